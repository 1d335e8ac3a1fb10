"""A strict, bounded reader of tar headers: only what a bundle needs, every field checked.

Python's `tarfile` is built to be lenient, which is the wrong default for untrusted media: it treats a header
with a bad checksum as the end of the archive, reads pax and GNU extension data of any declared size into
memory, and expands GNU sparse maps of any length. This reader accepts POSIX ustar headers (and the GNU magic,
for hand-made archives) plus pax extended headers (`x`) of at most 64 KiB carrying `path`, `linkpath`, `size`
and harmless metadata. Everything else — global pax headers, GNU long-name and sparse extensions, unknown pax
keywords, bad checksums, non-octal numbers, data past the end of the file, a missing end-of-archive — is
refused. It only reads headers (with `pread`); it never reads member data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

BLOCK = 512
MAX_PAX_BYTES = 64 * 1024
_ZERO = bytes(BLOCK)
_MAGICS = (b"ustar\x0000", b"ustar  \x00")  # POSIX ustar; GNU (accepted for the header layout only)
# pax keywords that carry no meaning for a bundle and may be ignored; `path`, `linkpath` and `size` are applied.
_IGNORED_PAX = frozenset(
    {"mtime", "atime", "ctime", "uid", "gid", "uname", "gname", "hdrcharset", "comment", "charset"}
)
_APPLIED_PAX = frozenset({"path", "linkpath", "size"})
_DECIMAL = re.compile(r"[0-9]{1,20}")


class TarFormatError(ValueError):
    """The bytes are not a tar archive this reader accepts; the message says where and why."""


@dataclass(frozen=True)
class Header:
    """One member's header, after any pax extended header was applied."""

    name: str
    typeflag: bytes  # one byte: b"0" or b"\0" regular, b"1" hardlink, b"2" symlink, b"5" directory, ...
    size: int
    linkname: str
    data_offset: int


def _number(field: bytes, what: str, at: int) -> int:
    if field[:1] == b"\x80":  # GNU base-256, positive
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text or any(c not in b"01234567" for c in text):
        raise TarFormatError(f"header at byte {at}: {what} field {field!r} is not an octal number")
    return int(text, 8)


def _text(field: bytes, what: str, at: int) -> str:
    raw = field.split(b"\0", 1)[0]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TarFormatError(f"header at byte {at}: {what} is not UTF-8") from None


def _pax_records(data: bytes, at: int) -> dict[str, str]:
    # POSIX pax: records "<length> <keyword>=<value>\n", where length counts the whole record.
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 20)
        if space < 0 or not data[pos:space].isdigit():
            raise TarFormatError(f"pax header at byte {at}: malformed record length")
        length = int(data[pos:space])
        end = pos + length
        if length < 5 or end > len(data) or data[end - 1 : end] != b"\n":
            raise TarFormatError(f"pax header at byte {at}: record length {length} does not fit")
        keyword, sep, value = data[space + 1 : end - 1].partition(b"=")
        if not sep:
            raise TarFormatError(f"pax header at byte {at}: record without '='")
        try:
            key, text = keyword.decode("utf-8"), value.decode("utf-8")
        except UnicodeDecodeError:
            raise TarFormatError(f"pax header at byte {at}: record is not UTF-8") from None
        if key in records:
            raise TarFormatError(f"pax header at byte {at}: keyword {key!r} given twice")
        if key.startswith("GNU.sparse"):
            records["GNU.sparse"] = text  # reported as a sparse member by the caller
        elif key not in _APPLIED_PAX and key not in _IGNORED_PAX:
            raise TarFormatError(f"pax header at byte {at}: unsupported keyword {key!r}")
        records[key] = text
        pos = end
    return records


def _parse_block(block: bytes, at: int) -> tuple[str, bytes, int, str]:
    stored = _number(block[148:156], "checksum", at)
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b > 127)  # old tars summed signed chars
    if stored not in (unsigned, signed):
        raise TarFormatError(f"header at byte {at}: checksum mismatch")
    if block[257:265] not in _MAGICS:
        raise TarFormatError(f"header at byte {at}: no ustar magic")
    name = _text(block[0:100], "name", at)
    prefix = _text(block[345:500], "prefix", at) if block[257:265] == _MAGICS[0] else ""
    if prefix:
        name = f"{prefix}/{name}"
    return name, block[156:157], _number(block[124:136], "size", at), _text(block[157:257], "linkname", at)


def scan_headers(fd: int, file_size: int, *, max_members: int) -> Iterator[Header]:
    """Yield every member header of the tar open at `fd`; raise TarFormatError at the first malformed thing."""
    offset = 0
    pax: dict[str, str] | None = None
    pax_start = 0
    count = 0
    while True:
        block = os.pread(fd, BLOCK, offset)
        if len(block) < BLOCK:
            if offset == 0:
                raise TarFormatError("shorter than one tar header (not a tar archive)")
            raise TarFormatError(f"truncated: no end-of-archive marker at byte {offset}")
        if block == _ZERO:
            if pax is not None:
                raise TarFormatError(f"truncated: pax header at byte {pax_start} is followed by the end")
            return
        try:
            name, typeflag, size, linkname = _parse_block(block, offset)
        except TarFormatError as exc:
            raise TarFormatError(f"{'not a tar archive' if offset == 0 else 'corrupt member header'}: {exc}") from None
        data_offset = offset + BLOCK
        if typeflag == b"x":
            if pax is not None:
                raise TarFormatError(f"pax header at byte {offset} follows another pax header")
            if size > MAX_PAX_BYTES:
                raise TarFormatError(f"pax header at byte {offset} declares {size} bytes, over {MAX_PAX_BYTES}")
            data = os.pread(fd, size, data_offset)
            if len(data) < size:
                raise TarFormatError(f"truncated: pax header at byte {offset} runs past the end of the file")
            pax, pax_start = _pax_records(data, offset), offset
            offset = data_offset + size + (-size % BLOCK)
            continue
        if typeflag in (b"g", b"L", b"K"):
            kind = {b"g": "global pax header", b"L": "GNU long name", b"K": "GNU long link name"}[typeflag]
            raise TarFormatError(f"header at byte {offset}: {kind} (not written by envex; refused)")
        if pax is not None:
            name = pax.get("path", name)
            linkname = pax.get("linkpath", linkname)
            if "size" in pax:
                if not _DECIMAL.fullmatch(pax["size"]):  # str.isdigit() would take "²"
                    raise TarFormatError(f"pax header at byte {pax_start}: size {pax['size']!r} is not a number")
                size = int(pax["size"])
            if "GNU.sparse" in pax:
                typeflag = b"S"
        has_data = typeflag in (b"0", b"\0", b"7", b"S")  # hardlinks, symlinks, devices and dirs carry none
        end = data_offset + (size if has_data else 0)
        if end > file_size:
            raise TarFormatError(f"truncated: member {name!r} runs past the end of the file")
        count += 1
        if count > max_members:
            raise TarFormatError(f"more than {max_members} members")
        yield Header(name, typeflag, size if has_data else 0, linkname, data_offset)
        pax = None
        offset = end + (-end % BLOCK)
