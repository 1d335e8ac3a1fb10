"""What one request may cost the server, in one place, and the bounded pool that prepares requests off the loop.

Parsing a large body, rendering a chat template and tokenizing are CPU work that would stall every other client
if it ran on the event loop (a 4 MB prompt takes about 2 s to tokenize on one core). Small requests are prepared
inline, which costs less than a hop to a thread; anything larger runs on `PrepPool`, a few threads with a bounded
queue. Tokenizing uses the tokenizer's batch calls, which release the GIL, so the loop keeps running meanwhile.
The limits are documented in offline_docs/api.md ("Limits").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from envex.runtime.server.errors import APIError

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """Per-request bounds (400 or 413 when passed, naming the field and the limit) and the preparation pool."""

    max_body_bytes: int = 4 * 1024 * 1024  # 413 beyond it
    max_messages: int = 4096  # messages in one chat (chat completions and /tokenize)
    max_message_chars: int = 1_048_576  # characters of one message's content (text parts joined)
    max_prompt_chars: int = 1_048_576  # characters of a request's string prompts, all of them together
    max_rendered_chars: int = 2_097_152  # characters of the chat template's output for one request
    max_token_ids: int = 262_144  # token ids in a request's token-id prompts, or in /detokenize's tokens
    max_stop_token_ids: int = 256  # stop_token_ids entries (each is checked at every generated token)
    prep_workers: int = 2  # threads that parse, render and tokenize requests over inline_bytes / inline_chars
    prep_queue: int = 32  # requests that may wait for a prep thread; beyond it the server answers 429
    inline_bytes: int = 65_536  # a body up to this size is parsed on the event loop
    inline_chars: int = 32_768  # text up to this many characters (or token ids) is tokenized on the event loop
    inline_messages: int = 256  # a chat of up to this many messages (and inline_chars) is rendered on the loop

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "prep_queue" else 1):
                raise ValueError(f"ServerLimits.{name}: must be an integer >= 1 (prep_queue >= 0), got {value!r}")


class PrepPool:
    """`prep_workers` threads; at most `prep_queue` jobs wait for one, and a job past that is refused with 429.

    A job counts until its thread has finished it, even when the client has gone and its request was cancelled
    (a thread cannot be interrupted), so leaving early cannot be used to pile up work beyond the bound.
    """

    def __init__(self, limits: ServerLimits) -> None:
        self._executor = ThreadPoolExecutor(max_workers=limits.prep_workers, thread_name_prefix="envex-prep")
        self._slots = limits.prep_workers + limits.prep_queue
        self._used = 0  # only touched on the event loop

    @property
    def busy(self) -> int:
        """Jobs running or waiting."""
        return self._used

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self._used >= self._slots:
            raise APIError(429, f"the server is busy preparing other requests ({self._used} running or waiting); "
                           "retry later", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        self._used += 1
        job: Future[T] = self._executor.submit(fn, *args)

        def release(_: Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(self._release)
            except RuntimeError:  # the loop is closed (server shut down): nothing left to count
                pass

        job.add_done_callback(release)
        return await asyncio.wrap_future(job)

    def _release(self) -> None:
        self._used -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
