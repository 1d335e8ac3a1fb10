"""End to end, the real thing: signed demo media from the embedded model, `install.sh` from the media into a temp
prefix, the real quick gates, `current` active, the release's own `envex serve --launch` answering the official
openai client ("Paris"); a newer release whose gates fail leaves it serving; a newer release that passes becomes
active and serves, with the old one kept; rollback works; the old media is then refused by the high-water mark.
Every Python process runs under the network guard (a generated sitecustomize.py), which must record nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from envex.installer.activate import current_target
from envex.installer.demo import build_demo_media, build_envex_wheel, source_root
from envex.installer.state import load_state
from envex.tests.support import installer as itest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

if source_root() is None:
    pytest.skip("needs the envex source tree to build the wheel", allow_module_level=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def start_server(prefix: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    envex = prefix / "current" / "venv" / "bin" / "envex"
    cmd = [str(envex), "serve", "--launch", str(prefix / "current" / "launch.json"), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited {proc.returncode}: {log.read_text()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server did not come up: {log.read_text()[-2000:]}")


def ask_capital(url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def test_demo_media_install_serve_upgrade_rollback(tmp_path):
    env, record = itest.guarded_env(tmp_path, {"PYTHON": sys.executable})
    wheel = build_envex_wheel(tmp_path / "wheel")
    keys = tmp_path / "keys"
    v1 = build_demo_media(tmp_path / "media-1", keys, runtime_version="0.1.0", model_version="1.0.0", wheel=wheel)
    prefix = tmp_path / "prefix"

    # 1. first install from the media's own bootstrap, real gates, no benchmark to keep CI short
    done = run(
        [
            "sh",
            str(v1.media / "install.sh"),
            "--prefix",
            str(prefix),
            "--trust-fingerprint",
            v1.fingerprint,
            "--no-bench",
        ],
        env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for step in ("verify", "probe", "plan", "install", "gates", "activate"):
        assert f"✓ {step}" in done.stdout
    state = load_state(prefix)
    first = state.active
    assert first is not None and current_target(prefix) == first
    checks = state.release(first).checks
    assert checks is not None and checks.verdict == "pass" and "installer.smoke" in checks.gates
    launch = json.loads((prefix / "current" / "launch.json").read_text())
    assert launch["gates"]["verdict"] == "pass" and launch["model"]["bundle"]["version"] == "1.0.0"
    # the deterministic mode is off unless asked for (envex-install --deterministic): the gate reports, not requires
    assert launch["engine"]["deterministic"] is False and checks.gates["verify.batch_invariance"] == "pass"
    report = json.loads((prefix / checks.report).read_text())
    invariance = next(g for g in report["details"]["verify.gates"]["gates"] if g["name"] == "batch_invariance")
    assert invariance["thresholds"]["required"] is False, invariance["summary"]
    assert (prefix / "envex.service").read_text().count("current/launch.json") == 1

    server, url = start_server(prefix, env, tmp_path / "server-1.log")
    try:
        assert "Paris" in ask_capital(url)

        # 2. a newer release whose gates fail: refused, the running release keeps serving
        v2 = build_demo_media(tmp_path / "media-2", keys, runtime_version="0.2.0", model_version="1.1.0", wheel=wheel)
        fail_report = tmp_path / "fail.json"
        fail_report.write_text(json.dumps(itest.FAIL_REPORT))
        install_cmd = [
            str(prefix / "current" / "venv" / "bin" / "envex-install"),
            "--media",
            str(v2.media),
            "--prefix",
            str(prefix),
            "--no-bench",
        ]
        done = run(install_cmd, {**env, "ENVEX_TEST_GATES_REPORT": str(fail_report)})
        assert done.returncode == 1 and "gates: 1 failed" in done.stderr
        assert load_state(prefix).active == first and current_target(prefix) == first
        assert "Paris" in ask_capital(url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)

    # 3. the newer release passes (its gate report injected: the real gates ran on the first install, and running
    #    them twice would double this test's time): it becomes active and serves, the first stays for rollback
    pass_report = tmp_path / "pass.json"
    pass_report.write_text(json.dumps(itest.PASS_REPORT))
    done = run(install_cmd, {**env, "ENVEX_TEST_GATES_REPORT": str(pass_report)})
    assert done.returncode == 0, done.stdout + done.stderr
    state = load_state(prefix)
    second = state.active
    assert second != first and current_target(prefix) == second
    assert state.high_water == {"envex-runtime": "0.2.0", "smollm2-135m-instruct": "1.1.0"}
    assert (prefix / "releases" / first / "launch.json").is_file()
    server, url = start_server(prefix, env, tmp_path / "server-2.log")
    try:
        assert "Paris" in ask_capital(url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)

    # 4. rollback to the first; the high-water mark still refuses the old media
    rollback = "from envex.installer.cli import rollback; import typer; typer.run(rollback)"
    done = run([sys.executable, "-c", rollback, "--prefix", str(prefix)], env)
    assert done.returncode == 0, done.stderr
    state = load_state(prefix)
    assert state.active == first and current_target(prefix) == first
    assert state.high_water["smollm2-135m-instruct"] == "1.1.0"
    done = run([sys.executable, "-m", "envex.installer.cli", "--media", str(v1.media), "--prefix", str(prefix)], env)
    assert done.returncode == 1 and "older than version" in done.stdout

    assert itest.violations(record) == [], "a non-loopback connection or name lookup was attempted"
    # and the guard was really there, in the release's own interpreter too (gates and server ran under it)
    probe = "import socket\ntry: socket.getaddrinfo('example.invalid', 443)\nexcept OSError: pass"
    run([str(prefix / "current" / "venv" / "bin" / "python"), "-c", probe], env)
    assert [v["kind"] for v in itest.violations(record)] == ["getaddrinfo"]
