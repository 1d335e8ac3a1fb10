"""FP8 MoE releases (Qwen3-30B-A3B-FP8, DeepSeek-V3 / Kimi K2 / Moonlight: quantization_config "fp8", block scales
`weight_scale_inv`) on tiny random models written in that layout: the experts load as FP8 stacks and are served
so (kernels.ops.MoEWeights), the other projections dequantized at load; the engine's greedy tokens equal HF
transformers' in float32 on the dequantized weights (HF cannot load the FP8 checkpoint on the CPU), on the torch
backend and on the Triton one under the interpreter; a layer left in float by modules_to_not_convert stays float;
what is refused is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from envex.kernels import quant
from envex.kernels.accuracy import rel_err
from envex.kernels.ops import MoEWeights
from envex.runtime.config import ConfigError, ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.tests.test_runtime_deepseek import _hf_model as _deepseek_model
from envex.tests.test_runtime_gpt_oss import VOCAB, _write_tokenizer
from envex.tests.test_runtime_qwen3_moe import QWEN3_30B_A3B

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 9, 44, 12, 7, 8, 9, 100, 3], [1, 2]]
QWEN3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=256, tie_word_embeddings=False, norm_topk_prob=True, mlp_only_layers=[2],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
# sigmoid of a very negative gate overflows exp() under the interpreter (numpy warns; the result is right)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _qwen3_model() -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3)).eval()
    with torch.no_grad():  # decisive logits, as tests/test_runtime_qwen3_moe.py makes them
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0) if "experts" not in name else p.normal_(0.0, 4.0 * p.shape[-1] ** -0.5)
            else:
                p.normal_(1.0, 0.3)
    return model


def _release(model: transformers.PreTrainedModel, tmp: Path, block: list[int], skip: tuple[str, ...] = ()
             ) -> tuple[Path, transformers.PreTrainedModel]:  # fmt: skip
    """Write `model` as an FP8 release: every projection (`*_proj.weight`, and Qwen3-Next's in_proj_qkvz) but those
    whose name holds one of `skip` quantized by kernels.quant's fp8_block quantizer, with its `weight_scale_inv`,
    and the routers, the LM head and `skip` listed in modules_to_not_convert, as Qwen3-30B-A3B-FP8 lists its
    routers. -> (its directory, HF's model in float32 on the same weights dequantized)."""
    float_dir, fp8_dir = tmp / "dequantized", tmp / "fp8"
    model.save_pretrained(float_dir, safe_serialization=True)  # the published per-expert names
    stored = load_file(str(float_dir / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, w in stored.items():
        if name.endswith(("_proj.weight", "in_proj_qkvz.weight")) and not any(s in name for s in skip):
            q = quant.quantize_fp8(w, quant.FP8_BLOCK, (block[0], block[1]))
            fp8[name], fp8[f"{name}_scale_inv"] = q.data, q.scale
            dequantized[name] = quant.dequantize(q, torch.float32)
        else:
            fp8[name] = dequantized[name] = w
    save_file(dequantized, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    routers = sorted({n.removesuffix(".weight") for n in stored if n.endswith("mlp.gate.weight")})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": block,
                                     "modules_to_not_convert": ["lm_head", *routers, *skip]}  # fmt: skip
    fp8_dir.mkdir()
    (fp8_dir / "config.json").write_text(json.dumps(config))
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(fp8_dir)
    hf = type(model).from_pretrained(float_dir, dtype=torch.float32).eval()
    return fp8_dir, hf


def _engine(path: Path, backend: str = "torch") -> LLMEngine:
    """The engine on the CPU; backend "triton": its model runner on TritonOps (the kernels under the interpreter,
    which the engine's config refuses on a CPU device outside tests), the matrices back in row-major order (the
    CPU runner stores them column-major for BLAS)."""
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.02,
                                    max_model_len=64))  # fmt: skip
    if backend == "triton":
        from envex.kernels.triton_ops import TritonOps

        engine.runner.ops = TritonOps()
        for p in engine.runner.model.parameters():
            p.data = p.data.contiguous()
    return engine


def _hf_tokens(hf: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def qwen3_release(tmp_path_factory):
    # blocks of 16 x 32: every expert matrix is several blocks each way (the releases' 128 x 128 would be one)
    return _release(_qwen3_model(), tmp_path_factory.mktemp("qwen3_fp8"), [16, 32], skip=("layers.1.mlp.experts",))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qwen3_moe_fp8_release_gives_hf_tokens(qwen3_release, backend: str) -> None:
    path, hf = qwen3_release
    engine = _engine(path, backend)
    moe = engine.model_config.moe
    assert moe is not None and moe.fp8_block == (16, 32) and moe.fp8_layers == (0,)  # 1: float, 2: dense
    layers = engine.runner.model.layers
    assert layers[0].experts.fp8 and layers[0].gate_up_proj.dtype == torch.float8_e4m3fn
    assert not layers[1].experts.fp8 and layers[1].gate_up_proj.dtype == torch.float32
    assert not any(p.is_meta for p in engine.runner.model.parameters())
    assert engine.runner.packed == {"layers.0.gate_up_proj": quant.FP8_BLOCK, "layers.0.down_proj": quant.FP8_BLOCK}
    assert_greedy_like_hf(engine, hf, backend)


def assert_greedy_like_hf(engine: LLMEngine, hf: transformers.PreTrainedModel, backend: str, triton_tokens: int = 4
                          ) -> None:  # fmt: skip
    """The engine's greedy tokens are HF's (the first triton_tokens on the Triton ops: the interpreter's steps are
    slow); on the torch backend, which dequantizes exactly, HF's logits too, to float32 rounding."""
    n = GREEDY.max_tokens if backend == "torch" else triton_tokens
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == [_hf_tokens(hf, p)[:n] for p in PROMPTS]
    if backend == "torch":
        with torch.no_grad():
            want = hf(torch.tensor([PROMPTS[0]])).logits[0]
        assert rel_err(engine.full_logits(PROMPTS[0]), want) < 1e-5


def test_deepseek_v3_fp8_release_gives_hf_tokens(tmp_path: Path) -> None:
    """DeepSeek-V3's layout (Kimi K2, Moonlight): 128 x 128 blocks, the shared expert FP8 too (loaded as the
    stacks' last expert), MLA's projections dequantized at load."""
    path, hf = _release(_deepseek_model("v3"), tmp_path, [128, 128])
    engine = _engine(path)
    assert engine.model_config.moe.fp8_layers == (1, 2)  # layer 0 is dense; 2: the MTP layer (config's, not stored)
    experts = engine.runner.model.layers[1].experts
    assert experts.fp8 and experts.gate_up_scale.shape == (8 + 1, 2, 1)  # [E + shared, 2·ceil(32/128), ceil(64/128)]
    got = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [_hf_tokens(hf, p) for p in PROMPTS]


def test_unsupported_expert_schemes_are_one_line() -> None:
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    cases = (
        ({"quant_method": "gptq", "bits": 4, "group_size": 128},
         "gptq int4_group MoE experts are not supported; the expert kernels read FP8 block-scaled experts"),
        ({**fp8, "weight_block_size": [128, 8]}, r"weight_block_size \[128, 8\] is not supported for MoE experts"),
        ({**fp8, "modules_to_not_convert": ["model.layers.3.mlp.experts.5."]},
         "layer 3's experts are partly quantized, partly left in float"),
    )  # fmt: skip
    for qc, message in cases:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf({**QWEN3_30B_A3B, "quantization_config": qc})
    c = ModelConfig.from_hf({**QWEN3_30B_A3B, "quantization_config": {**fp8, "modules_to_not_convert": ["lm_head"] + [
        f"model.layers.{i}.mlp.gate" for i in range(48)]}})  # the published Qwen3-30B-A3B-FP8 config's list
    assert c.moe is not None and c.moe.fp8_block == (128, 128) and c.moe.fp8_layers == tuple(range(48))


def test_model_card_counts_the_experts_fp8_bytes(qwen3_release) -> None:
    """The install plan's weight bytes (ModelCard.weights_bytes): the FP8 experts and their scales as stored, the
    rest (the dequantized projections too) at the serving dtype's bytes."""
    from envex.installer.model_card import card_for_model

    path, _ = qwen3_release
    card = card_for_model(path, "qwen3-fp8")
    stored = load_file(str(path / "model.safetensors"))
    experts = [t for n, t in stored.items() if n.startswith("model.layers.0.mlp.experts.")]
    assert len(experts) == 8 * 3 * 2 and card.quantization == "fp8"
    assert card.packed_parameters == sum(t.numel() for t in experts)
    assert card.packed_bytes == sum(t.numel() * t.element_size() for t in experts)
    assert card.weights_bytes(2) == (card.parameters - card.packed_parameters) * 2 + card.packed_bytes
    assert card.weights_bytes(2) < card.parameters * 2


def test_dummy_weights_fill_fp8_experts_at_float_magnitudes(qwen3_release) -> None:
    """--load-format dummy on an FP8 release's config (benches): random codes and block scales whose experts have
    the float matrices' N(0, 1/sqrt(fan_in)) spread."""
    assert dummy_experts(qwen3_release[0]).fp8


def dummy_experts(path: Path) -> MoEWeights:
    """Layer 0's experts of the tiny Qwen3-MoE release at `path` filled by dummy_weights, checked to have the float
    matrices' spread (H 64)."""
    from envex.runtime.models import dummy_weights
    from envex.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(ModelConfig.from_hf(json.loads((path / "config.json").read_text())),
                                dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    dummy_weights(model, seed=3)
    w = model.layers[0].experts.gate_up_matrix().expert(5)  # [2I, H]
    assert abs(float(w.std()) * 64**0.5 - 1) < 0.1
    return model.layers[0].experts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_release_serves_on_cuda_with_graphs(qwen3_release) -> None:
    """On the GPU: the Triton backend (FP8 expert GEMVs at decode, replayed from CUDA graphs; the grouped kernels at
    prefill) against the torch backend on the same checkpoint: logits within 2%, greedy tokens equal. In float32:
    this test ran in bf16 until 2026-12-06 and failed on an H100 (rel_err 0.196 > 0.02); the CPU shows why, with the
    same kernels under the interpreter: in bf16 the torch backend itself is 0.20 from HF's float32 logits and the
    two backends 0.28 apart, two of eleven rows at 0.67-0.70 (a near-tie in the tiny random router rounded the other
    way: another expert), the rest at 0.02-0.04; in float32 they agree to 6e-7. Not yet rerun on a GPU."""
    path, _ = qwen3_release
    kw = dict(device="cuda", dtype="float32", max_model_len=64, num_kv_blocks=64)  # a tiny model's pool
    fast = LLMEngine(EngineConfig(model=str(path), backend="triton", **kw))  # type: ignore[arg-type]
    ref = LLMEngine(EngineConfig(model=str(path), backend="torch", **kw))  # type: ignore[arg-type]
    assert fast.runner.decode_graphs is not None and fast.runner.model.layers[0].experts.fp8
    assert rel_err(fast.full_logits(PROMPTS[0]), ref.full_logits(PROMPTS[0])) < 2e-2
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
