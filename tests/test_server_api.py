"""The OpenAI-compatible server end to end: a real uvicorn on 127.0.0.1, the embedded model, the official client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from fastapi import APIRouter, Request

from envex.runtime.engine import LLMEngine
from envex.runtime.server.app import build_app
from envex.runtime.server.async_engine import AsyncEngine
from envex.tests.support.server import serve_in_thread

API_KEY = "sk-test-envex"
MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Server:
    url: str
    async_engine: AsyncEngine
    engine: LLMEngine

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def http(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=timeout)


@pytest.fixture(scope="module")
def server(embedded_engine: LLMEngine) -> Iterator[Server]:
    async_engine = AsyncEngine(embedded_engine)
    with serve_in_thread(build_app(async_engine, api_key=API_KEY)) as url:
        yield Server(url, async_engine, embedded_engine)
    assert not embedded_engine.has_unfinished(), "the server left requests in the engine"


def sse_events(lines: Iterator[str]) -> list[dict | str]:
    """The payloads of an SSE stream; '[DONE]' stays a string."""
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(server: Server, idle_blocks: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if (stats.num_running == 0 and stats.num_waiting == 0 and server.async_engine.in_flight == 0
                and stats.kv_blocks_used == idle_blocks):
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout} s: {server.engine.stats()}, "
                         f"in flight {server.async_engine.in_flight}")


# ---- models, health, tokenize ---------------------------------------------------------------------------------


def test_models_lists_the_served_model(server: Server) -> None:
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")


def test_health_and_metrics_are_open(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    assert 'envex_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in ("envex_prompt_tokens_total", "envex_generation_tokens_total", "envex_num_requests_running",
                 "envex_num_requests_waiting", "envex_kv_blocks_used", "envex_time_to_first_token_seconds_bucket",
                 "envex_time_per_output_token_seconds_count"):
        assert f"\n{name}" in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#") and "{" not in line}
    assert values["envex_generation_tokens_total"] >= 2
    assert values["envex_time_to_first_token_seconds_count"] >= 1
    # the settings the engine resolved (the embedded model on the CPU: torch, float32, deterministic mode off)
    config = server.engine.config
    assert (f'envex_engine_info{{backend="torch",dtype="float32",deterministic="false",'
            f'max_model_len="{config.max_model_len}",tensor_parallel="1",max_num_seqs="{config.max_num_seqs}",'
            f'weights="as stored"}} 1') in text
    assert "envex_state_bytes_per_sequence 0\n" in text and "envex_state_slots_total 0\n" in text  # no recurrent layers


def test_health_is_503_when_the_engine_thread_is_not_running(embedded_engine: LLMEngine) -> None:
    from fastapi.testclient import TestClient

    app = build_app(AsyncEngine(embedded_engine))  # never started: no lifespan without `with TestClient(...)`
    response = TestClient(app).get("/health")
    assert response.status_code == 503
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_extra_routers_are_mounted_without_the_api_key(embedded_engine: LLMEngine) -> None:
    from fastapi.testclient import TestClient

    router = APIRouter()

    @router.get("/admin/name")
    async def name(request: Request) -> dict[str, str]:
        return {"model": request.app.state.envex.served_model_name}

    app = build_app(AsyncEngine(embedded_engine), api_key="k", served_model_name="local", extra_routers=[router])
    client = TestClient(app)  # no lifespan: the engine thread is not started
    assert client.get("/admin/name").json() == {"model": "local"}
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "local"


def test_tokenize_and_detokenize_round_trip(server: Server) -> None:
    with server.http() as http:
        tok = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == server.engine.max_model_len
        assert http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json() == {
            "prompt": "Hello world"}
        chat = http.post("/tokenize", json={"model": MODEL, "messages": FRANCE}).json()
    reply = server.client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1, temperature=0)
    assert chat["count"] == reply.usage.prompt_tokens


# ---- completions and chat ------------------------------------------------------------------------------------


def test_chat_answers_the_capital_of_france(server: Server) -> None:
    reply = server.client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert choice.message.content == "The capital of France is Paris."
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.usage.completion_tokens == 8  # seven text tokens and <|im_end|>
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_non_stream_with_usage_chunk(server: Server) -> None:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "temperature": 0,
              "max_tokens": 12}
    full = server.client.chat.completions.create(**kwargs)
    chunks = list(server.client.chat.completions.create(**kwargs, stream=True,
                                                        stream_options={"include_usage": True}))
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage
    assert all(c.usage is None for c in content_chunks)
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == full.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert full.choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])


def test_completion_stream_equals_non_stream_and_ends_with_done(server: Server) -> None:
    body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 10, "temperature": 0}
    full = server.client.completions.create(**body)
    with server.http() as http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10


def test_streamed_n_choices_each_end_with_a_reason_and_usage_sums_them(server: Server) -> None:
    body = {"model": MODEL, "prompt": "A list of fruits:", "max_tokens": 4, "temperature": 0.8, "seed": 3, "n": 2}
    full = server.client.completions.create(**body)
    chunks = list(server.client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert reasons[choice.index] is None, "a chunk came after the choice's finish_reason"
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason
    assert texts == [c.text for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices] and None not in reasons


def test_exact_max_tokens_finishes_with_length(server: Server) -> None:
    for max_tokens in (1, 7):
        reply = server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == max_tokens


def test_stop_strings_never_leak(server: Server) -> None:
    for stop in (" Paris", "ital of", ["xyz", "France"]):
        reply = server.client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24,
                                                      stop=stop)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
        expected = "The capital of France is Paris."
        cut = min(expected.find(s) for s in ([stop] if isinstance(stop, str) else stop) if s in expected)
        assert text == expected[:cut]
        streamed = server.client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                                         max_tokens=24, stop=stop, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_prompt_forms_and_echo(server: Server) -> None:
    ids = server.engine.tokenizer.encode("The capital of France is")
    by_text = server.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                               temperature=0)
    by_ids = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = server.client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text[: len(many.choices[0].text)]
    assert many.usage.prompt_tokens == len(ids) + 2
    echoed = server.client.completions.create(model=MODEL, prompt=["The capital of France is", "Hi"],
                                              max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + by_text.choices[0].text
    assert echoed.choices[1].text.startswith("Hi")


def test_a_choice_finishing_at_once_does_not_cut_the_others_short(server: Server) -> None:
    # Greedy "Hello" continues with "-", so the stop string ends choice 0 on its first token, in the same step as
    # choice 1's first token: the end of choice 0's stream must not count as the end of choice 1's.
    body = {"model": MODEL, "prompt": ["Hello", "The capital of France is"], "max_tokens": 3, "temperature": 0,
            "stop": ["-"]}
    reply = server.client.completions.create(**body)
    assert [(c.text, c.finish_reason) for c in reply.choices] == [("", "stop"), (" Paris.\n", "length")]
    assert reply.usage.completion_tokens == 4
    texts, reasons = ["", ""], [None, None]
    for chunk in server.client.completions.create(**body, stream=True):
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == ["", " Paris.\n"] and reasons == ["stop", "length"]


def test_completion_logprobs_legacy_format(server: Server) -> None:
    reply = server.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                             temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy picks the most likely token

    echoed = server.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                              temperature=0, logprobs=1, echo=True)
    lp = echoed.choices[0].logprobs
    prompt_len = len(server.engine.tokenizer.encode("The capital of France is"))
    assert len(lp.tokens) == prompt_len + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == echoed.choices[0].text


def test_chat_logprobs_streamed_and_not(server: Server) -> None:
    kwargs = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 24, "logprobs": True,
              "top_logprobs": 3}
    reply = server.client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(c.token for c in content[:-1]) == reply.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    streamed = [c for c in server.client.chat.completions.create(**kwargs, stream=True) if c.choices]
    tokens = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in tokens] == [(e.token, e.logprob) for e in content]
    plain = server.client.chat.completions.create(**{**kwargs, "top_logprobs": None})
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_n_choices_with_seed_are_seed_plus_i(server: Server) -> None:
    kwargs = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 8, "temperature": 1.0}
    both = server.client.completions.create(**kwargs, n=2, seed=1234)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [server.client.completions.create(**kwargs, seed=1234 + i).choices[0].text for i in range(2)]
    assert [c.text for c in both.choices] == alone
    again = server.client.completions.create(**kwargs, n=2, seed=1234)
    assert [c.text for c in again.choices] == alone
    chat = server.client.chat.completions.create(model=MODEL, messages=FRANCE, n=2, seed=5, max_tokens=6,
                                                 temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5)
    assert len(chat.choices) == 2 and chat.usage.prompt_tokens == len(server.engine.tokenizer.encode(
        server.engine.tokenizer.apply_chat_template(FRANCE), add_special_tokens=False))


def test_max_completion_tokens_is_honoured(server: Server) -> None:
    reply = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story"}],
                                                  temperature=0, max_completion_tokens=3)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


# ---- batching, cancellation ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sixteen_concurrent_requests_answer_as_alone(server: Server) -> None:
    # max_tokens is kept small: on a shared 2-core CPU each token alone costs ~0.1 s.
    subjects = ["Paris", "the sea", "a cat", "mountains", "music", "bread", "winter", "a robot", "the moon",
                "coffee", "trains", "a garden", "rain", "chess", "a library", "the desert"]
    prompts = [f"Write one sentence about {s}." for s in subjects]

    async def ask(client: openai.AsyncOpenAI, prompt: str) -> str:
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                     temperature=0, max_tokens=16)
        return reply.choices[0].message.content or ""

    async def run() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as client:
            alone = [await ask(client, p) for p in prompts]
            together = await asyncio.gather(*(ask(client, p) for p in prompts))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert all(alone)
    assert together == alone


def test_stream_disconnect_aborts_and_frees_blocks(server: Server) -> None:
    idle = server.engine.stats().kv_blocks_used
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 4:
                break
        assert server.engine.stats().kv_blocks_used > idle
    wait_idle(server, idle)


def test_non_stream_disconnect_aborts(server: Server) -> None:
    idle = server.engine.stats().kv_blocks_used
    body = {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True}
    with server.http(timeout=1.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body)
    wait_idle(server, idle)
    reply = server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
