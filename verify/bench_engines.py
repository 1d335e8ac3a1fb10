"""The engines the benchmark drives, each behind one small interface: run a list of requests at a concurrency
and return when each token of each request arrived.

- `EnvexInProcess`: an LLMEngine stepped in this thread (closed loop: `concurrency` requests in flight).
- `HFTransformers`: HF `generate()` on batches of `concurrency` requests; "stock" (dynamic cache) or "tuned"
  (static cache, plus transformers' own torch.compile of the forward, which it applies on CUDA only).
- `OpenAICompatible`: any /v1/completions server over HTTP with SSE streaming (httpx), e.g. the customer's current
  server or `envex serve`; token counts come from the server's `usage`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    prompt_text: str  # byte-identical text of the same prompt (for engines that take text)
    max_tokens: int


@dataclass
class RequestTiming:
    submitted: float
    token_times: list[float] = field(default_factory=list)  # one entry per arrival (a chunk may carry several)
    output_tokens: int = 0  # served token count (the engine's own count; `usage` for HTTP)
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.submitted

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


class BenchEngine(Protocol):
    name: str

    def run(self, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestTiming]: ...

    def close(self) -> None: ...


class EnvexInProcess:
    """An LLMEngine (greedy, ignore_eos so every request serves exactly max_tokens)."""

    def __init__(self, engine: Any, name: str = "envex") -> None:
        self.engine = engine
        self.name = name
        self._ids = itertools.count()

    def run(self, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestTiming]:
        from envex.runtime.engine import SamplingParams

        pending = list(enumerate(requests))[::-1]
        timings: list[RequestTiming | None] = [None] * len(requests)
        by_id: dict[str, int] = {}
        in_flight = 0
        while pending or in_flight:
            while pending and in_flight < concurrency:
                i, req = pending.pop()
                rid = f"bench-{next(self._ids)}"
                params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
                timings[i] = RequestTiming(submitted=time.perf_counter(), prompt_tokens=len(req.prompt_ids))
                self.engine.add_request(rid, req.prompt_ids, params)
                by_id[rid] = i
                in_flight += 1
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                t = timings[by_id[out.request_id]]
                assert t is not None
                if out.token_ids:
                    t.token_times.append(now)
                t.output_tokens = out.completion_token_count
                if out.finished:
                    in_flight -= 1
        return [t for t in timings if t is not None]

    def close(self) -> None:
        pass


class _TimingStreamer:
    """A transformers streamer that only records when each generated step arrived (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFTransformers:
    def __init__(self, model: Any, *, tuned: bool = False, compile: bool | None = None, pad_token_id: int = 0,
                 name: str | None = None) -> None:
        self.model = model
        self.tuned = tuned
        self.device = next(model.parameters()).device
        # transformers compiles the forward itself when generate() runs a static cache on a GPU (its CompileConfig:
        # fullgraph, reduce-overhead, i.e. CUDA graphs); `compile=False` turns that off for the static-only row.
        self.compile = (self.device.type == "cuda") if compile is None else compile
        if self.compile and self.device.type != "cuda":
            raise ValueError("compile: transformers compiles generate() on CUDA only; use compile=False on a CPU")
        self.pad_token_id = pad_token_id
        label = "hf-stock" if not tuned else ("hf-tuned(static+compile)" if self.compile else "hf-tuned(static)")
        self.name = name or label

    @torch.inference_mode()
    def run(self, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestTiming]:
        out: list[RequestTiming] = []
        for start in range(0, len(requests), concurrency):
            batch = requests[start:start + concurrency]
            width = max(len(r.prompt_ids) for r in batch)
            ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):  # left padding: every row's last prompt token lines up
                ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[row, width - len(r.prompt_ids):] = 1
            n = max(r.max_tokens for r in batch)
            streamer = _TimingStreamer()
            kwargs: dict[str, Any] = {}
            if self.tuned:
                kwargs = {"cache_implementation": "static", "disable_compile": not self.compile}
            submitted = time.perf_counter()
            gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer,
                                      pad_token_id=self.pad_token_id, **kwargs)
            served = gen.shape[1] - width
            for r in batch:
                k = min(r.max_tokens, served)  # a row is done once its own max_tokens have arrived
                out.append(RequestTiming(submitted=submitted, token_times=streamer.times[:k], output_tokens=k,
                                         prompt_tokens=len(r.prompt_ids)))
        return out

    def close(self) -> None:
        pass


class OpenAICompatible:
    """Any OpenAI-compatible server: POST {url}/v1/completions, stream=True, greedy, ignore_eos."""

    def __init__(self, url: str, *, model: str, api_key: str | None = None, name: str | None = None,
                 timeout_s: float = 600.0, send_token_ids: bool = False) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = name or f"openai@{self.url}"
        self.timeout_s = timeout_s
        self.send_token_ids = send_token_ids

    async def _one(self, client: Any, req: BenchRequest, sem: asyncio.Semaphore) -> RequestTiming:
        async with sem:
            body = {"model": self.model, "prompt": req.prompt_ids if self.send_token_ids else req.prompt_text,
                    "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            t = RequestTiming(submitted=time.perf_counter())
            try:
                async with client.stream("POST", f"{self.url}/v1/completions", json=body,
                                         headers=self.headers) as resp:
                    if resp.status_code != 200:
                        t.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                        return t
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            break
                        chunk = json.loads(payload)
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            t.token_times.append(time.perf_counter())
                        usage = chunk.get("usage")
                        if usage:
                            t.output_tokens = int(usage.get("completion_tokens", 0))
                            t.prompt_tokens = int(usage.get("prompt_tokens", 0))
            except Exception as exc:  # a failed request is reported in its row, not raised mid-window
                t.error = f"{type(exc).__name__}: {exc}"
            return t

    async def _run(self, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestTiming]:
        import httpx

        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, trust_env=False) as client:
            return list(await asyncio.gather(*(self._one(client, r, sem) for r in requests)))

    def run(self, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestTiming]:
        return asyncio.run(self._run(requests, concurrency))

    def close(self) -> None:
        pass
