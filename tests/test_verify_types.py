"""Numeric policies decide the equality rule; reports are JSON with every field; suites reject unknown gates."""

from __future__ import annotations

import json

import pytest

from envex.verify.gates import SUITES, Suite
from envex.verify.types import GateReport, GateResult, NumericPolicy


def test_exact_rule_only_for_the_reference_computation_on_a_cpu() -> None:
    assert NumericPolicy("cpu", "float32").computes_like("cpu-float32-torch")
    assert not NumericPolicy("cpu", "bfloat16").computes_like("cpu-float32-torch")
    assert not NumericPolicy("cuda", "float32", "triton").computes_like("cuda-float32-torch")
    assert not NumericPolicy("cuda", "float32").computes_like("cuda-float32-torch")  # cuBLAS shapes differ
    assert NumericPolicy("cuda", "bfloat16", "triton").name == "cuda-bfloat16-triton"
    assert NumericPolicy("cpu", "float32", weights="int4").name == "cpu-float32-torch-int4"
    assert NumericPolicy.of(object()) == NumericPolicy("cpu", "float32")


def test_report_round_trips_through_json() -> None:
    g = GateResult(name="stopping", verdict="pass", thresholds={"rule": "exact"}, evidence={"cases": [1]},
                   seconds=1.5, summary="ok")
    r = GateReport(suite="quick", model="m", engine_policy="cpu-float32-torch",
                   reference_policy="cpu-float32-torch", verdict="pass", gates=(g,), created="now", seconds=2.0)
    d = json.loads(r.to_json())
    assert d["gates"][0]["evidence"] == {"cases": [1]} and d["verdict"] == "pass"
    assert r.gate("stopping").passed and r.passed
    with pytest.raises(KeyError, match="coding"):
        r.gate("coding")


def test_suites() -> None:
    quick, full = SUITES["quick"], SUITES["full"]
    assert max(quick.needle_lengths) <= 1024 and max(full.needle_lengths) == 8192
    assert quick.coding_tasks is not None and full.coding_tasks is None
    with pytest.raises(ValueError, match="gates: unknown"):
        Suite(name="x", reference_prompts=1, reference_max_tokens=1, needle_lengths=(1,), needle_depths=(0.0,),
              needle_max_tokens=1, stopping_prompts=1, stopping_max_tokens=1, coding_tasks=None,
              coding_max_tokens=1, semantic_texts=1, semantic_max_len=1, gates=("vibes",))
