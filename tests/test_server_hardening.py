"""One request never hurts another (issue #11): extreme sampling values, a request whose sampling fails, heavy or
oversized bodies and clients that leave during the upload, each while victim streams run beside it and must
finish normally. A real uvicorn on 127.0.0.1, the embedded model, the official openai client."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.runtime.engine import LLMEngine
from envex.runtime.server.app import build_app
from envex.runtime.server.async_engine import AsyncEngine
from envex.runtime.server.errors import APIError
from envex.runtime.server.limits import PrepPool, ServerLimits
from envex.tests.support.server import serve_in_thread

API_KEY = "sk-test-hardening"
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "Write one sentence about the sea."}]
LIMITS = ServerLimits()


@pytest.fixture(scope="module")
def url(embedded_engine: LLMEngine) -> Iterator[str]:
    with serve_in_thread(build_app(AsyncEngine(embedded_engine), api_key=API_KEY)) as base:
        yield base
    assert not embedded_engine.has_unfinished(), "the server left requests in the engine"


def client(url: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout)


@dataclass
class Victims:
    """Streams that run, one after another on each of `count` threads, until stopped: each must end with
    finish_reason "length" after exactly `tokens` tokens, without an error event."""

    url: str
    count: int = 2
    tokens: int = 6
    done: int = 0
    failures: list[str] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _run(self, seed: int) -> None:
        api = client(self.url)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                stream = api.chat.completions.create(
                    model=MODEL, messages=HI, temperature=0.8, seed=seed, max_tokens=self.tokens, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                reasons, usage, first = [], None, None
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content and first is None:
                        first = time.monotonic() - started
                    reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
                    usage = chunk.usage or usage
                if reasons != ["length"] or usage is None or usage.completion_tokens != self.tokens:
                    self.failures.append(f"seed {seed}: finish {reasons}, usage {usage}")
                else:
                    self.done += 1
                    self.first_token_s.append(first if first is not None else math.inf)
            except Exception as exc:  # noqa: BLE001 - any failure of a victim is the finding
                self.failures.append(f"seed {seed}: {type(exc).__name__}: {exc}")

    def __enter__(self) -> Victims:
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.count)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def check(self) -> None:
        assert not self.failures, self.failures[:5]
        assert self.done >= self.count, f"only {self.done} victim streams finished"


# ---- sampling values ------------------------------------------------------------------------------------------

TINY = [5e-324, 1e-310, 1e-300, 1e-46, 1e-45, 1.4e-45, 1e-38, 1.1754944e-38, 1e-20, 1e-6, 1e-5, 1.00001e-5]
# Each field's accepted values (the documented range, ends, subnormals and float32's underflow zone weighted in),
# and a strategy for anything else a client can send.
VALID: dict[str, st.SearchStrategy[object]] = {
    "temperature": st.one_of(st.sampled_from([0.0, -0.0, *TINY, 1.0, 2.0]), st.floats(0, 2)),
    "top_p": st.one_of(st.sampled_from([*TINY, 0.5, 1.0 - 1e-16, 1.0]), st.floats(0, 1, exclude_min=True)),
    "presence_penalty": st.one_of(st.sampled_from([0.0, -2.0, 2.0, 5e-324, -5e-324]), st.floats(-2, 2)),
    "frequency_penalty": st.one_of(st.sampled_from([0.0, -2.0, 2.0, 5e-324, -5e-324]), st.floats(-2, 2)),
    "top_k": st.one_of(st.integers(-1, 60), st.integers(0, 2**63)),
    "seed": st.one_of(st.integers(0, 2**64 - 1), st.integers(-2**63, 0)),
    "top_logprobs": st.integers(0, 20),
}
ANY_FLOAT = st.one_of(st.sampled_from([2.0000001, -1e-300, -2.0000001, 1e308, math.inf, -math.inf, math.nan]),
                      st.floats())
INVALID: dict[str, st.SearchStrategy[object]] = {
    "temperature": ANY_FLOAT.filter(lambda v: not 0 <= v <= 2),
    "top_p": ANY_FLOAT.filter(lambda v: not 0 < v <= 1),
    "presence_penalty": ANY_FLOAT.filter(lambda v: not -2 <= v <= 2),
    "frequency_penalty": ANY_FLOAT.filter(lambda v: not -2 <= v <= 2),
    "top_k": st.integers(max_value=-2),
    "seed": st.one_of(st.integers(max_value=-2**63 - 1), st.integers(min_value=2**64)),
    "top_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21)),
}


@st.composite
def sampling_requests(draw: st.DrawFn) -> tuple[dict[str, object], str | None]:
    """Every sampling field; about half the time one of them (named in the second value) is out of range."""
    bad = draw(st.one_of(st.none(), st.sampled_from(sorted(INVALID))))
    fields = {name: draw(INVALID[name] if name == bad else VALID[name]) for name in VALID}
    return fields, bad


def test_every_sampling_value_is_answered_or_refused_by_name_and_never_hurts_a_neighbour(url: str) -> None:
    """Hypothesis over the whole float range of every sampling field, through the server, beside victims."""
    api = client(url)

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(drawn=sampling_requests(), stream=st.booleans())
    def one(drawn: tuple[dict[str, object], str | None], stream: bool) -> None:
        fields, bad = dict(drawn[0]), drawn[1]
        top_logprobs = fields.pop("top_logprobs")
        extra = {"top_k": fields.pop("top_k")}
        kwargs = dict(model=MODEL, messages=HI, max_tokens=2, logprobs=True, top_logprobs=top_logprobs,
                      extra_body=extra, **fields)
        if not all(not isinstance(v, float) or math.isfinite(v) for v in fields.values()):
            # NaN and +-inf are not JSON (the openai client will not send them): the server refuses the body.
            raw = json.dumps({**kwargs.pop("extra_body"), **kwargs, "stream": stream}).encode()  # type: ignore[arg-type]
            response = httpx.post(f"{url}/v1/chat/completions", content=raw, headers=AUTH, timeout=60)
            assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
            return
        try:
            if stream:
                chunks = list(api.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
                events = [c for c in chunks if c.choices and c.choices[0].finish_reason]
                assert [c.choices[0].finish_reason for c in events] in (["length"], ["stop"]), chunks
            else:
                reply = api.chat.completions.create(**kwargs)  # type: ignore[call-overload]
                assert reply.choices[0].finish_reason in ("length", "stop")
        except openai.BadRequestError as exc:
            assert bad is not None, f"{fields} refused: {exc}"
            body = exc.body if isinstance(exc.body, dict) else {}
            assert body.get("param") == bad, (fields, body)
        else:
            assert bad is None, f"{fields} was accepted; {bad} is out of range"

    with Victims(url) as victims:
        one()
    victims.check()


@pytest.mark.parametrize("stream", [False, True])
def test_the_reported_tiny_values_answer_greedily_beside_victims(url: str, stream: bool) -> None:
    """temperature 1e-38 and top_p 1e-46 ended every stream in the batch with 'probability tensor contains inf,
    nan or element < 0'. Now they answer as greedy decoding does."""
    api = client(url)
    greedy = api.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0).choices[0]
    with Victims(url) as victims:
        for temperature, top_p in ((1e-38, 1.0), (1.0, 1e-46), (1e-38, 1e-46), (5e-324, 5e-324)):
            for _ in range(2):
                if stream:
                    text = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
                        model=MODEL, messages=HI, max_tokens=8, temperature=temperature, top_p=top_p, stream=True)
                        if c.choices)
                else:
                    text = api.chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                                       temperature=temperature, top_p=top_p).choices[0].message.content
                assert text == greedy.message.content, (temperature, top_p)
    victims.check()


def test_a_request_whose_sampling_fails_gets_a_500_alone(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection (no valid input fails any more): a request seeded 667 fails in the sampler at its first
    token, one seeded 666 at its third. The first gets a one-line 500; the second too when not streaming, and
    when streaming an error event then [DONE]. The victims finish normally."""
    real = torch.multinomial
    draws: dict[torch.Generator, int] = {}  # keeps each generator alive, so no id is reused by a later request

    def failing(probs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        if generator is not None and generator.initial_seed() in (666, 667):
            draws[generator] = draws.get(generator, 0) + 1
            if generator.initial_seed() == 667 or draws[generator] == 3:
                raise RuntimeError("injected sampler failure")
        return real(probs, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", failing)
    body = {"model": MODEL, "messages": HI, "max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}

    def check_500(error: dict[str, object]) -> None:
        assert "injected sampler failure" in str(error["message"]) and "\n" not in str(error["message"])
        assert error["code"] == "request_failed" and error["type"] == "server_error"

    api = client(url)
    with Victims(url) as victims:
        for _ in range(2):
            for seed in (666, 667):
                with pytest.raises(openai.InternalServerError) as info:
                    api.chat.completions.create(seed=seed, **body)  # type: ignore[call-overload]
                check_500(info.value.body)  # type: ignore[arg-type]
            with pytest.raises(openai.InternalServerError) as info:
                api.chat.completions.create(seed=667, stream=True, **body)  # type: ignore[call-overload]
            check_500(info.value.body)  # type: ignore[arg-type]
            raw = {**body.pop("extra_body"), **body, "seed": 666, "stream": True}  # type: ignore[arg-type]
            body["extra_body"] = {"ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=raw, headers=AUTH, timeout=120) as stream:
                assert stream.status_code == 200
                data = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            events = [json.loads(d) for d in data[:-1]]
            assert "error" in events[-1] and all("error" not in e for e in events[:-1]), events
            check_500(events[-1]["error"])
            assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[:-1])
    victims.check()


# ---- the event loop stays free; what one request may cost -------------------------------------------------------


def _post(url: str, path: str, payload: dict[str, object] | bytes) -> httpx.Response:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(url + path, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=300)


def test_health_stays_fast_and_a_stream_starts_while_heavy_requests_run(url: str) -> None:
    """The issue's load: ~4 MB /tokenize bodies, a 4 MB chat message, a chat of 50,000 messages, and heavy but
    allowed ones (1M-character prompts, 4,096 messages). /health answers within 100 ms for 95% of the probes and
    within 1 s for every one; a victim's first token comes within 3 s (it waited 43 s before).

    The server shares this process (and its interpreter lock) with the clients, and the 2-core test machine with
    whatever else runs on it: a single probe can wait a few hundred ms for a core (CI saw 113 and 581 ms once), so
    the 100 ms bound is on the 95th percentile and the hard bound on the worst probe is 1 s; before the fix,
    /health stalled for seconds in every round. A round is repeated (up to three in all) when it misses a bound,
    so that a burst of foreign load alone (the other test worker, say) does not fail it."""
    big_text = "the quick brown fox jumps over the lazy dog. " * 87_000  # 3.9 MB
    allowed_text = big_text[:LIMITS.max_prompt_chars]
    heavy: list[tuple[str, dict[str, object], int, str | None]] = [
        ("/tokenize", {"prompt": big_text}, 400, "prompt"),
        ("/tokenize", {"prompt": big_text[:-3]}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big_text}], "max_tokens": 1}, 400,
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 50_000, "max_tokens": 1}, 400,
         "messages"),
        ("/tokenize", {"prompt": allowed_text}, 200, None),
        ("/tokenize", {"prompt": allowed_text[1:]}, 200, None),
        ("/tokenize", {"messages": [{"role": "user", "content": "hello there"}] * LIMITS.max_messages}, 200, None),
        ("/v1/completions", {"prompt": allowed_text, "max_tokens": 1}, 400, "prompt"),  # over the window
    ]
    # Encoded before the probes start: this client's own JSON work would hold the interpreter lock inside the
    # measurement (the server runs in this process).
    bodies = [json.dumps(payload).encode() for _, payload, _, _ in heavy]

    def p95(values: list[float]) -> float:
        return statistics.quantiles(values, n=20)[-1]

    def one_round() -> tuple[list[float], Victims]:
        probes: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                while not stop.is_set():
                    started = time.perf_counter()
                    assert http.get("/health").status_code == 200
                    probes.append(time.perf_counter() - started)
                    time.sleep(0.01)

        with Victims(url, count=1, tokens=4) as victims:
            prober = threading.Thread(target=probe, daemon=True)
            prober.start()
            with ThreadPoolExecutor(len(heavy)) as pool:
                futures = [pool.submit(_post, url, path, body)
                           for (path, _, _, _), body in zip(heavy, bodies, strict=True)]
                responses = [f.result() for f in futures]
            stop.set()
            prober.join()
        for (path, _, status, param), response in zip(heavy, responses, strict=True):
            assert response.status_code == status, (path, response.text[:300])
            if param is not None:
                error = response.json()["error"]
                assert error["param"] == param, error
                assert "limit" in error["message"] or "context length" in error["message"], error
        victims.check()
        assert len(probes) > 20
        print(f"/health over {len(probes)} probes: max {max(probes) * 1000:.1f} ms, p95 {p95(probes) * 1000:.1f} "
              f"ms, median {statistics.median(probes) * 1000:.1f} ms; victim first tokens {victims.first_token_s}")
        return probes, victims

    for _attempt in range(3):
        probes, victims = one_round()
        if p95(probes) < 0.1 and max(probes) < 1.0 and max(victims.first_token_s) < 3.0:
            break
    summary = (f"/health: p95 {p95(probes) * 1000:.0f} ms, max {max(probes) * 1000:.0f} ms, median "
               f"{statistics.median(probes) * 1000:.1f} ms over {len(probes)} probes in the last of 3 rounds, "
               "each of which missed a bound")
    assert p95(probes) < 0.1, summary
    assert max(probes) < 1.0, summary
    assert max(victims.first_token_s) < 3.0, victims.first_token_s


@pytest.mark.parametrize(("path", "payload", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * (LIMITS.max_messages + 1)},
     "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * (LIMITS.max_messages + 1)}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 600_000}] * 2}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 900_000}] * 3}, "messages"),  # rendered
    ("/v1/completions", {"prompt": ["p" * 600_000, "q" * 600_000]}, "prompt"),
    ("/v1/completions", {"prompt": [1] * (LIMITS.max_token_ids + 1)}, "prompt"),
    ("/detokenize", {"tokens": [1] * (LIMITS.max_token_ids + 1)}, "tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * (LIMITS.max_stop_token_ids + 1)}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 10**9}, "max_completion_tokens"),
])
def test_each_limit_is_a_400_naming_the_field_and_the_limit(url: str, path: str, payload: dict[str, object],
                                                             param: str) -> None:
    response = _post(url, path, {"model": MODEL, **payload})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    assert any(f"{n:,}" in error["message"] for n in (
        LIMITS.max_messages, LIMITS.max_message_chars, LIMITS.max_rendered_chars, LIMITS.max_prompt_chars,
        LIMITS.max_token_ids, LIMITS.max_stop_token_ids, 8192)), error["message"]


def test_the_prep_pool_is_bounded_and_counts_a_job_until_its_thread_ends() -> None:
    limits = ServerLimits(prep_workers=1, prep_queue=1)

    async def main() -> None:
        pool = PrepPool(limits)
        gate = threading.Event()
        first = asyncio.ensure_future(pool.run(gate.wait, 30))
        second = asyncio.ensure_future(pool.run(lambda: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as info:
            await pool.run(lambda: "refused")
        assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
        first.cancel()  # the client left: its thread still runs, so its slot stays taken
        await asyncio.sleep(0.05)
        assert pool.busy == 2
        gate.set()
        assert await second == "queued"
        await asyncio.sleep(0.05)
        assert pool.busy == 0
        assert await pool.run(lambda: 42) == 42
        pool.shutdown()

    asyncio.run(main())


# ---- clients that leave during the upload -----------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _count(url: str, path: str, status: int) -> int:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'envex_requests_total{{endpoint="{path}",status="{status}"}} '):
            return int(line.rsplit(" ", 1)[1])
    return 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_client_that_leaves_during_the_upload_is_a_499_and_one_log_line(url: str, path: str) -> None:
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "")]  # uvicorn's does not propagate
    for logger in loggers:
        logger.addHandler(records)
    before = {s: _count(url, path, s) for s in (499, 500)}
    try:
        with Victims(url, count=1, tokens=4) as victims:
            address = urlparse(url)
            for _ in range(3):
                with socket.create_connection((address.hostname, address.port)) as sock:
                    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                                 "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n".encode()
                                 + b'{"prompt": "' + b"a" * 20_000)
                    time.sleep(0.2)  # the handler is now reading the body
            deadline = time.monotonic() + 10
            while _count(url, path, 499) < before[499] + 3 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    victims.check()
    assert _count(url, path, 499) == before[499] + 3
    assert _count(url, path, 500) == before[500]
    assert not [r for r in records.records if r.exc_info or "Exception in ASGI" in r.getMessage()], \
        [r.getMessage() for r in records.records]
    lines = [r.getMessage() for r in records.records if "disconnected" in r.getMessage()]
    assert len(lines) == 3 and all(path in line and "\n" not in line for line in lines), lines
