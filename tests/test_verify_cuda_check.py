"""The GPU gate run's pieces, on the CPU: the split/join that carries the GGUF across two device calls, and
verify/lab/cuda_check.py itself on the embedded GGUF (float32 torch backend, a one-prompt subset of the quick suite)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from envex.runtime.loader import embedded_model_path
from envex.verify.lab import cuda_check, devcarry

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(3_500_001))  # odd size: the last part is shorter
    return path


def test_split_join_round_trip(blob: Path, tmp_path: Path) -> None:
    manifest = devcarry.split(blob, tmp_path / "parts", max_part_bytes=1_000_000)
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert [p.name for p in parts] == ["part-aa", "part-ab", "part-ac", "part-ad"]
    assert all(p.stat().st_size <= 1_000_000 for p in parts)
    assert json.loads(manifest.read_text())["size"] == blob.stat().st_size
    # parts from two folders, given in any order (the device's stash and the carried folder)
    moved = tmp_path / "stash" / "part-aa"
    moved.parent.mkdir()
    parts[0].rename(moved)
    out = devcarry.join(manifest, [parts[3], parts[1], moved, parts[2]], tmp_path / "joined" / "model.gguf")
    assert out.read_bytes() == blob.read_bytes()


def test_join_refuses_a_bad_sha_with_one_line(blob: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = devcarry.split(blob, tmp_path / "parts", max_part_bytes=2_000_000)
    part = tmp_path / "parts" / "part-ab"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF  # same size, one byte flipped
    part.write_bytes(bytes(data))
    out = tmp_path / "joined.gguf"
    with pytest.raises(devcarry.CarryError, match="part-ab.*sha256"):
        devcarry.join(manifest, [tmp_path / "parts" / "part-aa", part], out)
    assert not out.exists() and not out.with_name("joined.gguf.partial").exists()
    rc = devcarry.main(["join", "--manifest", str(manifest), "--out", str(out), str(tmp_path / "parts" / "part-aa"),
                        str(part)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("devcarry: ") and err.count("\n") == 1, err


def test_join_names_a_missing_part(blob: Path, tmp_path: Path) -> None:
    manifest = devcarry.split(blob, tmp_path / "parts", max_part_bytes=2_000_000)
    with pytest.raises(devcarry.CarryError, match="part-aa: missing.*run both again"):
        devcarry.join(manifest, [tmp_path / "parts" / "part-ab"], tmp_path / "joined.gguf")


def test_split_refuses_too_many_parts(blob: Path, tmp_path: Path) -> None:
    with pytest.raises(devcarry.CarryError, match="at most 4"):
        devcarry.split(blob, tmp_path / "parts", max_part_bytes=100_000)


def test_sized_suite_caps_every_prompt_set() -> None:
    s = cuda_check.sized_suite("full", 2, ("stopping", "coding"))
    assert (s.reference_prompts, s.stopping_prompts, s.semantic_texts) == (2, 2, 2)
    assert len(s.coding_tasks or ()) == 2 and s.needle_lengths == (1024, 2048)
    assert s.gates == ("stopping", "coding") and s.name == "full-2"
    assert cuda_check.sized_suite("quick", None, ("stopping",)).reference_prompts == 2


def test_device_scripts_parse() -> None:
    scripts = sorted((REPO / "verify" / "lab").glob("device_*.sh"))
    assert {p.name for p in scripts} >= {"device_setup.sh", "device_gates_stage.sh", "device_gates_run.sh",
                                         "device_install.sh", "device_wave2.sh"}
    for script in scripts:
        shell = "bash" if script.read_text().startswith("#!/usr/bin/env bash") else "sh"
        subprocess.run([shell, "-n", str(script)], check=True)


def test_device_scripts_change_to_the_repo_root() -> None:
    """Each script that cds relative to itself lands at the repo root, where its paths (.devcarry/, .whl/, verify/lab/)
    are: after the move into verify/lab/ the stage script went to verify/ and reported part-aa missing (H100,
    2026-12-06)."""
    import re

    for script in sorted((REPO / "verify" / "lab").glob("device_*.sh")):
        for target in re.findall(r'^cd "\$\(dirname "\$0"\)/([./]+)"$', script.read_text(), re.M):
            assert (script.parent / target).resolve() == REPO.resolve(), (script.name, target)


def test_device_setup_refuses_to_be_sourced_outside_the_repo_root(tmp_path: Path) -> None:
    """It links the top-level folders of the working directory into /tmp/ns/envex: only the repo root will do."""
    script = REPO / "verify" / "lab" / "device_setup.sh"
    proc = subprocess.run(["sh", "-c", f'. "{script}"; echo "rc=$?"'], cwd=tmp_path, capture_output=True, text=True)
    assert proc.stdout.strip() == "rc=3", proc.stdout + proc.stderr
    assert "source it from the repo root" in proc.stderr


@pytest.mark.slow
def test_cuda_check_on_cpu_gives_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cuda_check.main(["--model", str(embedded_model_path()), "--device", "cpu", "--prompts", "1",
                          "--gates", "reference_equality,semantic_regression", "--max-tokens", "8",
                          "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "done", summary.get("traceback")
    assert rc == 0 and summary["verdict"] == "pass"
    assert set(summary["gates"]) == {"reference_equality", "semantic_regression"}
    assert summary["gates"]["reference_equality"]["thresholds"]["mode"] == "exact"  # float32 CPU vs float32 CPU
    assert summary["engine"]["policy"] == summary["reference"]["policy"] == "cpu-float32-torch"
    assert summary["policy_checks"] == {"engine cpu-float32-torch": True}
    assert len(summary["model_sha256"]) == 64
    france = summary["france"]
    assert france["identical"] and "Paris" in france["engine_text"], france
    report = json.loads((tmp_path / "gates.json").read_text())
    assert [g["name"] for g in report["gates"]] == ["reference_equality", "semantic_regression"]
    last = capsys.readouterr().out.strip().splitlines()
    table = last[-6:]  # the compact table comes last: two gates, overall, one check, two France lines
    assert table[0].startswith("reference_equality") and table[2].startswith("overall: PASS"), table
    assert table[-2].startswith("France engine:") and "Paris" in table[-1], table
