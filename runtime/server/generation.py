"""Running one API request as several engine requests (n choices x prompts), shared by both endpoints.

A `Generation` starts every choice, waits until each has produced its first output (so admission errors such as
a full queue become a proper HTTP status, not an error in the middle of a 200 stream), then yields outputs from
all choices as they come. Closing it, or cancelling the task that iterates it, aborts every unfinished choice in
the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from envex.runtime.engine import (
    EngineError,
    EngineInternalError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from envex.runtime.server.async_engine import AsyncEngine
from envex.runtime.server.errors import APIError, bad_request
from envex.runtime.server.metrics import Metrics

log = logging.getLogger(__name__)


def engine_error(exc: BaseException, prompt_param: str) -> APIError:
    """An engine exception -> the HTTP error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineError) and not isinstance(exc, EngineInternalError):
        message = str(exc)
        return bad_request(message, param=prompt_param if message.startswith("prompt") else None)
    return APIError(500, f"{exc}; see the server log")


def failed_output(out: RequestOutput) -> APIError | None:
    """A request the engine ended with finish_reason "error" (its own sampling failed; the batch went on)."""
    if out.finish_reason != "error":
        return None
    log.warning("request %s failed in the engine: %s", out.request_id, out.error)
    return APIError(500, f"{out.error or 'the engine could not continue this request'}; the other requests are "
                    "not affected; see the server log", code="request_failed")


def sampling_error(exc: ValueError) -> APIError:
    """SamplingParams' own validation (its errors carry the field in `param`)."""
    return bad_request(str(exc), param=getattr(exc, "param", None))


@dataclass
class Job:
    """One choice: the prompt it continues (index into the request's prompts) and its sampling settings."""

    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ChoiceState:
    """What the server accumulates for one choice while it runs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int = 0
    first_at: float | None = None


def check_capacity(async_engine: AsyncEngine, jobs: list[Job], prompt_param: str) -> None:
    """Refuse up front what cannot be admitted, before any choice starts (no half-admitted requests)."""
    if not async_engine.is_running:
        raise APIError(503, "the engine is not running; see the server log and /health", code="engine_down")
    engine = async_engine.engine
    for i, job in enumerate(jobs):  # admission is judged in one place, the engine's check_request
        try:
            engine.check_request(job.prompt_ids, job.params, in_flight=async_engine.in_flight + i)
        except EngineError as exc:
            raise engine_error(exc, prompt_param) from None


class Generation:
    def __init__(self, async_engine: AsyncEngine, jobs: list[Job], *, prefix: str, prompt_param: str,
                 metrics: Metrics, started_at: float) -> None:
        self._engine = async_engine
        self.jobs = jobs
        self.states = [ChoiceState() for _ in jobs]
        self._prompt_param = prompt_param
        self._metrics = metrics
        self._started_at = started_at
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._done: set[int] = set()  # choices whose finished output (or end) has been seen
        self._ids = [async_engine.new_request_id(prefix) for _ in jobs]

    async def _pump(self, index: int) -> None:
        job = self.jobs[index]
        try:
            async for out in self._engine.generate(job.prompt_ids, job.params, self._ids[index]):
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # delivered to the consumer, which maps it to an HTTP error
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, None))

    async def start(self) -> None:
        """Start every choice and wait for each one's first output; raise the HTTP error if any is refused."""
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.jobs))]
        waiting = set(range(len(self.jobs)))
        try:
            while waiting:
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise engine_error(item, self._prompt_param)
                if item is None:  # the choice's stream ended (its outputs, if any, are already buffered)
                    self._done.add(index)
                    waiting.discard(index)
                    continue
                failed = failed_output(item)
                if failed is not None:  # before any byte of the response: a plain 500 for this request
                    raise failed
                self._buffer.append((index, item))
                waiting.discard(index)
        except BaseException:
            await self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every choice, in arrival order; the finished one of each comes last for that choice."""
        try:
            for index, out in self._buffer:
                self._record(index, out)
                yield index, out
            self._buffer.clear()
            while len(self._done) < len(self.jobs):
                index, item = await self._queue.get()
                if item is None:  # a stream that ended without a finished output (aborted): nothing more comes
                    self._done.add(index)
                    continue
                if isinstance(item, BaseException):
                    raise engine_error(item, self._prompt_param)
                failed = failed_output(item)
                if failed is not None:  # a stream gets it as its last event; other requests go on
                    raise failed
                self._record(index, item)
                yield index, item
        finally:
            await self.close()

    def _record(self, index: int, out: RequestOutput) -> None:
        state = self.states[index]
        now = time.monotonic()
        if state.first_at is None and out.token_ids:
            state.first_at = now
            self._metrics.observe_ttft(now - self._started_at)
        state.text += out.text
        state.token_ids += out.token_ids
        state.completion_tokens = out.completion_token_count
        if out.finished:
            self._done.add(index)
            state.finish_reason = "length" if out.finish_reason == "length" else "stop"
            state.stop_reason = out.stop_reason
            if state.first_at is not None and state.completion_tokens > 1:
                self._metrics.observe_tpot((now - state.first_at) / (state.completion_tokens - 1))

    async def close(self) -> None:
        """Abort every unfinished choice (cancelling its task closes its engine generator) and wait for it."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def prompt_tokens(self) -> int:
        seen: dict[int, int] = {job.prompt_index: len(job.prompt_ids) for job in self.jobs}
        return sum(seen.values())

    def usage(self) -> dict[str, int]:
        prompt = self.prompt_tokens()
        completion = sum(s.completion_tokens for s in self.states)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def until_disconnected(request: Request) -> None:
    """Return when the client goes away (call only after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Run `work` while watching the client; False if it went away first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # re-raise an engine error
    return True


async def start_generation(request: Request, generation: Generation) -> bool:
    """Start every choice; False (and nothing left in the engine) if the client left while they were queued."""
    if await unless_disconnected(request, generation.start()):
        return True
    await generation.close()
    return False


async def run_to_completion(request: Request, generation: Generation,
                            on_output: Callable[[int, RequestOutput], None]) -> bool:
    """Drain a non-streaming generation; False (and every choice aborted) if the client disconnected first."""

    async def drain() -> None:
        async for index, out in generation.outputs():
            on_output(index, out)

    finished = await unless_disconnected(request, drain())
    if not finished:
        await generation.close()
    return finished


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def stream_events(generation: Generation, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SSE bytes for `events`, an error event if the engine fails mid-stream, and always `data: [DONE]`."""
    try:
        async for event in events:
            yield sse(event)
    except APIError as exc:
        yield sse(exc.body())
    finally:
        await generation.close()
    yield sse("[DONE]")
