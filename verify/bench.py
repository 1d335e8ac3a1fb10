"""The benchmark harness (`envex bench`): DESIGN.md's method, in one window.

1. Warm-up runs of every engine, discarded.
2. The opening anchor: the first engine runs the workload.
3. `repeats` rounds; each round runs every engine once, the order rotated each round (interleaved A/B), every
   engine on byte-identical prompts (distinct per round, so no engine answers a repeat from a prefix cache).
4. The closing anchor: the first engine again. If its output tok/s moved more than 3% from the opening anchor,
   the machine changed under us and the whole window is void.
Greedy decoding with ignore_eos; every engine must serve exactly the asked prompt and output token counts, and
a row that does not is excluded (with the reason), never footnoted. Medians per run are summarized over the
rounds with bootstrap 95% intervals; p50/p90/p99 pool every request of every round.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from envex.verify.bench_engines import BenchEngine, BenchRequest, EnvexInProcess, RequestTiming
from envex.verify.roofline import Roofline
from envex.verify.roofline import roofline as compute_roofline
from envex.verify.stats import ANCHOR_DRIFT_LIMIT, DEFAULT_SEED, anchor_drift, bootstrap_ci, percentiles
from envex.verify.workloads import WORKLOADS, Workload, build_requests, named_workload

LATENCY_METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
RATE_METRICS = ("output_tok_s", "requests_s")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    workload: Workload
    repeats: int = 12
    warmups: int = 1
    anchor_drift_limit: float = ANCHOR_DRIFT_LIMIT
    confidence: float = 0.95
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.repeats < 2 or self.warmups < 0:
            raise ValueError(f"repeats: need at least 2 rounds for an interval, got {self.repeats}")


@dataclass
class Run:
    engine: str
    label: str  # "warmup-0", "anchor-open", "round-3", "anchor-close"
    wall_s: float
    requests: list[RequestTiming]
    expected: list[BenchRequest]

    def per_request(self, metric: str) -> list[float]:
        ok = [r for r in self.requests if r.token_times]
        if metric == "ttft_s":
            return [r.ttft for r in ok]
        if metric == "e2e_s":
            return [r.e2e for r in ok]
        if metric == "tpot_s":
            return [t for r in ok if (t := r.tpot) is not None]
        if metric == "itl_s":
            return [x for r in ok for x in r.itls]
        raise KeyError(metric)

    @property
    def output_tok_s(self) -> float:
        return sum(r.output_tokens for r in self.requests) / self.wall_s

    @property
    def requests_s(self) -> float:
        return len(self.requests) / self.wall_s

    def count_problems(self) -> list[str]:
        problems = []
        for i, (got, want) in enumerate(zip(self.requests, self.expected, strict=True)):
            if got.error:
                problems.append(f"request {i}: {got.error}")
            elif got.output_tokens != want.max_tokens:
                problems.append(f"request {i}: served {got.output_tokens} tokens, asked {want.max_tokens}")
            elif got.prompt_tokens and got.prompt_tokens != len(want.prompt_ids):
                problems.append(f"request {i}: read {got.prompt_tokens} prompt tokens, sent {len(want.prompt_ids)}")
        return problems


@dataclass(frozen=True)
class EngineRow:
    engine: str
    included: bool
    excluded_reason: str | None
    runs: int
    intervals: dict[str, dict[str, float | int]]  # metric -> bootstrap interval of the per-round median
    percentiles: dict[str, dict[str, float]]  # latency metric -> p50/p90/p99 over all requests
    roofline_fraction: float | None


@dataclass(frozen=True)
class BenchReport:
    workload: dict[str, Any]
    repeats: int
    warmups: int
    rows: tuple[EngineRow, ...]
    anchor: dict[str, Any]
    void: bool
    roofline: dict[str, Any] | None
    created: str
    environment: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)  # raw per-run figures, for re-derivation

    def row(self, engine: str) -> EngineRow:
        for r in self.rows:
            if r.engine == engine:
                return r
        raise KeyError(f"engine {engine!r} is not in this report; it has {', '.join(r.engine for r in self.rows)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def to_markdown(self) -> str:
        from envex.verify.bench_report import markdown

        return markdown(self)

    def plot(self, path: str | Path) -> Path:
        from envex.verify.bench_report import plot

        return plot(self, Path(path))


def _round_order(engines: Sequence[BenchEngine], r: int) -> list[BenchEngine]:
    k = r % len(engines)
    return [*engines[k:], *engines[:k]]


def run_window(engines: Sequence[BenchEngine], tokenizer: Any, config: BenchConfig,
               on_run: Callable[[str, str], None] | None = None) -> list[Run]:
    import time

    w = config.workload
    plan: list[tuple[BenchEngine, str, str]] = []  # engine, label, prompt key
    for k in range(config.warmups):
        plan += [(e, f"warmup-{k}", f"w{k}") for e in engines]
    plan.append((engines[0], "anchor-open", "ao"))
    for r in range(config.repeats):
        plan += [(e, f"round-{r}", f"r{r}") for e in _round_order(engines, r)]
    plan.append((engines[0], "anchor-close", "ac"))
    prompts: dict[str, list[BenchRequest]] = {}
    runs = []
    for engine, label, key in plan:
        if key not in prompts:
            prompts[key] = build_requests(tokenizer, w, repeat=key)
        if on_run is not None:
            on_run(engine.name, label)
        start = time.perf_counter()
        timings = engine.run(prompts[key], w.concurrency)
        wall = time.perf_counter() - start
        # The run's span is first submission to last token (the engines' own timestamps); the wall clock around
        # the call only when no token arrived.
        arrived = [t for t in timings if t.token_times]
        if arrived:
            wall = max(t.token_times[-1] for t in arrived) - min(t.submitted for t in timings)
        runs.append(Run(engine.name, label, wall, timings, prompts[key]))
    return runs


def summarize(runs: list[Run], engines: Sequence[str], config: BenchConfig,
              roof: Roofline | None) -> tuple[list[EngineRow], dict[str, Any]]:
    rows = []
    for name in engines:
        measured = [r for r in runs if r.engine == name and r.label.startswith("round-")]
        problems = [p for r in measured for p in r.count_problems()]
        intervals: dict[str, dict[str, float | int]] = {}
        pcts: dict[str, dict[str, float]] = {}
        for m in LATENCY_METRICS:
            per_round = [statistics.median(v) for r in measured if (v := r.per_request(m))]
            if per_round:
                intervals[m] = bootstrap_ci(per_round, "median", confidence=config.confidence,
                                            seed=config.seed).to_dict()
            pcts[m] = percentiles([x for r in measured for x in r.per_request(m)])
        for m in RATE_METRICS:
            intervals[m] = bootstrap_ci([getattr(r, m) for r in measured], "median", confidence=config.confidence,
                                        seed=config.seed).to_dict()
        tpot = intervals.get("tpot_s", {}).get("estimate")
        fraction = roof.fraction(float(tpot)) if roof is not None and tpot else None
        reason = None
        if problems:
            reason = f"served token counts differ from the workload ({len(problems)} requests; first: {problems[0]})"
        rows.append(EngineRow(name, not problems, reason, len(measured), intervals, pcts, fraction))
    opening = next(r for r in runs if r.label == "anchor-open")
    closing = next(r for r in runs if r.label == "anchor-close")
    drift = anchor_drift(opening.output_tok_s, closing.output_tok_s)
    anchor = {"engine": opening.engine, "metric": "output_tok_s", "opening": opening.output_tok_s,
              "closing": closing.output_tok_s, "drift": drift, "limit": config.anchor_drift_limit,
              "void": drift > config.anchor_drift_limit}
    return rows, anchor


def run_bench(engines: Sequence[BenchEngine] | Any, *, tokenizer: Any = None,
              workload_name: str | Workload = "cpu-small", concurrency: int | None = None, repeats: int = 12,
              warmups: int = 1, out_dir: str | Path | None = None,
              show_progress: bool = False, with_roofline: bool = True) -> BenchReport:
    """Benchmark one or more engines in one interleaved window; pass an LLMEngine for envex alone.

    The roofline is computed for the first envex engine's model, dtype and device, at the workload's batch and
    mean context length. With `out_dir`, bench.json, bench.md and bench.png are written there.
    """
    if not isinstance(engines, Sequence):
        engines = [EnvexInProcess(engines)]
    if not engines:
        raise ValueError("engines: give at least one engine to benchmark")
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"engines: names must be distinct, got {names}")
    envex = next((e for e in engines if isinstance(e, EnvexInProcess)), None)
    if tokenizer is None:
        if envex is None:
            raise ValueError("tokenizer: needed to build prompts when no in-process envex engine is given")
        tokenizer = envex.engine.tokenizer
    w = (workload_name if isinstance(workload_name, Workload)
         else named_workload(workload_name, concurrency=concurrency))
    config = BenchConfig(workload=w, repeats=repeats, warmups=warmups)
    if envex is not None and w.prompt_tokens + w.output_tokens > envex.engine.max_model_len:
        raise ValueError(f"workload {w.name!r}: {w.prompt_tokens} prompt + {w.output_tokens} output tokens do not "
                         f"fit the model's context of {envex.engine.max_model_len}; choose a smaller workload")
    roof = None
    if with_roofline and envex is not None:
        eng = envex.engine
        context = (w.prompt_tokens or 48) + w.output_tokens // 2
        roof = compute_roofline(eng.model_config, device=eng.device.type, dtype=str(eng.runner.dtype)[6:],
                                context_len=context, batch=w.concurrency)
    runs = _with_progress(engines, tokenizer, config, show_progress)
    rows, anchor = summarize(runs, names, config, roof)
    report = BenchReport(
        workload=asdict(w), repeats=repeats, warmups=warmups, rows=tuple(rows), anchor=anchor, void=anchor["void"],
        roofline=roof.to_dict() if roof is not None else None,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), environment=_environment(),
        runs=[{"engine": r.engine, "label": r.label, "wall_s": r.wall_s, "output_tok_s": r.output_tok_s,
               "requests": len(r.requests)} for r in runs],
    )
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(report.to_json(), encoding="utf-8")
        (out / "bench.md").write_text(report.to_markdown(), encoding="utf-8")
        report.plot(out / "bench.png")
    return report


def _with_progress(engines: Sequence[BenchEngine], tokenizer: Any, config: BenchConfig, show: bool) -> list[Run]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = config.warmups * len(engines) + 2 + config.repeats * len(engines)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show, transient=False) as progress:
        task = progress.add_task("benchmark", total=total)
        state = {"first": True}

        def on_run(engine: str, label: str) -> None:
            if not state["first"]:
                progress.advance(task)
            state["first"] = False
            progress.update(task, description=f"{config.workload.name}: {engine} {label}")

        runs = run_window(engines, tokenizer, config, on_run)
        progress.update(task, completed=total)
    return runs


def _environment() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
            "workloads_known": sorted(WORKLOADS)}
