"""Gate: small programming tasks, the generated code run against unit tests in the sandbox (verify/sandbox.py).

A 135M model solves few of them, so there is no absolute bar: the engine's pass rate must sit inside the
reference engine's band, the percentile-bootstrap 95% interval of the reference's pass rate over the tasks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from envex.runtime.engine import SamplingParams
from envex.verify.common import Timer, chat_ids
from envex.verify.data import CodingTask
from envex.verify.reference import Reference
from envex.verify.sandbox import SandboxLimits, run_python
from envex.verify.stats import bootstrap_ci
from envex.verify.types import GateEngine, GateResult

NAME = "coding"
# The closing fence followed by a blank line ends the first code block (the opening fence is "```python\n").
STOP = ("```\n\n",)
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block, or the whole answer when there is no fence."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def check_coding(engine: GateEngine, reference: Reference, *, tasks: Sequence[CodingTask],
                 max_tokens: int = 160, limits: SandboxLimits | None = None,
                 confidence: float = 0.95) -> GateResult:
    timer = Timer()
    if not tasks:
        raise ValueError("tasks: the coding gate needs at least one task")
    tok = engine.tokenizer
    encoded = [chat_ids(tok, t.prompt) for t in tasks]
    ours = engine.generate(encoded, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=STOP))
    rows = []
    isolation = ""
    for task, ids, got in zip(tasks, encoded, ours, strict=True):
        ref = reference.greedy(ids, max_tokens, top_k=0, stop=STOP, decode=tok.decode)
        ref_text = tok.decode(ref.token_ids)
        ref_text = ref_text[:min((ref_text.find(s) for s in STOP if s in ref_text), default=len(ref_text))]
        mine = run_python(extract_code(got.text), task.tests, limits)
        theirs = run_python(extract_code(ref_text), task.tests, limits)
        isolation = mine.network_isolation
        rows.append({"task": task.id, "engine_passed": mine.passed, "reference_passed": theirs.passed,
                     "engine_timed_out": mine.timed_out, "engine_code": extract_code(got.text)[:800],
                     "reference_code": extract_code(ref_text)[:800], "engine_error": mine.stderr_tail[-200:]})
    ours_rate = sum(r["engine_passed"] for r in rows) / len(rows)
    ref_outcomes = [float(r["reference_passed"]) for r in rows]
    band = bootstrap_ci(ref_outcomes, "mean", confidence=confidence)
    ok = band.contains(ours_rate)
    return GateResult(
        name=NAME,
        verdict="pass" if ok else "fail",
        thresholds={"rule": "engine pass rate inside the reference's bootstrap band", "confidence": confidence,
                    "band_low": band.low, "band_high": band.high, "max_tokens": max_tokens},
        evidence={"engine_pass_rate": ours_rate, "reference_pass_rate": band.estimate, "tasks": rows,
                  "network_isolation": isolation, "limits": vars(limits or SandboxLimits())},
        seconds=timer.seconds,
        summary=(f"pass rate {ours_rate:.0%} vs reference {band.estimate:.0%} "
                 f"(band {band.low:.0%}-{band.high:.0%}, {len(rows)} tasks)"),
    )
