"""Batch-invariant paged attention for the deterministic mode: a query's output bits depend only on its own q and
the keys and values at positions 0 .. its position, never on the batch, the key-split count, whether it is a
decode step or a row of a prefill chunk, or whether the keys before it came from the prefix cache.

After "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025): split the key axis at a fixed SIZE
(SPLIT_KEYS), not into a fixed NUMBER of splits, so the splits of a query depend on its position alone, and
combine the splits in one fixed order. The arithmetic of one query row:

  for each split s = 0, 1, ... of keys [s·SPLIT_KEYS, min((s+1)·SPLIT_KEYS, position+1)):
      an online softmax over BLOCK_N-key tiles from a fresh state -> (m_s, l_s, acc_s)
      (max raw logit, sum of exp, unnormalised output; causal keys masked to -inf, contributing exact zeros)
  fold the splits in order into (M, L, ACC) with _fold; out = ACC / L.

Two schedules compute exactly that:
- decode (one token per sequence): `_split_kernel`, one program per (sequence, KV head, split program); program
  p computes splits p, p + P, p + 2P, ... (P from the batch or fixed by a CUDA graph: any P gives the same bits,
  it only spreads the work) and writes each split's state; `_merge_kernel` folds them in split order. With one
  split program (P = 1: large batches) the program makes the merge's folds itself (FOLD): no states, no merge;
- everything else (prefill chunks, mixed steps, speculative verify): `_full_kernel`, one program per (query tile,
  sequence, KV head), walking the splits and folding in registers. A tile's rows sit at different positions; for
  a row, keys past its position are masked, so the extra keys and whole splits a longer row makes it visit fold
  in as exact no-ops (p = 0, alpha = 1).
Both use the same tile (BLOCK_M query rows x BLOCK_N keys, NUM_WARPS), so every dot is the same instruction;
every multiply-add that a compiler could contract differently is an explicit tl.fma. The new token's K/V is read
from the cache (written before, by rotary.rotary_and_store_kv), never from registers, in both schedules.

Rows are (token, query head of the KV head's group) pairs, so K/V tiles are read once per GQA group; at decode a
64-row tile holds one group (4 rows for Llama-3-8B): tensor-core work is wasted, memory traffic is not.

Floor (decode): the K and V of every cached token read once, 2·seq_len·Hkv·D·bytes per sequence per layer, plus
the split states (~(D + 2)·4 bytes per split and query head). Floor (prefill): tensor-core FLOPs, as attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels import _common, rotary
from envex.kernels._common import (
    INTERPRETING,
    check,
    check_paged_attention_inputs,
    check_tensor,
    load_kv_tile,
    next_pow2,
    padded_rows,
    pdl_enter,
    pdl_launch,
)

LOG2E = 1.4426950408889634
# Keys per split: part of the arithmetic (changing it changes bits, never invariance). 128 rather than 256: twice
# the split programs for a short decode (H200, served batch 1 at 1K: 225.0 against 220.8 tok/s, 2f10028), and
# since a large batch folds its splits in registers (FOLD) more splits no longer cost it a longer merge.
SPLIT_KEYS = 128
BLOCK_M = 64  # query rows per program, decode and prefill alike
BLOCK_N = 64  # keys per tile
NUM_WARPS = 4


@triton.jit
def _dot(a, b, acc, UPCAST_DOT: tl.constexpr):
    """acc + a @ b. The interpreter (UPCAST_DOT) computes it in float64 rounded once: numpy's float32 matmul rounds
    a row by its place in the tile, tensor cores do not (see invariant_matmul)."""
    if UPCAST_DOT:
        out = acc + tl.dot(a.to(tl.float64), b.to(tl.float64), out_dtype=tl.float64).to(tl.float32)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _split_state(q, q_pos, lo, hi, b, kvh, d, d_ok, qk_scale, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                 stride_kb, stride_ks, stride_kh, stride_bt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PAGE: tl.constexpr, UPCAST_DOT: tl.constexpr):  # fmt: skip
    """Keys [lo, hi) of one split through an online softmax from a fresh state -> (m, l, acc): the largest raw
    logit seen, the sum of exp2((s - m)·qk_scale) and the unnormalised output, per row."""
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kvh, kpos, k_ok, d, d_ok, stride_kb,
                            stride_ks, stride_kh, stride_bt, PAGE)  # fmt: skip
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT)  # raw logits
        s = tl.where((kpos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet keeps p = 0
        # The scale multiplies a difference (s - m): no multiply-add for a compiler to contract either way.
        p = tl.exp2((s - m_safe[:, None]) * qk_scale)
        alpha = tl.exp2((m - m_safe) * qk_scale)
        l_i = tl.fma(l_i, alpha, tl.sum(p, axis=1))
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT)
        m = m_new
    return m, l_i, acc


@triton.jit
def _normalized(acc, l_i):
    """out = ACC / L, the last step of every schedule (a row that saw no key keeps its zeros)."""
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _fold(m, l_i, acc, m_s, l_s, acc_s, qk_scale):
    """Fold split state (m_s, l_s, acc_s) into the running (m, l, acc); the same operations in both schedules."""
    m_new = tl.maximum(m, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2((m - m_safe) * qk_scale)
    c = tl.exp2((m_s - m_safe) * qk_scale)
    acc = tl.fma(acc, tl.broadcast_to(a[:, None], acc.shape), acc_s * tl.broadcast_to(c[:, None], acc.shape))
    l_i = tl.fma(l_i, a, l_s * c)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # per-step integers: verify/lab/journal-kernels.md, "Compile keys"
def _full_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, block_tables_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    q_pos = seq_len - q_len + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    last_tok = tl.minimum(q_len - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP)
    kv_end = seq_len - q_len + last_tok + 1  # the tile's last row sees keys 0 .. kv_end - 1
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for lo in range(0, kv_end, SPLIT):
        m_s, l_s, acc_s = _split_state(q, q_pos, lo, tl.minimum(lo + SPLIT, kv_end), b, kvh, d, d_ok, qk_scale,
                                       k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_kb, stride_ks,
                                       stride_kh, stride_bt, BLOCK_M, BLOCK_N, BLOCK_D, PAGE, UPCAST_DOT)  # fmt: skip
        m, l_i, acc = _fold(m, l_i, acc, m_s, l_s, acc_s, qk_scale)
    o = _normalized(acc, l_i)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _seq_len(b, seq_lens_ptr, pos_ptr, FROM_POSITIONS: tl.constexpr):
    if FROM_POSITIONS:  # a decode step without seq_lens (a CUDA graph): the token's position + 1
        n = tl.load(pos_ptr + b).to(tl.int32) + 1
    else:
        n = tl.load(seq_lens_ptr + b).to(tl.int32)
    return n


@triton.jit(do_not_specialize=["stride_bt", "num_progs"])
def _split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, pos_ptr, block_tables_ptr, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_as, stride_at, stride_ah,
    stride_ms, stride_mt, stride_mh, num_progs,
    k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, stride_kt, stride_khh, stride_vt, stride_vh, stride_cos,
    out_ptr, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, FROM_POSITIONS: tl.constexpr,
    UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr, ROTARY: tl.constexpr = False, FOLD: tl.constexpr = False,
):  # fmt: skip
    """ROTARY: q, k and v are the token's raw (unrotated) rows, as rotary.rotary_and_store_kv takes them: every
    program rotates its q heads with that kernel's arithmetic, and the program that owns the last split also
    rotates the new key and writes it and the new value to the cache (slot < 0: no write) before reading its tiles
    back from the cache, so the bits are those of the rotary launch followed by this kernel.
    FOLD (one program a sequence and KV head, num_progs == 1): the program folds its splits in order in registers
    and writes the output, the merge kernel's folds from the same states: no split states, no merge launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1) // num_progs
    prog = tl.program_id(1) % num_progs
    seq_len = _seq_len(b, seq_lens_ptr, pos_ptr, FROM_POSITIONS)
    rows = tl.arange(0, BLOCK_M)  # one token: the rows are its GQA group's heads
    head = kvh * GROUP + rows
    row_ok = rows < GROUP
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    t = b.to(tl.int64)  # one query token per sequence: token index = sequence index
    if ROTARY:
        HALF: tl.constexpr = HEAD_DIM // 2
        hc = tl.arange(0, HALF)[None, :]
        pos = tl.load(pos_ptr + b).to(tl.int64)
        c = tl.load(cos_ptr + pos * stride_cos + hc)
        sn = tl.load(sin_ptr + pos * stride_cos + hc)
        q_lo, q_hi = _rotated(q_ptr + t * stride_qt + head[:, None] * stride_qh, row_ok[:, None], hc, c, sn, HALF,
                              q_ptr.dtype.element_ty)  # fmt: skip
        q = tl.reshape(tl.permute(tl.join(q_lo, q_hi), (0, 2, 1)), [BLOCK_M, HEAD_DIM])  # [halves] -> [M, D]
        slot = tl.load(slot_ptr + b)
        owner = (tl.cdiv(seq_len, SPLIT) - 1) % num_progs
        n_new = tl.where((prog == owner) & (slot >= 0), 1, 0)  # rows of the new key this program writes: 0 or 1
        one = tl.arange(0, 2)[:, None]  # a 2-row tile (row 1 never written): the new key is one row
        new_ok = one < n_new
        row = tl.maximum(slot, 0).to(tl.int64)  # the cache slot: block row // PAGE, offset row % PAGE
        k_row = k_cache_ptr + (row // PAGE) * stride_kb + (row % PAGE) * stride_ks + kvh * stride_kh
        v_row = v_cache_ptr + (row // PAGE) * stride_kb + (row % PAGE) * stride_ks + kvh * stride_kh
        klo, khi = _rotated(k_ptr + t * stride_kt + kvh * stride_khh + one * 0, new_ok, hc, c, sn, HALF,
                            k_ptr.dtype.element_ty)  # fmt: skip
        cache_ty = k_cache_ptr.dtype.element_ty
        tl.store(k_row + one * 0 + hc, klo.to(cache_ty), mask=new_ok)
        tl.store(k_row + one * 0 + HALF + hc, khi.to(cache_ty), mask=new_ok)
        dd = tl.arange(0, HEAD_DIM)[None, :]
        vv = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + one * 0 + dd, mask=new_ok, other=0.0)
        tl.store(v_row + one * 0 + dd, vv.to(v_cache_ptr.dtype.element_ty), mask=new_ok)
        tl.debug_barrier()  # the new key and value are in the cache before any thread reads its tiles
    else:
        q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(prog, tl.cdiv(seq_len, SPLIT), num_progs):
        lo = s * SPLIT
        m_s, l_s, acc_s = _split_state(q, q_pos, lo, tl.minimum(lo + SPLIT, seq_len), b, kvh, d, d_ok, qk_scale,
                                       k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_kb, stride_ks,
                                       stride_kh, stride_bt, BLOCK_M, BLOCK_N, BLOCK_D, PAGE, UPCAST_DOT)  # fmt: skip
        if FOLD:
            m, l_i, acc = _fold(m, l_i, acc, m_s, l_s, acc_s, qk_scale)
        else:
            tl.store(part_acc_ptr + s * stride_as + t * stride_at + head[:, None] * stride_ah + d[None, :], acc_s,
                     mask=mask)  # fmt: skip
            ml = part_ml_ptr + s * stride_ms + t * stride_mt + head * stride_mh
            tl.store(ml, m_s, mask=row_ok)
            tl.store(ml + 1, l_s, mask=row_ok)
    if FOLD:
        o = _normalized(acc, l_i)
        tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


@triton.jit
def _rotated(src, ok, hc, c, sn, HALF: tl.constexpr, out_ty: tl.constexpr):
    """rotary._rotate_heads's arithmetic on rows at src ([R, 1] pointers; ok [R, 1]): the two rotated halves,
    rounded to out_ty."""
    x1 = tl.load(src + hc, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + hc, mask=ok, other=0.0).to(tl.float32)
    return (x1 * c - x2 * sn).to(out_ty), (x2 * c + x1 * sn).to(out_ty)


@triton.jit
def _split_saved(acc_at, ml_at, s, n, mask, g_ok, stride_as, stride_ms):
    """Split s's saved state (m, l, acc) for the merge; nothing is read for s >= n."""
    ok = g_ok & (tl.zeros_like(g_ok.to(tl.int32)) + s < n)  # a vector: the interpreter masks with no scalar
    acc_s = tl.load(acc_at + s * stride_as, mask=mask & ok[:, None], other=0.0)
    m_s = tl.load(ml_at + s * stride_ms, mask=ok, other=float("-inf"))
    l_s = tl.load(ml_at + s * stride_ms + 1, mask=ok, other=0.0)
    return m_s, l_s, acc_s


@triton.jit
def _merge_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, pos_ptr, qk_scale,
    stride_as, stride_at, stride_ah, stride_ms, stride_mt, stride_mh, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, FROM_POSITIONS: tl.constexpr, USE_PDL: tl.constexpr, LATE: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL, LATE)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    t = b.to(tl.int64)
    seq_len = _seq_len(b, seq_lens_ptr, pos_ptr, FROM_POSITIONS)
    g = tl.arange(0, GROUP_P2)
    head = kvh * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    mask = g_ok[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
    acc_at = part_acc_ptr + t * stride_at + head[:, None] * stride_ah + d[None, :]
    ml_at = part_ml_ptr + t * stride_mt + head * stride_mh
    n = tl.cdiv(seq_len, SPLIT)
    # In split order, as _full_kernel folds them. Four splits' states are requested before the first of them is
    # folded: a fold waits on one L2 round trip per four splits, not per split (a sequence at 10K keys has 80).
    for s in range(0, n, 4):
        m0, l0, a0 = _split_saved(acc_at, ml_at, s, n, mask, g_ok, stride_as, stride_ms)
        m1, l1, a1 = _split_saved(acc_at, ml_at, s + 1, n, mask, g_ok, stride_as, stride_ms)
        m2, l2, a2 = _split_saved(acc_at, ml_at, s + 2, n, mask, g_ok, stride_as, stride_ms)
        m3, l3, a3 = _split_saved(acc_at, ml_at, s + 3, n, mask, g_ok, stride_as, stride_ms)
        m, l_i, acc = _fold(m, l_i, acc, m0, l0, a0, qk_scale)
        if s + 1 < n:  # a split past the last is not folded at all (a no-op fold could turn -0.0 into +0.0)
            m, l_i, acc = _fold(m, l_i, acc, m1, l1, a1, qk_scale)
        if s + 2 < n:
            m, l_i, acc = _fold(m, l_i, acc, m2, l2, a2, qk_scale)
        if s + 3 < n:
            m, l_i, acc = _fold(m, l_i, acc, m3, l3, a3, qk_scale)
    o = _normalized(acc, l_i)
    tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor | None,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    max_seq_len: int,
    positions: torch.Tensor | None = None,
    num_programs: int | None = None,
    split_keys: int = SPLIT_KEYS,
    pdl: bool = False,
) -> torch.Tensor:
    """Causal attention of packed varlen queries q [T, Hq, D] over paged caches [num_blocks, block_size, Hkv, D],
    every row batch-invariant (module docstring). The layout contract is attention.paged_attention's.

    seq_lens: [B] keys per sequence after this step's writes; may be None for a decode step (max_q_len 1), whose
    lengths are then positions + 1 (positions: [B], one token per sequence). num_programs: split programs per
    sequence and KV head at decode (None: enough to fill the GPU; a CUDA graph fixes it); it never changes the
    result. max_seq_len bounds every sequence (a CUDA graph passes max_model_len): it sizes the split buffers.
    split_keys: the split size, a multiple of BLOCK_N (tests use a small one to cross splits on short sequences).
    """
    num_tokens, n_q, head_dim, page, n_kv = check_paged_attention_inputs(q, k_cache, v_cache)
    check(n_q // n_kv <= BLOCK_M, f"q: a GQA group of {n_q // n_kv} heads exceeds the {BLOCK_M}-row tile")
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=q.device)
    batch = block_tables.shape[0]
    check(cu_seqlens_q.shape[0] == batch + 1, f"cu_seqlens_q: {cu_seqlens_q.shape[0]} entries for batch {batch}")
    check(max_q_len >= 1 and max_seq_len >= max_q_len, f"max_q_len {max_q_len} / max_seq_len {max_seq_len} invalid")
    check(split_keys >= BLOCK_N and split_keys % BLOCK_N == 0,
          f"split_keys: {split_keys} is not a positive multiple of {BLOCK_N}")
    if seq_lens is None:
        check(max_q_len == 1 and positions is not None,
              "seq_lens: required unless a decode step (max_q_len 1) passes positions")  # fmt: skip
    else:
        check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
        check(seq_lens.shape[0] == batch, f"seq_lens: {seq_lens.shape[0]} entries for batch {batch}")
    if positions is not None:
        check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    group = n_q // n_kv
    block_d = next_pow2(head_dim)
    qk_scale = float(scale) * LOG2E
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    if max_q_len > 1:
        assert seq_lens is not None
        grid = (triton.cdiv(max_q_len * group, BLOCK_M), batch, n_kv)
        _full_kernel[grid](
            q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, qk_scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_strides,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE=page,
            SPLIT=split_keys, UPCAST_DOT=INTERPRETING, USE_PDL=pdl, num_warps=NUM_WARPS, num_stages=3,
            **pdl_launch(pdl),
        )  # fmt: skip
        return out
    check(num_tokens == batch, f"q: a decode step has one token per sequence, got {num_tokens} for batch {batch}")
    return _decode(q, k_cache, v_cache, out, seq_lens, positions, block_tables, qk_scale, max_seq_len=max_seq_len,
                   num_programs=num_programs, split_keys=split_keys, pdl=pdl)


def _decode(q, k_cache, v_cache, out, seq_lens, positions, block_tables, qk_scale, *, max_seq_len, num_programs,
            split_keys, pdl, rotary=None) -> torch.Tensor:
    """The decode schedule: split programs, then the ordered merge. rotary: (k, v, cos, sin, slot_mapping), q, k
    and v unrotated (decode_attention_rotary)."""
    batch, n_q, head_dim = q.shape
    n_kv, page = k_cache.shape[2], k_cache.shape[1]
    group = n_q // n_kv
    block_d = next_pow2(head_dim)
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    splits = triton.cdiv(max_seq_len, split_keys)
    if num_programs is None:
        num_programs = triton.cdiv(2 * _sm_count(q.device), batch * n_kv)
    num_programs = max(1, min(num_programs, splits))
    fold = num_programs == 1  # every split in one program: it folds them itself (FOLD), no merge launch
    rows = padded_rows(batch)  # split strides divisible by 16 for every batch
    shape = (1, 1, 1) if fold else (splits, rows, n_q)
    part_acc = torch.empty((*shape, block_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=q.device)
    from_positions = seq_lens is None
    lens = positions if seq_lens is None else seq_lens  # the unused one is never read
    pos = positions if positions is not None else lens
    _split_kernel[(batch, n_kv * num_programs)](
        q, k_cache, v_cache, part_acc, part_ml, lens, pos, block_tables, qk_scale,
        q.stride(0), q.stride(1), *kv_strides,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2), num_programs,
        *_rotary_args(q, pos, rotary), out, out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE=page,
        SPLIT=split_keys, FROM_POSITIONS=from_positions, UPCAST_DOT=INTERPRETING, USE_PDL=pdl,
        ROTARY=rotary is not None, FOLD=fold, num_warps=NUM_WARPS, num_stages=2, **pdl_launch(pdl),
    )  # fmt: skip
    if fold:
        return out
    _merge_kernel[(batch, n_kv)](
        part_acc, part_ml, out, lens, pos, qk_scale,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P2=next_pow2(group), HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT=split_keys,
        FROM_POSITIONS=from_positions, USE_PDL=pdl, LATE=_common.LATE_TRIGGER, num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def _rotary_args(q: torch.Tensor, pos: torch.Tensor, rotary) -> tuple:
    """The split kernel's k, v, cos, sin, slots and their strides (unused placeholders without rotary)."""
    if rotary is None:
        return (q, q, q, q, pos, 0, 0, 0, 0, 0)
    k, v, cos, sin, slots = rotary
    return (k, v, cos, sin, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0))


def decode_attention_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    num_programs: int | None = None,
    split_keys: int = SPLIT_KEYS,
    pdl: bool = False,
) -> torch.Tensor:
    """A decode step's rotary, K/V write and attention in the split launch (then the merge): the bits of
    rotary.rotary_and_store_kv followed by paged_attention, one launch fewer. q [B, Hq, D], k and v [B, Hkv, D]
    unrotated, one token a sequence at `positions`; the other arguments as those two functions take them. D must
    be a power of two (the rotated halves are joined in registers)."""
    num_tokens, n_q, head_dim, page, n_kv = check_paged_attention_inputs(q, k_cache, v_cache)
    check(head_dim == next_pow2(head_dim),
          f"q: head_dim {head_dim} is not a power of two; use rotary_and_store_kv and paged_attention")
    check(n_q // n_kv <= BLOCK_M, f"q: a GQA group of {n_q // n_kv} heads exceeds the {BLOCK_M}-row tile")
    rotary.check_token_inputs(q, k, v, positions, cos, sin, slot_mapping)
    check(k.shape[1] == n_kv, f"k: {k.shape[1]} KV heads, the caches hold {n_kv}")
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        check(x.stride(-1) == 1, f"{name}: the last dim must have unit stride")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=q.device)
    check(block_tables.shape[0] == num_tokens, f"block_tables: {block_tables.shape[0]} rows for {num_tokens} tokens")
    check(split_keys >= BLOCK_N and split_keys % BLOCK_N == 0,
          f"split_keys: {split_keys} is not a positive multiple of {BLOCK_N}")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    return _decode(q, k_cache, v_cache, out, None, positions, block_tables, float(scale) * LOG2E,
                   max_seq_len=max_seq_len, num_programs=num_programs, split_keys=split_keys, pdl=pdl,
                   rotary=(k, v, cos, sin, slot_mapping))
