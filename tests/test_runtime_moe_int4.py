"""INT4 MoE releases (Kimi K2 Thinking: compressed-tensors pack-quantized routed experts, symmetric groups of 32,
everything else bf16; Qwen3-MoE AWQ releases) on tiny random models written in those layouts: the experts load as
INT4 stacks (kernels.quant.Int4GroupStack's layout) and are served so, the engine's greedy tokens equal HF
transformers' in float32 on the dequantized weights, on the torch backend and on the Triton one under the
interpreter; DeepSeek's float shared expert beside INT4 routed ones; what is refused is one line; the install
card counts the experts' stored bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from envex.kernels import quant
from envex.runtime.config import ConfigError, ModelConfig
from envex.tests.support.quant_packing import awq_pack, ct_pack
from envex.tests.test_runtime_deepseek import _hf_model as _deepseek_model
from envex.tests.test_runtime_gpt_oss import _write_tokenizer
from envex.tests.test_runtime_moe_fp8 import (
    GREEDY,
    PROMPTS,
    _engine,
    _hf_tokens,
    _qwen3_model,
    assert_greedy_like_hf,
    dummy_experts,
)
from envex.tests.test_runtime_qwen3_moe import QWEN3_30B_A3B

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
# Kimi K2 Thinking's quantization_config, at a test's group size: every Linear but those ignored
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               r"re:.*mlp\.gate$"]


def _ct_config(group: int) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": KIMI_IGNORE, "kv_cache_scheme": None}  # fmt: skip


def _release(model: transformers.PreTrainedModel, tmp: Path, layout: str, group: int
             ) -> tuple[Path, transformers.PreTrainedModel]:  # fmt: skip
    """Write `model` as an INT4 release: the routed experts (`mlp.experts.*_proj.weight`) quantized by
    kernels.quant.quantize_int4 and stored as compressed-tensors pack-quantized (symmetric, bf16 scales, layout
    "ct") or AutoAWQ GEMM (zero points, float16 scales, "awq"), the rest float. -> (its directory, HF's model in
    float32 on the same weights dequantized)."""
    float_dir, out_dir = tmp / "dequantized", tmp / layout
    model.save_pretrained(float_dir, safe_serialization=True)
    stored = load_file(str(float_dir / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, w in stored.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            if layout == "ct":
                pw = quant.quantize_int4(w, group, symmetric=True, scale_dtype=torch.bfloat16)
                q = quant.unpack_int4(pw.data, w.shape[1]).to(torch.int64) - quant.SYMMETRIC_ZERO
                packed |= {f"{module}.weight_packed": ct_pack(q), f"{module}.weight_scale": pw.scale,
                           f"{module}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}  # fmt: skip
            else:
                pw = quant.quantize_int4(w, group, symmetric=False, scale_dtype=torch.float16)
                zero = pw.zero if pw.zero is not None else torch.full_like(pw.scale, 8, dtype=torch.uint8)
                u = quant.unpack_int4(pw.data, w.shape[1])
                packed |= {f"{module}.qweight": awq_pack(u.t()), f"{module}.qzeros": awq_pack(zero.t()),
                           f"{module}.scales": pw.scale.t().contiguous()}  # fmt: skip
            dequantized[name] = quant.dequantize(pw, torch.float32)
        else:
            packed[name] = dequantized[name] = w
    save_file(dequantized, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    if layout == "ct":
        config["quantization_config"] = _ct_config(group)
    else:  # the routers, the attention and the dense MLP left float (substrings of their names)
        skip = ["mlp.gate", "self_attn", "mlp.up_proj", "mlp.down_proj"]
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": skip}  # fmt: skip
    out_dir.mkdir()
    (out_dir / "config.json").write_text(json.dumps(config))
    save_file(packed, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(out_dir)
    return out_dir, type(model).from_pretrained(float_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3_ct(tmp_path_factory):
    return _release(_qwen3_model(), tmp_path_factory.mktemp("qwen3_int4"), "ct", 32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qwen3_moe_pack_quantized_release_gives_hf_tokens(qwen3_ct, backend: str) -> None:
    path, hf = qwen3_ct
    engine = _engine(path, backend)
    moe = engine.model_config.moe
    assert moe is not None and (moe.int4_group, moe.int4_zero, moe.int4_layers) == (32, False, (0, 1))
    experts = engine.runner.model.layers[0].experts
    assert experts.int4 and experts.gate_up.dtype == torch.int32 and experts.gate_up.shape == (8, 96, 8)
    assert engine.runner.packed["layers.0.gate_up_proj"] == quant.INT4_GROUP
    assert_greedy_like_hf(engine, hf, backend, triton_tokens=2)  # a prefill and a decode step on the Triton ops


def test_qwen3_moe_awq_release_gives_hf_tokens(tmp_path: Path) -> None:
    """AutoAWQ's GEMM packing with zero points, groups of 16: converted at load into the same stacks."""
    path, hf = _release(_qwen3_model(), tmp_path, "awq", 16)
    engine = _engine(path)
    experts = engine.runner.model.layers[1].experts
    assert experts.int4 and experts.gate_up_zero is not None and experts.gate_up_scale.dtype == torch.float16
    got = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [_hf_tokens(hf, p) for p in PROMPTS]


def test_deepseek_v3_kimi_k2_layout_gives_hf_tokens(tmp_path: Path) -> None:
    """Kimi K2 Thinking's layout: routed experts INT4 (symmetric groups of 32), the shared expert, attention and
    dense MLPs float (ignore), the shared expert served beside the INT4 stacks as its own float MLP."""
    path, hf = _release(_deepseek_model("v3"), tmp_path, "ct", 32)
    engine = _engine(path)
    moe = engine.model_config.moe
    assert moe.int4_layers == (1, 2) and not moe.int4_shared  # layer 0 is dense; 2: the MTP layer (not stored)
    layer = engine.runner.model.layers[1]
    assert layer.experts.int4 and layer.experts.shared_experts == 0 and layer.experts.gate_up.shape[0] == 8
    assert layer.shared_gate_up_proj_weight.dtype == torch.float32
    got = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [_hf_tokens(hf, p) for p in PROMPTS]


def test_unsupported_int4_expert_schemes_are_one_line() -> None:
    ct = _ct_config(32)
    per_channel = json.loads(json.dumps(ct))
    per_channel["config_groups"]["group_0"]["weights"] |= {"strategy": "channel", "group_size": None}
    cases = (
        (per_channel, "INT4 MoE experts with group_size None are not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 24, "zero_point": True, "version": "gemm"},
         "INT4 MoE experts with group_size 24 are not supported"),
        ({**ct, "ignore": ["lm_head", "re:.*layers\\.3\\.mlp\\.experts\\.5\\..*"]},
         "layer 3's experts are partly quantized, partly left in float"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq int4_group MoE experts are not supported"),
    )  # fmt: skip
    for qc, message in cases:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf({**QWEN3_30B_A3B, "quantization_config": qc})
    c = ModelConfig.from_hf({**QWEN3_30B_A3B, "quantization_config": ct})
    assert c.moe is not None and c.moe.int4_group == 32 and c.moe.int4_layers == tuple(range(48))


def test_model_card_counts_the_experts_int4_bytes(qwen3_ct) -> None:
    """The install plan's weight bytes: the INT4 experts' words and scales as stored (not their weight_shape), the
    rest at the serving dtype's bytes."""
    from envex.installer.model_card import card_for_model

    path, _ = qwen3_ct
    card = card_for_model(path, "qwen3-int4")
    stored = load_file(str(path / "model.safetensors"))
    experts = [t for n, t in stored.items() if ".mlp.experts." in n and not n.endswith("weight_shape")]
    assert len(experts) == 2 * 8 * 3 * 2
    assert card.packed_parameters == sum(t.numel() for t in experts)
    assert card.packed_bytes == sum(t.numel() * t.element_size() for t in experts)
    assert card.weights_bytes(2) == (card.parameters - card.packed_parameters) * 2 + card.packed_bytes


def test_dummy_weights_fill_int4_experts_at_float_magnitudes(qwen3_ct) -> None:
    """--load-format dummy on an INT4 release's config: random words, scales giving the float spread, zeros 8."""
    assert dummy_experts(qwen3_ct[0]).int4
