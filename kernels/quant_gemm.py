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

W8A8 (`fp8_gemm`, FP8 weights only; not dispatched by quant_linear until a GPU has measured it): the activations
are quantized too (`fp8_act_quant`: e4m3 per row and group of 128 inputs, DeepSeek-V3's 1 x 128 activation tiles)
and each BLOCK_K step (= the group) multiplies two e4m3 tiles on Hopper's FP8 tensor cores (wgmma ...e4m3.e4m3, at
twice bf16's rate), its float32 result promoted into the float32 accumulator times the step's activation scales
(and fp8_block's weight scales). Hopper's FP8 MMA keeps only about 14 bits of its running sum, so a sum over all of
K inside the tensor core loses precision; adding each 128-input partial into a float32 accumulator (CUDA cores)
bounds that, as DeepSeek-V3's report (section 3.3.2) and DeepGEMM do. The W8A16 path above is unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from envex.kernels import quant_gemv
from envex.kernels._common import FLOAT_DTYPES, INTERPRETING, check, check_tensor, exact_dot, round_as
from envex.kernels.gemv import PROLOGUE_NONE, _sm_count
from envex.kernels.quant import FP8_BLOCK, FP8_CHANNEL, FP8_MAX, FP8_TENSOR, INT4_GROUP, PACK, PackedWeight, dequantize
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
def _tile(M, N, K, split_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Both GEMMs' program -> (its split pid_k, the split's inputs [k_begin, k_end), its BLOCK_N weight rows and
    BLOCK_M activation rows with their masks). Program axis 0 is fastest: the row tiles of one weight tile run side
    by side and share it in L2."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_begin = pid_k * split_len
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = outputs
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_k, k_begin, tl.minimum(k_begin + split_len, K), rows, rows < N, ms, ms < M


@triton.jit
def _store_tile(acc, s_ptr, bias_ptr, out_ptr, rows, row_ok, ms, m_ok, pid_k, stride_om, stride_os,
                SCHEME: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Both GEMMs' epilogue: the float32 [BLOCK_N, BLOCK_M] tile times an fp8 channel (SCHEME 1) or tensor (0)
    scale, plus the bias in split 0, stored transposed at split pid_k's slice of out."""
    if SCHEME == 1:
        acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if SCHEME == 0:
        acc = acc * tl.load(s_ptr)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + ms.to(tl.int64)[None, :] * stride_om + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


@triton.jit
def _int4_tile(w_rows, rows64, row_ok, k0, s_ptr, z_ptr, stride_sn, stride_zn, K: tl.constexpr, GROUP: tl.constexpr,
               HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The int4_group weight tile of rows w_rows [BLOCK_N, 1] at inputs k0 .. k0 + BLOCK_K: (u - zero) · scale in
    float32 [BLOCK_N, BLOCK_K] (nibble j of word c: input 8c + j; inputs past K hold no weight: the GEMM multiplies
    them by a masked 0, the dequantize pass does not store them). Where the tile lies in one group its scale and
    zero are one load a row, else one a word."""
    KW: tl.constexpr = (K + 7) // 8  # INT4 words a row
    wc = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = _stream_tile(w_rows, wc, row_ok, KW, 0)  # [BLOCK_N, BLOCK_K // 8]
    if GROUP % BLOCK_K == 0:
        uz, s = _int4_codes(words, s_ptr, z_ptr, rows64, k0 // GROUP, row_ok[:, None], stride_sn, stride_zn,
                            HAS_ZERO)  # fmt: skip
    else:
        uz, s = _int4_codes(words, s_ptr, z_ptr, rows64, (wc // (GROUP // 8))[None, :],
                            row_ok[:, None] & (wc < KW)[None, :], stride_sn, stride_zn, HAS_ZERO)  # fmt: skip
    return tl.reshape(uz * s[:, :, None], [BLOCK_N, BLOCK_K])


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
    pid_k, k_begin, k_end, rows, row_ok, ms, m_ok = _tile(M, N, K, split_len, BLOCK_M, BLOCK_N)
    rows64 = rows.to(tl.int64)[:, None]
    w_rows = w_ptr + rows64 * stride_wn
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    kk = tl.arange(0, BLOCK_K)
    dt = tl.float32 if UPCAST_DOT else x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        cols = k0 + kk
        x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if SCHEME == 3:  # a padding nibble meets a masked x
            w = _int4_tile(w_rows, rows64, row_ok, k0, s_ptr, z_ptr, stride_sn, stride_zn, K, GROUP, HAS_ZERO,
                           BLOCK_N, BLOCK_K).to(dt)  # fmt: skip
        else:
            w = _stream_tile(w_rows, cols, row_ok, K, 0.0)  # [BLOCK_N, BLOCK_K] e4m3 codes
            if SCHEME == 2:
                sc = _fp8_block_scale(s_ptr, rows, row_ok, k0, stride_sn, SCALE_ROWS, SCALE_COLS)
                w = (w.to(tl.float32) * sc[:, None]).to(dt)
            else:
                w = w.to(dt)
        acc += exact_dot(w, tl.trans(x.to(dt)))  # [BLOCK_N, BLOCK_M]
    _store_tile(acc, s_ptr, bias_ptr, out_ptr, rows, row_ok, ms, m_ok, pid_k, stride_om, stride_os, SCHEME, HAS_BIAS)


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


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, N, stride_wn, stride_sn, stride_zn, stride_on,
    K: tl.constexpr, SCHEME: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_N, BLOCK_K] tile of the float weight, unpacked as _quant_gemm_kernel unpacks it (SCHEME as there)
    and computed as quant.dequantize computes it: in float32, rounded once to out's dtype."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)[:, None]
    w_rows = w_ptr + rows64 * stride_wn
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    if SCHEME == 3:
        w = _int4_tile(w_rows, rows64, row_ok, k0, s_ptr, z_ptr, stride_sn, stride_zn, K, GROUP, HAS_ZERO, BLOCK_N,
                       BLOCK_K)  # fmt: skip
    else:
        w = _stream_tile(w_rows, cols, row_ok, K, 0.0).to(tl.float32)
        if SCHEME == 2:
            w = w * _fp8_block_scale(s_ptr, rows, row_ok, k0, stride_sn, SCALE_ROWS, SCALE_COLS)[:, None]
        elif SCHEME == 1:
            w = w * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[:, None]
        else:
            w = w * tl.load(s_ptr)
    dt = out_ptr.dtype.element_ty  # round_as: the interpreter's own bf16 cast truncates
    tl.store(out_ptr + rows64 * stride_on + cols[None, :], round_as(w, dt).to(dt),
             mask=row_ok[:, None] & (cols < K)[None, :])  # fmt: skip


_DEQUANT_TILE = (16, 128)  # rows x inputs a program: 2K weights, an elementwise pass over the matrix


def dequantize_weight(weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """quant.dequantize(weight, dtype), bit for bit, by one Triton pass over the packed weight (reads it once, writes
    the float weight once); quant.dequantize itself (torch) for an fp8_block weight whose block columns are not a
    power of two >= 16 (no tile of whole block columns). On an H100 the torch form took about 2.5 ms for
    Llama-3.1-8B's four projections of a layer, ~10x their bytes' time."""
    n, k = weight.shape
    scale_rows, scale_cols = weight.block if weight.scheme == FP8_BLOCK else (1, 1)
    block_n, block_k = _DEQUANT_TILE
    if weight.scheme == FP8_BLOCK:
        if scale_cols < 16 or scale_cols & (scale_cols - 1):
            return dequantize(weight, dtype)
        block_k = min(block_k, scale_cols)  # one block scale a row of a tile
    out = torch.empty((n, k), dtype=dtype, device=weight.data.device)
    is_int4 = weight.scheme == INT4_GROUP
    z = weight.zero if weight.zero is not None else weight.scale  # never read without HAS_ZERO
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        weight.data, weight.scale, z, out, n, weight.data.stride(0), weight.scale.stride(0), z.stride(0),
        out.stride(0), K=k, SCHEME=_INT4_MODE if is_int4 else _SCALE_MODE[weight.scheme], SCALE_ROWS=scale_rows,
        SCALE_COLS=scale_cols, GROUP=weight.group if is_int4 else PACK, HAS_ZERO=weight.zero is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


# Past this many rows (prefill chunks; 8192 a chunk on CUDA by default) the weight is dequantized for the call
# (dequantize_weight) and multiplied by cuBLAS. Measured on an H100 (bench_quant_gemm, Llama-3.1-8B's four
# projections, FP8 block and channel, INT4 g128; verify/lab/results/h100-2026-12-06-338a41a-quant-gemm.json) with
# torch's dequantize (about 2.5 ms a layer): the GEMM was faster at every row count measured, 9 to 2048. The W8A16
# GEMM is far from cuBLAS there (h100-2026-12-08-4903da0-w8a8.json: 2,278 against bf16's 580 us at 1024 rows),
# so with dequantize_weight (predicted ~0.23 ms a layer: 1 byte read and 2 written a weight) the crossover is
# expected near 192 rows; it stays at 2048 until bench_quant_gemm --w8a8 times dequantize_weight on a GPU.
GEMM_MAX_ROWS = 2048


def quant_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantize(weight)^T (+ bias) in x's dtype, the plain projection: the packed GEMV up
    to GEMV_MAX_ROWS rows, the packed GEMM up to GEMM_MAX_ROWS, past them the weight dequantized and a matmul."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return quant_gemv.quant_gemv(x, weight, bias=bias)[0]
    if x.shape[0] <= GEMM_MAX_ROWS:
        return quant_gemm(x, weight, bias)
    return torch.nn.functional.linear(x, dequantize_weight(weight, x.dtype), bias)


# ---- W8A8: e4m3 activations times e4m3 weights on the FP8 tensor cores ---------------------------------------------

W8A8_GROUP = 128  # activation inputs a scale and the GEMM's K step: DeepSeek-V3's 1 x 128 tiles (one MMA promotion)
FP8_MMA_K = 32  # inputs one Hopper FP8 wgmma takes (k32): the smallest group and BLOCK_K of the W8A8 GEMM
W8A8_MAX_BLOCK_M = 128  # the activation scales' rows are padded to a multiple of it (fp8_act_quant)
_FP8_SCHEMES = (FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR)
_E4M3_MAX = tl.constexpr(FP8_MAX)
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 · 2^23: (t + it) - it is t rounded to an integer, ties to even, |t| < 2^22


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| under 464) -> the nearest e4m3fn value, ties to even, as float32 with v's sign (-0 where a
    negative v rounds to zero, as a cast gives), so that the cast to float8e4nv after it is exact. Not the cast
    itself: the interpreter's float32 -> float8e4nv cast mis-rounds (125.2 -> 64 where rounding carries into the
    exponent, 10.5 -> 11), and both must give the same codes. An e4m3 value in [2^e, 2^(e+1)) has 3 mantissa bits,
    a step of 2^(e-3); below 2^-6 (subnormals) the step is 2^-9. |v| / step is a power-of-two scaling (exact) of at
    most 16, rounded by the 1.5 · 2^23 addition, and scaled back (exact: at most 5 significant bits)."""
    bits = v.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127  # floor(log2 |v|); 0 and float32 subnormals: -127, the step 2^-9
    p = tl.maximum(e - 3, -9)
    inv_step = ((127 - p) << 23).to(tl.float32, bitcast=True)
    step = ((127 + p) << 23).to(tl.float32, bitcast=True)
    a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    r = (a * inv_step + _RNE_MAGIC) - _RNE_MAGIC  # a * inv_step is exact, so a fused multiply-add rounds the same
    return ((r * step).to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_sm, stride_sg, GROUP: tl.constexpr,
                          ROWS: tl.constexpr):  # fmt: skip
    """Rows program_id(0) · ROWS .. + ROWS, group program_id(1) of x [M, K] -> their e4m3 codes (q, rows of K) and
    float32 scales (s at row · stride_sm + group · stride_sg); a row past M (the scales' padding) gets scale 1 and
    no codes. div_rn: the GPU's plain float32 division is approximate (div.full, 2 ulp), and s and x / s must be
    the correctly rounded quotients the reference computes."""
    ms = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (ms < M)[:, None] & (cols < K)[None, :]  # [ROWS, GROUP]
    x = tl.load(x_ptr + ms.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.where(amax > 0, tl.math.div_rn(amax, _E4M3_MAX), 1.0)  # [ROWS]
    codes = _round_to_e4m3(tl.math.div_rn(x, s[:, None]))
    tl.store(q_ptr + ms.to(tl.int64)[:, None] * K + cols[None, :], codes.to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + ms * stride_sm + g * stride_sg, s)


def fp8_act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or float32; rows may be strided) -> (codes float8_e4m3fn [M, K] contiguous, scales
    float32 [M, ceil(K / group)]): per row and group of `group` consecutive inputs (the last may be partial),
    s = amax|x| / 448 (1 where the group is all zero) and codes = x / s rounded to nearest even, both divisions
    correctly rounded in float32 (reference.fp8_act_quant, bit for bit). The scales are a column-major view of a
    [G, M padded to W8A8_MAX_BLOCK_M] buffer: the GEMM loads BLOCK_M scales of one group a step, contiguous so and
    without a mask (rows past M read the padding's scales of 1)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check(group >= 1 and group & (group - 1) == 0, f"group: {group} must be a power of two (inputs a scale)")
    m, k = x.shape
    groups = triton.cdiv(k, group)
    padded = triton.cdiv(m, W8A8_MAX_BLOCK_M) * W8A8_MAX_BLOCK_M
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((groups, padded), dtype=torch.float32, device=x.device)[:, :m].t()  # [M, G]
    if m == 0 or k == 0:
        return codes, scales
    rows = max(1, min(W8A8_MAX_BLOCK_M, 8192 // group))  # ~8192 inputs a program; divides the padded rows
    _fp8_act_quant_kernel[(padded // rows, groups)](
        x, codes, scales, m, k, x.stride(0), scales.stride(0), scales.stride(1), GROUP=group, ROWS=rows, num_warps=8,
    )  # fmt: skip
    return codes, scales


def w8a8_config(m: int, n: int, k: int, sms: int) -> GemmTiles:
    """The W8A8 GEMM's tiles for m activation rows, n outputs and k inputs on a device of `sms` SMs. Chosen before
    any GPU timing, not swept since (bench_quant_gemm --w8a8 measures them: on an H100, 2026-12-08, 560-650 TFLOP/s
    at 4096 rows against bf16 cuBLAS's 690-790; kernels/README.md); BLOCK_K is W8A8_GROUP throughout.
    Up to 64 rows (decode batches) the W8A16 GEMM's FP8 tiles (gemm_config: BLOCK_M 16-64 on wgmma's N side, 64
    weight rows on its M side, 4 warps, split-K to two programs an SM): a step reads the same weight bytes and
    half the activation bytes (a code, not a bf16), and only its dot differs.
    Past 64 rows (prefill) the work is the FLOPs, not the weight's bytes: 128 x 128 tiles (a 128-input step is
    32 KB of codes in shared memory, 96 KB at Triton's 3 stages) on 8 warps, two warpgroups of 64 weight rows each:
    the float32 accumulator and a step's partial take 128 registers a thread on 8 warps, 256 on 4 (the sm_90 build:
    177-201 registers in all on 8 warps; on 4, all 255 and 224 bytes spilled).
    Where 128 x 128 tiles leave SMs idle (256 rows of a 4096-output projection: 64 tiles on 132 SMs), BLOCK_N 64
    on 4 warps doubles them. Never split past 64 rows: the float32 partials' [split, M, N] round trip grows with
    M while a tile's steps do not shrink."""
    if m <= 64:
        return gemm_config(m, n, k, FP8_CHANNEL, sms)._replace(block_k=W8A8_GROUP)
    block_n, num_warps = 128, 8
    if triton.cdiv(m, 128) * triton.cdiv(n, block_n) < sms:
        block_n, num_warps = 64, 4
    return GemmTiles(128, block_n, W8A8_GROUP, num_warps, 1)


@triton.jit
def _w8a8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_xsm, stride_xsg, stride_wn, stride_wsn, stride_om, stride_os, split_len,
    K: tl.constexpr, SCHEME: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M rows, BLOCK_N outputs] tile of y = x @ W^T (+ bias) from e4m3 codes on both sides, over the
    inputs of split pid_k, stored as _quant_gemm_kernel stores. x: codes [M, K] with scales xs, one a row and
    BLOCK_K inputs (the group). SCHEME as _quant_gemm_kernel's 0-2 (BLOCK_K | SCALE_COLS). Each step's dot is
    float32 from FP8 operands (Hopper's wgmma e4m3, the weight tile on its M side, the codes' K-major B operand
    as FP8 wgmma requires); it enters the float32 accumulator times the step's scales (the promotion a 128-input
    partial needs: module docstring). UPCAST_DOT: float32 operands (the interpreter's FP8 dot is not exact)."""
    pid_k, k_begin, k_end, rows, row_ok, ms, m_ok = _tile(M, N, K, split_len, BLOCK_M, BLOCK_N)
    # Rows past N or M read row N - 1 or M - 1 (their outputs are never stored) instead of a masked load: a mask of
    # BLOCK_M lanes on each step's scale load held the 128 x 128 tile at 255 registers and spilled (sm_90 build).
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    ms_in = tl.minimum(ms, M - 1)
    x_rows = x_ptr + ms_in.to(tl.int64)[:, None] * stride_xm
    xs_off = ms * stride_xsm  # int32: the M x G scales; the buffer is padded past M (fp8_act_quant)
    kk = tl.arange(0, BLOCK_K)
    ws_row = ws_ptr + (tl.program_id(1) * BLOCK_N // SCALE_ROWS).to(tl.int64) * stride_wsn  # the tile's first row
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        cols = k0 + kk
        if K % BLOCK_K == 0:
            w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K] e4m3 codes
            x = tl.load(x_rows + cols[None, :])  # [BLOCK_M, BLOCK_K]
        else:  # a partial last step: its inputs past K are 0 on both sides
            w = tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
        # The step's scales are requested before its dot, so their latency overlaps the MMA.
        xs = tl.load(xs_ptr + (k0 // BLOCK_K) * stride_xsg + xs_off)  # [BLOCK_M]
        if SCHEME == 2:
            if SCALE_ROWS % BLOCK_N == 0:  # the tile's rows lie in one scale row: one weight scale a step
                xs = xs * tl.load(ws_row + k0 // SCALE_COLS)
            else:
                ws = _fp8_block_scale(ws_ptr, rows, row_ok, k0, stride_wsn, SCALE_ROWS, SCALE_COLS)  # [BLOCK_N]
        if UPCAST_DOT:
            part = exact_dot(w.to(tl.float32), tl.trans(x.to(tl.float32)))
        else:
            part = tl.dot(w, tl.trans(x))  # [BLOCK_N, BLOCK_M] float32
        if SCHEME == 2 and SCALE_ROWS % BLOCK_N != 0:
            acc += part * (ws[:, None] * xs[None, :])
        else:
            acc += part * xs[None, :]
    _store_tile(acc, ws_ptr, bias_ptr, out_ptr, rows, row_ok, ms, m_ok, pid_k, stride_om, stride_os, SCHEME,
                HAS_BIAS)


def w8a8_block_k(weight: PackedWeight, block_k: int) -> int:
    """The K step and activation group the W8A8 GEMM takes for `weight` given a config's BLOCK_K: capped at an
    fp8_block weight's block columns (one weight scale a row and step) and at K rounded up to a power of two, never
    under FP8_MMA_K (one line naming the weight where its blocks are narrower)."""
    if weight.scheme == FP8_BLOCK:
        cols = weight.block[1]
        check(cols >= FP8_MMA_K and cols & (cols - 1) == 0,
              f"weight: fp8_block columns {cols} must be a power of two >= {FP8_MMA_K} for the W8A8 GEMM (an FP8 "
              "MMA step takes 32 inputs); use quant_gemm")  # fmt: skip
        block_k = min(block_k, cols)
    return min(block_k, max(FP8_MMA_K, triton.next_power_of_2(weight.shape[1])))


def fp8_gemm(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *,
             config: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """y [M, N] = fp8_act_quant(x) @ dequantize(weight)^T (+ bias [N]) in x's dtype (bf16, fp16 or float32), for
    an FP8 weight (fp8_block, fp8_channel, fp8_tensor): x is quantized per row and group of BLOCK_K inputs, then
    multiplied on the FP8 tensor cores (reference.fp8_gemm defines it: the quantized activations' product, not
    x's). config: GemmTiles or its first four fields (default w8a8_config); BLOCK_M and BLOCK_N powers of two
    >= 16, BLOCK_K (the group) a power of two >= 32, then as w8a8_block_k caps it."""
    check(weight.scheme in _FP8_SCHEMES,
          f"weight: scheme {weight.scheme} has no W8A8 GEMM (FP8 weights only); use quant_gemm")  # fmt: skip
    n, k = weight.shape
    device = weight.data.device
    _check_inputs(x, n, k, PROLOGUE_NONE, None, None, bias, device)
    m = x.shape[0]
    tiles = GemmTiles(*config) if config is not None else w8a8_config(m, n, k, _sm_count(device))
    check(all(b >= 16 and b & (b - 1) == 0 for b in tiles[:3]) and tiles.block_m <= W8A8_MAX_BLOCK_M
          and tiles.block_k >= FP8_MMA_K and tiles.split >= 1,
          f"config: {tuple(config or ())} must be BLOCK_M (a power of two in 16..{W8A8_MAX_BLOCK_M}), BLOCK_N (a "
          f"power of two >= 16), BLOCK_K (a power of two >= {FP8_MMA_K}: an FP8 MMA step takes 32 inputs), "
          "num_warps and a split >= 1")  # fmt: skip
    block_k = w8a8_block_k(weight, tiles.block_k)
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=device)
    codes, scales = fp8_act_quant(x, block_k)  # [M, K], [M, ceil(K / block_k)]
    split_len = triton.cdiv(triton.cdiv(k, block_k), tiles.split) * block_k
    split = triton.cdiv(k, split_len)
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=device)
    scale_rows, scale_cols = weight.block if weight.scheme == FP8_BLOCK else (1, 1)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    _w8a8_gemm_kernel[grid](
        codes, scales, weight.data, weight.scale, bias if bias is not None else weight.scale, target, m, n,
        codes.stride(0), scales.stride(0), scales.stride(1), weight.data.stride(0), weight.scale.stride(0), n, m * n,
        split_len, K=k, SCHEME=_SCALE_MODE[weight.scheme], SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols,
        HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        UPCAST_DOT=INTERPRETING, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out if split == 1 else target.sum(dim=0).to(x.dtype)
