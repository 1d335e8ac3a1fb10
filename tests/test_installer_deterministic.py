"""The deterministic mode as an install-time choice: off unless the admin asks (`envex-install --deterministic`);
the plan records the choice, launch.json carries it, the release's gate run then requires batch invariance (and it
passes on the embedded model on the CPU); a model that cannot take it (gpt-oss) is refused in one line before
anything is written; a release of the same bundles is installed again when the choice differs from it.

Real signed media (tiny wheels, a fake model card, demo trust), the real `envex-install` in a child process with
injected gate reports where the gates are not the subject; the real gate runner on the embedded model where they are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from envex.bundles import load_private_key, make_demo_trust, verify_bundle
from envex.installer import gate_runner
from envex.installer.demo import model_card_for
from envex.installer.launch import LAUNCH_FILE, load_launch, read_launch
from envex.installer.media import InstallError
from envex.installer.plan import make_plan
from envex.installer.probe import GPU, Probe
from envex.installer.release import engine_settings, make_launch, model_path
from envex.installer.state import load_state
from envex.runtime.config import GPT_OSS
from envex.runtime.loader import EMBEDDED_MODEL, embedded_model_path
from envex.tests.support import installer as itest

EXPIRES = datetime.now(UTC) + timedelta(days=30)


def cpu_probe() -> Probe:
    return Probe(mode="cpu", gpus=(), driver_version=None, cuda_driver_version=None, cpu_model="test", cpu_count=2,
                 ram_total=8 << 30, ram_available=8 << 30, disk_free=100 << 30, python="3.12.3", torch="2.11.0",
                 torch_cuda=None, triton=None, cuda_smoke="skipped: no GPU")  # fmt: skip


def cuda_probe() -> Probe:
    gpu = GPU(index=0, name="NVIDIA H200", compute_capability="9.0", accelerator="sm_90", memory_total=141 << 30,
              memory_free=140 << 30, mig_mode="disabled", ecc_uncorrected=0)  # fmt: skip
    return Probe(mode="cuda", gpus=(gpu,), driver_version="580.159.04", cuda_driver_version="13.0", cpu_model="test",
                 cpu_count=16, ram_total=128 << 30, ram_available=120 << 30, disk_free=60 << 30, python="3.12.3",
                 torch="2.11.0+cu130", torch_cuda="13.0", triton="3.6.0", cuda_smoke="ok")  # fmt: skip


@pytest.fixture(scope="module")
def trust(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_demo_trust(tmp_path_factory.mktemp("keys"), expires=EXPIRES)


def signed_media(root: Path, trust: Any, card: Any, wheels: list[Path] | None = None) -> Path:
    """Signed media with a runtime bundle (`wheels`, or a file that is no wheel) and a model bundle of `card`."""
    if wheels is None:
        fake = root / "w" / "fake-0.1-py3-none-any.whl"
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_bytes(b"not really a wheel")
        wheels = [fake]
    media = itest.fake_media(root / "media", trust.root_path, load_private_key(trust.key_path), root / "src",
                             wheels=wheels, card=card)  # fmt: skip
    return media


def verified(media: Path, trust: Any) -> list[Any]:
    return [verify_bundle(p, root=trust.root) for p in sorted((media / "bundles").glob("*.envex"))]


# ---- the plan and launch.json ------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", [cpu_probe(), cuda_probe()], ids=["cpu", "cuda"])
def test_the_plan_records_the_choice_and_launch_json_resolves_it(tmp_path: Path, trust: Any, probe: Probe) -> None:
    bundles = verified(signed_media(tmp_path, trust, itest.fake_model_card()), trust)
    default = make_plan(bundles, probe)
    assert default.engine["deterministic"] is False
    asked = make_plan(bundles, probe, deterministic=True)
    assert asked.engine["deterministic"] is True
    assert {k: v for k, v in asked.engine.items() if k != "deterministic"} == \
        {k: v for k, v in default.engine.items() if k != "deterministic"}  # nothing else moves
    # what launch.json records: the resolved settings, the choice among them
    assert engine_settings(default, tmp_path / "model")["deterministic"] is False
    settings = engine_settings(asked, tmp_path / "model")
    assert settings["deterministic"] is True and settings["backend"] == ("torch" if probe.mode == "cpu" else "triton")


@pytest.mark.parametrize("probe", [cpu_probe(), cuda_probe()], ids=["cpu", "cuda"])
def test_gpt_oss_is_refused_the_mode_in_one_line_and_planned_without_it(tmp_path: Path, trust: Any,
                                                                         probe: Probe) -> None:  # fmt: skip
    card = itest.fake_model_card(architecture=GPT_OSS)
    bundles = verified(signed_media(tmp_path, trust, card), trust)
    with pytest.raises(InstallError) as info:
        make_plan(bundles, probe, deterministic=True)
    message = str(info.value)
    assert message == ("plan: --deterministic: fake-model 1.0.0 (GptOssForCausalLM) has no batch-invariant kernels "
                       "yet (mixture-of-experts layers, attention sinks and windows); install it without "
                       "--deterministic")  # fmt: skip
    plan = make_plan(bundles, probe)
    assert plan.engine["deterministic"] is False
    assert engine_settings(plan, tmp_path / "model")["deterministic"] is False


# ---- envex-install --deterministic, end to end with injected gate reports --------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, trust: Any) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("det-install")
    wheels = itest.build_tiny_wheels(tmp / "wheels")
    llama = signed_media(tmp / "llama", trust, itest.fake_model_card(), wheels)
    gpt_oss = signed_media(tmp / "gpt-oss", trust, itest.fake_model_card(architecture=GPT_OSS), wheels)
    (tmp / "pass.json").write_text(json.dumps(itest.PASS_REPORT))
    env, record = itest.guarded_env(tmp, {"ENVEX_TEST_GATES_REPORT": str(tmp / "pass.json")})
    yield {"tmp": tmp, "llama": llama, "gpt_oss": gpt_oss, "env": env, "trust": trust}
    assert itest.violations(record) == [], "a non-loopback connection or lookup was attempted"


def envex_install(world: dict[str, Any], media: Path, prefix: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "envex.installer.cli", "--media", str(media), "--prefix", str(prefix),
           "--trust-fingerprint", world["trust"].fingerprint, "--yes", "--cpu", *extra]  # fmt: skip
    return subprocess.run(cmd, env=world["env"], capture_output=True, text=True, timeout=300, check=False)


def active_engine(prefix: Path) -> dict[str, Any]:
    manifest, _ = read_launch(prefix / "current" / LAUNCH_FILE)
    return dict(manifest.engine)


@pytest.mark.slow
def test_envex_install_records_the_choice_and_installs_again_when_it_changes(world: dict[str, Any]) -> None:
    prefix = world["tmp"] / "prefix"
    done = envex_install(world, world["llama"], prefix, "--deterministic")
    assert done.returncode == 0, done.stdout + done.stderr
    first = load_state(prefix).active
    assert first is not None and active_engine(prefix)["deterministic"] is True
    # the same bundles without the flag: another release, with the mode off (the default)
    done = envex_install(world, world["llama"], prefix)
    assert done.returncode == 0, done.stdout + done.stderr
    second = load_state(prefix).active
    assert second not in (None, first) and active_engine(prefix)["deterministic"] is False
    # and once more the same: nothing to do
    done = envex_install(world, world["llama"], prefix, "--no-deterministic")
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr
    assert load_state(prefix).active == second


@pytest.mark.slow
def test_envex_install_refuses_the_mode_for_gpt_oss_before_anything_is_written(world: dict[str, Any]) -> None:
    fresh = world["tmp"] / "new" / "prefix"
    done = envex_install(world, world["gpt_oss"], fresh, "--deterministic")
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "error: plan: --deterministic: fake-model 1.0.0 (GptOssForCausalLM) has no batch-invariant kernels yet "
        "(mixture-of-experts layers, attention sinks and windows); install it without --deterministic"]
    assert not (world["tmp"] / "new").exists(), "a refused install created the prefix"
    # into an installed prefix: refused the same way, the state untouched
    prefix = world["tmp"] / "installed"
    assert envex_install(world, world["llama"], prefix).returncode == 0
    state = (prefix / "state.json").read_bytes()
    releases = sorted(p.name for p in (prefix / "releases").iterdir())
    done = envex_install(world, world["gpt_oss"], prefix, "--deterministic")
    assert done.returncode == 1 and "--deterministic: fake-model 1.0.0 (GptOssForCausalLM)" in done.stderr
    assert (prefix / "state.json").read_bytes() == state
    assert sorted(p.name for p in (prefix / "releases").iterdir()) == releases


# ---- the gate run of a release installed with --deterministic -------------------------------------------------


@pytest.fixture
def only_batch_invariance(monkeypatch: pytest.MonkeyPatch) -> None:
    """The release's quality suite cut to its batch_invariance gate, run for real on the release's engine (the
    others need the HF reference, minutes on two cores, and have their own tests)."""
    import envex.verify.gates

    real = envex.verify.gates.run_gates
    monkeypatch.setattr(envex.verify.gates, "run_gates",
                        lambda engine, **kwargs: real(engine, gates=("batch_invariance",), **kwargs))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_the_release_gate_run_requires_batch_invariance_when_installed_with_the_mode(
        only_batch_invariance: None, tmp_path: Path, trust: Any, deterministic: bool) -> None:  # fmt: skip
    """launch.json made by the installer's own plan and make_launch for the embedded model on the CPU, the real
    gate runner on it: with the mode the batch_invariance gate is required, and passes."""
    gguf = embedded_model_path()
    card = model_card_for(gguf, EMBEDDED_MODEL)
    plan = make_plan(verified(signed_media(tmp_path, trust, card), trust), cpu_probe(), deterministic=deterministic)
    slot = tmp_path / "release"
    model_path(slot, plan).parent.mkdir(parents=True)
    model_path(slot, plan).symlink_to(gguf)  # the real weights where the bundle's fake ones would be installed
    launch = make_launch("0001-embedded-1.0.0", plan, {"envex": "0.1.0", "python": "3.12"}, slot)
    (slot / LAUNCH_FILE).write_bytes(launch.to_bytes())
    assert launch.engine["deterministic"] is deterministic and launch.engine["device"] == "cpu"
    assert load_launch(slot / LAUNCH_FILE, require_gates=False).deterministic is deterministic

    report = gate_runner.run(slot / LAUNCH_FILE, tmp_path / "out", "quick", False,
                             (gate_runner.SMOKE_PROMPT, gate_runner.SMOKE_EXPECT))  # fmt: skip
    assert report["verdict"] == "pass", report
    assert report["gates"] == {"installer.smoke": "pass", "verify.batch_invariance": "pass"}
    (gate,) = report["details"]["verify.gates"]["gates"]
    assert gate["name"] == "batch_invariance" and gate["thresholds"]["required"] is deterministic
    assert gate["evidence"]["deterministic"] is deterministic
    if deterministic:
        assert gate["evidence"]["differing_tokens"] == 0 and gate["summary"].startswith("identical tokens")
    else:
        assert gate["summary"].startswith("not required (deterministic mode off)")
