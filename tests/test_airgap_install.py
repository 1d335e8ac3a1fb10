"""The air-gapped install, end to end (verify/lab/airgap_install.py): media built here for the embedded model with
the complete CPU wheelhouse of this machine, then `sh MEDIA/install.sh` into an empty prefix inside `unshare -n`
(a network namespace with only a loopback), gated, activated, served as its unit file starts it, and asked a chat
with the official openai client. Minutes on two cores (two pip installs of the wheelhouse and the quick gates).

It needs a network namespace of its own: where the kernel refuses `unshare -n` (not root, no unprivileged user
namespaces) it is skipped, and only there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def unshare_refused() -> str | None:
    """Why `unshare -n true` fails here, or None when it works."""
    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux) on PATH"
    done = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, check=False, timeout=30)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_media_built_here_installs_gates_activates_and_answers_with_no_network(tmp_path: Path) -> None:
    why = unshare_refused()
    if why is not None:
        pytest.skip(f"`unshare -n true` fails here ({why}): the air-gapped install runs in a network namespace")
    out = tmp_path / "airgap"
    cmd = [sys.executable, "-P", "-m", "envex.verify.lab.airgap_install", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=2900)
    summary = json.loads((out / "summary.json").read_text())
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert summary["ok"] and "failed" not in summary
        steps = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("airgap: ") and " s  " in line]
        assert steps == ["keys", "build", "namespace", "install", "serve", "chat", "summary"], done.stdout

        # built here, for this machine: its python and the CPU build of its torch release, every wheel on the media
        host = summary["host"]
        assert host["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
        assert summary["build"]["wheels"] > 50 and summary["build"]["seconds"] > 0
        assert any(b.startswith("envex-runtime-") for b in summary["build"]["bundles"])

        # the namespace: a loopback and nothing else, no route, nothing outside answers
        ns = summary["namespace"]
        assert ns["interfaces"] == [{"name": "lo", "up": True}]
        assert ns["ipv4_routes"] == [] and ns["ipv6_routes_off_loopback"] == []
        assert ns["connect_1.1.1.1:443"] == "ENETUNREACH"
        assert ns["resolve_pypi.org"].startswith("gaierror")

        # the install in it: pip looked in the media's wheelhouse only and downloaded nothing; every step passed
        inst = summary["install"]
        assert inst["exit"] == 0 and inst["seconds"] > 0
        assert inst["pip_looked_in"] and all(
            line.startswith("Looking in links: ") and line.endswith("/runtime/wheelhouse")
            for line in inst["pip_looked_in"]
        )
        assert inst["pip_downloaded"] == []
        assert f"torch-{host['torch_version']}+cpu" in (out / "install.log").read_text()  # from the wheelhouse
        assert list(inst["steps"]) == ["verify", "probe", "plan", "install", "gates", "activate"]
        assert all(line.startswith("✓ ") for line in inst["steps"].values()), inst["steps"]

        # gates passed on this machine and the release is the active one
        release = inst["release"]
        assert release["status"] == "passed" and release["verdict"] == "pass"
        assert "installer.smoke" in release["gates"] and len(release["gates"]) >= 7
        assert set(release["gates"].values()) == {"pass"}
        state = json.loads((out / "prefix" / "state.json").read_text())
        assert state["active"] == release["active"] == (out / "prefix" / "current").resolve().name
        gates = json.loads(Path(release["report"]).read_text())
        assert gates["verdict"] == "pass" and gates["gates"] == release["gates"]
        # judged against the answers the build computed and signed into the model bundle (--reference signed)
        assert summary["build"]["references"] == "the quick suite (cpu-float32-torch)"
        assert release["reference"] == "signed" and gates["details"]["reference"]["origin"] == "signed"
        assert gates["details"]["verify.gates"]["reference_policy"] == "signed-cpu-float32-torch"

        # the activated release, started as its unit file starts it, answered over loopback
        assert summary["serve"]["url"] == "http://127.0.0.1:8000"
        assert summary["serve"]["command"].startswith(str(out / "prefix" / "current" / "venv" / "bin" / "envex"))
        assert summary["serve"]["environment"]["HF_HUB_OFFLINE"] == "1"
        assert summary["serve"]["exit_after_sigterm"] == 0
        assert "Paris" in summary["chat"]["answer"]
        assert summary["chat"]["client"].startswith("openai ")
    finally:
        for heavy in ("media", "prefix", "home"):  # about 1.5 GB: pytest keeps the last runs' tmp folders
            shutil.rmtree(out / heavy, ignore_errors=True)
