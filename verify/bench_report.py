"""Human-readable forms of a BenchReport: a Markdown table and a PNG plot (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from envex.verify.bench import BenchReport


def _ms(interval: dict[str, float | int] | None) -> str:
    if not interval:
        return "-"
    return f"{1e3 * interval['estimate']:.1f} [{1e3 * interval['low']:.1f}, {1e3 * interval['high']:.1f}]"


def _rate(interval: dict[str, float | int] | None) -> str:
    if not interval:
        return "-"
    return f"{interval['estimate']:.2f} [{interval['low']:.2f}, {interval['high']:.2f}]"


def markdown(report: BenchReport) -> str:
    w = report.workload
    a = report.anchor
    lines = [
        f"Workload `{w['name']}`: prompt {w['prompt_tokens'] or 'chat'} tokens, output {w['output_tokens']} tokens, "
        f"{w['num_requests']} requests at concurrency {w['concurrency']}; {report.repeats} interleaved rounds, "
        f"{report.warmups} warm-up(s) discarded; medians with bootstrap 95% CIs.",
        "",
        f"Anchor ({a['engine']}, output tok/s): opening {a['opening']:.2f}, closing {a['closing']:.2f}, drift "
        f"{a['drift']:.1%} (limit {a['limit']:.0%}) -> window **{'VOID' if report.void else 'valid'}**.",
        "",
        "| engine | TTFT ms | TPOT ms | ITL p50/p99 ms | E2E ms | output tok/s | req/s | roofline | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        if not r.included:
            lines.append(f"| {r.engine} | - | - | - | - | - | - | - | excluded: {r.excluded_reason} |")
            continue
        itl = r.percentiles.get("itl_s", {})
        itl_s = f"{1e3 * itl.get('p50', float('nan')):.1f} / {1e3 * itl.get('p99', float('nan')):.1f}"
        roof = f"{r.roofline_fraction:.1%}" if r.roofline_fraction is not None else "-"
        lines.append(
            f"| {r.engine} | {_ms(r.intervals.get('ttft_s'))} | {_ms(r.intervals.get('tpot_s'))} | {itl_s} | "
            f"{_ms(r.intervals.get('e2e_s'))} | {_rate(r.intervals.get('output_tok_s'))} | "
            f"{_rate(r.intervals.get('requests_s'))} | {roof} | |"
        )
    if report.roofline:
        rf = report.roofline
        lines += ["", f"Roofline: {rf['bytes_per_step'] / 1e6:.1f} MB per decode step (batch {rf['batch']}, "
                  f"context {rf['context_len']}) over {rf['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s measured read "
                  f"bandwidth on {rf['device']} = {1e3 * rf['min_step_s']:.2f} ms floor per step."]
    return "\n".join(lines) + "\n"


def plot(report: BenchReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.included]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label, scale in ((axes[0], "output_tok_s", "output tok/s", 1.0),
                                     (axes[1], "tpot_s", "TPOT (ms)", 1e3)):
        names, est, err_lo, err_hi = [], [], [], []
        for r in rows:
            iv = r.intervals.get(metric)
            if not iv:
                continue
            names.append(r.engine)
            est.append(scale * float(iv["estimate"]))
            err_lo.append(scale * (float(iv["estimate"]) - float(iv["low"])))
            err_hi.append(scale * (float(iv["high"]) - float(iv["estimate"])))
        ax.bar(names, est, yerr=[err_lo, err_hi], capsize=6, color="#4a7ab5")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=15)
    title = f"{report.workload['name']} ({report.repeats} rounds, 95% CI)"
    fig.suptitle(title + (" - VOID: anchors drifted" if report.void else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
