"""The engine's torch backend against HF transformers on the same weights (float32, CPU): identical tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from envex.runtime.engine import SamplingParams
from envex.runtime.loader import embedded_model_path

PROMPTS = [
    "Once upon a time",
    "The theory of relativity says that",
    "def fibonacci(n):",
    "List three fruits:",
    "Translate to French: good morning",
    "The capital of Japan is",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n\n# compute the mean of an array\n",
    "In 1969, astronauts",
    "Write a haiku about the sea.",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "My favourite recipe for pancakes:",
    "Photosynthesis is the process by which",
    "1, 2, 3, 5, 8, 13,",
    "Dear Sir or Madam,",
    "The best way to learn a language is",
    "<html>\n<head>\n",
    "Here is a joke about computers:",
    "Water boils at",
    ]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with \"quotes\" & <tags>?"},
    ],
    [{"role": "user", "content": "Ünïcödé — 日本語 🙂"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_next_tokens(model, ids: list[int], continuation: list[int]) -> list[int]:
    """HF's greedy choice after the prompt and after each prefix of `continuation`: one forward of HF's own model
    over prompt + continuation[:-1] (teacher forcing). Greedy decoding's token t is the argmax after the prompt
    and tokens 0..t-1, so a continuation equal to this list is exactly HF's greedy output, and the first token
    where ours differs is where HF's greedy output differs, never stopping at EOS. One forward per prompt, where
    decoding one token at a time took 64 (152 s against 13 s for the 20 prompts on one core)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + continuation[:-1]]), use_cache=False).logits[0, len(ids) - 1 :]
    return logits.argmax(-1).tolist()


@pytest.mark.slow
def test_greedy_tokens_identical_to_transformers(embedded_engine, hf_reference):
    engine = embedded_engine
    encoded = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = engine.generate(encoded, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert len(PROMPTS) >= 20
    for ids, got in zip(encoded, ours, strict=True):
        assert len(got.token_ids) == 64 and got.finish_reason == "length"
        ref = hf_next_tokens(hf_reference, ids, got.token_ids)
        assert got.token_ids == ref, f"diverged for prompt {engine.tokenizer.decode(ids)!r}"


def test_capital_of_france(embedded_engine):
    engine = embedded_engine
    text = engine.tokenizer.apply_chat_template(CHATS[0])
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    out = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.tokenizer.eos_token_ids


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(embedded_engine, hf_tokenizer, messages, add_generation_prompt):
    ours = embedded_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert embedded_engine.tokenizer.encode(ours, add_special_tokens=False) == hf_tokenizer(
        ref, add_special_tokens=False
    ).input_ids


def test_tokenizer_roundtrip_matches_transformers(embedded_engine, hf_tokenizer):
    for text in PROMPTS + ["  leading spaces", "tabs\tand\nnewlines", "emoji 🙂 and ünïcode"]:
        ids = embedded_engine.tokenizer.encode(text)
        assert ids == hf_tokenizer(text).input_ids
        assert embedded_engine.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_the_gates_reference_loads_the_gguf_as_transformers_does(hf_reference) -> None:
    """verify.reference.load_hf_model memoizes gguf's tensor-name map and file reader while transformers reads the
    GGUF (it rebuilt the map for every module and parsed the file twice: 21 of 29 s); the weights are
    transformers' own plain load's, bit for bit, and gguf's functions are themselves again afterwards."""
    import gguf

    from envex.runtime.loader import resolve_model
    from envex.verify.reference import _gguf_memoized, load_hf_model

    path = embedded_model_path()
    originals = (gguf.get_tensor_name_map, gguf.GGUFReader)
    with _gguf_memoized():
        arch = next(iter(gguf.MODEL_ARCH_NAMES))
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.GGUFReader(path) is gguf.GGUFReader(str(path))
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == originals
    model = load_hf_model(resolve_model(str(path)))
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == originals
    ours, theirs = model.state_dict(), hf_reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert model.config.to_dict() == hf_reference.config.to_dict()
