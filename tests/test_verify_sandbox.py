"""The coding gate's sandbox: tests pass and fail honestly, and the limits and the network guard hold."""

from __future__ import annotations

import pytest

from envex.verify.gate_coding import extract_code
from envex.verify.sandbox import SandboxLimits, network_namespace_available, run_python


def test_correct_code_passes_and_wrong_code_fails() -> None:
    ok = run_python("def add(a, b):\n    return a + b", "assert add(2, 3) == 5")
    assert ok.passed and ok.returncode == 0
    bad = run_python("def add(a, b):\n    return a - b", "assert add(2, 3) == 5")
    assert not bad.passed and "AssertionError" in bad.stderr_tail
    assert not run_python("def add(a, b) return", "assert add(1, 1) == 2").passed  # syntax error


def test_no_network_connection_or_name_lookup() -> None:
    for code in ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)",
                 "import socket\nsocket.getaddrinfo('example.com', 80)",
                 "import urllib.request\nurllib.request.urlopen('http://10.1.2.3/', timeout=2)"):
        res = run_python(code, "")
        assert not res.passed
        assert "sandbox: socket" in res.stderr_tail or "unreachable" in res.stderr_tail.lower()
    expected = "netns+audit-hook" if network_namespace_available() else "audit-hook"
    assert run_python("x = 1", "assert x == 1").network_isolation == expected


def test_no_subprocesses() -> None:
    res = run_python("import subprocess\nsubprocess.run(['true'])", "")
    assert not res.passed and "subprocess.Popen is not allowed" in res.stderr_tail


def test_cpu_time_wall_time_and_memory_limits() -> None:
    spin = run_python("while True:\n    pass", "", SandboxLimits(cpu_seconds=1, timeout_s=20))
    assert not spin.passed and spin.returncode is not None and spin.returncode < 0  # SIGXCPU/SIGKILL from RLIMIT_CPU
    sleep = run_python("import time\ntime.sleep(30)", "", SandboxLimits(timeout_s=1.5))
    assert not sleep.passed and sleep.timed_out
    hog = run_python("x = bytearray(2 * 1024**3)", "", SandboxLimits(memory_bytes=256 * 2**20))
    assert not hog.passed and "MemoryError" in hog.stderr_tail


def test_environment_is_clean() -> None:
    res = run_python("import os", "assert set(os.environ) <= {'PATH', 'LANG', 'LC_CTYPE'}, sorted(os.environ)")
    assert res.passed, res.stderr_tail


def test_limits_validate() -> None:
    with pytest.raises(ValueError, match="SandboxLimits"):
        SandboxLimits(cpu_seconds=0)


def test_extract_code() -> None:
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n") == "x = 1\n"  # an unclosed fence (cut by max_tokens)
    assert extract_code("def g(): pass") == "def g(): pass"
