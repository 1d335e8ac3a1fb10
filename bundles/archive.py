"""Safe reading and writing of the bundle tar.

Layout (an uncompressed POSIX/pax tar; weights do not compress, and a plain tar hashes at disk speed):

    payload/<path>...                   every payload file, in manifest order
    manifest.json                       canonical JSON
    signatures.json                     {"signatures": [{"keyid": ..., "sig": ...}]}
    manifest.json.sigstore.json         optional sigstore bundle over manifest.json's bytes

Signing replaces only the trailing metadata members; the new bundle is written beside the old one (the payload
copied by the kernel, as a reflink where the filesystem can) and renamed over it.

Reading scans headers first (with the strict reader in tarscan.py, not tarfile) and refuses, before any data is
read: links, devices, directories and other non-regular members, absolute paths, `..` and odd names, duplicate
names, members that run past the end of the file, corrupt headers, and a missing end-of-archive marker. Data is
then read by offset only for regular members, through one fixed buffer, so memory stays flat for any file size.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from envex.bundles.errors import Check, VerificationError
from envex.bundles.files import commit_file, kind_of, os_reason, show, temp_beside
from envex.bundles.manifest import MAX_FILES, unsafe_path_reason
from envex.bundles.tarscan import BLOCK, Header, TarFormatError, scan_headers

MANIFEST = "manifest.json"
SIGNATURES = "signatures.json"
SIGSTORE = "manifest.json.sigstore.json"
METADATA = (MANIFEST, SIGNATURES, SIGSTORE)
TRAILING = (SIGNATURES, SIGSTORE)  # rewritten by signing; always after the manifest
PAYLOAD_PREFIX = "payload/"
MAX_METADATA_BYTES = {MANIFEST: 64 * 1024 * 1024, SIGNATURES: 1024 * 1024, SIGSTORE: 4 * 1024 * 1024}
MAX_MEMBERS = MAX_FILES + len(METADATA)
CHUNK = 4 * 1024 * 1024  # large reads keep hashing at memory-bandwidth speed; one buffer, reused
_REGULAR = (b"0", b"\0")


@dataclass(frozen=True)
class Member:
    """A regular member whose header passed every check: where its data lies in the archive file."""

    name: str
    size: int
    data_offset: int


def _malformed(path: Path, detail: str) -> VerificationError:
    return VerificationError(f"{show(path)}: {detail}", check=Check.MALFORMED_ARCHIVE)


_KINDS = {
    b"1": "hardlink",
    b"2": "symlink",
    b"3": "character device",
    b"4": "block device",
    b"5": "directory",
    b"6": "fifo",
    b"7": "contiguous file",
    b"S": "sparse file",
}


def _check_header(path: Path, header: Header) -> None:
    name = header.name
    # The kind first: a directory's name ends in "/", and a link is refused whatever it is called.
    if header.typeflag in (b"1", b"2"):
        raise VerificationError(
            f"{path}: member {name!r} is a {_KINDS[header.typeflag]} to {header.linkname!r}; "
            "bundles hold regular files only",
            check=Check.LINK_MEMBER,
        )
    if header.typeflag not in _REGULAR:
        kind = _KINDS.get(header.typeflag, f"member of type {header.typeflag!r}")
        raise VerificationError(
            f"{path}: member {name!r} is a {kind}; bundles hold regular files only", check=Check.SPECIAL_MEMBER
        )
    if name in METADATA:
        return
    if name.startswith(PAYLOAD_PREFIX):
        reason = unsafe_path_reason(name[len(PAYLOAD_PREFIX) :])
        if reason is not None:
            raise VerificationError(f"{path}: member {name!r}: {reason}", check=Check.UNSAFE_PATH)
        return
    reason = unsafe_path_reason(name)
    if reason is not None:
        raise VerificationError(f"{path}: member {name!r}: {reason}", check=Check.UNSAFE_PATH)
    raise VerificationError(f"{path}: member {name!r} is neither metadata nor under payload/", check=Check.UNKNOWN_FILE)


class BundleArchive:
    """An opened bundle whose member headers have all been checked. Use as a context manager."""

    def __init__(self, path: Path, handle: BinaryIO, members: dict[str, Member]) -> None:
        self.path = path
        self._handle = handle
        self.members = members

    @classmethod
    def open(cls, path: Path | str) -> BundleArchive:
        """Open and scan `path`; raises VerificationError naming the first unsafe or malformed thing."""
        path = Path(path)
        try:
            # stat first: a device is refused before it is opened (opening some has side effects).
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                raise _malformed(path, f"is {kind_of(info.st_mode)}, not a regular file")
            # O_NONBLOCK: a fifo swapped in since the stat must fail the check below, not hang the open.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as exc:
            raise _malformed(path, f"cannot open: {os_reason(exc)}") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise _malformed(path, f"is {kind_of(mode)}, not a regular file")
        handle = os.fdopen(fd, "rb")
        try:
            members = _scan(path, handle)
        except BaseException:
            handle.close()
            raise
        return cls(path, handle, members)

    def __enter__(self) -> BundleArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handle.close()

    def payload_members(self) -> dict[str, Member]:
        """Payload members keyed by their path under payload/."""
        n = len(PAYLOAD_PREFIX)
        return {name[n:]: m for name, m in self.members.items() if name.startswith(PAYLOAD_PREFIX)}

    def read_metadata(self, name: str) -> bytes | None:
        """The whole content of a metadata member, or None when absent; refused when over its size bound."""
        member = self.members.get(name)
        if member is None:
            return None
        limit = MAX_METADATA_BYTES[name]
        if member.size > limit:
            raise VerificationError(
                f"{self.path}: {name} is {member.size} bytes, over the {limit} byte limit", check=Check.SIZE
            )
        return b"".join(bytes(chunk) for chunk in self.stream(member))

    def stream(self, member: Member, buffer: bytearray | None = None) -> Iterator[memoryview]:
        """Yield the member's data in chunks of one reused buffer (valid until the next chunk)."""
        buf = buffer if buffer is not None else bytearray(min(CHUNK, max(member.size, 1)))
        view = memoryview(buf)
        remaining = member.size
        offset = member.data_offset
        fd = self._handle.fileno()
        while remaining > 0:
            want = min(remaining, len(buf))
            try:
                got = os.preadv(fd, [view[:want]], offset)
            except OSError as exc:
                raise _malformed(self.path, f"cannot read {member.name}: {exc.strerror}") from None
            if got <= 0:
                raise _malformed(self.path, f"truncated inside {member.name}")
            yield view[:got]
            offset += got
            remaining -= got

    def sha256(self, member: Member, buffer: bytearray | None = None) -> str:
        """Stream the member through sha256; memory is one buffer whatever the size."""
        digest = hashlib.sha256()
        for chunk in self.stream(member, buffer):
            digest.update(chunk)
        return digest.hexdigest()


def _scan(path: Path, handle: BinaryIO) -> dict[str, Member]:
    fd = handle.fileno()
    members: dict[str, Member] = {}
    try:
        for header in scan_headers(fd, os.fstat(fd).st_size, max_members=MAX_MEMBERS):
            _check_header(path, header)
            if header.name in members:
                raise VerificationError(f"{path}: member {header.name!r} appears twice", check=Check.DUPLICATE_MEMBER)
            members[header.name] = Member(header.name, header.size, header.data_offset)
    except TarFormatError as exc:
        raise _malformed(path, str(exc)) from None
    except OSError as exc:
        raise _malformed(path, f"cannot read: {exc.strerror}") from None
    return members


def member_info(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    """A deterministic header: regular file, mode 0644, owner root, fixed mtime."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = mtime
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def header_bytes(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def padding(size: int) -> bytes:
    return bytes(-size % BLOCK)


def write_member(out: BinaryIO, name: str, data: bytes, mtime: int) -> None:
    """Append one small member (metadata) at the current position."""
    out.write(header_bytes(member_info(name, len(data), mtime)))
    out.write(data)
    out.write(padding(len(data)))


def end_of_archive() -> bytes:
    return bytes(2 * BLOCK)


def rewrite_trailing(path: Path, members: dict[str, bytes], mtime: int) -> None:
    """Replace the trailing metadata members (signatures, sigstore); the payload bytes are kept as they are.

    The new bundle is written beside the old one and renamed over it, so a crash leaves the old bundle whole,
    with every signature it had. The payload is copied by the kernel: a reflink where the filesystem has them
    (btrfs, XFS: instant), else copy_file_range, which needs the bundle's size free for a moment.
    """
    real = Path(os.path.realpath(path))  # a link to the bundle keeps pointing at the signed file
    with BundleArchive.open(real) as archive:
        names = list(archive.members)
        if MANIFEST not in archive.members:
            raise VerificationError(f"{show(path)}: no manifest.json", check=Check.MISSING_FILE)
        after_manifest = names[names.index(MANIFEST) + 1 :]
        if any(n not in TRAILING for n in after_manifest):
            raise _malformed(path, "members after manifest.json other than signatures; not a bundle we built")
        manifest = archive.members[MANIFEST]
        cut = manifest.data_offset + manifest.size + len(padding(manifest.size))
        src_fd = archive._handle.fileno()
        before = os.fstat(src_fd)
        fd, tmp = temp_beside(real, what="bundle")
        try:
            with os.fdopen(fd, "wb") as out:
                _copy_prefix(src_fd, out.fileno(), cut)
                for name in TRAILING:
                    if name in members:
                        write_member(out, name, members[name], mtime)
                out.write(end_of_archive())
                out.flush()
                os.fchmod(out.fileno(), stat.S_IMODE(before.st_mode))
                os.fsync(out.fileno())
            now = os.stat(real, follow_symlinks=False)
            if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != (
                before.st_dev,
                before.st_ino,
                before.st_size,
                before.st_mtime_ns,
            ):
                raise _malformed(path, "changed while it was being signed; sign it again")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    commit_file(tmp, real, what="bundle", replace=True)


_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def _copy_prefix(src_fd: int, dst_fd: int, length: int) -> None:
    """Copy the first `length` bytes of `src_fd` into the empty `dst_fd`, leaving its position at `length`."""
    try:
        fcntl.ioctl(dst_fd, _FICLONE, src_fd)  # a reflink of the whole file, then cut to the payload
    except OSError:
        pass
    else:
        os.ftruncate(dst_fd, length)
        os.lseek(dst_fd, length, os.SEEK_SET)
        return
    offset = 0
    while offset < length:
        try:
            copied = os.copy_file_range(src_fd, dst_fd, length - offset, offset_src=offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            break  # no in-kernel copy here: read and write
        if copied <= 0:
            raise VerificationError("bundle: truncated while it was being copied", check=Check.MALFORMED_ARCHIVE)
        offset += copied
    while offset < length:
        chunk = os.pread(src_fd, min(CHUNK, length - offset), offset)
        if not chunk:
            raise VerificationError("bundle: truncated while it was being copied", check=Check.MALFORMED_ARCHIVE)
        os.write(dst_fd, chunk)  # a regular file: a short write only on a full disk, which raises
        offset += len(chunk)
