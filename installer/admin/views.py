"""Read-only views of the installed state for the admin pages: plain data the templates render, nothing more.

Everything comes from the prefix as the installer left it: state.json, each release's launch.json, and the
reports under `reports/<release>/` (gates.json, bench/bench.md, bench/bench.png).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envex.bundles.files import read_regular_file
from envex.installer.activate import activatable, current_target, rollback_target
from envex.installer.checks import MAX_REPORT_BYTES, report_dir
from envex.installer.launch import LAUNCH_FILE, LaunchError, LaunchManifest, read_launch
from envex.installer.media import InstallError
from envex.installer.release import release_dir
from envex.installer.state import Release, State

MAX_EVIDENCE_CHARS = 20_000
MAX_BENCH_TABLE_BYTES = 4 * 1024 * 1024  # the benchmark's Markdown table: a few KB


def _number(release: Release) -> int:
    head = release.id.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def releases_newest_first(state: State) -> list[Release]:
    return sorted(state.releases, key=_number, reverse=True)


def active_launch(prefix: Path, state: State) -> LaunchManifest | None:
    if state.active is None:
        return None
    try:
        manifest, _ = read_launch(release_dir(prefix, state.active) / LAUNCH_FILE)
    except LaunchError:
        return None
    return manifest


@dataclass(frozen=True)
class ReleaseRow:
    release: Release
    active: bool
    activatable: bool
    rollback_target: bool


def release_rows(prefix: Path, state: State) -> list[ReleaseRow]:
    try:
        target: str | None = rollback_target(prefix, state).id
    except InstallError:
        target = None
    return [
        ReleaseRow(
            release=r, active=r.id == state.active, activatable=activatable(prefix, r), rollback_target=r.id == target
        )
        for r in releases_newest_first(state)
    ]


def current_link(prefix: Path) -> str | None:
    return current_target(prefix)


@dataclass(frozen=True)
class GateView:
    name: str
    verdict: str
    summary: str
    thresholds: str  # JSON text
    evidence: str  # JSON text, cut at MAX_EVIDENCE_CHARS


def _json_text(value: Any) -> str:
    text = json.dumps(value, indent=2, sort_keys=True, default=str)
    return text if len(text) <= MAX_EVIDENCE_CHARS else text[:MAX_EVIDENCE_CHARS] + "\n… (cut; see the report file)"


def load_report(prefix: Path, release: Release) -> dict[str, Any] | None:
    if release.checks is None:
        return None
    path = Path(prefix) / release.checks.report
    try:
        data = json.loads(read_regular_file(path, max_bytes=MAX_REPORT_BYTES, what="gate report"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def gate_views(prefix: Path, release: Release) -> list[GateView]:
    """Each gate of the release's summary with its evidence from the full report, where the report has it."""
    if release.checks is None:
        return []
    report = load_report(prefix, release) or {}
    found_details = report.get("details")
    details: dict[str, Any] = found_details if isinstance(found_details, dict) else {}
    by_name: dict[str, dict[str, Any]] = {k: v for k, v in details.items() if isinstance(v, dict)}
    suite = by_name.get("verify.gates", {})
    for gate in suite.get("gates", []) if isinstance(suite.get("gates"), list) else []:
        if isinstance(gate, dict) and "name" in gate:
            by_name[f"verify.{gate['name']}"] = gate
    views = []
    for name, verdict in release.checks.gates.items():
        found = by_name.get(name, {})
        evidence = found.get("evidence", found if found else {"note": "the report holds no evidence for this gate"})
        views.append(
            GateView(
                name=name,
                verdict=verdict,
                summary=str(found.get("summary", "")),
                thresholds=_json_text(found.get("thresholds", {})),
                evidence=_json_text(evidence),
            )
        )
    return views


def bench_dir(prefix: Path, release_id: str) -> Path:
    return report_dir(prefix, release_id) / "bench"


@dataclass(frozen=True)
class BenchView:
    release: Release
    headline: dict[str, float]
    table_md: str | None
    has_plot: bool


def bench_view(prefix: Path, release: Release) -> BenchView:
    folder = bench_dir(prefix, release.id)
    try:
        data = read_regular_file(folder / "bench.md", max_bytes=MAX_BENCH_TABLE_BYTES, what="bench table")
        table = data.decode(errors="replace")
    except OSError:
        table = None
    headline = dict(release.checks.bench) if release.checks else {}
    return BenchView(release=release, headline=headline, table_md=table, has_plot=(folder / "bench.png").is_file())


@dataclass
class LiveSampler:
    """Tokens per second from successive samples of the engine's generated-token counter (no engine hooks)."""

    window_s: float = 10.0
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))

    def sample(self, generated_total: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.samples.append((now, generated_total))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        first_t, first_n = self.samples[0]
        if now - first_t <= 0:
            return 0.0
        return max(0.0, (generated_total - first_n) / (now - first_t))


def live_stats(async_engine: Any, metrics: Any, sampler: LiveSampler) -> dict[str, Any]:
    """The overview's live figures from a running AsyncEngine and the server's Metrics."""
    stats = async_engine.stats()
    requests = sum(count for (path, _status), count in metrics.requests.items() if path.startswith("/v1"))
    return {
        "engine_running": bool(async_engine.is_running),
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "queue_depth": stats.num_running + stats.num_waiting,
        "generation_tokens_total": stats.generation_tokens_total,
        "prompt_tokens_total": stats.prompt_tokens_total,
        "tokens_per_s": round(sampler.sample(stats.generation_tokens_total), 2),
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        # the pool's tokens in its kv_cache_dtype (packed fp8 / int4 hold more in the same memory)
        "kv_capacity_tokens": stats.kv_blocks_total * async_engine.engine.config.block_size,
        "kv_cache_dtype": async_engine.engine.config.kv_cache_dtype,
        "requests_total": requests,
        "uptime_s": round(time.time() - async_engine.started_at, 1),
    }
