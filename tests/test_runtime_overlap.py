"""Overlapped scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and launched before step N's sampled
tokens are read. On CPU the device work is synchronous, but every piece of the bookkeeping is the same as on CUDA
(pending tokens, tokens filled in from the previous step's tensor, late stops, aborts and preemption), so these
tests compare it, request by request, with the plain engine on the embedded model."""

from __future__ import annotations

import time

import pytest

from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [f"Fact number {i} about the moon:" for i in range(6)] + [
    "def fib(n):", "The capital of France is", "Once upon a time", "Q: Why is the sky blue?\nA:",
]
MIXED = [
    ("What is the capital of France?", SamplingParams(max_tokens=40, temperature=0.0)),  # stops on EOS
    ("Count: one, two, three,", SamplingParams(max_tokens=30, temperature=0.0, stop=(" six",))),
    ("Hello", SamplingParams(max_tokens=1, temperature=0.0)),
    ("Tell me a story", SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
    ("List colours:", SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)),
    ("1, 1, 1, 1,", SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.5, ignore_eos=True)),
    ("Write a poem about rain.", SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)),
]


def _engine(overlap: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", async_scheduling=overlap, num_speculative_tokens=0, **kw))


@pytest.fixture(scope="module")
def plain():
    return _engine(False)


@pytest.fixture(scope="module")
def overlapped():
    return _engine(True)


def _summary(c):
    lps = [(lp.token_id, round(lp.logprob, 4), sorted(lp.top)) for lp in c.logprobs] if c.logprobs else None
    return c.text, c.token_ids, c.finish_reason, lps


def test_concurrent_greedy_requests_match_the_plain_engine(plain, overlapped):
    want = [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    before = overlapped.stats().overlapped_steps_total
    got = [c.token_ids for c in overlapped.generate(PROMPTS, GREEDY)]
    assert got == want
    # every decode step after the first overlapped its successor
    assert overlapped.stats().overlapped_steps_total - before >= GREEDY.max_tokens - 2
    assert overlapped.stats().kv_blocks_used == 0 and not overlapped.has_unfinished()


def test_stops_seeds_logprobs_and_penalties_match_the_plain_engine(plain, overlapped):
    prompts, params = [p for p, _ in MIXED], [s for _, s in MIXED]
    want = [_summary(c) for c in plain.generate(prompts, params)]
    got = [_summary(c) for c in overlapped.generate(prompts, params)]
    assert got == want
    assert got[0][2] == "stop" and got[1][2] == "stop" and got[2][2] == "length"
    assert len(got[2][1]) == 1
    # A request that stopped on EOS had one more step in flight; it is dropped and the engine is idle again
    # (the semantic gate calls full_logits right after generate).
    assert not overlapped.has_unfinished()
    hello = overlapped.encode_prompt("Hello there")
    assert overlapped.full_logits(hello).shape[0] == len(hello)


def test_full_logits_after_aborting_with_a_step_in_flight(overlapped):
    engine = overlapped
    engine.add_request("a", engine.encode_prompt("Tell me about the sea"), GREEDY)
    for _ in range(3):  # prefill, then decode steps whose tokens stay in flight
        engine.step()
    assert engine.abort_request("a") is not None
    hello = engine.encode_prompt("Hello there")
    assert engine.full_logits(hello).shape[0] == len(hello) and not engine.has_unfinished()


def test_a_request_ending_by_length_costs_no_extra_step(overlapped, monkeypatch):
    calls = []
    execute = overlapped.runner.execute
    monkeypatch.setattr(overlapped.runner, "execute", lambda *a, **k: calls.append(1) or execute(*a, **k))
    out = overlapped.generate(["Write a long essay about trees."],
                              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert len(calls) == 6  # one prefill, five decodes: the sixth token is read, never fed back


def test_joining_and_aborting_mid_flight(plain, overlapped):
    want = {i: c.token_ids for i, c in enumerate(plain.generate(PROMPTS, GREEDY))}
    engine = overlapped
    got: dict[int, list[int]] = {}
    waiting = list(enumerate(PROMPTS))
    steps = 0
    while waiting or engine.has_unfinished():
        if waiting and steps % 2 == 0:  # a new request joins every other step, while a step is in flight
            i, p = waiting.pop(0)
            engine.add_request(f"j{i}", engine.tokenizer.encode(p), GREEDY)
            got[i] = []
        if steps == 9:
            aborted = engine.abort_request("j1")
            assert aborted is not None and aborted.finish_reason == "abort"
            got[1] += aborted.token_ids
        for out in engine.step():
            i = int(out.request_id[1:])
            assert i != 1 or steps < 9, "an aborted request got output after its abort"
            got[i] += out.token_ids
        steps += 1
    assert {i: t for i, t in got.items() if i != 1} == {i: t for i, t in want.items() if i != 1}
    assert got[1] == want[1][:len(got[1])] and len(got[1]) < GREEDY.max_tokens
    assert engine.stats().kv_blocks_used == 0


def test_preemption_with_tokens_in_flight_does_not_change_answers(plain):
    want = [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    # 6 blocks of 16 tokens cannot hold 10 sequences: the scheduler preempts sequences whose token is in flight.
    small = _engine(True, max_num_batched_tokens=7, num_kv_blocks=6, max_model_len=64)
    out = small.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == want
    assert small.stats().preemptions_total > 0 and small.stats().overlapped_steps_total > 0
    assert small.stats().kv_blocks_used == 0


def test_warm_up_leaves_the_engine_as_it_found_it(plain):
    engine = _engine(True, max_num_batched_tokens=64, max_model_len=128)
    want = plain.generate(PROMPTS[:3], GREEDY)
    engine.warm_up()  # the step kinds: a 64-token prefill chunk, decodes mixed with a chunk, decode steps
    stats = engine.stats()
    assert not engine.has_unfinished() and stats.kv_blocks_used == 0
    assert stats.prompt_tokens_total == stats.generation_tokens_total == stats.overlapped_steps_total == 0
    assert engine.blocks.enable_prefix_caching and not engine.blocks._block_of  # nothing published
    assert [c.token_ids for c in engine.generate(PROMPTS[:3], GREEDY)] == [c.token_ids for c in want]


def test_the_openai_server_on_an_overlapped_engine(overlapped):
    """The server (uvicorn on 127.0.0.1, the official client) on the overlapped engine: the France answer,
    streaming equal to non-streaming, concurrent requests equal to alone, a dropped stream aborted and freed."""
    import asyncio

    import httpx
    import openai

    from envex.runtime.server.app import build_app
    from envex.runtime.server.async_engine import AsyncEngine
    from envex.tests.support.server import serve_in_thread

    model = overlapped.model_name
    with serve_in_thread(build_app(AsyncEngine(overlapped))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        france = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=model, messages=france, temperature=0, max_tokens=24)
        assert reply.choices[0].message.content == "The capital of France is Paris."
        assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 8
        chunks = list(client.chat.completions.create(model=model, messages=france, temperature=0, max_tokens=24,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of France is Paris."

        async def ask(c: openai.AsyncOpenAI, prompt: str) -> str:
            r = await c.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12)
            return r.choices[0].text

        async def run() -> tuple[list[str], list[str]]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300) as c:
                alone = [await ask(c, p) for p in PROMPTS[:6]]
                return alone, list(await asyncio.gather(*(ask(c, p) for p in PROMPTS[:6])))

        alone, together = asyncio.run(run())
        assert all(alone) and together == alone

        body = {"model": model, "prompt": "Write a very long story.", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=120) as http, http.stream("POST", "/v1/completions",
                                                                          json=body) as response:
            seen, lines, stats = 0, [], None
            for line in response.iter_lines():
                lines.append(line[:120])
                seen += line.startswith("data: ")
                if seen == 4:
                    # Still holding its KV blocks, read before the break: the break closes the iter_lines()
                    # generator and httpcore then closes the connection (the body is unread), so the server aborts
                    # the request and frees its blocks while this thread goes on. A snapshot after the loop raced
                    # with that abort (a loaded CI run read 0 blocks and 0 running).
                    stats = overlapped.stats()
                    break
            assert seen == 4 and stats.kv_blocks_used > 0, (seen, lines, stats)
        deadline = time.monotonic() + 60
        while (overlapped.has_unfinished() or overlapped.stats().kv_blocks_used) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not overlapped.has_unfinished() and overlapped.stats().kv_blocks_used == 0
