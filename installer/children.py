"""The installer's children (pip, the gate runner) die with it, and a re-run clears what a dead run left.

A SIGKILLed `envex-install` once left its gate runner running, orphaned, at full CPU (on a GPU, holding the memory
the re-run's gates need), and the re-run went ahead beside it. Now:

1. Each child runs in a session and process group of its own, with PR_SET_PDEATHSIG = SIGKILL set in the child
   before exec: the kernel kills it when the installer dies, however it dies. (If the installer died before the
   prctl took effect, the child sees a new parent and kills itself.)
2. The kernel does not extend that to grandchildren (compile workers, a sandboxed test), so while a child runs its
   group is recorded in `<prefix>/.children.json` (written under the prefix lock): the group id, the leader's start
   time (clock ticks since boot) and the boot id. The next install, once it holds the lock, kills every recorded
   group that is still alive and waits until it is gone (`kill_leftovers`). A group is touched only when it is
   provably ours: its leader alive with the recorded start time in the same boot, or its leader gone and members
   left (Linux never hands out a pid that is still some group's id, so they are the leader's).
3. When a child ends normally, whatever it left in its group is killed before the leader is reaped (the leader's
   zombie keeps the group id from being reused meanwhile).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from envex.bundles.files import read_regular_file
from envex.installer.fsutil import atomic_write

CHILDREN_FILE = ".children.json"
PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30.0  # a process in uninterruptible sleep (a GPU driver tearing down) may take a while to go


@dataclass(frozen=True)
class ChildGroup:
    pgid: int
    start: int  # the leader's start time in clock ticks since boot (/proc/<pid>/stat field 22)
    boot_id: str
    what: str


class LeftoverError(RuntimeError):
    """A process group left by a dead install would not die; the message says which and what to do."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start time) of a live pid, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[2]), int(fields[19])


def _members(pgid: int) -> list[int]:
    """The pids of living (not zombie) processes in process group `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _proc_stat(int(entry))
            if info is not None and info[1] == pgid and info[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


def _is_ours(group: ChildGroup) -> bool:
    if group.boot_id != _boot_id():
        return False  # pids from another boot mean nothing
    leader = _proc_stat(group.pgid)
    if leader is not None and leader[0] not in ("Z", "X"):
        return leader[2] == group.start and leader[1] == group.pgid
    return bool(_members(group.pgid))


def _record_path(prefix: Path) -> Path:
    return Path(prefix) / CHILDREN_FILE


def _load(prefix: Path) -> list[ChildGroup]:
    path = _record_path(prefix)
    if not os.path.lexists(path):
        return []
    try:
        data = json.loads(read_regular_file(path, max_bytes=1 << 20, what="children record"))
        return [ChildGroup(**item) for item in data["groups"]]
    except (OSError, ValueError, TypeError, KeyError):
        return []  # unreadable: nothing can be proven ours, so nothing is killed


def _save(prefix: Path, groups: list[ChildGroup]) -> None:
    path = _record_path(prefix)
    if groups:
        atomic_write(path, json.dumps({"groups": [asdict(g) for g in groups]}).encode())
    else:
        path.unlink(missing_ok=True)


def _stop_group(pgid: int, timeout: float = STOP_TIMEOUT_S) -> bool:
    """SIGKILL the group and wait until no living member is left; False when some survive `timeout`."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while _members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_leftovers(prefix: Path) -> list[str]:
    """Kill the process groups a dead install left running (see the module docstring); returns notes for people.

    Call with the prefix lock held, before anything that could compete with them starts.
    """
    notes = []
    for group in _load(prefix):
        if not _is_ours(group):
            continue
        try:
            stopped = _stop_group(group.pgid)
        except PermissionError:
            stopped = False
        if not stopped:
            raise LeftoverError(
                f"the {group.what} of an earlier install (process group {group.pgid}) would not stop; kill it "
                f"(kill -KILL -- -{group.pgid}) and run again"
            )
        notes.append(f"stopped the {group.what} left running by an earlier install (process group {group.pgid})")
    _save(prefix, [])
    return notes


def _tie_to_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the kernel SIGKILL the child when this process dies (Linux), or None elsewhere."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now: the child must not load anything
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the installer died before the prctl: it would never fire
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def run_tied(
    cmd: Sequence[str],
    *,
    what: str,
    env: dict[str, str],
    prefix: Path | None,
    log: IO[bytes] | None = None,
) -> tuple[int, str, str]:
    """Run `cmd` tied to this process (see the module docstring); returns (exit status, stdout, stderr).

    With `log`, stdout and stderr both go there and "" is returned for them; otherwise they are collected (in
    temp files, not pipes: the child is waited for without being reaped). `prefix` (held locked by the caller)
    records the child's group for a later run to clear.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code = _run_tied(cmd, what=what, env=env, prefix=prefix, stdout=log or out, stderr=log or err)
        if log is not None:
            return code, "", ""
        out.seek(0)
        err.seek(0)
        return code, out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")


def _run_tied(
    cmd: Sequence[str], *, what: str, env: dict[str, str], prefix: Path | None, stdout: IO[bytes], stderr: IO[bytes]
) -> int:
    proc = subprocess.Popen(
        list(cmd),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=env,
        start_new_session=True,
        preexec_fn=_tie_to_parent(),
    )
    pgid = proc.pid  # a session leader's pid is its group's id
    info = _proc_stat(pgid)
    group = ChildGroup(pgid=pgid, start=info[2] if info else 0, boot_id=_boot_id(), what=what)
    recorded = False
    try:
        if prefix is not None:
            _save(prefix, [*_load(prefix), group])
            recorded = True
        # Wait without reaping: the leader's zombie keeps its group id taken until the stragglers are killed.
        os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOWAIT)
    finally:
        _stop_group(pgid)
        code = proc.wait()
        if recorded and prefix is not None:
            _save(prefix, [g for g in _load(prefix) if g.pgid != pgid])
    return code
