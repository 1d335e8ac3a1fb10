"""Run untrusted generated code against its unit tests: a subprocess with time, memory and file limits and no
network.

Isolation, in layers (each documented in offline_docs/gates.md):
1. `python -I` (no user site, no PYTHON* variables, script dir not on sys.path) with an environment of only PATH
   and LANG: no proxy settings, no HF variables leak in.
2. `resource.setrlimit` in the child before exec: CPU seconds, address space, file size, no core dumps; its own
   session, so a timeout kills the whole process group.
3. A network namespace of its own (`unshare -n`: only a downed loopback exists) where the kernel allows it; this
   is probed once per process and reported as `network_isolation`.
4. Always, as well: an audit hook installed by our harness before the candidate runs refuses socket connect,
   bind, sendto and name lookups, and process spawning, so the guard holds where namespaces are not allowed.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_HARNESS = r'''
import runpy, sys

_BLOCKED = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.gethostbyaddr", "subprocess.Popen", "os.system", "os.exec",
            "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "ctypes.dlopen")

def _guard(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")

sys.addaudithook(_guard)
runpy.run_path(sys.argv[1], run_name="__main__")
'''


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 4 * 2**20
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.cpu_seconds < 1 or self.memory_bytes < 64 * 2**20 or self.timeout_s <= 0:
            raise ValueError("SandboxLimits: need cpu_seconds >= 1, memory_bytes >= 64 MiB and timeout_s > 0")


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    returncode: int | None
    timed_out: bool
    network_isolation: str  # "netns+audit-hook" | "audit-hook"
    stderr_tail: str


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether `unshare -n` works here (root or unprivileged user namespaces); probed once."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _limit(limits: SandboxLimits) -> None:  # runs in the child between fork and exec
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, tests: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` followed by `tests` (plain asserts) in the sandbox; passed means exit status 0."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="envex-sandbox-") as tmp:
        work = Path(tmp)
        (work / "harness.py").write_text(_HARNESS, encoding="utf-8")
        (work / "candidate.py").write_text(f"{code}\n\n# ---- tests ----\n{tests}\n", encoding="utf-8")
        cmd = [sys.executable, "-I", str(work / "harness.py"), str(work / "candidate.py")]
        isolation = "audit-hook"
        if network_namespace_available():
            cmd = [shutil.which("unshare") or "unshare", "-n", *cmd]
            isolation = "netns+audit-hook"
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, preexec_fn=lambda: _limit(limits))
        try:
            _, err = proc.communicate(timeout=limits.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            timed_out = True
    tail = err.decode("utf-8", "replace")[-600:]
    rc = None if timed_out else proc.returncode
    return SandboxResult(passed=rc == 0, returncode=rc, timed_out=timed_out, network_isolation=isolation,
                         stderr_tail=tail)
