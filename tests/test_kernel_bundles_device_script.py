"""verify/lab/device_install.py before it meets a GPU: its parsers, and a CPU dry run of the steps that need none (the
demo media through `envex demo --media-only`, the random-weight model's signed bundle on its own media, and
`envex-install` with injected gates, every step timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envex.tests.support import installer as itest
from envex.verify.lab.device_install import install_step_times, table

ROOT = Path(__file__).resolve().parents[1]


def test_install_step_times_come_from_the_timestamped_result_lines() -> None:
    output = "\n".join([
        "   0.40  ✓ verify   3 bundles verified",
        "   2.10  ✓ probe    1× NVIDIA H200 (sm_90, 141 GiB, driver 580.159.04, CUDA 13.0, MIG disabled)",
        "   2.20    no kernel bundle ...",
        "   2.30  ✓ plan     cuda: ...",
        "  12.30  ✓ install  release 0001",
        " 130.00  ✗ gates    2 failed",
    ])
    assert install_step_times(output) == {"verify": 0.4, "probe": 1.7, "plan": 0.2, "install": 10.0, "gates": 117.7}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_device_script_dry_run_on_the_cpu(tmp_path: Path) -> None:
    from envex.verify.lab.devcarry import write_tokenizer_dir

    tok = write_tokenizer_dir(tmp_path / "tok")
    report = tmp_path / "pass.json"
    report.write_text(json.dumps(itest.PASS_REPORT))
    env = {**os.environ, "ENVEX_DEVICE_TOK": str(tok), "ENVEX_TEST_GATES_REPORT": str(report),
           "ENVEX_DUMMY_LAYERS": "1", "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "envex.verify.lab.device_install", "dry-run", "--work",
                           str(tmp_path / "work"), "--out", str(out)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=850, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert [s["status"] for s in summary["steps"]] == ["ok"] * 7, table_of(summary)
    assert set(steps["install"]["data"]["step_seconds"]) == {"verify", "probe", "plan", "install", "gates", "activate"}
    assert steps["install"]["data"]["token"] is True
    assert "hardware (recorded by the install" in (out / "status.txt").read_text()
    # The serve step's requests on the CPU release: all answered, the repeat found its prefix in the cache.
    served = steps["serve-workload"]["data"]
    assert len(served["workload"]["concurrent"]) == 18 and served["workload"]["prefix_hit_tokens"] > 0
    assert all(r["chars"] > 0 for r in served["workload"]["concurrent"])
    assert served["admin"]["hardware_recorded"] and served["admin"]["benchmark_figures"]
    assert (out / "admin-hardware.html").is_file() and (out / "admin-benchmarks.html").is_file()
    assert "dummy-llama-8b-shape-1.0.0.envex" in steps["dummy-media"]["detail"]
    assert (out / "install.txt").read_text().count("✓") == 6


def table_of(summary: dict) -> str:
    from envex.verify.lab.device_install import Step

    return table([Step(**s) for s in summary["steps"]])
