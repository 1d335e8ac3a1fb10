"""Residual add + RMSNorm folded into a projection of 2-16 rows: y = rms_norm(x + r) · w_norm @ W^T in one launch.

A step of a few rows (a batch-1 speculative verify step: k + 1 rows; decode of 2-16 sequences) ran the fused
Triton norm (one launch, ~2 µs, launch-bound) and then cuBLAS for QKV and gate-up: two launches per projection,
and the norm's is pure overhead at this size (kernels/NOTES.md, v18). Here each program owns BLOCK_N weight rows
and streams them along K in BLOCK_K chunks; with every chunk it loads the same K slice of the (few) input rows
from L2, adds the residual (the first program stores the sum, the new residual stream), accumulates each row's
sum of squares, scales by w_norm and multiplies on the tensor cores with the operands swapped, outᵀ [BLOCK_N,
BLOCK_M] = W [BLOCK_N, BLOCK_K] · ((x + r) · w_norm)ᵀ, so the weight rows fill the MMA's M side and the batch,
padded to 16, its N side (rows past M are masked, never loaded). The RMS scale is applied after the K loop,
y = rstd · Σ_k W[n,k]·h[k]·w_norm[k], as the chunked GEMV (gemv.py) applies it: one pass over K, so the
normalised row is not rounded to the activation dtype before the product as HF rounds it (the residual sum is).

Floor: the weight bytes (N·K·2), as cuBLAS's; the input rows are re-read from L2 by every program (M·K·4 bytes a
program: 10% of the weight bytes at M = 5, BLOCK_N = 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import INTERPRETING, check, check_tensor, next_pow2

DTYPES = (torch.bfloat16, torch.float16)
MIN_ROWS, MAX_ROWS = 2, 16  # one row takes the GEMV; more than 16, cuBLAS after the norm kernel
MAX_N = 32768  # QKV and gate-up; an LM head stays on cuBLAS (0.97 of the read bandwidth at M = 5 already)
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 4, 4  # the skinny GEMM's best tile at M = 2-16 (NOTES.md)


@triton.jit(do_not_specialize=["M"])
def _norm_matmul_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, bias_ptr, out_ptr, h_ptr,
    M, N, K, stride_xm, stride_rm, stride_wn, stride_om, stride_hm, eps,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    mm = tl.arange(0, BLOCK_M)
    m_ok = mm < M
    h_rows = tl.where(pid == 0, M, 0)  # the first program stores x + r (a bound: the interpreter wants no scalar masks)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + kk
        k_ok = cols < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + mm[:, None] * stride_xm + cols[None, :], mask=x_mask, other=0.0)
        if HAS_RES:  # the residual sum rounded to the activation dtype, as HF adds in it
            r = tl.load(r_ptr + mm[:, None] * stride_rm + cols[None, :], mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + mm[:, None] * stride_hm + cols[None, :], x, mask=x_mask & (mm < h_rows)[:, None])
        hf = x.to(tl.float32)
        ssq += tl.sum(hf * hf, axis=1)
        nw = tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        a = (hf * nw[None, :]).to(x.dtype)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        if UPCAST_DOT:
            w = w.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(w, tl.trans(a), acc)  # [BLOCK_N, BLOCK_M]
    rstd = tl.rsqrt(ssq / K + eps)
    y = acc * rstd[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + mm[None, :] * stride_om + rows[:, None], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & m_ok[None, :])  # fmt: skip


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether norm_matmul serves this projection (the rows, the width and the dtypes it is built for)."""
    return (MIN_ROWS <= x.shape[0] <= MAX_ROWS and weight.shape[0] <= MAX_N and x.dtype in DTYPES
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1)  # fmt: skip


def norm_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rms_norm(x + residual) · norm_weight @ weight^T (+ bias), x + residual) for x [M, K], 1 ≤ M ≤ 16, in x's
    dtype; residual None: x alone is normed and returned as the sum. Inputs untouched."""
    check_tensor("x", x, ndim=2, dtypes=DTYPES)
    m, k = x.shape
    dev = x.device
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=dev)
    n = weight.shape[0]
    check(weight.shape[1] == k, f"weight: {weight.shape[1]} columns for x's {k}")
    check(1 <= m <= MAX_ROWS, f"x: {m} rows; norm_matmul takes 1..{MAX_ROWS} (more: the norm kernel, then cuBLAS)")
    check_tensor("norm_weight", norm_weight, ndim=1, device=dev)
    check(norm_weight.shape[0] == k, f"norm_weight: {norm_weight.shape[0]} entries for hidden size {k}")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=dev)
        check(residual.shape == x.shape, f"residual: shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=dev)
        check(bias.shape[0] == n, f"bias: {bias.shape[0]} entries for {n} outputs")
    out = torch.empty((m, n), dtype=x.dtype, device=dev)
    total = torch.empty_like(x) if residual is not None else x
    if n == 0 or k == 0:
        return out.zero_(), (x if residual is None else torch.add(x, residual, out=total))
    _norm_matmul_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, residual if residual is not None else x, norm_weight, weight, bias if bias is not None else norm_weight,
        out, total, m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        out.stride(0), total.stride(0), float(eps),
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=max(16, next_pow2(m)), BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, UPCAST_DOT=INTERPRETING, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out, total
