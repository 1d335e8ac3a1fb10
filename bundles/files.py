"""Reading and writing the files a person names, so that no path can make Envex hang, eat memory or replace
what it should not.

Reading (`read_regular_file`): every file the product reads whole (trust roots, keys, sigstore bundles,
launch.json, state.json, cards, the admin token, gate reports, model configs) is stat'ed first, so that a device
is refused before it is even opened (opening some devices has side effects), opened once with O_NONBLOCK (a FIFO
cannot block the open), fstat'ed again (the file checked is the file read), required to be a regular file, and read
up to a cap that is checked both against its size and while reading (a file growing under us). Symlinks are
followed: operators link keys and roots, and the target is held to the same rules; a symlink loop is reported as
one.

Writing (`write_file`, `commit_file`): a temp file beside the target, fsync, then a rename, so that a crash leaves
the old file or the new one. The target must be absent, or a regular file when replacing was asked for: never a
device, FIFO, socket, directory or symlink (a rename would replace the node itself; as root, /dev/full became a
regular file that way). Without `replace`, the new file is linked into place, which fails atomically when the name
was taken in the meantime.

Errors are `FileProblem`, an OSError whose str() is one line for people: which input, what was wrong, what to
do. `show()` renders any path on one line (control characters and undecodable bytes escaped as repr does).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

_MAX_SHOWN = 300  # characters of a path shown in a message; the middle of a longer one is elided


class FileProblem(OSError):
    """A file or directory cannot be used as given; str() is one line naming it, the problem and what to do."""

    def __init__(self, message: str, *, code: int | None = None, path: Path | str | None = None) -> None:
        super().__init__(code or errno.EINVAL, message)
        self.message = message
        self.path = None if path is None else str(path)

    def __str__(self) -> str:
        return self.message


def one_line(text: str) -> str:
    """`text` with every non-printable character (newline, tab, escape, an undecodable byte) escaped as repr
    escapes it, so that a message is always one line and always encodable."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def show(path: Path | str | bytes) -> str:
    """A path for a message: one line (see `one_line`), its middle elided when very long."""
    text = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    text = one_line(text)
    if len(text) > _MAX_SHOWN:
        text = f"{text[:200]}…({len(text)} characters)…{text[-80:]}"
    return text


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
)


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words ("a regular file", "a FIFO", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def os_reason(exc: OSError) -> str:
    """Why an OS call on a path failed, in words that say what to do."""
    code = exc.errno
    if code == errno.ENOENT:
        return "does not exist"
    if code == errno.ELOOP:
        return "is a symlink loop (too many levels of symbolic links); fix or remove the link"
    if code == errno.ENAMETOOLONG:
        return "the path is too long for the filesystem; give a shorter one"
    if code == errno.ENOTDIR:
        return "a component of the path is not a directory"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied; run as a user who may access it"
    if code == errno.EROFS:
        return "is on a read-only filesystem; give a writable location"
    if code == errno.ENOSPC:
        return "no space left on the device; free some space"
    if code == errno.EISDIR:
        return "is a directory"
    return (exc.strerror or str(exc)).rstrip(".").lower()


def problem(what: str, path: Path | str, reason: str, code: int | None = None) -> FileProblem:
    """A FileProblem reading `<what> <path>: <reason>`."""
    return FileProblem(f"{what} {show(path)}: {reason}", code=code, path=path)


def from_os_error(what: str, path: Path | str, exc: OSError) -> FileProblem:
    if isinstance(exc, FileProblem):
        return exc
    return problem(what, path, os_reason(exc), exc.errno)


def stat_or_none(path: Path | str, *, what: str, follow_symlinks: bool = True) -> os.stat_result | None:
    """os.stat (or lstat) of `path`, None when nothing is there; any other failure (a loop, a path too long, a
    file where a directory should be, no permission) is a FileProblem naming it."""
    try:
        return os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise from_os_error(what, path, exc) from None


def require_directory(path: Path | str, *, what: str) -> Path:
    """`path` if it is an existing directory (links followed); else a FileProblem saying what it is instead."""
    info = stat_or_none(path, what=what)
    if info is None:
        raise problem(what, path, "does not exist", errno.ENOENT)
    if not stat.S_ISDIR(info.st_mode):
        raise problem(what, path, f"is {kind_of(info.st_mode)}, not a directory", errno.ENOTDIR)
    return Path(path)


def require_exists(path: Path | str, *, what: str) -> Path:
    """`path` if something is there (links followed); a missing path, a loop or a path too long is a FileProblem."""
    if stat_or_none(path, what=what) is None:
        raise problem(what, path, "does not exist", errno.ENOENT)
    return Path(path)


def read_regular_file(path: Path | str, *, max_bytes: int, what: str) -> bytes:
    """The whole content of the regular file `path`, at most `max_bytes`; FileProblem for anything else.

    Refused, each with one line: a path that does not exist, a symlink loop, a path too long, a directory, a
    FIFO, a socket or a device (refused before it is opened), a file over `max_bytes` (by its size, so a huge
    sparse file costs nothing, and again while reading, for a file that grows), and any read error.
    """
    info = stat_or_none(path, what=what)
    if info is None:
        raise problem(what, path, "does not exist", errno.ENOENT)
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(what, path, info.st_mode)
    try:
        # O_NONBLOCK: if the name was swapped for a FIFO since the stat, the open still returns at once.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise from_os_error(what, path, exc) from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise _not_regular(what, path, opened.st_mode)
        if opened.st_size > max_bytes:
            raise _too_large(what, path, opened.st_size, max_bytes)
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - total, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise _too_large(what, path, total, max_bytes, growing=True)
        return b"".join(chunks)
    except FileProblem:
        raise
    except OSError as exc:
        raise from_os_error(what, path, exc) from None
    finally:
        os.close(fd)


def _not_regular(what: str, path: Path | str, mode: int) -> FileProblem:
    return problem(what, path, f"is {kind_of(mode)}, not a regular file; give the path of the file itself")


def _too_large(what: str, path: Path | str, size: int, limit: int, *, growing: bool = False) -> FileProblem:
    how = "grew past" if growing else f"is {size:,} bytes, over"
    return problem(what, path, f"{how} the {limit:,}-byte limit for a {what}; is this the right file?", errno.EFBIG)


def check_target(path: Path | str, *, what: str, replace: bool) -> None:
    """Refuse to write `path` unless it is absent, or a regular file and `replace` is set.

    A device, FIFO, socket, directory or symlink is never replaced (rename would swap the node itself); an
    existing file without `replace` is refused with a hint to pass --force. The parent must be a directory.
    """
    parent = Path(path).parent
    require_directory(parent, what=f"directory of the {what}")
    info = stat_or_none(path, what=what, follow_symlinks=False)
    if info is None:
        return
    if not stat.S_ISREG(info.st_mode):
        raise problem(
            what, path, f"exists and is {kind_of(info.st_mode)}; refusing to replace it: give the path of a new file"
        )
    if not replace:
        raise problem(what, path, "already exists; refusing to overwrite it (pass --force to replace it)",
                      errno.EEXIST)


def temp_beside(path: Path | str, *, what: str, mode: int = 0o600) -> tuple[int, Path]:
    """A new, exclusive temp file in the target's directory (so the final rename stays on one filesystem)."""
    path = Path(path)
    tmp = path.parent / f".{path.name[:200]}.{secrets.token_hex(6)}.partial"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise from_os_error(f"directory of the {what}", path.parent, exc) from None
    return fd, tmp


def commit_file(tmp: Path, target: Path | str, *, what: str, replace: bool) -> None:
    """Move the complete, fsynced `tmp` to `target` (see `check_target`); `tmp` is gone afterwards either way."""
    target = Path(target)
    try:
        check_target(target, what=what, replace=replace)
        if replace:
            os.replace(tmp, target)
        else:
            _link_new(tmp, target, what=what)
        fsync_dir(target.parent)
    except OSError as exc:
        raise from_os_error(what, target, exc) from None
    finally:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, target: Path, *, what: str) -> None:
    try:
        os.link(tmp, target)  # fails with EEXIST if the name was taken since check_target: never overwrites
    except FileExistsError:
        raise problem(what, target, "already exists; refusing to overwrite it (pass --force to replace it)",
                      errno.EEXIST) from None
    except OSError as exc:
        # Filesystems without hard links (FAT, exFAT: removable media): the check just made, then a rename.
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
        check_target(target, what=what, replace=False)
        os.rename(tmp, target)


def write_file(path: Path | str, data: bytes, *, what: str, mode: int = 0o644, replace: bool) -> Path:
    """Write `data` to `path` durably and atomically (temp file beside it, fsync, rename); see `check_target`."""
    path = Path(path)
    check_target(path, what=what, replace=replace)  # before the temp file: say no before writing anything
    fd, tmp = temp_beside(path, what=what, mode=mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)  # exact, whatever the umask
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit_file(tmp, path, what=what, replace=replace)
    return path


def fsync_dir(path: Path | str) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
