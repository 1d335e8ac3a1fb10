"""The performance page generator (verify/lab/perf_table.py) on a fixture GPU matrix: its rows and figures, which
file it picks per device, `--check`, and the page it writes when no run has been recorded."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from envex.verify.lab import perf_table

FIXTURE = Path(__file__).parent / "support" / "h200-2026-12-06-abc1234-matrix.json"
SOURCE = "2026-12-06 04:10 UTC, `abc1234`, `h200-2026-12-06-abc1234-matrix.json`"


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    shutil.copy(FIXTURE, folder / FIXTURE.name)
    return folder


def _page(folder: Path) -> str:
    return perf_table.render(perf_table.latest_runs(folder))


def _row(page: str, *starts: str, section: str = "Throughput") -> str:
    """The one table row of a section that begins with these cells."""
    text = page.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    prefix = "| " + " | ".join(starts) + " |"
    rows = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(rows) == 1, (prefix, rows)
    return rows[0]


def test_throughput_rows_carry_the_run_figures_and_their_source(results: Path) -> None:
    page = _page(results)
    default = _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`default`")
    assert default == ("| Llama-3.1-8B (dummy bf16) | NVIDIA H200 | `default` | det off | 245.3 (244.9–245.6) | "
                       f"82.8% | 231.0 (230.4–231.3) | 4,418 (4,390–4,440) | — | 34.2 | 41.2 | {SOURCE} |")
    # a case the cell did not record is a dash, never a number
    draft = _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`draft`")
    assert "| 301.2 (299.8–303.0) [1 excluded] | — | — | — | — | 37.9 | 63.0 |" in draft
    assert "| 400.5 (399.1–401.2) | 83.4% | 372.0 (371.2–373.5) | — | — | 52.7 |" in _row(
        page, "gpt-oss-120b (dummy MXFP4)", "NVIDIA H200", "`default`")
    # every row of every table names the run's date, commit and raw file
    table_rows = [line for line in page.splitlines() if line.startswith("| ") and "`" in line
                  and not line.startswith("| NVIDIA H200 | `h200`")]
    assert table_rows and all(line.endswith(f"{SOURCE} |") for line in table_rows)


def test_refused_and_failed_cells_show_their_line_not_numbers(results: Path) -> None:
    page = _page(results)
    tp2 = _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`tp2`")
    assert tp2 == ("| Llama-3.1-8B (dummy bf16) | NVIDIA H200 | `tp2` | **refused**: tp2: --tensor-parallel 2 needs "
                   f"2 GPUs; this host has 1 |  |  |  |  |  |  |  | {SOURCE} |")
    assert ("- gpt-oss-120b (dummy MXFP4) on NVIDIA H200, `spec4`: **failed**: spec4: the server exited with code 1 "
            f"before it was ready (server-gpt-oss-120b-spec4.log) ({SOURCE})") in page.splitlines()
    assert sum(line.startswith("- ") for line in page.splitlines()) == 3  # tp2, gpt-oss det, gpt-oss spec4


def test_deterministic_cost_against_the_bar(results: Path) -> None:
    run = perf_table.latest_runs(results)[0]
    det, base, _ = perf_table._det_pair(run, "llama8b")
    assert det is not None and base is not None
    costs = perf_table.deterministic_costs(det, base)
    assert costs == pytest.approx({"b1_1k": (245.4 - 233.7) / 245.4, "b1_10k": (231.2 - 221.0) / 231.2,
                                   "c64_1k": (4431 - 4202) / 4431, "ttft": (40.1 - 34.0) / 34.0})
    page = perf_table.render([run])
    row = _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`det` vs `no-det`", section="Deterministic")
    assert row == ("| Llama-3.1-8B (dummy bf16) | NVIDIA H200 | `det` vs `no-det` | 4.8% (233.7 vs 245.4) | "
                   "4.4% (221.0 vs 231.2) | 5.2% (4,202 vs 4,431) | 17.9% (40.1 vs 34.0) | no: over at TTFT at 1K | "
                   f"off | {SOURCE} |")
    assert "batch 1, 1K ≤ 5%, batch 1, 10K ≤ 5%, 64 concurrent ≤ 10%, TTFT at 1K ≤ 15%" in page
    # the model whose deterministic cell was refused: no figures, its line, not measured
    oss = _row(page, "gpt-oss-120b (dummy MXFP4)", "NVIDIA H200", "`det` vs `default (det off)`", section="Determ")
    assert "`det` **refused**: deterministic: GptOssForCausalLM has no batch-invariant kernels yet" in oss
    assert "| not measured | off |" in oss


def test_the_baseline_is_the_det_off_cell_timed_in_more_cases(results: Path) -> None:
    """A matrix may time `no-det` at batch 1 only beside a fully timed default that resolved to the same kernels:
    the default is then the baseline, so the 10K and 64-concurrent costs are not left out."""
    data = json.loads(FIXTURE.read_text())
    nodet = next(c for c in data["cells"] if c["model"] == "llama8b" and c["mode"] == "no-det")
    nodet["cases"] = {"b1_1k": nodet["cases"]["b1_1k"]}
    (results / FIXTURE.name).write_text(json.dumps(data))
    run = perf_table.latest_runs(results)[0]
    det, base, compared = perf_table._det_pair(run, "llama8b")
    assert compared == "`det` vs `default (det off)`" and base is not None and base["mode"] == "default"
    assert set(perf_table.deterministic_costs(det, base)) == {"b1_1k", "b1_10k", "c64_1k", "ttft"}


def test_a_default_that_is_on_without_clearing_the_bar_is_flagged(results: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    for cell in data["cells"]:
        if cell["model"] == "llama8b" and cell["mode"] == "default":
            cell["resolved"]["deterministic"] = True
    (results / FIXTURE.name).write_text(json.dumps(data))
    row = _row(_page(results), "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`det` vs `no-det`", section="Determ")
    assert "| no: over at TTFT at 1K | **on without clearing the bar** |" in row


def test_speculation_against_the_default_and_api_checks(results: Path) -> None:
    page = _page(results)
    spec = _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`spec4`", "det off, 4 drafts, n-gram",
                "268.5 (1.09× of 245.3)", section="Speculative")
    assert "| 240.2 (1.04× of 231.0) | 3,950 (0.89× of 4,418) |" in spec
    assert "| 301.2 (1.23× of 245.3) | — | — |" in _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`draft`",
                                                       "det off, 4 drafts, draft model", "301.2 (1.23× of 245.3)",
                                                       section="Speculative")
    api = _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`draft`", "pass", section="API")
    assert "| pass | pass | **FAIL** | pass | pass | — |" in api
    assert "| identical (0 of 2,048 tokens differ) |" in _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200",
                                                              "`det`", "pass", section="API")
    install = _row(page, "NVIDIA H200", "install", section="Install")
    assert ("| ok | 312.0 | reference pass, semantic pass, stopping pass, needle pass, coding pass | held | pass | "
            "“The capital of France is Paris.” |") in install
    demo = _row(page, "NVIDIA H200", "demo", section="Install")
    assert "| **failed**: demo: port 8000 is in use; stop what serves there or pass --port | 12.5 | — | held |" in demo


def test_low_bit_weights_packed_kv_and_recurrent_state(results: Path) -> None:
    """A weights cell is set beside the same run's bf16 default, at batch 1 and 64 concurrent, with its share of
    the roofline of its packed bytes and its resolved policy; a packed-KV cell beside its model's bf16-KV default,
    with the pool's tokens and the long-context cases; a hybrid model's state and sessions at its window; MTP
    drafting is named as such."""
    data = json.loads(FIXTURE.read_text())
    draft = next(c for c in data["cells"] if c["mode"] == "draft")
    int4 = json.loads(json.dumps(draft))
    int4.update(mode="int4", resolved={"deterministic": False, "weights": "int4_g128_asym"})
    int4["cases"] = {"b1_1k": {**draft["cases"]["b1_1k"], "median": 490.6, "share_of_roofline": 0.512},
                     "c64_1k": {**draft["cases"]["b1_1k"], "metric": "output_tok_s", "median": 4418.0}}  # fmt: skip
    mtp = json.loads(json.dumps(draft))
    mtp.update(mode="mtp", resolved={"deterministic": False, "drafter": "mtp", "num_speculative_tokens": 1})
    base = json.loads(json.dumps(draft))  # a 128K-window model: its bf16-KV default and its int4-KV cell
    base.update(model="llama8b-128k", model_label="Llama-3.1-8B, 128K", mode="default",
                resolved={"deterministic": False, "kv_cache_dtype": "bf16", "kv_capacity_tokens": 400000})
    base["cases"] = {"b1_128k": {**draft["cases"]["b1_1k"], "median": 120.0}}
    kv = json.loads(json.dumps(base))
    kv.update(mode="kv-int4", resolved={"deterministic": False, "kv_cache_dtype": "int4",
                                        "kv_capacity_tokens": 1420000})  # fmt: skip
    kv["cases"] = {"b1_128k": {**draft["cases"]["b1_1k"], "median": 204.0}}
    hybrid = json.loads(json.dumps(draft))  # a hybrid model: its recurrent state and the sessions at its window
    hybrid.update(model="qwen3-next", model_label="Qwen3-Next", mode="default",
                  resolved={"deterministic": False, "max_model_len": "131072", "max_num_seqs": "256",
                            "kv_capacity_tokens": 3_000_000, "state_bytes_per_sequence": 77 * 2**20,
                            "state_slots_total": 513})  # fmt: skip
    data["cells"] += [int4, mtp, base, kv, hybrid]
    (results / FIXTURE.name).write_text(json.dumps(data))
    page = _page(results)
    row = _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`int4`", "det off, weights int4_g128_asym",
               section="Low-bit")  # fmt: skip
    assert "| 490.6 (2.00× of 245.3) | — | 4,418 (1.00× of 4,418) | 51.2% |" in row
    assert "No run has recorded a low-bit weights cell yet." not in page
    state = _row(page, "Qwen3-Next", "NVIDIA H200", "`default`", section="Recurrent state")
    assert "| 77.0 | 513 | 38.58 | 3,000,000 | 131,072 | 22 |" in state  # 3M // 131,072 = 22 windows < 256 slots
    assert "No run has recorded a hybrid model yet." not in page
    # a case beyond the three columns is in "other cases", with its roofline share where the cell has one
    assert "| — | — | — | b1_128k: 120.0 |" in _row(page, "Llama-3.1-8B, 128K", "NVIDIA H200", "`default`")
    kv_row = _row(page, "Llama-3.1-8B, 128K", "NVIDIA H200", "`kv-int4`", "det off", section="Packed KV")
    assert "| 1,420,000 (3.55× of 400,000) | — | — | 204.0 (1.70× of 120.0) | — |" in kv_row
    assert "| det off, 1 drafts, MTP |" in _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`mtp`",
                                                 section="Speculative")  # fmt: skip


def test_the_newest_file_of_each_device_is_read(results: Path) -> None:
    data = json.loads(FIXTURE.read_text())

    def write(name: str, commit: str, date: str, device: str = "NVIDIA H200") -> None:
        data["env"].update(commit=commit, date=date, device=device)
        (results / name).write_text(json.dumps(data))

    write("h200-2026-12-05-1111111-matrix.json", "1111111", "2026-12-05 23:59 UTC")  # an older day
    write("h200-2026-12-06-2222222-matrix.json", "2222222", "2026-12-06 09:30 UTC")  # same day, later in it
    write("h100-x2-2026-12-01-3333333-matrix.json", "3333333", "2026-12-01 10:00 UTC", "NVIDIA H100 80GB HBM3")
    (results / "h200-2026-12-07-4444444-bench.json").write_text("{}")  # not a matrix: ignored
    runs = perf_table.latest_runs(results)
    assert [(r.device, r.path.name) for r in runs] == [("h100-x2", "h100-x2-2026-12-01-3333333-matrix.json"),
                                                      ("h200", "h200-2026-12-06-2222222-matrix.json")]
    page = perf_table.render(runs)
    assert "`h200-2026-12-06-abc1234-matrix.json`" not in page and "`2222222`" in page
    assert "| NVIDIA H100 80GB HBM3 | `h100-x2` |" in page


def test_a_model_the_newest_run_left_out_keeps_its_rows_from_the_run_that_measured_it(results: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    llama = [c for c in data["cells"] if c["model"] == "llama8b"]
    for cell in llama:
        for case in (cell.get("cases") or {}).values():
            case["median"] = 111.1
    data["cells"] = llama  # the newer run measured llama8b alone, and neither the install nor the demo
    data["env"].update(commit="7777777", date="2026-12-07 05:00 UTC")
    data.pop("install"), data.pop("demo")
    (results / "h200-2026-12-07-7777777-matrix.json").write_text(json.dumps(data))
    (results / "h200-2026-12-01-0000000-matrix.json").write_text(FIXTURE.read_text())  # older still: adds nothing
    runs = perf_table.current_runs(results)
    assert [r.path.name for r in runs] == ["h200-2026-12-07-7777777-matrix.json", FIXTURE.name]
    assert {c["model"] for c in runs[1].cells} == {"gpt-oss-120b"}  # llama8b only from the newest run
    page = perf_table.render(runs)
    newer = "2026-12-07 05:00 UTC, `7777777`, `h200-2026-12-07-7777777-matrix.json`"
    assert _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`default`").endswith(f"{newer} |")
    assert "| 111.1 (" in _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", "`default`")
    assert _row(page, "gpt-oss-120b (dummy MXFP4)", "NVIDIA H200", "`default`").endswith(f"{SOURCE} |")
    # the install and demo come from the older run, once; the newest run has no "not in this run" rows for them
    install = page.split("\n## Install and demo", 1)[1]
    assert install.count("| NVIDIA H200 | install |") == 1 and "not in this run" not in install
    assert f"{SOURCE} |" in _row(page, "NVIDIA H200", "install", section="Install and demo")
    # main writes the page from these runs
    out = results.parent / "performance.md"
    assert perf_table.main(["--results", str(results), "--out", str(out)]) == 0
    assert out.read_text() == page


def test_a_quick_check_of_one_mode_keeps_the_older_runs_other_modes_beside_their_own_default(results: Path) -> None:
    """A newer run that timed llama8b's default and `det` at batch 1 only (`gpu_matrix --cases`) shows those two;
    the older run's other llama8b modes stay, each compared with the older run's default, which stays too."""
    data = json.loads(FIXTURE.read_text())
    modes = {c["mode"] for c in data["cells"] if c["model"] == "llama8b"}
    assert {"default", "det"} < modes  # the fixture has more llama8b modes than the quick check times
    quick = [c for c in data["cells"] if c["model"] == "llama8b" and c["mode"] in ("default", "det")]
    for cell in quick:
        cell["cases"] = {"b1_1k": {**cell["cases"]["b1_1k"], "median": 222.2}}
    data["cells"] = quick
    data["env"].update(commit="8888888", date="2026-12-07 06:00 UTC")
    data.pop("install"), data.pop("demo")
    (results / "h200-2026-12-07-8888888-matrix.json").write_text(json.dumps(data))
    runs = perf_table.current_runs(results)
    assert [r.path.name for r in runs] == ["h200-2026-12-07-8888888-matrix.json", FIXTURE.name]
    older = {(c["model"], c["mode"]) for c in runs[1].cells}
    assert ("llama8b", "det") not in older and ("llama8b", "default") in older
    assert {("llama8b", m) for m in modes - {"det"}} <= older
    page = perf_table.render(runs)
    newer = "2026-12-07 06:00 UTC, `8888888`, `h200-2026-12-07-8888888-matrix.json`"
    rows = [line for line in page.split("\n## Throughput", 1)[1].split("\n## ", 1)[0].splitlines()
            if line.startswith("| Llama-3.1-8B (dummy bf16) | NVIDIA H200 | `default` |")]
    assert len(rows) == 2 and rows[0].endswith(f"{newer} |") and rows[1].endswith(f"{SOURCE} |")


def test_the_deterministic_cost_stays_from_the_last_run_that_measured_it(results: Path) -> None:
    """A newer run that timed a model's default but not its `det` mode does not hide the cost an older run
    measured: the section compares the older run's pair and names that run."""
    data = json.loads(FIXTURE.read_text())
    data["cells"] = [c for c in data["cells"] if c["model"] == "llama8b" and c["mode"] == "default"]
    data["env"].update(commit="7777777", date="2026-12-07 05:00 UTC")
    (results / "h200-2026-12-07-7777777-matrix.json").write_text(json.dumps(data))
    runs = perf_table.current_runs(results)
    assert runs[0].path.name == "h200-2026-12-07-7777777-matrix.json"  # the newest run shows llama8b, without det
    older = perf_table.render([perf_table.load_run(results / FIXTURE.name, "h200")])
    page = perf_table.render(runs)
    det_row = _row(older, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", section="Deterministic mode")
    assert det_row.endswith(f"{SOURCE} |") and "%" in det_row
    assert _row(page, "Llama-3.1-8B (dummy bf16)", "NVIDIA H200", section="Deterministic mode") == det_row
    # main writes that page
    out = results.parent / "performance.md"
    assert perf_table.main(["--results", str(results), "--out", str(out)]) == 0
    assert out.read_text() == page


def test_regressions_name_rows_more_than_3_percent_below_the_run_before(results: Path, capsys) -> None:
    data = json.loads(FIXTURE.read_text())
    llama = next(c for c in data["cells"] if c["model"] == "llama8b" and c["mode"] == "default")
    b1, c64 = llama["cases"]["b1_1k"]["median"], llama["cases"]["c64_1k"]["median"]
    llama["cases"]["b1_1k"]["median"] = b1 * 0.96  # 4% slower: named
    llama["cases"]["c64_1k"]["median"] = c64 * 0.98  # 2% slower: within the 3%
    det = next(c for c in data["cells"] if c["model"] == "llama8b" and c["mode"] == "det")
    det.update(status="failed", line="exit 1: KeyError: 1", cases={})  # served before, not now: named
    data["env"]["commit"] = "5555555"
    (results / "h200-2026-12-07-5555555-matrix.json").write_text(json.dumps(data))
    assert perf_table.main(["--results", str(results), "--regressions"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("h200-2026-12-07-5555555-matrix.json: against h200-2026-12-06-abc1234-matrix.json, 2 rows "
                      "worse by more than 3%")  # fmt: skip
    assert out[1] == (f"  llama8b default b1_1k: {b1 * 0.96:.1f} against {b1:.1f} (-4.0%) in "
                      "h200-2026-12-06-abc1234-matrix.json")  # fmt: skip
    assert out[2] == "  llama8b det: failed (exit 1: KeyError: 1), served in h200-2026-12-06-abc1234-matrix.json"
    assert len(out) == 3
    # the oldest run has nothing to compare with
    assert perf_table.previous_run(results, perf_table.load_run(results / FIXTURE.name, "h200")) is None


def test_check_detects_a_stale_or_missing_page(results: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "performance.md"
    args = ["--results", str(results), "--out", str(out)]
    assert perf_table.main([*args, "--check"]) == 1
    assert "is missing; regenerate it with `python -P -m envex.verify.lab.perf_table`" in capsys.readouterr().err
    assert perf_table.main(args) == 0
    assert perf_table.main([*args, "--check"]) == 0
    out.write_text(out.read_text().replace("245.3", "250.0"))  # a figure typed by hand
    assert perf_table.main([*args, "--check"]) == 1
    assert "is stale" in capsys.readouterr().err


def test_a_file_that_is_not_a_matrix_is_one_line_and_exit_2(results: Path, capsys: pytest.CaptureFixture) -> None:
    (results / "h200-2026-12-09-5555555-matrix.json").write_text('{"schema": "envex-gpu-matrix/0"}')
    assert perf_table.main(["--results", str(results), "--out", str(results / "p.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "schema 'envex-gpu-matrix/0', expected 'envex-gpu-matrix/1'" in err


def test_no_run_recorded(tmp_path: Path) -> None:
    page = perf_table.render(perf_table.latest_runs(tmp_path / "absent"))
    assert "No GPU acceptance matrix run has been recorded yet for any device" in page
    assert "## Throughput" not in page


def test_the_committed_page_is_current() -> None:
    """offline_docs/performance.md is what the generator makes of verify/lab/results/ (regenerate it if not)."""
    assert perf_table.main(["--check"]) == 0


def test_the_busiest_gpus_expected_experts_are_exact() -> None:
    """Checked by enumerating every choice on a small split, against a seeded sample at Kimi K2's, and at the ends:
    one GPU runs all top-k, one expert a GPU runs one."""
    from envex.verify.lab.kimi_projection import expected_busiest

    choices = list(itertools.combinations(range(12), 4))  # 12 experts, top-4, 3 GPUs of 4
    by_hand = Fraction(sum(max(sum(e // 4 == g for e in c) for g in range(3)) for c in choices), len(choices))
    assert expected_busiest(12, 4, 3) == by_hand
    assert expected_busiest(384, 8, 1) == 8 and expected_busiest(384, 8, 384) == 1
    rng = random.Random(0)
    for gpus in (8, 16):
        draws = [max(Counter(e * gpus // 384 for e in rng.sample(range(384), 8)).values()) for _ in range(20000)]
        assert float(expected_busiest(384, 8, gpus)) == pytest.approx(sum(draws) / len(draws), abs=0.02)


def test_kimi_k2_bytes_on_the_busiest_gpu_by_hand() -> None:
    """Kimi K2's published config (hidden 7168, 61 layers of which 1 dense, MLA: 64 heads, q LoRA 1536, rank 512,
    rope 64, nope 128, v 128; 384 experts of 2048 top-8 + 1 shared, FP8 128 x 128 blocks; vocabulary 163840) at the
    1K case's 1152 tokens, counted by hand: the split parts over N, the replicated ones whole."""
    from envex.verify.lab import kimi_projection as kimi
    from envex.verify.lab.kernel_bench.bench_server import deepseek_step_bytes

    split = 1536 * 64 * 192 + 64 * 256 * 512 + 64 * 128 * 7168  # q_b, kv_b, o: bf16
    whole = 7168 * 1536 + 1536 + 7168 * 576 + 512 + 2 * 7168  # q_a, its norm, kv_a, its norm, two norms
    expert = 4096 * 7168 + 4 * 32 * 56 + 7168 * 2048 + 4 * 56 * 16  # FP8 codes, a float32 scale a block
    shared = {8: 512 * 7168 + 4 * 4 * 56 + 7168 * 256 + 4 * 56 * 2, 16: 256 * 7168 + 4 * 2 * 56 + 7168 * 128 + 4 * 56}
    router = 4 * 384 * 7169  # float32 weights and correction bias
    for n in (8, 16):
        busiest = float(kimi.expected_busiest(384, 8, n))
        by_hand = (61 * 2 * (split / n + whole) + 2 * 3 * 7168 * 18432 / n + 60 * (router + busiest * expert
                   + shared[n]) + 2 * (163840 * 7168 / n + 2 * 7168) + 61 * 576 * 2 * 1152)  # fmt: skip
        assert kimi.gpu_step_bytes(kimi.KIMI_K2, kimi.CONTEXT, n) == pytest.approx(by_hand, rel=1e-12)
        held = (61 * 2 * (split / n + whole) + 2 * 3 * 7168 * 18432 / n + 60 * (router + 384 / n * expert
                + shared[n]) + 2 * (2 * 163840 * 7168 / n + 7168))  # fmt: skip
        assert kimi.gpu_weight_bytes(kimi.KIMI_K2, n) == pytest.approx(held, rel=1e-12)
    assert kimi.CONTEXT == 1152 and kimi.KIMI_K2["first_k_dense_replace"] == 1
    # on one GPU it is the one-GPU roofline's count
    assert kimi.gpu_step_bytes(kimi.KIMI_K2, 1152, 1) == deepseek_step_bytes(kimi.KIMI_K2, 1152)
    # the all-reduce the projection waits on: a token's bf16 hidden vector (14 KB) at the 16 KB size measured
    assert kimi.measured_allreduce(perf_table.RESULTS, 2 * 7168) == pytest.approx(
        (6.549760103225708, "h200-2026-11-30-f2712c7-tp.json")
    )


def test_the_kimi_k2_section_carries_the_cells_share_over(results: Path) -> None:
    from envex.verify.lab import kimi_projection as kimi

    data = json.loads(FIXTURE.read_text())
    cell = json.loads(json.dumps(data["cells"][0]))
    cell.update(model="kimi-k2-width", model_label="Kimi K2 width (dummy FP8 experts, 7 of 61 layers)")
    cell["cases"] = {"b1_1k": {"metric": "decode_tok_s", "median": 40.0, "runs": [39.8, 40.0, 40.1],
                               "roofline_tok_s": 72.0, "share_of_roofline": 0.555}}  # fmt: skip
    data["cells"].append(cell)
    (results / FIXTURE.name).write_text(json.dumps(data))
    page = perf_table.render(perf_table.latest_runs(results), allreduce=(6.5, "h200-x-tp.json"))
    section = "Kimi K2, projected"
    assert "No run has recorded a `kimi-k2-width` cell yet" not in page
    measured = _row(page, "Kimi K2 width (dummy FP8 experts, 7 of 61 layers)", "NVIDIA H200", section=section)
    assert measured == (  # 1e6 / 40 / 7 µs a layer
        "| Kimi K2 width (dummy FP8 experts, 7 of 61 layers) | NVIDIA H200 | 40.0 (39.8–40.1) | "
        f"25.00 | 3,571 | 55.5% | {SOURCE} |"
    )
    for n in (8, 16):
        step = kimi.gpu_step_bytes(kimi.KIMI_K2, 1152, n)
        free, bound = 1 / (step / (4.15e12 * 0.555)), 1 / (step / (4.15e12 * 0.555) + 123 * 6.5e-6)
        assert _row(page, str(n), section=section) == (
            f"| {n} | {step / 1e9:.2f} | {perf_table._num(kimi.gpu_weight_bytes(kimi.KIMI_K2, n) / 1e9)} | 4.15 | "
            f"55.5% (measured) | {free:.1f} ({free / 335:.2f}× of 335.0) | {bound:.1f} ({bound / 335:.2f}× of "
            f"335.0) | {SOURCE} |"
        )
    assert "| tok/s, 123 collectives at 6.5 µs |" in page and "(`h200-x-tp.json`)" in page


def test_without_the_cell_the_projection_is_bytes_only(results: Path) -> None:
    page = _page(results)  # the fixture has no kimi-k2-width cell, and no all-reduce is given
    assert "No run has recorded a `kimi-k2-width` cell yet: the rows below are bytes only" in page
    row = _row(page, "8", section="Kimi K2, projected")
    assert "| 4.15 | 100.0% (bytes only) |" in row and row.endswith(f"| — | {SOURCE} |")
    data = json.loads(FIXTURE.read_text())
    data["env"]["device"] = "NVIDIA H100 80GB HBM3"  # no H200 run: no bandwidth to assume, no tok/s
    (results / FIXTURE.name).write_text(json.dumps(data))
    assert "| 100.0% (bytes only) | — | — | — |" in _row(_page(results), "16", section="Kimi K2, projected")
