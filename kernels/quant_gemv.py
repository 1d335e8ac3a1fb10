"""GEMV for decode on packed low-bit weights (kernels/quant.py): y = prologue(x) @ W^T, W dequantized in registers.

At batch 1 a projection's time is the bytes of its weight, so the packed weight is streamed as it is stored (FP8:
one byte per weight, INT4: half a byte plus its group's scale and zero) and turned into float32 only in registers;
the sums are float32. The layout of the work is kernels/gemv.py's chunked kernel: a program owns BLOCK_N output
rows, streams their packed rows in BLOCK_K-input chunks with the next chunk requested before the current one is
used, and computes its input from the previous layer's outputs on the fly (the same PROLOGUE_* values, the same
rounding: the residual sum and SwiGLU as HF rounds them, the RMS scale applied after the dot).

  FP8 (fp8_block, fp8_channel, fp8_tensor): a [BLOCK_N, BLOCK_K] tile of e4m3 codes. A channel or tensor scale
    multiplies each row's finished sum. A block scale, where a program's rows lie in one scale row (BLOCK_N
    divides the block's rows: the 128 x 128 DeepSeek / Qwen layout), is folded into the input instead:
    x[k] · s[row block, k // cols], BLOCK_K multiplies a step for any BLOCK_K (a chunk may span several block
    columns). Where the rows of a program have different scale rows (put_rows' block (1, bk), Qwen3-Next's q/k/v),
    each row of the tile is multiplied by its own scale (BLOCK_K divides the block's columns). Either way the
    scales are requested a step ahead with the tile: a scale load waited on in its own step cost its whole latency
    each step (the H100's fp8_block down projection, 112 steps: 78 us against fp8_channel's 26).
  INT4 (int4_group): a [BLOCK_N, GC, SEG] tile of int32 words (BLOCK_K/8 words a row, in GC segments of SEG
    words, each inside one group: int4_segment), nibble j of every word (input 8c + j, the internal layout) becomes
    the float 2^23 + u (int4_code), less 2^23 + the segment's zero, times the inputs x_j at columns 8c + j (one
    contiguous [BLOCK_K/8, 8] load split into its 8 columns, each reshaped to the tile's [GC, SEG]), summed over j
    per word, then times the segment's scale; the scale and zero are loaded once a segment ([BLOCK_N, GC, 1]) and,
    with the words, a step ahead. Loaded once a word instead (a [BLOCK_N, BLOCK_K/8] gather, 16 equal addresses a
    group of 128) they held the kernel at ~4x its byte floor on the H100 (bench_int4_gemv, kernel journal); the
    [BLOCK_N, BLOCK_K/8, 8] form before that, summed over its last axis, at 5.5-6.3x.

  FP8, persistent (a config with a 4th entry, programs per SM): kernels/gemv.py's persistent kernel itself on the
    codes (its SCALE_MODE): each program holds the whole input row in registers (computed once a program, not once
    a chunk, and normed as HF rounds it) and streams BLOCK_N-row tiles of codes over all of K; a block scale
    multiplies the input for each tile. K at most PERSISTENT_MAX_K.

Rows: each row of `a` is one program column and re-reads the weight (from L2 when the rows are few); meant for up
to GEMV_MAX_ROWS rows. Past that, kernels/quant_gemm.py's GEMM reads the same packing once per tile of rows
(`quant_gemm.quant_linear` picks between the two).
Configs: measured on the H100 (DEFAULT_CONFIGS says where).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import FLOAT_DTYPES, check, check_tensor, pdl_enter, pdl_launch
from envex.kernels.gemv import (
    PROLOGUE_ADD_RMS,
    PROLOGUE_NONE,
    PROLOGUE_RMS,
    PROLOGUE_SILU_MUL,
    _gemv_persistent_kernel,
    _sm_count,
    input_chunk,
    nearest_config,
)
from envex.kernels.quant import FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, INT4_GROUP, PACK, PackedWeight

GEMV_MAX_ROWS = 8  # rows up to which the packed projections use the GEMV; past it, quant_gemm's GEMM
_SCALE_MODE = {FP8_TENSOR: 0, FP8_CHANNEL: 1, FP8_BLOCK: 2}
# (BLOCK_N, BLOCK_K, num_warps) per scheme, measured on an H100 at Llama-3.1-8B's projections (kernel journal,
# 2026-12-07): fp8_channel at (8, 512, 4), 32 bytes of codes a thread, runs at 1.3-1.4x its byte floor, and
# fp8_block (its scale folded into the input) within 2% of it on the same tile (bench_quant_gemm --gemv). INT4 at
# (8, 512, 4) with its scales once a segment: 11.2 / 38.9 / 23.6 us for qkv / gate_up / down (floors 4.1 / 19.1 /
# 9.5), within 5% of the best of eight tiles at each (bench_int4_gemv's v1_group_scales: this loop with K at run time).
DEFAULT_CONFIGS: dict[str, tuple[int, ...]] = {
    FP8_BLOCK: (8, 512, 4),
    FP8_CHANNEL: (8, 512, 4),
    FP8_TENSOR: (8, 512, 4),
    INT4_GROUP: (8, 512, 4),
}
PERSISTENT_MAX_K = 16384  # the persistent FP8 GEMV holds a row of K inputs in registers: gemv's widest measured


# The FP8 GEMV's measured best per projection and scheme, keyed by (N, K, scheme): persistent (4 entries) where
# it won, chunked where not (fp8_block's down: its persistent tiles multiply a gathered row of K block scales each
# tile, 37.8 against 27.1 us). bench_quant_gemm --gemv on an H100 (raw verify/lab/results/
# h100-2026-12-07-42f53bf-var-quant-gemv.json; kernel journal): qkv 15.5 -> 12.3 / 11.3 us (block / channel), gate-up
# 47.5 -> 43.6 / 42.4, down (channel) 27.5 -> 25.4; floors 7.8, 36.3, 18.2 at 3.23 TB/s.
FP8_CONFIGS: dict[tuple[int, int, str], tuple[int, ...]] = {
    (6144, 4096, FP8_BLOCK): (4, 0, 8, 2),
    (6144, 4096, FP8_CHANNEL): (2, 0, 8, 4),
    (28672, 4096, FP8_BLOCK): (4, 0, 8, 2),
    (28672, 4096, FP8_CHANNEL): (2, 0, 8, 4),
    (4096, 14336, FP8_BLOCK): (16, 512, 4),
    (4096, 14336, FP8_CHANNEL): (2, 0, 16, 2),
}


def fp8_config(n: int, k: int, scheme: str) -> tuple[int, ...]:
    """The FP8 GEMV's config for an n x k projection: that of the nearest measured shape (by log N and log K, as
    gemv.tuned_config) of the scheme (fp8_tensor: fp8_channel's, its scale is applied the same way); a persistent
    config only while K fits its register tile (PERSISTENT_MAX_K), the scheme's chunked default otherwise."""
    found = nearest_config(FP8_CONFIGS, n, k, FP8_CHANNEL if scheme == FP8_TENSOR else scheme)
    assert found is not None  # every FP8 scheme has measured shapes
    cfg = found[1]
    if len(cfg) > 3 and triton.next_power_of_2(k) > PERSISTENT_MAX_K:
        return DEFAULT_CONFIGS[scheme]
    return cfg


def _config_for(weight: PackedWeight, n: int, k: int) -> tuple[int, ...]:
    """The config quant_gemv takes when given none: INT4's default; FP8's measured one (fp8_config), but for
    fp8_block only a tile whose rows lie in one scale row: else the scheme's default, else (scale rows of fewer rows
    than its tile: put_rows) FP8_BLOCK_ROWS_CONFIG with BLOCK_K the largest power of two dividing the block's
    columns, the chunked kernel's per-row scales."""
    if weight.scheme == INT4_GROUP:
        return DEFAULT_CONFIGS[INT4_GROUP]
    candidates = (fp8_config(n, k, weight.scheme), DEFAULT_CONFIGS[weight.scheme])
    if weight.scheme != FP8_BLOCK:
        return candidates[0]
    scale_rows, scale_cols = weight.block
    for cfg in candidates:
        if scale_rows % cfg[0] == 0:
            return cfg
    block_n, block_k, num_warps = FP8_BLOCK_ROWS_CONFIG
    return block_n, min(block_k, scale_cols & -scale_cols), num_warps


# fp8_block with a program's rows in several scale rows (put_rows' block (1, bk)): a scale a tile row, so a tile
# lies in one block column (BLOCK_K capped at the block's 128 columns) and BLOCK_N doubles to keep 16 bytes a thread.
FP8_BLOCK_ROWS_CONFIG = (16, 128, 4)


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
def int4_code(words, shift: tl.constexpr):
    """2^23 + the 4-bit code at bit `shift` of each word (any shape), a float32 made by OR (see _int4_codes)."""
    return (((words >> shift) & 0xF) | TWO_23_BITS).to(tl.float32, bitcast=True)


@triton.jit
def int4_word_dot(words, z, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ_j (code j of each word - zero) · x_j, code j at bits 4j (int4_code; 2^23 + code less z = 2^23 + zero:
    exact), summed in order j = 0..7; words and z of one shape, each x_j broadcasting against it."""
    return ((int4_code(words, 0) - z) * x0 + (int4_code(words, 4) - z) * x1 + (int4_code(words, 8) - z) * x2
            + (int4_code(words, 12) - z) * x3 + (int4_code(words, 16) - z) * x4 + (int4_code(words, 20) - z) * x5
            + (int4_code(words, 24) - z) * x6 + (int4_code(words, 28) - z) * x7)  # fmt: skip


@triton.jit
def _int4_group_params(s_ptr, z_ptr, rows64, grp, ok, stride_sn, stride_zn, HAS_ZERO: tl.constexpr):
    """int4_group: the scales and 2^23 + zeros of rows rows64 [R, 1] at groups grp (broadcasting against it; ok
    masks it) -> (scale, 2^23 + zero), float32 of the broadcast shape; no zero: 8."""
    s = tl.load(s_ptr + rows64 * stride_sn + grp, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + rows64 * stride_zn + grp, mask=ok, other=0).to(tl.float32) + TWO_23
    else:
        z = tl.full(s.shape, TWO_23 + 8.0, dtype=tl.float32)
    return s, z


@triton.jit
def _int4_codes(words, s_ptr, z_ptr, rows64, grp, ok, stride_sn, stride_zn, HAS_ZERO: tl.constexpr):
    """int4_group words [R, C] (int32, 8 inputs each, nibble j = input 8c + j) with their groups grp (any shape
    broadcasting against [R, C]; ok masks it) -> ((u - zero) [R, C, 8], scale [R, C]) in float32; no zero: 8.
    Callers apply the scale where it costs least (the GEMM per weight before its dot).
    Each code becomes a float without an int-to-float conversion (a quarter-rate instruction on Hopper, one per
    weight): OR-ed into the mantissa of 2^23 it is the float 2^23 + u, and 2^23 + zero is subtracted (both exact),
    as Marlin and the LUT-free dequantizers do."""
    u = (int4_nibbles(words) | TWO_23_BITS).to(tl.float32, bitcast=True)  # 2^23 + u
    s, z = _int4_group_params(s_ptr, z_ptr, rows64, grp, ok, stride_sn, stride_zn, HAS_ZERO)
    return u - z[:, :, None], s


@triton.jit
def _columns_of_8(x, R: tl.constexpr):
    """x [R, 8] -> its 8 columns, [R] each, in order: three halvings of the last dim (tl.split), column
    j = 4a + 2b + c of the [R, 2, 2, 2] view taken by c, then b, then a."""
    c0, c1 = tl.split(tl.reshape(x, [R, 2, 2, 2]))  # [R, 2, 2] each: the even and the odd columns
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    x0, x4 = tl.split(c0b0)
    x2, x6 = tl.split(c0b1)
    x1, x5 = tl.split(c1b0)
    x3, x7 = tl.split(c1b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _fp8_gemv_kernel(
    a_ptr, b_ptr, nw_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, h_ptr,
    N, stride_am, stride_bm, stride_wn, stride_sn, stride_om, stride_hm, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_MODE: tl.constexpr,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, FOLD_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """SCALE_MODE 0: one scale; 1: one per row; 2: one per SCALE_ROWS x SCALE_COLS block, either folded into the
    input (FOLD_SCALE: the program's rows lie in one scale row, SCALE_ROWS % BLOCK_N == 0; any BLOCK_K) or
    multiplying each row of the tile (BLOCK_K | SCALE_COLS: one scale a row of a tile)."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    kk = tl.arange(0, BLOCK_K)
    # The weight tile and its block scales are requested a step ahead (the first before waiting on the previous
    # kernel, PDL): the scales are streamed from memory like the codes, and a load waited on in its own step
    # costs its whole latency each step.
    w_next = _stream_tile(w_rows, kk, row_ok, K, 0.0)
    if SCALE_MODE == 2:
        if FOLD_SCALE:  # the scale of each input of this program's scale row: [BLOCK_K], BLOCK_K / SCALE_COLS values
            s_row = s_ptr + (pid_n * BLOCK_N // SCALE_ROWS).to(tl.int64) * stride_sn
            s_next = tl.load(s_row + kk // SCALE_COLS, mask=kk < K, other=0.0)
        else:  # the scale of each row at this tile's block column: [BLOCK_N]
            s_next = _fp8_block_scale(s_ptr, rows, row_ok, 0, stride_sn, SCALE_ROWS, SCALE_COLS)
    pdl_enter(USE_PDL, False)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_next
        cols = k0 + kk
        k_ok = cols < K
        ahead = cols + BLOCK_K
        w_next = _stream_tile(w_rows, ahead, row_ok, K, 0.0)
        if SCALE_MODE == 2:
            s = s_next
            if FOLD_SCALE:
                s_next = tl.load(s_row + ahead // SCALE_COLS, mask=ahead < K, other=0.0)
            else:
                s_next = _fp8_block_scale(s_ptr, rows, row_ok & (k0 + BLOCK_K < K), k0 + BLOCK_K, stride_sn,
                                          SCALE_ROWS, SCALE_COLS)  # fmt: skip
        x = input_chunk(a_ptr, b_ptr, h_ptr, m * stride_am, m * stride_bm, m * stride_hm, cols, k_ok, K,
                         tl.where(pid_n == 0, K, 0), PROLOGUE)  # fmt: skip
        if PROLOGUE == 1 or PROLOGUE == 2:
            sumsq += x * x
            x = x * tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        wf = w.to(tl.float32)
        if SCALE_MODE == 2:
            if FOLD_SCALE:
                x = x * s  # BLOCK_K multiplies, not BLOCK_N x BLOCK_K
            else:
                wf = wf * s[:, None]
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
    SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """W[n, 8c + j] = (nibble j of word [n, c] - zero[n, g]) · scale[n, g], g = 8c // GROUP; no zero: 8.
    A step's BW words a row are GC segments of SEG words, each inside one group (int4_segment): the words tile is
    [BLOCK_N, GC, SEG] and a segment's scale and zero [BLOCK_N, GC, 1], loaded once a segment, not once a word."""
    BW: tl.constexpr = BLOCK_K // 8  # words per row and chunk
    KW: tl.constexpr = (K + 7) // 8  # words per row
    WPG: tl.constexpr = GROUP // 8  # words per group
    GC: tl.constexpr = BW // SEG  # segments per chunk
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    r3 = rows.to(tl.int64)[:, None, None]
    ok3 = row_ok[:, None, None]
    w_rows = w_ptr + r3 * stride_wn
    seg = tl.arange(0, GC)[None, :, None] * SEG  # [1, GC, 1]: each segment's first word in the chunk
    wcol = seg + tl.arange(0, SEG)[None, None, :]  # [1, GC, SEG]: the chunk's words
    cw = tl.arange(0, BW)
    # The words and each segment's scale and zero are requested a step ahead, as the FP8 kernel's tile.
    w_next = tl.load(w_rows + wcol, mask=ok3 & (wcol < KW), other=0, eviction_policy="evict_first")
    s_next, z_next = _int4_group_params(s_ptr, z_ptr, r3, seg // WPG, ok3 & (seg < KW), stride_sn, stride_zn,
                                        HAS_ZERO)  # fmt: skip
    pdl_enter(USE_PDL, False)
    acc = tl.zeros([BLOCK_N, GC, SEG], dtype=tl.float32)
    sumsq = tl.zeros([BW, 8], dtype=tl.float32)
    for w0 in range(0, KW, BW):
        words, s, z = w_next, s_next, z_next  # int32 words [BLOCK_N, GC, SEG], scale and 2^23 + zero [.., GC, 1]
        ahead = w0 + BW + wcol
        w_next = tl.load(w_rows + ahead, mask=ok3 & (ahead < KW), other=0, eviction_policy="evict_first")
        seg_ahead = w0 + BW + seg
        s_next, z_next = _int4_group_params(s_ptr, z_ptr, r3, seg_ahead // WPG, ok3 & (seg_ahead < KW), stride_sn,
                                            stride_zn, HAS_ZERO)  # fmt: skip
        cols = (w0 + cw)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BW, 8]: input 8c + j, one contiguous load
        k_ok = cols < K
        x = input_chunk(a_ptr, b_ptr, h_ptr, m * stride_am, m * stride_bm, m * stride_hm, cols, k_ok, K,
                         tl.where(pid_n == 0, K, 0), PROLOGUE)  # fmt: skip
        if PROLOGUE == 1 or PROLOGUE == 2:
            sumsq += x * x  # each input once
            x = x * tl.load(nw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns_of_8(x, BW)  # [BW] each: the inputs of nibble j
        # Σ_j (u_j - zero) · x_j per word (u_j - zero exact), then one multiply by its segment's scale.
        d = int4_word_dot(words, z, tl.reshape(x0, [1, GC, SEG]), tl.reshape(x1, [1, GC, SEG]),
                          tl.reshape(x2, [1, GC, SEG]), tl.reshape(x3, [1, GC, SEG]), tl.reshape(x4, [1, GC, SEG]),
                          tl.reshape(x5, [1, GC, SEG]), tl.reshape(x6, [1, GC, SEG]),
                          tl.reshape(x7, [1, GC, SEG]))  # fmt: skip
        acc += d * s
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * tl.rsqrt(tl.sum(tl.sum(sumsq, axis=1), axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def int4_segment(group: int, block_k: int) -> int:
    """The words a scale segment of the INT4 GEMV holds: the largest power of two dividing the group's words, at
    most a step's (block_k / 8), so a segment never straddles two groups (a group of 128 inputs: 16 words)."""
    words = group // PACK
    return min(words & -words, block_k // PACK)


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
    config: tuple[int, ...] | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [M, N] = prologue(a) @ dequantize(weight)^T, in a's dtype; returns (y, a + b) for PROLOGUE_ADD_RMS, else
    (y, None). The arguments are kernels.gemv.gemv's (a: [M, K], or [M, 2K] for PROLOGUE_SILU_MUL; b, norm_weight,
    bias, pdl), the weight a PackedWeight of any scheme. config: (BLOCK_N, BLOCK_K, num_warps), powers of two,
    BLOCK_K >= 8 (INT4: a multiple of 8 inputs), or (BLOCK_N, 0, num_warps, programs per SM) for the persistent
    FP8 kernel; for fp8_block with BLOCK_N not dividing the block's rows, BLOCK_K
    must divide the block's columns (refused otherwise; the default is FP8_BLOCK_ROWS_CONFIG there)."""
    n, k = weight.shape
    device = weight.data.device
    _check_inputs(a, n, k, prologue, b, norm_weight, bias, device)
    m = a.shape[0]
    out = torch.empty((m, n), dtype=a.dtype, device=device)
    h = torch.empty((m, k), dtype=a.dtype, device=device) if prologue == PROLOGUE_ADD_RMS else out
    extra = h if prologue == PROLOGUE_ADD_RMS else None
    if m == 0:
        return out, extra
    scale_rows, scale_cols = weight.block if weight.scheme == FP8_BLOCK else (1, 1)
    config = config or _config_for(weight, n, k)
    block_n, block_k, num_warps, *rest = config
    persistent = rest[0] if rest else 0  # programs per SM of the persistent FP8 kernel; 0: the chunked kernels
    if persistent:
        check(weight.scheme != INT4_GROUP, f"config: {config} is persistent (a 4th entry); INT4 has the chunked "
              "kernel only: give (BLOCK_N, BLOCK_K, num_warps)")  # fmt: skip
        check(weight.scheme != FP8_BLOCK or scale_rows % block_n == 0,
              f"config: {config} for fp8_block in blocks of {weight.block}: the persistent kernel needs BLOCK_N "
              f"dividing the block's {scale_rows} rows")  # fmt: skip
        check(block_n & (block_n - 1) == 0 and triton.next_power_of_2(k) <= PERSISTENT_MAX_K,
              f"config: {config}: the persistent kernel needs BLOCK_N a power of two and K <= {PERSISTENT_MAX_K} "
              f"(K is {k})")  # fmt: skip
    check(persistent or block_n & (block_n - 1) == 0 and block_k >= 8 and block_k & (block_k - 1) == 0,
          f"config: {config} must be powers of two (BLOCK_N, BLOCK_K >= 8, num_warps)")  # fmt: skip
    block_k = min(block_k, max(8, triton.next_power_of_2(k)))
    # fp8_block: a program's rows in one scale row have their scales folded into the input (any BLOCK_K); rows in
    # several scale rows (put_rows' block (1, bk)) take a scale a tile row, so a tile must lie in one block column.
    fold = scale_rows % block_n == 0
    check(weight.scheme != FP8_BLOCK or fold or scale_cols % block_k == 0,
          f"config: {config} for fp8_block in blocks of {weight.block}: BLOCK_N {block_n} spans several scale rows, "
          f"so BLOCK_K {block_k} must divide the block's {scale_cols} columns; use a smaller BLOCK_K or a BLOCK_N "
          f"dividing {scale_rows}")  # fmt: skip
    bb = b if b is not None else a
    nw = norm_weight if norm_weight is not None else a  # never read without an RMS prologue
    bias_arg = bias if bias is not None else a  # never read when HAS_BIAS is off
    common = dict(K=k, PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=block_n, USE_PDL=pdl,
                  num_warps=num_warps, **pdl_launch(pdl))  # fmt: skip
    if persistent:
        grid = (min(triton.cdiv(n, block_n), persistent * _sm_count(device)), m)
        _gemv_persistent_kernel[grid](
            a, bb, nw, weight.data, weight.scale, bias_arg, out, h, n, a.stride(0), bb.stride(0),
            weight.data.stride(0), weight.scale.stride(0), out.stride(0), h.stride(0), float(eps),
            SCALE_MODE=_SCALE_MODE[weight.scheme], SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols,
            BLOCK_K=triton.next_power_of_2(k), **common,
        )  # fmt: skip
        return out, extra
    grid = (triton.cdiv(n, block_n), m)
    if weight.scheme == INT4_GROUP:
        z = weight.zero if weight.zero is not None else weight.scale  # never read without HAS_ZERO
        _int4_gemv_kernel[grid](
            a, bb, nw, weight.data, weight.scale, z, bias_arg, out, h, n, a.stride(0), bb.stride(0),
            weight.data.stride(0), weight.scale.stride(0), z.stride(0), out.stride(0), h.stride(0), float(eps),
            HAS_ZERO=weight.zero is not None, GROUP=weight.group, SEG=int4_segment(weight.group, max(block_k, PACK)),
            BLOCK_K=max(block_k, PACK), **common,
        )  # fmt: skip
        return out, extra
    _fp8_gemv_kernel[grid](
        a, bb, nw, weight.data, weight.scale, bias_arg, out, h, n, a.stride(0), bb.stride(0), weight.data.stride(0),
        weight.scale.stride(0), out.stride(0), h.stride(0), float(eps), SCALE_MODE=_SCALE_MODE[weight.scheme],
        SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, FOLD_SCALE=fold, BLOCK_K=block_k, **common,
    )  # fmt: skip
    return out, extra
