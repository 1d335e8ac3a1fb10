"""Skinny GEMM against cuBLAS on the Llama-3.1-8B projections at decode batches 2–64 (one H200 call, ~2–3 min).

    python3 -m envex.kernels._bench_skinny --out $OUT [--ms 2,4,8,16,32,64] [--shapes qkv,o,gate_up,down,lm_head]

1. Read bandwidth (_bench_lib.measure_bandwidth), the denominator of every "of_bw".
2. Per shape and M: skinny_matmul's default config against float64 and against cuBLAS (`x @ w.t()`), two runs
   bit-identical; then cuBLAS and ≤ 8 configs timed in a CUDA graph over rotating weight copies (≥ 400 MB, so W
   comes from HBM, not the 50 MB L2), every config checked against cuBLAS's output first.
3. skinny.json under --out (every row, the best config per (shape, M), the per-step projection time both ways),
   and a compact table printed last.

Configs share compiled kernels across shapes (K, M and split_k are not specialised), so the sweep compiles ~6
kernels per M bucket (16, 32, 64), not one per (shape, M, config).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from envex.kernels import _bench_lib as B
from envex.kernels import reference as ref
from envex.kernels import skinny_gemm as sg
from envex.kernels.accuracy import TOLERANCE, rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # calls per decode step (32 layers)
# Candidate tiles (BLOCK_N, BLOCK_K, warps, stages) per M bucket, besides the default one: a narrow tile (more
# units for the 4096-row shapes without split-K), and a wide one (less x re-read per weight byte).
SWEEP_TILES = {
    16: ((32, 256, 4, 4), (128, 128, 8, 3)),
    32: ((64, 128, 4, 4), (128, 128, 8, 3)),
    64: ((64, 128, 4, 4), (256, 64, 8, 3)),
}


def candidates(n: int, k: int, m: int) -> list[sg.SkinnyConfig]:
    """≤ 8 configs: the default, then each tile with its modelled split, and the alternative per tile (no split
    where the model splits, else one program per unit instead of a persistent grid)."""
    bm = sg.block_m_for(m)
    tiles = (sg.DEFAULT_TILES[bm], *SWEEP_TILES[bm])
    out = [sg.tuned_config(n, k, m)]
    for tile in tiles:
        cfg = sg.with_split(n, k, m, tile)
        alt = cfg._replace(split_k=1) if cfg.split_k > 1 else cfg._replace(programs_per_sm=0)
        out += [cfg, alt]
    if all(c.split_k == 1 for c in out):  # a wide shape: also try two slices on the default tile
        out.append(out[0]._replace(split_k=2))
    seen: list[sg.SkinnyConfig] = []
    for c in out:
        if c not in seen:
            seen.append(c)
    return seen[:8]


def _weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, math.ceil(400e6 / (n * k * 2)))
    return [torch.randn(n, k, device=DEV, dtype=BF16) / math.sqrt(k) for _ in range(copies)]


def bench_shape(name: str, n: int, k: int, ms: list[int], bw: float, rows: list[dict], log) -> None:
    ws = _weights(n, k)
    w64 = ws[0].double()
    nbytes = n * k * 2
    floor_us = nbytes / bw / 1e6
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        want = ref.skinny_matmul(x.double(), w64)
        cub = x @ ws[0].t()
        out = sg.skinny_matmul(x, ws[0])
        again = sg.skinny_matmul(x, ws[0])
        torch.cuda.synchronize()
        row: dict = dict(shape=name, n=n, k=k, m=m, floor_us=floor_us, default=list(sg.tuned_config(n, k, m)),
                         rel_err=rel_err(out, want), cublas_rel_err=rel_err(cub, want),
                         vs_cublas_rel_err=rel_err(out, cub), deterministic=bool(torch.equal(out, again)))  # fmt: skip
        row["ok"] = bool(row["rel_err"] <= TOLERANCE[BF16] and row["deterministic"])
        cub_ms = B.graph_time_ms(lambda i, x=x: x @ ws[i % len(ws)].t(), 2 * len(ws))
        row.update(cublas_us=cub_ms * 1e3, cublas_of_bw=floor_us / (cub_ms * 1e3))
        sweep = []
        for cfg in candidates(n, k, m):
            try:
                err = rel_err(sg.skinny_matmul(x, ws[0], config=cfg), cub)
                t_ms = B.graph_time_ms(lambda i, x=x, c=cfg: sg.skinny_matmul(x, ws[i % len(ws)], config=c),
                                       2 * len(ws))  # fmt: skip
            except Exception as exc:  # a config the compiler rejects (shared memory, registers) is recorded
                sweep.append(dict(config=list(cfg), error=str(exc)[:160]))
                continue
            sweep.append(dict(config=list(cfg), us=t_ms * 1e3, of_bw=floor_us / (t_ms * 1e3), vs_cublas_rel_err=err,
                              ok=bool(err <= TOLERANCE[BF16])))  # fmt: skip
        row["sweep"] = sweep
        good = [s for s in sweep if s.get("ok")]
        if good:
            best = min(good, key=lambda s: s["us"])
            row.update(best=best["config"], best_us=best["us"], best_of_bw=best["of_bw"],
                       speedup=row["cublas_us"] / best["us"],
                       default_us=next((s["us"] for s in sweep if s["config"] == row["default"]), None))  # fmt: skip
        rows.append(row)
        log(row)


def _table(data: dict) -> None:
    print(f"\n=== skinny GEMM vs cuBLAS, read BW {data['bw']['read_TBps']:.3f} TB/s ===")
    print(f"{'shape':8s} {'M':>3s} {'floor':>7s} {'cuBLAS':>8s} {'of_bw':>6s} {'best':>8s} {'of_bw':>6s} "
          f"{'speedup':>7s} {'default':>8s} {'ok':>3s}  best (BN, BK, warps, stages, split, progs/SM)")  # fmt: skip
    for r in data["rows"]:
        d = r.get("default_us")
        print(f"{r['shape']:8s} {r['m']:3d} {r['floor_us']:7.2f} {r['cublas_us']:8.2f} {r['cublas_of_bw']:6.3f} "
              f"{r.get('best_us', float('nan')):8.2f} {r.get('best_of_bw', float('nan')):6.3f} "
              f"{r.get('speedup', float('nan')):7.3f} {d if d is None else round(d, 2)!s:>8s} "
              f"{'y' if r['ok'] else 'N':>3s}  {r.get('best')}")  # fmt: skip
    for m, s in sorted(data["per_step"].items(), key=lambda kv: int(kv[0])):
        print(f"per step M={m}: projections cuBLAS {s['cublas_ms']:.3f} ms -> {s['skinny_ms']:.3f} ms with skinny "
              f"where faster (saves {s['cublas_ms'] - s['skinny_ms']:.3f} ms)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="2,4,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    import triton

    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(DEV)
    data: dict = dict(env=dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                               triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
                      rows=[])  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "skinny.json").write_text(json.dumps(data, indent=1))

    def log(row: dict) -> None:
        brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "sweep"}
        print(f"[{time.perf_counter() - t0:6.1f}s] {brief}", flush=True)
        save()

    data["bw"] = B.measure_bandwidth()
    print(f"[{time.perf_counter() - t0:6.1f}s] bandwidth {data['bw']}", flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        bench_shape(name, n, k, ms, data["bw"]["read_TBps"], data["rows"], log)
    per_step: dict = {}
    for r in data["rows"]:
        s = per_step.setdefault(str(r["m"]), dict(cublas_ms=0.0, skinny_ms=0.0))
        s["cublas_ms"] += PER_STEP[r["shape"]] * r["cublas_us"] / 1e3
        s["skinny_ms"] += PER_STEP[r["shape"]] * min(r.get("best_us", r["cublas_us"]), r["cublas_us"]) / 1e3
    data["per_step"] = per_step
    data["best_configs"] = {f"{r['n']}x{r['k']}/m{r['m']}": r.get("best") for r in data["rows"]}
    data["elapsed_s"] = time.perf_counter() - t0
    save()
    _table(data)


if __name__ == "__main__":
    main()
