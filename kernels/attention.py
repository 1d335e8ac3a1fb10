"""Paged attention over the KV cache: one kernel for decode, chunked prefill and prefix reuse, plus a split merge.

Design (after FlashAttention-2's online softmax and the flash-decoding split-K scheme): one program owns one KV
head of one sequence and a tile of BLOCK_M query rows, where a row is a (query token, query head of that KV head's
group) pair. Packing the GQA group into the rows means every K/V tile is read from memory once for all the query
heads that share it (decode: the whole group is one tile). The key range of a tile is split NUM_SPLITS ways when
there are too few tiles to fill the GPU (decode at small batch); each split writes a normalised partial output and
its log-sum-exp, and `_merge_splits_kernel` combines them. Keys are gathered token by token through the block
table, so BLOCK_N does not depend on the cache's block size.

Floor (decode): memory, the K and V of every cached token read once: 2·seq_len·Hkv·D·bytes per sequence per layer.
Floor (prefill): tensor-core FLOPs, 4·q_len·(ctx + q_len/2)·Hq·D per sequence per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import (
    FLOAT_DTYPES,
    INTERPRETING,
    check,
    check_paged_attention_inputs,
    check_tensor,
    exact_dot,
    load_kv_tile,
    next_pow2,
    padded_rows,
    pdl_launch,
    pow2_floor,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # key splits of one (sequence, KV head)
LONG_SPLIT_KEYS = 2048  # batch 1: split further while a split holds more keys than this


@triton.jit
def split_key_range(pid_m, q_len, seq_len, split, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr):  # fmt: skip
    """Keys [lo, hi) that query tile pid_m (BLOCK_M (token, query head) rows, GROUP heads a token) sees in key
    split `split`: up to the last row's position (causal), from the first row's window start (sliding window;
    else from 0), split NUM_SPLITS ways in BLOCK_N multiples."""
    last_tok = tl.minimum(q_len - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP)
    kv_end = tl.minimum(seq_len, seq_len - q_len + last_tok + 1)
    kv_start = 0
    if WINDOW > 0:
        kv_start = tl.maximum(seq_len - q_len + (pid_m * BLOCK_M) // GROUP - WINDOW + 1, 0)
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_start + split * chunk
    return lo, tl.minimum(kv_end, lo + chunk)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, start, hi, q_pos, b, kvh, d, d_ok, qk_scale,
                 k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_kb, stride_ks, stride_kh, stride_bt,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 MASKED: tl.constexpr, WINDOW: tl.constexpr):  # fmt: skip
    """One BLOCK_N tile of keys [start, start + BLOCK_N) through the online softmax. MASKED: apply the causal
    mask and the end of the range (the tiles on the diagonal and the last one); else every key is visible.
    WINDOW > 0 (with MASKED): a row at position p also hides keys ≤ p - WINDOW (sliding-window attention)."""
    kpos = start + tl.arange(0, BLOCK_N)
    k_ok = kpos < hi
    k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kvh, kpos, k_ok, d, d_ok, stride_kb,
                        stride_ks, stride_kh, stride_bt, PAGE)  # fmt: skip
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = exact_dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        visible = (kpos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOW > 0:
            visible = visible & (kpos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
    return _softmax_step(s, v, m_i, l_i, acc)


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    """One tile of scores s [M, N] (log2 domain, -inf where hidden) and its values v [N, D] into the online
    softmax state (running max m_i, sum l_i, unnormalised output acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet keeps p = 0
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + exact_dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# stride_bt follows the step's longest block table: not specialised, so no step meets a variant the warm-up did not
# compile (verify/lab/journal-kernels.md, "Compile keys").
@triton.jit(do_not_specialize=["stride_bt"])
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    cu_q_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_CAUSAL: tl.constexpr,
    HAS_SINKS: tl.constexpr = False, WINDOW: tl.constexpr = 0,
):  # fmt: skip
    if USE_PDL:  # everything below reads what earlier kernels of the step wrote (q, the new K/V, seq_lens)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP  # query token within this sequence's chunk
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    q_pos = seq_len - q_len + tok  # absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    if UPCAST_DOT:
        q = q.to(tl.float32)

    lo, hi = split_key_range(pid_m, q_len, seq_len, split, GROUP, BLOCK_M, BLOCK_N, NUM_SPLITS, WINDOW)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink joins split 0's softmax as one more logit (log2 domain, unscaled) with no value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    mid = lo
    if SPLIT_CAUSAL:
        # Keys below `mid` are visible to every row of the tile (they precede its first token): no causal mask.
        # Prefill only: on the H200 the second loop made decode 5-25% slower (verify/lab/journal-kernels.md).
        first_visible_end = seq_len - q_len + (pid_m * BLOCK_M) // GROUP + 1
        mid = lo + tl.maximum(tl.minimum(first_visible_end, hi) - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, mid, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, hi, q_pos, b, kvh, d, d_ok, qk_scale,
                                         k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_kb, stride_ks,
                                         stride_kh, stride_bt, BLOCK_N, PAGE, UPCAST_DOT, False, 0)  # fmt: skip
    for start in range(mid, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, hi, q_pos, b, kvh, d, d_ok, qk_scale,
                                     k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_kb, stride_ks, stride_kh,
                                     stride_bt, BLOCK_N, PAGE, UPCAST_DOT, True, WINDOW)  # fmt: skip

    l_div = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_div[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        p_ptrs = part_o_ptr + split * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :]
        tl.store(p_ptrs, o, mask=out_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_div), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = sp < NUM_SPLITS
    lse = tl.load(part_lse_ptr + sp * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)  # finite: some split sees each row's own (newest) key
    w = tl.where(s_ok, tl.exp2(lse - m), 0.0)
    o = tl.load(part_o_ptr + sp[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device, *,
                      min_keys: int = 64, programs_per_sm: int = 2) -> int:  # fmt: skip
    """Split the key range only as far as needed to give every SM `programs_per_sm` programs (and, for one
    sequence, no split longer than LONG_SPLIT_KEYS while there are SMs to spare), each split ≥ min_keys keys (below
    that the merge costs more than the parallelism gains); rounded down to a power of two."""
    programs = max(1, batch * num_kv_heads)
    sms = _sm_count(device)
    want = triton.cdiv(programs_per_sm * sms, programs)
    if batch == 1:  # one long sequence: splits of at most LONG_SPLIT_KEYS keys, up to 8 programs an SM (gpt-oss
        # at 131K keys: 117 -> 85 us a full layer from 32 to 64 splits; verify/lab/journal-kernels.md, "Long decode")
        want = max(want, min(triton.cdiv(max_seq_len, LONG_SPLIT_KEYS), 8 * sms // programs))
    # A power of two: NUM_SPLITS is a constexpr, so each value is a compiled variant, and the warm-up compiles
    # every one a step can meet (1, 2, 4 .. 64; runtime/engine/accel/warm_up.py).
    return pow2_floor(max(1, min(want, triton.cdiv(max_seq_len, min_keys), MAX_SPLITS)))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed varlen queries q [T,Hq,D] over paged caches [num_blocks, block_size, Hkv, D].

    Sequence b's query rows are cu_seqlens_q[b]:cu_seqlens_q[b+1]; they sit at the last q_len positions of its
    seq_lens[b] cached tokens (already written). max_q_len / max_seq_len bound the batch (host ints, so no sync).
    num_splits: key-range splits (None: chosen from the batch; fixed by a CUDA graph that must not re-plan).
    pdl: programmatic dependent launch, only inside a chain of kernels that all wait on their predecessor.
    sinks: [Hq] per-head sink logits (gpt-oss); window: sliding window (a query at p sees keys p-window+1 .. p;
    blocks before the window are never read), as reference.paged_attention takes them.
    """
    num_tokens, n_q, head_dim, page, n_kv = check_paged_attention_inputs(q, k_cache, v_cache)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=q.device)
    batch = seq_lens.shape[0]
    check(cu_seqlens_q.shape[0] == batch + 1, f"cu_seqlens_q: {cu_seqlens_q.shape[0]} entries for batch {batch}")
    check(block_tables.shape[0] == batch, f"block_tables: {block_tables.shape[0]} rows for batch {batch}")
    check(max_q_len >= 1 and max_seq_len >= max_q_len, f"max_q_len {max_q_len} / max_seq_len {max_seq_len} invalid")
    check(window is None or window >= 1, f"window: {window} must be a positive number of tokens or None")
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, device=q.device)
        check(sinks.shape[0] == n_q, f"sinks: {sinks.shape[0]} entries for {n_q} query heads")

    group = n_q // n_kv
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    if num_splits is None:
        # Prefill tiles already fill the GPU; splitting pays only for short query chunks. A window bounds the keys.
        keys = max_seq_len if window is None else min(max_seq_len, window + max_q_len)
        num_splits = choose_num_splits(batch, n_kv, keys, q.device) if max_q_len <= 4 else 1
    if block_m is None:
        block_m = max(16, min(128, next_pow2(max_q_len * group)))
    if max_q_len > 4 and block_m == 128:
        # Prefill tiles, best of the H200 sweep of 2026-11-29 (verify/lab/journal-kernels.md): short chunks favour
        # narrow key tiles, long prompts wide ones (8 x 1K packed: 268 us vs 297 us; one 10K prompt: 2.21 ms vs
        # 2.46 ms).
        long_prompt = max_q_len >= 4096
        block_n = block_n if block_n != 64 else (128 if long_prompt else 32)
        num_warps = num_warps or (8 if long_prompt else 4)
        num_stages = num_stages or 3
    if num_warps is None:
        num_warps = 4 if block_m <= 64 else 8
    if num_stages is None and max_q_len <= 4:
        num_stages = 2  # decode: the H200 sweep's best at batch 64 (1K) and batch 1 (10K); 1 won at batch 1 (1K)
    if num_splits > 1:
        rows = padded_rows(num_tokens)  # split strides divisible by 16 whatever the step's token count
        part_o = torch.empty((num_splits, rows, n_q, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, rows, n_q), dtype=torch.float32, device=q.device)
    else:
        part_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(max_q_len * group, block_m), batch, n_kv * num_splits)
    _attn_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, cu_seqlens_q, seq_lens, block_tables,
        sinks if sinks is not None else q, float(scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        NUM_SPLITS=num_splits, UPCAST_DOT=INTERPRETING, USE_PDL=pdl,
        SPLIT_CAUSAL=max_q_len > 4 and window is None,  # a window's keys all need the mask
        HAS_SINKS=sinks is not None, WINDOW=window or 0, num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}), **pdl_launch(pdl),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, n_q)](
            part_o, part_lse, out,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
            USE_PDL=pdl, num_warps=4, **pdl_launch(pdl),
        )  # fmt: skip
    return out
