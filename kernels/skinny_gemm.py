"""Skinny GEMM for decode batches 2–64: out[M, N] = x[M, K] @ W[N, K]^T with the weight read once from HBM.

Use it where the decode step would call cuBLAS on a small batch:

    out = skinny_matmul(x, w)          # same result as x @ w.t() (fp32 accumulate, one rounding at the end)

with x [M, K] (1 ≤ M ≤ 64, bf16 or fp16, unit stride along K) and w [N, K] (same dtype, unit stride along K).
The config comes from H200_CONFIGS keyed by (N, K, BLOCK_M) with BLOCK_M = max(16, next pow2 ≥ M), or from
`default_config` for other shapes; pass `config=SkinnyConfig(...)` to override (kernels/_bench_skinny.py sweeps
them on the H200 and prints the best per shape and M).

At M ≤ 64 the FLOPs are negligible (M=64 on gate-up: 15 GFLOP, 19 µs of tensor-core time against 51 µs of
weight reads), so the design is about bytes in flight and balance:

- **swap AB**: each program computes outᵀ tile [BLOCK_N, BLOCK_M] = W tile [BLOCK_N, BLOCK_K] @ xᵀ, so the weight
  rows sit on the MMA's M side (64 per warpgroup on Hopper) and the tiny batch on its N side (tensor cores need
  BLOCK_M ≥ 16; rows ≥ M are masked and never loaded).
- **work units** (BLOCK_N rows × one of SPLIT_K slices of K) walked by a persistent grid of programs_per_sm × SMs
  programs in one flattened loop over (unit, K chunk), so the software pipeline (num_stages) stays full across unit
  boundaries instead of draining after each tile (the Triton persistent-matmul tutorial's first form).
- **split-K** for the narrow shapes (N = 4096 or 6144 gives 32–96 tiles of 64–128 rows, too few for 132 SMs):
  fp32 partials [SPLIT_K, M, N] and a second kernel that sums them in split order, so the result is bit-identical
  run to run (no atomics). Cost: 8·SPLIT_K·M·N bytes of L2 traffic and one more launch (~2 µs).
- **x re-read**: every unit reads x[:, its K slice] from L2: M/BLOCK_N bytes per weight byte, so BLOCK_N grows with
  M (x is loaded evict_last, W evict_first, so the streamed weight does not push the activations out of L2).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from envex.kernels._common import INTERPRETING, check, check_tensor, next_pow2

DTYPES = (torch.bfloat16, torch.float16)
MAX_M = 64
SMEM_BYTES = 227 * 1024  # per-block shared memory limit on the H100/H200
HBM_TBPS = 4.6  # measured read bandwidth (NOTES.md), for the split-K cost model only


class SkinnyConfig(NamedTuple):
    """Tile shape and launch shape. programs_per_sm = 0: one program per work unit (no persistent loop)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    programs_per_sm: int = 1


@triton.jit(do_not_specialize=["M", "k_iters", "n_units", "split_k"])
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_iters, n_units, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Program p owns units p, p + P, p + 2P, ... (unit u: rows tile u // split_k, K slice u % split_k, each slice
    k_iters chunks of BLOCK_K). One loop walks all its (unit, chunk) pairs; a unit's result is stored when its last
    chunk is done: bf16 into out, or (PARTIAL) fp32 into part[slice]."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_units = (n_units - pid + nprog - 1) // nprog
    mm = tl.arange(0, BLOCK_M)
    m_ok = mm < M
    rr = tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    unit = pid - nprog
    ki = k_iters - 1
    rows = rr
    k0 = 0
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, my_units * k_iters):
        ki = tl.where(ki == k_iters - 1, 0, ki + 1)
        if ki == 0:  # next unit
            unit += nprog
            rows = (unit // split_k) * BLOCK_N + rr
            k0 = (unit % split_k) * k_iters * BLOCK_K
        cols = k0 + ki * BLOCK_K + kk
        k_ok = cols < K
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :],
                    mask=(rows < N)[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")  # fmt: skip
        x = tl.load(x_ptr + mm[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_last")  # fmt: skip
        if UPCAST_DOT:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
        if ki == k_iters - 1:  # unit done
            mask = (rows < N)[:, None] & m_ok[None, :]
            if PARTIAL:
                part = part_ptr + (unit % split_k).to(tl.int64) * M * N
                tl.store(part + mm[None, :] * N + rows[:, None], acc, mask=mask)
            else:
                tl.store(out_ptr + mm[None, :] * stride_om + rows[:, None], acc.to(out_ptr.dtype.element_ty),
                         mask=mask)  # fmt: skip
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)


@triton.jit(do_not_specialize=["M", "split_k"])
def _split_sum_kernel(part_ptr, out_ptr, M, N, stride_om, split_k, BLOCK: tl.constexpr):
    """out[m, n] = Σ_s part[s, m, n], always in split order, so the result does not depend on which program
    finished first."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    tl.store(out_ptr + (offs // N) * stride_om + offs % N, acc.to(out_ptr.dtype.element_ty), mask=ok)


def block_m_for(m: int) -> int:
    """The M bucket: rows of the MMA's N side, a power of two ≥ 16 (the smallest tl.dot operand)."""
    return max(16, next_pow2(m))


def smem_bytes(cfg: SkinnyConfig, block_m: int, elem: int = 2) -> int:
    """Shared memory of the pipelined W and x tiles (what limits programs per SM)."""
    return cfg.num_stages * (cfg.block_n + block_m) * cfg.block_k * elem


# An SM holding more than its share of units can stream faster than the average SM (the HBM share of one SM is
# ~35 GB/s; a deep pipeline lets one SM pull more), so imbalance costs only past this factor. A guess.
SM_HEADROOM = 1.5


def _split_cost_us(n: int, k: int, m: int, block_n: int, split: int, sms: int) -> float:
    """Predicted µs of one split choice: the weight floor over SM balance (units per SM, the busiest SM against the
    mean, SM_HEADROOM allowed), plus the fp32 partials' L2 traffic and ~2 µs for the reduction launch when
    split > 1. Only a starting point; H200_CONFIGS is meant to hold measured choices."""
    units = triton.cdiv(n, block_n) * split
    balance = min(1.0, SM_HEADROOM * units / sms / triton.cdiv(units, sms))
    floor_us = 2 * n * k / HBM_TBPS / 1e6
    extra = 8 * split * m * n / (2 * n * k) if split > 1 else 0.0
    return floor_us * (1 + extra) / balance + (2.0 if split > 1 else 0.0)


def pick_split(n: int, k: int, m: int, block_n: int, block_k: int, sms: int = 132) -> int:
    """The split-K count with the lowest predicted cost, keeping ≥ 4 K chunks per split (pipeline depth)."""
    chunks = triton.cdiv(k, block_k)
    splits = [s for s in (1, 2, 3, 4, 6, 8, 12, 16) if chunks // s >= 4] or [1]
    return min(splits, key=lambda s: _split_cost_us(n, k, m, block_n, s, sms))


def with_split(n: int, k: int, m: int, tile: tuple[int, int, int, int], sms: int = 132) -> SkinnyConfig:
    """A tile (BLOCK_N, BLOCK_K, warps, stages) completed with pick_split and as many programs per SM (≤ 2) as
    fit in shared memory with room for the epilogue."""
    block_n, block_k, warps, stages = tile
    cfg = SkinnyConfig(block_n, block_k, warps, stages, pick_split(n, k, m, block_n, block_k, sms), 1)
    return cfg._replace(programs_per_sm=2 if 2 * smem_bytes(cfg, block_m_for(m)) <= 200 * 1024 else 1)


# Pre-measurement tiles per M bucket: BLOCK_N ≥ 2·BLOCK_M where it can (x re-read ≤ half the weight bytes), one
# warpgroup per 64 weight rows, ~80–100 KB of pipelined tiles so two programs share an SM.
DEFAULT_TILES = {16: (64, 128, 4, 4), 32: (128, 64, 8, 4), 64: (128, 64, 8, 4)}


def default_config(n: int, k: int, m: int, sms: int = 132) -> SkinnyConfig:
    block_n, block_k, warps, stages = DEFAULT_TILES[block_m_for(m)]
    tile = (min(block_n, max(16, next_pow2(n))), min(block_k, max(16, next_pow2(k))), warps, stages)
    return with_split(n, k, m, tile, sms)


# Keyed by (N, K, BLOCK_M), the Llama-3.1-8B projections. PREDICTED (default_config's choices), not yet measured:
# replace with the best per (shape, M bucket) from `python3 -m envex.kernels._bench_skinny` on the H200.
H200_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    (n, k, bm): default_config(n, k, bm)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
    for bm in (16, 32, 64)
}


def tuned_config(n: int, k: int, m: int) -> SkinnyConfig:
    return H200_CONFIGS.get((n, k, block_m_for(m))) or default_config(n, k, m)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, *, config: SkinnyConfig | None = None) -> torch.Tensor:
    """out [M, N] = x [M, K] @ w [N, K]^T in x's dtype, fp32 accumulation; deterministic (bit-identical run to
    run for a given config). For 1 ≤ M ≤ 64; larger batches belong to cuBLAS (x @ w.t())."""
    check_tensor("w", w, ndim=2, dtypes=DTYPES)
    n, k = w.shape
    check_tensor("x", x, ndim=2, dtypes=(w.dtype,), device=w.device)
    m = x.shape[0]
    check(x.shape[1] == k, f"x: last dim {x.shape[1]} != K = {k} of w [{n}, {k}]")
    check(1 <= m <= MAX_M, f"x: {m} rows; skinny_matmul takes 1..{MAX_M}, use x @ w.t() for larger batches")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    cfg = SkinnyConfig(*config) if config is not None else tuned_config(n, k, m)
    check(cfg.block_n >= 16 and cfg.block_k >= 16 and cfg.split_k >= 1 and cfg.programs_per_sm >= 0,
          f"config: {cfg} needs block_n, block_k ≥ 16 (tl.dot), split_k ≥ 1, programs_per_sm ≥ 0")  # fmt: skip
    if k == 0:
        return out.zero_()
    block_m = block_m_for(m)
    k_iters = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
    split = triton.cdiv(triton.cdiv(k, cfg.block_k), k_iters)  # no empty trailing slices
    n_units = triton.cdiv(n, cfg.block_n) * split
    programs = n_units if cfg.programs_per_sm == 0 else min(n_units, cfg.programs_per_sm * _sm_count(x.device))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _skinny_kernel[(programs,)](
        x, w, out, part, m, n, k, x.stride(0), w.stride(0), out.stride(0), k_iters, n_units, split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PARTIAL=split > 1, UPCAST_DOT=INTERPRETING,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](part, out, m, n, out.stride(0), split, BLOCK=block,
                                                         num_warps=4)  # fmt: skip
    return out
