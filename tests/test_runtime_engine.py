"""Engine behaviour on the embedded model: batching, chunked prefill, preemption, prefix reuse, sampling, stops."""

from __future__ import annotations

import pytest

from envex.runtime.engine import EngineConfig, EngineError, LLMEngine, PromptTooLongError, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [f"Fact number {i} about the ocean:" for i in range(8)] + [
    "def add(a, b):", "The three primary colours are", "Once upon a time, in a small village,",
    "Q: What is the boiling point of water?\nA:", "A list of prime numbers: 2, 3, 5,", "Dear diary, today",
    "The history of Rome begins", "import os\nimport sys\n",
]


@pytest.fixture(scope="module")
def alone(embedded_engine):
    """Each prompt's greedy tokens when it runs on its own."""
    return [embedded_engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_sixteen_concurrent_requests_answer_as_alone(embedded_engine, alone):
    assert len(PROMPTS) == 16
    together = embedded_engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in together] == alone
    assert embedded_engine.stats().num_running == 0


def test_requests_joining_mid_flight_answer_as_alone(embedded_engine, alone):
    engine = embedded_engine
    got: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:  # a new request joins every third step
            i, p = pending.pop(0)
            engine.add_request(f"join-{i}", engine.tokenizer.encode(p), GREEDY)
            got[f"join-{i}"] = []
        for out in engine.step():
            got[out.request_id] += out.token_ids
        steps += 1
    assert [got[f"join-{i}"] for i in range(len(PROMPTS))] == alone


@pytest.mark.parametrize("speculative", [0, 4])
def test_chunked_prefill_and_preemption_do_not_change_answers(alone, speculative):
    # 8 blocks of 16 tokens cannot hold 16 sequences at once: the scheduler must preempt and recompute.
    small = LLMEngine(EngineConfig(device="cpu", max_num_batched_tokens=7, num_kv_blocks=8, max_model_len=96,
                                   num_speculative_tokens=speculative))
    out = small.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == alone
    assert small.stats().preemptions_total > 0
    assert small.stats().kv_blocks_used == 0  # everything freed (prefix blocks stay only as evictable)


def test_prefix_reuse_gives_same_answer_and_hits_cache(embedded_engine):
    engine = embedded_engine
    prefix = "You are a careful assistant. Answer briefly and truthfully. " * 4
    first = engine.generate([prefix + "What is two plus two?"], GREEDY)[0]
    before = engine.stats().prefix_cache_hit_tokens_total
    second = engine.generate([prefix + "What is two plus two?"], GREEDY)[0]
    assert engine.stats().prefix_cache_hit_tokens_total - before >= 32
    assert second.token_ids == first.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(embedded_engine):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = embedded_engine.generate(["Tell me a story"], params)[0]
    b = embedded_engine.generate(["Tell me a story", "Other", "Prompts"], params)[0]
    c = embedded_engine.generate(["Tell me a story"], SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_penalties_discourage_repeats(embedded_engine):
    prompt = ["1, 1, 1, 1, 1, 1, 1, 1,"]
    plain = embedded_engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    penalised = embedded_engine.generate(prompt, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))


def test_exact_max_tokens_and_length_reason(embedded_engine):
    for n in (1, 2, 7):
        out = embedded_engine.generate(["Write a long essay about trees."],
                                       SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == n
        assert out.finish_reason == "length"


def test_stop_string_is_cut_and_never_streamed(embedded_engine):
    engine = embedded_engine
    base = engine.generate(["The alphabet: a, b, c,"], SamplingParams(max_tokens=20, temperature=0.0))[0].text
    stop = base[6:9]  # a stop string taken from inside the answer, likely straddling tokens
    assert len(stop) == 3
    engine.add_request("stop-1", engine.tokenizer.encode("The alphabet: a, b, c,"),
                       SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))
    chunks, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            chunks.append(out.text)
            reason, stop_reason = out.finish_reason, out.stop_reason
    text = "".join(chunks)
    assert text == base[:base.index(stop)]
    assert reason == "stop" and stop_reason == stop
    for i in range(1, len(chunks) + 1):  # no prefix of the streamed text ever held a piece of the stop string
        assert stop not in "".join(chunks[:i])


def test_logprobs_are_normalised_and_include_the_chosen_token(embedded_engine):
    out = embedded_engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3,
                                                             ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id
        assert lp.logprob <= 0.0
        assert len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy: the chosen token is the top one


def test_abort_frees_blocks(embedded_engine):
    engine = embedded_engine
    engine.add_request("abort-me", engine.tokenizer.encode("A long story:" * 10),
                       SamplingParams(max_tokens=200, temperature=0.0))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    out = engine.abort_request("abort-me")
    assert out is not None and out.finish_reason == "abort"
    assert engine.stats().num_running == 0 and not engine.has_unfinished()


def test_prompt_over_window_is_refused_with_the_window(embedded_engine):
    with pytest.raises(PromptTooLongError, match=str(embedded_engine.max_model_len)):
        embedded_engine.add_request("long", [1] * embedded_engine.max_model_len, SamplingParams(max_tokens=1))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        embedded_engine.add_request("bad-id", [10**9], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"logprobs": 21}, "logprobs"), ({"stop": ("",)}, "stop"), ({"presence_penalty": 3.0}, "presence_penalty"),
])
def test_invalid_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(ValueError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param  # type: ignore[attr-defined]


def test_full_logits_match_generation(embedded_engine):
    engine = embedded_engine
    ids = engine.tokenizer.encode("The capital of France is")
    logits = engine.full_logits(ids)
    assert logits.shape == (len(ids), engine.model_config.vocab_size)
    first = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    assert int(logits[-1].argmax()) == first


def test_speculation_is_off_by_default():
    """Issue #11: prompt lookup halved single-stream chat speed on the CPU (11% of drafts accepted): off unless
    asked for, on every device."""
    assert EngineConfig().num_speculative_tokens == 0


def test_speculative_decoding_is_exact_and_accepts_drafts(embedded_engine):
    spec_engine = LLMEngine(EngineConfig(device="cpu", num_speculative_tokens=4, max_model_len=1024))
    assert spec_engine.spec is not None and spec_engine.spec.max_k == 4
    plain = embedded_engine
    prompts = PROMPTS[:6] + ["Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    before = plain.stats().accepted_draft_tokens_total
    spec = spec_engine.generate(prompts, params)
    base = plain.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in base]
    assert [c.text for c in spec] == [c.text for c in base]
    assert spec_engine.stats().accepted_draft_tokens_total > 0
    assert plain.stats().accepted_draft_tokens_total == before == 0


def test_prefix_match_then_chunked_prefill_commits_only_computed_blocks(embedded_engine):
    """A cached prefix followed by a prompt longer than one chunk: commit must not index past the block table."""
    engine = LLMEngine(EngineConfig(device="cpu", max_num_batched_tokens=32, max_model_len=512))
    head = "The rain in Spain stays mainly in the plain. " * 6
    first = engine.generate([head + "Tell me more."], GREEDY)[0]
    long_prompt = head + "Tell me more. " + "And then some more words follow here. " * 12
    again = engine.generate([long_prompt], GREEDY)[0]
    assert engine.stats().prefix_cache_hit_tokens_total >= 32
    assert len(again.token_ids) == GREEDY.max_tokens and len(first.token_ids) == GREEDY.max_tokens
    alone = embedded_engine.generate([long_prompt], GREEDY)[0]
    assert again.token_ids == alone.token_ids
