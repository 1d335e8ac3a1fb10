"""Qwen3-30B-A3B's MoE experts on one GPU: FP8 block-scaled experts (the FP8 release's layout) and INT4 ones (Kimi K2's
layout: symmetric, groups of 32, bf16 scales) against bf16 ones, by token rows (issues 42, 44).

    python3 -m envex.verify.lab.kernel_bench.bench_moe_fp8 --out $OUT --commit C

One layer's experts (128 × gate-up [1536, 2048] and down [2048, 768], top 8), random weights at dummy magnitudes,
quantized to 128 × 128 blocks (kernels.quant.quantize_fp8_stack) and to INT4 groups of 32
(quantize_int4_stack); moe_mxfp4.fused_moe timed in CUDA graphs at
each row count, "cold" (8 inputs in rotation whose routings pick other experts) for both forms. Per row count:
the times, the bytes of the experts the rows choose (the decode floor at the measured read bandwidth), and each
form's relative error against the float64 reference on its own dequantized experts, so a fast wrong kernel shows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from envex.kernels import moe_mxfp4 as M
from envex.kernels import quant
from envex.kernels import reference as ref
from envex.kernels.accuracy import rel_err
from envex.verify.lab.kernel_bench._bench_lib import graph_time_ms, measure_bandwidth

E, H, INTER, TOP_K = 128, 2048, 768, 8
ROWS = (1, 2, 4, 8, 16, 64, 256, 1024)
ROTATE = 8
BYTES_PER_WEIGHT = {"fp8": 1.0, "int4": 0.5 + 2 / 32, "bf16": 2.0}  # codes and scales (FP8's 128 x 128: ~0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    report = bench(dev, torch.Generator(device=dev).manual_seed(0), measure_bandwidth())
    report = {"commit": args.commit, "device": torch.cuda.get_device_name(), **report}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_fp8.json").write_text(json.dumps(report, indent=1))


def bench(dev: torch.device, gen: torch.Generator, bw: dict) -> dict:
    """Every form at every row count: {"shape", "bandwidth", "rows": {t: {"experts_chosen_per_input", form: {"us",
    "floor_us", "rel_err"}}}}."""
    wg = torch.randn(E, 2 * INTER, H, generator=gen, device=dev) * H**-0.5
    wd = torch.randn(E, H, INTER, generator=gen, device=dev) * INTER**-0.5
    forms = {"fp8": (quant.quantize_fp8_stack(wg, paired=True), quant.quantize_fp8_stack(wd)),
             "int4": (quant.quantize_int4_stack(wg, 32), quant.quantize_int4_stack(wd, 32)),
             "bf16": (wg.bfloat16(), wd.bfloat16())}  # fmt: skip
    del wg, wd
    f64 = {name: (_cpu64(g), _cpu64(d)) for name, (g, d) in forms.items()}  # the reference's experts, made once
    report: dict = {"shape": [E, H, INTER, TOP_K], "bandwidth": bw, "rows": {}}
    for t in ROWS:
        xs = [torch.randn(t, H, generator=gen, device=dev).bfloat16() for _ in range(ROTATE)]
        # float32 router logits: bf16 ones tie at the top-k edge, which the kernel and the reference break apart
        logits = [torch.randn(t, E, generator=gen, device=dev) for _ in range(ROTATE)]
        chosen = sum(torch.topk(lg.float(), TOP_K).indices.unique().numel() for lg in logits) / ROTATE
        row: dict = {"experts_chosen_per_input": chosen}
        for name, (g, d) in forms.items():
            def run(i: int, g=g, d=d, xs=xs, logits=logits) -> torch.Tensor:
                return M.fused_moe(xs[i % ROTATE], logits[i % ROTATE], TOP_K, gate_up=g, gate_up_bias=None, down=d,
                                   down_bias=None, alpha=1.702, limit=7.0, activation="silu")  # fmt: skip

            us = graph_time_ms(run, n_inner=2 * ROTATE) * 1e3
            floor_us = chosen * 3 * H * INTER * BYTES_PER_WEIGHT[name] / (bw["read_TBps"] * 1e12) * 1e6
            out = run(0).double().cpu()
            w, ids = ref.moe_route(logits[0].double().cpu(), TOP_K)
            g64, d64 = f64[name]
            want = ref.moe_experts(xs[0].double().cpu(), w, ids, g64, None, d64, None, 1.702, 7.0, "silu")
            row[name] = {"us": round(us, 2), "floor_us": round(floor_us, 2), "rel_err": rel_err(out, want)}
        report["rows"][t] = row
        print(t, json.dumps(row), flush=True)
    return report


def _cpu64(w: torch.Tensor | quant.FP8BlockStack | quant.Int4GroupStack) -> torch.Tensor:
    """The stack's experts in float64 on the CPU (the reference's)."""
    if isinstance(w, torch.Tensor):
        return w.double().cpu()
    return torch.stack([w.expert(e, torch.float64) for e in range(w.shape[0])]).cpu()


if __name__ == "__main__":
    main()
