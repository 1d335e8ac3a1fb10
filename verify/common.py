"""Small helpers shared by the gates: chat prompts to token ids, streaming one request, timing."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from envex.runtime.engine import SamplingParams
from envex.verify.types import GateEngine

_ids = itertools.count()


def chat_ids(tokenizer: Any, user_text: str) -> list[int]:
    """The token ids of a one-turn chat with the generation prompt (the way the server builds them).

    The rendered template already holds the special tokens, so nothing is added on encoding (as
    transformers' apply_chat_template(tokenize=True) does). A model without a chat template (a base model, served
    through /v1/completions) gets the text itself, with its special tokens, as a completion prompt would.
    """
    if getattr(tokenizer, "chat_template", "") is None:
        return list(tokenizer.encode(user_text))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


@dataclass
class Streamed:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    deltas: list[str] = field(default_factory=list)


def stream_many(engine: GateEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[Streamed]:
    """Drive requests through add_request/step on an idle engine (all in flight together), collecting deltas."""
    ids = [f"verify-stream-{next(_ids)}-{time.monotonic_ns()}" for _ in requests]
    index = {rid: i for i, rid in enumerate(ids)}
    outs = [Streamed() for _ in requests]
    for rid, (prompt_ids, params) in zip(ids, requests, strict=True):
        engine.add_request(rid, list(prompt_ids), params)
    remaining = len(requests)
    while remaining:
        outputs = engine.step()
        if not outputs and not getattr(engine, "has_unfinished", lambda: True)():
            raise RuntimeError("streamed requests vanished from the engine without a finished output")
        for o in outputs:
            if o.request_id not in index:
                continue
            out = outs[index[o.request_id]]
            out.text += o.text
            out.token_ids += o.token_ids
            out.deltas.append(o.text)
            if o.finished:
                out.finish_reason = o.finish_reason or "stop"
                remaining -= 1
    return outs


def stream_one(engine: GateEngine, prompt_ids: list[int], params: SamplingParams) -> Streamed:
    return stream_many(engine, [(prompt_ids, params)])[0]


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return round(time.perf_counter() - self.start, 3)
