"""The packed weight-only GEMM (kernels/quant_gemm.py) at Llama-3.1-8B's projection shapes, by rows, against bf16
cuBLAS and against the path it replaced (the weight dequantized to bf16 for each call, then cuBLAS) (issue 42).

    python3 -P -m envex.verify.lab.kernel_bench.bench_quant_gemm --out $OUT --commit C

    python3 -P -m envex.verify.lab.kernel_bench.bench_quant_gemm --out $OUT --commit C --sweep

Random weights at dummy magnitudes, quantized per scheme (quant.quantize_fp8 / quantize_int4); each form timed in
CUDA graphs (graph_time_ms) at each row count; per shape and rows: the times, the packed bytes' floor at the
measured read bandwidth, and the GEMM's relative error against float64 (a fast wrong kernel shows). Each form
cycles through copies of its weight that together exceed L2 twice (a layer's weight is cold in a model's step);
the first H100 run (338a41a) re-read one copy, so its small packed weights were timed warm.

--sweep instead times a grid of tiles and splits (GemmTiles) at 16 and 64 rows for FP8 per-channel and INT4 g128
and writes quant_gemm_sweep.json: per shape, rows and scheme, every config's time, the best and gemm_config's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from envex.kernels import quant
from envex.kernels.accuracy import rel_err
from envex.kernels.gemv import _sm_count
from envex.kernels.quant_gemm import GemmTiles, gemm_config, quant_gemm
from envex.verify.lab.kernel_bench._bench_lib import graph_time_ms, measure_bandwidth

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (9, 16, 32, 64, 128, 512, 2048)  # up to prefill chunks: where (if anywhere) dequantize + cuBLAS wins back
SCHEMES = {
    "fp8_block": lambda w: quant.quantize_fp8(w, quant.FP8_BLOCK),
    "fp8_channel": lambda w: quant.quantize_fp8(w, quant.FP8_CHANNEL),
    "int4_g128_asym": lambda w: quant.quantize_int4(w, 128, symmetric=False),
}


L2_COPIES_BYTES = 2 * 50 * 2**20  # twice an H100's / H200's L2


def copies(w: torch.Tensor | quant.PackedWeight) -> list:
    """Enough copies of w to exceed L2 twice together (w itself first)."""
    n = max(1, -(-L2_COPIES_BYTES // (w.nbytes if isinstance(w, quant.PackedWeight) else w.nbytes)))
    return [w] + [_clone(w) for _ in range(min(n, 20) - 1)]


def _clone(w: torch.Tensor | quant.PackedWeight) -> torch.Tensor | quant.PackedWeight:
    if isinstance(w, quant.PackedWeight):
        return dataclasses.replace(w, data=w.data.clone(), scale=w.scale.clone(),
                                   zero=None if w.zero is None else w.zero.clone())  # fmt: skip
    return w.clone()


SWEEP_ROWS = (16, 64)
SWEEP = {
    "fp8_channel": [GemmTiles(0, bn, bk, 4, sp) for bn in (64, 128) for bk in (64, 128) for sp in (1, 2, 4, 8, 16)],
    "int4_g128_asym": [GemmTiles(0, bn, bk, 4, sp) for bn in (64, 128) for bk in (32, 64) for sp in (1, 4, 8, 16, 32)],
}


def sweep(report: dict, dev: torch.device, gen: torch.Generator) -> None:
    """Every SWEEP config (BLOCK_M as gemm_config's) at SWEEP_ROWS, each shape: report["sweep"][shape][rows][scheme]."""
    sms, read_tbps = _sm_count(dev), report["bandwidth"]["read_TBps"]
    report["sweep"] = {}
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        for scheme, configs in SWEEP.items():
            ws = copies(SCHEMES[scheme](w))
            for m in SWEEP_ROWS:
                x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
                entry = _sweep_point(x, ws, configs, gemm_config(m, n, k, ws[0].scheme, sms), read_tbps)
                report["sweep"].setdefault(shape_name, {}).setdefault(str(m), {})[scheme] = entry
                print("sweep", shape_name, m, scheme, *(entry[f] for f in ("default", "default_us", "best", "best_us")),
                      flush=True)  # fmt: skip


def _sweep_point(x: torch.Tensor, ws: list[quant.PackedWeight], configs: list[GemmTiles], default: GemmTiles,
                 read_tbps: float) -> dict:  # fmt: skip
    """gemm_config's tiles and each of `configs` (with its BLOCK_M) on x and the weight's copies."""
    timed: dict[str, float | str] = {}
    for cfg in [default, *(c._replace(block_m=default.block_m) for c in configs)]:
        try:
            us: float | str = round(graph_time_ms(lambda i, c=cfg: quant_gemm(x, ws[i % len(ws)], config=c),
                                                  n_inner=20) * 1e3, 2)  # fmt: skip
        except Exception as exc:  # a config that does not compile or launch: recorded, not fatal
            us = f"{type(exc).__name__}: {exc}"[:200]
        timed[",".join(map(str, cfg))] = us
    numeric = {c: t for c, t in timed.items() if isinstance(t, float)}
    best = min(numeric, key=numeric.__getitem__)
    name = ",".join(map(str, default))
    return {"default": name, "default_us": timed[name], "best": best, "best_us": numeric[best],
            "floor_us": round(ws[0].nbytes / (read_tbps * 1e12) * 1e6, 2), "all": timed}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles and splits instead")
    args = ap.parse_args()
    bw = measure_bandwidth()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    report: dict = {"commit": args.commit, "device": torch.cuda.get_device_name(), "bandwidth": bw, "shapes": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        sweep(report, dev, gen)
        (args.out / "quant_gemm_sweep.json").write_text(json.dumps(report, indent=1))
        return
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        bf16 = copies(w.bfloat16())
        packed = {name: copies(make(w)) for name, make in SCHEMES.items()}
        del w
        rows: dict = {}
        for m in ROWS:
            rows[m] = _row(torch.randn(m, k, generator=gen, device=dev).bfloat16(), bf16, packed, bw["read_TBps"])
            print(shape_name, m, json.dumps(rows[m]), flush=True)
        report["shapes"][shape_name] = {"n": n, "k": k, "rows": rows}
    (args.out / "quant_gemm.json").write_text(json.dumps(report, indent=1))


def _row(x: torch.Tensor, bf16: list[torch.Tensor], packed: dict[str, list[quant.PackedWeight]],
         read_tbps: float) -> dict:  # fmt: skip
    """One row count: bf16 cuBLAS, then per scheme the GEMM, dequantize + cuBLAS, the bytes' floor, the error."""
    sms = _sm_count(x.device)
    row: dict = {"bf16_us": round(graph_time_ms(lambda i: F.linear(x, bf16[i % len(bf16)]), n_inner=20) * 1e3, 2)}
    for name, ws in packed.items():
        pw = ws[0]
        gemm_us = graph_time_ms(lambda i, ws=ws: quant_gemm(x, ws[i % len(ws)]), n_inner=20) * 1e3
        old_us = graph_time_ms(lambda i, pw=pw: F.linear(x, quant.dequantize(pw, x.dtype)), n_inner=4) * 1e3
        want = x.double() @ quant.dequantize(pw, torch.float64).t()
        row[name] = {"us": round(gemm_us, 2), "dequant_matmul_us": round(old_us, 2),
                     "floor_us": round(pw.nbytes / (read_tbps * 1e12) * 1e6, 2),
                     "rel_err": rel_err(quant_gemm(x, pw), want),
                     "config": gemm_config(x.shape[0], pw.shape[0], pw.shape[1], pw.scheme, sms)}  # fmt: skip
    return row


if __name__ == "__main__":
    main()
