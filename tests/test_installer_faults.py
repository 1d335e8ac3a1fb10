"""Fault injection: the installer killed (SIGKILL) before each step, a full disk, a corrupt bundle, the media
pulled out mid-install, a failing gate. Each time the previous release stays active, state.json stays valid,
and running the install again succeeds. Everything runs under the network guard, which must record nothing.

These use a fake model (a few bytes) and injected gate reports (ENVEX_TEST_GATES_REPORT), so each install takes
a few seconds; serving through a fault with the real model and real gates is in test_installer_e2e.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from envex.bundles import load_private_key, make_demo_trust
from envex.installer.activate import current_target
from envex.installer.state import load_state
from envex.installer.ui import PAUSE_MARKER, STEPS
from envex.tests.support import installer as itest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Demo trust, tiny wheels, media for versions 1.0.0 .. 1.3.0, a guarded environment."""
    tmp = tmp_path_factory.mktemp("faults")
    trust = make_demo_trust(tmp / "keys", expires=datetime.now(UTC) + timedelta(days=30))
    key = load_private_key(trust.key_path)
    wheels = itest.build_tiny_wheels(tmp / "wheels")
    media = {}
    for minor in range(4):
        version = f"1.{minor}.0"
        media[version] = itest.fake_media(
            tmp / f"media-{version}", trust.root_path, key, tmp / f"src-{version}", wheels=wheels, model_version=version
        )
    gates = tmp / "gates"
    gates.mkdir()
    (gates / "pass.json").write_text(json.dumps(itest.PASS_REPORT))
    (gates / "fail.json").write_text(json.dumps(itest.FAIL_REPORT))
    env, record = itest.guarded_env(tmp, {"ENVEX_TEST_GATES_REPORT": str(gates / "pass.json")})
    yield {"tmp": tmp, "trust": trust, "media": media, "env": env, "gates": gates}
    assert itest.violations(record) == [], "a non-loopback connection or lookup was attempted"


def installer(world, version: str, prefix: Path, **env_extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "envex.installer.cli",
        "--media",
        str(world["media"][version]),
        "--prefix",
        str(prefix),
        "--trust-fingerprint",
        world["trust"].fingerprint,
        "--yes",
    ]
    return subprocess.Popen(
        cmd,
        env={**world["env"], **env_extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def install(world, version: str, prefix: Path, **env_extra: str) -> subprocess.CompletedProcess:
    proc = installer(world, version, prefix, **env_extra)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def active_model_version(prefix: Path) -> str:
    state = load_state(prefix)  # raises if state.json is not intact
    release = state.release(state.active)
    assert release is not None and release.status == "passed"
    assert current_target(prefix) == state.active, "`current` disagrees with state.json"
    assert (prefix / "current" / "launch.json").is_file()
    return next(b.version for b in release.bundles if b.kind == "model")


def wait_for_marker(proc: subprocess.Popen, step: str) -> None:
    """Read until the installer announces the pause, then wait until it has really stopped (SIGSTOP)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == f"{PAUSE_MARKER} {step}":
            break
    else:
        raise AssertionError(f"installer ended (exit {proc.wait()}) before reaching {step}: {proc.stderr.read()}")
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the installer did not stop itself"
        time.sleep(0.01)


@pytest.fixture
def prefix(world):
    path = world["tmp"] / f"prefix-{uuid.uuid4().hex[:8]}"
    done = install(world, "1.0.0", path)
    assert done.returncode == 0, done.stderr
    assert active_model_version(path) == "1.0.0"
    return path


def test_killed_before_each_step_keeps_the_previous_release(world, prefix):
    for step in STEPS:
        proc = installer(world, "1.1.0", prefix, ENVEX_TEST_PAUSE_AT=step)
        wait_for_marker(proc, step)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert active_model_version(prefix) == "1.0.0", f"killed before {step}"
    # a run killed inside gates left a slot 'gating': the next run abandons and removes it, then succeeds
    done = install(world, "1.1.0", prefix)
    assert done.returncode == 0, done.stderr
    assert active_model_version(prefix) == "1.1.0"
    state = load_state(prefix)
    assert {r.status for r in state.releases} <= {"passed", "abandoned"}
    on_disk = sorted(p.name for p in (prefix / "releases").iterdir())
    assert on_disk == sorted(r.id for r in state.releases if r.status == "passed")


def test_killed_inside_the_copy_keeps_the_previous_release(world, prefix):
    proc = installer(world, "1.1.0", prefix, ENVEX_TEST_PAUSE_AT="install")
    wait_for_marker(proc, "install")
    os.killpg(proc.pid, signal.SIGCONT)
    time.sleep(0.5)  # let it run into the copy / venv creation, then kill the whole process group
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert active_model_version(prefix) == "1.0.0"
    assert install(world, "1.1.0", prefix).returncode == 0
    assert active_model_version(prefix) == "1.1.0"


def test_corrupt_bundle_on_the_media(world, prefix):
    bad = world["tmp"] / f"media-bad-{uuid.uuid4().hex[:6]}"
    shutil.copytree(world["media"]["1.2.0"], bad)
    bundle = next(bad.glob("bundles/fake-model-*.envex"))
    data = bytearray(bundle.read_bytes())
    data[600] ^= 0x40
    bundle.write_bytes(bytes(data))
    world["media"]["bad"] = bad
    done = install(world, "bad", prefix)
    assert done.returncode == 1
    assert "failed verification [digest]" in done.stderr
    assert active_model_version(prefix) == "1.0.0"
    assert install(world, "1.2.0", prefix).returncode == 0
    assert active_model_version(prefix) == "1.2.0"


def test_media_pulled_out_after_verification(world, prefix):
    pulled = world["tmp"] / f"media-pulled-{uuid.uuid4().hex[:6]}"
    shutil.copytree(world["media"]["1.2.0"], pulled)
    world["media"]["pulled"] = pulled
    proc = installer(world, "pulled", prefix, ENVEX_TEST_PAUSE_AT="install")
    wait_for_marker(proc, "install")
    bundle = next(pulled.glob("bundles/fake-model-*.envex"))
    with open(bundle, "r+b") as handle:  # the stick is yanked: the file shrinks under the copy
        handle.truncate(700)
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err
    assert "copying from the media failed" in err
    assert active_model_version(prefix) == "1.0.0"
    state = load_state(prefix)
    assert state.releases[-1].status == "failed" and not (prefix / "releases" / state.releases[-1].id).exists()
    shutil.rmtree(pulled)  # the whole medium gone
    done = install(world, "pulled", prefix)
    assert done.returncode == 1 and "does not exist; mount the install media" in done.stderr
    assert install(world, "1.2.0", prefix).returncode == 0
    assert active_model_version(prefix) == "1.2.0"


def test_failing_gate_keeps_the_previous_release_and_the_report(world, prefix):
    done = install(world, "1.3.0", prefix, ENVEX_TEST_GATES_REPORT=str(world["gates"] / "fail.json"))
    assert done.returncode == 1
    assert "gates: 1 failed (injected)" in done.stderr
    assert active_model_version(prefix) == "1.0.0"
    state = load_state(prefix)
    failed = state.releases[-1]
    assert failed.status == "failed" and failed.checks is not None and failed.checks.verdict == "fail"
    assert (prefix / failed.checks.report).is_file()  # the report outlives the removed slot
    assert not (prefix / "releases" / failed.id).exists()
    assert state.high_water["fake-model"] == "1.0.0"  # a failed release raises no high-water mark
    assert install(world, "1.3.0", prefix).returncode == 0
    assert active_model_version(prefix) == "1.3.0"


def test_full_disk(world, tmp_path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the planner's disk check is unit-tested")
    try:
        prefix = mount / "prefix"
        assert install(world, "1.0.0", prefix).returncode == 0
        filler = mount / "filler"
        free = shutil.disk_usage(mount).free
        with open(filler, "wb") as handle:  # leave 1 MiB: too little for the next release and its headroom
            handle.truncate(0)
            chunk = b"\0" * (1 << 20)
            for _ in range(free // (1 << 20) - 1):
                handle.write(chunk)
        done = install(world, "1.1.0", prefix)
        assert done.returncode == 1
        assert "GiB of disk" in done.stderr
        assert active_model_version(prefix) == "1.0.0"
        filler.unlink()
        done = install(world, "1.1.0", prefix)
        assert done.returncode == 0, done.stderr
        assert active_model_version(prefix) == "1.1.0"
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_rollback_and_activate_commands(world, prefix):
    from typer.testing import CliRunner

    assert install(world, "1.1.0", prefix).returncode == 0
    assert active_model_version(prefix) == "1.1.0"
    import typer

    from envex.installer import cli

    app = typer.Typer()
    for fn in (cli.status, cli.rollback, cli.activate):
        app.command(fn.__name__)(fn)
    runner = CliRunner()
    result = runner.invoke(app, ["rollback", "--prefix", str(prefix)])
    assert result.exit_code == 0, result.output
    assert active_model_version(prefix) == "1.0.0"
    state = load_state(prefix)
    assert state.high_water["fake-model"] == "1.1.0"  # rollback does not lower the mark
    status = runner.invoke(app, ["status", "--prefix", str(prefix)])
    assert status.exit_code == 0 and "high-water marks" in status.output and "fake-model 1.1.0" in status.output
    assert runner.invoke(app, ["rollback", "--prefix", str(prefix)]).exit_code == 1  # nothing older
    newer = next(r.id for r in state.releases if r.id.endswith("1.1.0"))
    assert runner.invoke(app, ["activate", newer, "--prefix", str(prefix)]).exit_code == 0
    assert active_model_version(prefix) == "1.1.0"
    assert runner.invoke(app, ["activate", "0099-nope", "--prefix", str(prefix)]).exit_code == 1
    # the media's 1.0.0 model is now below the high-water mark: refused as a downgrade, and the error says so
    done = install(world, "1.0.0", prefix)
    assert done.returncode == 1 and "downgrade refused" in done.stderr and "older than 1.1.0" in done.stderr
    assert "is older than version 1.1.0, the highest already accepted" in done.stdout
    assert active_model_version(prefix) == "1.1.0"


def test_installed_bundle_files_are_kept_for_re_verification(world, prefix):
    """The admin page's re-verify needs the bundle files after the media is gone: the install keeps them."""
    from envex.bundles import load_root, verify_bundle

    kept = sorted((prefix / "bundles").glob("*.envex"))
    installed = load_state(prefix).release(load_state(prefix).active).bundles
    assert sorted(p.name for p in kept) == sorted(f"{b.manifest_sha256}.envex" for b in installed)  # by digest
    assert not list((prefix / "bundles").glob(".*"))
    root = load_root(prefix / "trust" / "root.json")
    assert {verify_bundle(p, root=root).name for p in kept} == {b.name for b in load_state(prefix).release(
        load_state(prefix).active).bundles}
