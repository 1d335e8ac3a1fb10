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
from envex.verify.reference import Reference
from envex.verify.types import GateEngine, GateResult, NumericPolicy

NAME = "reference_equality"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def crossed_top_k(a: list[int], a_top: Sequence[dict[int, float]], b: list[int], b_top: Sequence[dict[int, float]],
                  d: int) -> tuple[bool, bool]:  # fmt: skip
    """vLLM's rule at the first difference d of two greedy answers: (a's token is in b's top-k there, b's token is
    in a's top-k there); a token or top-k past the end of its answer counts as absent."""
    a_tok, b_tok = (a[d] if d < len(a) else None), (b[d] if d < len(b) else None)
    return a_tok in (b_top[d] if d < len(b_top) else {}), b_tok in (a_top[d] if d < len(a_top) else {})


def check_reference_equality(engine: GateEngine, reference: Reference, *, prompts: Sequence[str],
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
            mine_in, theirs_in = crossed_top_k(got.token_ids, [lp.top for lp in got.logprobs or []], ref.token_ids,
                                               ref.top, d)  # fmt: skip
            case.update({
                "engine_token": got.token_ids[d] if d < len(got.token_ids) else None,
                "reference_token": ref.token_ids[d] if d < len(ref.token_ids) else None,
                "engine_token_in_reference_topk": mine_in, "reference_token_in_engine_topk": theirs_in,
            })
            ok = mode == "topk" and mine_in and theirs_in
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
        summary=(f"{n_identical}/{len(cases)} prompts token-identical to HF transformers"
                 f"{' (its signed answers)' if reference.origin == 'signed' else ''} ({mode} rule)"),
    )
