"""Installer pieces on their own: state.json, the lock, the `current` switch, launch.json, trust pinning and
rotation, the probe, the planner's refusals, the production wheelhouse path, and the network guard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envex.bundles import generate_key, make_demo_trust, make_root, sign_root, verify_bundle
from envex.installer.fsutil import LockHeldError, PrefixLock, atomic_write, switch_symlink
from envex.installer.launch import LaunchError, LaunchManifest, load_launch
from envex.installer.media import InstallError, pin_trust, scan_media, settle_trust, verify_all
from envex.installer.plan import make_plan
from envex.installer.probe import Probe, probe
from envex.installer.release import create_venv
from envex.installer.state import State, StateError, load_state, save_state
from envex.tests.support import installer as itest

EXPIRES = datetime.now(UTC) + timedelta(days=30)


@pytest.fixture
def trust(tmp_path):
    return make_demo_trust(tmp_path / "keys", expires=EXPIRES)


def cpu_probe(**overrides) -> Probe:
    values = dict(
        mode="cpu",
        gpus=(),
        driver_version=None,
        cuda_driver_version=None,
        cpu_model="test",
        cpu_count=2,
        ram_total=8 << 30,
        ram_available=8 << 30,
        disk_free=100 << 30,
        python="3.11.7",
        torch="2.5.0",
        torch_cuda=None,
        triton=None,
        cuda_smoke="skipped: no GPU",
    )
    values.update(overrides)
    return Probe(**values)


def media_with(tmp_path, trust, **kwargs):
    from envex.bundles import load_private_key

    wheel = tmp_path / "w" / "fake-0.1-py3-none-any.whl"
    wheel.parent.mkdir(exist_ok=True)
    wheel.write_bytes(b"not really a wheel")
    return itest.fake_media(
        tmp_path / "media",
        trust.root_path,
        load_private_key(trust.key_path),
        tmp_path / "src",
        wheels=[wheel],
        **kwargs,
    )


def verified(media: Path, trust) -> list:
    return [verify_bundle(p, root=trust.root) for p in sorted((media / "bundles").glob("*.envex"))]


# ---- state.json ----------------------------------------------------------------------------------------------------


def test_state_round_trip_and_unknown_keys_rejected(tmp_path):
    assert load_state(tmp_path) == State()
    state = State(high_water={"m": "1.2.0"}).with_event("install", "0001-m-1.2.0")
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".state.json.tmp")]
    data = json.loads((tmp_path / "state.json").read_text())
    data["surprise"] = 1
    (tmp_path / "state.json").write_text(json.dumps(data))
    with pytest.raises(StateError, match="surprise"):
        load_state(tmp_path)
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(StateError, match="state.json: invalid"):
        load_state(tmp_path)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300))
def test_state_parser_never_crashes_on_garbage(data):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "state.json").write_bytes(data)
        try:
            load_state(Path(tmp))
        except StateError as exc:
            assert "state.json" in str(exc)


def test_high_water_only_rises():
    from envex.installer.state import BundleRef

    ref = lambda v: BundleRef(name="m", kind="model", version=v, manifest_sha256="0" * 64)  # noqa: E731
    state = State(high_water={"m": "1.2.0"})
    assert state.raised_high_water([ref("1.1.0")]) == {"m": "1.2.0"}
    assert state.raised_high_water([ref("1.10.0")]) == {"m": "1.10.0"}


def test_lock_excludes_a_second_installer(tmp_path):
    with PrefixLock(tmp_path):
        with pytest.raises(LockHeldError, match="held by another"):
            with PrefixLock(tmp_path):
                pass
        # and from another process, too
        code = (
            "import sys; from envex.installer.fsutil import PrefixLock\ntry:\n with PrefixLock(sys.argv[1]): pass\n"
            "except Exception as e: print(type(e).__name__)"
        )
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True).stdout
        assert out.strip() == "LockHeldError"
    with PrefixLock(tmp_path):
        pass


def test_switch_symlink_and_atomic_write(tmp_path):
    (tmp_path / "releases" / "a").mkdir(parents=True)
    (tmp_path / "releases" / "b").mkdir()
    switch_symlink(tmp_path / "current", "releases/a")
    switch_symlink(tmp_path / "current", "releases/b")
    assert os.readlink(tmp_path / "current") == "releases/b"
    atomic_write(tmp_path / "f", b"one")
    atomic_write(tmp_path / "f", b"two")
    assert (tmp_path / "f").read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "f", "releases"]


# ---- launch.json ---------------------------------------------------------------------------------------------------


def _launch(**overrides) -> dict:
    ref = {"name": "m", "kind": "model", "version": "1.0.0", "manifest_sha256": "a" * 64}
    value = {
        "release": "0001-m-1.0.0",
        "created": "2026-01-01T00:00:00Z",
        "mode": "cpu",
        "model": {
            "path": "model/m.gguf",
            "served_name": "m",
            "format": "gguf",
            "architecture": "LlamaForCausalLM",
            "quantization": "Q4_1",
            "sha256": "b" * 64,
            "bundle": ref,
        },
        "engine": {"device": "cpu", "dtype": "float32", "max_model_len": 512},
        "numeric_policy": "weights Q4_1 computed in float32",
        "kv_cache": {"dtype": "float32", "block_size": 16},
        "kernels": None,
        "runtime": {
            "envex_version": "0.1.0",
            "python": "3.11",
            "torch": None,
            "triton": None,
            "venv": "venv",
            "bundle": {**ref, "name": "envex-runtime", "kind": "runtime"},
        },
    }
    value.update(overrides)
    return value


def test_launch_refuses_unknown_settings_and_ungated_releases(tmp_path):
    with pytest.raises(ValueError, match="engine.warp_speed"):
        LaunchManifest.model_validate(_launch(engine={"warp_speed": 9}))
    with pytest.raises(ValueError):
        LaunchManifest.model_validate({**_launch(), "extra": 1})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.gguf").write_bytes(b"x")
    (tmp_path / "launch.json").write_text(json.dumps(_launch()))
    with pytest.raises(LaunchError, match="has not passed its gates"):
        load_launch(tmp_path / "launch.json")
    gates = {"verdict": "pass", "suite": "quick", "gates": {"g": "pass"}, "report": "r", "finished_at": "x"}
    (tmp_path / "launch.json").write_text(json.dumps(_launch(gates=gates)))
    config = load_launch(tmp_path / "launch.json")
    assert config.model == str(tmp_path / "model" / "m.gguf") and config.max_model_len == 512
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(LaunchError, match="missing.json: does not exist"):
        load_launch(tmp_path / "missing.json")


# ---- trust ---------------------------------------------------------------------------------------------------------


def test_first_install_needs_the_fingerprint_confirmed(tmp_path, trust):
    media = media_with(tmp_path, trust)
    scan = scan_media(media)
    with pytest.raises(InstallError, match=trust.fingerprint):
        settle_trust(scan, State(), tmp_path / "p", trust_fingerprint=None, confirm=None)
    with pytest.raises(InstallError, match="root_fingerprint"):
        settle_trust(scan, State(), tmp_path / "p", trust_fingerprint="ab" * 32, confirm=None)
    asked: list[str] = []
    decision = settle_trust(
        scan, State(), tmp_path / "p", trust_fingerprint=None, confirm=lambda fp: asked.append(fp) or True
    )
    assert asked == [trust.fingerprint] and decision.first_pin
    spaced = " ".join(trust.fingerprint[i : i + 4] for i in range(0, 64, 4)).upper()
    assert settle_trust(scan, State(), tmp_path / "p", trust_fingerprint=spaced, confirm=None).first_pin


def test_pinned_root_rotates_forward_only_and_refuses_a_forged_root(tmp_path, trust):
    from envex.bundles import load_private_key

    prefix = tmp_path / "prefix"
    media = media_with(tmp_path, trust)
    scan = scan_media(media)
    state = pin_trust(
        prefix, State(), settle_trust(scan, State(), prefix, trust_fingerprint=trust.fingerprint, confirm=None)
    )
    assert state.trust.root_version == 1
    old_key, new_key = load_private_key(trust.key_path), generate_key()
    v2 = sign_root(
        make_root(root_keys=[new_key], bundle_keys=[new_key], version=2, expires=EXPIRES), [old_key, new_key]
    )
    (media / "trust" / "root.json").write_bytes(v2.to_bytes())
    decision = settle_trust(scan, state, prefix, trust_fingerprint=None, confirm=None)
    assert decision.rotated_from == 1 and decision.root.version == 2
    state2 = pin_trust(prefix, state, decision)
    assert state2.trust.root_version == 2 and state2.history[-1].event == "rotate-root"
    # the old v1 root on media is ignored in favour of the pinned v2
    (media / "trust" / "root.json").write_bytes(trust.root.to_bytes())
    assert settle_trust(scan, state2, prefix, trust_fingerprint=None, confirm=None).root.version == 2
    # a v3 signed only by a stranger is refused
    stranger = generate_key()
    v3 = sign_root(make_root(root_keys=[stranger], bundle_keys=[stranger], version=3, expires=EXPIRES), [stranger])
    (media / "trust" / "root.json").write_bytes(v3.to_bytes())
    with pytest.raises(InstallError, match="rotation refused"):
        settle_trust(scan, state2, prefix, trust_fingerprint=None, confirm=None)
    # a different root claiming the pinned version is refused
    forged = sign_root(make_root(root_keys=[stranger], bundle_keys=[stranger], version=2, expires=EXPIRES), [stranger])
    (media / "trust" / "root.json").write_bytes(forged.to_bytes())
    with pytest.raises(InstallError, match="forged"):
        settle_trust(scan, state2, prefix, trust_fingerprint=None, confirm=None)


def test_verify_all_stops_on_a_corrupt_bundle_and_skips_downgrades(tmp_path, trust):
    media = media_with(tmp_path, trust)
    scan = scan_media(media)
    result = verify_all(scan, trust.root, State())
    assert sorted(b.kind for b in result.bundles) == ["model", "runtime"]
    skipped = verify_all(scan, trust.root, State(high_water={"fake-model": "2.0.0"}))
    assert [b.kind for b in skipped.bundles] == ["runtime"] and "older than version 2.0.0" in skipped.skipped[0]
    bundle = next(media.glob("bundles/fake-model-*.envex"))
    data = bytearray(bundle.read_bytes())
    data[600] ^= 1  # inside the fake weights' data block
    bundle.write_bytes(bytes(data))
    with pytest.raises(InstallError, match=r"failed verification \[digest\]"):
        verify_all(scan, trust.root, State())


# ---- probe and plan ------------------------------------------------------------------------------------------------


def test_probe_without_gpu_is_cpu_mode(tmp_path, monkeypatch):
    import pynvml

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    found = probe(tmp_path / "not" / "yet")
    assert found.mode == "cpu" and found.gpus == () and found.accelerator == "cpu"
    assert found.ram_total > 0 and found.disk_free > 0 and found.cpu_count >= 1
    assert any("NVML unavailable" in n for n in found.notes)
    assert "CPU mode" in found.summary()


def test_plan_picks_newest_and_says_what_is_missing(tmp_path, trust):
    media = media_with(tmp_path, trust)
    bundles = verified(media, trust)
    plan = make_plan(bundles, cpu_probe())
    assert plan.mode == "cpu" and plan.kernels is None and plan.engine["device"] == "cpu"
    assert plan.engine["max_model_len"] == 128
    with pytest.raises(InstallError, match="no runtime bundle"):
        make_plan([b for b in bundles if b.kind != "runtime"], cpu_probe())
    with pytest.raises(InstallError, match="no model bundle named 'other'"):
        make_plan(bundles, cpu_probe(), model_name="other")
    with pytest.raises(InstallError, match=r"GiB of disk .* free"):
        make_plan(bundles, cpu_probe(disk_free=1000))
    with pytest.raises(InstallError, match="available RAM allows"):
        make_plan(bundles, cpu_probe(ram_available=1000))


def _answers(digest: str) -> bytes:
    from envex.verify.references_file import SCHEMA, ReferencesFile, references_bytes

    return references_bytes(ReferencesFile.model_validate({
        "schema": SCHEMA, "model_digest": digest, "reference_policy": "cpu-float32-torch", "suites": ["quick"],
        "max_model_len": 128, "created": "2026-12-06T00:00:00+00:00", "computed_on": {}, "greedy": [], "logits": [],
    }))  # fmt: skip


def test_plan_checks_signed_reference_answers_against_the_weights_they_sit_beside(tmp_path, trust):
    import hashlib

    from envex.verify.references_file import REFERENCES_FILE, model_digest

    for name in ("none", "ok", "other", "bad"):
        (tmp_path / name).mkdir()
    bundles = verified(media_with(tmp_path / "none", trust), trust)
    plan = make_plan(bundles, cpu_probe())
    assert plan.reference == "auto" and plan.signed_references is False
    with pytest.raises(InstallError) as info:
        make_plan(bundles, cpu_probe(), reference="signed")
    assert "--reference signed: model bundle fake-model 1.0.0 holds no signed reference answers" in str(info.value)
    with pytest.raises(InstallError, match="--reference 'remote': use one of auto, local, signed"):
        make_plan(bundles, cpu_probe(), reference="remote")

    digest = model_digest({"fake.gguf": hashlib.sha256(b"GGUF fake weights").hexdigest()})
    ok = verified(media_with(tmp_path / "ok", trust, model_files={REFERENCES_FILE: _answers(digest)}), trust)
    plan = make_plan(ok, cpu_probe(), reference="signed")
    assert plan.reference == "signed" and plan.signed_references is True

    other = verified(media_with(tmp_path / "other", trust, model_files={REFERENCES_FILE: _answers("0" * 64)}), trust)
    for reference in ("auto", "local", "signed"):  # answers for other weights are a broken bundle, whatever is asked
        with pytest.raises(InstallError) as info:
            make_plan(other, cpu_probe(), reference=reference)
        message = str(info.value)
        assert "\n" not in message and message.startswith("plan: model bundle fake-model 1.0.0: envex-references")
        assert "computed for other weights" in message
    bad = verified(media_with(tmp_path / "bad", trust, model_files={REFERENCES_FILE: b"[1, 2]"}), trust)
    with pytest.raises(InstallError, match="schema 'list', expected 'envex-references/1'"):
        make_plan(bad, cpu_probe())


def test_plan_refuses_targets_and_requirements_it_cannot_meet(tmp_path, trust):
    media = media_with(
        tmp_path,
        trust,
        card=itest.fake_model_card(parameters=10**12),
        model_targets={
            "accelerators": ["sm_90"],
            "min_driver": "550",
            "python": ">=3.11",
            "torch": None,
            "triton": None,
        },
        model_requires=[{"name": "envex-runtime", "kind": "runtime", "version": ">=9.0.0"}],
    )
    with pytest.raises(InstallError) as info:
        make_plan(verified(media, trust), cpu_probe())
    message = str(info.value)
    assert "built for sm_90; this machine runs cpu" in message
    assert "requires runtime envex-runtime >=9.0.0; found 0.1.0" in message


# ---- production wheelhouse -----------------------------------------------------------------------------------------


def test_complete_wheelhouse_installs_with_no_index_into_an_isolated_venv(tmp_path):
    wheels = itest.build_tiny_wheels(tmp_path / "wheelhouse")
    assert {w.name.split("-")[0] for w in wheels} == {"tinyapp", "tinydep"}
    venv = tmp_path / "venv"
    create_venv(venv, tmp_path / "wheelhouse", complete=True, install=["tinyapp==1.0"])
    python = str(venv / "bin" / "python")
    out = subprocess.run(
        [python, "-c", "import tinyapp, tinydep; print(tinyapp.NAME, tinydep.NAME)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["tinyapp", "tinydep"]
    # a complete wheelhouse means an isolated venv: nothing leaks in from the installer's environment
    assert subprocess.run([python, "-c", "import pydantic"], capture_output=True).returncode != 0
    with pytest.raises(InstallError, match="pip install --no-index"):
        create_venv(tmp_path / "venv2", tmp_path / "wheelhouse", complete=True, install=["absent-package"])


# ---- network guard -------------------------------------------------------------------------------------------------


def test_network_guard_refuses_and_records_everything_but_loopback(tmp_path):
    env, record = itest.guarded_env(tmp_path)
    code = """
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname()); c.close()
socket.getaddrinfo("localhost", 80)
for attempt in (lambda: socket.create_connection(("10.255.255.1", 80), timeout=0.1),
                lambda: socket.getaddrinfo("example.com", 443),
                lambda: socket.socket().connect_ex(("192.0.2.1", 80))):
    try:
        attempt()
        print("ALLOWED")
    except ConnectionRefusedError as e:
        print("refused", "network guard" in str(e))
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:3] == ["refused True"] * 3
    kinds = [v["kind"] for v in itest.violations(record)]
    assert kinds == ["create_connection", "getaddrinfo", "connect_ex"]


def test_reconcile_points_current_at_the_recorded_release_and_abandons_unfinished_slots(tmp_path):
    from envex.installer.activate import current_target, reconcile
    from envex.installer.state import BundleRef, Release

    ref = BundleRef(name="m", kind="model", version="1.0.0", manifest_sha256="a" * 64)
    for rid in ("0001-m-1.0.0", "0002-m-1.0.0", "0003-m-1.0.0"):
        (tmp_path / "releases" / rid).mkdir(parents=True)
        (tmp_path / "releases" / rid / "launch.json").write_text("{}")
    (tmp_path / "releases" / "stray").mkdir()
    state = State(
        releases=[
            Release(id="0001-m-1.0.0", created="t", status="passed", bundles=[ref], mode="cpu"),
            Release(id="0002-m-1.0.0", created="t", status="passed", bundles=[ref], mode="cpu"),
            Release(id="0003-m-1.0.0", created="t", status="gating", bundles=[ref], mode="cpu"),
        ],
        active="0002-m-1.0.0",
    )
    save_state(tmp_path, state)
    switch_symlink(tmp_path / "current", "releases/0001-m-1.0.0")  # a crash between state.json and the switch
    fixed = reconcile(tmp_path, load_state(tmp_path))
    assert current_target(tmp_path) == "0002-m-1.0.0"
    assert fixed.release("0003-m-1.0.0").status == "abandoned" and load_state(tmp_path) == fixed
    assert sorted(p.name for p in (tmp_path / "releases").iterdir()) == ["0001-m-1.0.0", "0002-m-1.0.0"]


# ---- gate reports --------------------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def test_gate_report_reading():
    from envex.installer.gate_runner import _headline, gate_verdicts, verdict_of

    report = {
        "verdict": "pass",
        "gates": [{"name": "stopping", "verdict": "pass"}, {"name": "needle", "verdict": "fail"}],
    }
    assert verdict_of(report) == "pass" and gate_verdicts(report) == {"stopping": "pass", "needle": "fail"}
    assert verdict_of({"passed": False}) == "fail" and verdict_of({}) == "fail"
    bench = {
        "rows": [
            {
                "included": True,
                "intervals": {"output_tok_s": {"estimate": 5.0, "n": 3}},
                "percentiles": {"ttft_s": {"p50": 0.1}},
            }
        ]
    }
    assert _headline(bench) == {"bench.output_tok_s.estimate": 5.0, "bench.ttft_s.p50": 0.1}


@settings(max_examples=150, deadline=None)
@given(report=_json)
def test_gate_report_readers_never_crash_and_fail_closed(report, tmp_path_factory):
    from envex.installer.checks import run_checks
    from envex.installer.gate_runner import _headline, gate_verdicts, verdict_of

    assert verdict_of(report) in ("pass", "fail")
    assert set(gate_verdicts(report).values()) <= {"pass", "fail", "skip"}
    assert isinstance(_headline(report), dict)
    prefix = tmp_path_factory.mktemp("p")
    injected = prefix / "injected.json"
    injected.write_text(json.dumps(report))
    try:
        summary, _ = run_checks(
            prefix, "0001-x-1.0.0", itest.fake_model_card(), suite="quick", bench=False, injected_report=injected
        )
    except InstallError as exc:
        assert "is not a gate report" in str(exc)
    else:  # only an explicit pass with at least one gate passes
        if summary.verdict == "pass":
            assert report.get("verdict") == "pass" and summary.gates
            assert set(summary.gates.values()) <= {"pass", "skip"}


def test_children_started_in_a_checkout_root_do_not_import_its_folders(tmp_path: Path) -> None:
    """The environment envex gives its children (gate runner, kernel warm-up, release venv) keeps the working
    directory off sys.path: in a source checkout's root, `python -m` would make its kernels/ shadow the PyPI package
    `kernels` that transformers >= 5.25 imports (the demo's gates failed on it)."""
    from envex.installer.launch import set_offline_env

    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # conftest sets it for the tests' own
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"

    def origin(env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              check=True)  # fmt: skip
        return done.stdout.strip()

    assert origin(env) == str(tmp_path / "kernels" / "__init__.py")  # the hazard, without envex's environment
    assert not origin(set_offline_env(dict(env))).startswith(str(tmp_path))


def test_the_installer_commands_start_without_torch():
    """A refusal, `status`, `rollback` and `activate` answer in under a second: the modules they import load no
    torch (each took 4.3-4.5 s on one core when the references-file parser and the KV formats imported it)."""
    code = ("import sys; import envex.installer.cli, envex.installer.commands, envex.installer.pipeline, "
            "envex.installer.plan, envex.verify.references_file, envex.kernels.kv_quant_format; "
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
