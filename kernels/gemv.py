"""GEMV for decode (M = 1 row per program column): y = prologue(x) @ W^T with the weight read once at full bandwidth.

At batch 1 every projection is a matrix-vector product whose floor is reading W (N·K·2 bytes); cuBLAS reaches
~85% of the read bandwidth there, and each separate norm or activation kernel costs a launch boundary. So each
program owns BLOCK_N output rows, streams their K-long weight rows in BLOCK_K chunks (16-byte loads, coalesced
along K), and computes its input on the fly from the previous layer's outputs, which are tiny and sit in L2:

  PROLOGUE_NONE     x
  PROLOGUE_ADD_RMS  rms_norm(a + b) · w_norm, and a + b written once (by the first column of programs)
  PROLOGUE_RMS      rms_norm(a) · w_norm
  PROLOGUE_SILU_MUL silu(g) · u from a fused gate-up row [g | u]

Rounding follows HF transformers, the reference every answer is checked against: the residual sum, the SwiGLU
(silu's output and the product) and, in the persistent kernel, which holds the whole row, the normalised row and
its product with the norm weight are rounded to the activation dtype where HF rounds them. A near-tie in bf16
logits (SmolLM2 answers "The" or "L'" to "What is the capital of France?" 0.125 apart, one bf16 step at 25) then
falls the way HF's does (H200, 2026-11-30: the fp32 prologue answered "L'Étoile"). The chunked kernel streams K
once, so it applies the RMS scale after the dot, y = rstd · Σ_k W[n,k]·h[k]·w_norm[k], with the sum of squares
accumulated in the same pass, and cannot round the normalised row first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from envex.kernels._common import FLOAT_DTYPES, check, check_tensor, pdl_launch, round_as
from envex.kernels.activation import silu_mul_as_hf

PROLOGUE_NONE, PROLOGUE_ADD_RMS, PROLOGUE_RMS, PROLOGUE_SILU_MUL = 0, 1, 2, 3


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@triton.jit
def _gemv_kernel(
    a_ptr, b_ptr, nw_ptr, w_ptr, bias_ptr, out_ptr, h_ptr,
    N, stride_am, stride_bm, stride_wn, stride_om, stride_hm, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    kk = tl.arange(0, BLOCK_K)
    # The weight never depends on the previous kernel, so its first tile is requested before waiting on that
    # kernel (programmatic dependent launch), and each later tile one iteration ahead of its use. The weight is
    # streamed once per step: evict_first keeps it from pushing out the small activations other programs re-read.
    w_next = tl.load(w_rows + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0,
                     eviction_policy="evict_first")  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_next
        cols = k0 + kk
        k_ok = cols < K
        ahead = cols + BLOCK_K
        w_next = tl.load(w_rows + ahead[None, :], mask=row_ok[:, None] & (ahead < K)[None, :], other=0.0,
                         eviction_policy="evict_first")  # fmt: skip
        x = input_chunk(a_ptr, b_ptr, h_ptr, m * stride_am, m * stride_bm, m * stride_hm, cols, k_ok, K,
                        tl.where(pid_n == 0, K, 0), PROLOGUE)  # fmt: skip
        if PROLOGUE == 1 or PROLOGUE == 2:
            sumsq += x * x
            x = x * tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    if HAS_BIAS:  # Qwen2's QKV bias: added in fp32 before the one rounding, as cuBLAS's epilogue does
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def input_chunk(a_ptr, b_ptr, h_ptr, row_a, row_b, row_h, cols, k_ok, K, h_end, PROLOGUE: tl.constexpr):
    """The GEMV input at columns `cols` (any shape) in float32, before the norm weight: x, a + b (rounded as HF
    rounds the residual sum, and written to h at the columns below h_end) or silu(g) · u from the row [g | u]."""
    if PROLOGUE == 3:
        g = tl.load(a_ptr + row_a + cols, mask=k_ok, other=0.0)
        u = tl.load(a_ptr + row_a + K + cols, mask=k_ok, other=0.0)
        x = silu_mul_as_hf(g, u)
    else:
        a = tl.load(a_ptr + row_a + cols, mask=k_ok, other=0.0)
        if PROLOGUE == 1:
            bb = tl.load(b_ptr + row_b + cols, mask=k_ok, other=0.0)
            a = (a.to(tl.float32) + bb.to(tl.float32)).to(h_ptr.dtype.element_ty)  # HF rounds the sum
            tl.store(h_ptr + row_h + cols, a, mask=cols < h_end)
        x = a.to(tl.float32)
    return x


@triton.jit
def row_input(a_ptr, b_ptr, nw_ptr, h_ptr, row_a, row_b, row_h, kk, k_ok, h_end, eps, K: tl.constexpr,
              PROLOGUE: tl.constexpr):  # fmt: skip
    """A persistent GEMV program's whole input row (columns kk, k_ok masking K) in float32, its prologue applied
    (input_chunk's, then the norm). The whole row is in registers, so the norm is applied before the dot and
    rounded where HF rounds it: the normalised row to the activation dtype, then times the weight, rounded again."""
    x = input_chunk(a_ptr, b_ptr, h_ptr, row_a, row_b, row_h, kk, k_ok, K, h_end, PROLOGUE)
    if PROLOGUE == 1 or PROLOGUE == 2:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        w_norm = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        x = round_as(w_norm * round_as(x * rstd, a_ptr.dtype.element_ty), a_ptr.dtype.element_ty)
    return x


@triton.jit
def _gemv_persistent_kernel(
    a_ptr, b_ptr, nw_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, h_ptr,
    N, stride_am, stride_bm, stride_wn, stride_sn, stride_om, stride_hm, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_MODE: tl.constexpr,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """A fixed number of programs each computes the whole input row once (prologue included) and keeps it in
    registers while it streams BLOCK_N-row weight tiles, the next tile requested before the current is reduced.
    Unlike the chunked kernel, the activation (and the norm) is read and computed once per program, not once per
    BLOCK_N rows; K must fit one register tile (BLOCK_K = next power of two ≥ K).

    SCALE_MODE -1: a float weight. FP8 codes (kernels/quant_gemv.py) with s_ptr their scales: 0 one scale, 1 one a
    row (both times each row's sum), 2 one a SCALE_ROWS x SCALE_COLS block, multiplying the input for each tile (a
    tile's rows lie in one scale row: SCALE_ROWS % BLOCK_N == 0)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    m = tl.program_id(1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    rr = tl.arange(0, BLOCK_N)
    rows = pid * BLOCK_N + rr
    w_next = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                     mask=(rows < N)[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = row_input(a_ptr, b_ptr, nw_ptr, h_ptr, m * stride_am, m * stride_bm, m * stride_hm, kk, k_ok,
                  tl.where(pid == 0, K, 0), eps, K, PROLOGUE)  # fmt: skip
    n_blocks = tl.cdiv(N, BLOCK_N)
    for rb in range(pid, n_blocks, nprog):
        w = w_next
        ahead = (rb + nprog) * BLOCK_N + rr
        w_next = tl.load(w_ptr + ahead.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                         mask=(ahead < N)[:, None] & k_ok[None, :], other=0.0,
                         eviction_policy="evict_first")  # fmt: skip
        rows = rb * BLOCK_N + rr
        xs = x
        if SCALE_MODE == 2:
            s_row = s_ptr + (rb * BLOCK_N // SCALE_ROWS) * stride_sn  # scale rows x columns: far below 2^31
            xs = x * tl.load(s_row + kk // SCALE_COLS, mask=k_ok, other=0.0)
        y = tl.sum(w.to(tl.float32) * xs[None, :], axis=1)
        if SCALE_MODE == 1:
            y = y * tl.load(s_ptr + rows, mask=rows < N, other=0.0)
        if SCALE_MODE == 0:
            y = y * tl.load(s_ptr)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


# (BLOCK_N, BLOCK_K, num_warps[, programs_per_sm]): a 4th entry > 0 selects the persistent kernel with that many
# programs per SM (BLOCK_K is then the whole K). For the chunked kernel, small BLOCK_N gives many programs
# (≥ 4 per SM for N = 4096) so enough weight bytes are in flight per SM; 16-byte loads need
# BLOCK_K ≥ 8·32·num_warps/BLOCK_N elements per row chunk.
# Retuned on the H200 by verify/lab/kernel_bench/bench_h200.py; verify/lab/journal-kernels.md has the table.
DEFAULT_CONFIG = (8, 512, 4)
# Best measured on the H200 for the Llama-3.1-8B projections, keyed by (N, K, prologue): the bench_h200 sweep of
# 2026-11-29 at commit e2aed4e (verify/lab/journal-kernels.md); the O projection's persistent config from the `fused`
# section at commit 27ad50e (8.41 against 9.26 us chunked). A 4th entry selects the persistent kernel.
H200_CONFIGS: dict[tuple[int, int, int], tuple[int, ...]] = {
    (6144, 4096, PROLOGUE_ADD_RMS): (1, 0, 16, 4),
    (4096, 4096, PROLOGUE_NONE): (2, 0, 8, 4),
    (28672, 4096, PROLOGUE_ADD_RMS): (2, 0, 8, 4),
    (4096, 14336, PROLOGUE_SILU_MUL): (1, 0, 8, 2),
    # The down projections without a prologue (the SwiGLU a launch of its own since 57ee9e4) take the configs swept
    # with it, here and below: not yet swept without it (bench_h200's sweep now times them so).
    (4096, 14336, PROLOGUE_NONE): (1, 0, 8, 2),
    (128256, 4096, PROLOGUE_ADD_RMS): (2, 0, 8, 4),
    # One GPU's share under TP=2 (bench_h200 --shapes llama70b-tp2 / llama8b-tp2 --short, f0d3761): the 70B shape's
    # K = 8192 projections fell back to the chunked default (QKV 31.6 -> 22.7 us, gate-up 121.2 -> 108.2 us, LM
    # head share 262.9 -> 235.6 us).
    (5120, 8192, PROLOGUE_ADD_RMS): (2, 0, 16, 2),
    (8192, 4096, PROLOGUE_NONE): (2, 2048, 8),
    (28672, 8192, PROLOGUE_ADD_RMS): (2, 0, 16, 2),
    (8192, 14336, PROLOGUE_SILU_MUL): (1, 0, 8, 2),
    (8192, 14336, PROLOGUE_NONE): (1, 0, 8, 2),
    (64128, 8192, PROLOGUE_ADD_RMS): (2, 0, 16, 4),
    (3072, 4096, PROLOGUE_ADD_RMS): (1, 0, 4, 4),
    (4096, 2048, PROLOGUE_NONE): (2, 1024, 4),
    (4096, 7168, PROLOGUE_SILU_MUL): (2, 0, 16, 2),
    (4096, 7168, PROLOGUE_NONE): (2, 0, 16, 2),
    # gpt-oss-120b's QKV (K = 2880: the persistent kernel's register tile is 4096 wide; bench_h200 --shapes gpt-oss,
    # 9454f3c: the nearest 8B config gave 11.7 us). O: the persistent kernel, picked in the decode chain
    # (bench_gpt_oss --sections chain, d0d7626) over (2, 2048, 8), the best timed alone, and kept with the MoE's
    # ONE_LAUNCH_WARM = False on the served figure: 400.5 against 397.8 tok/s (verify/lab/journal-kernels.md).
    (5120, 2880, PROLOGUE_ADD_RMS): (2, 0, 8, 4),
    (2880, 4096, PROLOGUE_NONE): (2, 0, 8, 4),
}


def nearest_config(table: dict[tuple[int, int, Any], tuple[int, ...]], n: int, k: int,
                   tag: Any) -> tuple[int, tuple[int, ...]] | None:  # fmt: skip
    """(K, config) of the measured shape in `table` (keyed by (N, K, tag)) nearest to n x k by log N and log K among
    those with this tag (the shape itself where measured), or None where the tag has none."""
    same = [(abs(math.log(n / n2)) + abs(math.log(k / k2)), k2, cfg) for (n2, k2, t), cfg in table.items()
            if t == tag]  # fmt: skip
    return min(same)[1:] if same else None


def tuned_config(n: int, k: int, prologue: int) -> tuple[int, ...]:
    """The measured best config for this projection; for a shape never measured, that of the nearest measured
    shape with the same prologue (by log N and log K): the best config follows the shape's regime (how many
    programs N gives, whether K fits one register tile), not its exact size. A new architecture's projections
    (Qwen3-8B: 24576 x 4096, 4096 x 12288, 151936 x 4096) so start from the Llama-3.1-8B tuning
    (verify/lab/journal-kernels.md, v10)."""
    found = nearest_config(H200_CONFIGS, n, k, PROLOGUE_ADD_RMS if prologue == PROLOGUE_RMS else prologue)
    if found is None:
        return DEFAULT_CONFIG
    k2, cfg = found
    if len(cfg) > 3 and cfg[3] > 0 and triton.next_power_of_2(k) > triton.next_power_of_2(k2):
        return DEFAULT_CONFIG  # the persistent kernel holds all of K in registers: never past a measured width
    return cfg


def gemv(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    prologue: int = PROLOGUE_NONE,
    b: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [M,N] = prologue(a) @ weight[N,K]^T; returns (y, a + b) for PROLOGUE_ADD_RMS, else (y, None).

    a: [M,K] ([M,2K] for PROLOGUE_SILU_MUL); b: [M,K] (ADD_RMS); norm_weight: [K] (ADD_RMS, RMS); bias: [N], added
    to y before its rounding. Meant for small
    M (each row re-reads the weight, from L2 when M is small); use torch matmul for large M. pdl: launch with
    programmatic dependent launch (Hopper), so this kernel's weight stream overlaps the previous kernel's tail;
    only for a chain of kernels that all wait on their predecessor (the fused decode step).
    """
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    n, k = weight.shape
    check_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES, device=weight.device)
    want_k = 2 * k if prologue == PROLOGUE_SILU_MUL else k
    check(a.shape[1] == want_k, f"a: last dim {a.shape[1]} != {want_k} expected for weight [{n}, {k}]")
    check(prologue in (0, 1, 2, 3), f"prologue: unknown value {prologue}; use a PROLOGUE_* constant")
    if prologue == PROLOGUE_ADD_RMS:
        check(b is not None, "b: the residual is required for PROLOGUE_ADD_RMS")
        assert b is not None
        check_tensor("b", b, ndim=2, dtypes=(a.dtype,), device=a.device)
        check(b.shape == a.shape, f"b: shape {tuple(b.shape)} != a shape {tuple(a.shape)}")
    if prologue in (PROLOGUE_ADD_RMS, PROLOGUE_RMS):
        check(norm_weight is not None, "norm_weight: required for the RMS prologues")
        assert norm_weight is not None
        check_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=a.device)
        check(norm_weight.shape[0] == k, f"norm_weight: length {norm_weight.shape[0]} != K = {k}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=a.device)
        check(bias.shape[0] == n, f"bias: length {bias.shape[0]} != N = {n}")
    m = a.shape[0]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    h = torch.empty((m, k), dtype=a.dtype, device=a.device) if prologue == PROLOGUE_ADD_RMS else out
    if m == 0 or n == 0:
        return out, (h if prologue == PROLOGUE_ADD_RMS else None)
    bb = b if b is not None else a
    nw = norm_weight if norm_weight is not None else weight
    bias_arg = bias if bias is not None else weight  # never read when HAS_BIAS is off
    block_n, block_k, num_warps, *rest = config or tuned_config(n, k, prologue)
    if rest and rest[0] > 0:
        programs = min(triton.cdiv(n, block_n), rest[0] * _sm_count(a.device))
        _gemv_persistent_kernel[(programs, m)](
            a, bb, nw, weight, weight, bias_arg, out, h, n, a.stride(0), bb.stride(0), weight.stride(0), 0,
            out.stride(0), h.stride(0), float(eps), K=k, PROLOGUE=prologue, HAS_BIAS=bias is not None,
            SCALE_MODE=-1, SCALE_ROWS=1, SCALE_COLS=1, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k),
            USE_PDL=pdl, num_warps=num_warps, **pdl_launch(pdl),
        )  # fmt: skip
        return out, (h if prologue == PROLOGUE_ADD_RMS else None)
    block_k = min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n), m)](
        a, bb, nw, weight, bias_arg, out, h, n, a.stride(0), bb.stride(0), weight.stride(0), out.stride(0),
        h.stride(0), float(eps), K=k, PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, USE_PDL=pdl, num_warps=num_warps,
        **pdl_launch(pdl),
    )  # fmt: skip
    return out, (h if prologue == PROLOGUE_ADD_RMS else None)
