"""Gate: batch invariance. A prompt's greedy tokens must not depend on what else the engine is doing.

Each probe prompt is decoded greedily (ignore_eos, max_tokens tokens) under four conditions, and every
condition must give the tokens of the first, token for token:

1. alone   : the probe by itself, prefix cache off (a cold prefill in one chunk);
2. batched : all probes among `others` filler prompts of assorted lengths, submitted together, prefix cache off:
             the probes' prefill chunks share steps with the fillers' (and are cut where the token budget runs
             out), and they decode in a batch of len(probes) + others, each at its own row;
3. chunked : each probe alone again, prefix cache off, the token budget cut to `small_budget` tokens per step
             (an odd size, so chunk boundaries never line up with KV blocks);
4. cached  : the probes' prompts published to the prefix cache (one throwaway batch), then the probes among the
             fillers in reverse order: their cached blocks are read, only the rest is computed.

Conditions 1-3 switch the engine's prefix cache or token budget for their duration (LLMEngine's
`blocks.enable_prefix_caching` and `scheduler.max_num_batched_tokens`, as LLMEngine.warm_up does) and restore
them; on an engine without them the gate runs what it can and says which in the evidence (`controlled`).

Verdict: with the engine in its deterministic mode (EngineConfig.deterministic) every condition must be
identical ("batch invariance" is then a promise). Without it the gate still measures and reports the differing
tokens, and passes as not required: the default fast path makes no such promise (offline_docs/gates.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from envex.runtime.engine import SamplingParams
from envex.verify.common import Timer, chat_ids
from envex.verify.types import GateEngine, GateResult

NAME = "batch_invariance"


def filler_prompts(tokenizer: Any, texts: Sequence[str], count: int, longest: int = 400) -> list[list[int]]:
    """`count` distinct prompts of assorted lengths (24 to `longest` tokens) cut from `texts`."""
    encoded = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    encoded = [e for e in encoded if e] or [[1, 2, 3]]
    out: list[list[int]] = []
    for i in range(count):
        ids = encoded[i % len(encoded)]
        length = max(1, min(24 + (i * 53) % 377, longest))  # spread over the token budget's chunk boundaries
        start = (i * 13) % len(ids)  # a different start for each filler cut from the same text
        out.append(((ids[start:] + ids) * (length // len(ids) + 1))[:length])
    return out


@contextmanager
def _setting(obj: Any, attr: str, value: Any) -> Iterator[bool]:
    """Set obj.attr for the duration (True), or leave an object without it untouched (False)."""
    if obj is None or not hasattr(obj, attr):
        yield False
        return
    before = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield True
    finally:
        setattr(obj, attr, before)


def _hits(engine: GateEngine) -> int | None:
    stats = getattr(engine, "stats", None)
    return stats().prefix_cache_hit_tokens_total if callable(stats) else None


def _run(engine: GateEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int | None]:
    """Token ids of each prompt, all submitted together; and the prefix-cache hit tokens of the run."""
    before = _hits(engine)
    tokens = [c.token_ids for c in engine.generate(prompts, params)]
    after = _hits(engine)
    return tokens, (after - before if after is not None and before is not None else None)


def _interleave(probes: list[list[int]], others: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The probes spread among the fillers (not first: their prefill then starts mid-budget); their indices."""
    batch = list(others)
    where = []
    for i, p in enumerate(probes):
        at = min(len(batch), (i + 1) * (len(others) + 1) // (len(probes) + 1) + i)
        batch.insert(at, p)
        where.append(at)
    return batch, where


def _compare(want: list[int], got: list[int]) -> dict[str, Any]:
    diff = [i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b]
    diff += list(range(min(len(want), len(got)), max(len(want), len(got))))
    return {"differing_tokens": len(diff), "first_difference": diff[0] if diff else None}


def check_batch_invariance(engine: GateEngine, *, prompts: Sequence[str], texts: Sequence[str], others: int = 32,
                           max_tokens: int = 256, small_budget: int | None = None,
                           deterministic: bool | None = None) -> GateResult:  # fmt: skip
    """prompts: the probes (chat messages); texts: what the fillers are cut from. deterministic: whether the
    engine promises invariance (None: read EngineConfig.deterministic from engine.config, else False)."""
    timer = Timer()
    tok = engine.tokenizer
    config = getattr(engine, "config", None)
    if deterministic is None:
        deterministic = bool(getattr(config, "deterministic", False))
    blocks = getattr(engine, "blocks", None)
    scheduler = getattr(engine, "scheduler", None)
    budget = small_budget or getattr(blocks, "block_size", 16) + 3
    probes = [chat_ids(tok, p) for p in prompts]
    fillers = filler_prompts(tok, texts, others, longest=min(400, engine.max_model_len - max_tokens - 1))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, list[list[int]]] = {}
    hits: dict[str, int | None] = {}
    controlled: dict[str, bool] = {}
    with _setting(blocks, "enable_prefix_caching", False) as cold:
        controlled["prefix_cache_off"] = cold
        runs["alone"] = [_run(engine, [p], params)[0][0] for p in probes]
        batch, where = _interleave(probes, fillers)
        batched, hits["batched"] = _run(engine, batch, params)
        runs["batched"] = [batched[i] for i in where]
        with _setting(scheduler, "max_num_batched_tokens", budget) as small:
            controlled["small_budget"] = small
            runs["chunked"] = [_run(engine, [p], params)[0][0] for p in probes]
    engine.generate(probes, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # publish the prompts
    batch, where = _interleave(probes, fillers[::-1])
    cached, hits["cached"] = _run(engine, batch, params)
    runs["cached"] = [cached[i] for i in where]

    cases = []
    for i, prompt in enumerate(prompts):
        want = runs["alone"][i]
        per = {name: _compare(want, runs[name][i]) for name in ("batched", "chunked", "cached")}
        cases.append({"prompt": prompt, "prompt_tokens": len(probes[i]), "tokens": len(want), **per})
    differing = sum(c[n]["differing_tokens"] for c in cases for n in ("batched", "chunked", "cached"))
    compared = 3 * sum(c["tokens"] for c in cases)
    identical = differing == 0
    verdict = "pass" if identical or not deterministic else "fail"
    what = (f"{len(prompts)} prompts x {max_tokens} greedy tokens alone, in a batch of {len(prompts) + others}, "
            f"in {budget}-token chunks and after prefix caching")  # fmt: skip
    if identical:
        summary = f"identical tokens: {what}"
    else:
        summary = f"{differing} of {compared} tokens differ from the prompt alone: {what}"
    if not deterministic:
        summary = f"not required (deterministic mode off); {summary}"
    return GateResult(
        name=NAME,
        verdict=verdict,
        thresholds={"rule": "every probe's tokens identical in every condition", "required": deterministic,
                    "max_tokens": max_tokens, "batch": len(prompts) + others, "small_budget": budget},
        evidence={"deterministic": deterministic, "cases": cases, "differing_tokens": differing,
                  "compared_tokens": compared, "prefix_cache_hit_tokens": hits, "controlled": controlled},
        seconds=timer.seconds,
        summary=summary,
    )
