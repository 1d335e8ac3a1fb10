"""The KV cache's format as an install-time choice (issue 43): `envex-install --kv-cache-dtype bf16|fp8|int4`. The
plan records the choice and counts the KV cache's bytes per token and its capacity in tokens in the chosen format
(the packed formats' bytes: kernels/kv_quant_format.py, what the model runner counts its blocks by); launch.json
carries engine.kv_cache_dtype and the capacity; what cannot take a packed cache is refused in one line; a release of
the same bundles is installed again when the choice differs; a failed band gate's figures reach the install's error
line. Also the draft model's share of the KV memory, counted in the same format (runtime/engine/spec/decoder.py).

Real signed media (a fake model card of the embedded model's shape), the real plan and make_launch; the real
`envex-install` in a child process with an injected gate report where the gates are not the subject.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from envex.bundles import make_demo_trust, verify_bundle
from envex.installer.media import InstallError
from envex.installer.plan import make_plan
from envex.installer.probe import Probe
from envex.installer.release import make_launch
from envex.kernels.kv_quant_format import kv_bytes_per_token
from envex.runtime.config import ModelConfig
from envex.runtime.engine import EngineConfig
from envex.runtime.engine.spec import draft_kv_bytes
from envex.tests.support import installer as itest
from envex.tests.test_installer_deterministic import cpu_probe, cuda_probe, signed_media

EXPIRES = datetime.now(UTC) + timedelta(days=30)
# The embedded model's shape (SmolLM2-135M: 30 layers, 3 KV heads of 64), with fake weights.
SMOL = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "parameters": 134_515_008, "max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def trust(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_demo_trust(tmp_path_factory.mktemp("keys"), expires=EXPIRES)


def bundles_of(tmp: Path, trust: Any, **card: Any) -> list[Any]:
    media = signed_media(tmp, trust, itest.fake_model_card(**{**SMOL, **card}))
    return [verify_bundle(p, root=trust.root) for p in sorted((media / "bundles").glob("*.envex"))]


# ---- the plan and launch.json ------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", [cpu_probe(), cuda_probe()], ids=["cpu", "cuda"])
def test_the_plan_counts_capacity_in_the_chosen_format_and_launch_json_carries_it(tmp_path: Path, trust: Any,
                                                                                  probe: Probe) -> None:  # fmt: skip
    bundles = bundles_of(tmp_path, trust)
    plans = {d: make_plan(bundles, probe, kv_cache_dtype=d) for d in ("bf16", "fp8", "int4")}
    for dtype, plan in plans.items():
        assert plan.kv_cache_dtype == dtype and plan.engine["kv_cache_dtype"] == dtype
        per_layer = kv_bytes_per_token(dtype, 3, 64)
        if dtype == "bf16":  # the unpacked cache holds the activation dtype: float32 on the CPU
            per_layer = per_layer * (2 if probe.mode == "cpu" else 1)
        assert plan.kv_bytes_per_token == 30 * per_layer
        assert f"KV cache {dtype}: {plan.kv_capacity_tokens} tokens" in plan.summary()
        # nothing but the format moves: the same memory, more tokens
        assert {k: v for k, v in plan.engine.items() if k != "kv_cache_dtype"} == \
            {k: v for k, v in plans["bf16"].engine.items() if k != "kv_cache_dtype"}
    # a head of 64 elements, K and V: int4 72 bytes against bf16's 256 (3.56x), fp8 132 (1.94x); the CPU's
    # unpacked cache is float32 (twice bf16's bytes)
    scale = 2 if probe.mode == "cpu" else 1
    int4 = plans["int4"].kv_capacity_tokens / plans["bf16"].kv_capacity_tokens
    fp8 = plans["fp8"].kv_capacity_tokens / plans["bf16"].kv_capacity_tokens
    assert int4 == pytest.approx(scale * 256 / 72, rel=1e-3) and int4 / scale >= 3.5
    assert fp8 == pytest.approx(scale * 256 / 132, rel=1e-3) and fp8 / scale >= 1.9
    if probe.mode == "cuda":  # the pool takes what the bf16 weights leave of 85% of the H200's 141 GiB
        per_token = 30 * 2 * 3 * 64 * 2  # layers x K, V x heads x elements x bf16's bytes
        assert plans["bf16"].kv_capacity_tokens == (int(141 * 2**30 * 0.85) - 134_515_008 * 2) // per_token
    launch = make_launch("0001-x", plans["int4"], {"envex": "0.1.0", "python": "3.12"}, tmp_path / "slot")
    assert launch.engine["kv_cache_dtype"] == "int4"
    assert launch.kv_cache["kv_cache_dtype"] == "int4"
    assert launch.kv_cache["bytes_per_token"] == 30 * 2 * 3 * (32 + 4)  # K, V x 3 heads x (codes + bf16 scale, zero)
    assert launch.kv_cache["capacity_tokens"] == plans["int4"].kv_capacity_tokens
    config = launch.engine_config(tmp_path / "slot")
    assert config.kv_cache_dtype == "int4"


def test_what_cannot_take_a_packed_cache_is_refused_in_one_line(tmp_path: Path, trust: Any) -> None:
    bundles = bundles_of(tmp_path / "a", trust)
    with pytest.raises(InstallError) as info:
        make_plan(bundles, cpu_probe(), kv_cache_dtype="int8")
    assert str(info.value) == "plan: --kv-cache-dtype 'int8': use one of bf16, fp8, int4"
    with pytest.raises(InstallError) as info:
        make_plan(bundles, cpu_probe(), kv_cache_dtype="int4", deterministic=True)
    assert str(info.value) == ("plan: fake-model 1.0.0 (LlamaForCausalLM): kv_cache_dtype: int4 has no "
                               "batch-invariant attention kernel yet; use --kv-cache-dtype bf16 with "
                               "--deterministic, or --no-deterministic")  # fmt: skip
    odd = bundles_of(tmp_path / "b", trust, head_dim=48)
    with pytest.raises(InstallError, match=r"^plan: --kv-cache-dtype fp8: fake-model 1.0.0 \(LlamaForCausalLM\): "
                                           r"head_dim: 48 must be a power of two ≥ 32"):  # fmt: skip
        make_plan(odd, cpu_probe(), kv_cache_dtype="fp8")
    assert make_plan(odd, cpu_probe()).kv_cache_dtype == "bf16"  # the unpacked cache takes any head
    mla = bundles_of(tmp_path / "c", trust, kv_latent_width=576)
    with pytest.raises(InstallError, match="keeps a latent KV cache .MLA., which has no packed format yet"):
        make_plan(mla, cpu_probe(), kv_cache_dtype="int4")


# ---- envex-install --kv-cache-dtype, end to end with injected gate reports ----------------------------------------


def envex_install(tmp: Path, trust: Any, media: Path, prefix: Path, report: dict[str, Any],
                  *extra: str) -> subprocess.CompletedProcess:  # fmt: skip
    (tmp / "report.json").write_text(json.dumps(report))
    env, _ = itest.guarded_env(tmp, {"ENVEX_TEST_GATES_REPORT": str(tmp / "report.json")})
    cmd = [sys.executable, "-m", "envex.installer.cli", "--media", str(media), "--prefix", str(prefix),
           "--trust-fingerprint", trust.fingerprint, "--yes", "--cpu", *extra]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_envex_install_kv_cache_dtype_usage_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from envex.installer.cli import main

    assert main(["--media", str(tmp_path), "--prefix", str(tmp_path / "p"), "--kv-cache-dtype", "int8"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --kv-cache-dtype 'int8': use bf16, fp8 or int4"]
    assert not (tmp_path / "p").exists()


@pytest.mark.slow
def test_envex_install_records_int4_and_a_refused_band_gate_names_its_figures(tmp_path: Path, trust: Any) -> None:
    """The plan's line shows the capacity in int4, the release's launch.json carries it; the band gate (injected:
    its own test is tests/test_verify_gate_kv_cache.py) refuses it and the install's one error line names the
    figures; nothing is activated (launch.json's kv_cache_dtype: the test above, on the installer's own make_launch)."""
    wheels = itest.build_tiny_wheels(tmp_path / "wheels")
    media = signed_media(tmp_path / "m", trust, itest.fake_model_card(**SMOL), wheels)
    prefix = tmp_path / "prefix"
    reason = "kv_cache_dtype int4 refused: outside its band against the bf16-KV model: mean KLD 0.20000 > 0.12"
    refused = {"verdict": "fail", "suite": "quick", "gates": {"verify.kv_cache_band": "fail", "x": "pass"},
               "bench": {}, "details": {"verify.kv_cache_band": {"verdict": "fail", "reason": reason}}}  # fmt: skip
    done = envex_install(tmp_path, trust, media, prefix, refused, "--kv-cache-dtype", "int4")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "KV cache int4:" in done.stdout
    assert f"gates: 1 failed (verify.kv_cache_band): {reason}; report:" in done.stderr
    state = json.loads((prefix / "state.json").read_text())
    assert state["active"] is None and [r["status"] for r in state["releases"]] == ["failed"]


# ---- the draft model's share of the KV memory ----------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["bf16", "fp8", "int4"])
def test_the_draft_models_kv_is_budgeted_in_the_cache_format(kv: str) -> None:
    """draft_kv_bytes: the draft's K and V for one block of the target's, in the format its runner allocates."""
    draft = SimpleNamespace(config=ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "head_dim": 64}))  # fmt: skip
    config = EngineConfig(model="x", dtype="bfloat16", block_size=16, kv_cache_dtype=kv)
    got = draft_kv_bytes(config, draft)  # type: ignore[arg-type]
    assert got == 4 * 16 * kv_bytes_per_token(kv, 2, 64)
    bf16 = 4 * 16 * 2 * 2 * 64 * 2
    assert got == {"bf16": bf16, "fp8": bf16 * 1056 // 2048, "int4": bf16 * 576 // 2048}[kv]
    float32 = draft_kv_bytes(EngineConfig(model="x", dtype="float32", block_size=16, kv_cache_dtype=kv), draft)
    assert float32 == (2 * bf16 if kv == "bf16" else got)  # a packed cache's bytes do not follow the activations


def test_a_latent_attention_draft_is_budgeted_as_its_latent_cache() -> None:
    """A DeepSeek-architecture draft (MLA) keeps one latent row a token and layer (its own make_kv_caches): its
    share is what its model allocates, not 2 x KV heads x head_dim."""
    import torch

    from envex.runtime.models.deepseek import DeepseekV3ForCausalLM

    hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 64,
          "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
          "max_position_embeddings": 256}  # fmt: skip
    mc = ModelConfig.from_hf(hf)
    draft = SimpleNamespace(config=mc)
    config = EngineConfig(model="x", dtype="bfloat16", block_size=16)
    model = DeepseekV3ForCausalLM(mc, dtype=torch.bfloat16, device=torch.device("meta"))
    got = draft_kv_bytes(config, draft)  # type: ignore[arg-type]
    assert got == model.kv_cache_bytes_per_block(16, torch.bfloat16) == 3 * 16 * (32 + 8) * 2
