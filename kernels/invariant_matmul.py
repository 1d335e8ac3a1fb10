"""Batch-invariant projection for the deterministic mode: y = prologue(x) @ W^T (+ bias), each row's bits a
function of that row alone, whatever the batch, its size or the row's place in it.

After "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025): a matmul is batch-invariant when
the reduction order of every output element does not depend on M. cuBLAS picks its kernel, tiles and split-K by
shape, and the fast path switches from the batch-1 GEMV (CUDA-core FMAs) to cuBLAS (tensor cores) at M = 2, so
the same row rounds differently at batch 1, batch 35 and inside a prefill chunk. Here every row is computed by
one fixed arithmetic:

  K is cut into `chunk` -long pieces (chunk_size(N, K): a property of the weight, never of M);
  each piece is reduced from zero by tensor-core dots in 16-wide k steps, k ascending;
  the pieces' fp32 sums are added in order, starting from 0.0; then the bias in fp32; one rounding.

How that arithmetic is scheduled may depend on M without changing a bit:
- SPLIT (decode batches, M <= 64, more than one piece): one program per (row tile, column tile, piece) writes
  its piece's fp32 sum; `_reduce_kernel` adds the pieces in order. This gives a batch-1 step enough programs to
  stream the weight at bandwidth (O and down projections have only 64 column tiles of 64 rows);
- FULL (larger M): one program per (row tile, column tile) walks the pieces itself, with a fresh accumulator
  per piece added to a running total: the same additions, no partial buffer. Its operands come through TMA
  descriptors (zero fill past the edges: the masked loads' values), which took the prefill projections from
  0.55-0.75 of cuBLAS to 0.92-1.04 (H200, c037c43).

Tiles: SMALL_TILE for M <= 16 on a weight of several pieces (the operands swapped: 64 weight rows on the wgmma's
M side, the x rows on its N side, m64n16), DECODE_TILE for M <= 64 (a 64-row tile: the smallest wgmma takes 64
rows, and a single row then wastes tensor-core work, not memory traffic), deeper versions of both for a one-piece
weight of few column tiles, PREFILL_TILE or WIDE_TILE above. All
issue m64·k16 wgmma steps in k order; that their per-element result does not depend on the instruction's N (16 to
256), on which operand holds the weight, or on how many 64-row slabs a program holds is the one assumption not
proven by construction. verify/lab/kernel_bench/bench_invariance.py checks it on the device, row against row across
the switches (verify/lab/journal-kernels.md). One tile for every M removes it at a cost.

Prologues: PROLOGUE_SILU_MUL computes SwiGLU (silu(g) · u of a fused gate-up row, fp32, one rounding) in an
elementwise pass of its own before the matmul: row-independent by construction. Folded into the operand load it
cost a decode step the sigmoid of all 64 rows of its tensor-core tile at every k step: the down projection ran at
25% of its byte floor, 100.5 µs against the GEMV's 30.6 (H200, a0d1f62). RMSNorm stays in norm.py's kernels
(one program per row).

Floor: decode, the weight read once (N·K·2 bytes), as the GEMV; prefill, tensor-core FLOPs (2·M·N·K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from envex.kernels import _common
from envex.kernels._common import (
    FLOAT_DTYPES,
    INTERPRETING,
    check,
    check_tensor,
    padded_rows,
    pdl_enter,
    pdl_launch,
    pow2_floor,
    prefetch_l2,
)

PROLOGUE_NONE, PROLOGUE_SILU_MUL = 0, 3  # the values gemv.py uses for the same prologues


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool = False  # weight rows on the tensor-core M side: out^T = W · x^T, the rows x on its N side
    # Launch order of one program per tile (FULL): groups of group_m row tiles sweep the column tiles, so a
    # group's x rows and the weight tiles it is on stay in L2 together. The default (every row tile in one group)
    # runs the row tiles of a column tile first.
    group_m: int = 1 << 20


# Decode: 64 x 64 output tiles, 128-wide k steps, one warpgroup; 3 stages of 32 KB (x and weight tiles) let two
# programs share an SM, so ~6 weight tiles are in flight per SM (Little's law needs ~25 KB at 4.6 TB/s).
DECODE_TILE = Tile(64, 64, 128, 4, 3)
# Up to 16 rows of a weight cut into several K pieces: the same 64 x 128 weight tile with the operands swapped
# (wgmma m64n16: a quarter of the tensor-core work and of the x tile's shared memory), the same k16 steps in the
# same order. H200, one row (aeb9c7a): QKV 21.3 -> 16.2 us, O 12.7 -> 12.0, down 34.1 -> 33.1; one-piece weights
# keep the 64-row tile: gate-up loses on the small one (60.8 -> 65.5; the 946733c probe: 59.7 -> 65.3). The LM head
# read 243 -> 266 there, but that row's first timing reads high (54fd7ff: 280 and 249 for one tile), and the probe
# has it winning, 242.6 -> 235.9 (verify/lab/journal-kernels.md, "Where the batch-1 cost goes next").
SMALL_TILE = Tile(16, 64, 128, 4, 3, swap=True)
SMALL_MAX_M = 16
# A one-piece weight of few column tiles (under MANY_COLUMNS; QKV of Llama-3.1-8B, 96) streams its whole K in each
# program, so deeper pipelines: H200, b185546 (`bench_probes --section swapped`, us, QKV in one piece / in three
# with the pieces handed on): 1 row 15.0 / 14.5 (five stages here; three: 18.5), 64 rows 18.1 / 20.6.
DEEP_SMALL_TILE = Tile(16, 64, 128, 4, 5, swap=True)
DEEP_DECODE_TILE = Tile(64, 64, 128, 4, 4)
MANY_COLUMNS = 256  # column tiles of 64 from which a one-piece weight fills the GPU on the plain tiles
# Prefill: 128 x 128 tiles, two warpgroups of m64 wgmma, and a second fp32 accumulator (the running total of the
# pieces) for a weight of several pieces (on the 128 x 256 tile two accumulators take all 255 registers and spill:
# 416 bytes a thread, compiled for sm_90 with Triton 3.9).
PREFILL_TILE = Tile(128, 128, 64, 8, 3)
# Long prefills, and any M > 64 of a one-piece weight of many column tiles: 128 x 256, H200 at 4,096 rows (dcde335,
# us against PREFILL_TILE): gate-up 1,446 / 2,025, LM head 7,333 / 8,759, down 905 / 1,097, O 311 / 327, QKV 484 /
# 474 (cuBLAS 1,239 / 6,405 / 600 / 178 / 266): even with two accumulators the wide tile wins but for QKV (2%
# slower; one rule kept). Below 2,048 rows a weight of few column tiles keeps 128 x 128 (more programs).
# Launched in groups of 16 row tiles: at 8,192 rows (a full prefill step) -2.7% for gate-up, 3,327 -> 3,237 us,
# and 1-5% for the others (H200, 15628a6, verify/lab/results/...-15628a6-invariance-fixup.json; 8 and 32 were not
# better).
WIDE_TILE = Tile(128, 256, 64, 8, 3, group_m=16)
WIDE_MIN_M = 2048
DECODE_MAX_M = 64  # rows up to which the decode tile (and split pieces) are used
# A launch's operand loads (matmul's `tma`, the kernel's TMA): both through row pointers (masked loads), both
# through TMA descriptors, or the weight through a descriptor and x through pointers (no x box of 16-64 rows
# filled for the one row a decode step has). use_tma picks them by rows and tile, from H200 measurements (us at
# one / 64 rows, pointers / both / weight; verify/lab/results/h200-2026-12-03-wip-decode-loads-probe.json): above 64
# rows both (prefill 0.55-0.75 of cuBLAS -> 0.92-1.05, c037c43); 17-64 rows both (QKV 18.3 / 17.3 / 18.2, down 32.7 /
# 31.9 / 33.1); up to 16 rows the weight alone (gate-up 59.5 / 115.7 / 59.2 on the 64-row tile, where the x box
# costs twice; O 10.2 / 10.1 / 10.1) but on the deep small tile of a one-piece weight (QKV 14.8 / 15.7 / 15.2).
TMA_NONE, TMA_BOTH, TMA_WEIGHT = 0, 1, 2

# The piece rule (part of the arithmetic: changing a constant changes bits, never invariance). A weight of at
# least ONE_PIECE_COLUMNS column tiles of 64 is one piece: its column tiles alone give a batch-1 step enough
# programs on the deep tiles, and a prefill program then holds one accumulator (H200, b185546: QKV at 4,096 rows
# 318 us in one piece against 458 in three). Fewer column tiles (O and down: 64) want >= TARGET_PROGRAMS
# (column tile, piece) programs for the 132 SMs of an H200 (in one piece their batch-1 step lost 1.7 and 2.6 us);
# pieces are whole multiples of K_ALIGN (every tile's block_k divides it) and at least MIN_CHUNK long.
ONE_PIECE_COLUMNS = 96
TARGET_PROGRAMS = 256
COLUMN_UNIT = 64
MIN_CHUNK = 1024
K_ALIGN = 128


def chunk_size(n: int, k: int) -> int:
    """The length of the K pieces each output element sums separately, from the weight's shape alone."""
    columns = triton.cdiv(n, COLUMN_UNIT)
    pieces = 1 if columns >= ONE_PIECE_COLUMNS else max(1, min(triton.cdiv(TARGET_PROGRAMS, columns), k // MIN_CHUNK))
    return min(k, triton.cdiv(triton.cdiv(k, pieces), K_ALIGN) * K_ALIGN)


def _on_16_bytes(a: torch.Tensor) -> bool:
    return a.data_ptr() % 16 == 0 and a.stride(0) * a.element_size() % 16 == 0


def use_tma(x: torch.Tensor, weight: torch.Tensor, m: int, tile: Tile) -> int:
    """How a launch of m rows on `tile` reads its operands (TMA_NONE, TMA_BOTH or TMA_WEIGHT; the rule above
    TMA_NONE): through TMA descriptors on a GPU of sm_90 or later (or the interpreter) where the operand's rows are
    on 16 bytes (the descriptors' rule). A schedule choice: the operand values, so the bits, are the masked
    loads'."""
    if not INTERPRETING and (x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] < 9):
        return TMA_NONE
    if not _on_16_bytes(weight) or tile == DEEP_SMALL_TILE:
        return TMA_NONE
    if m > SMALL_MAX_M:
        return TMA_BOTH if _on_16_bytes(x) else TMA_WEIGHT if m <= DECODE_MAX_M else TMA_NONE
    return TMA_WEIGHT


def tile_for(m: int, n: int, pieces: int, itemsize: int = 2) -> Tile:
    """The launch's tile: a schedule choice (every tile gives the same bits), by rows, the weight's column count
    and pieces and the element size (float32's 128 x 256 stages need 288 KB of shared memory, past the H200's 227
    KB; the deep 64-row tile's four stages 256 KB)."""
    many = triton.cdiv(n, COLUMN_UNIT) >= MANY_COLUMNS
    if m <= SMALL_MAX_M and not many:
        return SMALL_TILE if pieces > 1 else DEEP_SMALL_TILE
    if m <= DECODE_MAX_M:
        return DEEP_DECODE_TILE if pieces == 1 and not many and itemsize <= 2 else DECODE_TILE
    return WIDE_TILE if (m >= WIDE_MIN_M or (pieces == 1 and many)) and itemsize <= 2 else PREFILL_TILE


@triton.jit
def _operands(x_src, w_src, k, WIDTH: tl.constexpr, row_ok, col_ok, row0, col0, K: tl.constexpr,
              TMA: tl.constexpr):  # fmt: skip
    """The x tile [BLOCK_M, WIDTH] and weight tile [BLOCK_N, WIDTH] of k columns k .. k + WIDTH - 1: masked loads
    through row pointers, or the tensor memory accelerator's loads through descriptors of blocks [BLOCK_M, WIDTH]
    at (row0, k) (TMA_BOTH) and [BLOCK_N, WIDTH] at (col0, k) (TMA_BOTH, TMA_WEIGHT), whose zero fill past the
    edges gives the same values."""
    if TMA != 1:  # x through pointers (TMA_NONE, TMA_WEIGHT)
        ks = k + tl.arange(0, WIDTH)
        k_ok = ks < K
        x = tl.load(x_src + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        x = x_src.load([row0, k])
    if TMA == 0:  # TMA_NONE
        w = tl.load(w_src + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        w = w_src.load([col0, k])
    return x, w


@triton.jit
def _piece_dots(acc, x_src, w_src, lo, row_ok, col_ok, row0, col0, K: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """acc plus the k16 tensor-core steps of the piece starting at lo, k ascending. SWAP: acc is out^T, the weight
    tile the dot's first operand."""
    for k0 in range(lo, tl.minimum(lo + CHUNK, K), BLOCK_K):
        if UPCAST_DOT:
            # The interpreter: numpy's float32 matmul rounds a row differently by its place in the tile (its
            # micro-kernel handles rows in groups), the tensor cores do not. So each 16-wide k step (one wgmma k
            # step) is a float64 dot rounded once into the fp32 accumulator, whatever BLOCK_K is (a TMA launch
            # there has descriptors of 16-wide blocks).
            for a in tl.static_range(0, BLOCK_K, 16):
                x, w = _operands(x_src, w_src, k0 + a, 16, row_ok, col_ok, row0, col0, K, TMA)
                x, w = x.to(tl.float64), w.to(tl.float64)
                lhs, rhs = (w, x) if SWAP else (x, w)
                acc += tl.dot(lhs, tl.trans(rhs), out_dtype=tl.float64).to(tl.float32)
        else:
            x, w = _operands(x_src, w_src, k0, BLOCK_K, row_ok, col_ok, row0, col0, K, TMA)
            lhs, rhs = (w, x) if SWAP else (x, w)
            acc = tl.dot(lhs, tl.trans(rhs), acc)
    return acc


_PREFETCH_ASM = tl.constexpr(not INTERPRETING)  # the interpreter has no cache to warm
# A PDL-launched program asks L2 for the first WARM_K k of its weight tile (a power of two; 0: off) before it waits
# on the previous launch, a short one that triggers late (_common.LATE_TRIGGER), so the requests overlap that
# launch and not the projection before it. A schedule, never a bit (verify/lab/journal-kernels.md, "The short
# launches trigger after their wait": 128 measured best of 64-256).
WARM_K = 128


def warm_span(chunk: int, k: int, itemsize: int) -> int:
    """The k a PDL-launched program asks L2 for before its wait: WARM_K, within its piece and K, in whole 128-byte
    lines of a weight row of itemsize-byte elements, a power of two (tl.arange); 0 where not even a line fits."""
    span = min(WARM_K, pow2_floor(max(1, min(chunk, k)))) if WARM_K else 0
    return span if span * itemsize >= 128 else 0


@triton.jit
def _warm_l2(w_rows, lo, col_ok, K: tl.constexpr, SPAN: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for k in [lo, lo + SPAN) of the weight rows w_rows ([BLOCK_N, 1] pointers), a 128-byte line
    (LINE elements) at a time: fire and forget."""
    if _PREFETCH_ASM:
        ks = lo + tl.arange(0, SPAN // LINE) * LINE
        prefetch_l2(w_rows + ks[None, :], (col_ok[:, None] & (ks < K)[None, :]).to(tl.int32))


@triton.jit
def _grouped(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the launch's tile-th program: groups of GROUP_M row tiles, each group's row
    tiles first within a column tile, then the next column tile (Triton's matmul tutorial order)."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first = (tile // in_group) * GROUP_M
    size = tl.minimum(row_tiles - first, GROUP_M)
    return first + (tile % in_group) % size, (tile % in_group) // size


@triton.jit(do_not_specialize=["M"])  # the step's row count: verify/lab/journal-kernels.md, "Compile keys"
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, wraw_ptr,
    M, N, stride_xm, stride_wn, stride_om, stride_ps, stride_pm,
    K: tl.constexpr, CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr, SWAP: tl.constexpr = False, GROUP_M: tl.constexpr = 1 << 20, TMA: tl.constexpr = 0,
    WARM: tl.constexpr = 0, LINE: tl.constexpr = 64,
):  # fmt: skip
    # wraw_ptr: the weight's own pointer (w_ptr may be its TMA descriptor), for the L2 warm-up (WARM > 0)
    if SPLIT:  # grid (row tile, column tile, piece)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:  # grid (tile,), in groups of row tiles
        pid_m, pid_n = _grouped(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    # TMA (a launch's operand loads, TMA_*): 0 both through row pointers, 1 both tensor descriptors, 2 the weight
    # a descriptor and x through pointers
    if TMA == 1:
        x_src = x_ptr
    else:
        x_src = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if TMA == 0:
        w_src = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    else:
        w_src = w_ptr
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    if SPLIT:  # this program's piece only; its fp32 sum goes to the partial buffer
        first = tl.program_id(2)
        last = first + 1
    else:
        first = 0
        last = tl.cdiv(K, CHUNK)
    if WARM > 0:  # the weight does not depend on the previous launch: its first WARM k asked of L2 before waiting
        _warm_l2(wraw_ptr + cols.to(tl.int64)[:, None] * stride_wn, first * CHUNK, col_ok, K, WARM, LINE)
    pdl_enter(USE_PDL, False)  # x comes from the previous kernel of the step
    if SWAP:  # the accumulators hold out^T: [BLOCK_N, BLOCK_M]
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # One piece: its dots go straight into the total (0 + part is part: the same bits), so the tile holds one
    # accumulator; several pieces each start from zero and are added to the total in order.
    if CHUNK >= K:
        total = _piece_dots(total, x_src, w_src, 0, row_ok, col_ok, row0, col0, K, CHUNK, BLOCK_K, UPCAST_DOT, SWAP,
                            TMA)  # fmt: skip
    else:
        for piece in range(first, last):
            total += _piece_dots(tl.zeros_like(total), x_src, w_src, piece * CHUNK, row_ok, col_ok, row0, col0, K,
                                 CHUNK, BLOCK_K, UPCAST_DOT, SWAP, TMA)  # fmt: skip
    if SWAP:  # store through transposed offsets: element (col, row) of the accumulator is out[row, col]
        r_off, c_off = rows.to(tl.int64)[None, :], cols[:, None]
        mask = row_ok[None, :] & col_ok[:, None]
    else:
        r_off, c_off = rows.to(tl.int64)[:, None], cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + first * stride_ps + r_off * stride_pm + c_off, total, mask=mask)
    else:
        if HAS_BIAS:  # in fp32 before the one rounding, as the reduce kernel does
            total += tl.load(bias_ptr + c_off, mask=col_ok[:, None] if SWAP else col_ok[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
        tl.store(out_ptr + r_off * stride_om + c_off, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(x_ptr, out_ptr, M, stride_xm, stride_om, K: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr, LATE: tl.constexpr = False):  # fmt: skip
    """silu(g) · u of each fused gate-up row [g | u], in fp32, rounded once: elementwise, one program per (row,
    block of K), so no bit depends on the batch. A pass of its own rather than the matmul's operand load: there
    a decode step's one row would pay the sigmoid of all 64 rows of its tensor-core tile at every k step."""
    pdl_enter(USE_PDL, LATE)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = ks < K
    g = tl.load(x_ptr + row * stride_xm + ks, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_xm + K + ks, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + ks, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_ps, stride_pm, stride_om,
    PIECES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr, LATE: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL, LATE)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_pm + cols[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for piece in range(PIECES):  # in piece order from 0.0: the additions the FULL kernel makes
        total += tl.load(part_ptr + piece * stride_ps + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def sum_pieces(pieces: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 pieces [S, M, N] added in order to 0.0 and rounded once to dtype -> [M, N]: the reduce kernel that
    ends matmul's split schedule (and the sum norm.add_rms_norm_partials makes), for a caller holding the pieces."""
    check_tensor("pieces", pieces, ndim=3, dtypes=(torch.float32,))
    check(dtype in FLOAT_DTYPES, f"dtype: {dtype} is not one of {FLOAT_DTYPES}")
    count, m, n = pieces.shape
    out = torch.empty((m, n), dtype=dtype, device=pieces.device)
    if count and m and n:
        _reduce_kernel[(triton.cdiv(m, 16), triton.cdiv(n, 128))](
            pieces, pieces, out, m, n, pieces.stride(0), pieces.stride(1), out.stride(0),
            PIECES=count, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=128, USE_PDL=False, num_warps=4,
        )  # fmt: skip
    else:
        out.zero_()
    return out


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: int = PROLOGUE_NONE,
    tile: Tile | None = None,
    split: bool | None = None,
    tma: int | None = None,
    chunk: int | None = None,
    pdl: bool = False,
    partials: bool = False,
) -> torch.Tensor:
    """y [M, N] = prologue(x) @ weight[N, K]^T (+ bias [N]), in x's dtype, batch-invariant row by row.

    x: [M, K], or [M, 2K] (gate | up) for PROLOGUE_SILU_MUL. tile / split / tma (TMA_*): override the launch (tests
    and the device check use them to compute the same rows through every schedule); None: chosen from M, which
    changes the schedule only, never the result. chunk: the K piece length (None: chunk_size(N, K); tests pass a
    small one to get several pieces from a small K). pdl: programmatic dependent launch (Hopper), inside a chain of
    kernels that each wait on their predecessor. partials: where the schedule splits (and there is no bias), return
    the pieces' float32 sums [pieces, M, N] unreduced, for a consumer that adds them in piece order and rounds
    once, as the reduce kernel would (norm.add_rms_norm_partials): the same bits, one launch fewer.
    """
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    n, k = weight.shape
    check_tensor("x", x, ndim=2, dtypes=(weight.dtype,), device=weight.device)
    check(prologue in (PROLOGUE_NONE, PROLOGUE_SILU_MUL), f"prologue: {prologue} is not NONE or SILU_MUL")
    want_k = 2 * k if prologue == PROLOGUE_SILU_MUL else k
    check(x.shape[1] == want_k, f"x: last dim {x.shape[1]} != {want_k} expected for weight [{n}, {k}]")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=weight.device)
        check(bias.shape[0] == n, f"bias: length {bias.shape[0]} != N = {n}")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if prologue == PROLOGUE_SILU_MUL:
        act = torch.empty((m, k), dtype=x.dtype, device=x.device)
        _silu_mul_kernel[(m, triton.cdiv(k, 1024))](
            x, act, m, x.stride(0), act.stride(0), K=k, BLOCK=1024, USE_PDL=pdl, LATE=_common.LATE_TRIGGER,
            num_warps=4, **pdl_launch(pdl))
        x, prologue = act, PROLOGUE_NONE
    chunk = chunk or chunk_size(n, k)
    check(chunk % K_ALIGN == 0 or chunk >= k, f"chunk: {chunk} must be a multiple of {K_ALIGN} (or cover K = {k})")
    pieces = triton.cdiv(k, chunk)
    t = tile or tile_for(m, n, pieces, x.element_size())
    check(pieces == 1 or chunk % t.block_k == 0,
          f"tile: block_k {t.block_k} must divide the piece length {chunk} (no k step may cross pieces)")  # fmt: skip
    if split is None:
        split = pieces > 1 and m <= DECODE_MAX_M
    split = split and pieces > 1
    bias_arg = bias if bias is not None else weight  # never read when HAS_BIAS is off
    tiles = triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n)
    grid = (*tiles, pieces) if split else (tiles[0] * tiles[1],)
    # Rows padded: the piece stride stays divisible by 16 for every M (_common.padded_rows).
    part = torch.empty((pieces, padded_rows(m), n) if split else (1, 1, 1), dtype=torch.float32, device=x.device)
    tma = use_tma(x, weight, m, t) if tma is None else tma
    x_arg, w_arg = x, weight
    check(tma in (TMA_NONE, TMA_BOTH, TMA_WEIGHT), f"tma: {tma} is not TMA_NONE, TMA_BOTH or TMA_WEIGHT")
    width = 16 if INTERPRETING else t.block_k  # descriptors' blocks: 16 wide in the interpreter (its k16 steps)
    if tma == TMA_BOTH:
        x_arg = TensorDescriptor.from_tensor(x, [t.block_m, width])
    if tma != TMA_NONE:
        w_arg = TensorDescriptor.from_tensor(weight, [t.block_n, width])
    _matmul_kernel[grid](
        x_arg, w_arg, bias_arg, out, part, weight, m, n, x.stride(0), weight.stride(0), out.stride(0),
        part.stride(0), part.stride(1),
        K=k, CHUNK=chunk, HAS_BIAS=bias is not None and not split, SPLIT=split,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, UPCAST_DOT=INTERPRETING, USE_PDL=pdl,
        SWAP=t.swap, GROUP_M=t.group_m, TMA=int(tma), WARM=warm_span(chunk, k, weight.element_size()) if pdl else 0,
        LINE=128 // weight.element_size(),
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    if split and partials and bias is None:
        return part[:, :m]
    if split:
        _reduce_kernel[(triton.cdiv(m, 16), triton.cdiv(n, 128))](
            part, bias_arg, out, m, n, part.stride(0), part.stride(1), out.stride(0),
            PIECES=pieces, HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=128, USE_PDL=pdl, num_warps=4,
            LATE=_common.LATE_TRIGGER, **pdl_launch(pdl),
        )  # fmt: skip
    return out
