"""Test tools for the admin page: a real prefix with two installed releases, built by the installer itself.

Never used by the admin page. The releases hold the installer's fake model bundle (tests/support/installer.py); their
gate reports are injected (the installer's ENVEX_TEST_GATES_REPORT hook) with evidence shaped like the gate
runner's, and each gets a benchmark table and plot written by verify's own report code from fixture figures
(labelled as such: they are not measurements).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console

from envex.bundles import load_private_key, make_demo_trust
from envex.installer.admin.auth import TOKEN_PREFIX, create_admin_token
from envex.installer.admin.views import bench_dir
from envex.installer.media import BUNDLES_DIR
from envex.installer.pipeline import InstallOptions, install
from envex.installer.ui import InstallUI
from envex.tests.support import installer as itest

VERSIONS = ("1.0.0", "1.1.0")


@dataclass(frozen=True)
class AdminFixture:
    prefix: Path
    bundle_dirs: tuple[Path, ...]
    token: str
    releases: tuple[str, ...]  # oldest first; the last is active
    token_from_install: bool  # the token is the one the installer printed at the first install


def gates_report(tok_s: float) -> dict[str, Any]:
    """A gate runner report (installer/gate_runner.py's shape) with per-gate evidence and thresholds."""
    suite_gates = [
        {
            "name": "reference_equality",
            "verdict": "pass",
            "summary": "20/20 prompts: same greedy tokens as HF transformers (float32)",
            "thresholds": {"min_identical_fraction": 1.0},
            "evidence": {"prompts": 20, "identical": 20, "max_new_tokens": 64},
            "seconds": 41.2,
        },
        {
            "name": "stopping",
            "verdict": "pass",
            "summary": "EOS, stop strings across tokens, exact max_tokens, stream == non-stream",
            "thresholds": {},
            "evidence": {"cases": 12, "failures": []},
            "seconds": 3.1,
        },
    ]
    return {
        "verdict": "pass",
        "suite": "quick",
        "gates": {"installer.smoke": "pass", "verify.reference_equality": "pass", "verify.stopping": "pass"},
        "bench": {"smoke_decode_tokens_per_s": tok_s, "load_seconds": 1.5},
        "details": {
            "installer.smoke": {
                "name": "installer.smoke",
                "verdict": "pass",
                "evidence": {"prompt": "What is the capital of France?", "text": "Paris.", "deterministic": True},
            },
            "verify.gates": {"verdict": "pass", "gates": suite_gates},
            "reference": {"origin": "signed", "reference_policy": "cpu-float32-torch",
                          "why": "the local reference does not fit"},
        },
    }


def write_bench(prefix: Path, release_id: str, tok_s: float) -> None:
    """bench.md and bench.png for a release, by verify.bench's own report code, from fixture figures."""
    from envex.verify.bench import BenchReport, EngineRow

    def interval(value: float) -> dict[str, float | int]:
        return {"estimate": value, "low": value * 0.97, "high": value * 1.03}

    rows = tuple(
        EngineRow(
            engine=name,
            included=True,
            excluded_reason=None,
            runs=3,
            intervals={"output_tok_s": interval(rate), "tpot_s": interval(1 / rate), "ttft_s": interval(0.05)},
            percentiles={"itl_s": {"p50": 1 / rate, "p90": 1.1 / rate, "p99": 1.3 / rate}},
            roofline_fraction=None,
        )
        for name, rate in (("envex", tok_s), ("hf-transformers", tok_s / 2))
    )
    report = BenchReport(
        workload={
            "name": "fixture-not-a-measurement",
            "prompt_tokens": 16,
            "output_tokens": 32,
            "num_requests": 4,
            "concurrency": 2,
        },
        repeats=3,
        warmups=1,
        rows=rows,
        anchor={"engine": "envex", "opening": tok_s, "closing": tok_s, "drift": 0.0, "limit": 0.03, "void": False},
        void=False,
        roofline=None,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    out = bench_dir(prefix, release_id)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(report.to_markdown())
    report.plot(out / "bench.png")


def build_admin_fixture(work: Path, *, served_name: str = "fake") -> AdminFixture:
    """Two releases (fake-model 1.0.0 then 1.1.0) installed into `work/prefix` by the installer, plus a token."""
    work.mkdir(parents=True, exist_ok=True)
    trust = make_demo_trust(work / "keys", expires=datetime.now(UTC) + timedelta(days=30))
    key = load_private_key(trust.key_path)
    wheels = itest.build_tiny_wheels(work / "wheels")
    prefix = work / "prefix"
    releases: list[str] = []
    dirs: list[Path] = []
    card = itest.fake_model_card(served_name=served_name)
    console = Console(file=io.StringIO(), record=True, width=400)
    for n, version in enumerate(VERSIONS):
        media = itest.fake_media(
            work / f"media-{version}",
            trust.root_path,
            key,
            work / f"src-{version}",
            wheels=wheels,
            model_version=version,
            card=card,
        )
        dirs.append(media / BUNDLES_DIR)
        report = work / f"gates-{version}.json"
        report.write_text(json.dumps(gates_report(20.0 + 10 * n)))
        options = InstallOptions(
            media=media, prefix=prefix, trust_fingerprint=trust.fingerprint, use_gpu=False, test_gates_report=report
        )
        outcome = install(options, InstallUI(console=console))
        if not outcome.ok or outcome.release is None:
            raise RuntimeError(f"installing the admin fixture failed: {outcome.message}")
        releases.append(outcome.release)
        write_bench(prefix, outcome.release, 20.0 + 10 * n)
    printed = re.findall(rf"{TOKEN_PREFIX}[A-Za-z0-9_-]+", console.export_text())
    token = printed[0] if len(printed) == 1 else create_admin_token(prefix, replace=True)
    return AdminFixture(
        prefix=prefix,
        bundle_dirs=tuple(dirs),
        token=token,
        releases=tuple(releases),
        token_from_install=len(printed) == 1,
    )
