"""Weight-only GEMM on packed low-bit weights (kernels/quant.py) for more rows than the GEMV serves: y = x @ W^T.

Past quant_gemv.GEMV_MAX_ROWS rows the GEMV's one pass over the weight per row no longer pays, and dequantizing
the whole weight to bf16 for each call writes and re-reads every weight in bf16 (more bytes than serving bf16).
This kernel reads the packed tiles as they are stored (FP8: one byte a weight; INT4: a word of 8 plus the group's
scale and zero), widens them to the activation dtype in registers and multiplies on the tensor cores with float32
accumulation (the idea of moe_mxfp4's grouped kernels and of Marlin, Frantar et al. 2024, without its reordered
layout). The unpacking is the GEMV's (quant_gemv's `_stream_tile`, `_fp8_block_scale`, `_int4_codes`), so both
read one layout one way.

  FP8: the e4m3 codes are exact in bf16/fp16. A channel or tensor scale multiplies the float32 accumulator once
    at the end (the codes enter the dot unscaled); a block scale (rows x cols per scale, BLOCK_K dividing the
    block's columns: one scale a row of a tile) multiplies the widened tile before its dot, as quant.dequantize
    defines the weight (one rounding to the activation dtype, as the torch backend's dequantized weight).
  INT4: (u - zero) · scale per weight before the dot (one rounding, as above); where the group is a whole number
    of K tiles the scale and zero are one load a row and tile, else one a word.

Operand order ("swap AB"): the program computes the [BLOCK_N, BLOCK_M] tile W_tile @ x_tile^T, so the weight
rows are the MMA's M side (Hopper's wgmma needs 64 there, and takes that operand from registers, where the
dequantized tile already is) and the 9-64 activation rows its N side (8 to 256), and stores it transposed.

Tiles: `gemm_config`, a small table chosen before any GPU timing (the reasons beside it), and split-K: a long
row of inputs is shared by several programs, whose float32 partial sums are added after.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from envex.kernels import quant_gemv
from envex.kernels._common import INTERPRETING, check, exact_dot
from envex.kernels.gemv import PROLOGUE_NONE, _sm_count
from envex.kernels.quant import FP8_BLOCK, INT4_GROUP, PACK, PackedWeight, dequantize
from envex.kernels.quant_gemv import (
    _SCALE_MODE,
    GEMV_MAX_ROWS,
    _check_inputs,
    _fp8_block_scale,
    _int4_codes,
    _stream_tile,
)

_INT4_MODE = 3  # SCHEME beside quant_gemv's _SCALE_MODE (0 tensor, 1 channel, 2 block)


class GemmTiles(NamedTuple):
    """One launch's tiles: BLOCK_M activation rows, BLOCK_N outputs, BLOCK_K inputs a step (powers of two >= 16),
    num_warps, and split: the programs sharing one output tile's inputs (split-K; 1 writes y directly)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    split: int = 1


# Programs a launch aims for, per SM, before it splits the inputs; and the fewest BLOCK_K steps a split keeps.
_PROGRAMS_PER_SM = 2
_MIN_SPLIT_STEPS = 8


def gemm_config(m: int, n: int, k: int, scheme: str, sms: int) -> GemmTiles:
    """The tiles for m activation rows, n outputs, k inputs and a weight scheme on a device of `sms` SMs, from the
    first sweep of tiles and splits on a GPU (one H100, `bench_quant_gemm --sweep`, Llama-3.1-8B's four projections
    at 16 and 64 rows; verify/lab/journal-kernels.md, 2026-12-07).
    BLOCK_M: the rows rounded up to a power of two in 16..64 (wgmma's N side: 9-64 rows pay for at most twice
    their count; more rows take several 64-row tiles, which re-read each weight tile from L2, not HBM, as the row
    tiles of one weight tile are adjacent program ids). FP8: 64 outputs x 128 inputs a tile (the 128-column scale
    block: one scale a row and tile), best or within 5% of the best at six of the eight points; INT4: 128 x 64,
    best at seven of eight. Split: the inputs are split until the launch has _PROGRAMS_PER_SM programs an SM,
    keeping at least _MIN_SPLIT_STEPS steps a split (one program streaming a whole row of K was latency-bound: the
    down projection took 2.2-6x bf16's time); the float32 partial sums are added once after (deterministic order).
    Two programs an SM, not the four first guessed. The sweep's times of these tiles against the first defaults, a
    layer's four projections: FP8 at 16 rows 152 -> 115 us (gate-up 80 -> 51), at 64 rows 211 -> 175; INT4 at 16
    rows 245 -> about 230, at 64 rows 326 -> about 305 (gate-up's split of 2 was not in the sweep's grid)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k = (128, 64) if scheme == INT4_GROUP else (64, 128)
    tiles, steps = triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = 1
    while tiles * split < _PROGRAMS_PER_SM * sms and steps // (2 * split) >= _MIN_SPLIT_STEPS:
        split *= 2
    return GemmTiles(block_m, block_n, block_k, 4, split)


@triton.jit
def _quant_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_os, split_len,
    K: tl.constexpr, SCHEME: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M rows, BLOCK_N outputs] tile of y = x @ W^T (+ bias) over the inputs of split pid_k
    ([pid_k · split_len, + split_len), split_len a multiple of BLOCK_K), stored at out_ptr + pid_k · stride_os
    (one split: y itself; several: float32 partial sums, the bias in split 0's). SCHEME: 0 fp8 one scale, 1 fp8 a
    scale per row, 2 fp8 a scale per SCALE_ROWS x SCALE_COLS block (BLOCK_K | SCALE_COLS), 3 int4 in groups of
    GROUP inputs. UPCAST_DOT: float32 operands (the interpreter, whose bf16 dot multiplies raw bits; _common)."""
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run side by side and share it in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_begin = pid_k * split_len
    k_end = tl.minimum(k_begin + split_len, K)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = outputs
    row_ok = rows < N
    rows64 = rows.to(tl.int64)[:, None]
    w_rows = w_ptr + rows64 * stride_wn
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    kk = tl.arange(0, BLOCK_K)
    BW: tl.constexpr = BLOCK_K // 8  # INT4 words a row and tile
    KW: tl.constexpr = (K + 7) // 8  # INT4 words a row
    dt = tl.float32 if UPCAST_DOT else x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        cols = k0 + kk
        x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if SCHEME == 3:
            wc = k0 // 8 + tl.arange(0, BW)
            words = _stream_tile(w_rows, wc, row_ok, KW, 0)  # [BLOCK_N, BW]; a padding nibble meets a masked x
            if GROUP % BLOCK_K == 0:  # the tile lies in one group: its scale and zero once a row
                uz, s = _int4_codes(words, s_ptr, z_ptr, rows64, k0 // GROUP, row_ok[:, None], stride_sn, stride_zn,
                                    HAS_ZERO)  # fmt: skip
            else:
                uz, s = _int4_codes(words, s_ptr, z_ptr, rows64, (wc // (GROUP // 8))[None, :],
                                    row_ok[:, None] & (wc < KW)[None, :], stride_sn, stride_zn, HAS_ZERO)  # fmt: skip
            w = tl.reshape(uz * s[:, :, None], [BLOCK_N, BLOCK_K]).to(dt)  # nibble j of word c: input 8c + j
        else:
            w = _stream_tile(w_rows, cols, row_ok, K, 0.0)  # [BLOCK_N, BLOCK_K] e4m3 codes
            if SCHEME == 2:
                sc = _fp8_block_scale(s_ptr, rows, row_ok, k0, stride_sn, SCALE_ROWS, SCALE_COLS)
                w = (w.to(tl.float32) * sc[:, None]).to(dt)
            else:
                w = w.to(dt)
        acc += exact_dot(w, tl.trans(x.to(dt)))  # [BLOCK_N, BLOCK_M]
    if SCHEME == 1:
        acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if SCHEME == 0:
        acc = acc * tl.load(s_ptr)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + ms.to(tl.int64)[None, :] * stride_om + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


def quant_gemm(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *,
               config: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """y [M, N] = x [M, K] @ dequantize(weight)^T (+ bias [N]) in x's dtype (bf16, fp16 or float32), for any M
    (meant for M > GEMV_MAX_ROWS). config: GemmTiles or its first four fields (default gemm_config); BLOCK_K is
    capped at an fp8_block weight's block columns, and a split's inputs are whole BLOCK_K steps."""
    n, k = weight.shape
    device = weight.data.device
    _check_inputs(x, n, k, PROLOGUE_NONE, None, None, bias, device)
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0:
        return out
    tiles = GemmTiles(*config) if config is not None else gemm_config(m, n, k, weight.scheme, _sm_count(device))
    check(all(b >= 16 and b & (b - 1) == 0 for b in tiles[:3]) and tiles.split >= 1,
          f"config: {tuple(config or ())} must be BLOCK_M, BLOCK_N, BLOCK_K (powers of two >= 16), num_warps and "
          "a split >= 1")  # fmt: skip
    block_k = tiles.block_k
    scale_rows, scale_cols = weight.block if weight.scheme == FP8_BLOCK else (1, 1)
    if weight.scheme == FP8_BLOCK:
        check(scale_cols >= 16 and scale_cols & (scale_cols - 1) == 0,
              f"weight: fp8_block columns {scale_cols} must be a power of two >= 16 for the GEMM")  # fmt: skip
        block_k = min(block_k, scale_cols)  # one block scale a row of a tile
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    split_len = triton.cdiv(triton.cdiv(k, block_k), tiles.split) * block_k
    split = triton.cdiv(k, split_len)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=device)
    is_int4 = weight.scheme == INT4_GROUP
    z = weight.zero if weight.zero is not None else weight.scale  # never read without HAS_ZERO
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    _quant_gemm_kernel[grid](
        x, weight.data, weight.scale, z, bias if bias is not None else x, target, m, n, x.stride(0),
        weight.data.stride(0), weight.scale.stride(0), z.stride(0), n, m * n, split_len, K=k,
        SCHEME=_INT4_MODE if is_int4 else _SCALE_MODE[weight.scheme], SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols,
        GROUP=weight.group if is_int4 else PACK, HAS_ZERO=weight.zero is not None, HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, UPCAST_DOT=INTERPRETING,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return out if split == 1 else target.sum(dim=0).to(x.dtype)


# Past this many rows (prefill chunks) the weight is dequantized once for the call and multiplied by cuBLAS, as
# before the GEMM existed. Measured on an H100 (bench_quant_gemm, Llama-3.1-8B's four projections, FP8 block and
# channel, INT4 g128; verify/lab/results/h100-2026-12-06-338a41a-quant-gemm.json): the GEMM is faster at every row
# count measured, 9 to 2048 (1.07-1.33x at 2048, where the gap closes); nothing is measured past 2048.
GEMM_MAX_ROWS = 2048


def quant_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantize(weight)^T (+ bias) in x's dtype, the plain projection: the packed GEMV up
    to GEMV_MAX_ROWS rows, the packed GEMM up to GEMM_MAX_ROWS, past them the weight dequantized and a matmul."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return quant_gemv.quant_gemv(x, weight, bias=bias)[0]
    if x.shape[0] <= GEMM_MAX_ROWS:
        return quant_gemm(x, weight, bias)
    return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)
