"""The packed KV cache's band gate (verify/gate_kv_cache.py, issue 43) on the embedded model against its own
bf16-KV self (here the unpacked float32 cache: CPU activations), on the CPU at a length the suite affords (the
install runs the issue's 4K-token prompts: installer/gate_runner.py): fp8 passes inside its band; int4's verdict and
figures are the ones measured (verify/lab/journal.md); a band tightened for the test refuses it in one line naming
the figures; the install's gate runner runs the gate when launch.json's kv_cache_dtype packs the cache.

The engines are the real LLMEngine, built once per dtype for the module (the gate closes each engine it is handed:
here a no-op, so the three loads are shared).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from envex.runtime.engine import EngineConfig, LLMEngine
from envex.verify.gate_kv_cache import KV_BANDS, KVBand, judge, kv_band_gate, measure_kv_quality

PROMPT_TOKENS, WINDOW = 192, 224  # the needle prompts fill the window less the answer's 24 tokens: 200 tokens
BASE = EngineConfig(model="smollm2-135m-instruct", device="cpu", dtype="float32", max_model_len=WINDOW,
                    kv_cache_memory_gb=0.0625)  # fmt: skip


class _Kept:
    """An engine the gate may close: it stays open for the next measurement."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, _Kept]]:
    made: dict[str, _Kept] = {}
    yield made
    for kept in made.values():
        kept._engine.close()


def _factory(engines: dict[str, _Kept]) -> Any:
    def make(config: EngineConfig) -> _Kept:
        if config.kv_cache_dtype not in engines:
            engines[config.kv_cache_dtype] = _Kept(LLMEngine(config))
        return engines[config.kv_cache_dtype]

    return make


@pytest.fixture(scope="module")
def fp8(engines: dict[str, _Kept]) -> dict[str, Any]:
    return kv_band_gate(BASE, "fp8", prompt_tokens=PROMPT_TOKENS, prompts=1, needle_depths=(0.5, 1.0),
                        stopping_prompts=("What is the capital of France?",), make_engine=_factory(engines))


def test_fp8_passes_its_band_against_the_bf16_kv_model(fp8: dict[str, Any]) -> None:
    r = fp8["result"]
    assert fp8["verdict"] == "pass", fp8["reason"]
    assert fp8["band"] == {"name": "fp8", "max_mean_kld": 0.01, "min_top1": 0.93}
    assert r["positions"] == PROMPT_TOKENS // 2 and r["prompt_tokens"] == PROMPT_TOKENS
    assert 1e-4 < r["mean_kld"] < 0.01 and r["top1"] >= 0.93
    assert r["needle_hits_kept"] == r["needle_reference_hits"]
    assert all(c["prompt_tokens"] <= WINDOW - 24 for c in r["needle_cells"])
    assert r["stopping"]["verdict"] == "pass"
    assert fp8["reason"].startswith("kv_cache_dtype fp8 is inside its band against the bf16-KV model: mean KLD ")


def test_int4_verdict_and_figures_are_the_measured_ones(engines: dict[str, _Kept]) -> None:
    q = measure_kv_quality(BASE, "int4", prompt_tokens=PROMPT_TOKENS, prompts=1, needle_depths=(1.0,),
                           stopping_prompts=(), make_engine=_factory(engines))  # fmt: skip
    passed, reason = judge(q)
    assert q.stopping == {"verdict": "skip"}
    want_pass, want_kld, want_top1 = MEASURED_INT4
    assert passed == want_pass, reason
    assert abs(q.mean_kld - want_kld) < 0.01 and abs(q.top1 - want_top1) < 0.03, reason
    # A band tightened for this test (not a shipped band) refuses it, in one line naming the figures.
    tight = KVBand("int4", max_mean_kld=q.mean_kld / 2, min_top1=KV_BANDS["int4"].min_top1)
    refused, line = judge(q, tight)
    assert not refused and "\n" not in line
    assert line.startswith(f"kv_cache_dtype int4 refused: outside its band or a check against the bf16-KV model: "
                           f"mean KLD {q.mean_kld:.5f} > {tight.max_mean_kld} and top-1 {q.top1:.2%}")  # fmt: skip
    assert line.endswith("install with --kv-cache-dtype bf16 (or fp8 where int4 is refused)")


def test_a_dtype_without_a_band_or_a_prompt_past_the_window_is_one_line(engines: dict[str, _Kept]) -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: 'bf16' has no band; use one of fp8, int4$"):
        measure_kv_quality(BASE, "bf16", make_engine=_factory(engines))
    with pytest.raises(ValueError, match=r"^prompt_tokens: 4096 is past max_model_len 224; give at most that$"):
        measure_kv_quality(BASE, "fp8", prompt_tokens=4096, make_engine=_factory(engines))


def test_the_gate_runner_runs_the_band_gate_for_a_packed_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """installer/gate_runner.run adds verify.kv_cache_band where launch.json's kv_cache_dtype packs the cache, with
    the issue's 4K-token prompts capped at the window, and its verdict counts."""
    from dataclasses import replace

    from envex.installer import gate_runner

    seen: dict[str, Any] = {}

    def fake_gate(config: EngineConfig, dtype: str, **kw: Any) -> dict[str, Any]:
        seen.update(dtype=dtype, **kw)
        return {"verdict": "fail", "reason": "outside"}

    monkeypatch.setattr("envex.verify.gate_kv_cache.kv_band_gate", fake_gate)
    result = gate_runner.kv_cache_gate(replace(BASE, kv_cache_dtype="int4"))
    assert result["verdict"] == "fail" and seen == {"dtype": "int4", "prompt_tokens": WINDOW, "prompts": 2}
    big = gate_runner.kv_cache_gate(replace(BASE, kv_cache_dtype="fp8", max_model_len=32768))
    assert big["verdict"] == "fail" and seen["prompt_tokens"] == 4096


# int4 on one 192-token prompt (96 positions scored), measured 2026-12-06: mean KLD 0.0382, top-1 89.6%, needle kept.
# Compared within 0.01 KLD and 3 points of top-1 (it was rounded to 0.04 / 90%: a 2-worker suite run on a loaded
# machine measured a KLD that rounds to 0.03, the CPU's matmul threads moving int4's near-ties).
MEASURED_INT4 = (True, 0.0382, 0.896)
