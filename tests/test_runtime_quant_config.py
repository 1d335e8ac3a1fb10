"""A checkpoint's quantization_config read into per-layer weight schemes: the published configs of each format,
one clear ConfigError for each unsupported option (and, fuzzed, for anything malformed), and each scheme's
tensors read into the PackedWeight the kernels take."""

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.kernels import quant as q
from envex.runtime.config import ConfigError
from envex.runtime.quant_config import QuantConfig, WeightScheme, load_packed, quant_config_from_hf
from envex.tests.support.quant_packing import awq_pack, ct_pack, gptq_pack_weight, gptq_pack_zeros, int4_reference

# As the checkpoints publish them (DeepSeek-V3 and Qwen3-*-FP8; RedHatAI's Llama-3.1 FP8-dynamic and w4a16;
# Kimi K2 Thinking's INT4 experts; an AWQ and two GPTQ exports).
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
_FP8_ARGS = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
             "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
             "type": "float"}  # fmt: skip
_TOKEN_ACTS = {**_FP8_ARGS, "dynamic": True, "observer": None, "strategy": "token"}
CT_FP8_CHANNEL = {
    "config_groups": {"group_0": {"input_activations": _TOKEN_ACTS, "output_activations": None, "targets": ["Linear"],
                                  "weights": _FP8_ARGS}},
    "format": "float-quantized", "global_compression_ratio": 1.24, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed",
}  # fmt: skip
_INT4_ARGS = {"actorder": "weight", "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
              "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
              "type": "int"}  # fmt: skip
CT_W4A16 = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": _INT4_ARGS}},
    "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}  # fmt: skip
KIMI_K2_THINKING = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {**_INT4_ARGS, "actorder": None, "group_size": 32}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}  # fmt: skip
AWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
       "zero_point": True}  # fmt: skip
GPTQ_V1 = {"bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01, "desc_act": False, "group_size": 128,
           "model_file_base_name": None, "model_name_or_path": None, "quant_method": "gptq", "static_groups": False,
           "sym": True, "true_sequential": True}  # fmt: skip
GPTQ_V2_ASYM = {"bits": 4, "group_size": 32, "desc_act": False, "sym": False, "lm_head": False,
                "quant_method": "gptq", "checkpoint_format": "gptq_v2", "pack_dtype": "int32",
                "meta": {"quantizer": ["gptqmodel:2.2.0"]}}  # fmt: skip
PUBLISHED = [DEEPSEEK_FP8, CT_FP8_CHANNEL, CT_W4A16, KIMI_K2_THINKING, AWQ, GPTQ_V1, GPTQ_V2_ASYM]


def _parse(qc: Any) -> QuantConfig | None:
    return quant_config_from_hf({"architectures": ["LlamaForCausalLM"], "quantization_config": qc})


def _scheme(qc: dict[str, Any], module: str = "model.layers.0.mlp.down_proj") -> WeightScheme | None:
    got = _parse(qc)
    assert got is not None
    return got.scheme_for(module)


def test_published_configs() -> None:
    s = _scheme(DEEPSEEK_FP8)
    assert s is not None and (s.kind, s.block, s.activations) == (q.FP8_BLOCK, (128, 128), "dynamic")
    assert s.tensor_names() == ("weight", "weight_scale_inv")
    s = _scheme(CT_FP8_CHANNEL)
    assert s is not None and (s.kind, s.activations) == (q.FP8_CHANNEL, "dynamic")
    assert s.tensor_names() == ("weight", "weight_scale") and "input_scale" in s.optional_tensor_names()
    assert _scheme(CT_FP8_CHANNEL, "lm_head") is None
    s = _scheme(CT_W4A16)
    assert s is not None and (s.kind, s.group_size, s.symmetric) == (q.INT4_GROUP, 128, True)
    assert s.tensor_names() == ("weight_packed", "weight_scale", "weight_shape")
    kimi = _parse(KIMI_K2_THINKING)
    assert kimi is not None
    expert = kimi.scheme_for("model.layers.5.mlp.experts.17.down_proj")
    assert expert is not None and expert.group_size == 32
    for dense in ("model.layers.5.self_attn.q_a_proj", "model.layers.5.mlp.shared_experts.up_proj",
                  "model.layers.0.mlp.gate_proj", "lm_head"):  # fmt: skip
        assert kimi.scheme_for(dense) is None, dense
    s = _scheme(AWQ)
    assert s is not None and (s.layout, s.symmetric, s.group_size) == ("awq-gemm", False, 128)
    assert s.tensor_names() == ("qweight", "qzeros", "scales")
    s = _scheme(GPTQ_V1)
    assert s is not None and s.zero_plus_one and s.symmetric and s.optional_tensor_names() == ("g_idx",)
    assert _scheme(GPTQ_V1, "lm_head") is None
    s = _scheme(GPTQ_V2_ASYM)
    assert s is not None and not s.zero_plus_one and not s.symmetric and s.group_size == 32


def test_fp8_as_transformers_reads_it() -> None:
    """FineGrainedFP8Config: a missing weight_block_size is its default [128, 128]; MiniMax's ignored_layers is
    modules_to_not_convert (a substring of the module name); ue8m0 scales are read."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0", "ignored_layers": ["gate"]}
    got = _parse(qc)
    assert got is not None
    s = got.scheme_for("model.layers.0.self_attn.o_proj")
    assert s is not None and s.block == (128, 128)
    assert got.scheme_for("model.layers.0.block_sparse_moe.gate") is None
    data = torch.randn(130, 256).to(q.FP8_DTYPE)
    scale = torch.tensor([[0.5, 2.0], [4.0, 0.125]]).to(torch.float8_e8m0fnu)
    w = load_packed(s, {"weight": data, "weight_scale_inv": scale}, module="m")
    assert torch.equal(w.scale, scale.float())


def test_float_and_mxfp4_checkpoints_have_no_scheme() -> None:
    assert quant_config_from_hf({"architectures": ["LlamaForCausalLM"]}) is None
    assert _parse({"quant_method": "mxfp4"}) is None  # gpt-oss's experts: runtime/config.py reads them


def test_compressed_tensors_fp8_block_and_tensor() -> None:
    block = copy.deepcopy(CT_FP8_CHANNEL)
    block["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])
    s = _scheme(block)
    assert s is not None and (s.kind, s.block) == (q.FP8_BLOCK, (128, 128))
    assert s.tensor_names() == ("weight", "weight_scale")  # compressed-tensors' name, not DeepSeek's
    tensor = copy.deepcopy(CT_FP8_CHANNEL)
    tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    tensor["config_groups"]["group_0"]["input_activations"] = None
    s = _scheme(tensor)
    assert s is not None and (s.kind, s.activations) == (q.FP8_TENSOR, "none")


def _with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    *parents, last = path.split("/")
    node = out
    for p in parents:
        node = node[p]
    node[last] = value
    return out


_W = "config_groups/group_0/weights"
UNSUPPORTED = [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    (_with(DEEPSEEK_FP8, "fmt", "e5m2"), "fmt 'e5m2' is not supported"),
    (_with(DEEPSEEK_FP8, "weight_block_size", [128, 100]), "must be a power of two"),
    (_with(DEEPSEEK_FP8, "extra_option", 1), "unknown key 'extra_option'"),
    (_with(DEEPSEEK_FP8, "weight_block_size", None), "weight_block_size null (one scale per matrix)"),
    (_with(DEEPSEEK_FP8, "expert_dtype", "fp4"), "expert_dtype 'fp4' is not supported"),
    (_with(CT_FP8_CHANNEL, f"{_W}/symmetric", False), "asymmetric FP8 is not supported"),
    (_with(CT_FP8_CHANNEL, f"{_W}/num_bits", 4), "float with num_bits 4 is not supported"),
    (_with(CT_FP8_CHANNEL, "kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme is not supported"),
    (_with(CT_FP8_CHANNEL, "format", "int-quantized"), "format 'int-quantized' is not supported for FP8"),
    (_with(CT_W4A16, f"{_W}/num_bits", 8), "num_bits 8 is not supported; only 4-bit integer"),
    (_with(CT_W4A16, f"{_W}/actorder", "group"), "act-order groups with a g_idx"),
    (_with(CT_W4A16, f"{_W}/group_size", 100), "group_size 100 is not supported"),
    (_with(CT_W4A16, f"{_W}/strategy", "tensor"), "INT4 strategy 'tensor' is not supported"),
    (_with(CT_W4A16, f"{_W}/observer_kwargs2", {}), "unknown key 'observer_kwargs2'"),
    (_with(CT_W4A16, "config_groups/group_0/input_activations", _TOKEN_ACTS), "(W4A8) are not supported"),
    (_with(CT_W4A16, "config_groups/group_0/targets", ["Embedding"]), "class 'Embedding' is not supported"),
    (_with(CT_W4A16, "quantization_status", "frozen"), "only 'compressed' checkpoints"),
    (_with(CT_W4A16, "sparsity_config", {"format": "sparse-24-bitmask"}), "sparsity_config is not supported"),
    (_with(AWQ, "version", "gemv_fast"), "awq version 'gemv_fast' is not supported"),
    (_with(AWQ, "bits", 3), "awq bits 3 is not supported"),
    (_with(GPTQ_V1, "desc_act", True), "desc_act true (act-order groups"),
    (_with(GPTQ_V1, "checkpoint_format", "marlin"), "checkpoint_format 'marlin' is not supported"),
    (_with(GPTQ_V1, "bits", 8), "gptq bits 8 is not supported"),
    (_with(GPTQ_V2_ASYM, "dynamic", {"-:.*down_proj": {}}), "gptq dynamic (per-module overrides)"),
    ("fp8", "expected an object, got str"),
]


@pytest.mark.parametrize("qc,message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_is_one_line_naming_it(qc: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _parse(qc)
    text = str(e.value)
    assert message in text and "\n" not in text and text.startswith("config.json")


def test_act_order_with_static_groups_is_read() -> None:
    """static_groups keeps g_idx = k // group_size even with desc_act, so such a checkpoint reads (load_packed
    still checks its g_idx)."""
    assert _scheme(_with(_with(GPTQ_V1, "desc_act", True), "static_groups", True)) is not None


# ---- one layer's tensors ------------------------------------------------------------------------------------------


def _codes(*shape: int, lo: int = 0, hi: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed))


def test_load_packed_each_layout() -> None:
    n, k, g = 16, 128, 32
    # compressed-tensors pack-quantized, asymmetric
    s = _scheme(_with(_with(CT_W4A16, f"{_W}/symmetric", False), f"{_W}/group_size", g))
    assert s is not None and "weight_zero_point" in s.tensor_names()
    qs, zp = _codes(n, k, lo=-8, hi=8), _codes(n, k // g, lo=-8, hi=8, seed=1)
    scale = torch.rand(n, k // g).to(torch.bfloat16)
    w = load_packed(s, {"weight_packed": ct_pack(qs.to(torch.int8)), "weight_scale": scale,
                        "weight_shape": torch.tensor([n, k]), "weight_zero_point": ct_pack(zp.to(torch.int8), 0)},
                    module="m")  # fmt: skip
    assert torch.equal(q.dequantize(w, torch.float64), int4_reference(qs - zp.repeat_interleave(g, 1), scale, g))
    # AWQ
    s = _scheme(_with(AWQ, "group_size", g))
    assert s is not None
    u, z, sc = _codes(k, n), _codes(k // g, n, seed=2), torch.rand(k // g, n).half()
    w = load_packed(s, {"qweight": awq_pack(u), "qzeros": awq_pack(z), "scales": sc}, module="m")
    assert torch.equal(q.dequantize(w, torch.float64), int4_reference((u - z.repeat_interleave(g, 0)).t(), sc.t(), g))
    # GPTQ v1, symmetric, with its trivial g_idx and a bias the caller keeps
    s = _scheme(_with(GPTQ_V1, "group_size", g))
    assert s is not None
    z8 = torch.full((k // g, n), 8)
    g_idx = torch.arange(k, dtype=torch.int32) // g
    w = load_packed(s, {"qweight": gptq_pack_weight(u), "qzeros": gptq_pack_zeros(z8), "scales": sc,
                        "g_idx": g_idx, "bias": torch.zeros(n)}, module="m")  # fmt: skip
    assert w.zero is None
    assert torch.equal(q.dequantize(w, torch.float64), int4_reference((u - 8).t(), sc.t(), g))
    # DeepSeek FP8 block
    s = _scheme(DEEPSEEK_FP8)
    assert s is not None
    data = torch.randn(200, 130).to(q.FP8_DTYPE)
    w = load_packed(s, {"weight": data, "weight_scale_inv": torch.rand(2, 2)}, module="m")
    assert w.scheme == q.FP8_BLOCK and w.block == (128, 128)


def test_load_packed_names_what_is_wrong() -> None:
    s = _scheme(DEEPSEEK_FP8)
    assert s is not None
    data = torch.randn(8, 8).to(q.FP8_DTYPE)
    with pytest.raises(ConfigError, match=r"layers\.0\.q: missing tensor layers\.0\.q\.weight_scale_inv"):
        load_packed(s, {"weight": data}, module="layers.0.q")
    with pytest.raises(ConfigError, match=r"unexpected tensor layers\.0\.q\.qweight"):
        load_packed(s, {"weight": data, "weight_scale_inv": torch.ones(1, 1), "qweight": data}, module="layers.0.q")
    with pytest.raises(ConfigError, match=r"layers\.0\.q: fp8_block weight: scale must be float32 \[1, 1\]"):
        load_packed(s, {"weight": data, "weight_scale_inv": torch.ones(2, 1)}, module="layers.0.q")
    with pytest.raises(ConfigError, match="expected float8_e4m3fn"):
        load_packed(s, {"weight": data.float(), "weight_scale_inv": torch.ones(1, 1)}, module="layers.0.q")
    g = _scheme(_with(GPTQ_V1, "group_size", 32))
    assert g is not None
    z8 = torch.full((2, 8), 8)
    with pytest.raises(ConfigError, match="act-order"):
        load_packed(g, {"qweight": gptq_pack_weight(_codes(64, 8)), "qzeros": gptq_pack_zeros(z8),
                        "scales": torch.ones(2, 8).half(), "g_idx": torch.arange(64).flip(0) % 2},
                    module="m")  # fmt: skip


# ---- fuzz: anything malformed is one ConfigError line ---------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-300, 300) | st.floats(allow_nan=False, width=32) | st.text(max_size=8)
    | st.sampled_from(["group", "channel", "tensor", "block", "int", "float", "pack-quantized", "float-quantized",
                       "naive-quantized", "gemm", "gptq", "gptq_v2", "Linear", "re:(", "re:.*", "128x128"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((*prefix, key))
            out += _paths(value, (*prefix, key))
    return out


@st.composite
def _mutated(draw: st.DrawFn) -> Any:
    base = copy.deepcopy(draw(st.sampled_from(PUBLISHED)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(base)
        path = draw(st.sampled_from(paths)) if paths else ()
        node = base
        for p in path[:-1]:
            node = node[p]
        if path and draw(st.booleans()):
            del node[path[-1]]
        elif path:
            node[path[-1]] = draw(_json)
    return base


def _check_outcome(qc: Any) -> None:
    try:
        got = _parse(qc)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("config.json"), str(e)
        return
    if got is not None:  # a config that parses gives usable schemes
        for module in ("model.layers.0.mlp.down_proj", "lm_head"):
            s = got.scheme_for(module)
            if s is not None:
                assert s.kind in q.SCHEMES and s.tensor_names()
                s.optional_tensor_names()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated())
def test_fuzz_mutated_published_configs(qc: Any) -> None:
    _check_outcome(qc)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["fp8", "compressed-tensors", "awq", "gptq", "FP8", "other"]), _json)
def test_fuzz_random_configs(method: str, body: Any) -> None:
    _check_outcome({**body, "quant_method": method} if isinstance(body, dict) else body)
