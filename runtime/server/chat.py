"""POST /v1/chat/completions: the model's chat template, then the same engine path as completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from envex.runtime.engine import RequestOutput
from envex.runtime.harmony import HarmonyStream, HarmonyTokens, split_output
from envex.runtime.server.context import ServerContext, clamp, sampling_params
from envex.runtime.server.errors import bad_request
from envex.runtime.server.generation import (
    Generation,
    Job,
    check_capacity,
    run_to_completion,
    start_generation,
    stream_events,
)
from envex.runtime.server.protocol import ChatCompletionRequest

_PROMPT = "messages"


def _entry(ctx: ServerContext, token_id: int, logprob: float) -> dict[str, Any]:
    text = ctx.token_text(token_id)
    return {"token": text, "logprob": clamp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(ctx: ServerContext, out: RequestOutput, top_n: int) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs content for the tokens of one output."""
    content = []
    for token_id, lp in zip(out.token_ids, out.logprobs or [], strict=False):
        top = sorted(lp.top.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        content.append({**_entry(ctx, token_id, lp.logprob), "top_logprobs": [_entry(ctx, t, v) for t, v in top]})
    return content


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    started = time.monotonic()
    req = await ctx.parse(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    ctx.check_max_tokens(req.max_new_tokens, "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    ids = await ctx.encode_chat(req.messages, add_generation_prompt=req.add_generation_prompt is not False)
    room = ctx.max_model_len - len(ids)
    if room < 1:
        raise bad_request(f"this model's maximum context length is {ctx.max_model_len} tokens; the messages take "
                          f"{len(ids)} tokens and leave no room for a reply; shorten them", param=_PROMPT,
                          code="context_length_exceeded")
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    jobs = [Job(0, ids, sampling_params(req, max_tokens=req.max_new_tokens or room, logprobs=top_n, seed_offset=i))
            for i in range(req.n or 1)]
    check_capacity(ctx.async_engine, jobs, _PROMPT)
    generation = Generation(ctx.async_engine, jobs, prefix="chat", prompt_param=_PROMPT, metrics=ctx.metrics,
                            started_at=started)
    if not await start_generation(request, generation):
        return Response(status_code=499)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": ctx.served_model_name}
    if req.stream:
        return StreamingResponse(stream_events(generation, _events(ctx, req, generation, head, top_n)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    logprobs: list[list[dict[str, Any]]] = [[] for _ in jobs]

    def collect(index: int, out: RequestOutput) -> None:
        if top_n is not None:
            logprobs[index] += chat_logprobs(ctx, out, top_n)

    if not await run_to_completion(request, generation, collect):
        return Response(status_code=499)
    harmony = HarmonyTokens.of(ctx.tokenizer)  # gpt-oss: reasoning and answer parsed apart (harmony.py)

    def message(i: int, text: str, token_ids: list[int]) -> dict[str, Any]:
        if harmony is None:
            return {"role": "assistant", "content": text}
        reasoning, content = split_output(ctx.tokenizer, harmony, token_ids, jobs[i].params.stop)
        return {"role": "assistant", "content": content, "reasoning_content": reasoning or None}

    choices = [
        {"index": i, "message": message(i, s.text, s.token_ids),
         "logprobs": {"content": logprobs[i], "refusal": None} if top_n is not None else None,
         "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
        for i, s in enumerate(generation.states)
    ]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": generation.usage()})


async def _events(ctx: ServerContext, req: ChatCompletionRequest, generation: Generation, head: dict[str, Any],
                  top_n: int | None) -> AsyncIterator[dict[str, Any]]:
    head = {**head, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if req.include_usage else {}
    harmony = HarmonyTokens.of(ctx.tokenizer)  # gpt-oss: reasoning deltas apart from content (harmony.py)
    streams = ([HarmonyStream(ctx.tokenizer, harmony, job.params.stop) for job in generation.jobs]
               if harmony is not None else [])  # fmt: skip
    # OpenAI's first chunk of each choice announces the role with empty content.
    for index in range(len(generation.jobs)):
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        yield {**head, "choices": [choice], **usage_field}
    async for index, out in generation.outputs():
        delta: dict[str, str] = {"content": out.text} if out.text else {}
        if streams:
            reasoning, content = streams[index].feed(out.token_ids)
            if out.finished:
                r, c = streams[index].finish()
                reasoning, content = reasoning + r, content + c
            delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if not delta and not out.finished and (top_n is None or not out.token_ids):
            continue
        state = generation.states[index]
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": chat_logprobs(ctx, out, top_n), "refusal": None} if top_n is not None else None,
            "finish_reason": state.finish_reason if out.finished else None,
        }
        if out.finished:
            choice["stop_reason"] = state.stop_reason
        yield {**head, "choices": [choice], **usage_field}
    if req.include_usage:
        yield {**head, "choices": [], "usage": generation.usage()}
