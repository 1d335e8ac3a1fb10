"""AsyncEngine: the LLMEngine stepped by one background thread, streaming each request's outputs to asyncio.

The engine is not thread-safe, so the thread owns it: callers only put commands (add, abort) on a queue, and the
thread hands outputs back to each request's asyncio.Queue on the caller's event loop. A request whose consumer
goes away (the generator is closed or its task cancelled) is aborted and its blocks are freed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from envex.runtime.engine.engine import EngineStats, LLMEngine
from envex.runtime.engine.types import (
    EngineError,
    EngineInternalError,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[str, object]] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._in_flight = 0  # admitted and not finished (approximate queue depth seen by callers)
        self.started_at = time.time()
        self.last_error: str | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="envex-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ------------------------------------------------------------------------------------------

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns()}"

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (text and token deltas) until the finished one.

        Raises PromptTooLongError / QueueFullError / EngineError before the first output when the request cannot
        be admitted. Closing the iterator early aborts the request.
        """
        request_id = request_id or self.new_request_id()
        pending = _Pending(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self.engine.check_request(prompt_token_ids, params, in_flight=self._in_flight)
            self._in_flight += 1
            self._pending[request_id] = pending
        self._commands.put(("add", (request_id, list(prompt_token_ids), params)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await pending.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
                self._in_flight -= 1
            if not finished:
                self._commands.put(("abort", request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ---- the engine thread ---------------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is not None:
            try:
                pending.loop.call_soon_threadsafe(pending.outputs.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                self._commands.put(("abort", request_id))

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, ids, params = arg  # type: ignore[misc]
                with self._lock:
                    wanted = request_id in self._pending
                if not wanted:
                    continue  # cancelled before it was admitted
                try:
                    self.engine.add_request(request_id, ids, params)
                except EngineError as exc:
                    self._deliver(request_id, exc)
            elif kind == "abort":
                self.engine.abort_request(str(arg))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step must not hang every client: fail them all, keep serving
                log.exception("engine step failed")
                self.last_error = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    ids = list(self._pending)
                for request_id in ids:
                    self.engine.abort_request(request_id)
                    self._deliver(request_id, EngineInternalError(f"internal engine error: {exc}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
