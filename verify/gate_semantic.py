"""Gate: semantic regression. Per-token KL divergence KL(reference || engine) and top-1 agreement of the logits
over a held text corpus (verify/data_corpus.json), with thresholds set per numeric policy.

Against signed references (verify/signed_reference.py), which keep the reference's top tokens of each position and
not its whole distribution, the KL is taken over those tokens plus the rest of the vocabulary as one outcome: a
lower bound of the full KL (equal where the top tokens hold all the mass), under the same thresholds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from envex.verify.common import Timer
from envex.verify.reference import HFReference
from envex.verify.signed_reference import SignedReference
from envex.verify.types import GateEngine, GateResult, NumericPolicy

NAME = "semantic_regression"

# Keyed by the engine's dtype. float32 against the float32 reference is the same computation up to summation
# order (measured KL ~1e-10 on CPU), so its bar is tight; bf16/fp16 bars follow what reduced-precision serving of
# the same weights typically shows and are to be re-measured on each new accelerator (offline_docs/gates.md).
THRESHOLDS: dict[str, dict[str, float]] = {
    "float32": {"max_mean_kl": 1e-4, "max_p99_kl": 1e-3, "min_top1": 0.99},
    "float16": {"max_mean_kl": 5e-3, "max_p99_kl": 5e-2, "min_top1": 0.97},
    "bfloat16": {"max_mean_kl": 2e-2, "max_p99_kl": 2e-1, "min_top1": 0.94},
}


def kl_and_top1(reference_logits: torch.Tensor, engine_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(ref || engine) in nats and top-1 agreement; inputs [T, V]."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    eng = torch.log_softmax(engine_logits.double(), dim=-1)
    kl = (ref.exp() * (ref - eng)).sum(-1).clamp_min(0.0)  # [T]
    top1 = reference_logits.argmax(-1) == engine_logits.argmax(-1)  # [T]
    return kl, top1


def grouped_kl_and_top1(top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                        engine_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KL(ref || engine) over the reference's top tokens [T, k] (logprobs [T, k], most likely first) and the rest of
    the vocabulary lumped into one outcome, and exact top-1 agreement; engine logits [T, V]."""
    eng = torch.log_softmax(engine_logits.double(), dim=-1)
    p = top_logprobs.double().exp()  # [T, k]
    q_top = eng.gather(-1, top_ids)  # [T, k]
    rest_p = (1.0 - p.sum(-1)).clamp_min(0.0)
    rest_q = (1.0 - q_top.exp().sum(-1)).clamp_min(torch.finfo(torch.float64).tiny)
    rest = torch.where(rest_p > 0, rest_p * (rest_p.clamp_min(torch.finfo(torch.float64).tiny).log() - rest_q.log()),
                       torch.zeros_like(rest_p))  # fmt: skip
    kl = ((p * (top_logprobs.double() - q_top)).sum(-1) + rest).clamp_min(0.0)
    return kl, engine_logits.argmax(-1) == top_ids[:, 0]


def check_semantic(engine: GateEngine, reference: HFReference | SignedReference, *, texts: Sequence[str],
                   max_len: int = 512, thresholds: dict[str, float] | None = None) -> GateResult:
    timer = Timer()
    policy = NumericPolicy.of(engine)
    limits = thresholds or THRESHOLDS.get(policy.dtype, THRESHOLDS["bfloat16"])
    kls, agree, per_text = [], [], []
    for text in texts:
        ids = engine.tokenizer.encode(text)[:min(max_len, engine.max_model_len)]
        engine_logits = engine.full_logits(ids).float().cpu()
        if isinstance(reference, SignedReference):
            kl, top1 = grouped_kl_and_top1(*reference.top_logprobs(ids), engine_logits)
        else:
            kl, top1 = kl_and_top1(reference.full_logits(ids), engine_logits)
        kls.append(kl)
        agree.append(top1)
        per_text.append({"tokens": len(ids), "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                         "top1": float(top1.float().mean()), "text": text[:60]})
    kl_all = torch.cat(kls)
    top1_all = torch.cat(agree).float()
    measured: dict[str, Any] = {"mean_kl": float(kl_all.mean()), "p99_kl": float(torch.quantile(kl_all, 0.99)),
                                "max_kl": float(kl_all.max()), "top1": float(top1_all.mean()),
                                "tokens": int(kl_all.numel())}
    ok = (measured["mean_kl"] <= limits["max_mean_kl"] and measured["p99_kl"] <= limits["max_p99_kl"]
          and measured["top1"] >= limits["min_top1"])
    return GateResult(
        name=NAME,
        verdict="pass" if ok else "fail",
        thresholds={"policy": policy.name, **limits},
        evidence={**measured, "engine_policy": policy.name, "reference_policy": reference.policy_name,
                  "kl_over": "the whole vocabulary" if not isinstance(reference, SignedReference)
                  else "the signed top tokens and the rest as one outcome (a lower bound)", "texts": per_text},
        seconds=timer.seconds,
        summary=(f"mean KL {measured['mean_kl']:.2e} nats, top-1 agreement {measured['top1']:.1%} over "
                 f"{measured['tokens']} tokens"),
    )
