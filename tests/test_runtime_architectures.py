"""Every supported architecture, as a tiny random HF checkpoint on disk, gives HF transformers' greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from envex.runtime.config import ConfigError, ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.loader import ModelNotFoundError, resolve_model

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)

ARCHS = {
    "llama3.1": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
}


def _make_model_dir(tmp_path, embedded_engine, name):
    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    config = config_cls(**TINY, **extra)
    model = model_cls(config).eval()
    with torch.no_grad():  # make the logits decisive enough that argmax is not a coin flip between near-ties
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    out = tmp_path / name
    model.save_pretrained(out, safe_serialization=True)
    embedded_engine.tokenizer._backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return out, model


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_architecture_matches_transformers(tmp_path, embedded_engine, name):
    path, hf_model = _make_model_dir(tmp_path, embedded_engine, name)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory_gb=0.05))
    assert engine.model_config.architecture == type(hf_model).__name__
    prompts = ["Hello there", "def f(x):", "One two three four five six seven eight nine ten eleven"]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    ours = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt_ids, got in zip(ids, ours, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0,
                                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        assert got.token_ids == ref[0, len(prompt_ids):].tolist()


def test_unknown_architecture_lists_supported():
    with pytest.raises(ConfigError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})


def test_bad_model_arguments_say_what_is_accepted(tmp_path):
    with pytest.raises(ModelNotFoundError, match="HF model directory, a .gguf file"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
