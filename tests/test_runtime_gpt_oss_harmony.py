"""gpt-oss's harmony format: the output parser on token ids (a byte-level tokenizer with harmony's special tokens,
so characters split across tokens), and the chat route on a real server with the official client."""

from __future__ import annotations

import json
import random
from pathlib import Path

import openai
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.harmony import HarmonyStream, HarmonyTokens, split_output
from envex.runtime.server.app import build_app
from envex.runtime.server.async_engine import AsyncEngine
from envex.runtime.tokenizer import Tokenizer as EnvexTokenizer
from envex.tests.support.server import serve_in_thread

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
# A harmony-shaped chat template (ours, for the tests): system, user and assistant turns; the generation prompt
# opens an assistant header, as gpt-oss's does.
TEMPLATE = (
    '{{- "<|start|>system<|message|>Reasoning: medium\\n\\n# Valid channels: analysis, final.<|end|>" -}}'
    "{%- for m in messages -%}"
    '{%- if m.role == "user" -%}{{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}'
    '{%- elif m.role == "assistant" -%}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}'
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
GPT_OSS_TINY = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 512,
    "vocab_size": 263, "tie_word_embeddings": False, "eos_token_id": 260,  # <|return|>
    "quantization_config": {"quant_method": "mxfp4"},
}  # fmt: skip


def _backend() -> Tokenizer:
    """Byte-level, no merges: every byte is a token (ids 0-255), then harmony's special tokens (256-262)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


@pytest.fixture(scope="module")
def tok() -> EnvexTokenizer:
    return EnvexTokenizer(_backend(), {"chat_template": TEMPLATE, "eos_token": "<|return|>"})


def _ids(tok: EnvexTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


ANSWER = "<|channel|>analysis<|message|>User says hi; 日本 é.<|end|><|start|>assistant<|channel|>final<|message|>Hello, é 😀!<|return|>"  # noqa: E501


def test_harmony_tokens_found_only_in_a_harmony_tokenizer(tok: EnvexTokenizer) -> None:
    t = HarmonyTokens.of(tok)
    assert t is not None and (t.start, t.message, t.returns) == (256, 258, 260)
    plain = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    assert HarmonyTokens.of(EnvexTokenizer(plain, {})) is None


def test_split_reasoning_from_content(tok: EnvexTokenizer) -> None:
    t = HarmonyTokens.of(tok)
    assert t is not None
    ids = _ids(tok, ANSWER)
    assert split_output(tok, t, ids) == ("User says hi; 日本 é.", "Hello, é 😀!")
    # decoded with special tokens skipped, everything runs together: what the parser exists to undo
    assert tok.decode(ids) == "analysisUser says hi; 日本 é.assistantfinalHello, é 😀!"


@pytest.mark.parametrize("seed", range(4))
def test_streamed_in_any_chunks_equals_whole(tok: EnvexTokenizer, seed: int) -> None:
    """Fed in random chunks (a multi-byte character split between them), the deltas concatenate to the whole
    output's split and never carry a replacement character."""
    t = HarmonyTokens.of(tok)
    assert t is not None
    ids = _ids(tok, ANSWER)
    rng = random.Random(seed)
    stream = HarmonyStream(tok, t)
    reasoning, content, i = "", "", 0
    while i < len(ids):
        n = rng.randint(1, 4)
        r, c = stream.feed(ids[i : i + n])
        assert "\ufffd" not in r + c
        reasoning, content, i = reasoning + r, content + c, i + n
    r, c = stream.finish()
    assert (reasoning + r, content + c) == split_output(tok, t, ids)


def test_stop_strings_unfinished_bodies_and_no_structure(tok: EnvexTokenizer) -> None:
    t = HarmonyTokens.of(tok)
    assert t is not None
    ids = _ids(tok, ANSWER)
    assert split_output(tok, t, ids, stop=["é 😀"]) == ("User says hi; 日本 é.", "Hello, ")  # cut in its body
    cut = ids.index(t.returns) - 3  # max_tokens inside the answer (in the middle of the emoji's four bytes)
    assert split_output(tok, t, ids[:cut]) == ("User says hi; 日本 é.", "Hello, é ")
    assert split_output(tok, t, _ids(tok, "no harmony here")) == ("", "no harmony here")
    tool = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
    assert split_output(tok, t, _ids(tok, tool)) == ("", "{}")  # tool calls are not served: the body is content


def test_chat_route_parses_harmony(tmp_path: Path, tok: EnvexTokenizer) -> None:
    """A tiny gpt-oss (dummy weights, MXFP4 experts) behind the real server: the prompt goes through the model's
    chat template, and each answer's reasoning and content are the parse of its tokens, streamed or not."""
    model_dir = tmp_path / "gpt-oss-tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(GPT_OSS_TINY))
    _backend().save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE,
                                                                  "eos_token": "<|return|>"}))  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", load_format="dummy", kv_cache_memory_gb=0.01))
    messages = [{"role": "user", "content": "Say hi"}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|end|><|start|>assistant")
    want = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    t = HarmonyTokens.of(engine.tokenizer)
    assert t is not None
    reasoning, content = split_output(engine.tokenizer, t, want.token_ids)
    with serve_in_thread(build_app(AsyncEngine(engine))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="gpt-oss-tiny", messages=messages, max_tokens=12,
                                               temperature=0)  # fmt: skip
        message = reply.choices[0].message
        assert message.content == content and getattr(message, "reasoning_content", None) == (reasoning or None)
        chunks = list(client.chat.completions.create(model="gpt-oss-tiny", messages=messages, max_tokens=12,
                                                     temperature=0, stream=True))  # fmt: skip
        streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed_reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                                     for c in chunks if c.choices)  # fmt: skip
        assert (streamed_reasoning, streamed_content) == (reasoning, content)
        # the reasoning of an earlier turn may be sent back with its message
        again = client.chat.completions.create(model="gpt-oss-tiny", max_tokens=2, temperature=0, messages=[
            *messages, {"role": "assistant", "content": content, "reasoning_content": reasoning},
            {"role": "user", "content": "Again"}])  # fmt: skip
        assert again.choices[0].finish_reason in ("stop", "length")
