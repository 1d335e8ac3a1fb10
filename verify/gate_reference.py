"""Gate: greedy tokens identical to HF transformers on the same weights.

Where the numeric policy is the reference's own (float32 through the torch kernels on a CPU) the tokens must be
identical. Where it differs (bf16 or Triton on a GPU, low-bit later) we apply vLLM's rule from its model tests
(`check_logprobs_close`): the sequences may diverge, but at the first differing position each side's token must
be among the other side's top-k (k=5) candidates; after that point the two continue from different prefixes and
are not compared. The divergence point is reported either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from envex.runtime.engine import SamplingParams
from envex.verify.common import Timer, chat_ids
from envex.verify.reference import HFReference
from envex.verify.types import GateEngine, GateResult, NumericPolicy

NAME = "reference_equality"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_reference_equality(engine: GateEngine, reference: HFReference, *, prompts: Sequence[str],
                             max_tokens: int = 64, mode: Literal["auto", "exact", "topk"] = "auto",
                             top_k: int = 5) -> GateResult:
    timer = Timer()
    policy = NumericPolicy.of(engine)
    if mode == "auto":
        mode = "exact" if policy.computes_like(reference.policy_name) else "topk"
    encoded = [chat_ids(engine.tokenizer, p) for p in prompts]
    ours = engine.generate(encoded, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_k))
    cases: list[dict[str, Any]] = []
    ok_all = True
    for prompt, ids, got in zip(prompts, encoded, ours, strict=True):
        ref = reference.greedy(ids, max_tokens, top_k=top_k)
        d = first_difference(got.token_ids, ref.token_ids)
        case: dict[str, Any] = {
            "prompt": prompt, "prompt_tokens": len(ids), "engine_tokens": len(got.token_ids),
            "reference_tokens": len(ref.token_ids), "identical": d is None, "divergence_index": d,
            "engine_text": got.text, "reference_text": engine.tokenizer.decode(ref.token_ids),
        }
        ok = d is None
        if d is not None:
            mine = got.token_ids[d] if d < len(got.token_ids) else None
            theirs = ref.token_ids[d] if d < len(ref.token_ids) else None
            mine_top = got.logprobs[d].top if got.logprobs and d < len(got.logprobs) else {}
            theirs_top = ref.top[d] if d < len(ref.top) else {}
            case.update({
                "engine_token": mine, "reference_token": theirs,
                "engine_token_in_reference_topk": mine in theirs_top,
                "reference_token_in_engine_topk": theirs in mine_top,
            })
            ok = mode == "topk" and mine in theirs_top and theirs in mine_top
        case["ok"] = ok
        ok_all &= ok
        cases.append(case)
    n_identical = sum(c["identical"] for c in cases)
    return GateResult(
        name=NAME,
        verdict="pass" if ok_all else "fail",
        thresholds={"mode": mode, "top_k": top_k, "max_tokens": max_tokens,
                    "rule": "identical tokens" if mode == "exact"
                    else f"at the first difference each token is in the other's top-{top_k}"},
        evidence={"engine_policy": policy.name, "reference_policy": reference.policy_name,
                  "prompts": len(cases), "identical": n_identical, "cases": cases},
        seconds=timer.seconds,
        summary=f"{n_identical}/{len(cases)} prompts token-identical to HF transformers ({mode} rule)",
    )
