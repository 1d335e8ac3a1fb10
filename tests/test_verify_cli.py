"""`gates run` and `bench` through typer's CliRunner on verify/cli.py's own app objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from envex.verify.cli import bench, gates_app

runner = CliRunner()
bench_app = typer.Typer()
bench_app.command("bench")(bench)
bench_app.command("noop", hidden=True)(lambda: None)  # two commands: typer keeps "bench" as a subcommand


def test_gates_list() -> None:
    r = runner.invoke(gates_app, ["list"])
    assert r.exit_code == 0 and "reference_equality" in r.output and "suite quick" in r.output


def test_help_lists_the_options() -> None:
    r = runner.invoke(gates_app, ["run", "--help"])
    assert r.exit_code == 0
    for opt in ("--model", "--device", "--suite", "--out", "--gate"):
        assert opt in r.output
    r = runner.invoke(bench_app, ["bench", "--help"])
    assert r.exit_code == 0
    for opt in ("--engines", "--workload", "--concurrency", "--repeats", "--url", "--out"):
        assert opt in r.output


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--suite", "huge"], "--suite: 'huge' is not one of quick, full"),
    (["run", "--gate", "vibes"], "--gate: 'vibes' is not one of"),
    (["run", "--model", "/nonexistent/model"], "model '/nonexistent/model': not found"),
])
def test_gates_run_rejects_bad_input_with_one_line(args: list[str], message: str) -> None:
    r = runner.invoke(gates_app, args)
    assert r.exit_code == 2
    assert message in r.output and r.output.count("error:") == 1


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "--engines", "vllm"], "--engines: vllm not known"),
    (["bench", "--engines", ""], "nothing to benchmark"),
    (["bench", "--workload", "huge"], "--workload: 'huge' is not one of"),
    (["bench", "--concurrency", "300"], "--concurrency: must be in 1..256"),
    (["bench", "--repeats", "1"], "--repeats: need at least 2"),
])
def test_bench_rejects_bad_input_with_one_line(args: list[str], message: str) -> None:
    r = runner.invoke(bench_app, args)
    assert r.exit_code == 2 and message in r.output


@pytest.mark.slow
def test_gates_run_stopping_gate_on_the_embedded_model(tmp_path: Path) -> None:
    r = runner.invoke(gates_app, ["run", "--device", "cpu", "--gate", "stopping", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "PASS  stopping" in r.output and "overall: PASS" in r.output
    report = json.loads((tmp_path / "gates.json").read_text())
    assert report["verdict"] == "pass" and [g["name"] for g in report["gates"]] == ["stopping"]


@pytest.mark.slow
def test_bench_envex_on_the_embedded_model(tmp_path: Path) -> None:
    r = runner.invoke(bench_app, ["bench", "--device", "cpu", "--workload", "cpu-small", "--repeats", "2",
                                  "--warmups", "0", "--out", str(tmp_path), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "| envex |" in r.output and "Roofline:" in r.output
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["rows"][0]["included"] and saved["workload"]["name"] == "cpu-small"
    assert (tmp_path / "bench.png").exists() and (tmp_path / "bench.md").exists()
