"""What ships is what is gated: a release that packs its KV cache or its weights runs its smoke test, quality suite
and benchmark on its own engine settings (installer/gate_runner.py), and the suite's checks against HF tokens and
logits report the packed formats' band measurements in their place (verify/gates.py band_stand_in), named in the
verdict line; a bf16 release's numeric policy and checks are today's.

The engine is a stand-in that records the settings it was built with (the real engine's packed paths and the band
gates' measurements are tested in test_verify_gate_kv_cache.py and test_runtime_packed_weights.py); the suite is
the real run_gates, cut to the banded gates, so no HF reference is loaded.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from envex.runtime.engine import EngineConfig
from envex.verify.gates import BANDED, Suite, band_stand_in, run_gates
from envex.verify.types import NumericPolicy, PackedBand

BASE = EngineConfig(model="smollm2-135m-instruct", device="cpu", dtype="float32", backend="torch",
                    max_model_len=224, kv_cache_memory_gb=0.0625)  # fmt: skip
BANDED_SUITE = Suite(name="quick", reference_prompts=1, reference_max_tokens=4, needle_lengths=(), needle_depths=(),
                     needle_max_tokens=1, stopping_prompts=1, stopping_max_tokens=1, coding_tasks=(),
                     coding_max_tokens=1, semantic_texts=1, semantic_max_len=8, gates=BANDED)  # fmt: skip
KV_INT4 = {"name": "verify.kv_cache_band", "verdict": "pass", "reason": "kv_cache_dtype int4 is inside its band",
           "band": {"name": "int4", "max_mean_kld": 0.12, "min_top1": 0.8},
           "result": {"mean_kld": 0.0382, "top1": 0.896}}  # fmt: skip
WEIGHTS_INT4 = {"verdict": "fail", "band": "int4", "reason": "weights policy int4_g128_sym refused: outside",
                "result": {"mean_kld": 0.031, "top1": 0.91}}  # fmt: skip


class TorchOps:  # NumericPolicy.of reads the backend from the ops' class name
    pass


class FakeEngine:
    """An LLMEngine's face for the gate runner: the config it was built with, a CPU float32 torch runner."""

    built: list[EngineConfig] = []

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = SimpleNamespace(device="cpu", dtype=torch.float32, ops=TorchOps())
        self.max_model_len = config.max_model_len
        FakeEngine.built.append(config)

    def generate(self, prompts: Any, params: Any) -> Any:
        raise AssertionError("a banded gate must not decode against HF")

    def close(self) -> None:
        pass


def _gate_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, release: EngineConfig) -> tuple[dict[str, Any],
                                                                                                  dict[str, Any]]:
    """installer/gate_runner.run on `release` with the engine, the band gates, the smoke test and the benchmark
    stubbed: (its report, what the smoke test and the benchmark saw)."""
    from envex.installer import gate_runner

    seen: dict[str, Any] = {}
    FakeEngine.built = []
    monkeypatch.setattr("envex.installer.launch.load_launch", lambda path, require_gates: release)
    monkeypatch.setattr("envex.runtime.engine.LLMEngine", FakeEngine)
    monkeypatch.setattr(gate_runner, "kv_cache_gate", lambda config: KV_INT4)
    monkeypatch.setattr(gate_runner, "weights_gate", lambda config: WEIGHTS_INT4)
    monkeypatch.setattr("envex.verify.signed_reference.choose_reference", lambda *a: (None, {"reference": "none"}))

    def smoke(engine: FakeEngine, prompt: str, expect: str) -> dict[str, Any]:
        seen["smoke"] = engine.config
        return {"name": "installer.smoke", "verdict": "pass", "bench": {}}

    def bench(engine: FakeEngine, **kw: Any) -> dict[str, Any]:
        seen["bench"] = engine.config
        return {"rows": []}

    monkeypatch.setattr(gate_runner, "smoke_gate", smoke)
    monkeypatch.setattr("envex.verify.bench.run_bench", bench)
    report = gate_runner.run(tmp_path / "launch.json", tmp_path / "out", BANDED_SUITE, True,  # type: ignore[arg-type]
                             ("q", "a"))  # fmt: skip
    return report, seen


def test_a_packed_kv_release_runs_smoke_suite_and_bench_with_its_kv_cache_dtype(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: Path) -> None:
    release = replace(BASE, kv_cache_dtype="int4")
    report, seen = _gate_run(monkeypatch, tmp_path, release)
    assert [c.kv_cache_dtype for c in FakeEngine.built] == ["int4"]  # the one engine: the release's own
    assert seen["smoke"].kv_cache_dtype == seen["bench"].kv_cache_dtype == "int4"
    assert report["details"]["bench"]["settings"]["kv_cache_dtype"] == "int4"
    suite = report["details"]["verify.gates"]
    assert suite["engine_policy"] == "cpu-float32-torch-kv-int4" and suite["verdict"] == "pass"
    for gate in suite["gates"]:
        assert gate["summary"].startswith("kv_cache_dtype int4 judged against the int4 band: KLD 0.03820 / top-1 "
                                          "89.6% against its unpacked self (verify.kv_cache_band)"), gate["summary"]
    assert report["gates"] == {"verify.kv_cache_band": "pass", "installer.smoke": "pass",
                               "verify.reference_equality": "pass", "verify.semantic_regression": "pass"}
    assert report["verdict"] == "pass"


def test_a_weights_policy_outside_its_band_fails_the_banded_checks_by_name(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    release = replace(BASE, weights="int4_g128_sym")
    report, seen = _gate_run(monkeypatch, tmp_path, release)
    assert seen["smoke"].weights == seen["bench"].weights == "int4_g128_sym"
    assert report["details"]["bench"]["settings"]["weights"] == "int4_g128_sym"
    summary = report["details"]["verify.gates"]["gates"][0]["summary"]
    assert summary.startswith("weights int4_g128_sym judged against the int4 band: KLD 0.03100 / top-1 91.0% "
                              "against its unpacked self (verify.weight_quality_band: outside)"), summary
    assert report["gates"]["verify.weight_quality_band"] == report["gates"]["verify.reference_equality"] == "fail"
    assert report["verdict"] == "fail"


def test_a_bf16_release_keeps_the_hf_checks_and_its_policy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    policy = NumericPolicy.of(FakeEngine(replace(BASE, weights="bf16")))
    assert policy == NumericPolicy("cpu", "float32", "torch") and policy.packed_formats == ()
    assert policy.computes_like("cpu-float32-torch")  # token identity with the float32 HF reference, as before
    report, seen = _gate_run(monkeypatch, tmp_path, BASE)
    assert "verify.kv_cache_band" not in report["gates"] and seen["bench"].kv_cache_dtype == "bf16"
    # No band stands in: the suite asks for the HF reference (none is given here, so it cannot run).
    assert report["gates"]["verify.gates"] == "fail"
    assert report["details"]["verify.gates"]["error"].startswith("ValueError: reference: the engine has no `source`")


def test_band_stand_in_passes_only_with_every_format_inside_its_band() -> None:
    policy = NumericPolicy("cuda", "bfloat16", "triton", kv_cache="fp8")
    inside = PackedBand.from_gate("verify.kv_cache_band", "kv_cache_dtype fp8",
                                  {"verdict": "pass", "band": {"name": "fp8"}, "result": {"mean_kld": 0.0037,
                                                                                          "top1": 0.966}})
    assert inside.line == "judged against the fp8 band: KLD 0.00370 / top-1 96.6%"
    assert band_stand_in("semantic_regression", policy, [inside]).verdict == "pass"
    could_not_run = PackedBand.from_gate("verify.kv_cache_band", "kv_cache_dtype fp8",
                                         {"verdict": "fail", "error": "RuntimeError: out of memory"})
    assert not could_not_run.passed and could_not_run.reason == "RuntimeError: out of memory"
    assert band_stand_in("semantic_regression", policy, [could_not_run]).verdict == "fail"
    assert band_stand_in("semantic_regression", policy, []).verdict == "fail"
    # A run_gates caller without bands gets the same refusal, with no HF reference loaded.
    report = run_gates(FakeEngine(replace(BASE, kv_cache_dtype="fp8")), suite=BANDED_SUITE)
    assert report.verdict == "fail" and "no band measurement given" in report.gates[0].summary
