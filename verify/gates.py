"""The gate runner the installer calls: `run_gates(engine, reference=..., suite="quick"|"full")` -> GateReport.

Suites fix the prompt sets and sizes. "quick" fits a CI run of the installer on a 2-core CPU with the embedded
model (about a minute or two); "full" is the real gate, run before activation on the target hardware.
"""

from __future__ import annotations

import datetime as dt
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias, cast

from envex.verify import data
from envex.verify.common import Timer
from envex.verify.gate_batch_invariance import check_batch_invariance
from envex.verify.gate_coding import check_coding
from envex.verify.gate_needle import check_needle
from envex.verify.gate_reference import check_reference_equality
from envex.verify.gate_semantic import check_semantic
from envex.verify.gate_stopping import check_stopping
from envex.verify.reference import HFReference, Reference
from envex.verify.types import GateEngine, GateReport, GateResult, NumericPolicy, PackedBand

GATE_NAMES = ("reference_equality", "needle_retrieval", "stopping", "coding", "semantic_regression", "batch_invariance")
_NO_REFERENCE = ("stopping", "batch_invariance")  # gates that run on the engine alone
# The checks against HF transformers' tokens and logits that a packed format's own error is not held to: where the
# engine serves one, its band gate's measurement against the model's unpacked self stands in (band_stand_in).
BANDED = ("reference_equality", "semantic_regression")


@dataclass(frozen=True, kw_only=True)
class Suite:
    name: str
    reference_prompts: int
    reference_max_tokens: int
    needle_lengths: tuple[int, ...]
    needle_depths: tuple[float, ...]
    needle_max_tokens: int
    stopping_prompts: int
    stopping_max_tokens: int
    coding_tasks: tuple[str, ...] | None  # task ids; None: all of them
    coding_max_tokens: int
    semantic_texts: int
    semantic_max_len: int
    invariance_prompts: int = 2  # probes, each alone, among `invariance_others` fillers, chunked, cached
    invariance_others: int = 4
    invariance_max_tokens: int = 8
    gates: tuple[str, ...] = field(default=GATE_NAMES)

    def __post_init__(self) -> None:
        unknown = set(self.gates) - set(GATE_NAMES)
        if unknown:
            raise ValueError(f"gates: unknown {sorted(unknown)}; known: {', '.join(GATE_NAMES)}")


SUITES: dict[str, Suite] = {
    "quick": Suite(name="quick", reference_prompts=2, reference_max_tokens=12, needle_lengths=(256, 768),
                   needle_depths=(0.5,), needle_max_tokens=14, stopping_prompts=1, stopping_max_tokens=16,
                   coding_tasks=("add", "is_even", "square"), coding_max_tokens=32, semantic_texts=2,
                   semantic_max_len=96, invariance_prompts=2, invariance_others=4, invariance_max_tokens=8),
    "full": Suite(name="full", reference_prompts=10, reference_max_tokens=128,
                  needle_lengths=(1024, 2048, 4096, 8192), needle_depths=(0.0, 0.25, 0.5, 0.75, 1.0),
                  needle_max_tokens=24, stopping_prompts=3, stopping_max_tokens=48, coding_tasks=None,
                  coding_max_tokens=160, semantic_texts=8, semantic_max_len=512, invariance_prompts=4,
                  invariance_others=32, invariance_max_tokens=256),
}

EngineLike: TypeAlias = GateEngine | Callable[[], Any]


def _run_one(name: str, fn: Callable[[], GateResult]) -> GateResult:
    timer = Timer()
    try:
        return fn()
    except Exception as exc:  # a gate that cannot run has failed; the report says why instead of crashing
        return GateResult(name=name, verdict="fail", thresholds={}, evidence={"error": f"{type(exc).__name__}: {exc}"},
                          seconds=timer.seconds, summary=f"the gate could not run: {type(exc).__name__}: {exc}")


def run_gates(engine: EngineLike, *, reference: Reference | None = None, suite: str | Suite = "quick",
              out_dir: str | Path | None = None, gates: Sequence[str] | None = None,
              progress: Callable[[str], None] | None = None, bands: Sequence[PackedBand] = ()) -> GateReport:
    """Run a suite of gates against `engine` (an LLMEngine, a wrapper with the same methods, or a factory).

    `reference` defaults to HF transformers in float32 on the engine's device type, loaded from the engine's
    own model files; a SignedReference (verify/signed_reference.py) answers from the model bundle's signed file
    instead. The report's reference_policy says which. With `out_dir`, the report is also written to
    out_dir/gates.json.

    Where the engine serves a packed format (NumericPolicy.packed_formats: a low-bit KV cache, low-bit weights),
    the BANDED gates are not run against the reference: each is the verdict of `bands`, the band gates'
    measurements of those formats against the model's unpacked self (band_stand_in); a packed format without one
    fails them. The other gates run as for any engine.
    """
    timer = Timer()
    eng: GateEngine = engine if hasattr(engine, "generate") else engine()  # type: ignore[operator]
    if isinstance(suite, str) and suite not in SUITES:
        raise ValueError(f"suite: {suite!r} is not one of {', '.join(SUITES)}")
    s = SUITES[suite] if isinstance(suite, str) else suite
    policy = NumericPolicy.of(eng)
    selected = tuple(gates) if gates is not None else s.gates
    unknown = set(selected) - set(GATE_NAMES)
    if unknown:
        raise ValueError(f"gates: unknown {sorted(unknown)}; known: {', '.join(GATE_NAMES)}")
    banded = BANDED if policy.packed_formats else ()
    if reference is None and set(selected) - set(_NO_REFERENCE) - set(banded):
        source = getattr(eng, "source", None)
        if source is None:
            raise ValueError("reference: the engine has no `source` to load the reference from; pass reference=")
        reference = HFReference(source, device=policy.device, dtype="float32",
                                eos_token_ids=eng.tokenizer.eos_token_ids)
    ref = cast(Any, reference)  # None only when no selected gate needs it; the semantic gate also takes its logits
    prompts = data.chat_prompts()
    tasks = data.coding_tasks()
    if s.coding_tasks is not None:
        tasks = [t for t in tasks if t.id in s.coding_tasks]
    runners: dict[str, Callable[[], GateResult]] = {
        "reference_equality": lambda: check_reference_equality(
            eng, ref, prompts=prompts[:s.reference_prompts], max_tokens=s.reference_max_tokens),
        "needle_retrieval": lambda: check_needle(
            eng, ref, lengths=s.needle_lengths, depths=s.needle_depths, max_tokens=s.needle_max_tokens),
        "stopping": lambda: check_stopping(eng, prompts=prompts[:s.stopping_prompts],
                                           max_tokens=s.stopping_max_tokens),
        "coding": lambda: check_coding(eng, ref, tasks=tasks, max_tokens=s.coding_max_tokens),
        "semantic_regression": lambda: check_semantic(eng, ref, texts=data.corpus_texts()[:s.semantic_texts],
                                                      max_len=s.semantic_max_len),
        # The last prompts: the ones the other gates least use, so the cold conditions start cold.
        "batch_invariance": lambda: check_batch_invariance(
            eng, prompts=prompts[len(prompts) - s.invariance_prompts:], texts=data.corpus_texts(),
            others=s.invariance_others, max_tokens=s.invariance_max_tokens),
    }
    for name in banded:
        runners[name] = partial(band_stand_in, name, policy, bands)
    results = []
    for name in selected:
        if progress is not None:
            progress(name)
        results.append(_run_one(name, runners[name]))
    source = getattr(eng, "source", None)
    report = GateReport(
        suite=s.name,
        model=getattr(source, "name", "unknown"),
        engine_policy=policy.name,
        reference_policy=ref.policy_name if ref is not None else "none",
        verdict="pass" if results and all(r.passed for r in results) else "fail",
        gates=tuple(results),
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        seconds=timer.seconds,
        environment=_environment(),
    )
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gates.json").write_text(report.to_json(), encoding="utf-8")
    return report


def band_stand_in(name: str, policy: NumericPolicy, bands: Sequence[PackedBand]) -> GateResult:
    """The result of gate `name` for an engine serving packed formats: pass where every format the policy packs has
    a band measurement inside its band, with the figures in the summary ("judged against the fp8 band: KLD x /
    top-1 y"); a format without one fails, naming the band gate that measures it."""
    timer = Timer()
    by_format = {b.format: b for b in bands}
    found = [by_format[f] for f in policy.packed_formats if f in by_format]
    missing = [f for f in policy.packed_formats if f not in by_format]
    lines = [f"{b.format} {b.line} against its unpacked self ({b.gate}{'' if b.passed else ': outside'})"
             for b in found]  # fmt: skip
    lines += [f"{f}: no band measurement given; the install's gate runner measures it (verify.kv_cache_band or "
              "verify.weight_quality_band) and passes it in bands=" for f in missing]  # fmt: skip
    return GateResult(
        name=name, verdict="pass" if found and not missing and all(b.passed for b in found) else "fail",
        thresholds={"rule": "packed formats: each inside its band against the model's unpacked self, in place of "
                            "the checks against HF transformers", "packed_formats": list(policy.packed_formats)},
        evidence={"engine_policy": policy.name, "bands": [asdict(b) for b in found], "missing": missing},
        seconds=timer.seconds, summary="; ".join(lines),
    )  # fmt: skip


def _environment() -> dict[str, Any]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
