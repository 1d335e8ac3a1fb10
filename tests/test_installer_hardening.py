"""The installer writes only where it was given a dedicated prefix, creates nothing until its inputs are checked,
takes its children with it when it dies, keeps installed bundles by digest, and says why a downgrade is refused.

Real signed media (tiny wheels, a fake model, demo trust with real Ed25519 keys), the real `envex-install` in a
child process under the network guard, injected gate reports except where the gate runner itself is the subject.
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.bundles import build_bundle, load_private_key, make_demo_trust, sign_bundle
from envex.installer.admin.actions import reverify_bundle
from envex.installer.children import CHILDREN_FILE, run_tied
from envex.installer.media import scan_media, verify_all
from envex.installer.pipeline import refuse_downgrades
from envex.installer.prefix import SYSTEM_DIRS, PrefixError, check_prefix
from envex.installer.state import State, load_state
from envex.tests.support import installer as itest

pytestmark = pytest.mark.slow

SLOW_GATE_RUNNER = '''
import os as _os, subprocess as _sp, sys as _sys, time as _time
if "envex.installer.gate_runner" in " ".join(getattr(_sys, "orig_argv", [])) and _os.environ.get("SLOW_GATES_MARKER"):
    _child = _sp.Popen(["sleep", "300"])  # a grandchild of the installer, in the gate runner's process group
    _marker = _os.environ["SLOW_GATES_MARKER"]
    with open(_marker + ".tmp", "w") as _f:
        _f.write(f"{_os.getpid()} {_child.pid}\\n")
    _os.rename(_marker + ".tmp", _marker)
    _time.sleep(300)
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Demo trust; media 1.0.0 and 1.1.0 whose runtime bundles are both envex-runtime 0.1.0 with other bytes."""
    tmp = tmp_path_factory.mktemp("hardening")
    trust = make_demo_trust(tmp / "keys", expires=datetime.now(UTC) + timedelta(days=30))
    key = load_private_key(trust.key_path)
    wheels = itest.build_tiny_wheels(tmp / "wheels")
    media = {}
    for version in ("1.0.0", "1.1.0"):
        media[version] = itest.fake_media(
            tmp / f"media-{version}", trust.root_path, key, tmp / f"src-{version}", wheels=wheels, model_version=version
        )
    # Rebuild 1.1.0's runtime 0.1.0 with other bytes: same name and version, another manifest.
    rsrc = tmp / "src-1.1.0" / "runtime-0.1.0"
    (rsrc / "NOTES.txt").write_text("rebuilt\n")
    rebuilt = build_bundle(rsrc, kind="runtime", name="envex-runtime", version="0.1.0",
                           out=media["1.1.0"] / "bundles", force=True)
    sign_bundle(rebuilt, [key])
    gates = tmp / "gates"
    gates.mkdir()
    (gates / "pass.json").write_text(json.dumps(itest.PASS_REPORT))
    env, record = itest.guarded_env(tmp, {"ENVEX_TEST_GATES_REPORT": str(gates / "pass.json")})
    # The same guard, plus a gate runner that hangs with a grandchild (for the kill tests).
    guard = Path(env["PYTHONPATH"].split(os.pathsep)[0]) / "sitecustomize.py"
    guard.write_text(guard.read_text() + SLOW_GATE_RUNNER)
    yield {"tmp": tmp, "trust": trust, "media": media, "env": env, "key": key}
    assert itest.violations(record) == [], "a non-loopback connection or lookup was attempted"


def installer(world, media: Path, prefix: Path, *extra: str, env_extra: dict[str, str] | None = None,
              drop: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "envex.installer.cli", "--media", str(media), "--prefix", str(prefix),
           "--trust-fingerprint", world["trust"].fingerprint, "--yes", *extra]
    env = {k: v for k, v in {**world["env"], **(env_extra or {})}.items() if k not in drop}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def install(world, media: Path, prefix: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = installer(world, media, prefix, *extra)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def prefix(world):
    path = world["tmp"] / f"prefix-{uuid.uuid4().hex[:8]}"
    done = install(world, world["media"]["1.0.0"], path)
    assert done.returncode == 0, done.stderr
    return path


# ---- the prefix: a dedicated directory, checked before anything is created -------------------------------------


@pytest.mark.parametrize("path", sorted(SYSTEM_DIRS) + ["/proc/envex", "/sys/kernel/envex", "/dev/shm/envex",
                                                         "/usr/./", "/etc/../usr", "//"])
def test_system_directories_are_never_a_prefix(path):
    with pytest.raises(PrefixError, match="system directory"):
        check_prefix(path, must_exist=False)


def test_links_to_system_directories_and_home_are_refused(tmp_path):
    (tmp_path / "to-root").symlink_to("/")
    (tmp_path / "to-usr").symlink_to("/usr")
    for link in ("to-root", "to-usr"):
        with pytest.raises(PrefixError, match="system directory"):
            check_prefix(tmp_path / link, must_exist=False)
    with pytest.raises(PrefixError):
        check_prefix(Path.home(), must_exist=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.sampled_from(["notes.txt", "data", ".bashrc", "state.json", ".lock", "releases", "trust",
                                         ".demo", "bundles", "current"]), max_size=4, unique=True))
def test_an_existing_prefix_must_be_empty_or_envex(tmp_path_factory, entries):
    prefix = tmp_path_factory.mktemp("p")
    for name in entries:
        (prefix / name).mkdir()
    ours = {"state.json", ".lock", "releases", "trust", ".demo", "bundles", "current"}
    envex = "state.json" in entries or ".lock" in entries or set(entries) <= ours
    if envex:
        assert check_prefix(prefix, must_exist=False) == prefix
    else:
        with pytest.raises(PrefixError, match="Envex did not put there"):
            check_prefix(prefix, must_exist=False)
    assert sorted(p.name for p in prefix.iterdir()) == sorted(entries)  # looked, created nothing


def test_bad_prefixes_are_one_line_and_nothing_is_created(world, tmp_path):
    media = world["media"]["1.0.0"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    foreign = tmp_path / "home-like"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    cases = {
        afile: "is a regular file, not a directory",
        afile / "below": "a component of the path is not a directory",
        Path("/proc/envex-test"): "system directory",
        foreign: "Envex did not put there",
        tmp_path / ("p" * 5000): "too long",
    }
    for path, needle in cases.items():
        done = install(world, media, path)
        assert done.returncode == 2
        one_line(done, needle)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    assert afile.read_text() == "x"


def test_read_only_prefix_is_one_line(world, tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        one_line(install(world, world["media"]["1.0.0"], mount), "read-only")
        one_line(install(world, world["media"]["1.0.0"], mount / "sub"), "cannot create it", "read-only")
        for command in (["status"], ["rollback"], ["activate", "0001-x"]):
            done = subprocess.run([sys.executable, "-m", "envex.installer.commands", *command, "--prefix", str(mount)],
                                  capture_output=True, text=True, timeout=60)
            one_line(done, "nothing is installed there")
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_failed_install_creates_nothing(world, tmp_path):
    media = world["media"]["1.0.0"]
    new = tmp_path / "new" / "prefix"
    one_line(install(world, tmp_path / "no-media", new), "--media", "does not exist")
    assert not (tmp_path / "new").exists()
    corrupt = tmp_path / "corrupt-media"
    shutil.copytree(media, corrupt)
    model = next(corrupt.glob("bundles/fake-model-*.envex"))
    data = bytearray(model.read_bytes())
    data[600] ^= 1  # inside the fake weights
    model.write_bytes(bytes(data))
    one_line(install(world, corrupt, new), "failed verification [digest]")
    assert not (tmp_path / "new").exists()
    bad = [sys.executable, "-m", "envex.installer.cli", "--media", str(media), "--prefix", str(new), "--yes",
           "--trust-fingerprint", "ab" * 32]
    done = subprocess.run(bad, env=world["env"], capture_output=True, text=True, timeout=120)
    one_line(done, "--trust-fingerprint")
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    bad[bad.index(str(new))] = str(empty)
    done = subprocess.run(bad, env=world["env"], capture_output=True, text=True, timeout=120)
    one_line(done, "--trust-fingerprint")
    assert list(empty.iterdir()) == [], "a failed first install left a lock or a record behind"
    for command in (["status"], ["rollback"], ["activate", "0001-x"]):
        done = subprocess.run([sys.executable, "-m", "envex.installer.commands", *command, "--prefix", str(new)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        one_line(done, "does not exist")
    assert not (tmp_path / "new").exists()


def _media_with_card(world, dest: Path, card: dict | None) -> Path:
    """world's media 1.1.0 with its model bundle rebuilt (the Python API: no card check at build, as for media made
    by hand or by an older envex) around `card` (None: no envex-model.json at all), and signed."""
    shutil.copytree(world["media"]["1.1.0"], dest)
    src = itest.write_model_src(dest.parent / f"{dest.name}-src", itest.fake_model_card())
    if card is None:
        (src / "envex-model.json").unlink()
    else:
        (src / "envex-model.json").write_text(json.dumps(card))
    bundle = build_bundle(src, kind="model", name="fake-model", version="1.1.0", out=dest / "bundles", force=True)
    sign_bundle(bundle, [world["key"]])
    return dest


def test_a_bad_model_card_is_one_line_before_anything_is_written(world, prefix, tmp_path):
    good = itest.fake_model_card().model_dump(mode="json")
    cases = {
        "no-card": (None, ["plan: model bundle fake-model 1.1.0", "has no envex-model.json"]),
        "bad-card": ({k: v for k, v in good.items() if k != "quantization"},
                     ["envex-model.json: invalid (quantization: Field required)", "offline_docs/install.md"]),
        "bad-weights": ({**good, "weights": "fak.gguf"},
                        ["plan: model bundle fake-model 1.1.0", "field `weights` is 'fak.gguf'", "closest: fake.gguf"]),
    }
    before = load_state(prefix)
    for name, (card, needles) in cases.items():
        media = _media_with_card(world, tmp_path / name, card)
        new = tmp_path / f"{name}-prefix"
        line = one_line(install(world, media, new), *needles)
        assert "internal error" not in line
        assert not new.exists(), f"{name}: a refused first install left {sorted(p.name for p in new.iterdir())}"
        # Into an installed prefix: refused before a release slot is made; the active release stays.
        one_line(install(world, media, prefix), *needles)
        after = load_state(prefix)
        assert [r.id for r in after.releases] == [r.id for r in before.releases], name
        assert after.active == before.active
        assert sorted(p.name for p in (prefix / "releases").iterdir()) == [r.id for r in before.releases]
    done = install(world, world["media"]["1.1.0"], tmp_path / "bad-weights-prefix")  # the same prefix path, rerun
    assert done.returncode == 0, done.stderr


def test_admin_never_creates_a_token_outside_an_installed_prefix(tmp_path):
    for prefix in (tmp_path / "empty", tmp_path / "missing"):
        if prefix.name == "empty":
            prefix.mkdir()
        done = subprocess.run([sys.executable, "-m", "envex.installer.commands", "admin", "--prefix", str(prefix),
                               "--no-serve", "--cpu"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        one_line(done, "nothing is installed there")
    assert list((tmp_path / "empty").iterdir()) == [] and not (tmp_path / "missing").exists()


# ---- children die with the installer; a re-run clears what a dead one left ------------------------------------


def test_a_killed_installer_takes_its_gate_runner_with_it(world, prefix, tmp_path):
    marker = tmp_path / "gate-runner.pids"
    proc = installer(world, world["media"]["1.1.0"], prefix, env_extra={"SLOW_GATES_MARKER": str(marker)},
                     drop=("ENVEX_TEST_GATES_REPORT",))
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the gate runner never started"
        time.sleep(0.1)
    runner, grandchild = map(int, marker.read_text().split())
    assert alive(runner) and alive(grandchild)
    os.kill(proc.pid, signal.SIGKILL)  # the installer alone, as the OOM killer or an operator would
    proc.communicate()
    try:
        assert wait_gone(runner), "the gate runner outlived the installer"
        # The grandchild is beyond the kernel's reach (PR_SET_PDEATHSIG covers the child only): the re-run clears it.
        rerun = install(world, world["media"]["1.1.0"], prefix)
        assert rerun.returncode == 0, rerun.stderr
        assert "stopped the gate runner left running by an earlier install" in rerun.stdout
        assert wait_gone(grandchild, 5), "the re-run went ahead beside the dead run's processes"
        assert not (prefix / CHILDREN_FILE).exists()
    finally:
        for pid in (runner, grandchild):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_a_rerun_kills_a_live_group_recorded_by_a_dead_run_and_nothing_else(world, prefix):
    ours = subprocess.Popen(["sleep", "300"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # its pid reused: another start time
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    groups = [
        {"pgid": ours.pid, "start": _start_ticks(ours.pid), "boot_id": boot, "what": "gate runner"},
        {"pgid": stranger.pid, "start": _start_ticks(stranger.pid) + 1, "boot_id": boot, "what": "gate runner"},
    ]
    (prefix / CHILDREN_FILE).write_text(json.dumps({"groups": groups}))
    try:
        done = install(world, world["media"]["1.0.0"], prefix)  # nothing to install; the leftovers go anyway
        assert done.returncode == 0, done.stderr
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert stranger.poll() is None, "a process that was not the dead run's was killed"
        assert not (prefix / CHILDREN_FILE).exists()
    finally:
        for child in (ours, stranger):
            child.kill()
            child.wait()


def test_run_tied_leaves_nothing_of_a_child_behind(tmp_path):
    script = "import subprocess, sys; p = subprocess.Popen(['sleep', '300']); print(p.pid)"
    code, out, err = run_tied([sys.executable, "-c", script], what="test", env=dict(os.environ), prefix=tmp_path)
    assert code == 0, err
    assert wait_gone(int(out)), "a grandchild outlived its finished parent"
    assert not (tmp_path / CHILDREN_FILE).exists()


# ---- installed bundles kept by digest; demo media reused --------------------------------------------------------


def test_a_rebuilt_bundle_of_the_same_version_does_not_break_reverify(world, prefix):
    done = install(world, world["media"]["1.1.0"], prefix)
    assert done.returncode == 0, done.stderr
    state = load_state(prefix)
    runtimes = {r.id: next(b for b in r.bundles if b.kind == "runtime") for r in state.releases}
    assert len({b.manifest_sha256 for b in runtimes.values()}) == 2, "the two runtime 0.1.0 bundles should differ"
    for release_id, ref in runtimes.items():
        result = reverify_bundle(prefix, ref, (prefix / "bundles",))
        assert result.ok, f"{release_id}: {result.detail}"
        assert Path(result.path).name == f"{ref.manifest_sha256}.envex"


def test_demo_media_reuses_the_runtime_bundle_it_built(world, tmp_path):
    from envex.installer.demo import RUNTIME_BUNDLE, build_demo_media

    wheel = next((world["tmp"] / "wheels").glob("tinydep-*.whl"))
    media, keys = tmp_path / "media", tmp_path / "keys"
    build_demo_media(media, keys, model_version="1.0.0", wheel=wheel)
    runtime = media / "bundles" / f"{RUNTIME_BUNDLE}-0.1.0.envex"
    before = os.stat(runtime)
    time.sleep(1.1)  # a rebuild would carry another `created` second, and is another file
    build_demo_media(media, keys, model_version="1.0.1", wheel=wheel)
    after = os.stat(runtime)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "the runtime bundle was rebuilt"
    assert len(list((media / "bundles").glob("*.envex"))) == 3


# ---- a downgrade says so ---------------------------------------------------------------------------------------


def test_a_downgrade_refusal_says_it_is_a_downgrade(world):
    scan = scan_media(world["media"]["1.0.0"])
    root = world["trust"].root
    for kind, marks, name in (("model", {"fake-model": "2.0.0"}, "fake-model"),
                              ("runtime", {"envex-runtime": "0.2.0"}, "envex-runtime")):
        verified = verify_all(scan, root, State(high_water=marks))
        assert [d.kind for d in verified.refused] == [kind]
        with pytest.raises(Exception, match=rf"downgrade refused: the media's {kind} bundle {name} \S+ is older than"):
            refuse_downgrades(verified, None)
    verified = verify_all(scan, root, State(high_water={"fake-model": "2.0.0"}))
    with pytest.raises(Exception, match="downgrade refused"):
        refuse_downgrades(verified, "fake-model")
    refuse_downgrades(verify_all(scan, root, State()), None)  # nothing refused: nothing to say


def test_a_state_file_key_with_a_newline_is_named_on_one_line() -> None:
    """A field path holds the file's own keys: one with a newline (high_water's, here) is escaped in the message."""
    from envex.installer.state import validate_json

    with pytest.raises(ValueError) as err:
        validate_json(State, json.dumps({"high_water": {"model\nname": 3}}).encode())
    assert str(err.value) == "high_water.model\\nname: Input should be a valid string"
