"""Durable file operations: atomic replace with fsync, atomic symlink switch, and the installer's lock."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from pathlib import Path
from types import TracebackType

from envex.bundles.files import fsync_dir


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to `path` so that a reader (or a crash) sees the old bytes or the new, never a mix.

    Temp file beside the target, fsync, os.replace, fsync of the directory: the rename is the commit point.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def switch_symlink(link: Path, target: str) -> None:
    """Point `link` at `target` (a path relative to the link's directory) atomically: symlink a temp name, rename."""
    tmp = link.parent / f".{link.name}.tmp-{secrets.token_hex(6)}"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)


class LockHeldError(RuntimeError):
    """Another installer (or envex activate/rollback) holds the prefix's lock."""


class PrefixLock:
    """An exclusive flock on `<prefix>/.lock`, held for the whole install; the kernel drops it when we die."""

    def __init__(self, prefix: Path) -> None:
        self.path = Path(prefix) / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> PrefixLock:
        # The prefix must exist already: it is created only once every input has been checked (prefix.py).
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeldError(
                    f"{self.path} is held by another envex-install or envex command (pid {holder}); "
                    "wait for it to finish, then run again"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
