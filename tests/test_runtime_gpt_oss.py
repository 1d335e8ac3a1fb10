"""gpt-oss end to end on tiny random configs: Envex gives HF transformers' greedy tokens and logits from the float
checkpoint that save_pretrained writes and from the published MXFP4 layout (experts kept packed); the model file
on the Triton ops equals it on the torch ops; the config, YaRN tables and dummy weights."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from envex.kernels import mxfp4
from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.runtime.config import ConfigError, ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.models import dummy_weights
from envex.runtime.models.gpt_oss import GptOssForCausalLM
from envex.runtime.models.rope import rope_cos_sin

VOCAB = 512
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=4,
            max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})
# Prompts longer than the window (4) and the block size (4), one shorter than both.
PROMPTS = [[5, 17, 300, 9, 44, 12, 7, 8, 9, 100, 3, 3, 99], [1, 2], list(range(100, 131))]
# The published gpt-oss-120b config.json (openai/gpt-oss-120b), as ModelConfig.from_hf must read it.
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


def _write_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(hf float model, its save_pretrained dir, the same weights in the published MXFP4 layout, HF on those)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY)).eval()
    with torch.no_grad():  # decisive logits, and sinks / biases far from 0 so a dropped one shows
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            if name.endswith(("sinks", "bias")):
                p.normal_(0.0, 0.5)
    root = tmp_path_factory.mktemp("gpt_oss")
    float_dir, packed_dir = root / "float", root / "mxfp4"
    model.save_pretrained(float_dir, safe_serialization=True)
    _write_tokenizer(float_dir)
    packed_dir.mkdir()
    tensors = {}
    for name, t in load_file(str(float_dir / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> packed [E, out, ...]
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4.quantize(t.transpose(1, 2))
        else:
            tensors[name] = t
    save_file(tensors, str(packed_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["quantization_config"] = GPT_OSS_120B["quantization_config"]
    (packed_dir / "config.json").write_text(json.dumps(cfg))
    _write_tokenizer(packed_dir)
    # HF dequantizes MXFP4 on a CPU; transformers 5.17 (the GPU machine's) does it to bf16 whatever `dtype` asks,
    # 5.24 to the dtype: .float() makes both the float32 model (MXFP4 values are exact in bf16, so nothing is lost).
    packed_hf = transformers.GptOssForCausalLM.from_pretrained(
        str(packed_dir), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
    ).float().eval()  # fmt: skip
    return model, float_dir, packed_dir, packed_hf


def _greedy_equals_hf(path: Path, hf_model, prompts: list[list[int]] = PROMPTS, **settings) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4,
                                    **(settings or {"kv_cache_memory_gb": 0.02})))  # fmt: skip
    ours = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got.token_ids == want[0, len(prompt):].tolist()
    return engine


def _prefill_logits(model: GptOssForCausalLM, ops, prompt: list[int], page: int = 4) -> torch.Tensor:
    """Logits at every position of one prompt, through the paged cache (blocks in reverse order)."""
    c = model.config
    n_blocks = -(-len(prompt) // page)
    table = list(range(n_blocks))[::-1]
    caches = [(torch.zeros(n_blocks, page, c.num_key_value_heads, c.head_dim),
               torch.zeros(n_blocks, page, c.num_key_value_heads, c.head_dim)) for _ in range(c.num_hidden_layers)]
    cos, sin = rope_cos_sin(c, 64, torch.device("cpu"))
    n = len(prompt)
    meta = AttentionMetadata(
        positions=torch.arange(n), slot_mapping=torch.tensor([table[p // page] * page + p % page for p in range(n)]),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), block_tables=torch.tensor([table], dtype=torch.int32),
        cos=cos, sin=sin, max_q_len=n, max_seq_len=n, seq_lens=torch.tensor([n], dtype=torch.int32),
    )  # fmt: skip
    with torch.inference_mode():
        hidden, residual = model(ops, torch.tensor(prompt), caches, meta)
        return model.compute_logits(ops, hidden, residual)


def test_float_checkpoint_matches_transformers(checkpoints) -> None:
    hf_model, float_dir, _, _ = checkpoints
    engine = _greedy_equals_hf(float_dir, hf_model)
    model = engine.runner.model
    assert isinstance(model, GptOssForCausalLM) and model.layers[0].gate_up_proj.dtype == torch.float32
    # Logits at every position of a 31-token prompt: the window (4), the sinks and YaRN all shape them.
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPTS[2]])).logits[0]
    assert rel_err(_prefill_logits(model, TorchOps(), PROMPTS[2]), want) < 1e-5


def test_window_layers_keep_only_their_window(checkpoints) -> None:
    """The window layers' K/V live in their own pool (runtime/engine/caches/window_kv.py): a sequence holds only the
    blocks its 4-token window can still see, freed ones are reused, and a preempted sequence (the 13-token
    prompt needs a 5th of the 12 blocks the 31-token one shares with it) recomputes into new blocks: the tokens
    stay HF's."""
    hf_model, float_dir, _, _ = checkpoints
    engine = _greedy_equals_hf(float_dir, hf_model, [PROMPTS[2], PROMPTS[0]], num_kv_blocks=12, max_model_len=48,
                               max_num_seqs=3)  # fmt: skip
    windows = engine.runner.windows
    assert engine.scheduler.num_preemptions > 0 and not engine.blocks.enable_prefix_caching
    assert windows is not None and windows.layers == [0, 2]
    assert engine.runner.kv_caches[0][0].shape[0] == windows.num_blocks  # 3 · (0 + 3) + 512 (a 2048 budget)
    assert engine.runner.kv_caches[1][0].shape[0] == 12
    engine.generate([[7] * 30], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    # after its last step a sequence holds ceil(3 / 4) + 1 blocks at most: 31 tokens -> blocks 6 and 7
    assert windows.num_used_blocks <= 2


def test_mxfp4_checkpoint_stays_packed_and_matches_transformers(checkpoints) -> None:
    _, _, packed_dir, packed_hf = checkpoints
    engine = _greedy_equals_hf(packed_dir, packed_hf)
    model = engine.runner.model
    params = dict(model.named_parameters())
    assert params["layers.0.gate_up_proj_blocks"].dtype == torch.uint8
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in params), "experts were dequantized"
    with torch.no_grad():
        want = packed_hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert rel_err(_prefill_logits(model, TorchOps(), PROMPTS[0]), want) < 1e-5


def test_the_gates_reference_dequantizes_mxfp4_itself_even_where_hub_kernels_would_load(checkpoints,
                                                                                      monkeypatch) -> None:
    """transformers asks the hub for its MXFP4 kernels wherever a `kernels` package imports and triton is new
    enough (both true here with transformers 5.25; patched so the test holds anywhere): offline that failed the
    load (`envex media references` on gpt-oss). The gates' reference (verify.reference.load_hf_model) dequantizes
    with transformers' own code and gives the model an explicit Mxfp4Config(dequantize=True) gives."""
    import transformers.quantizers.quantizer_mxfp4 as quantizer

    from envex.runtime.loader import resolve_model
    from envex.verify.reference import load_hf_model

    _, _, packed_dir, packed_hf = checkpoints
    monkeypatch.setattr(quantizer, "is_kernels_available", lambda: True)
    monkeypatch.setattr(quantizer, "is_triton_available", lambda *_: True)
    model = load_hf_model(resolve_model(str(packed_dir)))
    assert not [n for n, m in model.named_modules() if type(m).__name__.startswith("Mxfp4")]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, packed_hf(ids).logits)


def test_checkpoint_and_config_must_agree(checkpoints, tmp_path) -> None:
    _, float_dir, packed_dir, _ = checkpoints
    cfg = ModelConfig.from_hf(json.loads((float_dir / "config.json").read_text()))
    model = GptOssForCausalLM(cfg, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="MXFP4-packed experts but config.json has no quantization_config"):
        model.load_weights(load_file(str(packed_dir / "model.safetensors")).items())
    weights = load_file(str(float_dir / "model.safetensors"))
    del weights["model.layers.3.self_attn.sinks"]
    with pytest.raises(ValueError, match="1 tensors missing, e.g. \\['model.layers.3.self_attn.sinks'\\]"):
        model.load_weights(weights.items())


def test_published_120b_config() -> None:
    c = ModelConfig.from_hf(GPT_OSS_120B)
    assert c.architecture == "GptOssForCausalLM" and c.quantization == "mxfp4" and c.attention_bias
    assert c.moe is not None and (c.moe.num_experts, c.moe.top_k, c.moe.swiglu_alpha) == (128, 4, 1.702)
    assert c.layer_windows == (128, None) * 18 and c.sliding_window is None  # the engine serves the whole window
    assert c.rope_yarn is not None and (c.rope_yarn.factor, c.rope_yarn.truncate) == (32.0, False)
    assert c.rope_theta == 150000.0 and c.max_position_embeddings == 131072
    with pytest.raises(ConfigError, match="quantization 'awq' is not supported for gpt-oss"):
        ModelConfig.from_hf({**GPT_OSS_120B, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ConfigError, match="layer_types must list 36"):
        ModelConfig.from_hf({**GPT_OSS_120B, "layer_types": ["full_attention"]})


def test_yarn_tables_equal_transformers() -> None:
    config = transformers.GptOssConfig(**{**TINY, "head_dim": 64, "rope_parameters": {
        **GPT_OSS_120B["rope_scaling"], "rope_theta": 150000.0}})  # fmt: skip
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(config)
    positions = torch.arange(0, 5000, 7)
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    c = ModelConfig.from_hf({**config.to_dict(), "architectures": ["GptOssForCausalLM"]})
    cos, sin = rope_cos_sin(c, 5000, torch.device("cpu"))
    assert torch.equal(cos[positions], want_cos[0]) and torch.equal(sin[positions], want_sin[0])


def test_yarn_for_the_llama_family_too() -> None:
    """YaRN is read for any architecture (models/rope.py is shared): Qwen2's tables with HF's default truncation."""
    config = transformers.Qwen2Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32768, rope_parameters={
                                          "rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                          "original_max_position_embeddings": 8192})  # fmt: skip
    rotary = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding(config)
    positions = torch.arange(0, 20000, 13)
    want_cos, _ = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    c = ModelConfig.from_hf({**config.to_dict(), "architectures": ["Qwen2ForCausalLM"]})
    assert c.rope_yarn is not None and c.rope_yarn.truncate
    cos, _ = rope_cos_sin(c, 20000, torch.device("cpu"))
    assert torch.equal(cos[positions], want_cos[0, :, :32])  # HF repeats the half-table


def test_dummy_weights_build_packed_experts_from_the_config() -> None:
    cfg = ModelConfig.from_hf({**GPT_OSS_120B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                               "layer_types": None, "vocab_size": 128, "num_local_experts": 8,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})  # fmt: skip
    model = GptOssForCausalLM(cfg, dtype=torch.float32, device=torch.device("cpu"))
    dummy_weights(model, seed=3)
    layer = model.layers[1]
    assert layer.down_proj_blocks.shape == (8, 64, 3, 16) and layer.down_proj_blocks.dtype == torch.uint8
    std = float(mxfp4.dequantize(layer.gate_up_proj_blocks, layer.gate_up_proj_scales).std())
    assert 64**-0.5 / 1.5 < std < 64**-0.5 * 1.5
    logits = _prefill_logits(model, TorchOps(), [3, 1, 4, 1, 5, 9, 2, 6])
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_one_forward_on_triton_ops_equals_the_reference() -> None:
    """The gpt-oss model file on the Triton ops (attention with sinks and a 6-token window over pages of 8, the
    MXFP4 MoE kernels: GEMV at one and two rows, grouped at more) equals it on the torch ops: prefill, a chunk
    after cached tokens, batch-1 decode and the decode graphs' step. (Float experts: tests/test_kernels_moe.py.)"""
    from envex.kernels.triton_ops import TritonOps
    from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
    from envex.tests.test_runtime_one_forward import PAGE, TOL, _Runner, _step

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = {**GPT_OSS_120B, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "layer_types": None,
          "vocab_size": 40, "num_local_experts": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "sliding_window": 6, "max_position_embeddings": 128}  # fmt: skip
    config = ModelConfig.from_hf(hf)
    model = GptOssForCausalLM(config, dtype=torch.float32, device=dev)
    dummy_weights(model, seed=1)
    with torch.no_grad():
        for layer in model.layers:
            layer.sinks.normal_(0.0, 1.0)
    cos, sin = rope_cos_sin(config, 64, dev)

    def runner(ops) -> _Runner:
        caches = [(torch.zeros(12, PAGE, 2, 16, device=dev), torch.zeros(12, PAGE, 2, 16, device=dev))
                  for _ in range(config.num_hidden_layers)]  # fmt: skip
        return _Runner(model=model, ops=ops, kv_caches=caches, cos=cos, sin=sin, device=dev, block_size=PAGE,
                       max_model_len=64, model_config=config)  # fmt: skip

    ref, fast = runner(TorchOps()), runner(TritonOps())
    tables = [[3, 7], [1, 5, 2]]
    prompts = [[4, 11, 29, 3, 8], [1, 2, 3, 5, 8, 13, 21, 34, 7, 11, 18]]
    for name, ids, starts in (("prefill", prompts, [0, 0]), ("chunk", [[22, 6, 1], [6, 30, 2, 2]], [5, 11])):
        want, got = _step(ref, ids, starts, tables), _step(fast, ids, starts, tables)
        assert rel_err(got, want) < TOL, f"{name}: {rel_err(got, want):.2e}"
    want, got = _step(ref, [[30]], [8], tables[:1]), _step(fast, [[30]], [8], tables[:1])
    assert rel_err(got, want) < TOL, f"batch-1 decode: {rel_err(got, want):.2e}"
    graphs = DecodeGraphs(fast, max_batch=2, capture=dev.type == "cuda")
    want = _step(ref, [[12], [19]], [9, 15], tables)
    got = graphs.run([12, 19], [9, 15], tables)
    assert rel_err(got, want) < TOL, f"graph decode: {rel_err(got, want):.2e}"
