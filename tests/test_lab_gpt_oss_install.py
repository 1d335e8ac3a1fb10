"""The device script's gpt-oss install (issue 40: every model that serves installs) run on the CPU at a tiny width:
a reduced gpt-oss in the published MXFP4 layout, its references computed by `envex media references`, its own
card, media of signed bundles, `envex-install --reference signed` with the real gates, then served and asked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpt_oss_install_dry_run_gates_against_the_signed_answers(tmp_path: Path) -> None:
    from envex.verify.lab.devcarry import write_tokenizer_dir

    tok = write_tokenizer_dir(tmp_path / "tok")
    env = {**os.environ, "ENVEX_DEVICE_TOK": str(tok), "PYTHONUNBUFFERED": "1"}
    env.pop("ENVEX_TEST_GATES_REPORT", None)  # the real gates
    out = tmp_path / "out"
    # Not from the checkout's root: its top-level kernels/ would shadow transformers' `kernels` package.
    proc = subprocess.run([sys.executable, "-m", "envex.verify.lab.device_install", "gpt-oss-dry-run", "--work",
                           str(tmp_path / "work"), "--out", str(out)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=850, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert [s["status"] for s in steps.values()] == ["ok"] * 7, proc.stdout[-3000:]

    card = steps["gpt-oss-card"]["data"]["card"]
    assert card["architecture"] == "GptOssForCausalLM" and card["quantization"] == "mxfp4"
    assert card["packed_parameters"] > 0 and card["num_layers"] == 2
    assert card["smoke"]["expect"] and card["smoke"]["prompt"] != "What is the capital of France?"

    installed = steps["gpt-oss-install"]["data"]
    assert installed["reference_policy"] == "signed-cpu-float32-torch"
    assert installed["reference"]["origin"] == "signed" and installed["reference"]["suites"] == ["quick"]
    assert set(installed["gates"].values()) == {"pass"} and len(installed["gates"]) == 7
    assert "(quick suite, signed reference)" in (out / "gpt-oss-install.txt").read_text()
    # Served from the release and asked the card's smoke prompt: the reference's own first words.
    assert card["smoke"]["expect"].lower() in steps["gpt-oss-serve"]["data"]["answer"].lower()
