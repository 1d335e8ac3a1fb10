"""gpt-oss's mixture of experts on Triton: routing, then the expert projections reading MXFP4 (or float) weights
directly, dequantized tile by tile in registers, with the clamped SwiGLU fused into the first projection.
Qwen3-MoE's experts run the same kernels: a None bias pointer and a None alpha/limit are constexpr None to Triton,
which compiles out the bias loads and takes the plain SwiGLU silu(gate) · up (`_expert_act`), so gpt-oss's
kernels, their signatures and their bits are as before. FP8 releases' experts (Qwen3-30B-A3B-FP8, DeepSeek-V3:
e4m3 codes with bn x bk block scales, quant.FP8BlockStack) run them too, as the constexpr FP8_BN > 0: the GEMVs
widen each tile's codes and multiply them by their row's block scale in registers (`_rows_dot`), the grouped
kernels widen a tile's codes to the activation dtype for the tensor cores and scale each output column's product;
only the chosen experts' bytes are read. INT4 releases' experts (Kimi K2's pack-quantized groups of 32, AWQ /
GPTQ: int32 words of 8 codes with group scales and optional zeros, quant.Int4GroupStack) likewise, as the
constexpr INT4_G > 0: the GEMVs take each word's 8 codes less their zero against the 8 input planes (the words' own
layout, as MXFP4) and scale each word's sum by its group's scale, the grouped kernels unpack a tile's codes less
their zero (small integers, exact in bf16) for the tensor cores and scale each output column's product by its group
scale. Codes become floats without an int-to-float conversion (quant_gemv's 2^23 trick).

Two paths, chosen by the number of token rows T (`fused_moe`):

- T ≤ GEMV_MAX_ROWS (decode): a GEMV over the chosen experts only, inputs as float32 planes (input c + 8j of a
  row at c·(K/8) + j: `norm_router` writes them with the norm and the router logits, in one launch, or
  `_planes_kernel`). `_gate_up_gemv_kernel`
  runs one column of one-warp programs per (token, expert slot); each program redoes the token's top-k over the
  router logits (E values, in L2), so routing costs no launch, and the first column stores the chosen ids and
  weights for the next kernel; it writes the activations as planes too. `_down_gemv_kernel` runs one warp per
  (rows, token, slot); the last of a token's top_k programs to finish adds their terms in slot order (an
  acq_rel arrival counter): no float atomics, the same sum whatever order they ran in.
- larger T (prefill, wide decode batches): grouped by expert. The (token, slot) pairs are sorted by expert into
  tiles of BLOCK_M rows (`align_by_expert`, device-only: sized for the worst case, so there is no host sync and
  a CUDA graph can hold it), and `_gate_up_grouped_kernel` / `_down_grouped_kernel` multiply each tile with its
  expert's weights on the tensor cores (after vLLM's fused_moe and its moe_align_block_size). Each pair's down
  output goes to its own row, and the top_k rows of a token are summed in a fixed order: deterministic.

MXFP4 (kernels/mxfp4.py): byte b of a row holds elements 2b (low nibble) and 2b + 1 (high nibble). The kernels
read the blocks as int32 words, 8 codes each, a 32-value group being 4 words (one 16-byte load); `_e2m1_pair`
turns codes i and 4 + i of a word into the two fp16 halves of one register (exactly 2^-14 times their e2m1
values) with two shifts and two logic ops, so the inputs are taken in the order 0, 4, 1, 5, 2, 6, 3, 7 of each
word; each group's e8m0 scale is loaded once and applied as an fp32 power of two (with the 2^14): exact.

Floor (decode): memory. Per token and layer the GEMV path reads top_k · (2I·H + H·I) · 17/32 bytes of packed
experts (values and scales) plus E·H·2 of the router; gpt-oss-120b: 4 · 12.9 MB + 0.7 MB. At ~4 instructions a
weight the decode is close to issue-bound on an H200 as well; measured 32 µs for both GEMVs against 11.3 µs of
bytes (verify/lab/journal-kernels.md, "The batch-1 MoE again").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels import mxfp4, quant
from envex.kernels._common import (
    FLOAT_DTYPES,
    INTERPRETING,
    arrival_counters,
    check,
    check_tensor,
    exact_dot,
    next_pow2,
    pdl_launch,
    prefetch_l2,
)
from envex.kernels.norm import plane_offsets, residual_sum, rms_normed
from envex.kernels.quant_gemv import TWO_23, TWO_23_BITS, int4_nibbles, int4_word_dot

_HALVES_ASM = tl.constexpr(not INTERPRETING)  # _e2m1_pair's inline PTX; the interpreter runs the tensor form
GEMV_MAX_ROWS = 4  # above this many tokens the grouped path reads each used expert once, not once per token
# GEMV tiles (one warp a program; verify/lab/journal-kernels.md, "The batch-1 MoE again"): a step covers GEMV_GROUPS
# 32-value groups of a row, one per thread (a 16-byte load each; 32 keeps weights and input planes in one layout);
# gate-up programs own GEMV_PAIRS (gate, up) row pairs of one (token, slot), down programs GEMV_DOWN_ROWS output rows of
# one (token, slot).
GEMV_GROUPS = 32
GEMV_PAIRS = 8
GEMV_DOWN_ROWS = 8
GEMV_FLOAT_K = 128  # unquantized experts: inputs per step
# One token's packed experts as one launch with a device-wide barrier between gate-up and down (_one_launch_kernel),
# where every program fits on the GPU at once; ONE_LAUNCH_WARM: its programs ask L2 for their down rows first.
# ONE_LAUNCH_MAXNREG: a register cap; Triton 3.6 builds the fused kernel at 168 registers, 12 one-warp programs an
# SM (1,584 on an H200: gpt-oss needs 1,440); a cap of 128 spilled and cost 8 us (verify/lab/journal-kernels.md). The
# settings below are the fastest of the H200 sweep (bench_moe --one-launch); WARM off was picked in the decode chain
# (bench_gpt_oss --sections chain, d0d7626) and kept with gemv's O config on the served figure
# (verify/lab/journal-kernels.md).
ONE_LAUNCH = True
ONE_LAUNCH_WARM = False
ONE_LAUNCH_MAXNREG = 168
ONE_LAUNCH_SPIN_NS = 800  # > 0: each spin of the barrier's wait sleeps this many ns (nanosleep) before reading again
# a cooperative launch: the driver refuses a grid that cannot be resident at once (an error, not a hung barrier)
ONE_LAUNCH_COOPERATIVE = True


@triton.jit
def _topk_softmax(logits_ptr, t, stride_l, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_TK: tl.constexpr):  # fmt: skip
    """Token t's top_k experts (ties: the lower id) and their softmax weights over those k -> ([BLOCK_TK] int32,
    [BLOCK_TK] float32); entries ≥ TOP_K are padding. A row with a NaN still gets ids below E (its weights are
    NaN): a broken activation must not become an out-of-bounds expert read."""
    ee = tl.arange(0, BLOCK_E)
    v = tl.load(logits_ptr + t * stride_l + ee, mask=ee < E, other=float("-inf")).to(tl.float32)
    kk = tl.arange(0, BLOCK_TK)
    top_v = tl.full([BLOCK_TK], float("-inf"), dtype=tl.float32)
    top_i = tl.zeros([BLOCK_TK], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        m = tl.max(v, axis=0)
        idx = tl.minimum(tl.min(tl.where(v == m, ee, BLOCK_E), axis=0), E - 1)  # NaN: nothing equals m
        top_v = tl.where(kk == i, m, top_v)
        top_i = tl.where(kk == i, idx, top_i)
        v = tl.where(ee == idx, float("-inf"), v)
    p = tl.exp(top_v - tl.max(top_v, axis=0))  # padding: exp(-inf) = 0
    return top_i, p / tl.sum(p, axis=0)


@triton.jit
def _swiglu_oai(g, u, alpha, limit):
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return (u + 1.0) * (g * tl.sigmoid(alpha * g))


@triton.jit
def _expert_act(g, u, alpha, limit):
    """reference.moe_activation on float32 gate and up values: gpt-oss's clamped SwiGLU, or with alpha None (a
    constexpr, fused_moe's activation "silu") the plain silu(g) · u."""
    if alpha is None:
        a = g * tl.sigmoid(g) * u
    else:
        a = _swiglu_oai(g, u, alpha, limit)
    return a


@triton.jit
def _e2m1_pair(words, i: tl.constexpr):
    """int32 words of 8 e2m1 codes (code c in bits 4c..4c+3) -> the float32 values 2^-14 · e2m1 of codes i and
    4 + i (i = 0..3), both halves of a word at once. Each code's magnitude bits go to bits 9-11 of its 16-bit half
    and its sign to bit 15: that half is the fp16 2^-14 · e2m1 (e2m1's subnormal 0.5 lands on fp16's subnormal
    2^-15, so no select), and widening fp16 to fp32 is exact. Two shifts and two logic ops per two codes."""
    if 4 * i <= 9:
        mag = words << (9 - 4 * i)
    else:
        mag = words >> (4 * i - 9)
    halves = (mag & 0x0E000E00) | ((words << (12 - 4 * i)) & -2147450880)  # the sign mask 0x80008000 as int32
    if _HALVES_ASM:
        # Both halves straight from the register (HADD2.F32 .H0_H0 / .H1_H1); through int16 tensors Triton first
        # packs the low halves of two words with a PRMT, half an extra logic op a value.
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [halves], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = halves.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (halves >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_dots(words, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ over each group's 4 words of its 32 codes times their inputs -> [..., GB] float32, times 2^-14 (the
    scale is applied per group by the caller). words [..., GB, 4] int32; x_r broadcast against it."""
    # one FMA a code: each product is added on its own (`acc += a·b + c·d` would add a product pair first)
    lo, hi = _e2m1_pair(words, 0)
    acc = lo * x0
    acc = acc + hi * x4
    lo, hi = _e2m1_pair(words, 1)
    acc = acc + lo * x1
    acc = acc + hi * x5
    lo, hi = _e2m1_pair(words, 2)
    acc = acc + lo * x2
    acc = acc + hi * x6
    lo, hi = _e2m1_pair(words, 3)
    acc = acc + lo * x3
    acc = acc + hi * x7
    return tl.sum(acc, axis=-1)


@triton.jit
def _group_scale(sc):
    """e8m0 scale bytes -> 2^(s - 127) · 2^14 float32 (2^14 undoes _e2m1_pair's offset; s = 0 reads as 0)."""
    return (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit
def _plane(x_base, f, ok, GB: tl.constexpr):
    return tl.reshape(tl.load(x_base + f, mask=ok, other=0.0), [1, GB, 4])


@triton.jit
def _plane_loads(x_base, f, ok, K: tl.constexpr, GB: tl.constexpr):
    """The 8 inputs of each word f ([1, 4·GB] word indices of a row) from K inputs stored as planes (plane c holds
    inputs c, 8 + c, 16 + c, ...): each a float32 [1, GB, 4] tile, in the layout of the reshaped words."""
    kw: tl.constexpr = K // 8
    return (_plane(x_base, f, ok, GB), _plane(x_base + kw, f, ok, GB), _plane(x_base + 2 * kw, f, ok, GB),
            _plane(x_base + 3 * kw, f, ok, GB), _plane(x_base + 4 * kw, f, ok, GB), _plane(x_base + 5 * kw, f, ok, GB),
            _plane(x_base + 6 * kw, f, ok, GB), _plane(x_base + 7 * kw, f, ok, GB))  # fmt: skip


@triton.jit
def _packed_rows_dot(w_rows, s_rows, row_ok, x_base, K: tl.constexpr, R: tl.constexpr, GB: tl.constexpr):
    """R packed rows (word pointers w_rows, scale pointers s_rows) against K inputs stored as planes at x_base ->
    [R, GB] float32 partial sums (sum axis 1 for the dots). Each step loads [R, 4·GB] words and [1, 4·GB] of each
    input plane: a contiguous last axis that Triton's coalescing gives one 16-byte vector a thread along the warp
    for both, whatever its tie-breaking, so the reshape to [R, GB, 4] leaves weights and inputs in one layout and
    no value changes threads. A loop, not unrolled: the code stays in the instruction cache (and not pipelined
    through shared memory by Triton: 2 or 3 stages were slower, verify/lab/journal-kernels.md)."""
    acc = tl.zeros([R, GB], dtype=tl.float32)
    for g0 in range(0, K // 32, GB):
        f = 4 * g0 + tl.arange(0, 4 * GB)  # word index in the row
        f_ok = f < K // 8
        words = tl.load(w_rows[:, None] + f[None, :], mask=row_ok[:, None] & f_ok[None, :], other=0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _plane_loads(x_base, f[None, :], f_ok[None, :], K, GB)
        g = g0 + tl.arange(0, GB)
        sc = tl.load(s_rows[:, None] + g[None, :], mask=row_ok[:, None] & (g < K // 32)[None, :], other=0)
        acc += _word_dots(tl.reshape(words, [R, GB, 4]), x0, x1, x2, x3, x4, x5, x6, x7) * _group_scale(sc)
    return acc


@triton.jit
def _rows_dot(w_rows, s_rows, row_ok, x_base, K: tl.constexpr, R: tl.constexpr, GB: tl.constexpr, BK: tl.constexpr):
    """R float or FP8 rows (pointers w_rows [R] to their first value) against K inputs stored as planes at x_base
    -> [R, GB] float32 partial sums (sum axis 1 for the dots). FP8: s_rows [R] point to each row's first block
    scale; a step's GB inputs lie in one block of BK columns (GB divides BK), so one scale a row multiplies the
    widened tile in registers. Float: s_rows None (a constexpr: no scale)."""
    kk = tl.arange(0, GB)
    acc = tl.zeros([R, GB], dtype=tl.float32)
    for k0 in range(0, K, GB):
        k = k0 + kk
        k_ok = k < K
        xv = tl.load(x_base + plane_offsets(k, K), mask=k_ok, other=0.0)
        wv = tl.load(w_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if s_rows is not None:
            wv = wv * tl.load(s_rows + k0 // BK, mask=row_ok, other=0.0)[:, None]
        acc += wv * xv[None, :]
    return acc


@triton.jit
def _int4_zero(z_ptr, off, ok):
    """INT4 zero points at offsets off (int32), 8 where z_ptr is None (a constexpr: symmetric experts)."""
    z = (off * 0 + 8).to(tl.int32)
    if z_ptr is not None:
        z = tl.load(z_ptr + off, mask=ok, other=8).to(tl.int32)
    return z


@triton.jit
def _int4_tile(words, zero, R: tl.constexpr, BK: tl.constexpr):
    """int32 words [R, BK/8] and their zero points [R] (int32) -> u - zero [R, BK] in float32, exact (input 8c + j
    from nibble j of word c). No int-to-float conversion (quant_gemv._int4_codes: 2^23 + u by OR, 2^23 + zero
    subtracted)."""
    u = tl.reshape((int4_nibbles(words) | TWO_23_BITS).to(tl.float32, bitcast=True), [R, BK])
    return u - (zero.to(tl.float32) + TWO_23)[:, None]


@triton.jit
def _int4_rows_dot(w_rows, s_ptr, z_ptr, s_off, row_ok, x_base, K: tl.constexpr, R: tl.constexpr, GB: tl.constexpr,
                   G: tl.constexpr):  # fmt: skip
    """R INT4 rows (quant.Int4GroupStack: w_rows [R] point to each row's first word; s_off [R], the offset of its
    first group scale in s_ptr and zero in z_ptr, None: zero 8) against K inputs stored as planes at x_base ->
    [R, GB] float32 partial sums (sum axis 1 for the dots). As _packed_rows_dot: a step loads [R, 4·GB] words and
    the 8 input planes in the words' layout; word f's 8 codes less their zero times their inputs, times the group
    scale, all in registers. G a multiple of 32: a quad of 4 words (32 inputs, the [R, GB, 4] tile's last axis)
    lies in one group, so its scale and zero are loaded once a quad ([R, GB]) and the scale multiplies the quad's
    sum; G 16: once a word. (Loaded once a word, a group's 16 equal addresses a step held the dense INT4 GEMV at
    ~4x its byte floor on the H100: kernels/quant_gemv.py.)"""
    acc = tl.zeros([R, GB], dtype=tl.float32)
    for w0 in range(0, K // 8, 4 * GB):
        f = w0 + tl.arange(0, 4 * GB)  # word index in the row
        f_ok = f < K // 8
        m = row_ok[:, None] & f_ok[None, :]
        words = tl.reshape(tl.load(w_rows[:, None] + f[None, :], mask=m, other=0), [R, GB, 4])
        x0, x1, x2, x3, x4, x5, x6, x7 = _plane_loads(x_base, f[None, :], f_ok[None, :], K, GB)
        if G % 32 == 0:
            q = w0 // 4 + tl.arange(0, GB)  # quads of 4 words in the row
            q_ok = row_ok[:, None] & (q * 4 < K // 8)[None, :]
            g_off = s_off[:, None] + (q * 32 // G)[None, :]
            sc = tl.load(s_ptr + g_off, mask=q_ok, other=0.0).to(tl.float32)  # [R, GB]
            z = _int4_zero(z_ptr, g_off, q_ok).to(tl.float32) + TWO_23  # 2^23 + zero
            d = int4_word_dot(words, z[:, :, None], x0, x1, x2, x3, x4, x5, x6, x7)  # (u - zero) · x, exact codes
            acc += tl.sum(d, axis=2) * sc
        else:
            g_off = s_off[:, None] + (f * 8 // G)[None, :]
            sc = tl.reshape(tl.load(s_ptr + g_off, mask=m, other=0.0).to(tl.float32), [R, GB, 4])
            z = tl.reshape(_int4_zero(z_ptr, g_off, m).to(tl.float32), [R, GB, 4]) + TWO_23  # 2^23 + zero
            d = int4_word_dot(words, z, x0, x1, x2, x3, x4, x5, x6, x7)  # (u - zero) · x, exact codes
            acc += tl.sum(d * sc, axis=2)
    return acc


@triton.jit
def _planes_kernel(x_ptr, out_ptr, stride_x, stride_o, K: tl.constexpr, BLOCK: tl.constexpr):
    """x [T, K] -> float32 planes [T, K] (see _plane_loads), one program a row."""
    t = tl.program_id(0).to(tl.int64)
    for k0 in tl.static_range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + plane_offsets(k, K), v, mask=k < K)


@triton.jit
def _gate_up_tile(
    pid_n, pair, x_ptr, xp_ptr, logits_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, b_ptr, act_ptr,
    stride_xp, stride_l, stride_we, stride_wn, stride_se, stride_be, stride_act, alpha, limit,
    K: tl.constexpr, INTER: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_I: tl.constexpr, GB: tl.constexpr, PACKED: tl.constexpr, FP8_BN: tl.constexpr,
    FP8_BK: tl.constexpr, z_ptr, INT4_G: tl.constexpr,
):  # fmt: skip
    """_gate_up_gemv_kernel's work for its tile (pid_n, pair): returns the token's top_k expert ids."""
    t = pair // TOP_K
    slot = pair % TOP_K
    top_i, top_w = _topk_softmax(logits_ptr, t, stride_l, E, TOP_K, BLOCK_E, BLOCK_TK)
    kk = tl.arange(0, BLOCK_TK)
    e = tl.sum(tl.where(kk == slot, top_i, 0), axis=0)
    w_slot = tl.sum(tl.where(kk == slot, top_w, 0.0), axis=0)
    # One program per pair publishes the routing for the down kernel (a vector store with one live lane: a bound
    # rather than `& (pid_n == 0)`, as the interpreter rejects masks built from scalar booleans).
    publish = kk < tl.where(pid_n == 0, 1, 0)
    tl.store(ids_ptr + pair + kk, tl.zeros([BLOCK_TK], dtype=tl.int32) + e, mask=publish)
    tl.store(wts_ptr + pair + kk, tl.zeros([BLOCK_TK], dtype=tl.float32) + w_slot, mask=publish)

    rows = pid_n * (2 * BLOCK_I) + tl.arange(0, 2 * BLOCK_I)  # gate and up rows interleaved, as stored
    row_ok = rows < 2 * INTER
    x_base = xp_ptr + t.to(tl.int64) * stride_xp
    e64 = e.to(tl.int64)
    r64 = rows.to(tl.int64)
    if PACKED:
        # row starts in words; a group (4 words, 16 bytes) starts at a multiple of 4: one vector load
        w_rows = w_ptr + tl.multiple_of(e64 * stride_we + r64 * (K // 8), [4])  # [2·BLOCK_I]
        s_rows = s_ptr + e64 * stride_se + r64 * (K // 32)
        acc = _packed_rows_dot(w_rows, s_rows, row_ok, x_base, K, 2 * BLOCK_I, GB)
        y = tl.sum(acc, axis=1)
    elif INT4_G > 0:  # per-row scales: gate and up rows need nothing special
        s_off = e64 * stride_se + r64 * ((K + INT4_G - 1) // INT4_G)
        acc = _int4_rows_dot(w_ptr + e64 * stride_we + r64 * (K // 8), s_ptr, z_ptr, s_off, row_ok, x_base, K,
                             2 * BLOCK_I, GB, INT4_G)  # fmt: skip
        y = tl.sum(acc, axis=1)
    elif FP8_BN > 0:
        # rows interleave gate and up, and so do their block rows (quant.FP8BlockStack, paired)
        s_rows = s_ptr + e64 * stride_se + (2 * (r64 // 2 // FP8_BN) + r64 % 2) * ((K + FP8_BK - 1) // FP8_BK)
        acc = _rows_dot(w_ptr + e64 * stride_we + r64 * stride_wn, s_rows, row_ok, x_base, K, 2 * BLOCK_I, GB,
                        FP8_BK)  # fmt: skip
        y = tl.sum(acc, axis=1)
    else:
        acc = _rows_dot(w_ptr + e64 * stride_we + r64 * stride_wn, None, row_ok, x_base, K, 2 * BLOCK_I, GB, GB)
        y = tl.sum(acc, axis=1)
    # HF rounds the projection (bias included) to the activation dtype before the SwiGLU, and its result too.
    dt = x_ptr.dtype.element_ty  # x itself is not read (its planes are): the dtype HF rounds to
    if b_ptr is not None:  # None (a constexpr): experts without biases
        y += tl.load(b_ptr + e64 * stride_be + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = y.to(dt)
    g_val, u_val = tl.split(tl.reshape(y, [BLOCK_I, 2]))
    a = _expert_act(g_val.to(tl.float32), u_val.to(tl.float32), alpha, limit)
    j = pid_n * BLOCK_I + tl.arange(0, BLOCK_I)
    tl.store(act_ptr + pair.to(tl.int64) * stride_act + plane_offsets(j, INTER), a.to(dt).to(tl.float32),
             mask=j < INTER)  # fmt: skip
    return top_i


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, xp_ptr, logits_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, b_ptr, act_ptr,
    stride_xp, stride_l, stride_we, stride_wn, stride_se, stride_be, stride_act, alpha, limit,
    K: tl.constexpr, INTER: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_I: tl.constexpr, GB: tl.constexpr, PACKED: tl.constexpr, FP8_BN: tl.constexpr = 0,
    FP8_BK: tl.constexpr = 0, USE_PDL: tl.constexpr = False, z_ptr=None, INT4_G: tl.constexpr = 0,
):  # fmt: skip
    """act[pair, j] = swiglu(gate_j, up_j) of the expert in slot pair % TOP_K of token pair // TOP_K, for the
    BLOCK_I output pairs j of this program: its 2·BLOCK_I weight rows (2j gate, 2j + 1 up) over all of K. The
    input x arrives as float32 planes (xp, _plane_loads; x_ptr only gives the activation dtype) and act leaves as
    float32 planes too, for the down kernel.

    PACKED: w is the expert blocks viewed as int32 words [E, 2I, K/8] (four words = one 32-value group, one
    16-byte load per thread), s the scales [E, 2I, K/32]; a step holds one group of each of the tile's rows in each
    thread, and the 8 inputs of each of its words come as 8 tiles of the words' own shape and layout (one 16-byte
    load each), so no value changes threads. FP8_BN > 0: w float8_e4m3fn [E, 2I, K], s its FP8_BN x FP8_BK block
    scales (quant.FP8BlockStack, paired), each code widened and scaled in registers. INT4_G > 0: w int32 words
    [E, 2I, K/8], s the group scales [E, 2I, ceil(K/G)] and z_ptr the uint8 zeros alike or None (symmetric:
    quant.Int4GroupStack), each word's codes unpacked and scaled in registers. Float: w [E, 2I, K]."""
    if USE_PDL:  # everything here depends on the previous kernels: wait at once, let the next one launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    _gate_up_tile(tl.program_id(0), tl.program_id(1), x_ptr, xp_ptr, logits_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr,
                  b_ptr, act_ptr, stride_xp, stride_l, stride_we, stride_wn, stride_se, stride_be, stride_act, alpha,
                  limit, K, INTER, E, TOP_K, BLOCK_E, BLOCK_TK, BLOCK_I, GB, PACKED, FP8_BN, FP8_BK, z_ptr,
                  INT4_G)  # fmt: skip


@triton.jit
def _down_gemv_kernel(
    act_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, b_ptr, part_ptr, count_ptr, out_ptr,
    stride_act, stride_we, stride_wn, stride_se, stride_be, stride_o,
    N: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, GB: tl.constexpr,
    PACKED: tl.constexpr, FP8_BN: tl.constexpr = 0, FP8_BK: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
    z_ptr=None, INT4_G: tl.constexpr = 0,
):  # fmt: skip
    """out[t, n] = Σ_slot weight · (down_e(act[pair]) + bias_e)[n] over token t's TOP_K pairs, for BLOCK_N outputs
    n. One warp a (rows, token, slot): BLOCK_N rows of the slot's expert over all of INTER, the inputs from that
    pair's act planes (as the gate-up kernel). Each program stores its weighted term in part [pairs, N]; the last
    of a token's TOP_K programs to finish (an acq_rel counter, reset by that program for the next launch) adds the
    TOP_K terms in slot order: no float atomics, the same sum whatever order the programs ran in."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    _down_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), act_ptr, ids_ptr, wts_ptr,
               w_ptr, s_ptr, b_ptr, part_ptr, count_ptr, out_ptr, stride_act, stride_we, stride_wn, stride_se,
               stride_be, stride_o, N, INTER, TOP_K, BLOCK_N, GB, PACKED, FP8_BN, FP8_BK, z_ptr, INT4_G)  # fmt: skip


@triton.jit
def _down_tile(
    pid_n, t, slot, n_blocks, act_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, b_ptr, part_ptr, count_ptr, out_ptr,
    stride_act, stride_we, stride_wn, stride_se, stride_be, stride_o,
    N: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, GB: tl.constexpr,
    PACKED: tl.constexpr, FP8_BN: tl.constexpr, FP8_BK: tl.constexpr, z_ptr, INT4_G: tl.constexpr,
):  # fmt: skip
    """_down_gemv_kernel's work for its tile (rows pid_n of n_blocks, token t, slot)."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n64 = n.to(tl.int64)
    dt = out_ptr.dtype.element_ty
    pair = t * TOP_K + slot
    e64 = tl.load(ids_ptr + pair).to(tl.int64)
    a_row = act_ptr + pair.to(tl.int64) * stride_act
    if PACKED:
        w_rows = w_ptr + tl.multiple_of(e64 * stride_we + n64 * (INTER // 8), [4])  # [BLOCK_N]
        s_rows = s_ptr + e64 * stride_se + n64 * (INTER // 32)
        acc = _packed_rows_dot(w_rows, s_rows, n_ok, a_row, INTER, BLOCK_N, GB)
        r = tl.sum(acc, axis=1)
    elif INT4_G > 0:
        s_off = e64 * stride_se + n64 * ((INTER + INT4_G - 1) // INT4_G)
        acc = _int4_rows_dot(w_ptr + e64 * stride_we + n64 * (INTER // 8), s_ptr, z_ptr, s_off, n_ok, a_row, INTER,
                             BLOCK_N, GB, INT4_G)  # fmt: skip
        r = tl.sum(acc, axis=1)
    elif FP8_BN > 0:
        s_rows = s_ptr + e64 * stride_se + (n64 // FP8_BN) * ((INTER + FP8_BK - 1) // FP8_BK)
        acc = _rows_dot(w_ptr + e64 * stride_we + n64 * stride_wn, s_rows, n_ok, a_row, INTER, BLOCK_N, GB, FP8_BK)
        r = tl.sum(acc, axis=1)
    else:
        acc = _rows_dot(w_ptr + e64 * stride_we + n64 * stride_wn, None, n_ok, a_row, INTER, BLOCK_N, GB, GB)
        r = tl.sum(acc, axis=1)
    if b_ptr is not None:
        r += tl.load(b_ptr + e64 * stride_be + n64, mask=n_ok, other=0.0).to(tl.float32)
    # HF rounds each expert's output before weighting it
    tl.store(part_ptr + pair.to(tl.int64) * N + n64, tl.load(wts_ptr + pair) * r.to(dt).to(tl.float32), mask=n_ok)
    tl.debug_barrier()  # every thread's term is stored before the counter moves
    count = count_ptr + t * n_blocks + pid_n
    arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:  # the last one: every term is visible (acquire); add them in slot order
        y = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(TOP_K):
            y += tl.load(part_ptr + (t * TOP_K + s).to(tl.int64) * N + n64, mask=n_ok, other=0.0,
                         cache_modifier=".cg")  # fmt: skip
        tl.store(out_ptr + t.to(tl.int64) * stride_o + n, y.to(dt), mask=n_ok)
        tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["dry"])  # (a dry=1 launch must build the same kernel as the real one)
def _one_launch_kernel(
    x_ptr, xp_ptr, logits_ptr, ids_ptr, wts_ptr, w1_ptr, s1_ptr, b1_ptr, act_ptr, w2_ptr, s2_ptr, b2_ptr,
    part_ptr, count_ptr, out_ptr, bar_ptr, dry,
    stride_xp, stride_l, stride_we1, stride_wn1, stride_se1, stride_be1, stride_act,
    stride_we2, stride_wn2, stride_se2, stride_be2, stride_o, alpha, limit,
    K: tl.constexpr, INTER: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, GB1: tl.constexpr, GB2: tl.constexpr,
    PACKED: tl.constexpr, WARM: tl.constexpr, WARM_LINES: tl.constexpr, SPIN_NS: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """One token's MoE experts in one launch: program p runs gate-up tile p, waits at a device-wide barrier until
    every program's activations are stored, then runs down tile p: the two GEMV kernels' tiles and arithmetic (the
    same bits), without the launch boundary between them. Every program must be resident at once: the launcher
    checks the grid against the SMs' room and launches it cooperatively (the driver refuses a grid that does not
    fit). WARM: before the barrier, ask L2 for the down tile's weight rows (its expert is known from the top-k).
    bar_ptr: an int64 counter that only grows (launch g waits for it to reach (g + 1) · programs), so it is never
    reset; launches on one counter must not overlap (they do not: each waits on the chain before it, and the engine
    runs one stream a device). SPIN_NS: a nanosleep between polls (fewer atomics while the last programs arrive).
    dry != 0: return at once (the launcher's first launch, which only builds the kernel and reads its resources)."""
    if USE_PDL:  # before the dry return too: a dry launch that did not wait would let the next one skip the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if dry != 0:
        return
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    gu_blocks: tl.constexpr = (INTER + BLOCK_I - 1) // BLOCK_I
    dn_blocks: tl.constexpr = (K + BLOCK_N - 1) // BLOCK_N
    if p < gu_blocks * TOP_K:
        top_i = _gate_up_tile(p % gu_blocks, p // gu_blocks, x_ptr, xp_ptr, logits_ptr, ids_ptr, wts_ptr, w1_ptr,
                              s1_ptr, b1_ptr, act_ptr, stride_xp, stride_l, stride_we1, stride_wn1, stride_se1,
                              stride_be1, stride_act, alpha, limit, K, INTER, E, TOP_K, BLOCK_E, BLOCK_TK, BLOCK_I,
                              GB1, PACKED, 0, 0, None, 0)  # fmt: skip
    else:
        top_i, _ = _topk_softmax(logits_ptr, 0, stride_l, E, TOP_K, BLOCK_E, BLOCK_TK)
    if WARM:
        if p < dn_blocks * TOP_K:
            kk = tl.arange(0, BLOCK_TK)
            e64 = tl.sum(tl.where(kk == p // dn_blocks, top_i, 0), axis=0).to(tl.int64)
            n64 = ((p % dn_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            _warm_rows(w2_ptr + e64 * stride_we2 + n64 * (INTER // 8), (n64 < K).to(tl.int32), INTER // 8,
                       WARM_LINES)  # fmt: skip
    tl.debug_barrier()  # every thread's activations are stored before the counter moves
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")  # release: this program's activations
    target = (arrived // nprog + 1) * nprog
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")  # acquire: every program's activations
    while seen < target:
        if SPIN_NS > 0:  # fewer atomics in flight while the last programs arrive
            tl.inline_asm_elementwise(_NANOSLEEP, "=r,r", [tl.full([1], SPIN_NS, tl.int32)], dtype=tl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    if p < dn_blocks * TOP_K:
        _down_tile(p % dn_blocks, p * 0, p // dn_blocks, dn_blocks, act_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, b2_ptr,
                   part_ptr, count_ptr, out_ptr, stride_act, stride_we2, stride_wn2, stride_se2, stride_be2, stride_o,
                   K, INTER, TOP_K, BLOCK_N, GB2, PACKED, 0, 0, None, 0)  # fmt: skip


_NANOSLEEP = tl.constexpr("{ nanosleep.u32 $1; mov.b32 $0, 0; }")


@triton.jit
def _warm_rows(rows, ok, WORDS: tl.constexpr, LINES_P2: tl.constexpr):
    """Ask L2 for the first WORDS int32 words of each row in rows ([R] word pointers; ok [R] int32, 0 skips a row),
    a 128-byte line at a time: fire and forget."""
    lines = tl.arange(0, LINES_P2)
    want = (ok[:, None] != 0) & (lines < (WORDS + 31) // 32)[None, :]
    prefetch_l2(rows[:, None] + lines[None, :] * 32, want.to(tl.int32))


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, wts_ptr, stride_l, E: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    top_i, top_w = _topk_softmax(logits_ptr, t, stride_l, E, TOP_K, BLOCK_E, BLOCK_TK)
    kk = tl.arange(0, BLOCK_TK)
    tl.store(ids_ptr + t * TOP_K + kk, top_i, mask=kk < TOP_K)
    tl.store(wts_ptr + t * TOP_K + kk, top_w, mask=kk < TOP_K)


@triton.jit
def _norm_router_kernel(
    x_ptr, res_ptr, nw_ptr, rw_ptr, rb_ptr, out_ptr, sum_ptr, planes_ptr, logits_ptr,
    H, stride_x, stride_res, stride_out, stride_sum, stride_planes, stride_rw, stride_l, eps,
    E: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Router logits for R experts of one row, with the row's add + RMSNorm computed in the same program (each
    program redoes it: 2·H activations from L2), so the MoE's norm and router are one launch. Program 0 of the row
    also stores the sum, the normed row and its float32 planes, as norm.norm_planes does; the norm is its
    arithmetic, the logits are each expert row's dot with the normed (rounded) row, plus the bias, rounded once."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    experts = pid * R + tl.arange(0, R)
    e_ok = experts < E
    # The router rows do not depend on the previous kernel: requested before waiting on it.
    w = tl.load(rw_ptr + experts.to(tl.int64)[:, None] * stride_rw + cols[None, :],
                mask=e_ok[:, None] & mask[None, :], other=0.0)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    own = cols < tl.where(pid == 0, H, 0)  # program 0 stores the row's sum, norm and planes (a bound, not `& pid
    # == 0`: the interpreter rejects masks built from scalar booleans)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the norm kernel's arithmetic (norm.residual_sum, norm.rms_normed): the same bits
        x = residual_sum(x, tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0))
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=own)
    y = rms_normed(x, tl.load(nw_ptr + cols, mask=mask, other=0.0), H, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=own)
    tl.store(planes_ptr + row * stride_planes + plane_offsets(cols, H), y.to(tl.float32), mask=own)
    logit = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        logit += tl.load(rb_ptr + experts, mask=e_ok, other=0.0).to(tl.float32)
    tl.store(logits_ptr + row * stride_l + experts, logit.to(logits_ptr.dtype.element_ty), mask=e_ok)


NORM_ROUTER_ROWS = 4  # router rows a program: 32 programs for gpt-oss's 128 experts
NORM_ROUTER_MAX_HIDDEN = 8192  # the widest row one norm_router program holds (gpt-oss: 2,880)


def norm_router(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                router_weight: torch.Tensor, router_bias: torch.Tensor | None = None, *, pdl: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The batch-1 MoE's first launch: (rms_norm(x + residual), x + residual, the normed rows as float32 planes,
    router logits [T, E] in x's dtype), what norm.norm_planes and a router projection give, in one launch (the
    logits summed in another order than a GEMV's: equal within rounding). residual None: x alone is normed."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    t, h = x.shape
    check(h % 8 == 0, f"x: hidden size {h} must be a multiple of 8 for the plane layout")
    check(h <= NORM_ROUTER_MAX_HIDDEN,
          f"x: hidden size {h} > {NORM_ROUTER_MAX_HIDDEN} is more than one program holds; use norm_planes and a GEMV")
    check_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check(norm_weight.shape[0] == h, f"norm_weight: length {norm_weight.shape[0]} != hidden size {h}")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        check(residual.shape == x.shape, f"residual: shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    check_tensor("router_weight", router_weight, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    e = router_weight.shape[0]
    check(router_weight.shape[1] == h and router_weight.stride(1) == 1,
          f"router_weight: {tuple(router_weight.shape)} is not a row-major [E, {h}]")  # fmt: skip
    if router_bias is not None:
        check_tensor("router_bias", router_bias, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
        check(router_bias.shape[0] == e, f"router_bias: length {router_bias.shape[0]} != {e} experts")
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    planes = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    logits = torch.empty((t, e), dtype=x.dtype, device=x.device)
    if t == 0:
        return out, total, planes, logits
    res = residual if residual is not None else x
    _norm_router_kernel[(triton.cdiv(e, NORM_ROUTER_ROWS), t)](
        x, res, norm_weight, router_weight, router_bias if router_bias is not None else norm_weight, out, total,
        planes, logits, h, x.stride(0), res.stride(0), out.stride(0), total.stride(0), planes.stride(0),
        router_weight.stride(0), logits.stride(0), float(eps),
        E=e, R=NORM_ROUTER_ROWS, BLOCK_H=next_pow2(h), HAS_RESIDUAL=residual is not None,
        HAS_BIAS=router_bias is not None, USE_PDL=pdl, num_warps=8, **pdl_launch(pdl),
    )  # fmt: skip
    return out, total, planes, logits


@triton.jit
def _dequant_tile(w_rows, s_rows, row_ok, k0, K: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """MXFP4 rows (word pointers w_rows [R] from the int32 view, scale pointers s_rows [R]) at inputs k0 ..
    k0 + BLOCK_K -> [R, BLOCK_K] float32 (3 significant bits times a power of two: exact in bf16 too), each
    word's 8 inputs in the order 0, 4, 1, 5, 2, 6, 3, 7 (two fp16 halves a word op, as the GEMV); _x_tile orders
    x alike. Each 32-value group's scale is loaded once."""
    GBK: tl.constexpr = BLOCK_K // 32
    gg = k0 // 32 + tl.arange(0, GBK)
    g_ok = gg < K // 32
    qq = tl.arange(0, 4)
    words = tl.load(w_rows[:, None, None] + (4 * gg)[None, :, None] + qq[None, None, :],
                    mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)  # [R, GBK, 4]
    scale = _group_scale(tl.load(s_rows[:, None] + gg[None, :], mask=row_ok[:, None] & g_ok[None, :],
                                 other=0))[:, :, None]  # fmt: skip
    lo, hi = _e2m1_pair(words, 0)
    j0 = tl.join(lo * scale, hi * scale)  # [R, GBK, 4, 2 (h)]: inputs i, 4 + i
    lo, hi = _e2m1_pair(words, 1)
    j1 = tl.join(lo * scale, hi * scale)
    lo, hi = _e2m1_pair(words, 2)
    j2 = tl.join(lo * scale, hi * scale)
    lo, hi = _e2m1_pair(words, 3)
    j3 = tl.join(lo * scale, hi * scale)
    q = tl.join(tl.join(j0, j1), tl.join(j2, j3))  # [R, GBK, 4, h, i0, i1]: input 4h + i, i = i0 + 2·i1
    return tl.reshape(tl.permute(q, (0, 1, 2, 5, 4, 3)), [R, BLOCK_K])


@triton.jit
def _x_tile(x_rows, row_ok, k0, K: tl.constexpr, M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activation rows (pointers x_rows [M]) at inputs k0 .. k0 + BLOCK_K -> [M, BLOCK_K], each 8 inputs in the
    order _dequant_tile gives the weights: 0, 4, 1, 5, 2, 6, 3, 7."""
    k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_rows[:, None] + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
    x6 = tl.reshape(x, [M, BLOCK_K // 32, 4, 2, 2, 2])  # [M, group, word, h, i1, i0]: input 4h + 2·i1 + i0
    return tl.reshape(tl.permute(x6, (0, 1, 2, 4, 5, 3)), [M, BLOCK_K])


@triton.jit
def _gate_up_grouped_kernel(
    x_ptr, pairs_ptr, block_expert_ptr, w_ptr, s_ptr, b_ptr, act_ptr,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_act, alpha, limit,
    K: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr, PACKED: tl.constexpr, UPCAST_DOT: tl.constexpr, FP8_BN: tl.constexpr = 0,
    FP8_BK: tl.constexpr = 0, z_ptr=None, INT4_G: tl.constexpr = 0,
):  # fmt: skip
    """One tile of BLOCK_M (token, slot) pairs of one expert × BLOCK_I output pairs: act = swiglu(x @ W^T + b).
    FP8_BN > 0: FP8 codes (quant.FP8BlockStack, paired), widened to x's dtype (exact: e4m3 fits bf16 and fp16),
    multiplied on the tensor cores, and each output column's block scale applied to the tile's product (BLOCK_K
    divides FP8_BK: one scale a row of the tile). INT4_G > 0: INT4 words (quant.Int4GroupStack) unpacked to
    their codes less their zero (integers in -15..15, exact in x's dtype), multiplied on the tensor cores, and
    each output column's group scale applied to the product (BLOCK_K divides INT4_G: one group a row of the
    tile)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:  # a tile past the last expert's (the grid is sized for the worst case)
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair >= 0
    tok = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
    j = pid_n * BLOCK_I + tl.arange(0, BLOCK_I)
    j_ok = j < INTER
    acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    e64 = e.to(tl.int64)
    # PACKED: w is the int32 word view (as the GEMV); each 32-value group's scale is loaded once
    g_words = w_ptr + tl.multiple_of(e64 * stride_we + (2 * j).to(tl.int64) * (K // 8), [4])
    u_words = g_words + K // 8
    g_scales = s_ptr + e64 * stride_se + (2 * j) * (K // 32)
    u_scales = g_scales + K // 32
    for k0 in range(0, K, BLOCK_K):
        if PACKED:
            x_t = _x_tile(x_ptr + tok * stride_x, row_ok, k0, K, BLOCK_M, BLOCK_K)
            g_w = _dequant_tile(g_words, g_scales, j_ok, k0, K, BLOCK_I, BLOCK_K)
            u_w = _dequant_tile(u_words, u_scales, j_ok, k0, K, BLOCK_I, BLOCK_K)
            if UPCAST_DOT:
                x_t = x_t.to(tl.float32)
            else:
                g_w, u_w = g_w.to(x_t.dtype), u_w.to(x_t.dtype)
            acc_g += exact_dot(x_t, tl.trans(g_w))
            acc_u += exact_dot(x_t, tl.trans(u_w))
        else:  # INT4, FP8 or float: [BLOCK_I, BLOCK_K] tiles of the gate and up rows as stored
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x_t = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                          other=0.0)  # fmt: skip
            if INT4_G > 0:  # codes less their zero; one group scale a row of the tile
                c = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                w_mask = j_ok[:, None] & (c < K // 8)[None, :]
                g_row = w_ptr + e64 * stride_we + (2 * j).to(tl.int64)[:, None] * stride_wn + c[None, :]
                s_off = e64 * stride_se + (2 * j) * stride_sn + k0 // INT4_G
                g_t = _int4_tile(tl.load(g_row, mask=w_mask, other=0), _int4_zero(z_ptr, s_off, j_ok), BLOCK_I,
                                 BLOCK_K)  # fmt: skip
                u_t = _int4_tile(tl.load(g_row + stride_wn, mask=w_mask, other=0),
                                 _int4_zero(z_ptr, s_off + stride_sn, j_ok), BLOCK_I, BLOCK_K)  # fmt: skip
                g_sc = s_ptr + s_off
            else:
                w_mask = j_ok[:, None] & k_ok[None, :]
                g_row = w_ptr + e64 * stride_we + (2 * j).to(tl.int64)[:, None] * stride_wn + k[None, :]
                g_t = tl.load(g_row, mask=w_mask, other=0.0)
                u_t = tl.load(g_row + stride_wn, mask=w_mask, other=0.0)
                if FP8_BN > 0:  # block rows interleave
                    g_sc = s_ptr + e64 * stride_se + (2 * (j // FP8_BN)) * stride_sn + k0 // FP8_BK
            if UPCAST_DOT:
                x_t, g_t, u_t = x_t.to(tl.float32), g_t.to(tl.float32), u_t.to(tl.float32)
            else:
                g_t, u_t = g_t.to(x_t.dtype), u_t.to(x_t.dtype)
            if INT4_G > 0 or FP8_BN > 0:
                acc_g += exact_dot(x_t, tl.trans(g_t)) * tl.load(g_sc, mask=j_ok, other=0.0).to(tl.float32)[None, :]
                acc_u += exact_dot(x_t, tl.trans(u_t)) * tl.load(g_sc + stride_sn, mask=j_ok, other=0.0).to(
                    tl.float32)[None, :]  # fmt: skip
            else:
                acc_g += exact_dot(x_t, tl.trans(g_t))
                acc_u += exact_dot(x_t, tl.trans(u_t))
    dt = act_ptr.dtype.element_ty
    if b_ptr is not None:
        bias_row = b_ptr + e.to(tl.int64) * stride_be
        acc_g += tl.load(bias_row + 2 * j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_row + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    a = _expert_act(acc_g.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), alpha, limit)
    rows = tl.where(row_ok, pair, 0).to(tl.int64)
    tl.store(act_ptr + rows[:, None] * stride_act + j[None, :], a.to(dt), mask=row_ok[:, None] & j_ok[None, :])


@triton.jit
def _down_grouped_kernel(
    act_ptr, pairs_ptr, block_expert_ptr, wts_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_o,
    N: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr, UPCAST_DOT: tl.constexpr, FP8_BN: tl.constexpr = 0, FP8_BK: tl.constexpr = 0,
    z_ptr=None, INT4_G: tl.constexpr = 0,
):  # fmt: skip
    """out[pair, n] = weight[pair] · (act[pair] @ W_e^T + b_e)[n] (float32) for one tile of one expert's pairs.
    FP8_BN > 0 / INT4_G > 0: as _gate_up_grouped_kernel's FP8 / INT4 tiles."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair >= 0
    rows = tl.where(row_ok, pair, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    e64 = e.to(tl.int64)
    n_words = w_ptr + tl.multiple_of(e64 * stride_we + n.to(tl.int64) * (INTER // 8), [4])
    n_scales = s_ptr + e64 * stride_se + n * (INTER // 32)
    for k0 in range(0, INTER, BLOCK_K):
        if PACKED:
            a_t = _x_tile(act_ptr + rows * stride_act, row_ok, k0, INTER, BLOCK_M, BLOCK_K)
            w_t = _dequant_tile(n_words, n_scales, n_ok, k0, INTER, BLOCK_N, BLOCK_K)
            if UPCAST_DOT:
                a_t = a_t.to(tl.float32)
            else:
                w_t = w_t.to(a_t.dtype)
            acc += exact_dot(a_t, tl.trans(w_t))
        else:  # INT4, FP8 or float: a [BLOCK_N, BLOCK_K] tile as stored
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < INTER
            a_t = tl.load(act_ptr + rows[:, None] * stride_act + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                          other=0.0)  # fmt: skip
            if INT4_G > 0:
                c = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                w_words = tl.load(w_ptr + e64 * stride_we + n.to(tl.int64)[:, None] * stride_wn + c[None, :],
                                  mask=n_ok[:, None] & (c < INTER // 8)[None, :], other=0)  # fmt: skip
                s_off = e64 * stride_se + n * stride_sn + k0 // INT4_G
                w_t = _int4_tile(w_words, _int4_zero(z_ptr, s_off, n_ok), BLOCK_N, BLOCK_K)
            else:
                w_t = tl.load(w_ptr + e64 * stride_we + n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                              mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                if FP8_BN > 0:
                    s_off = e64 * stride_se + (n // FP8_BN) * stride_sn + k0 // FP8_BK
            if UPCAST_DOT:
                a_t, w_t = a_t.to(tl.float32), w_t.to(tl.float32)
            else:
                w_t = w_t.to(a_t.dtype)
            if INT4_G > 0 or FP8_BN > 0:
                w_sc = tl.load(s_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
                acc += exact_dot(a_t, tl.trans(w_t)) * w_sc[None, :]
            else:
                acc += exact_dot(a_t, tl.trans(w_t))
    dt = act_ptr.dtype.element_ty
    if b_ptr is not None:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    r = acc.to(dt)
    wt = tl.load(wts_ptr + rows, mask=row_ok, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_o + n[None, :], wt[:, None] * r.to(tl.float32),
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


# ---- launchers ----------------------------------------------------------------------------------------------

# float [E, N, K], MXFP4 (blocks, scales), FP8 block-scaled (quant.FP8BlockStack) or INT4 (quant.Int4GroupStack)
Weights = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | quant.FP8BlockStack | quant.Int4GroupStack
_NO_FP8 = (0, 0)


def _weight_args(name: str, w: Weights, n: int, k: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, bool, tuple[int, int]]:  # fmt: skip
    """(w, s, stride_we, stride_wn, stride_se, stride_sn, packed (MXFP4), FP8 block or (0, 0)) for the kernels,
    after checking the shapes."""
    if isinstance(w, quant.Int4GroupStack):
        check(w.shape[1:] == (n, k), f"{name}: INT4 words {list(w.data.shape)} do not hold [E, {n}, {k}]")
        check(w.data.stride(2) == 1 and w.data.stride(1) == k // 8 and w.scale.is_contiguous()
              and (w.zero is None or w.zero.is_contiguous()), f"{name}: INT4 words must be contiguous within each "
              "expert, scales and zeros contiguous")  # fmt: skip
        check(w.data.device == device, f"{name}: on another device than x")
        return (w.data, w.scale, w.data.stride(0), w.data.stride(1), w.scale.stride(0), w.scale.stride(1), False,
                _NO_FP8)  # fmt: skip
    if isinstance(w, quant.FP8BlockStack):
        check(w.shape[1:] == (n, k), f"{name}: FP8 data {list(w.shape)} is not [E, {n}, {k}]")
        check(w.paired == (name == "gate_up"), f"{name}: an FP8 stack {'with' if w.paired else 'without'} "
              "interleaved gate/up block rows; gate_up has them, down does not (quant.FP8BlockStack)")  # fmt: skip
        check(w.data.stride(2) == 1 and w.data.stride(1) == k and w.scale.stride(2) == 1
              and w.scale.stride(1) == w.scale.shape[2], f"{name}: FP8 data and scales must be contiguous "
              "within each expert")  # fmt: skip
        check(w.data.device == device, f"{name}: on another device than x")
        return (w.data, w.scale, w.data.stride(0), w.data.stride(1), w.scale.stride(0), w.scale.stride(1), False,
                w.block)  # fmt: skip
    if isinstance(w, tuple):
        blocks, scales = w
        mxfp4.check_packed(blocks, scales)
        check(blocks.dim() == 4 and blocks.shape[1:3] == (n, k // mxfp4.GROUP),
              f"{name}: blocks {tuple(blocks.shape)} do not hold [E, {n}, {k} / 32, 16]")  # fmt: skip
        check(blocks.stride(3) == 1 and blocks.stride(2) == 16 and blocks.stride(1) == k // 2,
              f"{name}: blocks must be contiguous within each expert")  # fmt: skip
        check(scales.stride(2) == 1 and scales.stride(1) == k // mxfp4.GROUP,
              f"{name}: scales must be contiguous within each expert")  # fmt: skip
        check(blocks.device == device and scales.device == device, f"{name}: on another device than x")
        return blocks, scales, blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1), True, _NO_FP8
    check_tensor(name, w, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check(w.shape[1:] == (n, k), f"{name}: shape {tuple(w.shape)} is not [E, {n}, {k}]")
    return w, w, w.stride(0), w.stride(1), 0, 0, False, _NO_FP8


def _gemv_words(w: torch.Tensor, stride_we: int, packed: bool) -> tuple[torch.Tensor, int]:
    """The kernels read MXFP4 blocks as int32 words (8 codes each): the blocks viewed so, and the expert
    stride in words. Every group then starts on 16 bytes, which the kernels assume for their vector loads."""
    if not packed:
        return w, stride_we
    check(w.data_ptr() % 16 == 0 and stride_we % 16 == 0, "blocks: each expert must start on 16 bytes")
    return w.view(torch.int32), stride_we // 4


_BARRIERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_RESIDENT: dict[tuple, tuple[int, int, int]] = {}  # key -> (programs that fit at once, registers, spilled bytes)


def _barrier(device: torch.device, programs: int) -> torch.Tensor:
    """The one-launch kernel's device-wide barrier for launches of this many programs: an int64 counter that only
    grows by whole launches (never reset, so graph replays need nothing), made outside any CUDA graph."""
    have = _BARRIERS.get((device, programs))
    if have is None:
        check(not torch.cuda.is_current_stream_capturing(),
              "fused_moe: run the batch-1 MoE once before capturing a CUDA graph (it allocates its barrier)")
        have = _BARRIERS[device, programs] = torch.zeros(1, dtype=torch.int64, device=device)
    return have


def _resident_programs(key: tuple, device: torch.device, launch) -> int:
    """How many one-warp programs of the one-launch kernel fit on the GPU at once (registers, shared memory, and 32
    blocks an SM), from a first launch that returns at once (dry) and gives the compiled kernel's resources."""
    if key not in _RESIDENT:
        k = launch(1, 1)
        props = torch.cuda.get_device_properties(device)
        per_sm = one_warp_blocks_per_sm(k.n_regs, k.metadata.shared, props.shared_memory_per_multiprocessor)
        _RESIDENT[key] = (per_sm * props.multi_processor_count, k.n_regs, k.n_spills)
    return _RESIDENT[key][0]


def one_warp_blocks_per_sm(regs: int, shared: int, shared_per_sm: int) -> int:
    """How many one-warp blocks of a kernel with these registers a thread and bytes of shared memory a block an
    SM of compute capability 9.0 holds at once: 64K registers (a warp's allocated in units of 8 a thread), the
    shared memory (plus the 1 KB the driver reserves a block) and at most 32 blocks."""
    fit = min(32, 65536 // (-(-max(1, regs) // 8) * 8 * 32))
    return min(fit, shared_per_sm // (shared + 1024)) if shared else fit


def takes_gemv_path(tokens: int, hidden: int, inter: int, gemv_max_rows: int = GEMV_MAX_ROWS) -> bool:
    """Whether fused_moe runs these tokens on the GEMV path (which reads its input as planes, norm.norm_planes)."""
    return tokens <= gemv_max_rows and hidden % 8 == 0 and inter % 8 == 0


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, top_k] int32, weights [T, top_k] float32), as reference.moe_route."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    t, e = logits.shape
    check(1 <= top_k <= e, f"top_k: {top_k} must be in 1..{e} experts")
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    wts = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, wts, logits.stride(0), E=e, TOP_K=top_k, BLOCK_E=next_pow2(e),
                            BLOCK_TK=next_pow2(top_k))  # fmt: skip
    return ids, wts


def top_k_share(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T] float32: the share of each token's top_k experts in the softmax over all its logits (≤ 1)."""
    v = logits.float()
    return torch.exp(torch.logsumexp(torch.topk(v, top_k, dim=-1).values, -1) - torch.logsumexp(v, -1))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) pairs, flattened as t·top_k + slot, sorted by expert into tiles of block_m -> (pairs
    [max_tiles · block_m] int32, -1 where a tile is padding; tile_expert [max_tiles] int32, -1 past the last tile).

    max_tiles = ceil(P / block_m) + E bounds any routing (each expert pads at most one partial tile), so nothing
    here waits for the device."""
    flat = ids.reshape(-1).long()  # [P]
    p = flat.numel()
    dev = ids.device
    max_tiles = -(-p // block_m) + num_experts
    order = torch.argsort(flat, stable=True)  # pair ids by expert
    # [E] pairs per expert (not torch.bincount: on CUDA it reads the maximum back to the host, which a graph
    # capture forbids)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    expert_of = flat[order]
    dest = (padded_end - padded)[expert_of] + torch.arange(p, device=dev) - starts[expert_of]
    pairs = torch.full((max_tiles * block_m,), -1, dtype=torch.int32, device=dev)
    pairs[dest] = order.to(torch.int32)
    tile_start = torch.arange(max_tiles, device=dev) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return pairs, tile_expert


def fused_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    top_k: int,
    *,
    gate_up: Weights,
    gate_up_bias: torch.Tensor | None,
    down: Weights,
    down_bias: torch.Tensor | None,
    alpha: float,
    limit: float,
    activation: str = "swiglu_oai",
    renormalize: bool = True,
    gemv_max_rows: int = GEMV_MAX_ROWS,
    x_planes: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Σ_k softmax-weighted down(act(gate_up(x))) over each token's top_k experts by `logits` -> [T, H] in x's
    dtype: reference.moe_route (with renormalize) followed by reference.moe_experts. x [T, H] (normed); logits
    [T, E]; gate_up [E, 2I, H] (rows interleaved gate/up) and down [E, H, I], float, MXFP4 (blocks, scales) or FP8
    (quant.FP8BlockStack, gate_up paired); biases [E, 2I] and [E, H], both or neither (None); activation
    "swiglu_oai" (with alpha and limit) or "silu" (reference.moe_activation). The GEMV path (T ≤ gemv_max_rows,
    H and I multiples of 8) only: x_planes, x again as float32 planes (norm.norm_planes writes them; made here
    otherwise); pdl, launch its kernels as programmatic dependents."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    t, h = x.shape
    e = logits.shape[1]
    check(logits.shape[0] == t, f"logits: {logits.shape[0]} rows for {t} tokens")
    check(activation in ("swiglu_oai", "silu"), f"activation: {activation!r} is not swiglu_oai or silu")
    if not renormalize:
        # The chosen experts' shares of the full softmax are the renormalised weights times the top-k's total
        # share: the same sum scaled per token (a torch epilogue; every published Qwen3-MoE renormalises).
        out = fused_moe(x, logits, top_k, gate_up=gate_up, gate_up_bias=gate_up_bias, down=down,
                        down_bias=down_bias, alpha=alpha, limit=limit, activation=activation,
                        gemv_max_rows=gemv_max_rows, x_planes=x_planes, pdl=pdl)  # fmt: skip
        return (out.float() * top_k_share(logits, top_k)[:, None]).to(out.dtype)
    inter = (gate_up[0] if isinstance(gate_up, tuple) else gate_up).shape[1] // 2  # the stacks have a shape
    check((gate_up_bias is None) == (down_bias is None), "biases: give both gate_up_bias and down_bias, or neither")
    if gate_up_bias is not None and down_bias is not None:
        check_tensor("gate_up_bias", gate_up_bias, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        check_tensor("down_bias", down_bias, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        check(gate_up_bias.shape == (e, 2 * inter) and down_bias.shape == (e, h),
              f"biases: {tuple(gate_up_bias.shape)} / {tuple(down_bias.shape)} are not [{e}, {2 * inter}] / "
              f"[{e}, {h}]")  # fmt: skip
    check(h % 2 == 0 and inter % 2 == 0, f"x: hidden {h} and intermediate {inter} must be even")
    check(1 <= top_k <= e, f"top_k: {top_k} must be in 1..{e} experts")
    w1, s1, we1, wn1, se1, sn1, packed1, fp8_1 = _weight_args("gate_up", gate_up, 2 * inter, h, x.device)
    w2, s2, we2, wn2, se2, sn2, packed2, fp8_2 = _weight_args("down", down, h, inter, x.device)
    check(packed1 == packed2 and (fp8_1 == _NO_FP8) == (fp8_2 == _NO_FP8)
          and isinstance(gate_up, quant.Int4GroupStack) == isinstance(down, quant.Int4GroupStack),
          "gate_up/down: both MXFP4, both FP8 or both float (or both INT4)")  # fmt: skip
    # INT4: the group (a power of two >= 16) and the zeros (None: symmetric); a grouped tile's K lies in one group
    int4_g = gate_up.group if isinstance(gate_up, quant.Int4GroupStack) else 0
    z1 = gate_up.zero if isinstance(gate_up, quant.Int4GroupStack) else None
    z2 = down.zero if isinstance(down, quant.Int4GroupStack) else None
    check(not int4_g or isinstance(down, quant.Int4GroupStack) and down.group == int4_g
          and (z1 is None) == (z2 is None), "gate_up/down: INT4 stacks of one group, both with zeros or neither")
    # FP8: a GEMV step's inputs and a grouped tile's K lie in one block of columns
    gemv_k1, gemv_k2 = (min(GEMV_FLOAT_K, fp8_1[1]), min(GEMV_FLOAT_K, fp8_2[1])) if fp8_1 != _NO_FP8 else \
        (GEMV_FLOAT_K, GEMV_FLOAT_K)  # fmt: skip
    if int4_g:
        gemv_k1 = gemv_k2 = min(GEMV_FLOAT_K, int4_g)
    # Without biases the kernels get None pointers (stride 0), with "silu" a None alpha and limit: constexpr
    # None to Triton, which compiles the loads and the clamps out.
    sb1 = gate_up_bias.stride(0) if gate_up_bias is not None else 0
    sb2 = down_bias.stride(0) if down_bias is not None else 0
    a_arg, l_arg = (None, None) if activation == "silu" else (float(alpha), float(limit))
    out = torch.empty_like(x)
    if t == 0:
        return out
    pairs_n = t * top_k
    if takes_gemv_path(t, h, inter, gemv_max_rows):
        ids = torch.empty(pairs_n, dtype=torch.int32, device=x.device)
        wts = torch.empty(pairs_n, dtype=torch.float32, device=x.device)
        xp = x_planes  # x as planes (_plane_loads), from norm.norm_planes where the caller has them
        if xp is None:
            xp = torch.empty((t, h), dtype=torch.float32, device=x.device)
            _planes_kernel[(t,)](x, xp, x.stride(0), xp.stride(0), K=h, BLOCK=min(next_pow2(h), 1024), num_warps=4)
        check(xp.shape == (t, h) and xp.dtype == torch.float32 and xp.stride(1) == 1 and xp.device == x.device,
              f"x_planes: {tuple(xp.shape)} {xp.dtype} on {xp.device} is not x's [{t}, {h}] as contiguous float32 "
              "planes on x's device")  # fmt: skip
        act_p = torch.empty((pairs_n, inter), dtype=torch.float32, device=x.device)
        gw1, gwe1 = _gemv_words(w1, we1, packed1)
        gw2, gwe2 = _gemv_words(w2, we2, packed2)
        part = torch.empty((pairs_n, h), dtype=torch.float32, device=x.device)
        blocks = triton.cdiv(h, GEMV_DOWN_ROWS)
        counters = arrival_counters("fused_moe", x.device, max(t, GEMV_MAX_ROWS) * blocks)
        if t == 1 and packed1 and packed2 and ONE_LAUNCH and not INTERPRETING:
            programs = max(triton.cdiv(inter, GEMV_PAIRS), blocks) * top_k

            def launch(grid: int, dry: int):
                return _one_launch_kernel[(grid,)](
                    x, xp, logits, ids, wts, gw1, s1, gate_up_bias, act_p, gw2, s2, down_bias, part, counters, out,
                    _barrier(x.device, programs), dry, xp.stride(0), logits.stride(0), gwe1, wn1, se1,
                    sb1, act_p.stride(0), gwe2, wn2, se2, sb2, out.stride(0), a_arg, l_arg,
                    K=h, INTER=inter, E=e, TOP_K=top_k, BLOCK_E=next_pow2(e), BLOCK_TK=next_pow2(top_k),
                    BLOCK_I=GEMV_PAIRS, BLOCK_N=GEMV_DOWN_ROWS, GB1=GEMV_GROUPS, GB2=GEMV_GROUPS, PACKED=True,
                    WARM=ONE_LAUNCH_WARM, WARM_LINES=next_pow2(triton.cdiv(inter // 8, 32)),
                    SPIN_NS=ONE_LAUNCH_SPIN_NS, USE_PDL=pdl,
                    num_warps=1, maxnreg=ONE_LAUNCH_MAXNREG, launch_cooperative_grid=ONE_LAUNCH_COOPERATIVE,
                    **pdl_launch(pdl),
                )  # fmt: skip

            key = (x.device, h, inter, e, top_k, pdl, ONE_LAUNCH_WARM, ONE_LAUNCH_SPIN_NS, ONE_LAUNCH_MAXNREG,
                   ONE_LAUNCH_COOPERATIVE, gate_up_bias is None, activation)
            if programs <= _resident_programs(key, x.device, launch):
                launch(programs, 0)
                return out
        gb1 = GEMV_GROUPS if packed1 or int4_g else gemv_k1  # INT4: GB groups of 4 words a step
        _gate_up_gemv_kernel[(triton.cdiv(inter, GEMV_PAIRS), pairs_n)](
            x, xp, logits, ids, wts, gw1, s1, gate_up_bias, act_p,
            xp.stride(0), logits.stride(0), gwe1, wn1, se1, sb1, act_p.stride(0), a_arg, l_arg,
            K=h, INTER=inter, E=e, TOP_K=top_k, BLOCK_E=next_pow2(e),
            BLOCK_TK=next_pow2(top_k), BLOCK_I=GEMV_PAIRS, GB=gb1, PACKED=packed1, FP8_BN=fp8_1[0], FP8_BK=fp8_1[1],
            USE_PDL=pdl, z_ptr=z1, INT4_G=int4_g, num_warps=1,
            **pdl_launch(pdl),
        )  # fmt: skip
        _down_gemv_kernel[(blocks, t, top_k)](
            act_p, ids, wts, gw2, s2, down_bias, part, counters, out,
            act_p.stride(0), gwe2, wn2, se2, sb2, out.stride(0),
            N=h, INTER=inter, TOP_K=top_k, BLOCK_N=GEMV_DOWN_ROWS, GB=GEMV_GROUPS if packed2 or int4_g else gemv_k2,
            PACKED=packed2, FP8_BN=fp8_2[0], FP8_BK=fp8_2[1], USE_PDL=pdl, z_ptr=z2, INT4_G=int4_g, num_warps=1,
            **pdl_launch(pdl),
        )  # fmt: skip
        return out
    act = torch.empty((pairs_n, inter), dtype=x.dtype, device=x.device)
    ids, wts = route(logits, top_k)
    # Each program dequantizes its expert's weight tile once for its BLOCK_M pairs, which is most of its work:
    # decode-sized batches spread thin over the experts take 16-row tiles, prefill chunks (hundreds of pairs an
    # expert) 128-row ones.
    block_m = 16 if pairs_n <= 16 * e else (64 if pairs_n <= 128 * e else 128)
    warps = 8 if block_m == 128 else 4
    pairs, tile_expert = align_by_expert(ids, e, block_m)
    tiles = tile_expert.shape[0]
    block_i, block_n = 32, 64
    gw1, gwe1 = _gemv_words(w1, we1, packed1)
    gw2, gwe2 = _gemv_words(w2, we2, packed2)
    _gate_up_grouped_kernel[(tiles, triton.cdiv(inter, block_i))](
        x, pairs, tile_expert, gw1, s1, gate_up_bias, act,
        x.stride(0), gwe1, wn1, se1, sn1, sb1, act.stride(0), a_arg, l_arg,
        K=h, INTER=inter, TOP_K=top_k, BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_K=128 if packed1 else min(64, gemv_k1),
        PACKED=packed1, UPCAST_DOT=INTERPRETING, FP8_BN=fp8_1[0], FP8_BK=fp8_1[1], z_ptr=z1, INT4_G=int4_g,
        num_warps=warps,
    )  # fmt: skip
    per_pair = torch.empty((pairs_n, h), dtype=torch.float32, device=x.device)
    _down_grouped_kernel[(tiles, triton.cdiv(h, block_n))](
        act, pairs, tile_expert, wts, gw2, s2, down_bias, per_pair,
        act.stride(0), gwe2, wn2, se2, sn2, sb2, per_pair.stride(0),
        N=h, INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128 if packed2 else min(64, gemv_k2),
        PACKED=packed2, UPCAST_DOT=INTERPRETING, FP8_BN=fp8_2[0], FP8_BK=fp8_2[1], z_ptr=z2, INT4_G=int4_g,
        num_warps=warps,
    )  # fmt: skip
    out.copy_(per_pair.view(t, top_k, h).sum(1))  # the top_k slots of each token in a fixed order
    return out
