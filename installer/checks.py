"""Step 5: the quality gates and the benchmark of the new release, run on this machine by the release itself.

The gate runner (`envex.installer.gate_runner`) runs in the release's venv as a child process; its report lands
in `<prefix>/reports/<release>/gates.json`, outside the release slot, so it survives the removal of a slot that
failed. The installer reads the verdict from that file, never from the child's exit code alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from envex.bundles.files import one_line, read_regular_file
from envex.installer.cards import ModelCard
from envex.installer.children import run_tied
from envex.installer.launch import LAUNCH_FILE, OFFLINE_ENV
from envex.installer.media import InstallError
from envex.installer.release import release_dir, venv_python
from envex.installer.state import CheckSummary, now_ts
from envex.verify.references_file import REFERENCES_FILE

REPORTS_DIR = "reports"
# gates.json holds every gate's evidence (texts, a traceback on failure): megabytes at most.
MAX_REPORT_BYTES = 64 * 1024 * 1024


def report_dir(prefix: Path, release_id: str) -> Path:
    return Path(prefix) / REPORTS_DIR / release_id


def run_checks(
    prefix: Path,
    release_id: str,
    card: ModelCard,
    *,
    suite: str,
    bench: bool,
    reference: str = "auto",
    signed_references: bool = False,
    injected_report: Path | None = None,
) -> tuple[CheckSummary, dict[str, Any]]:
    """Run the gates (and benchmark) of `release_id`; returns the summary for state.json and the full report.

    `reference` (auto | local | signed) picks the gates' reference (envex.verify.signed_reference.choose_reference);
    `signed_references`: the model bundle holds envex-references.json, checked by the plan. `injected_report` is a
    test hook (ENVEX_TEST_GATES_REPORT, read only by the CLI): a prepared gates.json used
    in place of running the gates, so fault-injection tests need not spend a minute per install.
    """
    out = report_dir(prefix, release_id)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    report_file = out / "gates.json"
    if injected_report is not None:
        shutil.copyfile(injected_report, report_file)
    else:
        slot = release_dir(prefix, release_id)
        cmd = [
            str(venv_python(slot / "venv")),
            "-m",
            "envex.installer.gate_runner",
            "--launch",
            str(slot / LAUNCH_FILE),
            "--out",
            str(out),
            "--suite",
            suite,
        ]
        if not bench:
            cmd.append("--no-bench")
        # The float32 reference's weights: what must fit beside the engine for the local reference.
        cmd += ["--reference", reference, "--reference-bytes", str(card.parameters * 4)]
        if signed_references:
            cmd += ["--references", str(slot / "model" / REFERENCES_FILE)]
        if card.smoke is not None:
            cmd += ["--smoke-prompt", card.smoke.prompt, "--smoke-expect", card.smoke.expect]
        env = {**os.environ, **OFFLINE_ENV}
        with open(out / "gate_runner.log", "wb") as log:
            # Tied to the installer: killed with it, and cleared by the next run if it left anything behind.
            code, _, _ = run_tied(cmd, what="gate runner", env=env, prefix=prefix, log=log)
        if not report_file.is_file():
            raise InstallError(
                f"gates: the gate runner exited {code} without a report; see {out / 'gate_runner.log'}"
            )
    try:
        report = json.loads(read_regular_file(report_file, max_bytes=MAX_REPORT_BYTES, what="gate report"))
        gates = {
            str(k): v if v in ("pass", "fail", "skip") else "fail" for k, v in dict(report.get("gates", {})).items()
        }
        # Fail closed: a pass needs the report to say so, at least one gate, and no gate that did not pass or skip.
        passed = report.get("verdict") == "pass" and bool(gates) and all(v != "fail" for v in gates.values())
        summary = CheckSummary(
            verdict="pass" if passed else "fail",
            suite=str(report.get("suite", suite)),
            gates=gates,
            report=str(report_file.relative_to(prefix)),
            bench={str(k): float(v) for k, v in dict(report.get("bench", {})).items()},
            finished_at=now_ts(),
            reference=_reference_origin(report),
        )
    except (ValueError, TypeError, AttributeError, OSError) as exc:
        raise InstallError(f"gates: {report_file} is not a gate report ({one_line(str(exc))})") from None
    return summary, report


def _reference_origin(report: dict[str, Any]) -> str | None:
    """"local" or "signed": what the gate runner judged the release against (its details.reference)."""
    details = report.get("details")
    reference = details.get("reference") if isinstance(details, dict) else None
    origin = reference.get("origin") if isinstance(reference, dict) else None
    return origin if origin in ("local", "signed") else None
