"""Gate: a packed KV cache (kv_cache_dtype fp8 or int4, issue 43) against the same model's bf16-KV self.

The same engine settings run twice, one engine after the other (a GPU holds one copy of the weights at a time):
first with the unpacked cache ("bf16": K and V in the activation dtype, bfloat16 on a GPU, float32 on the CPU),
then with the packed one; both one sequence at a time with the prefix cache off (ISOLATED). That is deliberate: a
packed cache's greedy tokens may depend on the batch (a last-bit difference in a key computed in another batch or
chunk shape can move its quantization code, and a near-tie then flips: measured on the embedded model, "Write a
short poem about the sea." differs from its own run alone at token ~13 in the stopping gate's batch of 7, under
fp8 and int4; its float32 cache does not). That is batch invariance's business (the deterministic mode, which
refuses a packed cache), not stopping's or quality's. Judged:

- **logits**: next-token distributions over `prompts` long prompts of `prompt_tokens` tokens of the fixed local
  text (verify.weight_quality.text_tokens: verify/data_corpus.json, then offline_docs/*.md); as llama.cpp's
  KL-divergence tool does, only the second half of each prompt is scored, so every scored position reads at least
  half a prompt of packed cache. Mean KL(bf16-KV || packed) in nats and top-1 agreement, held to the dtype's band
  (`KV_BANDS`). The install uses the issue's lengths (4096 tokens); the CPU tests pass shorter ones.
- **needle at the window's end**: needle prompts that fill the window (max_model_len less the answer's tokens), the
  needle at each of `needle_depths`; the packed cache must find the needle in every cell its bf16-KV self finds it
  (100% of them). Where the bf16-KV self finds none, the cells prove nothing and the evidence says so.
- **stopping unchanged**: the stopping gate (verify/gate_stopping.py: EOS, exact max_tokens, stop strings across
  token boundaries, streaming equal to non-streaming) passes on the packed engine.

The bands were set from a measurement on the embedded model (SmolLM2-135M, float32 activations on the CPU,
verify/lab/kv_cache_quality.py, verify/lab/journal.md 2026-12-06), before any gate ran: over 512-4096-token
prompts fp8 mean KLD 0.0034-0.0043 and top-1 95.7-97.1%, int4 0.044-0.060 and 85.4-90.2% (4096 tokens: fp8
0.00367 / 96.6%, int4 0.0510 / 87.1%). Each band is about 2x the worst mean KLD measured and 3-5 points under the
worst top-1: fp8 <= 0.01 / >= 93%, int4 <= 0.12 / >= 80%. These are the embedded model's bands (a 135M model is
sensitive; an 8B-class model is expected well inside them, to be measured on a GPU). A band is never loosened
after a failure without saying so here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from envex.runtime.engine import EngineConfig, SamplingParams
from envex.verify.common import Timer
from envex.verify.gate_needle import build_prompt, retrieved
from envex.verify.gate_semantic import kl_and_top1
from envex.verify.gate_stopping import check_stopping
from envex.verify.types import GateEngine
from envex.verify.weight_quality import QualityBand as KVBand  # the same band: a mean KLD above, a top-1 below

NAME = "verify.kv_cache_band"
STOPPING_PROMPTS = ("What is the capital of France?", "Write a short poem about the sea.")
NEEDLE_ANSWER_TOKENS = 24
ISOLATED = {"max_num_seqs": 1, "enable_prefix_caching": False}  # each request alone: see the module's docstring


KV_BANDS = {"fp8": KVBand("fp8", 0.01, 0.93), "int4": KVBand("int4", 0.12, 0.80)}


@dataclass(frozen=True)
class KVQuality:
    """What one packed dtype measured against its bf16-KV self."""

    kv_cache_dtype: str
    prompt_tokens: int
    positions: int  # scored positions (the second half of each prompt)
    mean_kld: float
    p99_kld: float
    max_kld: float
    top1: float
    needle_cells: list[dict[str, Any]]
    needle_reference_hits: int
    needle_hits_kept: int  # cells found by both
    stopping: dict[str, Any]  # the stopping gate's verdict and summary on the packed engine

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _prompts(tokenizer: Any, prompt_tokens: int, prompts: int) -> list[list[int]]:
    from envex.verify.weight_quality import text_tokens

    ids = text_tokens(tokenizer, prompt_tokens * prompts)
    return [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(prompts)]


def _needles(engine: GateEngine, depths: Sequence[float]) -> list[tuple[str, list[int]]]:
    from envex.verify.data import needle_data

    data = needle_data()
    length = engine.max_model_len - NEEDLE_ANSWER_TOKENS  # the longest prompt that still answers: the window's end
    return [(data.needles[i % len(data.needles)].answer,
             build_prompt(engine.tokenizer, data, data.needles[i % len(data.needles)], length=length, depth=d))
            for i, d in enumerate(depths)]  # fmt: skip


def _run(engine: Any, prompts: list[list[int]], needles: list[tuple[str, list[int]]]
         ) -> tuple[list[torch.Tensor], list[str]]:  # fmt: skip
    """The scored logits [L - L/2, V] float32 (CPU) of each prompt, and each needle prompt's greedy answer."""
    logits = [engine.full_logits(p)[len(p) // 2:].float().cpu() for p in prompts]
    answers = engine.generate([ids for _, ids in needles], SamplingParams(max_tokens=NEEDLE_ANSWER_TOKENS,
                                                                           temperature=0.0)) if needles else []
    return logits, [a.text for a in answers]


def measure_kv_quality(base: EngineConfig, kv_cache_dtype: str, *, prompt_tokens: int = 4096, prompts: int = 2,
                       needle_depths: Sequence[float] = (0.0, 0.5, 1.0),
                       stopping_prompts: Sequence[str] = STOPPING_PROMPTS,
                       make_engine: Callable[[EngineConfig], Any] | None = None) -> KVQuality:  # fmt: skip
    """`base` (any kv_cache_dtype) run with the unpacked cache, then with `kv_cache_dtype`, one engine at a time
    (`make_engine`: LLMEngine by default). No needle depths or stopping prompts: those parts are skipped."""
    if kv_cache_dtype not in KV_BANDS:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} has no band; use one of {', '.join(KV_BANDS)}")
    if make_engine is None:
        from envex.runtime.engine import LLMEngine

        make_engine = LLMEngine
    engine = make_engine(replace(base, kv_cache_dtype="bf16", **ISOLATED))
    try:
        if prompt_tokens > engine.max_model_len:
            raise ValueError(f"prompt_tokens: {prompt_tokens} is past max_model_len {engine.max_model_len}; give "
                             "at most that")  # fmt: skip
        texts = _prompts(engine.tokenizer, prompt_tokens, prompts)
        needles = _needles(engine, needle_depths)
        ref_logits, ref_answers = _run(engine, texts, needles)
    finally:
        engine.close()
    engine = make_engine(replace(base, kv_cache_dtype=kv_cache_dtype, **ISOLATED))
    try:
        logits, answers = _run(engine, texts, needles)
        stop = check_stopping(engine, prompts=stopping_prompts, max_tokens=16) if stopping_prompts else None
    finally:
        engine.close()
    pairs = [kl_and_top1(r, q) for r, q in zip(ref_logits, logits, strict=True)]
    kl = torch.cat([p[0] for p in pairs])
    top1 = torch.cat([p[1] for p in pairs]).double()
    cells = [{"depth": d, "prompt_tokens": len(ids), "answer": ans, "reference_hit": retrieved(ans, r),
              "packed_hit": retrieved(ans, g), "reference_text": r, "packed_text": g}
             for d, (ans, ids), r, g in zip(needle_depths, needles, ref_answers, answers, strict=True)]  # fmt: skip
    return KVQuality(
        kv_cache_dtype=kv_cache_dtype, prompt_tokens=prompt_tokens, positions=int(kl.numel()),
        mean_kld=float(kl.mean()), p99_kld=float(torch.quantile(kl, 0.99)), max_kld=float(kl.max()),
        top1=float(top1.mean()), needle_cells=cells,
        needle_reference_hits=sum(c["reference_hit"] for c in cells),
        needle_hits_kept=sum(c["reference_hit"] and c["packed_hit"] for c in cells),
        stopping={"verdict": stop.verdict, "summary": stop.summary} if stop is not None else {"verdict": "skip"},
    )  # fmt: skip


def judge(q: KVQuality, band: KVBand | None = None) -> tuple[bool, str]:
    """(passed, one line naming the figures) for `q` against `band` (by default its dtype's, KV_BANDS)."""
    b = band or KV_BANDS[q.kv_cache_dtype]
    kld_ok, top1_ok = q.mean_kld <= b.max_mean_kld, q.top1 >= b.min_top1
    needle_ok = q.needle_hits_kept == q.needle_reference_hits
    stop_ok = q.stopping["verdict"] in ("pass", "skip")
    figures = (f"mean KLD {q.mean_kld:.5f} {'<=' if kld_ok else '>'} {b.max_mean_kld} and top-1 {q.top1:.2%} "
               f"{'>=' if top1_ok else '<'} {b.min_top1:.0%} over {q.positions} positions of {q.prompt_tokens}-token "
               f"prompts; needle at the window's end found in {q.needle_hits_kept} of the "
               f"{q.needle_reference_hits} cells the bf16-KV self finds"
               f"{' (it finds none: no needle evidence)' if not q.needle_reference_hits else ''}; stopping "
               f"{q.stopping['verdict']}")  # fmt: skip
    if kld_ok and top1_ok and needle_ok and stop_ok:
        return True, f"kv_cache_dtype {q.kv_cache_dtype} is inside its band against the bf16-KV model: {figures}"
    return False, (f"kv_cache_dtype {q.kv_cache_dtype} refused: outside its band or a check against the bf16-KV model: "
                   f"{figures}; install with --kv-cache-dtype bf16 (or fp8 where int4 is refused)")


def kv_band_gate(base: EngineConfig, kv_cache_dtype: str, *, band: KVBand | None = None,
                 **measure: Any) -> dict[str, Any]:  # fmt: skip
    """The install's gate for a release whose launch.json engine.kv_cache_dtype packs the cache: measured on the
    release's own engine settings (measure_kv_quality; its keywords pass through) and held to the dtype's band (or
    `band`). A gate's JSON: verdict, the one-line reason naming the figures, the band and the measurement."""
    timer = Timer()
    q = measure_kv_quality(base, kv_cache_dtype, **measure)
    b = band or KV_BANDS[kv_cache_dtype]
    passed, reason = judge(q, b)
    return {"name": NAME, "verdict": "pass" if passed else "fail", "reason": reason, "band": dict(b.__dict__),
            "result": q.to_dict(), "seconds": timer.seconds}
