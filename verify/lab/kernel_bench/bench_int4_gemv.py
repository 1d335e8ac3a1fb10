"""Variants of the batch-1 INT4 GEMV (kernels/quant_gemv.py _int4_gemv_kernel) at Llama-3.1-8B's shapes, to find
which of its suspected costs keeps it at ~4x its byte floor on the H100 (lab code, not product).

    python3 -P -m envex.verify.lab.kernel_bench.bench_int4_gemv --out $OUT --commit C

Plain y = x @ dequantize(W)^T, x [1, K] bf16, int4_group asymmetric with groups of 128 inputs only (16 words a
group), no prologue, no bias; K a multiple of BLOCK_K. Each variant keeps the product's step-ahead prefetch (the
next chunk's words, scales and zeros requested before the current chunk's math) and its float32 sums:
  v0_replica       the product's kernel with K a runtime argument (the control: the launcher and K's
                   specialization cost nothing).
  v1_group_scales  the product's arithmetic, but the words tile is [BLOCK_N, GC, 16] (GC = BLOCK_K / 128 groups
                   a chunk) and the scale and zero [BLOCK_N, GC, 1] are loaded once a group, not once a word.
  v2_strided_x     the product's 2-D tile, the inputs of nibble j loaded as 8 strided [BW] loads, not one
                   [BW, 8] load split into columns (tl.split: layout conversions).
  v3_both          v1 and v2.
  v4_one_group     BLOCK_K = 128: one group a chunk, a [BLOCK_N, 16] words tile, scale and zero [BLOCK_N];
                   BLOCK_N large (32..128) to keep the bytes a thread up; x as v2.
  v5_zero_fold     v3's tile, with each code made as the float 1 + u/16 (the nibble shifted to the top of the
                   mantissa of 1.0: shift, and, or; no float subtract a weight) and the zero folded out:
                   Σ_j (u_j - z) x_j = 16 (Σ_j c_j x_j - (1 + z/16) Σ_j x_j), the word's Σ_j x_j once a chunk.
  v6_perm_x        v3 on a weight repacked once (prepare): nibble j of a group's word c holds the group's input
                   16j + c, so x_j of a group's 16 words is 16 consecutive inputs (vector loads, in the words'
                   layout) instead of 16 inputs 8 apart.
  v7_native        v6 with the nibbles read where they lie (Marlin's trick in float32): (w & 0xF << 4p) | the
                   exponent of 2^(23-4p) is the float 2^(23-4p) + u exactly for p <= 4 (nibbles 5..7 from w >> 12,
                   one shift a word), less 2^(23-4p) + zero: and|or (one LOP3), sub, FMA a weight instead of the
                   product's SHF, SGXT, LOP3, sub, FMA (its bfe.u32 in the H100's SASS, compiled offline); each
                   term equals the product's.
Per shape: quant_gemv at its default config, every variant over its CONFIGS, each timed in CUDA graphs over copies
of the weight exceeding L2 (bench_quant_gemm.copies), each output's relative error against float64 and against
quant_gemv; written to int4_gemv_variants.json, one line per shape and variant printed with the best.
--variants v3_both,v7_native times only those.

    python3 -P -m envex.verify.lab.kernel_bench.bench_int4_gemv --sass

needs no GPU: compiles quant_gemv's kernel (its default config) and every variant's configs for sm_90 and prints
the SASS of each one's K loop by opcode (cuobjdump from Triton's wheel): one step's instructions, barriers (BAR:
layout conversions through shared memory) and loads. Before any H100 run (Triton 3.9, 2026-12-07) it showed, per
step of 64 weights a thread: quant_gemv 472 instructions with 16 BAR and 16 scalar scale/zero loads; the variants'
barriers depend on the config (v3 at 8,1024,4: 32 BAR; at 16,512,4: none); v7 at 16,512,4: 385, no BAR.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from envex.kernels import quant
from envex.kernels.accuracy import rel_err
from envex.kernels.quant_gemv import (
    DEFAULT_CONFIGS,
    TWO_23,
    _columns_of_8,
    _int4_gemv_kernel,
    _int4_group_params,
    int4_word_dot,
    quant_gemv,
)
from envex.verify.lab.kernel_bench._bench_lib import graph_time_ms, measure_bandwidth
from envex.verify.lab.kernel_bench.bench_quant_gemm import copies

GROUP = 128  # inputs a group: the only group the variants take
SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
MAX_REL_ERR = 1e-2  # against float64, as bench_quant_gemm checks


# ---- shared helpers -----------------------------------------------------------------------------------------------


@triton.jit
def _load_words(w_rows, wcol, ok):
    """Words at columns wcol of rows w_rows (broadcasting shapes), streamed once: evict_first as the product."""
    return tl.load(w_rows + wcol, mask=ok, other=0, eviction_policy="evict_first")


@triton.jit
def _x_strided(x_ptr, offs, STEP: tl.constexpr):
    """x_j = x[offs + j · STEP], j = 0..7, as 8 loads of offs' shape, float32 (STEP 1: the 8 inputs of words at
    offs = 8 · word; STEP 16: v6's permuted groups)."""
    base = x_ptr + offs
    return (tl.load(base).to(tl.float32), tl.load(base + STEP).to(tl.float32),
            tl.load(base + 2 * STEP).to(tl.float32), tl.load(base + 3 * STEP).to(tl.float32),
            tl.load(base + 4 * STEP).to(tl.float32), tl.load(base + 5 * STEP).to(tl.float32),
            tl.load(base + 6 * STEP).to(tl.float32), tl.load(base + 7 * STEP).to(tl.float32))  # fmt: skip


@triton.jit
def _x_split(x_ptr, wc, BW: tl.constexpr):
    """The product's way: the inputs of words wc [BW] as one contiguous [BW, 8] load split into its 8 columns."""
    x = tl.load(x_ptr + wc[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.float32)
    return _columns_of_8(x, BW)


@triton.jit
def _unit_code(words, j: tl.constexpr):
    """1 + u_j / 16 as a float32: nibble j (bits 4j..4j+3) moved to bits 19..22, the top of 1.0's mantissa."""
    SH: tl.constexpr = 19 - 4 * j
    if SH >= 0:
        t = words << SH
    else:
        t = words >> (-SH)  # sign-fill lands above bit 22: masked off
    return ((t & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _unit_word_dot(words, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ_j (1 + u_j/16) x_j per word, in order j = 0..7 (x_j broadcasting against words)."""
    return (_unit_code(words, 0) * x0 + _unit_code(words, 1) * x1 + _unit_code(words, 2) * x2
            + _unit_code(words, 3) * x3 + _unit_code(words, 4) * x4 + _unit_code(words, 5) * x5
            + _unit_code(words, 6) * x6 + _unit_code(words, 7) * x7)  # fmt: skip


@triton.jit
def _native_code(words, P: tl.constexpr):
    """2^(23 - 4P) + u as a float32, u the nibble at bits 4P..4P+3 (P <= 4), read where it lies by one and|or
    (one LOP3, no shift): under the exponent of 2^(23 - 4P) a mantissa bit 4P is worth 1."""
    return ((words & (0xF << (4 * P))) | ((150 - 4 * P) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _native_word_dot(words, z, x0, x1, x2, x3, x4, x5, x6, x7):
    """int4_word_dot with the nibbles read in place: nibbles 0..4 from the word, 5..7 from words >> 12 (one shift
    a word) at bits 8, 12, 16; z = 2^23 + zero. (2^(23-4P) + u) - (2^(23-4P) + zero) = u - zero exactly, so each
    term equals the product's."""
    zr = z - TWO_23
    z1 = zr + 524288.0  # 2^19 + zero
    z2 = zr + 32768.0
    z3 = zr + 2048.0
    z4 = zr + 128.0
    hi = words >> 12  # nibbles 5, 6, 7 to bits 8.., 12.., 16..; the sign fill lies above every mask
    return ((_native_code(words, 0) - z) * x0 + (_native_code(words, 1) - z1) * x1
            + (_native_code(words, 2) - z2) * x2 + (_native_code(words, 3) - z3) * x3
            + (_native_code(words, 4) - z4) * x4 + (_native_code(hi, 2) - z2) * x5
            + (_native_code(hi, 3) - z3) * x6 + (_native_code(hi, 4) - z4) * x7)  # fmt: skip


# ---- the variants -------------------------------------------------------------------------------------------------


@triton.jit
def _per_word_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, KW, stride_wn, stride_sn, stride_zn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STRIDED_X: tl.constexpr):  # fmt: skip
    """v0 (STRIDED_X off: the product's kernel, K at run time) and v2 (on): [BLOCK_N, BW] words, a scale and zero
    loaded a word."""
    BW: tl.constexpr = BLOCK_K // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)[:, None]
    w_rows = w_ptr + rows64 * stride_wn
    cw = tl.arange(0, BW)
    ok = row_ok[:, None] & (cw < KW)[None, :]
    w_next = _load_words(w_rows, cw[None, :], ok)
    s_next, z_next = _int4_group_params(s_ptr, z_ptr, rows64, (cw // 16)[None, :], ok, stride_sn, stride_zn, True)
    acc = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
    for w0 in range(0, KW, BW):
        words, s, z = w_next, s_next, z_next
        wc = w0 + cw
        ahead = wc + BW
        ok = row_ok[:, None] & (ahead < KW)[None, :]
        w_next = _load_words(w_rows, ahead[None, :], ok)
        s_next, z_next = _int4_group_params(s_ptr, z_ptr, rows64, (ahead // 16)[None, :], ok, stride_sn, stride_zn,
                                            True)  # fmt: skip
        if STRIDED_X:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_strided(x_ptr, wc * 8, 1)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_split(x_ptr, wc, BW)
        d = int4_word_dot(words, z, x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :],
                          x6[None, :], x7[None, :])  # fmt: skip
        acc += d * s
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _per_group_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, KW, stride_wn, stride_sn, stride_zn,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STRIDED_X: tl.constexpr,
                      ZERO_FOLD: tl.constexpr, PERM_X: tl.constexpr, NATIVE: tl.constexpr):  # fmt: skip
    """v1 (STRIDED_X off), v3 (on), v5 (ZERO_FOLD, strided x), v6 (PERM_X: the weight permuted by prepare), v7 (v6
    with NATIVE: the nibbles read in place, _native_word_dot):
    words [BLOCK_N, GC, 16], a group's 16 words on the last axis; its scale and zero [BLOCK_N, GC, 1], loaded once
    a group."""
    GC: tl.constexpr = BLOCK_K // 128  # groups a chunk
    BW: tl.constexpr = BLOCK_K // 8
    KG = KW // 16
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    r3 = rows.to(tl.int64)[:, None, None]
    ok3 = row_ok[:, None, None]
    w_rows = w_ptr + r3 * stride_wn
    g3 = tl.arange(0, GC)[None, :, None]  # a chunk's groups [1, GC, 1]
    wcol = g3 * 16 + tl.arange(0, 16)[None, None, :]  # a chunk's words [1, GC, 16]
    w_next = _load_words(w_rows, wcol, ok3 & (wcol < KW))
    s_next, z_next = _int4_group_params(s_ptr, z_ptr, r3, g3, ok3 & (g3 < KG), stride_sn, stride_zn, True)
    acc = tl.zeros([BLOCK_N, GC, 16], dtype=tl.float32)
    for w0 in range(0, KW, BW):
        words, s, z = w_next, s_next, z_next  # [BLOCK_N, GC, 16] words, [BLOCK_N, GC, 1] scale and 2^23 + zero
        wc = w0 + wcol
        w_next = _load_words(w_rows, wc + BW, ok3 & (wc + BW < KW))
        ga = (w0 + BW) // 16 + g3
        s_next, z_next = _int4_group_params(s_ptr, z_ptr, r3, ga, ok3 & (ga < KG), stride_sn, stride_zn, True)
        if PERM_X:  # nibble j of a group's word c holds input 16j + c of the group: x_j contiguous along c
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_strided(x_ptr, w0 * 8 + g3 * 128 + tl.arange(0, 16)[None, None, :], 16)
        elif STRIDED_X:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_strided(x_ptr, wc * 8, 1)  # [1, GC, 16] each
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = _x_split(x_ptr, w0 + tl.arange(0, BW), BW)
            x0, x1, x2, x3 = (tl.reshape(c0, [1, GC, 16]), tl.reshape(c1, [1, GC, 16]), tl.reshape(c2, [1, GC, 16]),
                              tl.reshape(c3, [1, GC, 16]))  # fmt: skip
            x4, x5, x6, x7 = (tl.reshape(c4, [1, GC, 16]), tl.reshape(c5, [1, GC, 16]), tl.reshape(c6, [1, GC, 16]),
                              tl.reshape(c7, [1, GC, 16]))  # fmt: skip
        if ZERO_FOLD:  # Σ_j (1 + u_j/16) x_j - (1 + z/16) Σ_j x_j = Σ_j (u_j - z) x_j / 16
            xw = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
            zz = 1.0 + (z - TWO_23) * 0.0625
            acc += (_unit_word_dot(words, x0, x1, x2, x3, x4, x5, x6, x7) - zz * xw) * s
        elif NATIVE:
            acc += _native_word_dot(words, z, x0, x1, x2, x3, x4, x5, x6, x7) * s
        else:
            acc += int4_word_dot(words, z, x0, x1, x2, x3, x4, x5, x6, x7) * s
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if ZERO_FOLD:
        y = y * 16.0
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _one_group_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, KW, stride_wn, stride_sn, stride_zn,
                      BLOCK_N: tl.constexpr):  # fmt: skip
    """v4: a chunk is one group: words [BLOCK_N, 16], scale and zero [BLOCK_N, 1]; x as 8 strided [16] loads."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)[:, None]
    ok = row_ok[:, None]
    w_rows = w_ptr + rows64 * stride_wn
    cw = tl.arange(0, 16)[None, :]
    w_next = _load_words(w_rows, cw, ok)
    s_next, z_next = _int4_group_params(s_ptr, z_ptr, rows64, 0, ok, stride_sn, stride_zn, True)  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for w0 in range(0, KW, 16):
        words, s, z = w_next, s_next, z_next
        more = ok & (w0 + 16 + tl.zeros([BLOCK_N, 1], dtype=tl.int32) < KW)  # [BLOCK_N, 1]: a next chunk
        w_next = _load_words(w_rows, w0 + 16 + cw, more)
        s_next, z_next = _int4_group_params(s_ptr, z_ptr, rows64, w0 // 16 + 1, more, stride_sn, stride_zn, True)
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_strided(x_ptr, (w0 + cw) * 8, 1)  # [1, 16] each
        acc += int4_word_dot(words, z, x0, x1, x2, x3, x4, x5, x6, x7) * s
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_ok)


# name -> (kernel, its constexpr flags); each name compiles to its own kernel
_GROUP_FLAGS = {"STRIDED_X": True, "ZERO_FOLD": False, "PERM_X": False, "NATIVE": False}
VARIANTS: dict[str, tuple] = {
    "v0_replica": (_per_word_kernel, {"STRIDED_X": False}),
    "v1_group_scales": (_per_group_kernel, {**_GROUP_FLAGS, "STRIDED_X": False}),
    "v2_strided_x": (_per_word_kernel, {"STRIDED_X": True}),
    "v3_both": (_per_group_kernel, _GROUP_FLAGS),
    "v4_one_group": (_one_group_kernel, {}),
    "v5_zero_fold": (_per_group_kernel, {**_GROUP_FLAGS, "ZERO_FOLD": True}),
    "v6_perm_x": (_per_group_kernel, {**_GROUP_FLAGS, "PERM_X": True}),
    "v7_native": (_per_group_kernel, {**_GROUP_FLAGS, "PERM_X": True, "NATIVE": True}),
}
PERMUTED = {"v6_perm_x", "v7_native"}  # variants that take prepare()'s permuted weight
# (BLOCK_N, BLOCK_K, num_warps) per variant: the product's best two first where they apply, then around them
_GROUPED = [(8, 1024, 4), (8, 512, 4), (16, 512, 4), (16, 1024, 4), (4, 1024, 4), (8, 256, 4), (16, 1024, 8),
            (32, 512, 8)]  # fmt: skip
CONFIGS: dict[str, list[tuple[int, int, int]]] = {
    "v0_replica": [(8, 1024, 4), (8, 512, 4)],
    "v1_group_scales": _GROUPED,
    "v2_strided_x": [(8, 1024, 4), (8, 512, 4), (16, 512, 4), (16, 1024, 4), (4, 1024, 4), (16, 1024, 8)],
    "v3_both": _GROUPED,
    "v4_one_group": [(bn, 128, w) for bn in (32, 64, 128) for w in (4, 8)],
    "v5_zero_fold": _GROUPED,
    "v6_perm_x": _GROUPED,
    "v7_native": _GROUPED,
}


def prepare(variant: str, w: quant.PackedWeight) -> quant.PackedWeight:
    """The weight `variant` takes: w itself, or for PERMUTED ones w with each group's codes reordered so that
    nibble j of the group's word c holds input 16j + c of the group (x_j of a group's 16 words: 16 consecutive
    inputs, one vector load), scales and zeros unchanged. A load-time repacking, as Marlin's; done once, untimed."""
    if variant not in PERMUTED:
        return w
    n, k = w.shape
    if w.group != GROUP or k % GROUP:
        raise ValueError(f"{variant}: K = {k} must be a multiple of the group {GROUP}")
    u = quant.unpack_int4(w.data, k).view(n, k // GROUP, 8, 16).transpose(2, 3).reshape(n, k)
    return dataclasses.replace(w, data=quant.pack_int4(u).contiguous())


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def run(variant: str, x: torch.Tensor, w: quant.PackedWeight, config: tuple[int, int, int]) -> torch.Tensor:
    """y [1, N] = x [1, K] @ dequantize(W)^T in x's dtype by `variant` at config (BLOCK_N, BLOCK_K, num_warps), w
    being prepare(variant, W); ValueError, in one line, for what the variant does not take."""
    kernel, flags = VARIANTS[variant]
    block_n, block_k, num_warps = config
    n, k = w.shape
    if w.scheme != quant.INT4_GROUP or w.group != GROUP or w.zero is None:
        raise ValueError(f"{variant}: takes int4_group with group {GROUP} and zeros only, got {w.scheme} "
                         f"group {w.group} zero {'none' if w.zero is None else 'uint8'}")  # fmt: skip
    if tuple(x.shape) != (1, k) or not x.is_contiguous():
        raise ValueError(f"{variant}: x must be a contiguous [1, {k}], got {tuple(x.shape)}")
    if kernel is _one_group_kernel and block_k != GROUP:
        raise ValueError(f"{variant}: BLOCK_K must be the group, {GROUP}; got {block_k}")
    min_k = GROUP if kernel is _per_group_kernel else 8
    if not (_pow2(block_n) and _pow2(block_k) and _pow2(num_warps) and block_k >= min_k and k % block_k == 0):
        raise ValueError(f"{variant}: config {config}: powers of two, BLOCK_K >= {min_k} dividing K = {k}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    extra = {} if kernel is _one_group_kernel else {"BLOCK_K": block_k}
    kernel[(triton.cdiv(n, block_n),)](
        x, w.data, w.scale, w.zero, out, n, k // 8, w.data.stride(0), w.scale.stride(0), w.zero.stride(0),
        BLOCK_N=block_n, num_warps=num_warps, **extra, **flags,
    )  # fmt: skip
    return out


# ---- the bench ----------------------------------------------------------------------------------------------------


def _timed(call, ref: torch.Tensor, product: torch.Tensor) -> dict:
    """call(i) checked against float64 (ref) and quant_gemv (product), then timed; an error is recorded, not fatal."""
    try:
        y = call(0)
        entry: dict = {"rel_err": rel_err(y, ref), "rel_err_vs_product": rel_err(y, product)}
        entry["ok"] = entry["rel_err"] < MAX_REL_ERR
        entry["us"] = round(graph_time_ms(call, n_inner=20) * 1e3, 2) if entry["ok"] else None
    except Exception as exc:
        entry = {"error": f"{type(exc).__name__}: {exc}"[:300], "ok": False, "us": None}
    return entry


def _product_call(x: torch.Tensor, ws: list, i: int) -> torch.Tensor:
    return quant_gemv(x, ws[i % len(ws)])[0]


def _variant_call(variant: str, x: torch.Tensor, ws: list, cfg: tuple[int, int, int], i: int) -> torch.Tensor:
    return run(variant, x, ws[i % len(ws)], cfg)


def _shape(name: str, n: int, k: int, dev: torch.device, gen: torch.Generator, read_tbps: float) -> dict:
    """One shape: the floor, quant_gemv's default and every variant's configs with the best; one line each."""
    w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
    ws = copies(quant.quantize_int4(w, GROUP, symmetric=False))
    del w
    x = torch.randn(1, k, generator=gen, device=dev).bfloat16()
    ref = x.double() @ quant.dequantize(ws[0], torch.float64).t()
    product = quant_gemv(x, ws[0])[0]
    floor = round(ws[0].nbytes / (read_tbps * 1e12) * 1e6, 2)
    entry: dict = {"n": n, "k": k, "copies": len(ws), "floor_us": floor}
    default = _timed(partial(_product_call, x, ws), ref, product)
    entry["product"] = {"config": ",".join(map(str, DEFAULT_CONFIGS[quant.INT4_GROUP])), **default}
    print(name, f"N={n} K={k} floor_us", floor, "product", entry["product"]["config"], default["us"], flush=True)
    for variant, configs in CONFIGS.items():
        vws = [prepare(variant, w) for w in ws]
        timed = {",".join(map(str, c)): _timed(partial(_variant_call, variant, x, vws, c), ref, product)
                 for c in configs}  # fmt: skip
        del vws
        fine = {c: e["us"] for c, e in timed.items() if e["us"] is not None}
        best = min(fine, key=fine.__getitem__) if fine else None
        entry[variant] = {"best": best, "best_us": fine.get(best), "all": timed}
        print(name, variant, "best", best, fine.get(best), f"({fine[best] / floor:.2f}x floor)" if best else "",
              "failed:", [c for c, e in timed.items() if not e["ok"]], flush=True)  # fmt: skip
    return entry


def bench(report: dict, dev: torch.device, gen: torch.Generator, save=lambda: None) -> None:
    """report["shapes"][shape] for each of SHAPES (save() after each: a run cut short keeps what ran)."""
    for shape_name, (n, k) in SHAPES.items():
        t0 = time.perf_counter()
        report["shapes"][shape_name] = _shape(shape_name, n, k, dev, gen, report["bandwidth"]["read_TBps"])
        report["shapes"][shape_name]["seconds"] = round(time.perf_counter() - t0, 1)
        save()


def loop_sass(kernel, constexprs: dict, num_warps: int, signature: dict) -> collections.Counter:
    """kernel compiled for sm_90 (no GPU needed; every pointer and int argument taken as 16-aligned, as the launches
    here specialize them) -> the SASS opcodes of its longest backward-branch loop (the K loop), counted."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else signature.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs and n != "eps"}
    src = ASTSource(kernel, sig, constexprs={(names.index(c),): v for c, v in constexprs.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(code)}
    loop = (0, -1)
    for i, (a, t) in enumerate(code):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and i - at.get(int(m.group(1), 16), i) > loop[1] - loop[0]:
            loop = (at[int(m.group(1), 16)], i)
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for _, t in code[loop[0]:loop[1] + 1])  # fmt: skip


def sass_report() -> None:
    """One line per kernel and config: the K loop's SASS instructions, BAR, LDG, and the commonest opcodes."""
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16"}
    bn, bk, nw = DEFAULT_CONFIGS[quant.INT4_GROUP]
    product = {"K": 4096, "PROLOGUE": 0, "HAS_BIAS": False, "HAS_ZERO": True, "GROUP": GROUP, "BLOCK_N": bn,
               "BLOCK_K": bk, "USE_PDL": False}  # fmt: skip
    rows = [("quant_gemv", (bn, bk, nw), _int4_gemv_kernel, product, {n: "*bf16" for n in _int4_gemv_kernel.arg_names
                                                                      if n.endswith("_ptr")} | ptrs)]  # fmt: skip
    rows[0][4].update({"w_ptr": "*i32", "z_ptr": "*u8", "eps": "fp32"})
    for variant, configs in CONFIGS.items():
        kernel, flags = VARIANTS[variant]
        for c in configs:
            consts = {"BLOCK_N": c[0], **flags, **({} if kernel is _one_group_kernel else {"BLOCK_K": c[1]})}
            rows.append((variant, c, kernel, consts, ptrs))
    for name, cfg, kernel, consts, sig in rows:
        ops = loop_sass(kernel, consts, cfg[2], sig)
        print(f"{name:16s} {','.join(map(str, cfg)):10s} loop {sum(ops.values()):4d} BAR {ops['BAR']:3d} "
              f"LDG {ops['LDG']:3d}", dict(ops.most_common(8)), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sass", action="store_true", help="print each kernel's K-loop SASS (no GPU) instead")
    ap.add_argument("--commit", default="")
    ap.add_argument("--variants", default="", help="comma-separated names to time (default: all of CONFIGS)")
    args = ap.parse_args()
    if args.variants:
        unknown = set(args.variants.split(",")) - set(CONFIGS)
        if unknown:
            raise SystemExit(f"bench_int4_gemv: unknown variants {sorted(unknown)}; use some of {list(CONFIGS)}")
        for name in set(CONFIGS) - set(args.variants.split(",")):
            del CONFIGS[name]
    if args.sass:
        sass_report()
        return
    if args.out is None:
        raise SystemExit("bench_int4_gemv: --out DIR is required (or --sass)")
    if not torch.cuda.is_available():
        raise SystemExit("bench_int4_gemv: needs a CUDA device (run it on the device machine)")
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    bw = measure_bandwidth()
    report: dict = {"commit": args.commit, "device": torch.cuda.get_device_name(), "bandwidth": bw, "shapes": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "int4_gemv_variants.json"
    gen = torch.Generator(device=dev).manual_seed(0)
    bench(report, dev, gen, lambda: path.write_text(json.dumps(report, indent=1)))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path, "in", report["seconds"], "s", flush=True)


if __name__ == "__main__":
    main()
