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
--gemv instead times the batch-1 GEMV (kernels/quant_gemv.py, rows 1) of each scheme over a grid of (BLOCK_N,
BLOCK_K), and for FP8 the persistent kernel's (BLOCK_N, num_warps, programs per SM), beside the bf16 GEMV the
product runs (kernels/gemv.py, its tuned config) and writes quant_gemv.json.
--w8a8 instead times the W8A8 FP8 GEMM (quant_gemm.fp8_gemm: the activation quantizer and the FP8 tensor-core
GEMM, timed together) against bf16 cuBLAS, the W8A16 GEMM (quant_gemm) and the weight dequantized then cuBLAS
(dequantize_weight; quant_linear serves the first up to GEMM_MAX_ROWS rows, the second past them) at W8A8_ROWS,
fp8_block (128 x 128) and fp8_channel, and writes quant_gemm_w8a8.json: per shape and rows the times, the
quantizer's alone, fp8_gemm's tiles and TFLOP/s, and its error against float64 (the quantized activations'
product, its definition; and the unquantized one, what quantizing the activations costs).

    python3 -P -m envex.verify.lab.kernel_bench.bench_quant_gemm --w8a8 --out $OUT --commit C
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from envex.kernels import quant
from envex.kernels import reference as ref
from envex.kernels.accuracy import rel_err
from envex.kernels.gemv import _sm_count, gemv
from envex.kernels.quant_gemm import (
    W8A8_GROUP,
    GemmTiles,
    dequantize_weight,
    fp8_act_quant,
    fp8_gemm,
    gemm_config,
    quant_gemm,
    w8a8_block_k,
    w8a8_config,
)
from envex.kernels.quant_gemv import quant_gemv
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
    n = max(1, -(-L2_COPIES_BYTES // w.nbytes))  # a tensor's bytes, or a PackedWeight's codes, scales and zeros
    return [w] + [_clone(w) for _ in range(min(n, 20) - 1)]


def _clone(w: torch.Tensor | quant.PackedWeight) -> torch.Tensor | quant.PackedWeight:
    if isinstance(w, quant.PackedWeight):
        return dataclasses.replace(w, data=w.data.clone(), scale=w.scale.clone(),
                                   zero=None if w.zero is None else w.zero.clone())  # fmt: skip
    return w.clone()


SWEEP_ROWS = (16, 64)
SWEEP = {
    "fp8_channel": [GemmTiles(0, bn, bk, 4, sp) for bn in (64, 128) for bk in (64, 128) for sp in (1, 2, 4, 8, 16)],
    "int4_g128_asym": [GemmTiles(0, bn, bk, 4, sp) for bn in (64, 128) for bk in (32, 64)
                       for sp in (1, 2, 4, 8, 16, 32)],
}  # fmt: skip


def sweep(report: dict, dev: torch.device, gen: torch.Generator, save=lambda: None) -> None:
    """Every SWEEP config (BLOCK_M as gemm_config's) at SWEEP_ROWS, each shape: report["sweep"][shape][rows][scheme]
    (save() after each shape: a call cut short keeps what ran)."""
    sms, read_tbps = _sm_count(dev), report["bandwidth"]["read_TBps"]
    report["sweep"] = {}
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        for scheme, configs in SWEEP.items():
            ws = copies(SCHEMES[scheme](w))
            for m in SWEEP_ROWS:
                x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
                default = gemm_config(m, n, k, ws[0].scheme, sms)
                tiles = [default, *(c._replace(block_m=default.block_m) for c in configs)]
                entry = _time_configs(partial(_gemm_call, x, ws), tiles, ws[0].nbytes / (read_tbps * 1e12))
                report["sweep"].setdefault(shape_name, {}).setdefault(str(m), {})[scheme] = entry
                print("sweep", shape_name, m, scheme, *(entry[f] for f in ("default", "default_us", "best", "best_us")),
                      flush=True)  # fmt: skip
        save()


GEMV_SHAPES = ("qkv", "gate_up", "down")
# Each runs as named for every scheme: fp8_block's 128 x 128 blocks hold whole programs of rows (BLOCK_N | 128), so
# its scales fold into the input and BLOCK_K is not capped (before 2026-12-07 a BLOCK_K over 128 ran as 128).
GEMV_CONFIGS = [(bn, bk, 4) for bn in (8, 16, 32) for bk in (128, 256, 512, 1024)]
# The FP8 schemes also have the persistent kernel (BLOCK_N, 0, num_warps, programs per SM); bf16's winners at these
# shapes are (1-2, 0, 8-16, 2-4) (kernels/gemv.py), and a row of codes is half a bf16 row's bytes.
PERSISTENT_CONFIGS = [(bn, 0, nw, pps) for bn in (2, 4, 8) for nw in (8, 16) for pps in (2, 4)]


def gemv_sweep(report: dict, dev: torch.device, gen: torch.Generator, save=lambda: None) -> None:
    """report["gemv"][shape]: the bf16 GEMV's time (its tuned config) and per scheme the packed GEMV's at
    DEFAULT_CONFIGS (listed first) and each GEMV_CONFIGS, the best, and the packed bytes' floor; one row."""
    read_tbps = report["bandwidth"]["read_TBps"]
    report["gemv"] = {}
    for shape_name in GEMV_SHAPES:
        n, k = SHAPES[shape_name]
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        x = torch.randn(1, k, generator=gen, device=dev).bfloat16()
        bf16 = copies(w.bfloat16())
        entry: dict = {"bf16": _time_configs(partial(_gemv_call, x, bf16), [None], bf16[0].nbytes / (read_tbps * 1e12))}
        for scheme, make in SCHEMES.items():
            ws = copies(make(w))
            configs = GEMV_CONFIGS + (PERSISTENT_CONFIGS if scheme.startswith("fp8") else [])
            entry[scheme] = _time_configs(partial(_gemv_call, x, ws), [None, *configs],
                                          ws[0].nbytes / (read_tbps * 1e12))  # fmt: skip
            print("gemv", shape_name, scheme, entry["bf16"]["default_us"], entry[scheme]["default_us"],
                  entry[scheme]["best"], entry[scheme]["best_us"], flush=True)  # fmt: skip
        report["gemv"][shape_name] = entry
        save()


W8A8_ROWS = (16, 64, 256, 1024, 4096)  # decode batches to a prefill chunk (TTFT: 1K-token prompts and longer)
W8A8_SCHEMES = ("fp8_block", "fp8_channel")
W8A8_ERR_ROWS = 256  # rows the errors are measured on (a float64 product of every row would dominate the run)


def w8a8(report: dict, dev: torch.device, gen: torch.Generator, save=lambda: None) -> None:
    """report["w8a8"][shape]["rows"][rows]: bf16 cuBLAS, and per W8A8_SCHEMES scheme the W8A16 GEMM, fp8_gemm
    (quantizer + GEMM), dequantize_weight alone and before cuBLAS (quant_linear serves the W8A16 GEMM or that), the
    errors and the tiles;
    the quantizer alone once a row count (save() after each shape: a call cut short keeps what ran)."""
    report["w8a8"] = {}
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        bf16 = copies(w.bfloat16())
        packed = {name: copies(SCHEMES[name](w)) for name in W8A8_SCHEMES}
        del w
        rows: dict = {}
        for m in W8A8_ROWS:
            rows[str(m)] = _w8a8_row(torch.randn(m, k, generator=gen, device=dev).bfloat16(), bf16, packed)
            print("w8a8", shape_name, m, json.dumps(rows[str(m)]), flush=True)
        report["w8a8"][shape_name] = {"n": n, "k": k, "rows": rows}
        save()


def _w8a8_row(x: torch.Tensor, bf16: list[torch.Tensor], packed: dict[str, list[quant.PackedWeight]]) -> dict:
    """One row count of report["w8a8"]: times in microseconds, TFLOP/s of 2·M·N·K."""
    m, k = x.shape
    n = bf16[0].shape[0]
    sms = _sm_count(x.device)

    def us(call, n_inner: int = 20) -> float:
        return round(graph_time_ms(call, n_inner=n_inner) * 1e3, 2)

    def tflops(t_us: float) -> float:
        return round(2 * m * n * k / (t_us * 1e6), 1)

    row: dict = {"bf16_us": us(lambda i: F.linear(x, bf16[i % len(bf16)]))}
    row["bf16_tflops"] = tflops(row["bf16_us"])
    row["act_quant_us"] = us(lambda i: fp8_act_quant(x, W8A8_GROUP))
    sub = x[:W8A8_ERR_ROWS]
    for name, ws in packed.items():
        pw = ws[0]
        entry: dict = {"w8a16_gemm_us": us(lambda i, ws=ws: quant_gemm(x, ws[i % len(ws)])),
                       "w8a8_us": us(lambda i, ws=ws: fp8_gemm(x, ws[i % len(ws)]))}  # fmt: skip
        # the weight dequantized for the call (dequantize_weight), then cuBLAS: what quant_linear serves past
        # GEMM_MAX_ROWS rows; its crossover with the W8A16 GEMM sets GEMM_MAX_ROWS
        entry["dequant_us"] = us(lambda i, ws=ws: dequantize_weight(ws[i % len(ws)], x.dtype), n_inner=4)
        entry["dequant_linear_us"] = us(lambda i, ws=ws: F.linear(x, dequantize_weight(ws[i % len(ws)], x.dtype)),
                                        n_inner=4)  # fmt: skip
        entry["w8a8_tflops"] = tflops(entry["w8a8_us"])
        plain = sub.double() @ quant.dequantize(pw, torch.float64).t()
        y = fp8_gemm(x, pw)[:W8A8_ERR_ROWS]
        entry["rel_err"] = rel_err(y, ref.fp8_gemm(sub, pw, group=w8a8_block_k(pw, W8A8_GROUP)))
        entry["rel_err_unquantized"] = rel_err(y, plain)
        entry["w8a16_rel_err_unquantized"] = rel_err(quant_gemm(x, pw)[:W8A8_ERR_ROWS], plain)
        entry["config"] = list(w8a8_config(m, n, k, sms))
        row[name] = entry
    return row


def _gemm_call(x: torch.Tensor, ws: list, cfg: GemmTiles, i: int) -> torch.Tensor:
    return quant_gemm(x, ws[i % len(ws)], config=cfg)


def _gemv_call(x: torch.Tensor, ws: list, cfg: tuple | None, i: int) -> torch.Tensor:
    w = ws[i % len(ws)]
    return (quant_gemv(x, w, config=cfg) if isinstance(w, quant.PackedWeight) else gemv(x, w, config=cfg))[0]


def _time_configs(call, configs: list, floor_s: float) -> dict:
    """call(config, i) timed in graphs for each config (the first is the default); a config that does not compile
    or launch is recorded with its error, not fatal."""
    timed: dict[str, float | str] = {}
    for cfg in configs:
        try:
            us: float | str = round(graph_time_ms(partial(call, cfg), n_inner=20) * 1e3, 2)
        except Exception as exc:
            us = f"{type(exc).__name__}: {exc}"[:200]
        timed["default" if cfg is None else ",".join(map(str, cfg))] = us
    name = next(iter(timed))
    numeric = {c: t for c, t in timed.items() if isinstance(t, float)}
    best = min(numeric, key=numeric.__getitem__) if numeric else name
    return {"default": name, "default_us": timed[name], "best": best, "best_us": numeric.get(best),
            "floor_us": round(floor_s * 1e6, 2), "all": timed}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles and splits instead")
    ap.add_argument("--gemv", action="store_true", help="time the batch-1 GEMV's configs against bf16's instead")
    ap.add_argument("--w8a8", action="store_true", help="time the W8A8 FP8 GEMM against bf16 and W8A16 instead")
    args = ap.parse_args()
    bw = measure_bandwidth()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    report: dict = {"commit": args.commit, "device": torch.cuda.get_device_name(), "bandwidth": bw, "shapes": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    modes = {"sweep": (sweep, "quant_gemm_sweep.json"), "gemv": (gemv_sweep, "quant_gemv.json"),
             "w8a8": (w8a8, "quant_gemm_w8a8.json")}  # fmt: skip
    mode = next((name for name in modes if getattr(args, name)), None)
    if mode is not None:
        run, file_name = modes[mode]
        path = args.out / file_name
        run(report, dev, gen, lambda: path.write_text(json.dumps(report, indent=1)))
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
