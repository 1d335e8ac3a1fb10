"""A weights policy as an install-time choice (issue 42): `envex-install --weights POLICY`. The plan records the policy
(engine.weights, in the canonical form EngineConfig keeps), launch.json carries it to the engine, what `envex serve
--weights` refuses is refused in one line before anything is written, a release of the same bundles is installed
again when the policy differs, and a failed verify.weight_quality_band's figures reach the install's error line.

Real signed media (a fake model card of the embedded model's shape), the real plan and make_launch; the real
`envex-install` in a child process with injected gate reports (the band gate's own test is
tests/test_verify_weight_quality.py; the gate runner's wiring of it, tests/test_installer_gate_runner*.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from envex.bundles import make_demo_trust
from envex.installer.launch import LAUNCH_FILE, read_launch
from envex.installer.media import InstallError
from envex.installer.plan import make_plan, refuse_weights
from envex.installer.release import make_launch
from envex.installer.state import load_state
from envex.tests.support import installer as itest
from envex.tests.test_installer_deterministic import cpu_probe, cuda_probe, signed_media
from envex.tests.test_installer_kv_cache_dtype import EXPIRES, SMOL, bundles_of, envex_install

POLICY = '{"default": "int4_g128_sym", "overrides": {"down_proj": "fp8_channel"}}'
CANONICAL = '{"default":"int4_g128_sym","lm_head":"bf16","overrides":{"down_proj":"fp8_channel"}}'


@pytest.fixture(scope="module")
def trust(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_demo_trust(tmp_path_factory.mktemp("keys"), expires=EXPIRES)


# ---- the plan and launch.json ------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", [cpu_probe(), cuda_probe()], ids=["cpu", "cuda"])
def test_the_plan_records_the_policy_and_launch_json_carries_it_to_the_engine(tmp_path: Path, trust: Any,
                                                                              probe: Any) -> None:  # fmt: skip
    bundles = bundles_of(tmp_path, trust)
    plain = make_plan(bundles, probe)
    assert "weights" not in plain.engine and plain.weights_policy is None and "at load" not in plain.summary()
    plan = make_plan(bundles, probe, weights_policy=POLICY)
    assert plan.engine["weights"] == plan.weights_policy == CANONICAL  # as EngineConfig keeps it
    assert plan.summary().endswith(f"; weights {CANONICAL} at load")
    assert {k: v for k, v in plan.engine.items() if k != "weights"} == plain.engine  # nothing else moves
    assert make_plan(bundles, probe, weights_policy="fp8_channel").engine["weights"] == "fp8_channel"  # a name as given
    launch = make_launch("0001-x", plan, {"envex": "0.1.0", "python": "3.12"}, tmp_path / "slot")
    assert launch.engine["weights"] == CANONICAL
    assert launch.numeric_policy.startswith(f"weights F32 quantized at load by {CANONICAL} computed in ")
    config = launch.engine_config(tmp_path / "slot")
    assert config.weights == CANONICAL  # what the gate runner reads to run verify.weight_quality_band
    assert make_launch("0001-x", plain, {}, tmp_path / "slot").engine["weights"] is None


def test_what_serve_refuses_is_refused_at_plan_time_in_one_line(tmp_path: Path, trust: Any) -> None:
    bundles = bundles_of(tmp_path / "a", trust)
    label = "fake-model 1.0.0 (LlamaForCausalLM)"
    cases = {
        "int4_g100_sym": f"plan: --weights: {label}: weights policy default: 'int4_g100_sym': the group must be a "
                         "multiple of 8 (32, 64, 128, ...)",
        '{"default": "bf16", "overrides": {"layers.30": "fp8_channel"}}':
            f"plan: --weights: {label}: weights policy overrides: 'layers.30' names a layer the model lacks (it has "
            "30: layers.0 to layers.29)",
    }  # fmt: skip
    for weights, line in cases.items():
        with pytest.raises(InstallError) as info:
            make_plan(bundles, cpu_probe(), weights_policy=weights)
        assert str(info.value) == line
    with pytest.raises(InstallError) as info:  # the batch-invariant backend reads no packed weights
        make_plan(bundles, cpu_probe(), weights_policy="fp8_channel", deterministic=True)
    assert str(info.value).startswith(f"plan: {label}: weights: ") and "drop --weights or --deterministic" in str(
        info.value)
    gpt_oss = bundles_of(tmp_path / "b", trust, architecture="GptOssForCausalLM")
    with pytest.raises(InstallError, match=r"^plan: fake-model 1.0.0 \(GptOssForCausalLM\): weights: packed low-bit "
                                           r"weights are served for the Llama family only so far, not "
                                           r"GptOssForCausalLM; drop --weights$"):  # fmt: skip
        make_plan(gpt_oss, cpu_probe(), weights_policy="fp8_channel")
    # a checkpoint already quantized (its card, as installer/model_card.py writes it from quantization_config)
    awq = itest.fake_model_card(**SMOL, format="hf", weights=".", quantization="awq")
    with pytest.raises(InstallError) as info:
        refuse_weights(SimpleNamespace(name="m", version="1.0.0"), awq, "int4_g128_sym", mode="cpu")  # type: ignore[arg-type]
    assert str(info.value) == ("plan: --weights: m 1.0.0 (LlamaForCausalLM) is already quantized (awq); install it "
                               "without --weights")  # fmt: skip
    bf16 = itest.fake_model_card(**SMOL, format="hf", weights=".", quantization="bfloat16")
    assert refuse_weights(SimpleNamespace(name="m", version="1"), bf16, "fp8_block", mode="cuda") == "fp8_block"  # type: ignore[arg-type]


def test_a_model_split_over_several_gpus_is_refused(tmp_path: Path, trust: Any) -> None:
    big = bundles_of(tmp_path, trust, parameters=100_000_000_000, num_kv_heads=8)  # 186 GiB in bf16: 2 x H200
    probe = cuda_probe()
    two = replace(probe, gpus=(probe.gpus[0], replace(probe.gpus[0], index=1)))
    assert make_plan(big, two).engine["tensor_parallel"] == 2
    with pytest.raises(InstallError) as info:
        make_plan(big, two, weights_policy="fp8_channel")
    assert str(info.value) == ("plan: --weights: fake-model needs 2 GPUs here (tensor parallel) and packed low-bit "
                               "weights do not run under tensor parallelism yet; install without --weights")


# ---- envex-install --weights -------------------------------------------------------------------------------------


def test_envex_install_weights_usage_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from envex.installer.cli import main

    assert main(["--media", str(tmp_path), "--prefix", str(tmp_path / "p"), "--weights", "int5_g128_sym"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --weights: weights policy default: 'int5_g128_sym' is not a "
                                               "scheme; use bf16, fp8_block")  # fmt: skip
    assert not (tmp_path / "p").exists()


@pytest.mark.slow
def test_envex_install_records_the_policy_installs_again_when_it_changes_and_names_a_failed_bands_figures(
    tmp_path: Path, trust: Any
) -> None:
    wheels = itest.build_tiny_wheels(tmp_path / "wheels")
    media = signed_media(tmp_path / "m", trust, itest.fake_model_card(**SMOL), wheels)
    prefix = tmp_path / "prefix"
    done = envex_install(tmp_path, trust, media, prefix, itest.PASS_REPORT, "--weights", "fp8_channel")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "weights fp8_channel at load" in done.stdout
    first = load_state(prefix).active
    manifest, _ = read_launch(prefix / "current" / LAUNCH_FILE)
    assert first is not None and manifest.engine["weights"] == "fp8_channel"
    # the same policy again: nothing to do
    done = envex_install(tmp_path, trust, media, prefix, itest.PASS_REPORT, "--weights", "fp8_channel")
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr
    # another policy: a new release of the same bundles, which the band gate (injected) refuses with its figures
    gate = "verify.weight_quality_band"
    reason = "weights int4_g128_sym refused: outside its band against the bf16 model: mean KLD 0.31000 > 0.12"
    refused = {"verdict": "fail", "suite": "quick", "gates": {gate: "fail", "x": "pass"}, "bench": {},
               "details": {gate: {"verdict": "fail", "reason": reason}}}  # fmt: skip
    done = envex_install(tmp_path, trust, media, prefix, refused, "--weights", "int4_g128_sym")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"gates: 1 failed (verify.weight_quality_band): {reason}; report:" in done.stderr
    state = json.loads((prefix / "state.json").read_text())
    assert state["active"] == first and [r["status"] for r in state["releases"]][-1] == "failed"
