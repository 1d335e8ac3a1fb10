"""The performance page, offline_docs/performance.md, generated from the newest GPU acceptance matrix of each device.

    python -P -m envex.verify.lab.perf_table [--results DIR] [--out FILE] [--check]

verify/lab/gpu_matrix.py writes one `<device>-<YYYY-MM-DD>-<commit>-matrix.json` (schema "envex-gpu-matrix/1") per
run into verify/lab/results/. For each device this reads the newest file: the latest date in its name, then the
run's own timestamp inside it (`env.date`), then the name. File times are not used: in a checkout they are the
checkout's, not the run's, and `--check` must give the same answer on every clone. A model the newest run did not
measure keeps its rows from the newest older run that did (`current_runs`), and so does each mode of a model the
newer runs did not time, with its own run's default beside it: a mode is only ever set against a default of the same
run; where the newest run shown for a model lacks its `det` pair, the deterministic section compares the pair of the
newest run on the page that has one (`_det_run`).

The page holds, over every model x GPU x mode of those runs: throughput, the deterministic mode's cost against
--no-deterministic in the same run (against DETERMINISTIC_BAR, runtime/engine/config.py), speculation against the
same model's default, the API checks and invariance verdicts, the refused and failed cells (one line each), the
install and demo results, and Kimi K2 over 8 and 16 GPUs projected from its `kimi-k2-width` cell (kimi_projection.py).
Every row names its run's date, commit and raw file; nothing on the page is typed by hand. A figure the run did not
record renders as "—"; a refused or failed cell renders as its one line.

`--check` writes nothing and exits 1 when the page on disk differs from what would be generated (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from envex.runtime.engine.config import DETERMINISTIC_BAR, meets_deterministic_bar
from envex.verify.lab import kimi_projection as kimi

SCHEMA = "envex-gpu-matrix/1"
LAB = Path(__file__).resolve().parent
RESULTS = LAB / "results"
PAGE = LAB.parents[1] / "offline_docs" / "performance.md"
COMMAND = "python -P -m envex.verify.lab.perf_table"
# <device>-<YYYY-MM-DD>-<commit>-matrix.json; the device slug may hold hyphens (h100-x2), the date anchors it.
_NAME = re.compile(r"^(?P<device>[A-Za-z0-9][A-Za-z0-9_.-]*?)-(?P<date>\d{4}-\d{2}-\d{2})-(?P<commit>[0-9a-f]{7,40})"
                   r"-matrix\.json$")
MODE_ORDER = ("default", "no-det", "det", "spec4", "draft", "mtp", "tp2", "fp8", "fp8-channel", "int4", "kv-fp8",
              "kv-int4")  # fmt: skip
SPEC_MODES = ("spec4", "draft", "mtp")
WEIGHT_MODES = ("fp8", "fp8-channel", "int4")
KV_MODES = ("kv-fp8", "kv-int4")
DASH = "—"
# The three timed cases, as the matrix names them, and their column headings.
CASES = (("b1_1k", "batch 1, 1K/256"), ("b1_10k", "batch 1, 10K/512"), ("c64_1k", "64 concurrent, 1K/256"))
# The packed KV cache's cases (the llama8b-128k cell's).
KV_CASES = (("b1_1k", "batch 1, 1K/256"), ("b1_32k", "batch 1, 32K/256"), ("b1_128k", "batch 1, 128K/256"),
            ("c64_8k", "64 concurrent, 8K/256"))  # fmt: skip
API_CHECKS = (("chat", "chat"), ("completion", "completion"), ("stream", "stream"), ("metrics", "metrics"),
              ("shutdown_clean", "clean shutdown"))
_BAR_HEADINGS = {"b1_1k": "batch 1, 1K", "b1_10k": "batch 1, 10K", "c64_1k": "64 concurrent", "ttft": "TTFT at 1K"}


class MatrixError(ValueError):
    """A results file that is not a readable GPU matrix; the message names the file."""


@dataclass(frozen=True)
class Run:
    """One matrix file: its device slug (from the name), path, environment, cells, install and demo."""

    device: str
    path: Path
    env: Mapping[str, Any]
    cells: Sequence[Mapping[str, Any]]
    install: Mapping[str, Any] | None
    demo: Mapping[str, Any] | None

    @property
    def gpu(self) -> str:
        """The device as a reader knows it, with the GPU count where there is more than one."""
        name = str(self.env.get("device") or self.device)
        gpus = self.env.get("gpus")
        return f"{name} x{gpus}" if isinstance(gpus, int) and gpus > 1 else name

    @property
    def source(self) -> str:
        """Date, commit and raw file: what every row of the page carries."""
        commit = str(self.env.get("commit") or DASH) + (" (dirty)" if self.env.get("dirty") else "")
        return f"{self.env.get('date') or DASH}, `{commit}`, `{self.path.name}`"


def matrix_files(results: Path) -> dict[str, list[tuple[str, Path]]]:
    """The matrix files under `results` by device slug: (date from the name, path). Other files are ignored."""
    out: dict[str, list[tuple[str, Path]]] = {}
    if not results.is_dir():
        return out
    for path in sorted(results.iterdir()):
        m = _NAME.match(path.name)
        if m and path.is_file():
            out.setdefault(m["device"], []).append((m["date"], path))
    return out


def load_run(path: Path, device: str) -> Run:
    """Parse one matrix file; MatrixError (naming the file) when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MatrixError(f"{path}: not readable JSON ({exc}); fix or remove it") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise MatrixError(f"{path}: schema {found!r}, expected {SCHEMA!r}; regenerate it with verify/lab/gpu_matrix.py")
    cells = data.get("cells") or []
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise MatrixError(f"{path}: 'cells' must be a list of objects")
    env = data["env"] if isinstance(data.get("env"), dict) else {}
    return Run(device=device, path=path, env=env, cells=cells, install=data.get("install"), demo=data.get("demo"))


def latest_runs(results: Path) -> list[Run]:
    """The newest run of each device, sorted by device slug (see the module docstring for "newest")."""
    runs = []
    for device, files in sorted(matrix_files(results).items()):
        newest_date = max(date for date, _ in files)
        candidates = [load_run(path, device) for date, path in files if date == newest_date]
        runs.append(max(candidates, key=lambda r: (str(r.env.get("date") or ""), r.path.name)))
    return runs


def all_runs(results: Path) -> dict[str, list[Run]]:
    """Every run of each device, newest first (see the module docstring for "newest")."""
    return {device: sorted((load_run(path, device) for _, path in files),
                           key=lambda r: (_NAME.match(r.path.name)["date"], str(r.env.get("date") or ""),  # type: ignore[index]
                                          r.path.name), reverse=True)  # fmt: skip
            for device, files in sorted(matrix_files(results).items())}


def current_runs(results: Path) -> list[Run]:
    """What the page shows: per device, the newest run whole, then, newest first, each older run's cells of the
    (model, mode) pairs no newer run measured, each with its own run's default cell of that model beside it (a mode
    is only ever compared with a default of the same run: a quick check of one mode, `gpu_matrix --cases`, does not
    hide the older run's other modes, and their default stays on the page as their run's), and its install and
    demo where no newer run has them. An older run that adds nothing is left out."""
    runs = []
    for device, older in all_runs(results).items():
        seen: set[tuple[object, object]] = set()
        install = demo = False
        for run in older:
            new = {(c.get("model"), c.get("mode")) for c in run.cells} - seen
            models = {model for model, mode in new if mode != "default"}
            cells = [c for c in run.cells if (c.get("model"), c.get("mode")) in new
                     or (c.get("mode") == "default" and c.get("model") in models)]  # fmt: skip
            kept = replace(run, cells=cells, install=None if install else run.install, demo=None if demo else run.demo)
            if not runs or runs[-1].device != device or cells or kept.install or kept.demo:
                runs.append(kept)
            seen |= {(c.get("model"), c.get("mode")) for c in run.cells}
            install, demo = install or run.install is not None, demo or run.demo is not None
    return runs


def previous_run(results: Path, run: Run) -> Run | None:
    """The run of the same device before `run` (by the file name's date, then the name), or None."""
    files = sorted((date, path.name, path) for date, path in matrix_files(results).get(run.device, []))
    earlier = [path for date, name, path in files if path != run.path and (date, name) < (
        _NAME.match(run.path.name)["date"], run.path.name)]  # type: ignore[index]  # fmt: skip
    return load_run(earlier[-1], run.device) if earlier else None


def regressions(new: Run, old: Run, threshold: float = 0.03) -> list[str]:
    """One line for each timed row of `new` whose median is more than `threshold` below the same model, mode and
    case in `old`, and for each cell that served in `old` and does not in `new` (what a closing note must name)."""
    before = {(c.get("model"), c.get("mode")): c for c in old.cells if c.get("status") == "ok"}
    lines = []
    for cell in new.cells:
        key = (cell.get("model"), cell.get("mode"))
        then = before.get(key)
        if then is None:
            continue
        if cell.get("status") != "ok":
            lines.append(f"{key[0]} {key[1]}: {cell.get('status')} ({cell.get('line')}), served in {old.path.name}")
            continue
        for case, now in (cell.get("cases") or {}).items():
            a, b = now.get("median"), ((then.get("cases") or {}).get(case) or {}).get("median")
            if isinstance(a, int | float) and isinstance(b, int | float) and b > 0 and a < b * (1 - threshold):
                lines.append(f"{key[0]} {key[1]} {case}: {a:.1f} against {b:.1f} ({a / b - 1:+.1%}) in "
                             f"{old.path.name}")
    return lines


# -- formatting ---------------------------------------------------------------------------------------------------


def _text(value: object) -> str:
    """One table cell's text: on one line, with the pipe escaped."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _num(value: object, digits: int = 1) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return DASH
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"


def _share(value: object) -> str:
    return f"{value * 100:.1f}%" if isinstance(value, int | float) and not isinstance(value, bool) else DASH


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _case(cell: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    case = (cell.get("cases") or {}).get(name)
    return case if isinstance(case, dict) else {}


def _median(cell: Mapping[str, Any], name: str) -> float | None:
    value = _case(cell, name).get("median")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _other_cases(cell: Mapping[str, Any]) -> str:
    """The cell's timed cases beyond the three columns (a model's long-context or other batch cases), each as
    `name: median (share of roofline)`, in the order the cell ran them."""
    shown = {name for name, _ in CASES}
    parts = []
    for name in cell.get("cases") or {}:
        if name in shown or (median := _median(cell, name)) is None:
            continue
        share = _case(cell, name).get("share_of_roofline")
        parts.append(f"{name}: {_num(median)}" + (f" ({_share(share)})" if share is not None else ""))
    return _text("; ".join(parts)) if parts else DASH


def _ttft(cell: Mapping[str, Any]) -> float | None:
    value = _case(cell, "b1_1k").get("ttft_ms")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _figure(cell: Mapping[str, Any], name: str) -> str:
    """A case's median with the spread of its runs, e.g. `242.9 (241.0–243.3)`."""
    median = _median(cell, name)
    runs = [r for r in _case(cell, name).get("runs") or [] if isinstance(r, int | float)]
    if median is None:
        return DASH
    spread = f" ({_num(min(runs))}–{_num(max(runs))})" if len(runs) > 1 else ""
    excluded = _case(cell, name).get("excluded")
    dropped = f" [{excluded} excluded]" if isinstance(excluded, int) and excluded > 0 else ""
    return _num(median) + spread + dropped


def _label(cell: Mapping[str, Any]) -> str:
    return _text(cell.get("model_label") or cell.get("model") or DASH)


def _resolved(cell: Mapping[str, Any]) -> str:
    """What the engine resolved the cell's flags to: the deterministic mode, speculation, a weights policy."""
    res = cell.get("resolved") or {}
    parts = []
    if isinstance(res.get("deterministic"), bool):
        parts.append("det on" if res["deterministic"] else "det off")
    if res.get("num_speculative_tokens"):
        source = {"draft_model": "draft model", "mtp": "MTP"}.get(res.get("drafter"), "n-gram")
        parts.append(f"{res['num_speculative_tokens']} drafts, {source}")
    if res.get("weights") not in (None, "as stored"):
        parts.append(f"weights {res['weights']}")
    return _text(", ".join(parts)) if parts else DASH


def _not_ok(cell: Mapping[str, Any]) -> str | None:
    """`refused: <line>` or `failed: <line>` for a cell that has no figures; None for an ok cell."""
    status = cell.get("status")
    if status == "ok":
        return None
    return f"**{_text(status or 'no status')}**: {_text(cell.get('line') or 'no line recorded')}"


def _mode_key(mode: object) -> tuple[int, str]:
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), str(mode))


def _rows(runs: Sequence[Run]) -> list[tuple[Run, Mapping[str, Any]]]:
    """Every cell of every run: model (in order of first appearance), then GPU, then mode."""
    order: dict[str, int] = {}
    for run in runs:
        for cell in run.cells:
            order.setdefault(str(cell.get("model")), len(order))
    pairs = [(run, cell) for run in runs for cell in run.cells]
    return sorted(pairs, key=lambda p: (order[str(p[1].get("model"))], p[0].device, _mode_key(p[1].get("mode"))))


def _cell(run: Run, model: object, mode: str) -> Mapping[str, Any] | None:
    return next((c for c in run.cells if c.get("model") == model and c.get("mode") == mode), None)


# -- sections -----------------------------------------------------------------------------------------------------


def _runs_section(runs: Sequence[Run]) -> list[str]:
    rows = [[_text(run.gpu), f"`{run.device}`", _text(run.env.get("date") or DASH),
             f"`{_text(run.env.get('commit') or DASH)}`" + (" (dirty)" if run.env.get("dirty") else ""),
             _text(run.env.get("torch") or DASH), _text(run.env.get("triton") or DASH),
             _num(run.env.get("read_TBps"), 2), f"`{run.path.name}`"] for run in runs]
    return ["## Runs", "",
            "The newest matrix of each device, then any older one that measured a model (or the install) the "
            "newer ones did not: a model's rows all come from one run. Read bandwidth is the run's own measurement; "
            "the byte rooflines below divide a decode step's bytes by it.", "",
            *_table(["GPU", "slug", "date", "commit", "torch", "Triton", "read TB/s", "raw file"], rows)]


def _throughput_section(runs: Sequence[Run]) -> list[str]:
    rows = []
    for run, cell in _rows(runs):
        head = [_label(cell), _text(run.gpu), f"`{_text(cell.get('mode'))}`"]
        if (line := _not_ok(cell)) is not None:
            rows.append([*head, line, "", "", "", "", "", "", "", run.source])
            continue
        share = _share(_case(cell, "b1_1k").get("share_of_roofline"))
        rows.append([*head, _resolved(cell), _figure(cell, "b1_1k"), share, _figure(cell, "b1_10k"),
                     _figure(cell, "c64_1k"), _other_cases(cell), _num(_ttft(cell)), _num(cell.get("ready_s")),
                     run.source])  # fmt: skip
    return ["## Throughput", "",
            "Decode tokens/s of one request at a time (batch 1) after a 1K-token prompt (256 out) and a 10K-token "
            "prompt (512 out), with the batch-1 1K figure's share of the byte roofline; output tokens/s of 64 "
            "concurrent 1K/256 requests; the model's other cases (e.g. `b1_128k`: batch 1 after 128K tokens, "
            "`c64_8k`: 64 concurrent 8K/256; with their roofline share); time to the first token of a 1K prompt at "
            "batch 1; seconds from start to "
            "ready. Medians, with the spread of the runs in brackets (a run whose served token count differed is "
            "excluded, and counted); each measured through `envex serve` as `verify/lab/gpu_matrix.py` says.", "",
            *_table(["model", "GPU", "mode", "resolved", "b1 1K/256 tok/s", "of roofline", "b1 10K/512 tok/s",
                     "64× 1K/256 tok/s", "other cases", "TTFT 1K (ms)", "ready (s)", "source"], rows)]


def deterministic_costs(det: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float]:
    """The deterministic mode's cost against the default kernels, as fractions keyed like DETERMINISTIC_BAR: the
    throughput lost (cases) and the first-token time gained (ttft). Figures either cell lacks are left out."""
    costs: dict[str, float] = {}
    for name, _ in CASES:
        d, b = _median(det, name), _median(base, name)
        if d is not None and b:
            costs[name] = (b - d) / b
    d, b = _ttft(det), _ttft(base)
    if d is not None and b:
        costs["ttft"] = (d - b) / b
    return costs


def _det_pair(run: Run, model: object) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None, str]:
    """The cells to compare for one model: `det` against `no-det`, or the default where it resolved to that mode."""
    default = _cell(run, model, "default")
    resolved = (default or {}).get("resolved") or {}
    det, det_name = _cell(run, model, "det"), "det"
    if det is None and default is not None and resolved.get("deterministic") is True:
        det, det_name = default, "default (det on)"
    # Both `no-det` and a default that resolved to it run the mode's kernels off: the one timed in more cases is
    # the baseline (a matrix may time the default fully and `no-det` at batch 1 only); `no-det` on a tie.
    bases = [(cell, name) for cell, name in ((_cell(run, model, "no-det"), "no-det"),
                                             (default if resolved.get("deterministic") is False else None,
                                              "default (det off)")) if cell is not None]  # fmt: skip
    timed = [sum(_median(cell, case) is not None for case, _ in CASES) for cell, _ in bases]
    base, base_name = bases[timed.index(max(timed))] if bases else (None, "no-det")
    return det, base, f"`{det_name}` vs `{base_name}`"


def _det_run(run: Run, model: object, runs: Sequence[Run]) -> Run:
    """The run whose `det` and baseline cells of `model` the section compares: `run` (the newest the page shows the
    model from) where it has both, else the newest of the page's runs of the device that has both (current_runs
    keeps an older run's `det` cell with its default, so a later run that timed other modes does not hide the last
    measured cost), else `run`."""
    for candidate in (run, *(r for r in runs if r.device == run.device)):
        det, base, _ = _det_pair(candidate, model)
        if det is not None and base is not None:
            return candidate
    return run


def _det_section(runs: Sequence[Run]) -> list[str]:
    bar = ", ".join(f"{_BAR_HEADINGS.get(k, k)} ≤ {v * 100:g}%" for k, v in DETERMINISTIC_BAR.items())
    out = ["## Deterministic mode: its cost against --no-deterministic", "",
           f"The bar the mode must clear, in one run, before it may be a model's default (`DETERMINISTIC_BAR` in "
           f"`runtime/engine/config.py`): {bar}. Throughput costs are the share of tokens/s lost; the TTFT cost is "
           "the share of time added. \"default\" is what the run's default cell resolved to.", ""]
    rows = []
    seen: set[tuple[str, object]] = set()
    for run, cell in _rows(runs):
        model = cell.get("model")
        if (run.device, model) in seen:
            continue
        seen.add((run.device, model))
        run = _det_run(run, model, runs)
        det, base, compared = _det_pair(run, model)
        default = ((_cell(run, model, "default") or {}).get("resolved") or {}).get("deterministic")
        if det is None and base is None:
            continue
        head = [_label(cell), _text(run.gpu), compared]
        broken = next((c for c in (det, base) if c is not None and c.get("status") != "ok"), None)
        costs = deterministic_costs(det, base) if det is not None and base is not None and broken is None else {}
        if det is None or base is None or broken is not None:
            lacking = "no-det" if base is None else "det"
            why = (f"`{_text(broken.get('mode'))}` {_not_ok(broken)}" if broken is not None
                   else f"no `{lacking}` cell in this run")
            figures, verdict = [why, *([""] * (len(DETERMINISTIC_BAR) - 1))], "not measured"
        else:
            figures = []
            for key in DETERMINISTIC_BAR:
                d, b = (_ttft(det), _ttft(base)) if key == "ttft" else (_median(det, key), _median(base, key))
                figures.append(f"{costs[key] * 100:.1f}% ({_num(d)} vs {_num(b)})" if key in costs else DASH)
            over = [_BAR_HEADINGS.get(k, k) for k, v in DETERMINISTIC_BAR.items() if k in costs and costs[k] > v]
            if meets_deterministic_bar(costs):
                verdict = "**yes**"
            elif over:
                verdict = "no: over at " + ", ".join(over)
            else:
                verdict = "not measured: " + ", ".join(_BAR_HEADINGS.get(k, k) for k in DETERMINISTIC_BAR
                                                        if k not in costs)
        default_text = {True: "on", False: "off"}.get(default, DASH) if isinstance(default, bool) else DASH
        if default is True and not meets_deterministic_bar(costs):
            default_text = "**on without clearing the bar**"
        rows.append([*head, *figures, verdict, default_text, run.source])
    if not rows:
        return [*out, "No run has recorded the mode against the default kernels yet."]
    heads = [f"{_BAR_HEADINGS.get(k, k)} (≤ {v * 100:g}%)" for k, v in DETERMINISTIC_BAR.items()]
    return [*out, *_table(["model", "GPU", "compared", *heads, "clears the bar", "default", "source"], rows)]


def _against_default(runs: Sequence[Run], modes: tuple[str, ...], title: str, text: str, empty: str,
                     cases: tuple[tuple[str, str], ...] = CASES, capacity: bool = False) -> list[str]:  # fmt: skip
    """A table of the cells in `modes` against the same model's `default` cell in the same run, case by case;
    capacity: also the KV pool's tokens (/metrics) against the default's."""
    rows = []
    for run, cell in _rows(runs):
        if cell.get("mode") not in modes:
            continue
        head = [_label(cell), _text(run.gpu), f"`{_text(cell.get('mode'))}`"]
        base = _cell(run, cell.get("model"), "default")
        if (line := _not_ok(cell)) is not None:
            rows.append([*head, line, *([""] * (len(cases) + 1 + capacity)), run.source])
            continue
        base_ok = base is not None and base.get("status") == "ok"
        figures = []
        if capacity:
            tokens = [(c.get("resolved") or {}).get("kv_capacity_tokens") for c in (cell, base if base_ok else {})]
            figures.append(_versus(*tokens, digits=0))
        figures += [_versus(_median(cell, name), _median(base, name) if base_ok else None) for name, _ in cases]
        share = _share(_case(cell, "b1_1k").get("share_of_roofline"))
        rows.append([*head, _resolved(cell), *figures, share, run.source])
    out = [f"## {title}", "", text, ""]
    if not rows:
        return [*out, empty]
    heads = ["KV capacity, tokens"] if capacity else []
    return [*out, *_table(["model", "GPU", "mode", "resolved", *heads, *(h for _, h in cases), "b1 1K of roofline",
                           "source"], rows)]  # fmt: skip


def _versus(value: float | None, base: float | None, digits: int = 1) -> str:
    """A figure and its ratio to the default's: "268.5 (1.09× of 245.3)"."""
    if value is None:
        return DASH
    if not base:
        return f"{_num(value, digits)} (no default)"
    return f"{_num(value, digits)} ({value / base:.2f}× of {_num(base, digits)})"


def _spec_section(runs: Sequence[Run]) -> list[str]:
    return _against_default(
        runs, SPEC_MODES, "Speculative decoding against the default",
        "Speculation (`spec4`: four drafted tokens a step; `draft`: drafted by a smaller model; `mtp`: by the "
        "model's own multi-token-prediction module) against the same model's `default` cell in the same run: "
        "tokens/s, and the ratio to the default's (above 1: faster).",
        "No run has recorded a speculation cell yet.")  # fmt: skip


def _kv_section(runs: Sequence[Run]) -> list[str]:
    return _against_default(
        runs, KV_MODES, "Packed KV cache against bf16",
        "The KV cache packed (`kv-fp8`: `--kv-cache-dtype fp8`; `kv-int4`: `int4`) against the same model's "
        "`default` cell (bf16 KV) in the same run: the tokens the pool holds (/metrics), tokens/s at batch 1 from "
        "1K to 128K of context and at 64 concurrent 8K prompts, with the ratio to bf16's (above 1: more, faster).",
        "No run has recorded a packed KV-cache cell yet.", KV_CASES, capacity=True)  # fmt: skip


def _state_section(runs: Sequence[Run]) -> list[str]:
    """Hybrid models' recurrent state: what a sequence holds, what the slots take, and the sessions a GPU keeps at
    the full window (the live slots, max_num_seqs, or what the KV pool holds of whole windows, whichever is less)."""
    rows = []
    for run, cell in _rows(runs):
        res = cell.get("resolved") or {}
        per_seq, slots = res.get("state_bytes_per_sequence"), res.get("state_slots_total")
        if cell.get("status") != "ok" or not per_seq:
            continue
        window, seqs, tokens = (_int(res.get(k)) for k in ("max_model_len", "max_num_seqs", "kv_capacity_tokens"))
        sessions = min(seqs, tokens // window) if window and seqs is not None and tokens is not None else None
        rows.append([_label(cell), _text(run.gpu), f"`{_text(cell.get('mode'))}`", _num(per_seq / 2**20),
                     _num(slots, 0), _num(per_seq * slots / 2**30 if slots else None, 2), _num(tokens, 0),
                     _num(window, 0), _num(sessions, 0), run.source])  # fmt: skip
    out = ["## Recurrent state (hybrid models)", "",
           "A hybrid model's per-sequence state over its linear-attention layers (MiB), the state slots the engine "
           "allocated (one live a sequence, prefix snapshots, scratch, speculation's verify slots) and what they "
           "take (GiB), the KV pool of its full-attention layers in tokens, and the sessions it keeps at the full "
           "window: the live slots or the whole windows the pool holds, whichever is fewer (from `/metrics`).", ""]
    if not rows:
        return [*out, "No run has recorded a hybrid model yet."]
    return [*out, *_table(["model", "GPU", "mode", "state a sequence (MiB)", "state slots", "slots (GiB)",
                           "KV pool (tokens)", "window", "sessions at the window", "source"], rows)]  # fmt: skip


def _int(value: object) -> int | None:
    """An integer figure from the resolved settings (the metrics give some as strings), None if there is none."""
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _weights_section(runs: Sequence[Run]) -> list[str]:
    return _against_default(
        runs, WEIGHT_MODES, "Low-bit weights against bf16",
        "A float model's projections quantized at load by a weights policy and served packed (`fp8`: `--weights "
        "fp8_block`; `fp8-channel`: `fp8_channel`; `int4`: `int4_g128_asym`; the LM head stays bf16) against the "
        "same model's `default` cell (bf16) in the same run: tokens/s, the ratio to bf16's (above 1: faster), and "
        "the batch-1 figure's share of the roofline of its packed bytes.",
        "No run has recorded a low-bit weights cell yet.")  # fmt: skip


def _kimi_source(runs: Sequence[Run]) -> tuple[Run | None, Mapping[str, Any] | None]:
    """The newest run with an ok `kimi-k2-width` default cell timed at batch 1 against its roofline, and the cell;
    else the newest H200 run with a read bandwidth (the cell's GPU), and None; else (None, None)."""
    timed = [(run, cell) for run in runs if (cell := _cell(run, "kimi-k2-width", "default")) is not None
             and cell.get("status") == "ok" and _median(cell, "b1_1k")
             and isinstance(_case(cell, "b1_1k").get("share_of_roofline"), int | float)]  # fmt: skip
    if timed:
        return max(timed, key=lambda pair: str(pair[0].env.get("date") or ""))
    h200 = [run for run in runs if "H200" in run.gpu and isinstance(run.env.get("read_TBps"), int | float)]
    return (max(h200, key=lambda run: str(run.env.get("date") or "")) if h200 else None), None


def _kimi_section(runs: Sequence[Run], allreduce: tuple[float, str] | None) -> list[str]:
    run, cell = _kimi_source(runs)
    claim, shape = kimi.GB200_CLAIM_TOK_S, kimi.KIMI_K2
    layers, top_k, waits = shape["num_hidden_layers"], shape["num_experts_per_tok"], kimi.collectives(shape)
    wait = f"{waits} collectives at {allreduce[0]:.1f} µs" if allreduce else "collectives (none measured)"
    out = ["## Kimi K2, projected from its width", "",
           "Measured: the `kimi-k2-width` cell, Kimi K2's published width (dummy weights, FP8 experts) at a few of "
           f"its {layers} layers on one GPU; its batch-1 1K/256 decode, that step over its layers (the LM head's "
           "read in it) and its share of its byte roofline. Projected, not measured (`verify/lab/kimi_projection.py` "
           f"says how; Envex does not yet split this model over GPUs): the {layers} layers over "
           f"{' and '.join(map(str, kimi.GPU_COUNTS))} GPUs, experts by expert parallelism and the rest by tensor "
           "parallelism, the latent cache replicated. The bytes a step reads on the busiest GPU at the 1K case's "
           f"mean context (a layer waits for the GPU running the most of a token's {top_k} experts: the expected "
           "most under uniform routing, which real routing's skew makes optimistic) and the weights a GPU must hold. "
           "Tokens/s: those bytes at the run's read bandwidth times the cell's share of its roofline (one GPU's "
           "efficiency carried over to projections 8 to 16 times narrower: optimistic), without communication, and "
           "with the step's collectives (two a layer, one for the LM head) at the one-shot all-reduce latency "
           "measured on two GPUs" + (f" (`{allreduce[1]}`)" if allreduce else "") + ", which more GPUs only "
           f"lengthen: both are upper bounds. Each against {_num(claim, 0)} tok/s, the product page's claim for "
           "GB200 (not our measurement).", ""]  # fmt: skip
    if cell is not None and run is not None:
        median = _median(cell, "b1_1k") or 0.0
        served = re.search(r"(\d+) of \d+ layers", str(cell.get("model_label")))
        per_layer = 1e6 / median / int(served[1]) if served else None
        out += [*_table(["model", "GPU", "b1 1K/256 tok/s", "ms a step", "µs a layer (step / layers)",
                         "of roofline", "source"],
                        [[_label(cell), _text(run.gpu), _figure(cell, "b1_1k"), _num(1e3 / median, 2),
                          _num(per_layer), _share(_case(cell, "b1_1k").get("share_of_roofline")), run.source]]),
                ""]  # fmt: skip
        share, carried = float(_case(cell, "b1_1k")["share_of_roofline"]), "measured"
    else:
        out += ["No run has recorded a `kimi-k2-width` cell yet: the rows below are bytes only, not yet measured, "
                "at 100% of the newest H200 run's read bandwidth.", ""]  # fmt: skip
        share, carried = 1.0, "bytes only"
    read = run.env.get("read_TBps") if run is not None else None
    bandwidth = float(read) if isinstance(read, int | float) else None
    rows = []
    for gpus in kimi.GPU_COUNTS:
        step = kimi.gpu_step_bytes(shape, kimi.CONTEXT, gpus)
        free = bound = None
        if bandwidth is not None:
            free = kimi.projected_tok_s(step, bandwidth, share)
            bound = kimi.projected_tok_s(step, bandwidth, share, waits, allreduce[0]) if allreduce else None
        rows.append([str(gpus), _num(step / 1e9, 2), _num(kimi.gpu_weight_bytes(shape, gpus) / 1e9),
                     _num(bandwidth, 2), f"{_share(share)} ({carried})", _versus(free, claim), _versus(bound, claim),
                     run.source if run is not None else DASH])  # fmt: skip
    head = ["GPUs", "GB a step, busiest GPU", "GB of weights a GPU", "read TB/s", "share of roofline",
            "tok/s, no communication", f"tok/s, {wait}", "source"]  # fmt: skip
    return [*out, *_table(head, rows)]


def _check(value: object) -> str:
    return {True: "pass", False: "**FAIL**"}.get(value, DASH) if isinstance(value, bool) else DASH


def _invariance(inv: object) -> str:
    if not isinstance(inv, dict):
        return DASH
    differ, compared = inv.get("differing_tokens"), inv.get("compared_tokens")
    counts = f"{_num(differ, 0)} of {_num(compared, 0)} tokens differ"
    if not inv.get("promised"):
        return f"not promised ({counts})"
    return f"identical ({counts})" if inv.get("identical") else f"**differs** ({counts})"


def _api_section(runs: Sequence[Run]) -> list[str]:
    rows, refusals = [], []
    for run, cell in _rows(runs):
        head = [_label(cell), _text(run.gpu), f"`{_text(cell.get('mode'))}`"]
        if (line := _not_ok(cell)) is not None:
            refusals.append(f"- {head[0]} on {head[1]}, {head[2]}: {line} ({run.source})")
            continue
        api = cell.get("api") or {}
        rows.append([*head, *(_check(api.get(k)) for k, _ in API_CHECKS), _invariance(cell.get("invariance")),
                     run.source])
    out = ["## API checks and invariance", "",
           "Whether each cell's server answered a chat and a completion request, streamed, served /metrics and shut "
           "down cleanly; and whether its greedy tokens stayed the same across batch compositions (`verify/lab/"
           "gpu_matrix.py` says how). Promised: the deterministic mode was on, so a difference is a failure.", ""]
    if rows:
        out += _table(["model", "GPU", "mode", *(h for _, h in API_CHECKS), "invariance", "source"], rows)
    else:
        out.append("No cell ran.")
    if refusals:
        out += ["", "Refused or failed, one line each:", "", *refusals]
    return out


def _step(run: Run, name: str, step: object) -> list[str]:
    if not isinstance(step, dict):
        return [_text(run.gpu), name, "not in this run", DASH, DASH, DASH, DASH, DASH, run.source]
    status = _text(step.get("status") or DASH)
    if step.get("status") != "ok":
        status = f"**{status}**" + (f": {_text(step['line'])}" if step.get("line") else "")
    gates = step.get("gates")
    gates_text = ", ".join(f"{_text(k)} {_text(v)}" for k, v in gates.items()) if isinstance(gates, dict) else DASH
    guard = step.get("network_guard")
    guard_text = {True: "held", False: "**broken**"}.get(guard, DASH) if isinstance(guard, bool) else DASH
    answer = f"“{_text(step['answer'])}”" if step.get("answer") else DASH
    return [_text(run.gpu), name, status, _num(step.get("seconds")), gates_text or DASH, guard_text,
            _check(step.get("shutdown_clean")), answer, run.source]


def _install_section(runs: Sequence[Run]) -> list[str]:
    # the runs that brought an install or a demo (current_runs keeps the newest of each); a device with neither
    # shows its newest run's "not in this run"
    has = {run.device for run in runs if run.install or run.demo}
    shown = [run for i, run in enumerate(runs)
             if run.install or run.demo or (run.device not in has and (i == 0 or runs[i - 1].device != run.device))]
    rows = [row for run in shown for row in (_step(run, "install", run.install), _step(run, "demo", run.demo))]
    return ["## Install and demo", "",
            "`envex-install` from signed media on the GPU host (its gates, the network guard, and the installed "
            "release's answer to one chat question), and `envex demo`.", "",
            *_table(["GPU", "step", "status", "seconds", "gates", "network guard", "clean shutdown", "answer",
                     "source"], rows)]


def render(runs: Sequence[Run], results_label: str = "verify/lab/results/",
           allreduce: tuple[float, str] | None = None) -> str:  # fmt: skip
    """The whole page. Deterministic: the same runs give the same bytes (no time of generation on it). allreduce:
    the measured all-reduce (µs, raw file) the Kimi K2 projection waits on (kimi_projection.measured_allreduce)."""
    out = ["# Performance", "",
           f"Generated by `{COMMAND}` from the newest GPU acceptance matrix of each device in `{results_label}` "
           "(written by `verify/lab/gpu_matrix.py`).",
           "Do not edit this page by hand: regenerate it; `--check` fails when it is stale. Every figure comes from "
           "the raw file named on its row.",
           "The dated history of earlier measurements is the lab's journal, `verify/lab/journal.md`.", ""]
    if not runs:
        out += ["No GPU acceptance matrix run has been recorded yet for any device: "
                f"`{results_label}` holds no `<device>-<YYYY-MM-DD>-<commit>-matrix.json`. Run "
                "`verify/lab/gpu_matrix.py` on a GPU host, commit its JSON, and regenerate this page.", ""]
        bar = ", ".join(f"{_BAR_HEADINGS.get(k, k)} ≤ {v * 100:g}%" for k, v in DETERMINISTIC_BAR.items())
        out += [f"The bar the deterministic mode must clear against `--no-deterministic`, in one run, before it may be "
                f"a model's default (`DETERMINISTIC_BAR` in `runtime/engine/config.py`): {bar}."]
        return "\n".join(out) + "\n"
    sections = (_runs_section, _throughput_section, _det_section, _spec_section, _weights_section, _kv_section,
                _state_section, _api_section, _install_section)
    for section in sections:
        out += [*section(runs), ""]
    out += [*_kimi_section(runs, allreduce), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of *-matrix.json files")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (offline_docs/performance.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page on disk is stale")
    parser.add_argument("--regressions", action="store_true",
                        help="write nothing; print each row of the newest run more than 3%% below the run before it")
    args = parser.parse_args(argv)
    try:
        runs = latest_runs(args.results)
        if args.regressions:
            for run in runs:
                old = previous_run(args.results, run)
                found = regressions(run, old) if old else []
                print(f"{run.path.name}: " + (f"against {old.path.name}, " if old else "no earlier run, ")
                      + (f"{len(found)} rows worse by more than 3%" if found else "no row worse by more than 3%"))
                for line in found:
                    print(f"  {line}")
            return 0
        # one token's bf16 hidden vector is what a batch-1 step's collectives carry
        allreduce = kimi.measured_allreduce(args.results, 2 * kimi.KIMI_K2["hidden_size"])
        page = render(current_runs(args.results), allreduce=allreduce)
    except MatrixError as exc:
        print(f"perf_table: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != page:
            state = "missing" if current is None else "stale"
            print(f"perf_table: {args.out} is {state}; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
