"""The benchmark harness: workloads, roofline, the anchor rule and token-count exclusion on engines with known
timing, and real runs (envex in-process, HF transformers, a real uvicorn envex server on loopback)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from envex.runtime.engine import EngineConfig, LLMEngine
from envex.verify.bench import run_bench
from envex.verify.bench_engines import (
    BenchRequest,
    EnvexInProcess,
    HFTransformers,
    OpenAICompatible,
    RequestTiming,
)
from envex.verify.roofline import decode_bytes, measure_read_bandwidth, roofline
from envex.verify.workloads import Workload, build_requests, exact_prompt, named_workload

TINY = Workload(name="tiny", prompt_tokens=24, output_tokens=4, num_requests=1, concurrency=1)


class PacedEngine:
    """An engine with known timing: token timestamps on a virtual clock, `step_s` apart, so the harness's rules
    (intervals, anchors, exclusion) are tested against exactly known figures, free of this machine's load.

    `slowdown` multiplies its step time by (1 + slowdown) per run, a machine that drifts; `short` serves one token
    fewer than asked, a token-count violation.
    """

    def __init__(self, name: str, step_s: float, *, slowdown: float = 0.0, short: bool = False) -> None:
        self.name = name
        self.step_s = step_s
        self.slowdown = slowdown
        self.short = short

    def run(self, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestTiming]:
        out = []
        clock = time.perf_counter()
        for r in requests:
            t = RequestTiming(submitted=clock, prompt_tokens=len(r.prompt_ids))
            n = r.max_tokens - 1 if self.short else r.max_tokens
            for _ in range(n):
                clock += self.step_s
                t.token_times.append(clock)
            t.output_tokens = n
            out.append(t)
        self.step_s *= 1 + self.slowdown
        return out

    def close(self) -> None:
        pass


def test_exact_prompts_and_distinct_requests(embedded_engine: LLMEngine) -> None:
    tok = embedded_engine.tokenizer
    for n in (8, 100, 1024):
        text, ids = exact_prompt(tok, n, "Request 1-2.")
        assert len(ids) == n and tok.encode(text, add_special_tokens=False) == ids and text.startswith("Request 1-2.")
    w = named_workload("1k-256", concurrency=4, num_requests=4)
    a, b = build_requests(tok, w, repeat=0), build_requests(tok, w, repeat=0)
    assert [r.prompt_text for r in a] == [r.prompt_text for r in b]  # byte-identical across engines
    assert len({r.prompt_text for r in a}) == 4 and all(len(r.prompt_ids) == 1024 for r in a)
    assert build_requests(tok, w, repeat=1)[0].prompt_text != a[0].prompt_text  # each round is fresh
    chat = build_requests(tok, named_workload("chat", num_requests=6), repeat=0)
    assert len({r.max_tokens for r in chat}) > 1
    with pytest.raises(ValueError, match="workload"):
        named_workload("nope")
    with pytest.raises(ValueError, match="concurrency"):
        Workload(name="x", prompt_tokens=8, output_tokens=1, num_requests=1, concurrency=257)


def test_roofline_counts_the_engine_weights(embedded_engine: LLMEngine) -> None:
    cfg = embedded_engine.model_config
    b = decode_bytes(cfg, dtype="float32", context_len=100)
    params = dict(embedded_engine.runner.model.named_parameters())
    layer_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if n != "embed_tokens_weight")
    assert b.layer_weights == layer_bytes  # every layer weight and the final norm, read once per step
    assert b.lm_head == params["embed_tokens_weight"].numel() * 4  # tied: the embedding read as the LM head
    assert b.kv_per_sequence == 2 * cfg.num_hidden_layers * cfg.kv_size * 100 * 4
    assert decode_bytes(cfg, dtype="bfloat16", context_len=100, batch=4).total < b.total * 4
    bw = measure_read_bandwidth("cpu", size_bytes=64 * 2**20, repeats=3)
    assert 1e8 < bw < 1e13
    r = roofline(cfg, device="cpu", dtype="float32", context_len=100, bandwidth=bw)
    assert r.min_step_s == pytest.approx(b.total / bw) and r.fraction(2 * r.min_step_s) == pytest.approx(0.5)


def test_interleaved_window_with_steady_engines_is_valid(embedded_engine: LLMEngine, tmp_path: Path) -> None:
    fast, slow = PacedEngine("fast", 0.004), PacedEngine("slow", 0.008)
    report = run_bench([fast, slow], tokenizer=embedded_engine.tokenizer, workload_name=TINY, repeats=6,
                       out_dir=tmp_path, with_roofline=False)
    assert not report.void and report.anchor["engine"] == "fast"
    f, s = report.row("fast"), report.row("slow")
    assert f.included and s.included and f.runs == s.runs == 6
    assert f.intervals["tpot_s"]["high"] < s.intervals["tpot_s"]["low"]  # 4 ms vs 8 ms: disjoint intervals
    assert f.intervals["tpot_s"]["estimate"] == pytest.approx(0.004)
    assert f.intervals["output_tok_s"]["estimate"] == pytest.approx(250.0)
    labels = [r["label"] for r in report.runs]
    assert labels[:2] == ["warmup-0", "warmup-0"] and labels[2] == "anchor-open" and labels[-1] == "anchor-close"
    rounds = [(r["label"], r["engine"]) for r in report.runs if r["label"].startswith("round-")]
    assert rounds[:4] == [("round-0", "fast"), ("round-0", "slow"), ("round-1", "slow"), ("round-1", "fast")]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["void"] is False and {r["engine"] for r in saved["rows"]} == {"fast", "slow"}
    md = (tmp_path / "bench.md").read_text()
    assert "| fast |" in md and "valid" in md
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_drifting_anchor_voids_the_window(embedded_engine: LLMEngine) -> None:
    drifting = PacedEngine("drifting", 0.004, slowdown=0.02)  # 2% slower per run: far past 3% by the close
    report = run_bench([drifting], tokenizer=embedded_engine.tokenizer, workload_name=TINY, repeats=3,
                       with_roofline=False)
    assert report.void and report.anchor["drift"] > 0.03
    assert "VOID" in report.to_markdown()


def test_a_row_serving_the_wrong_token_count_is_excluded(embedded_engine: LLMEngine) -> None:
    report = run_bench([PacedEngine("good", 0.002), PacedEngine("short", 0.002, short=True)],
                       tokenizer=embedded_engine.tokenizer, workload_name=TINY, repeats=2, with_roofline=False)
    assert report.row("good").included
    bad = report.row("short")
    assert not bad.included and "served 3 tokens, asked 4" in (bad.excluded_reason or "")
    assert "excluded: served token counts differ" in report.to_markdown()


@pytest.mark.slow
def test_envex_and_hf_stock_on_the_embedded_model(embedded_engine: LLMEngine, hf_reference: torch.nn.Module,
                                                  tmp_path: Path) -> None:
    engines = [EnvexInProcess(embedded_engine), HFTransformers(hf_reference, pad_token_id=2),
               HFTransformers(hf_reference, tuned=True, pad_token_id=2)]
    report = run_bench(engines, workload_name=TINY, repeats=2, out_dir=tmp_path)
    with pytest.raises(ValueError, match="do not fit the model's context of 8192"):
        run_bench(engines[:1], workload_name="10k-512", repeats=2)
    with pytest.raises(ValueError, match="compile"):
        HFTransformers(hf_reference, tuned=True, compile=True)  # transformers compiles on CUDA only
    for name in ("envex", "hf-stock", "hf-tuned(static)"):
        row = report.row(name)
        assert row.included, row.excluded_reason
        assert row.intervals["output_tok_s"]["estimate"] > 0 and row.intervals["tpot_s"]["estimate"] > 0
        assert 0 < (row.roofline_fraction or 0) <= 1.0
    assert report.roofline is not None and report.roofline["batch"] == 1
    assert (tmp_path / "bench.png").exists()


@pytest.mark.slow
def test_http_envex_server_agrees_with_in_process(embedded_engine: LLMEngine) -> None:
    from envex.runtime.server.app import build_app
    from envex.runtime.server.async_engine import AsyncEngine
    from envex.tests.support.server import serve_in_thread

    # The server owns its own engine (its thread steps it); the in-process engine is the session's.
    server_engine = LLMEngine(EngineConfig(device="cpu", enable_prefix_caching=False))
    w = Workload(name="agree", prompt_tokens=24, output_tokens=12, num_requests=1, concurrency=1)
    with serve_in_thread(build_app(AsyncEngine(server_engine))) as url:
        http = OpenAICompatible(url, model=embedded_engine.model_name, name="envex-http")
        report = run_bench([EnvexInProcess(embedded_engine), http], workload_name=w, repeats=4, warmups=1,
                           with_roofline=False)
    local, remote = report.row("envex"), report.row("envex-http")
    assert remote.included, remote.excluded_reason  # usage.completion_tokens == max_tokens on every request
    # Decode speed is the engine's, whichever door the tokens leave by: the two TPOTs agree within a factor the
    # HTTP path and a shared 2-core machine cannot explain away (requiring the 95% intervals to overlap failed on
    # a 3% difference while another job ran: two engines, two processes' worth of noise).
    a, b = local.intervals["tpot_s"], remote.intervals["tpot_s"]
    assert 2 / 3 < a["estimate"] / b["estimate"] < 3 / 2, (a, b)


def test_bench_quant_gemm_sweeps_run_end_to_end_with_a_stand_in_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed GEMM's tile sweep and the GEMV's config sweep (verify/lab/kernel_bench/bench_quant_gemm.py) on
    small shapes under the interpreter, with graph_time_ms replaced by a stand-in that calls each config (so a
    device call is not spent on a bench that breaks after minutes): every shape, rows and scheme is reported,
    gemm_config's tiles first, and a config that fails is recorded with its error, not fatal."""
    from envex.verify.lab.kernel_bench import bench_quant_gemm as bench

    seen: list[str] = []

    def stand_in(fn, n_inner: int, replays: int = 7) -> float:
        fn(0)
        fn(1)
        seen.append("call")
        return 0.01

    monkeypatch.setattr(bench, "graph_time_ms", stand_in)
    monkeypatch.setattr(bench, "SHAPES", {"qkv": (48, 256), "gate_up": (64, 256), "down": (32, 512), "o": (32, 64)})
    monkeypatch.setattr(bench, "L2_COPIES_BYTES", 100_000)
    monkeypatch.setattr(bench, "SWEEP", {k: v[:2] + [bench.GemmTiles(0, 64, 24, 4, 1)] for k, v in bench.SWEEP.items()})
    monkeypatch.setattr(bench, "GEMV_CONFIGS", bench.GEMV_CONFIGS[:2])
    monkeypatch.setattr(bench, "PERSISTENT_CONFIGS", [(2, 0, 4, 1)])
    monkeypatch.setattr(bench, "SWEEP_ROWS", (16,))
    report: dict = {"bandwidth": {"read_TBps": 1e-6}}  # 1 MB/s: floors of whole microseconds
    gen = torch.Generator().manual_seed(0)
    bench.sweep(report, torch.device("cpu"), gen)
    bench.gemv_sweep(report, torch.device("cpu"), gen)
    assert set(report["sweep"]) == {"qkv", "gate_up", "down", "o"}
    down = report["sweep"]["down"]["16"]["int4_g128_asym"]
    assert down["default"] == ",".join(map(str, bench.gemm_config(16, 32, 512, "int4_group", 4)))
    assert list(down["all"])[0] == down["default"] and down["default_us"] == 10.0
    assert down["all"]["16,64,24,4,1"].startswith("ValueError: config")  # BLOCK_K 24: refused, recorded
    assert down["floor_us"] == 32 * 512 / 2 + 32 * 4 * 3  # int4 codes, a bf16 scale and uint8 zero a group of 128
    for shape in bench.GEMV_SHAPES:
        entry = report["gemv"][shape]
        assert set(entry) == {"bf16", *bench.SCHEMES}
        assert list(entry["fp8_channel"]["all"]) == ["default", "8,128,4", "8,256,4", "2,0,4,1"]
        assert list(entry["int4_g128_asym"]["all"]) == ["default", "8,128,4", "8,256,4"]  # no persistent INT4
    assert len(seen) == 4 * 2 * 3 + 3 * (1 + 3 * 3 + 2)  # the failing config never reached the timer


def test_bench_quant_gemm_w8a8_runs_end_to_end_with_a_stand_in_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The W8A8 mode of bench_quant_gemm (--w8a8) on small shapes under the interpreter with a stand-in timer: every
    shape, row count and scheme is reported with its times (the W8A16 and W8A8 GEMMs, the weight dequantized alone
    and before cuBLAS), TFLOP/s, tiles and errors; fp8_gemm equals its float64 definition and stays
    near the unquantized product, as the W8A16 GEMM does."""
    from envex.verify.lab.kernel_bench import bench_quant_gemm as bench

    calls: list[int] = []

    def stand_in(fn, n_inner: int, replays: int = 7) -> float:
        fn(0)
        fn(1)
        calls.append(n_inner)
        return 0.01

    monkeypatch.setattr(bench, "graph_time_ms", stand_in)
    monkeypatch.setattr(bench, "SHAPES", {"qkv": (48, 256), "down": (32, 320)})
    monkeypatch.setattr(bench, "W8A8_ROWS", (16, 40))
    monkeypatch.setattr(bench, "L2_COPIES_BYTES", 20_000)
    report: dict = {}
    bench.w8a8(report, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert set(report["w8a8"]) == {"qkv", "down"}
    for shape, (n, k) in bench.SHAPES.items():
        for m in bench.W8A8_ROWS:
            row = report["w8a8"][shape]["rows"][str(m)]
            assert row["bf16_us"] == row["act_quant_us"] == 10.0
            assert row["bf16_tflops"] == round(2 * m * n * k / 1e7, 1)
            for scheme in bench.W8A8_SCHEMES:
                entry = row[scheme]
                assert entry["w8a8_us"] == entry["w8a16_gemm_us"] == 10.0
                assert entry["dequant_us"] == entry["dequant_linear_us"] == 10.0
                assert entry["config"] == list(bench.w8a8_config(m, n, k, 4))
                assert entry["rel_err"] < 2e-2, (shape, m, scheme, entry)
                assert entry["rel_err_unquantized"] < 6e-2 and entry["w8a16_rel_err_unquantized"] < 2e-2
    assert calls.count(4) == 2 * 2 * 2 * 2  # dequantizing, then with cuBLAS: each shape, rows, scheme
    assert len(calls) == 2 * 2 * (2 + 2 * 2) + 2 * 2 * 2 * 2


def test_bench_moe_fp8_runs_every_form_end_to_end_with_a_stand_in_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE experts bench (verify/lab/kernel_bench/bench_moe_fp8.py: FP8, INT4 and bf16 experts by token rows) on
    a small layer under the interpreter, both paths (the decode GEMV, the grouped kernels past GEMV_MAX_ROWS), with
    a stand-in timer: each form's result is checked against its float64 reference and its floor counts its bytes."""
    from envex.kernels.moe_mxfp4 import GEMV_MAX_ROWS
    from envex.verify.lab.kernel_bench import bench_moe_fp8 as bench

    monkeypatch.setattr(bench, "graph_time_ms", lambda fn, n_inner: (fn(0), 0.01)[1])
    small = {"E": 8, "H": 128, "INTER": 128, "TOP_K": 2, "ROTATE": 2, "ROWS": (1, GEMV_MAX_ROWS + 1)}
    for name, value in small.items():
        monkeypatch.setattr(bench, name, value)
    report = bench.bench(torch.device("cpu"), torch.Generator().manual_seed(0), {"read_TBps": 1e-6})
    assert list(report["rows"]) == [1, GEMV_MAX_ROWS + 1]
    for row in report["rows"].values():
        assert set(row) == {"experts_chosen_per_input", "fp8", "int4", "bf16"}
        for form, bytes_per_weight in bench.BYTES_PER_WEIGHT.items():
            assert row[form]["us"] == 10.0 and row[form]["rel_err"] < 2e-2, (form, row[form])
            floor = row["experts_chosen_per_input"] * 3 * 128 * 128 * bytes_per_weight
            assert row[form]["floor_us"] == round(floor, 2)
