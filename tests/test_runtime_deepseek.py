"""DeepSeek-V3 and DeepSeek-V2 end to end on tiny random configs: Envex's model file (MLA over the latent cache,
DeepSeek's routing, shared experts, dense first layers) gives HF transformers' logits and greedy tokens from the
published checkpoint layout (save_pretrained's safetensors), through the real engine; the Triton ops under the
interpreter equal the torch ops (prefill, a chunk after cached tokens, decode); the configs read and what is
refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.runtime.config import DEEPSEEK_V2, DEEPSEEK_V3, ConfigError, ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.config import has_invariant_kernels
from envex.runtime.models import dummy_weights
from envex.runtime.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from envex.runtime.models.rope import rope_cos_sin
from envex.runtime.parallel.state import check_tensor_parallel
from envex.tests.support.kernels import eager_step
from envex.tests.test_runtime_gpt_oss import VOCAB, _write_tokenizer

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
              max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
CASES = {
    # q LoRA, grouped sigmoid routing with a correction bias, routed scaling, one shared expert; YaRN with mscale
    # and mscale_all_dim apart (attention_factor ≠ 1 and the softmax scale's mscale²)
    "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "mscale": 1.0, "mscale_all_dim": 0.8,
                                               "original_max_position_embeddings": 64})),  # fmt: skip
    # V2-Lite's shape: no q LoRA, softmax greedy routing, two shared experts
    "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(
        q_lora_rank=None, n_shared_experts=2, topk_method="greedy", routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}  # fmt: skip
PROMPTS = [[5, 17, 300, 9, 44, 12, 7, 8, 9, 100, 3, 3, 99], [1, 2], list(range(100, 121))]
# The published Moonlight-16B-A3B config.json (moonshotai/Moonlight-16B-A3B), the fields ModelConfig.from_hf reads.
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 163584,
    "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
    "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def _hf_model(case: str, seed: int = 0):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # decisive logits; norms away from 1, a correction bias away from 0: a dropped one shows
        for name, p in model.named_parameters():
            if "experts" in name and "shared" not in name:
                p.normal_(0.0, 4.0 * p.shape[-1] ** -0.5)
            elif p.dim() > 1:
                p.mul_(4.0)
            else:
                p.normal_(1.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    """(case, HF model, its save_pretrained dir): transformers writes the published per-expert layout."""
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp("deepseek") / request.param
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return request.param, model, path


def _prefill_logits(model: DeepseekV3ForCausalLM, ops, prompt: list[int], page: int = 4) -> torch.Tensor:
    """Logits at every position of one prompt, through the latent cache (blocks in reverse order)."""
    n, n_blocks = len(prompt), -(-len(prompt) // page)
    table = list(range(n_blocks))[::-1]
    caches = model.make_kv_caches(n_blocks, page, torch.float32, torch.device("cpu"))
    cos, sin = rope_cos_sin(model.config, 64, torch.device("cpu"))
    meta = AttentionMetadata(
        positions=torch.arange(n), slot_mapping=torch.tensor([table[p // page] * page + p % page for p in range(n)]),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), block_tables=torch.tensor([table], dtype=torch.int32),
        cos=cos, sin=sin, max_q_len=n, max_seq_len=n, seq_lens=torch.tensor([n], dtype=torch.int32),
    )  # fmt: skip
    with torch.inference_mode():
        hidden, residual = model(ops, torch.tensor(prompt), caches, meta)
        return model.compute_logits(ops, hidden, residual)


def test_checkpoint_matches_transformers(checkpoint) -> None:
    case, hf_model, path = checkpoint
    names = load_file(str(path / "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names  # the published layout
    assert {"model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= set(names)
    assert ("model.layers.0.self_attn.q_a_proj.weight" in names) == (case == "v3")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.02))
    model = engine.runner.model
    assert isinstance(model, DeepseekV3ForCausalLM) and isinstance(model, DeepseekV2ForCausalLM) == (case == "v2")
    assert [layer.sparse for layer in model.layers] == [False, True]
    # the latent cache: one row of kv_lora_rank + qk_rope_head_dim a token and layer, no V
    assert [tuple(t.shape[1:]) for c in engine.runner.kv_caches for t in c] == [(4, 40)] * 2
    ours = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, got in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got.token_ids == want[0, len(prompt):].tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPTS[2]])).logits[0]
    got = _prefill_logits(model, TorchOps(), PROMPTS[2])
    assert rel_err(got, want) < 1e-5
    assert torch.allclose(torch.log_softmax(got, -1), torch.log_softmax(want, -1), atol=1e-4)


def test_missing_and_unexpected_tensors_are_named(checkpoint) -> None:
    _, _, path = checkpoint
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, device=torch.device("cpu"))
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.shared_experts.up_proj.weight"]
    with pytest.raises(ValueError, match=r"1 tensors missing, e.g. \['model.layers.1.mlp.shared_experts.up_proj"):
        model.load_weights(weights.items())
    weights["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)  # layer 0 is dense
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.experts.0.up_proj.weight'"):
        model.load_weights(weights.items())


def test_the_model_card_sizes_the_latent_cache(checkpoint) -> None:
    """The installer's plan sizes the KV cache from the card: for MLA that is the model's own latent rows (one
    kv_lora_rank + qk_rope_head_dim row a token and layer), not 2 x KV heads x head_dim."""
    from envex.installer.model_card import card_for_model

    _, _, path = checkpoint
    card = card_for_model(path, "tiny-deepseek")
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert cfg.mla is not None and card.kv_latent_width == cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, device=torch.device("meta"))
    assert card.kv_bytes_per_token(2) * 16 == model.kv_cache_bytes_per_block(16, torch.bfloat16)


def test_one_forward_on_triton_ops_equals_the_reference() -> None:
    """The V3 model file on the Triton ops under the interpreter (mla_store_latent, mla_prefill_attention,
    mla_decode_attention, the MoE kernels with DeepSeek's routing handed over) equals it on the torch ops: prefill of
    two sequences over shuffled blocks, a chunk after cached tokens, a batch-2 decode step and a speculative verify
    step (two tokens a sequence, every row's logits). Batch 2: one row would take the GEMV kernels, slow here."""
    from envex.kernels.triton_ops import TritonOps
    from envex.tests.test_runtime_one_forward import PAGE, TOL, _Runner, _step

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = ModelConfig.from_hf({**_hf_model("v3").config.to_dict(), "architectures": [DEEPSEEK_V3]})
    model = DeepseekV3ForCausalLM(config, dtype=torch.float32, device=dev)
    dummy_weights(model, seed=1)
    cos, sin = rope_cos_sin(config, 64, dev)

    def runner(ops) -> _Runner:
        return _Runner(model=model, ops=ops, kv_caches=model.make_kv_caches(12, PAGE, torch.float32, dev), cos=cos,
                       sin=sin, device=dev, block_size=PAGE, max_model_len=64, model_config=config)  # fmt: skip

    ref_runner, fast = runner(TorchOps()), runner(TritonOps())
    tables = [[3, 7], [1, 5, 2]]
    prompts = [[4, 11, 29, 3, 8], [1, 2, 3, 5, 8, 13, 21, 34, 7, 11, 18]]
    steps = (("prefill", prompts, [0, 0], tables), ("chunk", [[22, 6, 1], [6, 30, 2, 2]], [5, 11], tables),
             ("decode", [[12], [19]], [8, 15], tables))  # fmt: skip
    for name, ids, starts, table in steps:
        want, got = _step(ref_runner, ids, starts, table), _step(fast, ids, starts, table)
        assert rel_err(got, want) < TOL, f"{name}: {rel_err(got, want):.2e}"

    def verify(runner: _Runner) -> torch.Tensor:
        tokens, meta, _ = eager_step([[3, 9], [27, 14]], [9, 16], tables, cos, sin, PAGE, dev)
        meta = dataclasses.replace(meta, q_per_seq=2)  # the absorbed decode kernel with q_len 2
        with torch.inference_mode():
            hidden, residual = model(runner.ops, tokens, runner.kv_caches, meta)
            return model.compute_logits(runner.ops, runner.ops.materialize(hidden, residual.dtype), residual)

    want, got = verify(ref_runner), verify(fast)
    assert rel_err(got, want) < TOL, f"verify: {rel_err(got, want):.2e}"


def test_published_moonlight_config() -> None:
    c = ModelConfig.from_hf(MOONLIGHT)
    assert c.architecture == DEEPSEEK_V3 and c.mla is not None and c.moe is not None
    assert (c.mla.q_lora_rank, c.mla.kv_lora_rank, c.mla.qk_rope_head_dim, c.head_dim) == (None, 512, 64, 64)
    assert c.mla.interleaved and c.mla.softmax_scale == pytest.approx(192**-0.5)
    assert (c.moe.num_experts, c.moe.top_k, c.moe.shared_experts, c.moe.dense_layers) == (64, 6, 2, (0,))
    assert (c.moe.scoring, c.moe.n_group, c.moe.topk_group, c.moe.routed_scaling_factor) == ("sigmoid", 1, 1, 2.446)
    # DeepSeek-V3's yarn: factor 40, mscale = mscale_all_dim = 1: cos/sin unscaled, the softmax scale times 1.873
    v3 = ModelConfig.from_hf({**MOONLIGHT, "q_lora_rank": 1536, "n_group": 8, "topk_group": 4, "rope_scaling": {
        "type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 4096}})  # fmt: skip
    assert v3.rope_yarn is not None and v3.rope_yarn.attention_factor == pytest.approx(1.0)
    assert v3.mla is not None and v3.mla.softmax_scale == pytest.approx(192**-0.5 * 1.3688879454113936**2)
    v2 = ModelConfig.from_hf({**MOONLIGHT, "architectures": [DEEPSEEK_V2], "topk_method": "greedy",
                              "scoring_func": "softmax"})  # fmt: skip
    assert v2.moe is not None and v2.moe.scoring == "softmax_greedy" and not v2.moe.norm_topk_prob
    for change, message in (
        ({"topk_method": "greedy"}, "topk_method 'greedy' with scoring_func 'sigmoid' is not supported for Deepseek"),
        ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 256]}},
         r"moe_intermediate_size 1408 is not a whole number of FP8 blocks \[128, 256\], which splitting 2 shared"),
        ({"n_group": 3}, "n_group 3 must divide n_routed_experts 64"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer, got 0"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for DeepseekV3ForCausalLM"),
    ):
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf({**MOONLIGHT, **change})


def test_deterministic_and_tensor_parallel_are_refused() -> None:
    assert not has_invariant_kernels(DEEPSEEK_V3) and not has_invariant_kernels(DEEPSEEK_V2)
    with pytest.raises(ValueError, match="deterministic: DeepseekV3ForCausalLM has no batch-invariant kernels yet "
                                         "\\(mixture-of-experts layers, multi-head latent attention\\)"):
        EngineConfig(model="m", deterministic=True).resolved(window=4096, cuda_available=False,
                                                             architecture=DEEPSEEK_V3)  # fmt: skip
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM is not supported under tensor parallelism yet"):
        check_tensor_parallel(ModelConfig.from_hf(MOONLIGHT), 2)
