"""Decode attention with rotary, the KV-cache write and (optionally) the split merge folded into one launch.

The unfused decode layer runs three kernels between the QKV and O projections: `rotary.rotary_and_store_kv`,
`attention._attn_kernel` and `attention._merge_splits_kernel`, two of them launch-bound at batch 1
(verify/lab/journal-kernels.md: 2.2 µs + ~2 µs of a 7.6 µs attention stage). Here one program per (sequence, KV head,
key split) reads the un-rotated q/k/v straight from the QKV projection's output row, and:

1. rotates the GROUP query heads of its KV head in registers (every split redoes it: GROUP x D elements);
2. attends over its share of the *cached* keys 0 .. pos-1 with the same tile code as `attention._attn_kernel`;
3. if it owns the split holding position pos (the new token), rotates the new k, writes k and v into the paged
   cache at the slot (a negative slot is a padding row: nothing is written) and adds the new key to its online
   softmax from registers. No program of this launch reads position pos from the cache, so the write races with
   nothing;
4. with more than one split, writes its partial (o, lse); with MERGE_IN_KERNEL the last split of a (sequence, KV
   head) to finish merges all partials (the "last block" pattern of the CUDA threadFenceReduction sample and of
   CUTLASS's split-K serial semaphore), else `attention._merge_splits_kernel` runs as a second launch.

A speculative verify step (`q_len` > 1) runs through the same launch: each sequence brings q_len new tokens at
consecutive positions, every program rotates all q_len x GROUP query rows, the owner of the first new position
writes all q_len keys and values and lets them into its softmax as one causal tile from registers, and the merge
runs per token as a second launch. This replaces the verify step's rotary, prefill-attention and merge launches
(verify/lab/journal-kernels.md, v16).

Rounding follows the unfused path: rotated q and k are rounded to the storage dtype before the dots, as the
rotary kernel stores them; the new key's probability is rounded to V's dtype as `tl.dot(p.to(v.dtype), v)` does.
Floor: memory, as `attention.paged_attention` (2·seq_len·Hkv·D·bytes per sequence per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import (
    FLOAT_DTYPES,
    INTERPRETING,
    check,
    check_tensor,
    exact_dot,
    next_pow2,
    padded_rows,
    pdl_launch,
)
from envex.kernels.attention import (
    LOG2E,
    LONG_SPLIT_KEYS,
    _attend_tile,
    _merge_splits_kernel,
    _softmax_step,
    choose_num_splits,
)

# A split of fewer keys than this takes 64-key tiles in a launch built with 128-key ones (run-time choice).
SHORT_SPLIT_KEYS = 1024
# Query rows (new tokens x GQA group) one program holds: a verify step of more goes to attention.paged_attention.
MAX_QUERY_ROWS = 64

# Elements of the [splits, GROUP, D] fp32 tile the merging program loads at once: 64 registers a thread at 4 warps.
_MERGE_TILE = 8192


@triton.jit
def _rope(x, xp, c, s, lo_half):
    """HF rotate_half: x1·c − x2·s in the low half, x2·c + x1·s in the high half; xp is x's partner (d ± D/2).
    Written as the rotary kernel writes it, so both round the same way."""
    return tl.where(lo_half, x * c - xp * s, x * c + xp * s)


@triton.jit
def _head_rms_norm(x, xp, w_ptr, d, partner, d_ok, eps, HEAD_DIM: tl.constexpr):
    """HF's RMSNorm over each row of x [R, BLOCK_D] (one head each), applied to x and to its rotary partner xp:
    fp32 statistics, the normalised value rounded to x's dtype, then times the weight and rounded again."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    x_n = (w * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    xp_n = (wp * (xp.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    return x_n, xp_n


@triton.jit
def _merge_partials(part_o_ptr, part_lse_ptr, t, head0, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr):  # fmt: skip
    """Σ_s 2^(lse_s − m)·o_s / Σ_s 2^(lse_s − m) for the GROUP heads head0.. of token t -> [GROUP_P2, BLOCK_D].
    Loads bypass L1 (.cg): the partials were written by other SMs during this launch."""
    g = tl.arange(0, GROUP_P2)
    g_ok = g < GROUP
    sp = tl.arange(0, BLOCK_S)
    lse_all = tl.load(part_lse_ptr + sp[:, None] * stride_ls + t * stride_lt + head0 + g[None, :],
                      mask=(sp < NUM_SPLITS)[:, None] & g_ok[None, :], other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
    m = tl.max(lse_all, axis=0)  # [GROUP_P2]; finite for real heads: the new key's split always has a key
    m = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp2(lse_all - m[None, :]), axis=0)
    ss = tl.arange(0, MERGE_S)[:, None, None]
    gg = g[None, :, None]
    dd = tl.arange(0, BLOCK_D)[None, None, :]
    acc = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, MERGE_S):  # MERGE_S splits per step keep the tile in registers
        s_ok = (s0 + ss) < NUM_SPLITS
        # [MERGE_S, GROUP_P2, 1] log-sum-exps and [MERGE_S, GROUP_P2, BLOCK_D] partial outputs
        lse = tl.load(part_lse_ptr + (s0 + ss) * stride_ls + t * stride_lt + head0 + gg,
                      mask=s_ok & (gg < GROUP), other=float("-inf"), cache_modifier=".cg")  # fmt: skip
        o = tl.load(part_o_ptr + (s0 + ss) * stride_ps + t * stride_pt + (head0 + gg) * stride_ph + dd,
                    mask=s_ok & (gg < GROUP) & (dd < HEAD_DIM), other=0.0, cache_modifier=".cg")  # fmt: skip
        acc += tl.sum(tl.exp2(lse - m[None, :, None]) * o, axis=0)
    return acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]


@triton.jit
def _attend_keys(q, m_i, l_i, acc, lo, hi, q_pos, b, kvh, d, d_ok, qk_scale, k_cache_ptr, v_cache_ptr,
                 block_tables_ptr, stride_kb, stride_ks, stride_kh, stride_bt, TILE: tl.constexpr,
                 PAGE: tl.constexpr, UPCAST_DOT: tl.constexpr, WINDOW: tl.constexpr):  # fmt: skip
    """Keys lo .. hi-1 through the online softmax in TILE-key tiles."""
    for start in range(lo, hi, TILE):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, hi, q_pos, b, kvh, d, d_ok, qk_scale, k_cache_ptr,
                                     v_cache_ptr, block_tables_ptr, stride_kb, stride_ks, stride_kh, stride_bt,
                                     TILE, PAGE, UPCAST_DOT, True, WINDOW)  # fmt: skip
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # as attention._attn_kernel's
def _decode_fused_kernel(
    qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, counter_ptr, q_norm_ptr, k_norm_ptr, sinks_ptr, qk_scale, norm_eps,
    stride_qkv, stride_cos, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    N_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr,
    UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr, QK_NORM: tl.constexpr,
    HAS_SINKS: tl.constexpr = False, WINDOW: tl.constexpr = 0, Q_LEN: tl.constexpr = 1, Q_P2: tl.constexpr = 16,
    SHORT_N: tl.constexpr = 0, SHORT_KEYS: tl.constexpr = 0,
):  # fmt: skip
    if USE_PDL:  # qkv, positions and slots come from earlier kernels of the step; the counters from this kernel's
        tl.extra.cuda.gdc_launch_dependents()  # previous launch (complete once gdc_wait returns, transitively)
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    HALF: tl.constexpr = HEAD_DIM // 2
    # Sequence b's Q_LEN new tokens are rows b·Q_LEN .. b·Q_LEN + Q_LEN - 1 of qkv, at consecutive positions from
    # its first one, pos (keys 0 .. pos-1 are cached); int32 like _attn_kernel's loop bounds.
    pos = tl.load(pos_ptr + b * Q_LEN).to(tl.int32)
    seq_len = pos + 1

    rows = tl.arange(0, BLOCK_M)  # one row per (new token, query head of this KV head's group)
    tok = rows // GROUP
    row_ok = tok < Q_LEN
    head = kvh * GROUP + rows % GROUP
    t_row = b.to(tl.int64) * Q_LEN + tok  # each row's token: its qkv row and its output row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lo_half = d < HALF
    partner = tl.where(lo_half, d + HALF, d - HALF)
    half_d = tl.where(lo_half, d, d - HALF)
    if Q_LEN == 1:
        c = tl.load(cos_ptr + pos * stride_cos + half_d, mask=d_ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + half_d, mask=d_ok, other=0.0).to(tl.float32)
        c_q, s_q = c[None, :], s[None, :]
    else:  # each row rotates at its own token's position
        pos_row = tl.load(pos_ptr + t_row, mask=row_ok, other=0)
        cs_off = pos_row[:, None] * stride_cos + half_d[None, :]
        c_q = tl.load(cos_ptr + cs_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s_q = tl.load(sin_ptr + cs_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    # 1. q of the GROUP heads (of each new token), rotated and rounded as the rotary kernel would have stored it.
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_ptrs = qkv_ptr + t_row[:, None] * stride_qkv + head[:, None] * HEAD_DIM
    q = tl.load(q_ptrs + d[None, :], mask=q_mask, other=0.0)
    qp = tl.load(q_ptrs + partner[None, :], mask=q_mask, other=0.0)
    if QK_NORM:  # Qwen3: RMSNorm over each head before the rotation (rounded as the norm kernel rounds)
        q, qp = _head_rms_norm(q, qp, q_norm_ptr, d, partner, d_ok, norm_eps, HEAD_DIM)
    q = _rope(q.to(tl.float32), qp.to(tl.float32), c_q, s_q, lo_half[None, :]).to(q.dtype)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # 2. This split's share of the cached keys, in multiples of 64 whatever BLOCK_N (a 128-key tile chosen for a
    # graph's long splits then leaves as many splits busy on a short sequence as a 64-key one; the tile's mask
    # stops at hi); with a sliding window only keys pos-WINDOW+1 .. pos are split (and read). Every row sees every
    # cached key (each is older than the first new token) but for the window, which the tile masks per row.
    kv_start = 0
    if WINDOW > 0:
        kv_start = tl.maximum(pos - WINDOW + 1, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), 64) * 64
    lo = kv_start + split * chunk
    hi = tl.minimum(seq_len - 1, lo + chunk)  # positions pos.. (the new keys) come from registers, below
    q_pos = pos + tok
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink joins split 0's softmax as one more logit (log2 domain, unscaled) with no value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # LOG2E
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SHORT_N > 0 and hi - lo < SHORT_KEYS:
        # A graph captured for long sequences (BLOCK_N = 128) running a short one: the 64-key tile, as a graph
        # for short sequences would have (gpt-oss at 1K keys: 3% a token; verify/lab/journal-kernels.md, "Long decode").
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, lo, hi, q_pos, b, kvh, d, d_ok, qk_scale, k_cache_ptr,
                                     v_cache_ptr, block_tables_ptr, stride_kb, stride_ks, stride_kh, stride_bt,
                                     SHORT_N, PAGE, UPCAST_DOT, WINDOW)  # fmt: skip
    else:
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, lo, hi, q_pos, b, kvh, d, d_ok, qk_scale, k_cache_ptr,
                                     v_cache_ptr, block_tables_ptr, stride_kb, stride_ks, stride_kh, stride_bt,
                                     BLOCK_N, PAGE, UPCAST_DOT, WINDOW)  # fmt: skip

    # 3. The new tokens' k (rotated) and v. Every split computes them (L2-resident rows); only the owner of
    # position pos writes them to the cache and lets the new keys into its softmax.
    owner = split == (pos - kv_start) // chunk
    if Q_LEN == 1:
        k_row = qkv_ptr + b.to(tl.int64) * stride_qkv + (N_KV * GROUP + kvh) * HEAD_DIM
        k_new = tl.load(k_row + d, mask=d_ok, other=0.0)
        k_par = tl.load(k_row + partner, mask=d_ok, other=0.0)
        if QK_NORM:
            k_new, k_par = _head_rms_norm(k_new[None, :], k_par[None, :], k_norm_ptr, d, partner, d_ok, norm_eps,
                                          HEAD_DIM)  # fmt: skip
            k_new, k_par = tl.reshape(k_new, [BLOCK_D]), tl.reshape(k_par, [BLOCK_D])
        k_new = _rope(k_new.to(tl.float32), k_par.to(tl.float32), c, s, lo_half).to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(k_row + N_KV * HEAD_DIM + d, mask=d_ok, other=0.0)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b)
        # A negative slot is a padding row of a graph batch: nothing to cache. (A bound rather than `d_ok & owner`:
        # the interpreter rejects masks built from scalar booleans.)
        write = d < tl.where(owner & (slot >= 0), HEAD_DIM, 0)
        slot_c = tl.maximum(slot, 0).to(tl.int64)
        kv_off = (slot_c // PAGE) * stride_kb + (slot_c % PAGE) * stride_ks + kvh * stride_kh + d
        tl.store(k_cache_ptr + kv_off, k_new, mask=write)
        tl.store(v_cache_ptr + kv_off, v_new, mask=write)
        if UPCAST_DOT:
            v_dot = v_new.to(tl.float32)
        else:
            v_dot = v_new
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        s_new = tl.where(owner, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty split (short sequence) keeps p = 0
        p = tl.exp2(s_new - m_safe)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p.to(v_dot.dtype).to(tl.float32)[:, None] * v_dot.to(tl.float32)[None, :]
        m_i = m_new
    else:
        # A verify step's Q_LEN tokens as one [Q_P2, BLOCK_D] tile (Q_P2 >= 16 for tl.dot): token j is seen by
        # the rows of tokens j.. (causal among themselves), through the tile code's online softmax.
        j = tl.arange(0, Q_P2)
        j_ok = j < Q_LEN
        t_new = b.to(tl.int64) * Q_LEN + j
        pos_new = tl.load(pos_ptr + t_new, mask=j_ok, other=0)
        nk_mask = j_ok[:, None] & d_ok[None, :]
        cs_new = pos_new[:, None] * stride_cos + half_d[None, :]
        c_k = tl.load(cos_ptr + cs_new, mask=nk_mask, other=0.0).to(tl.float32)
        s_k = tl.load(sin_ptr + cs_new, mask=nk_mask, other=0.0).to(tl.float32)
        k_rows = qkv_ptr + t_new[:, None] * stride_qkv + (N_KV * GROUP + kvh) * HEAD_DIM
        k_new = tl.load(k_rows + d[None, :], mask=nk_mask, other=0.0)
        k_par = tl.load(k_rows + partner[None, :], mask=nk_mask, other=0.0)
        if QK_NORM:
            k_new, k_par = _head_rms_norm(k_new, k_par, k_norm_ptr, d, partner, d_ok, norm_eps, HEAD_DIM)
        k_new = _rope(k_new.to(tl.float32), k_par.to(tl.float32), c_k, s_k, lo_half[None, :])
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(k_rows + N_KV * HEAD_DIM + d[None, :], mask=nk_mask, other=0.0)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + t_new, mask=j_ok, other=-1)
        write = (slot >= 0)[:, None] & (d[None, :] < tl.where(owner, HEAD_DIM, 0))
        slot_c = tl.maximum(slot, 0).to(tl.int64)
        kv_off = (slot_c // PAGE) * stride_kb + (slot_c % PAGE) * stride_ks + kvh * stride_kh
        tl.store(k_cache_ptr + kv_off[:, None] + d[None, :], k_new, mask=write)
        tl.store(v_cache_ptr + kv_off[:, None] + d[None, :], v_new, mask=write)
        if UPCAST_DOT:
            k_new = k_new.to(tl.float32)
            v_new = v_new.to(tl.float32)
        s_new = exact_dot(q, tl.trans(k_new)) * qk_scale  # [BLOCK_M, Q_P2], log2 domain
        visible = (j[None, :] <= tok[:, None]) & j_ok[None, :]
        if WINDOW > 0:
            visible = visible & (pos_new[None, :] > q_pos[:, None] - WINDOW)
        s_new = tl.where(visible, s_new, float("-inf"))
        s_new = tl.where(owner, s_new, float("-inf"))
        m_i, l_i, acc = _softmax_step(s_new, v_new, m_i, l_i, acc)

    l_div = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_div[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + t_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)  # fmt: skip
    else:
        tl.store(part_o_ptr + split * stride_ps + t_row[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :],
                 o, mask=q_mask)  # fmt: skip
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_div), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + t_row * stride_lt + head, lse, mask=row_ok)
        if MERGE_IN_KERNEL:  # one token per sequence (the launcher's check): token b
            t = b.to(tl.int64)
            # 4. Memory ordering (the pattern of CUTLASS's split-K semaphore, cutlass/barrier.h):
            #  - every thread of this program has stored part of the partial above; the CTA barrier orders those
            #    stores before the atomic, which one thread issues (Triton lowers a scalar atomic to one thread);
            #  - the atomic is acq_rel at GPU scope: its release half makes this CTA's partial (cumulatively, via
            #    the barrier) visible to whichever program later reads the incremented count;
            #  - the program that reads NUM_SPLITS-1 has acquired every other split's release (they form one
            #    release sequence on the counter), and Triton broadcasts the atomic's result to the CTA through
            #    shared memory behind a barrier; the second barrier below makes that ordering explicit before any
            #    thread loads a partial, and those loads skip L1 (.cg) so no stale line can be hit.
            # The last program resets the counter to 0: all NUM_SPLITS increments of this launch have happened,
            # and the next launch that uses the counter starts after this one completes (stream order; with PDL
            # after gdc_wait, which waits for the predecessor chain to complete), so no memset is ever needed.
            tl.debug_barrier()
            count = tl.atomic_add(counter_ptr + b * N_KV + kvh, 1, sem="acq_rel", scope="gpu")
            if count == NUM_SPLITS - 1:
                tl.debug_barrier()
                merged = _merge_partials(part_o_ptr, part_lse_ptr, t, kvh * GROUP, stride_ps, stride_pt, stride_ph,
                                         stride_ls, stride_lt, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, NUM_SPLITS,
                                         BLOCK_S, MERGE_S)  # fmt: skip
                g = tl.arange(0, GROUP_P2)
                tl.store(out_ptr + t * stride_ot + (kvh * GROUP + g[:, None]) * stride_oh + d[None, :],
                         merged.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & d_ok[None, :])  # fmt: skip
                tl.store(counter_ptr + b * N_KV + kvh, 0)


def takes_long_tile(head_dim: int, keys: int, num_splits: int) -> bool:
    """Whether a launch over up to `keys` keys in num_splits splits takes the 128-key tile with 3 stages: long
    splits of 64-wide heads (gpt-oss at 131K: 84.7 -> 75.1 us a full layer; verify/lab/journal-kernels.md, "Long
    decode")."""
    return head_dim <= 64 and triton.cdiv(keys, num_splits) >= LONG_SPLIT_KEYS


def new_split_counters(batch: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters `decode_attention_fused(merge_in_kernel=True)` needs: one per (sequence, KV head).
    Allocate once per batch size and reuse (each launch leaves them at zero); one buffer serves every layer."""
    return torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=device)


def decode_attention_fused(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_splits: int | None = None,
    merge_in_kernel: bool = True,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    q_len: int = 1,
) -> torch.Tensor:
    """q_len new tokens per sequence (decode: 1; a speculative verify step: k + 1): (q/k RMSNorm,) rotary on
    q/k, k/v written to the cache at slot_mapping, causal attention -> [B·q_len, Hq, D].

    qkv: [B·q_len, (Hq + 2·Hkv)·D], the QKV projection's output, un-rotated (q heads, then k heads, then v heads);
    sequence b's tokens are rows b·q_len .. b·q_len + q_len - 1. positions: [B·q_len] position of each new token,
    consecutive within a sequence (its cached keys are 0 .. its first position - 1; max_seq_len bounds the last
    position + 1). slot_mapping: [B·q_len] cache slot of each new token (block·block_size + offset); negative =
    not written (a padding row, or a verify row past the drafts: its output is garbage, and rows after it in the
    sequence must be garbage too, as they would see its key). cos/sin: [max_pos, D/2] float32. Caches: [num_blocks,
    block_size, Hkv, D]. merge_in_kernel: merge the key splits in the last program to finish (needs `counters`,
    from new_split_counters, left at zero after every launch; allocated here if None) instead of a second launch.
    out / partials ([S, B·q_len, Hq, D] and [S, B·q_len, Hq] float32): preallocated buffers, else allocated here.
    merge_in_kernel is ignored (the merge is a second launch) with one split or q_len > 1.
    q_norm, k_norm: [D] RMSNorm weights applied to each q and k head before the rotation (Qwen3), both or neither.
    sinks: [Hq] per-head sink logits; window: sliding window (keys position-window+1 .. position), as
    reference.paged_attention takes them (gpt-oss). max_seq_len is then also bounded by window for the split count.
    """
    check_tensor("qkv", qkv, ndim=2, dtypes=FLOAT_DTYPES)
    check(isinstance(q_len, int) and q_len >= 1 and qkv.shape[0] % q_len == 0,
          f"q_len: {q_len!r} must be an int ≥ 1 that divides qkv's {qkv.shape[0]} rows")  # fmt: skip
    tokens = qkv.shape[0]
    batch = tokens // q_len
    dev = qkv.device
    check(num_kv_heads >= 1 and num_heads % num_kv_heads == 0,
          f"num_heads: {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")  # fmt: skip
    group = num_heads // num_kv_heads
    check(q_len == 1 or q_len * group <= MAX_QUERY_ROWS,
          f"q_len: {q_len} tokens x GQA group {group} = {q_len * group} query rows per KV head > {MAX_QUERY_ROWS}; "
          "run a step this long through attention.paged_attention")  # fmt: skip
    check(k_cache.dim() == 4, f"k_cache: expected [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    page, head_dim = k_cache.shape[1], k_cache.shape[3]
    check(qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim,
          f"qkv: width {qkv.shape[1]} != (Hq + 2·Hkv)·D = {(num_heads + 2 * num_kv_heads) * head_dim}")  # fmt: skip
    check(head_dim % 2 == 0, f"k_cache: head_dim {head_dim} must be even for rotate_half rotary")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, ndim=4, dtypes=(qkv.dtype,), device=dev)
        check(c.shape[2] == num_kv_heads, f"{name}: {c.shape[2]} KV heads, expected {num_kv_heads}")
    check(k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
          "v_cache: must have k_cache's shape and strides")  # fmt: skip
    check(page >= 1 and page & (page - 1) == 0, f"k_cache: block_size {page} must be a power of two")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
        check(t.shape[0] == tokens, f"{name}: {t.shape[0]} entries for {tokens} tokens")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=dev)
        check(t.shape[1] == head_dim // 2, f"{name}: last dim {t.shape[1]} != head_dim/2 = {head_dim // 2}")
    check(cos.stride(0) == sin.stride(0), "cos/sin: must share one row stride; pass .contiguous() for both")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
    check(block_tables.shape[0] == batch, f"block_tables: {block_tables.shape[0]} rows for batch {batch}")
    check(max_seq_len >= 1, f"max_seq_len: {max_seq_len} must be ≥ 1")
    check((q_norm is None) == (k_norm is None), "q_norm/k_norm: pass both or neither")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            check_tensor(name, w, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
            check(w.shape[0] == head_dim, f"{name}: length {w.shape[0]} != head_dim {head_dim}")
    check(window is None or window >= 1, f"window: {window} must be a positive number of tokens or None")
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        check(sinks.shape[0] == num_heads, f"sinks: {sinks.shape[0]} entries for {num_heads} query heads")

    if out is None:
        out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=dev)
    check_tensor("out", out, ndim=3, dtypes=(qkv.dtype,), device=dev)
    want = (tokens, num_heads, head_dim)
    check(out.shape == want, f"out: shape {tuple(out.shape)} != {want}")
    if batch == 0:
        return out
    keys = max_seq_len if window is None else min(max_seq_len, window)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, keys, dev)
    short_n = 0
    if block_n is None:  # long splits of 64-wide heads: 128-key tiles, 3 stages (gpt-oss at 131K: 84.7 -> 75.1 us);
        # a split of the step that holds fewer than SHORT_SPLIT_KEYS keys then takes 64-key tiles at run time
        long = takes_long_tile(head_dim, keys, num_splits)
        block_n, num_stages, short_n = (128, num_stages or 3, 64) if long else (64, num_stages, 0)
    merge_in_kernel = merge_in_kernel and num_splits > 1 and q_len == 1  # the in-kernel merge: one token
    if num_splits > 1:
        if partials is None:  # rows padded: split strides divisible by 16 for every batch (_common.padded_rows)
            rows = padded_rows(tokens)
            o = torch.empty((num_splits, rows, num_heads, head_dim), dtype=torch.float32, device=dev)
            lse = torch.empty((num_splits, rows, num_heads), dtype=torch.float32, device=dev)
            partials = (o[:, :tokens], lse[:, :tokens])
        part_o, part_lse = partials
        for name, t, shape in (("o", part_o, (num_splits, tokens, num_heads, head_dim)),
                               ("lse", part_lse, (num_splits, tokens, num_heads))):  # fmt: skip
            check(t.shape == shape and t.dtype == torch.float32 and t.stride(-1) == 1,
                  f"partials: {name} must be float32 {list(shape)} with a contiguous last dim")  # fmt: skip
    else:
        part_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=dev)
        part_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=dev)
    if merge_in_kernel:
        if counters is None:
            counters = new_split_counters(batch, num_kv_heads, dev)
        check_tensor("counters", counters, ndim=1, dtypes=(torch.int32,), device=dev)
        need = batch * num_kv_heads
        msg = f"counters: {counters.numel()} entries < batch·Hkv = {need}; allocate with new_split_counters"
        check(counters.numel() >= need, msg)
    else:
        counters = part_lse  # unused by the kernel (MERGE_IN_KERNEL=False)
    block_d = next_pow2(head_dim)
    block_s = next_pow2(num_splits)
    merge_s = min(block_s, max(1, _MERGE_TILE // (next_pow2(group) * block_d)))
    _decode_fused_kernel[(batch, num_kv_heads * num_splits)](
        qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, block_tables,
        out, part_o, part_lse, counters, q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos, sinks if sinks is not None else cos, float(scale) * LOG2E,
        float(norm_eps),
        qkv.stride(0), cos.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        N_KV=num_kv_heads, GROUP=group, GROUP_P2=next_pow2(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=max(16, next_pow2(q_len * group)), BLOCK_N=block_n, PAGE=page, NUM_SPLITS=num_splits, BLOCK_S=block_s,
        MERGE_S=merge_s, MERGE_IN_KERNEL=merge_in_kernel, UPCAST_DOT=INTERPRETING, USE_PDL=pdl,
        QK_NORM=q_norm is not None, HAS_SINKS=sinks is not None, WINDOW=window or 0,
        Q_LEN=q_len, Q_P2=max(16, next_pow2(q_len)), SHORT_N=short_n, SHORT_KEYS=SHORT_SPLIT_KEYS,
        num_warps=num_warps or 4, num_stages=num_stages or 2,
        **pdl_launch(pdl),
    )  # fmt: skip
    if num_splits > 1 and not merge_in_kernel:
        _merge_splits_kernel[(tokens, num_heads)](
            part_o, part_lse, out,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=block_s, HEAD_DIM=head_dim, BLOCK_D=block_d,
            USE_PDL=pdl, num_warps=4, **pdl_launch(pdl),
        )  # fmt: skip
    return out
