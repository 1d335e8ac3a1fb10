"""The packed weight-only GEMM (kernels/quant_gemm.py) at Llama-3.1-8B's projection shapes, by rows, against bf16
cuBLAS and against the path it replaced (the weight dequantized to bf16 for each call, then cuBLAS) (issue 42).

    python3 -P -m envex.verify.lab.kernel_bench.bench_quant_gemm --out $OUT --commit C

Random weights at dummy magnitudes, quantized per scheme (quant.quantize_fp8 / quantize_int4); each form timed in
CUDA graphs (graph_time_ms) at each row count; per shape and rows: the times, the packed bytes' floor at the
measured read bandwidth, and the GEMM's relative error against float64 (a fast wrong kernel shows). One weight a
shape, re-read by every call of a graph: a packed weight smaller than L2 (O in FP8 or INT4) is timed warm, under
its floor. Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from envex.kernels import quant
from envex.kernels.accuracy import rel_err
from envex.kernels.quant_gemm import gemm_config, quant_gemm
from envex.verify.lab.kernel_bench._bench_lib import graph_time_ms, measure_bandwidth

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (9, 16, 32, 64, 128, 512, 2048)  # up to prefill chunks: where (if anywhere) dequantize + cuBLAS wins back
SCHEMES = {
    "fp8_block": lambda w: quant.quantize_fp8(w, quant.FP8_BLOCK),
    "fp8_channel": lambda w: quant.quantize_fp8(w, quant.FP8_CHANNEL),
    "int4_g128_asym": lambda w: quant.quantize_int4(w, 128, symmetric=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    bw = measure_bandwidth()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    report: dict = {"commit": args.commit, "device": torch.cuda.get_device_name(), "bandwidth": bw, "shapes": {}}
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        bf16 = w.bfloat16()
        packed = {name: make(w) for name, make in SCHEMES.items()}
        del w
        rows: dict = {}
        for m in ROWS:
            rows[m] = _row(torch.randn(m, k, generator=gen, device=dev).bfloat16(), bf16, packed, bw["read_TBps"])
            print(shape_name, m, json.dumps(rows[m]), flush=True)
        report["shapes"][shape_name] = {"n": n, "k": k, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_gemm.json").write_text(json.dumps(report, indent=1))


def _row(x: torch.Tensor, bf16: torch.Tensor, packed: dict[str, quant.PackedWeight], read_tbps: float) -> dict:
    """One row count: bf16 cuBLAS, then per scheme the GEMM, dequantize + cuBLAS, the bytes' floor, the error."""
    row: dict = {"bf16_us": round(graph_time_ms(lambda i: F.linear(x, bf16), n_inner=20) * 1e3, 2)}
    for name, pw in packed.items():
        gemm_us = graph_time_ms(lambda i, pw=pw: quant_gemm(x, pw), n_inner=20) * 1e3
        old_us = graph_time_ms(lambda i, pw=pw: F.linear(x, quant.dequantize(pw, x.dtype)), n_inner=4) * 1e3
        want = x.double() @ quant.dequantize(pw, torch.float64).t()
        row[name] = {"us": round(gemm_us, 2), "dequant_matmul_us": round(old_us, 2),
                     "floor_us": round(pw.nbytes / (read_tbps * 1e12) * 1e6, 2),
                     "rel_err": rel_err(quant_gemm(x, pw), want),
                     "config": gemm_config(x.shape[0], pw.shape[0], pw.scheme)}  # fmt: skip
    return row


if __name__ == "__main__":
    main()
