"""Gate: needle retrieval. A fact is placed at depths 0-100% of filler text of lengths up to the model's window;
the model is asked for it, and the answer is scored by exact match of the needle's value. The engine's score is
compared with the reference engine's own score on the same prompts (a small model misses some cells; what
matters is that we miss no more than the reference does).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from envex.runtime.engine import SamplingParams
from envex.verify.common import Timer, chat_ids
from envex.verify.data import Needle, NeedleData, needle_data
from envex.verify.reference import Reference
from envex.verify.types import GateEngine, GateResult

NAME = "needle_retrieval"


@dataclass(frozen=True)
class NeedlePrompt:
    length: int  # the asked-for prompt length in tokens
    depth: float
    needle: Needle
    token_ids: list[int]


def build_prompt(tokenizer: Any, data: NeedleData, needle: Needle, *, length: int, depth: float) -> list[int]:
    """A chat prompt of at most `length` tokens with `needle.fact` placed at `depth` (0..1) of the filler."""
    def render(sentences: list[str]) -> list[int]:
        k = round(depth * len(sentences))
        body = " ".join([*sentences[:k], needle.fact, *sentences[k:]])
        text = f"{data.instruction}\n\n{body}\n\nQuestion: {needle.question} {data.question_suffix}"
        return chat_ids(tokenizer, text)

    overhead = len(render([]))
    costs = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in data.filler]
    sentences: list[str] = []
    budget = length - overhead
    i = 0
    while budget - costs[i % len(costs)] >= 0:
        budget -= costs[i % len(costs)]
        sentences.append(data.filler[i % len(data.filler)])
        i += 1
    ids = render(sentences)
    while len(ids) > length and sentences:  # per-sentence counts are approximate at the joins
        sentences.pop()
        ids = render(sentences)
    return ids


def needle_prompts(tokenizer: Any, *, lengths: Sequence[int], depths: Sequence[float], max_model_len: int,
                   max_tokens: int) -> list[NeedlePrompt]:
    data = needle_data()
    out = []
    for li, length in enumerate(lengths):
        fit = min(length, max_model_len - max_tokens)  # "up to the window": the longest prompt that still answers
        for di, depth in enumerate(depths):
            needle = data.needles[(li * len(depths) + di) % len(data.needles)]
            out.append(NeedlePrompt(fit, depth, needle, build_prompt(tokenizer, data, needle, length=fit,
                                                                     depth=depth)))
    return out


def retrieved(answer: str, text: str) -> bool:
    """Exact match: the needle's value appears as a whole number in the answer."""
    return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", text) is not None


def check_needle(engine: GateEngine, reference: Reference, *, lengths: Sequence[int] = (1024, 2048, 4096, 8192),
                 depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), max_tokens: int = 24,
                 max_score_drop: float = 0.1) -> GateResult:
    timer = Timer()
    prompts = needle_prompts(engine.tokenizer, lengths=lengths, depths=depths, max_model_len=engine.max_model_len,
                             max_tokens=max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ours = engine.generate([p.token_ids for p in prompts], params)
    cells = []
    for p, got in zip(prompts, ours, strict=True):
        ref = reference.greedy(p.token_ids, max_tokens, top_k=0)
        ref_text = engine.tokenizer.decode(ref.token_ids)
        cells.append({
            "length": p.length, "prompt_tokens": len(p.token_ids), "depth": p.depth, "answer": p.needle.answer,
            "engine_hit": retrieved(p.needle.answer, got.text), "reference_hit": retrieved(p.needle.answer, ref_text),
            "engine_text": got.text, "reference_text": ref_text,
        })
    n = len(cells)
    ours_score = sum(c["engine_hit"] for c in cells) / n
    ref_score = sum(c["reference_hit"] for c in cells) / n
    ok = ours_score >= ref_score - max_score_drop
    return GateResult(
        name=NAME,
        verdict="pass" if ok else "fail",
        thresholds={"max_score_drop": max_score_drop, "rule": "engine score >= reference score - max_score_drop",
                    "lengths": list(lengths), "depths": list(depths)},
        evidence={"engine_score": ours_score, "reference_score": ref_score, "cells": cells},
        seconds=timer.seconds,
        summary=f"needle found in {ours_score:.0%} of {n} cells vs reference {ref_score:.0%}",
    )
