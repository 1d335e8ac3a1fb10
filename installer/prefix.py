"""What may be an appliance prefix: a directory of Envex's own, checked before anything is written there.

`envex-install --prefix /` was once accepted and scattered state.json, releases/ and admin/token.json over `/`. A
prefix must now be a dedicated directory: not `/`, not a system directory (/usr, /etc, /home itself, ...), nothing
under /proc, /sys or /dev, not the user's home directory itself; and, when it exists, empty or already an Envex
prefix. `check_prefix` only looks (stat, listdir): nothing is created until every input has been checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from envex.bundles.files import FileProblem, kind_of, os_reason, show

STATE_FILE = "state.json"
LOCK_FILE = ".lock"
# What Envex itself puts in a prefix (offline_docs/install.md, "The prefix"); a directory holding only these, or
# holding state.json or the lock, is an Envex prefix.
ENVEX_ENTRIES = frozenset(
    {STATE_FILE, LOCK_FILE, "trust", "releases", "reports", "bundles", "admin", "current", "envex.service", ".demo",
     ".children.json"}
)
# Temp names of atomic writes (fsutil.atomic_write, switch_symlink, bundles.files), left behind by a crash.
_TEMP_MARKERS = (".tmp-", ".partial")

# Directories that are never a prefix themselves (a dedicated directory inside one, e.g. /opt/envex, is fine).
SYSTEM_DIRS = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt",
     "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/usr/bin", "/usr/include",
     "/usr/lib", "/usr/lib64", "/usr/libexec", "/usr/local", "/usr/local/bin", "/usr/local/lib", "/usr/sbin",
     "/usr/share", "/usr/src", "/var", "/var/cache", "/var/lib", "/var/log", "/var/tmp", "/var/spool"}
)
# Kernel pseudo-filesystems: nothing under them can hold an appliance.
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


class PrefixError(ValueError):
    """The --prefix cannot be an appliance prefix; the message is one line: which path, why, what to do."""


def _refuse(prefix: Path | str, reason: str) -> PrefixError:
    return PrefixError(f"--prefix {show(prefix)}: {reason}")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_prefix(prefix: Path | str, *, must_exist: bool) -> Path:
    """The prefix as an absolute path once it passes every rule above; raises PrefixError. Creates nothing.

    `must_exist`: for status, activate and rollback, which have nothing to do in a prefix that is not there.
    """
    try:
        absolute = Path(os.path.abspath(prefix))
    except (ValueError, OSError) as exc:  # ValueError: a NUL byte
        raise _refuse(prefix, f"not a usable path ({exc})") from None
    real = os.path.realpath(absolute)  # a link to / or to /usr is refused like / or /usr
    home = os.path.realpath(os.path.expanduser("~"))
    for candidate in {str(absolute), real}:
        if candidate in SYSTEM_DIRS or any(_under(candidate, root) for root in PSEUDO_ROOTS):
            raise _refuse(
                prefix, "is a system directory; give a directory of Envex's own, e.g. /opt/envex or /srv/envex"
            )
        if candidate == home:
            raise _refuse(prefix, "is your home directory itself; give a directory of its own, e.g. ~/envex")
    try:
        info = os.stat(absolute)
    except FileNotFoundError:
        if must_exist:
            raise _refuse(prefix, "does not exist; nothing is installed there (envex-install creates it)") from None
        return absolute
    except OSError as exc:
        raise _refuse(prefix, os_reason(exc)) from None
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(prefix, f"is {kind_of(info.st_mode)}, not a directory")
    foreign = _foreign_entry(absolute)
    if foreign is not None:
        raise _refuse(
            prefix,
            f"holds {show(foreign)}, which Envex did not put there; give an empty or new directory, or an existing "
            "Envex prefix",
        )
    if must_exist and not os.path.lexists(absolute / STATE_FILE):
        raise _refuse(prefix, f"has no {STATE_FILE}; nothing is installed there (run envex-install --prefix first)")
    return absolute


def is_envex_prefix(prefix: Path) -> bool:
    """Whether `prefix` already holds an install's record or lock."""
    return any(os.path.lexists(prefix / name) for name in (STATE_FILE, LOCK_FILE))


def _foreign_entry(prefix: Path) -> str | None:
    """The first entry of `prefix` that Envex would not have made, or None (also when it is an Envex prefix)."""
    if is_envex_prefix(prefix):
        return None
    try:
        with os.scandir(prefix) as entries:
            for entry in entries:
                name = entry.name
                if name in ENVEX_ENTRIES or (name.startswith(".") and any(m in name for m in _TEMP_MARKERS)):
                    continue
                return name
    except OSError as exc:
        raise _refuse(prefix, os_reason(exc)) from None
    return None


def create_prefix(prefix: Path) -> None:
    """Create the (checked) prefix directory; one line naming the path when the filesystem refuses."""
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _refuse(prefix, f"cannot create it: {os_reason(exc)}") from None
    if not prefix.is_dir():  # mkdir(exist_ok) accepts a link to a directory only
        raise _refuse(prefix, "is not a directory")


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError escaping a command: the file it names, and why."""
    if isinstance(exc, FileProblem):
        return str(exc)
    where = exc.filename if exc.filename is not None else None
    reason = os_reason(exc)
    return f"{show(where)}: {reason}" if where is not None else reason

