"""Qwen3-Next FP8 releases (Qwen/Qwen3-Next-80B-A3B-Instruct-FP8: quantization_config "fp8", e4m3, block scales
`weight_scale_inv`) on the tiny random Qwen3-Next of tests/test_runtime_qwen3_next.py written in that layout by
tests/test_runtime_moe_fp8.py's release writer (every `*_proj.weight` and in_proj_qkvz FP8 in 16 x 16 blocks, the
routers and one in_proj_ba listed in modules_to_not_convert, the in_proj_ba and shared-expert gates stored float
though the config does not list them), plus an `mtp.*` module quantized alike (its fc too). The routed experts load
as FP8 stacks, the attention, Gated DeltaNet, shared-expert and dense projections as packed FP8 matrices
(tests/test_runtime_qwen3_next_fp8_packed.py), served so; the engine's logits and greedy tokens equal HF
transformers' in float32 on the dequantized weights (torch ops, and the Triton ops under the interpreter); a
missing scale is one line; the MTP module keeps its experts and layer FP8 (its fc dequantized), gives HF's MtpLayer
logits, and drafting with it leaves the greedy output unchanged; --load-format dummy fills the FP8 stacks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

from envex.kernels import quant
from envex.kernels.accuracy import rel_err
from envex.kernels.torch_ops import TorchOps
from envex.runtime.config import ConfigError, ModelConfig
from envex.runtime.engine import SamplingParams
from envex.runtime.loader import load_model_info
from envex.runtime.models import dummy_weights
from envex.runtime.models.qwen3_next import Qwen3NextForCausalLM
from envex.runtime.packed_load import load_dequantized, load_mtp_weights
from envex.runtime.quant_config import quant_config_from_hf
from envex.tests.test_runtime_moe_fp8 import PROMPTS, _engine, _release, assert_greedy_like_hf
from envex.tests.test_runtime_mtp import _blocks, _prefill, transformers_mtp
from envex.tests.test_runtime_qwen3_next import PUBLISHED, TINY, save_tiny_checkpoint
from envex.tests.test_runtime_qwen3_next import _engine as _next_engine

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
BLOCK = [16, 16]  # several blocks to every matrix at these widths; in_proj_ba's 8 rows: one partial block
N = TINY["num_hidden_layers"]  # the MTP layer's index (MoEConfig.fp8_layers)
H = TINY["hidden_size"]
FULL = 1  # a full-attention MoE layer of TINY: the MTP layer's kind (HF MtpLayer's layer_idx)
CPU = torch.device("cpu")
# the published FP8 release's config, as Qwen writes it (modules_to_not_convert: lm_head and the small gates)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", *(f"model.layers.{i}.{m}" for i in range(48) for m in (
                  "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba"))]}  # fmt: skip


def _release_with_mtp(tmp: Path) -> tuple[Path, transformers.PreTrainedModel, torch.nn.Module, dict]:
    """The tiny Qwen3-Next with one more full-attention MoE layer (index N) written as an FP8 release, that layer
    then renamed mtp.layers.0.* (the MTP module's decoder layer, quantized as the release quantizes a layer) beside
    the module's fc (FP8 too) and norms, and config.json back to N layers. -> (its directory, HF's N-layer model on
    the dequantized weights, HF's layer N (the MTP block, dequantized), the module's own tensors dequantized)."""
    types = ["linear_attention", "full_attention"] * (N // 2) + ["full_attention"]
    big = save_tiny_checkpoint(tmp / "float", num_hidden_layers=N + 1, layer_types=types)
    path, hf_big = _release(big, tmp, BLOCK, skip=("layers.2.linear_attn.in_proj_ba",))
    layer, stored = f"model.layers.{N}.", load_file(str(path / "model.safetensors"))
    renamed = {f"mtp.layers.0.{k.removeprefix(layer)}" if k.startswith(layer) else k: v for k, v in stored.items()}
    gen = torch.Generator().manual_seed(1)
    own = {f"mtp.{n}.weight": torch.randn(H, generator=gen) * 0.3 + 0.3 for n in ("pre_fc_norm_embedding",
                                                                                  "pre_fc_norm_hidden", "norm")}
    fc = quant.quantize_fp8(torch.randn(H, 2 * H, generator=gen) * (2 * H) ** -0.5 * 4, quant.FP8_BLOCK, (16, 16))
    renamed |= own | {"mtp.fc.weight": fc.data, "mtp.fc.weight_scale_inv": fc.scale}
    save_file({k: v.contiguous() for k, v in renamed.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": N, "layer_types": types[:N]}))
    small = copy.deepcopy(hf_big.config)
    small.num_hidden_layers, small.layer_types = N, types[:N]
    hf = type(hf_big)(small).eval()
    hf.load_state_dict({k: v for k, v in hf_big.state_dict().items() if not k.startswith(layer)})
    return path, hf, hf_big.model.layers[N], own | {"mtp.fc.weight": quant.dequantize(fc, torch.float32)}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return _release_with_mtp(tmp_path_factory.mktemp("qwen3_next_fp8"))


def test_the_published_fp8_config_keeps_the_experts_fp8() -> None:
    """The published 80B's config with Qwen's FP8 quantization_config: every layer's routed experts FP8 in
    128 x 128 blocks, and the MTP layer's (index 48) unless the config leaves it float; INT4 experts refused."""
    moe = ModelConfig.from_hf({**PUBLISHED, "quantization_config": FP8_CONFIG}).moe
    assert moe is not None and moe.fp8_block == (128, 128) and moe.fp8_layers == tuple(range(49))
    skip_mtp = {**FP8_CONFIG, "modules_to_not_convert": [*FP8_CONFIG["modules_to_not_convert"], "mtp"]}
    assert ModelConfig.from_hf({**PUBLISHED, "quantization_config": skip_mtp}).moe.fp8_layers == tuple(range(48))
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    with pytest.raises(ConfigError, match=r"^config.json: INT4 experts are not supported for Qwen3-Next yet; serve "):
        ModelConfig.from_hf({**PUBLISHED, "quantization_config": awq})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_release_gives_hf_logits_and_tokens(release, backend: str) -> None:
    path, hf, _, _ = release
    engine = _engine(path, backend)
    moe, model = engine.model_config.moe, engine.runner.model
    assert moe is not None and moe.fp8_block == (16, 16) and moe.fp8_layers == (0, 1, 3, N)  # 2: dense
    assert engine.model_config.hybrid.fp8_layers == (0, 1, 2, 3, N)  # the other projections: every layer's
    own = {0: ("in_proj", "out_proj", "shared_proj", "shared_down"), 2: ("in_proj", "out_proj"),
           1: ("qkvg_proj", "o_proj", "shared_proj", "shared_down")}  # layer 3 as 1, and 2's dense MLP as experts
    assert engine.runner.packed == {f"layers.{i}.{p}": quant.FP8_BLOCK for i, ps in (*own.items(), (3, own[1]))
                                    for p in ps} | {f"layers.{i}.{p}": quant.FP8_BLOCK for i in (0, 1, 2, 3)
                                                    for p in ("gate_up_proj", "down_proj")}  # fmt: skip
    assert model.layers[1].experts.fp8 and model.layers[1].gate_up_proj_scale.shape == (8, 2 * 2, 4)
    assert all(isinstance(w, quant.PackedWeight) for w in (model.layers[0].in_proj_weight,
               model.layers[1].qkvg_proj_weight, model.layers[3].shared_proj_weight))  # kept FP8 (packed test)
    assert {model.layers[0].in_proj_ba_weight.dtype, model.layers[3].shared_gate_weight.dtype} == {torch.float32}
    assert_greedy_like_hf(engine, hf, backend)
    if backend == "triton":  # the FP8 expert kernels and the dequantized projections under the interpreter
        with torch.no_grad():
            want = hf(torch.tensor([PROMPTS[0]])).logits[0]
        assert rel_err(engine.full_logits(PROMPTS[0]), want) < 1e-4


def test_a_missing_or_stray_scale_is_one_line(release) -> None:
    """An expert's block scale left out: the model's missing-tensor line; a dequantized projection's: its
    layer's; FP8 experts in a layer the config leaves float, or float ones where it makes them FP8: the expert,
    before anything is cast."""
    path, _, _, _ = release
    hf_config = json.loads((path / "config.json").read_text())
    stored = load_file(str(path / "model.safetensors"))

    def load(drop: str, cfg: dict = hf_config) -> None:
        qc = quant_config_from_hf(cfg)
        assert qc is not None
        model = Qwen3NextForCausalLM(ModelConfig.from_hf(cfg), dtype=torch.float32, device=CPU)
        load_dequantized(model, ((k, v) for k, v in sorted(stored.items()) if k != drop), qc, CPU)  # names in order

    expert = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=rf"^weights: 1 tensors missing, e\.g\. \['{expert}'\]; the checkpoint is "):
        load(expert)
    scale = "model.layers.0.linear_attn.out_proj.weight_scale_inv"  # a packed projection's: the same line
    with pytest.raises(ValueError, match=rf"^weights: 1 tensors missing, e\.g\. \['{scale}'\]; the checkpoint is "):
        load(scale)
    float_experts = {**hf_config, "quantization_config": {**hf_config["quantization_config"],
                                                          "modules_to_not_convert": ["lm_head", "mlp.gate", "experts"]}}
    with pytest.raises(ValueError, match=r"^weights: 'model.layers.0.mlp.experts.0.down_proj.weight' is stored "
                                         r"torch.float8_e4m3fn where config.json's quantization_config makes this "
                                         r"layer's experts torch.float32; the config's modules_to_not_convert"):
        load("", float_experts)
    stored[expert.removesuffix("_scale_inv")] = torch.zeros(H, TINY["moe_intermediate_size"])  # float, unlisted
    with pytest.raises(ValueError, match=r"^weights: 'model.layers.1.mlp.experts.3.down_proj.weight' is stored "
                                         r"torch.float32 where .* makes this layer's experts torch.float8_e4m3fn"):
        load(expert)


def test_the_fp8_mtp_module_gives_transformers_mtp_layer_logits(release) -> None:
    """load_mtp_weights on the FP8 release: the module's experts FP8 (its index among MoEConfig.fp8_layers), its
    fc and attention dequantized; its logits and the state it chains on are HF's MtpLayer over the dequantized
    weights (tests/test_runtime_qwen3_next_mtp.py's comparison)."""
    path, hf, block, own = release
    loaded = load_model_info(str(path))
    model = Qwen3NextForCausalLM(loaded.config, dtype=torch.float32, device=CPU)
    qc = quant_config_from_hf(loaded.hf_config)
    assert qc is not None
    with torch.no_grad():
        load_dequantized(model, loaded.iter_weights(skip=("mtp.",)), qc, CPU)  # the embedding and head it reads
        module = model.multi_token_predictor()
        load_mtp_weights(module, loaded, CPU)
    assert module.layer.experts.fp8 and module.fc.dtype == torch.float32  # fc dequantized, the layer packed
    assert isinstance(module.layer.qkvg_proj_weight, quant.PackedWeight)
    assert "mtp.layers.0.mlp.experts.7.up_proj.weight_scale_inv" in module.expected_weight_names()
    prompt = PROMPTS[0]
    t, tokens = len(prompt), torch.tensor(prompt)
    hidden = torch.randn(t, H, generator=torch.Generator().manual_seed(2)) * 3
    weights = [own[f"mtp.{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")]
    out, want = transformers_mtp(hf, (Qwen3NextDecoderLayer, Qwen3NextRMSNorm, FULL), block, *weights, tokens,
                                 hidden)  # fmt: skip
    ops, cache = TorchOps(), module.make_kv_cache(_blocks(t), 4, torch.float32, CPU)
    with torch.inference_mode():
        got, chained = module.compute_logits(ops, *module(ops, tokens, hidden, cache, _prefill(module.config, t)))
    assert rel_err(got, want) < 1e-5 and rel_err(chained, out) < 1e-5


def test_greedy_output_with_fp8_mtp_drafts_is_the_plain_output(release) -> None:
    path, _, _, _ = release
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in _engine(path).generate(PROMPTS, params)]
    spec = _next_engine(path, draft_model="mtp", num_speculative_tokens=2)
    assert spec.spec.drafter.module.layer.experts.fp8
    assert [c.token_ids for c in spec.generate(PROMPTS, params)] == want
    assert spec.stats().spec_draft_tokens_total > 0


def test_dummy_weights_fill_the_fp8_experts(release) -> None:
    """--load-format dummy on the FP8 config (the GPU matrix's qwen3-next-fp8 cell): the model's and the MTP
    module's FP8 stacks filled with codes and block scales at the float matrices' N(0, 1/sqrt(fan_in)) spread."""
    path, _, _, _ = release
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = Qwen3NextForCausalLM(config, dtype=torch.float32, device=CPU)
    dummy_weights(model, seed=3)
    module = model.multi_token_predictor()
    dummy_weights(module, seed=4)
    for experts in (model.layers[1].experts, module.layer.experts):
        assert experts.fp8
        assert abs(float(experts.gate_up_matrix().expert(5).std()) * H**0.5 - 1) < 0.1
        assert bool((experts.down_scale == TINY["moe_intermediate_size"] ** -0.5).all())
    engine = _next_engine(path, load_format="dummy")
    assert engine.runner.model.layers[3].experts.fp8 and len(engine.generate(PROMPTS[:1], SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True))[0].token_ids) == 2  # fmt: skip


def test_the_model_card_counts_the_fp8_experts_and_projections_as_stored(release) -> None:
    """The install plan's bytes: the model's and the MTP module's FP8 experts and other FP8 projections with their
    scales as stored (the MTP layer's index, num_hidden_layers, is among fp8_layers), everything else, the
    dequantized MTP fc and the float gates too, at the serving dtype's bytes."""
    from envex.installer.model_card import card_for_model

    path, _, _, _ = release
    card = card_for_model(path, "qwen3-next-fp8")
    stored = load_file(str(path / "model.safetensors"))
    experts = [t for n, t in stored.items() if ".mlp.experts." in n]
    assert len(experts) == 4 * 8 * 3 * 2 and card.quantization == "fp8"  # layers 0, 1, 3 and the MTP layer
    kept = [t for n, t in stored.items() if (t.dtype == quant.FP8_DTYPE or n.endswith("_scale_inv"))
            and not n.startswith("mtp.fc.")]  # fmt: skip
    assert len(kept) - len(experts) == 2 * (5 + 7 + 5 + 7 + 7)  # layers 0-3, MTP: qkvz, out or q, k, v, o; 3 MLP
    assert card.packed_parameters == sum(t.numel() for t in kept)
    assert card.packed_bytes == sum(t.numel() * t.element_size() for t in kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_release_serves_on_cuda_with_graphs(release) -> None:
    """On the GPU: the Triton backend (FP8 expert GEMVs at decode and the Gated DeltaNet kernels, replayed from
    CUDA graphs) against the torch backend on the same FP8 checkpoint, in float32 (test_runtime_moe_fp8.py's GPU
    test says why not bf16): logits within 2%, greedy tokens equal, and with MTP drafts the same tokens."""
    from envex.runtime.engine import EngineConfig, LLMEngine

    path, _, _, _ = release
    kw = dict(device="cuda", dtype="float32", max_model_len=64, num_kv_blocks=64)  # a tiny model's pool
    fast = LLMEngine(EngineConfig(model=str(path), backend="triton", **kw))  # type: ignore[arg-type]
    ref = LLMEngine(EngineConfig(model=str(path), backend="torch", **kw))  # type: ignore[arg-type]
    assert fast.runner.decode_graphs is not None and fast.runner.model.layers[1].experts.fp8
    assert rel_err(fast.full_logits(PROMPTS[0]), ref.full_logits(PROMPTS[0])) < 2e-2
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in ref.generate(PROMPTS, greedy)]
    assert [o.token_ids for o in fast.generate(PROMPTS, greedy)] == want
    spec = LLMEngine(EngineConfig(model=str(path), backend="triton", draft_model="mtp", num_speculative_tokens=2,
                                  **kw))  # type: ignore[arg-type]
    assert [o.token_ids for o in spec.generate(PROMPTS, greedy)] == want
