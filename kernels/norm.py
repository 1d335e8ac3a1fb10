"""RMSNorm and fused residual-add + RMSNorm (HF Llama numerics), one program per token row.

Floor: memory. rms_norm reads x and writes y (2·T·H·bytes); add_rms_norm reads x and residual and writes
the normed row and the sum (4·T·H·bytes). Rows of a Llama model fit one program (H ≤ 16384 → ≤ 64 KB fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels import _common
from envex.kernels._common import FLOAT_DTYPES, check, check_tensor, next_pow2, pdl_enter, pdl_launch


@triton.jit
def plane_offsets(k, K):
    """Where input k of a row of K (a multiple of 8) sits in the plane layout: input c + 8j at c·(K/8) + j, so
    plane c holds inputs c, 8 + c, 16 + c, ... (the batch-1 MoE GEMV's input and activation layout)."""
    return (k % 8) * (K // 8) + k // 8


@triton.jit
def residual_sum(x, r):
    """x + r as HF adds them, in the activation dtype: added in fp32 and rounded once (what a bf16 add does on the
    GPU, and what the CPU interpreter gets right)."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def rms_normed(x, w, H, eps, out_dtype: tl.constexpr):
    """RMSNorm of one row x [BLOCK_H] (zeros past H) with weight w, rounded to out_dtype. HF casts x·rstd back to
    the input dtype before multiplying by the weight; that rounding step is kept. Every kernel that norms a row
    calls this, so their rows are bit-identical."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    return (normed * w.to(tl.float32)).to(out_dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, planes_ptr,
    H, stride_x, stride_res, stride_out, stride_sum, stride_planes, eps, stride_split,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, PLANES: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    SPLITS: tl.constexpr = 0, LATE: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL, LATE)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    if SPLITS > 0:  # x is a split-K product's float32 partials [SPLITS, T, H]: added in order to 0.0 (as
        # invariant_matmul's reduce kernel adds them, -0.0 included), rounded once
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(x_ptr + s * stride_split + row * stride_x + cols, mask=mask, other=0.0)
        x = acc.to(out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # HF adds in the activation dtype: the sum is rounded before the norm sees it
        x = residual_sum(x, tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0))
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    y = rms_normed(x, tl.load(w_ptr + cols, mask=mask, other=0.0), H, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if PLANES:  # also as float32 planes (plane_offsets: the MoE GEMV's input layout, moe_mxfp4)
        tl.store(planes_ptr + row * stride_planes + plane_offsets(cols, H), y.to(tl.float32), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check(weight.shape[0] == x.shape[1], f"weight: length {weight.shape[0]} != hidden size {x.shape[1]} of x")
    check(x.shape[1] <= 65536, f"x: hidden size {x.shape[1]} > 65536 is not supported by the one-row kernel")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        check(residual.shape == x.shape, f"residual: shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")


def _num_warps(block_h: int) -> int:
    # 8 bf16 per thread per 16-byte load; enough warps that each thread holds a few vectors at most.
    return max(1, min(16, block_h // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x[T,H], weight[H], eps) -> [T,H] in x's dtype."""
    _check(x, weight, None)
    out = torch.empty_like(x)
    _launch(x, None, weight, eps, out, out)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual); inputs untouched."""
    _check(x, weight, residual)
    out = torch.empty_like(x)
    total = torch.empty_like(x)
    _launch(x, residual, weight, eps, out, total)
    return out, total


def norm_planes(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rms_norm(x + residual), x + residual, the normed rows again as float32 planes) in one launch: the MoE
    GEMV's input layout (plane_offsets). residual None: x alone is normed and returned as the sum. pdl:
    programmatic dependent launch (waits on the previous kernel before reading)."""
    _check(x, weight, residual)
    check(x.shape[1] % 8 == 0, f"x: hidden size {x.shape[1]} must be a multiple of 8 for the plane layout")
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    planes = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _launch(x, residual, weight, eps, out, total, planes, pdl=pdl)
    return out, total, planes


def add_rms_norm_partials(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                          pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """add_rms_norm(x, residual, weight, eps) where x = Σ_s partials[s], a split-K product's float32 partials
    [S, T, H] summed in split order and rounded once to the residual's dtype: the split-K reduce, the residual add
    and the norm in one launch. -> (normed, x + residual); inputs untouched. pdl: programmatic dependent launch."""
    check_tensor("partials", partials, ndim=3, dtypes=(torch.float32,))
    check(partials.shape[0] >= 1, "partials: need at least one split, [S >= 1, T, H]")
    check_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES, device=partials.device)
    check(residual.shape == partials.shape[1:],
          f"residual: shape {tuple(residual.shape)} != the partials' rows {tuple(partials.shape[1:])}")  # fmt: skip
    _check(residual, weight, None)
    out = torch.empty_like(residual)
    total = torch.empty_like(residual)
    # between the split product and the next projection: the deterministic chain's short launch (_common.LATE_TRIGGER)
    _launch(partials, residual, weight, eps, out, total, pdl=pdl, late=_common.LATE_TRIGGER)
    return out, total


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor,
            total: torch.Tensor, planes: torch.Tensor | None = None, *, pdl: bool = False,
            late: bool = False) -> None:  # fmt: skip
    """One _rms_norm_kernel launch over x's rows ([T, H], or float32 split partials [S, T, H]): the residual added
    (and the sum stored in total) unless None, the normed rows also stored as planes unless None."""
    splits = x.shape[0] if x.dim() == 3 else 0
    rows = x[0] if splits else x
    if rows.shape[0] == 0:
        return
    block_h = next_pow2(rows.shape[1])
    has_res = residual is not None
    _rms_norm_kernel[(rows.shape[0],)](
        x, residual if has_res else x, weight, out, total, out if planes is None else planes, rows.shape[1],
        rows.stride(0), residual.stride(0) if has_res else 0, out.stride(0), total.stride(0) if has_res else 0,
        0 if planes is None else planes.stride(0), float(eps), x.stride(0) if splits else 0, HAS_RESIDUAL=has_res,
        BLOCK_H=block_h, PLANES=planes is not None, USE_PDL=pdl, num_warps=_num_warps(block_h), SPLITS=splits,
        LATE=pdl and late, **pdl_launch(pdl),
    )  # fmt: skip
