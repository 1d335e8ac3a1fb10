"""POST /v1/completions: OpenAI's legacy text completions, streaming or not, n choices per prompt."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from envex.runtime.engine import RequestOutput, TokenLogprob
from envex.runtime.server.context import ServerContext, clamp, sampling_params
from envex.runtime.server.errors import APIError
from envex.runtime.server.generation import (
    Generation,
    Job,
    check_capacity,
    run_to_completion,
    start_generation,
    stream_events,
)
from envex.runtime.server.protocol import MAX_CHOICES, CompletionRequest

_PROMPT = "prompt"


class LegacyLogprobs:
    """OpenAI's legacy logprobs object for one choice: tokens, token_logprobs, top_logprobs, text_offset.

    `text_offset` counts characters into the choice's text (the echoed prompt included), token by token.
    """

    def __init__(self, ctx: ServerContext) -> None:
        self._ctx = ctx
        self.offset = 0
        self._reset()

    def _reset(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, entry: TokenLogprob | None) -> None:
        text = self._ctx.token_text(token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if entry is None:  # the first prompt token: nothing predicted it
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(clamp(entry.logprob))
        top = {self._ctx.token_text(t): clamp(lp) for t, lp in entry.top.items()}
        top.setdefault(text, clamp(entry.logprob))  # as vLLM: the chosen token is always listed
        self.top_logprobs.append(top)

    def take(self) -> dict[str, Any]:
        """What was added since the last take (a streaming delta, or everything for a full response)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self._reset()
        return out


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    started = time.monotonic()
    req = await ctx.parse(request, CompletionRequest)
    ctx.check_model(req.model)
    ctx.check_max_tokens(req.max_tokens, "max_tokens")
    prompts: list[str] | list[list[int]] = req.prompt
    n = req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(400, f"prompt: {len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices; "
                       "split the request", param=_PROMPT)
    if isinstance(prompts[0], str):
        prompt_ids = await ctx.encode(prompts, add_special_tokens=req.add_special_tokens is not False)  # type: ignore[arg-type]
        prompt_texts = list(prompts)
    else:
        prompt_ids = [list(p) for p in prompts]  # type: ignore[arg-type]
        prompt_texts = await ctx.decode(prompt_ids) if req.echo else []
    echo_logprobs = req.logprobs if req.echo else None
    jobs = [
        Job(p, ids, sampling_params(req, max_tokens=req.max_tokens or 16, logprobs=req.logprobs,
                                    prompt_logprobs=echo_logprobs, seed_offset=i))
        for p, ids in enumerate(prompt_ids) for i in range(n)
    ]
    check_capacity(ctx.async_engine, jobs, _PROMPT)
    generation = Generation(ctx.async_engine, jobs, prefix="cmpl", prompt_param=_PROMPT, metrics=ctx.metrics,
                            started_at=started)
    if not await start_generation(request, generation):
        return Response(status_code=499)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.served_model_name}
    logprobs = [LegacyLogprobs(ctx) if req.logprobs is not None else None for _ in jobs]
    first = [True] * len(jobs)

    def delta(index: int, out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The text and logprobs this output adds to choice `index` (the echoed prompt on its first output)."""
        job, text, lp = jobs[index], out.text, logprobs[index]
        if first[index]:
            first[index] = False
            if req.echo:
                text = prompt_texts[job.prompt_index] + text
                if lp is not None:
                    prompt_lps = out.prompt_logprobs or [None] * len(job.prompt_ids)
                    for token_id, entry in zip(job.prompt_ids, prompt_lps, strict=False):
                        lp.add(token_id, entry)
        if lp is None:
            return text, None
        for token_id, entry in zip(out.token_ids, out.logprobs or [], strict=False):
            lp.add(token_id, entry)
        return text, lp.take()

    if req.stream:
        return StreamingResponse(stream_events(generation, _events(req, generation, head, delta)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    texts = [""] * len(jobs)
    merged: list[dict[str, Any] | None] = [None] * len(jobs)

    def collect(index: int, out: RequestOutput) -> None:
        text, lp = delta(index, out)
        texts[index] += text
        if lp is not None:
            acc = merged[index]
            merged[index] = lp if acc is None else {k: acc[k] + lp[k] for k in acc}

    if not await run_to_completion(request, generation, collect):
        return Response(status_code=499)
    choices = [
        {"index": i, "text": texts[i], "logprobs": merged[i] if req.logprobs is not None else None,
         "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
        for i, s in enumerate(generation.states)
    ]
    return JSONResponse({**head, "choices": choices, "usage": generation.usage()})


async def _events(req: CompletionRequest, generation: Generation, head: dict[str, Any], delta: Any
                  ) -> AsyncIterator[dict[str, Any]]:
    usage_field = {"usage": None} if req.include_usage else {}
    async for index, out in generation.outputs():
        text, lp = delta(index, out)
        state = generation.states[index]
        if not text and lp is None and not out.finished:
            continue
        choice = {"index": index, "text": text, "logprobs": lp,
                  "finish_reason": state.finish_reason if out.finished else None,
                  "stop_reason": state.stop_reason if out.finished else None}
        yield {**head, "choices": [choice], **usage_field}
    if req.include_usage:
        yield {**head, "choices": [], "usage": generation.usage()}
