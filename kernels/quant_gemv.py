"""GEMV for decode on packed low-bit weights (kernels/quant.py): y = prologue(x) @ W^T, W dequantized in registers.

At batch 1 a projection's time is the bytes of its weight, so the packed weight is streamed as it is stored (FP8:
one byte per weight, INT4: half a byte plus its group's scale and zero) and turned into float32 only in registers;
the sums are float32. The layout of the work is kernels/gemv.py's chunked kernel: a program owns BLOCK_N output
rows, streams their packed rows in BLOCK_K-input chunks with the next chunk requested before the current one is
used, and computes its input from the previous layer's outputs on the fly (the same PROLOGUE_* values, the same
rounding: the residual sum and SwiGLU as HF rounds them, the RMS scale applied after the dot).

  FP8 (fp8_block, fp8_channel, fp8_tensor): a [BLOCK_N, BLOCK_K] tile of e4m3 codes. A block scale multiplies
    the tile before the sum (BLOCK_K divides the block's columns, so one scale per row of a tile); a channel or
    tensor scale multiplies each row's finished sum.
  INT4 (int4_group): a [BLOCK_N, BLOCK_K/8] tile of int32 words, each split into its 8 nibbles ([.., .., 8],
    nibble j = input 8c + j, the internal layout), (u - zero) summed against the input per word, then times the
    word's group scale (a group is a whole number of words).

Rows: each row of `a` is one program column and re-reads the weight (from L2 when the rows are few); meant for up
to GEMV_MAX_ROWS rows. Past that, kernels/quant_gemm.py's GEMM reads the same packing once per tile of rows
(`quant_gemm.quant_linear` picks between the two).
Configs are untuned (no GPU measurement yet): DEFAULT_CONFIGS says why each was picked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import FLOAT_DTYPES, check, check_tensor, pdl_enter, pdl_launch
from envex.kernels.gemv import PROLOGUE_ADD_RMS, PROLOGUE_NONE, PROLOGUE_RMS, PROLOGUE_SILU_MUL, _silu_mul_as_hf
from envex.kernels.quant import FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, INT4_GROUP, PACK, PackedWeight

GEMV_MAX_ROWS = 8  # rows up to which the packed projections use the GEMV; past it, quant_gemm's GEMM
_SCALE_MODE = {FP8_TENSOR: 0, FP8_CHANNEL: 1, FP8_BLOCK: 2}
# (BLOCK_N, BLOCK_K, num_warps) per scheme, before any GPU measurement. FP8: 8 x 512 one-byte codes over 128
# threads is 32 bytes a thread (two 16-byte loads); a block scale caps BLOCK_K at the block's 128 columns, so
# BLOCK_N doubles to keep 16 bytes a thread. INT4: 8 rows x 512 inputs = 8 x 64 words, 16 bytes a thread.
DEFAULT_CONFIGS: dict[str, tuple[int, int, int]] = {
    FP8_BLOCK: (16, 128, 4),
    FP8_CHANNEL: (8, 512, 4),
    FP8_TENSOR: (8, 512, 4),
    INT4_GROUP: (8, 512, 4),
}


@triton.jit
def _input_chunk(a_ptr, b_ptr, h_ptr, row_a, row_b, row_h, cols, k_ok, K, h_end, PROLOGUE: tl.constexpr):
    """The GEMV input at columns `cols` (any shape) in float32, before the norm weight: x, a + b (written to h by
    h at the columns below h_end, rounded as HF rounds the residual sum) or silu(g) · u from the row [g | u]."""
    if PROLOGUE == 3:
        g = tl.load(a_ptr + row_a + cols, mask=k_ok, other=0.0)
        u = tl.load(a_ptr + row_a + K + cols, mask=k_ok, other=0.0)
        x = _silu_mul_as_hf(g, u)
    else:
        a = tl.load(a_ptr + row_a + cols, mask=k_ok, other=0.0)
        if PROLOGUE == 1:
            bb = tl.load(b_ptr + row_b + cols, mask=k_ok, other=0.0)
            a = (a.to(tl.float32) + bb.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row_h + cols, a, mask=cols < h_end)
        x = a.to(tl.float32)
    return x


@triton.jit
def _stream_tile(w_rows, cols, row_ok, limit, other):
    """The weight tile of rows w_rows [BLOCK_N, 1] at columns cols < limit: streamed once per step, so evict_first
    keeps it from pushing out the small activations other programs re-read."""
    return tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < limit)[None, :], other=other,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _fp8_block_scale(s_ptr, rows, row_ok, k0, stride_sn, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr):
    """fp8_block: the scale of rows `rows` [R] at input k0 -> float32 [R] (a tile of up to SCALE_COLS inputs
    starting at a multiple of its width lies in one block column)."""
    return tl.load(s_ptr + (rows // SCALE_ROWS) * stride_sn + k0 // SCALE_COLS, mask=row_ok, other=0.0)


TWO_23_BITS = tl.constexpr(0x4B000000)  # the float32 2^23: an integer below 2^23 OR-ed into it is added exactly
TWO_23 = tl.constexpr(8388608.0)


@triton.jit
def int4_nibbles(words):
    """int32 words [R, C] -> their 4-bit codes u [R, C, 8] in 0..15 (int32), nibble j of word c = input 8c + j."""
    return (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # & 0xF: >> sign-fills


@triton.jit
def _int4_codes(words, s_ptr, z_ptr, rows64, grp, ok, stride_sn, stride_zn, HAS_ZERO: tl.constexpr):
    """int4_group words [R, C] (int32, 8 inputs each, nibble j = input 8c + j) with their groups grp (any shape
    broadcasting against [R, C]; ok masks it) -> ((u - zero) [R, C, 8], scale [R, C]) in float32; no zero: 8.
    Callers apply the scale where it costs least (the GEMV per word's sum, the GEMM per weight before its dot).
    Each code becomes a float without an int-to-float conversion (a quarter-rate instruction on Hopper, one per
    weight): OR-ed into the mantissa of 2^23 it is the float 2^23 + u, and 2^23 + zero is subtracted (both exact),
    as Marlin and the LUT-free dequantizers do."""
    u = (int4_nibbles(words) | TWO_23_BITS).to(tl.float32, bitcast=True)  # 2^23 + u
    s = tl.load(s_ptr + rows64 * stride_sn + grp, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + rows64 * stride_zn + grp, mask=ok, other=0).to(tl.float32) + TWO_23
    else:
        z = tl.full(s.shape, TWO_23 + 8.0, dtype=tl.float32)
    return u - z[:, :, None], s


@triton.jit
def _fp8_gemv_kernel(
    a_ptr, b_ptr, nw_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, h_ptr,
    N, stride_am, stride_bm, stride_wn, stride_sn, stride_om, stride_hm, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_MODE: tl.constexpr,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """SCALE_MODE 0: one scale; 1: one per row; 2: one per SCALE_ROWS x SCALE_COLS block (BLOCK_K | SCALE_COLS)."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    kk = tl.arange(0, BLOCK_K)
    w_next = _stream_tile(w_rows, kk, row_ok, K, 0.0)  # requested before waiting on the previous kernel (PDL)
    pdl_enter(USE_PDL, False)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_next
        cols = k0 + kk
        k_ok = cols < K
        ahead = cols + BLOCK_K
        w_next = _stream_tile(w_rows, ahead, row_ok, K, 0.0)
        x = _input_chunk(a_ptr, b_ptr, h_ptr, m * stride_am, m * stride_bm, m * stride_hm, cols, k_ok, K,
                         tl.where(pid_n == 0, K, 0), PROLOGUE)  # fmt: skip
        if PROLOGUE == 1 or PROLOGUE == 2:
            sumsq += x * x
            x = x * tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        wf = w.to(tl.float32)
        if SCALE_MODE == 2:
            wf = wf * _fp8_block_scale(s_ptr, rows, row_ok, k0, stride_sn, SCALE_ROWS, SCALE_COLS)[:, None]
        acc += wf * x[None, :]
    y = tl.sum(acc, axis=1)
    if SCALE_MODE == 1:
        y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if SCALE_MODE == 0:
        y = y * tl.load(s_ptr)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _int4_gemv_kernel(
    a_ptr, b_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, h_ptr,
    N, stride_am, stride_bm, stride_wn, stride_sn, stride_zn, stride_om, stride_hm, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """W[n, 8c + j] = (nibble j of word [n, c] - zero[n, g]) · scale[n, g], g = 8c // GROUP; no zero: 8."""
    BW: tl.constexpr = BLOCK_K // 8  # words per row and chunk
    KW: tl.constexpr = (K + 7) // 8  # words per row
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)[:, None]
    w_rows = w_ptr + rows64 * stride_wn
    cw = tl.arange(0, BW)
    w_next = _stream_tile(w_rows, cw, row_ok, KW, 0)
    pdl_enter(USE_PDL, False)
    acc = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
    sumsq = tl.zeros([BW, 8], dtype=tl.float32)
    for w0 in range(0, KW, BW):
        words = w_next
        wc = w0 + cw  # this chunk's word columns [BW]
        w_ok = row_ok[:, None] & (wc < KW)[None, :]
        ahead = wc + BW
        w_next = _stream_tile(w_rows, ahead, row_ok, KW, 0)
        cols = wc[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BW, 8]: input 8c + j
        k_ok = cols < K
        x = _input_chunk(a_ptr, b_ptr, h_ptr, m * stride_am, m * stride_bm, m * stride_hm, cols, k_ok, K,
                         tl.where(pid_n == 0, K, 0), PROLOGUE)  # fmt: skip
        if PROLOGUE == 1 or PROLOGUE == 2:
            sumsq += x * x
            x = x * tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        grp = wc // (GROUP // 8)
        uz, s = _int4_codes(words, s_ptr, z_ptr, rows64, grp[None, :], w_ok, stride_sn, stride_zn, HAS_ZERO)
        # Σ_j (u - z)·x_j per word ([BLOCK_N, BW, 8] summed over j), then one multiply by the word's group scale.
        acc += tl.sum(uz * x[None, :, :], axis=2) * s
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * tl.rsqrt(tl.sum(tl.sum(sumsq, axis=1), axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def _check_inputs(a: torch.Tensor, n: int, k: int, prologue: int, b: torch.Tensor | None,
                  norm_weight: torch.Tensor | None, bias: torch.Tensor | None,
                  device: torch.device) -> None:  # fmt: skip
    """One line naming the first input that does not fit a GEMV over a weight of shape [n, k] with `prologue`."""
    check(prologue in (PROLOGUE_NONE, PROLOGUE_ADD_RMS, PROLOGUE_RMS, PROLOGUE_SILU_MUL),
          f"prologue: unknown value {prologue}; use a PROLOGUE_* constant from kernels.gemv")  # fmt: skip
    check_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    width = 2 * k if prologue == PROLOGUE_SILU_MUL else k
    check(a.shape[1] == width, f"a: last dim {a.shape[1]} != {width} expected for weight [{n}, {k}]")
    needs = {"b": prologue == PROLOGUE_ADD_RMS, "norm_weight": prologue in (PROLOGUE_ADD_RMS, PROLOGUE_RMS)}
    for name, t, shape in (("b", b, tuple(a.shape)), ("norm_weight", norm_weight, (k,)), ("bias", bias, (n,))):
        if t is None:
            check(not needs.get(name, False), f"{name}: required for prologue {prologue}")
            continue
        check_tensor(name, t, ndim=len(shape), dtypes=(a.dtype,) if name == "b" else FLOAT_DTYPES, device=device)
        check(tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)} != {shape} expected")


def quant_gemv(
    a: torch.Tensor,
    weight: PackedWeight,
    *,
    prologue: int = PROLOGUE_NONE,
    b: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [M, N] = prologue(a) @ dequantize(weight)^T, in a's dtype; returns (y, a + b) for PROLOGUE_ADD_RMS, else
    (y, None). The arguments are kernels.gemv.gemv's (a: [M, K], or [M, 2K] for PROLOGUE_SILU_MUL; b, norm_weight,
    bias, pdl), the weight a PackedWeight of any scheme. config: (BLOCK_N, BLOCK_K, num_warps), powers of two,
    BLOCK_K >= 8 (INT4: a multiple of 8 inputs); for fp8_block it is capped at the block's columns."""
    n, k = weight.shape
    device = weight.data.device
    _check_inputs(a, n, k, prologue, b, norm_weight, bias, device)
    m = a.shape[0]
    out = torch.empty((m, n), dtype=a.dtype, device=device)
    h = torch.empty((m, k), dtype=a.dtype, device=device) if prologue == PROLOGUE_ADD_RMS else out
    extra = h if prologue == PROLOGUE_ADD_RMS else None
    if m == 0:
        return out, extra
    block_n, block_k, num_warps = config or DEFAULT_CONFIGS[weight.scheme]
    check(block_n & (block_n - 1) == 0 and block_k >= 8 and block_k & (block_k - 1) == 0,
          f"config: {config} must be powers of two (BLOCK_N, BLOCK_K >= 8, num_warps)")  # fmt: skip
    block_k = min(block_k, max(8, triton.next_power_of_2(k)))
    bb = b if b is not None else a
    nw = norm_weight if norm_weight is not None else a  # never read without an RMS prologue
    bias_arg = bias if bias is not None else a  # never read when HAS_BIAS is off
    common = dict(K=k, PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=block_n, USE_PDL=pdl,
                  num_warps=num_warps, **pdl_launch(pdl))  # fmt: skip
    grid = (triton.cdiv(n, block_n), m)
    if weight.scheme == INT4_GROUP:
        z = weight.zero if weight.zero is not None else weight.scale  # never read without HAS_ZERO
        _int4_gemv_kernel[grid](
            a, bb, nw, weight.data, weight.scale, z, bias_arg, out, h, n, a.stride(0), bb.stride(0),
            weight.data.stride(0), weight.scale.stride(0), z.stride(0), out.stride(0), h.stride(0), float(eps),
            HAS_ZERO=weight.zero is not None, GROUP=weight.group, BLOCK_K=max(block_k, PACK), **common,
        )  # fmt: skip
        return out, extra
    scale_rows, scale_cols = weight.block if weight.scheme == FP8_BLOCK else (1, 1)
    if weight.scheme == FP8_BLOCK:
        check(scale_cols & (scale_cols - 1) == 0, f"weight: block columns {scale_cols} must be a power of two")
        block_k = min(block_k, scale_cols)  # one block scale per row of a tile
    _fp8_gemv_kernel[grid](
        a, bb, nw, weight.data, weight.scale, bias_arg, out, h, n, a.stride(0), bb.stride(0), weight.data.stride(0),
        weight.scale.stride(0), out.stride(0), h.stride(0), float(eps), SCALE_MODE=_SCALE_MODE[weight.scheme],
        SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, BLOCK_K=block_k, **common,
    )  # fmt: skip
    return out, extra
