"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight) on a paged latent cache.

The cache holds one row per token, [num_blocks, block_size, rank + rope] (rank = kv_lora_rank, 512; rope =
qk_rope_head_dim, 64: 576 elements, 1,152 bytes in bf16 for all heads together): the compressed KV c after
kv_a_layernorm, then k_pe after rotary in the half-split layout (reference.deepseek_rope). Slots and block tables
are the engine's (ops.AttentionMetadata: slot = block · block_size + offset, negative = not written).

Decode absorbs the up-projections (DeepSeek-V2 paper, §2.1.2 and appendix C; FlashMLA, SGLang's and vLLM's MLA
backends): kv_b_proj's weight splits per head into W_UK_h [nope, rank] and W_UV_h [v, rank]; the score
q_nope_h · (W_UK_h c) = (W_UK_hᵀ q_nope_h) · c, so the absorbed query [q_nope_h W_UK_h, q_pe_h] (576 wide) attends
over the latent rows themselves, the values are the rows' first `rank` columns, and every head shares the one latent
"KV head" (MQA with a 576-wide key and a 512-wide value). The output Σ p·c (rank wide per head) goes through W_UV_h
(expand_output), then o_proj. Per token and layer the cache read is (rank + rope)·bytes once, for all heads.

Kernels:
- `mla_store_latent`: RMSNorm of c, rotary of k_pe, the row written at its slot; optionally the query's rope part
  rotated in the same launch (one program per token).
- `mla_decode_attention`: one program per (sequence, BLOCK_H (token, head) rows, key split); both dots of the score
  (q_abs·c over rank, q_pe·k_pe over rope) and the value dot p·c read the one latent tile once. More than one split:
  partial outputs with their log-sum-exp (log2 domain), combined by `_merge_kernel` (flash-decoding split-K, as
  attention.paged_attention). Floor: memory, seq_len·(rank + rope)·bytes per sequence per layer (plus re-reads of
  the tile by the H / BLOCK_H head blocks, from L2).
- `mla_prefill_attention`: the chosen prefill path expands instead (torch, not Triton): the sequence's latent rows
  through W_UK and W_UV into per-head K [L, nope + rope] and V [L, v], then causal SDPA. Prefill is compute-bound,
  and expanded attention costs (nope + rope + v)·H multiply-adds a (query, key) pair against (2·rank + rope)·H
  absorbed: 320 against 1,088 at V3's shapes (vLLM and SGLang choose the same).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from envex.kernels._common import FLOAT_DTYPES, INTERPRETING, check, check_tensor, exact_dot, next_pow2, padded_rows
from envex.kernels.attention import LOG2E, _softmax_step, choose_num_splits

BLOCK_H = 16  # query heads a decode program holds: tl.dot's least M, and 8 programs per sequence at 128 heads
DECODE_BLOCK_N, DECODE_WARPS = 32, 8  # keys a decode tile, warps a program (mla_decode_attention's comment)
_MERGE_D = 64  # latent columns one merge program combines (a [splits, 64] fp32 tile stays in registers)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature, 0.1·mscale·ln(factor) + 1 (1 for factor ≤ 1): DeepSeek's yarn_get_mscale."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def mla_softmax_scale(qk_head_dim: int, rope_parameters: Mapping[str, Any] | None) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-1/2 (nope + rope, 192 for V3, not the 576 the absorbed dot spans),
    times yarn_mscale(factor, mscale_all_dim)² when the rope scaling is not the default one and names a nonzero
    mscale_all_dim (DeepSeek's reference model; HF's yarn_apply_mscale). V3 and Kimi K2: yarn, factor 40 (K2: 32),
    mscale_all_dim 1.0. Takes HF's rope_parameters or the older rope_scaling dict ("type" for "rope_type").
    YaRN's other factor, attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim), scales the
    cos/sin tables (1.0 for every DeepSeek checkpoint, where the two are equal): the tables' business, not this."""
    scale = qk_head_dim**-0.5
    params = dict(rope_parameters or {})
    kind = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if kind != "default" and mscale_all_dim:
        m = yarn_mscale(float(params["factor"]), float(mscale_all_dim))
        scale *= m * m
    return scale


def split_kv_b_proj(weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int,
                    v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """kv_b_proj's weight [H·(nope + v), rank] (HF layout: per head, its nope rows then its v rows) -> (W_UK
    [H, nope, rank], W_UV [H, v, rank]), views of the weight."""
    check_tensor("weight", weight, ndim=2)
    per_head = qk_nope_head_dim + v_head_dim
    check(weight.shape[0] == num_heads * per_head,
          f"weight: {weight.shape[0]} rows != num_heads·(qk_nope_head_dim + v_head_dim) = {num_heads * per_head}")
    w = weight.view(num_heads, per_head, weight.shape[1])  # [H, nope + v, rank]
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope] -> q_abs [T, H, rank] = q_nope_h @ W_UK_h per head (one batched GEMM over heads)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, T, rank] -> [T, H, rank], a view


def expand_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The attention's latent output [T, H, rank] -> [T, H·v] = W_UV_h o_h per head, o_proj's input."""
    t, h, _ = o_lat.shape
    out = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
    return out.transpose(0, 1).reshape(t, h * w_uv.shape[1])


@triton.jit
def _store_latent_kernel(
    kv_ptr, w_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, cache_ptr, q_ptr, qpe_ptr, eps,
    stride_kv, stride_cos, stride_cb, stride_cs, stride_qt, stride_qh, stride_pt, stride_ph,
    RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, HALF_P2: tl.constexpr, PAGE: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, Q_NOPE: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_Q: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_P2)
    j_ok = j < HALF
    c = tl.load(cos_ptr + pos * stride_cos + j, mask=j_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + j, mask=j_ok, other=0.0)
    if INTERLEAVED:  # pair i is (x_2i, x_2i+1)
        e1 = 2 * j
        e2 = 2 * j + 1
    else:  # pair i is (x_i, x_i+HALF)
        e1 = j
        e2 = j + HALF

    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = slot >= 0  # a padding row writes nothing (masks as bounds: the interpreter takes no scalar in a mask)
    slot = tl.maximum(slot, 0)
    row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    r = tl.arange(0, BLOCK_R)
    r_ok = r < tl.where(ok, RANK, 0)
    x = tl.load(kv_ptr + t * stride_kv + r, mask=r_ok, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / RANK + eps)
    w = tl.load(w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    c_n = w * (xf * rstd).to(x.dtype).to(tl.float32)  # HF: normalised in fp32, rounded, then times the weight
    tl.store(row + r, c_n.to(cache_ptr.dtype.element_ty), mask=r_ok)
    pe_ok = j < tl.where(ok, HALF, 0)
    x1 = tl.load(kv_ptr + t * stride_kv + RANK + e1, mask=pe_ok, other=0.0).to(tl.float32)
    x2 = tl.load(kv_ptr + t * stride_kv + RANK + e2, mask=pe_ok, other=0.0).to(tl.float32)
    tl.store(row + RANK + j, (x1 * c - x2 * s).to(cache_ptr.dtype.element_ty), mask=pe_ok)
    tl.store(row + RANK + HALF + j, (x2 * c + x1 * s).to(cache_ptr.dtype.element_ty), mask=pe_ok)

    if HAS_Q:  # every head's rope part, [HEADS_P2, HALF_P2]; written for padding rows too (their output is unused)
        h = tl.arange(0, HEADS_P2)[:, None]
        q_ok = (h < NUM_HEADS) & j_ok[None, :]
        q_row = q_ptr + t * stride_qt + h * stride_qh + Q_NOPE
        q1 = tl.load(q_row + e1[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + e2[None, :], mask=q_ok, other=0.0).to(tl.float32)
        out = qpe_ptr + t * stride_pt + h * stride_ph + j[None, :]
        tl.store(out, (q1 * c[None, :] - q2 * s[None, :]).to(qpe_ptr.dtype.element_ty), mask=q_ok)
        tl.store(out + HALF, (q2 * c[None, :] + q1 * s[None, :]).to(qpe_ptr.dtype.element_ty), mask=q_ok)


def mla_store_latent(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, latent_cache: torch.Tensor, *,
                     interleaved: bool = True, q: torch.Tensor | None = None, qk_nope_head_dim: int | None = None,
                     q_pe_out: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
    """Write each token's latent row (reference.mla_store_latent) and, given q, rotate the queries' rope part.

    kv_a: [T, rank + rope], kv_a_proj_with_mqa's output (un-normalised c, un-rotated k_pe). norm_weight: [rank],
    kv_a_layernorm's. positions / slot_mapping: [T]. cos/sin: [max_pos, rope/2] float32 (with YaRN's
    attention_factor folded in, as HF's rotary module scales them). latent_cache: [num_blocks, block_size,
    rank + rope]. interleaved: the checkpoint's rope pairs are interleaved (every DeepSeek checkpoint; HF's
    rope_interleave), else rotate_half halves. q: [T, H, nope + rope] (q_b_proj's or q_proj's output viewed per head)
    -> q_pe [T, H, rope] rotated into the cache's half-split layout (into q_pe_out if given); None without q.
    """
    check_tensor("kv_a", kv_a, ndim=2, dtypes=FLOAT_DTYPES)
    dev, tokens = kv_a.device, kv_a.shape[0]
    check_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    rank = norm_weight.shape[0]
    rope = kv_a.shape[1] - rank
    check(rope >= 2 and rope % 2 == 0,
          f"kv_a: width {kv_a.shape[1]} must be kv_lora_rank {rank} plus an even, positive qk_rope_head_dim")
    check_tensor("latent_cache", latent_cache, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check(latent_cache.shape[2] == rank + rope,
          f"latent_cache: row width {latent_cache.shape[2]} != kv_lora_rank + qk_rope_head_dim = {rank + rope}")
    page = latent_cache.shape[1]
    check(page >= 1 and page & (page - 1) == 0, f"latent_cache: block_size {page} must be a power of two")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
        check(t.shape[0] == tokens, f"{name}: {t.shape[0]} entries for {tokens} tokens")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=dev)
        check(t.shape[1] == rope // 2, f"{name}: last dim {t.shape[1]} != qk_rope_head_dim/2 = {rope // 2}")
    check(cos.stride(0) == sin.stride(0), "cos/sin: must share one row stride; pass .contiguous() for both")
    heads, nope = 1, 0
    if q is not None:
        check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
        check(qk_nope_head_dim is not None and q.shape[2] == qk_nope_head_dim + rope,
              f"q: head width {q.shape[2]} != qk_nope_head_dim ({qk_nope_head_dim}) + qk_rope_head_dim ({rope})")
        check(q.shape[0] == tokens, f"q: {q.shape[0]} rows for {tokens} tokens")
        heads, nope = q.shape[1], int(qk_nope_head_dim or 0)
        if q_pe_out is None:
            q_pe_out = torch.empty((tokens, heads, rope), dtype=q.dtype, device=dev)
        check_tensor("q_pe_out", q_pe_out, ndim=3, dtypes=(q.dtype,), device=dev)
        check(q_pe_out.shape == (tokens, heads, rope), f"q_pe_out: shape {tuple(q_pe_out.shape)} != "
              f"{(tokens, heads, rope)}")
    if tokens == 0:
        return q_pe_out
    qq = q if q is not None else kv_a.view(tokens, 1, -1)  # unused when HAS_Q is off
    qp = q_pe_out if q_pe_out is not None else qq
    _store_latent_kernel[(tokens,)](
        kv_a, norm_weight, positions, slot_mapping, cos, sin, latent_cache, qq, qp, float(eps),
        kv_a.stride(0), cos.stride(0), latent_cache.stride(0), latent_cache.stride(1),
        qq.stride(0), qq.stride(1), qp.stride(0), qp.stride(1),
        RANK=rank, HALF=rope // 2, BLOCK_R=next_pow2(rank), HALF_P2=next_pow2(rope // 2), PAGE=page,
        NUM_HEADS=heads, HEADS_P2=next_pow2(heads), Q_NOPE=nope, INTERLEAVED=bool(interleaved),
        HAS_Q=q is not None, num_warps=4,
    )  # fmt: skip
    return q_pe_out


@triton.jit(do_not_specialize=["stride_bt"])  # as attention._attn_kernel's: the step's longest table sets it
def _decode_kernel(
    qn_ptr, qp_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, qk_scale,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_cb, stride_cs, stride_bt, stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST_DOT: tl.constexpr, Q_LEN: tl.constexpr = 1,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)

    # BLOCK_H query rows, a row being one (new token, head) pair of this sequence, token-major: decode (Q_LEN 1)
    # holds BLOCK_H heads of its one token; a verify step's Q_LEN tokens at consecutive positions take more rows.
    row = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok = row // NUM_HEADS
    h = row % NUM_HEADS
    h_ok = tok < Q_LEN
    q_pos = seq_len - Q_LEN + tok  # each row's position: it sees keys 0 .. q_pos
    r = tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    p = tl.arange(0, BLOCK_P)
    p_ok = p < ROPE
    t = (b * Q_LEN + tok).to(tl.int64)  # each row's token in the packed batch
    qn = tl.load(qn_ptr + t[:, None] * stride_qnt + h[:, None] * stride_qnh + r[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
    qp = tl.load(qp_ptr + t[:, None] * stride_qpt + h[:, None] * stride_qph + p[None, :],
                 mask=h_ok[:, None] & p_ok[None, :], other=0.0)  # fmt: skip
    if UPCAST_DOT:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)

    # This split's keys: the sequence's own length split NUM_SPLITS ways in BLOCK_N multiples (some may be empty).
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(seq_len, lo + chunk)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        blk = tl.load(block_tables_ptr + b * stride_bt + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
        rows = cache_ptr + blk * stride_cb + (kpos % PAGE) * stride_cs  # [BLOCK_N] latent rows
        c = tl.load(rows[:, None] + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        pe = tl.load(rows[:, None] + RANK + p[None, :], mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        if UPCAST_DOT:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        s = (exact_dot(qn, tl.trans(c)) + exact_dot(qp, tl.trans(pe))) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
        visible = k_ok[None, :]
        if Q_LEN > 1:  # decode's one row sees every key below seq_len
            visible = visible & (kpos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, c, m_i, l_i, acc)  # the values are the same tile's first RANK columns

    l_div = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_div[:, None]
    o_mask = h_ok[:, None] & r_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + r[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)  # fmt: skip
    else:
        tl.store(part_o_ptr + split * stride_ps + t[:, None] * stride_pt + h[:, None] * stride_ph + r[None, :], o,
                 mask=o_mask)  # fmt: skip
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_div), float("-inf"))  # -inf: an empty split
        tl.store(part_lse_ptr + split * stride_ls + t * stride_lt + h, lse, mask=h_ok)


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, RANK: tl.constexpr, MERGE_D: tl.constexpr,
):  # fmt: skip
    """Σ_s 2^(lse_s − m)·o_s / Σ_s 2^(lse_s − m) for MERGE_D columns of one (token, head)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.program_id(2) * MERGE_D + tl.arange(0, MERGE_D)
    d_ok = d < RANK
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < NUM_SPLITS
    lse = tl.load(part_lse_ptr + sp * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a sequence of no keys (a padding row) gives zeros, not NaN
    w = tl.where(s_ok, tl.exp2(lse - m), 0.0)
    o = tl.load(part_o_ptr + sp[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    w_sum = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def mla_decode_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, max_seq_len: int,
                         q_len: int = 1, num_splits: int | None = None, out: torch.Tensor | None = None,
                         partials: tuple[torch.Tensor, torch.Tensor] | None = None, block_n: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:  # fmt: skip
    """Absorbed MLA over the paged latent cache, q_len new tokens per sequence (decode: 1; a speculative verify
    step: drafts + 1) -> [T, H, rank] (before W_UV), T = B·q_len.

    q_abs: [T, H, rank] (absorb_query); q_pe: [T, H, rope], rotated (mla_store_latent's); sequence b's tokens are
    rows b·q_len .. b·q_len + q_len - 1, at the last q_len of its seq_lens[b] positions, each seeing keys 0 .. its
    own position. latent_cache: [num_blocks, block_size, rank + rope], this step's rows already written.
    block_tables: [B, max_blocks]; seq_lens: [B] int32 (the new tokens included), max_seq_len bounding them (a host
    int: the split count, no device read). scale: mla_softmax_scale's. num_splits: key splits per sequence (None:
    chosen from the batch; a CUDA graph fixes it). out / partials ([S, T, H, rank] and [S, T, H] float32):
    preallocated, else allocated here.
    """
    check_tensor("q_abs", q_abs, ndim=3, dtypes=FLOAT_DTYPES)
    tokens, heads, rank = q_abs.shape
    check(isinstance(q_len, int) and q_len >= 1 and tokens % q_len == 0,
          f"q_len: {q_len!r} must be an int ≥ 1 that divides q_abs's {tokens} rows")
    batch = tokens // q_len
    dev = q_abs.device
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_abs.dtype,), device=dev)
    check(q_pe.shape[:2] == (tokens, heads), f"q_pe: shape {tuple(q_pe.shape)} does not match q_abs's {tokens, heads}")
    rope = q_pe.shape[2]
    check_tensor("latent_cache", latent_cache, ndim=3, dtypes=(q_abs.dtype,), device=dev)
    check(latent_cache.shape[2] == rank + rope,
          f"latent_cache: row width {latent_cache.shape[2]} != rank {rank} + rope {rope} of the queries")
    page = latent_cache.shape[1]
    check(page >= 1 and page & (page - 1) == 0, f"latent_cache: block_size {page} must be a power of two")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
    check(block_tables.shape[0] == batch, f"block_tables: {block_tables.shape[0]} rows for batch {batch}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    check(seq_lens.shape[0] == batch, f"seq_lens: {seq_lens.shape[0]} entries for batch {batch}")
    check(max_seq_len >= 1, f"max_seq_len: {max_seq_len} must be ≥ 1")
    if out is None:
        out = torch.empty((tokens, heads, rank), dtype=q_abs.dtype, device=dev)
    check_tensor("out", out, ndim=3, dtypes=(q_abs.dtype,), device=dev)
    check(out.shape == (tokens, heads, rank), f"out: shape {tuple(out.shape)} != {(tokens, heads, rank)}")
    if batch == 0:
        return out
    row_blocks = triton.cdiv(q_len * heads, BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(batch, row_blocks, max_seq_len, dev)
    check(isinstance(num_splits, int) and num_splits >= 1, f"num_splits: {num_splits!r} must be an int ≥ 1")
    if num_splits > 1:
        if partials is None:  # rows padded: split strides divisible by 16 for every batch (_common.padded_rows)
            rows = padded_rows(tokens)
            o = torch.empty((num_splits, rows, heads, rank), dtype=torch.float32, device=dev)
            lse = torch.empty((num_splits, rows, heads), dtype=torch.float32, device=dev)
            partials = (o[:, :tokens], lse[:, :tokens])
        part_o, part_lse = partials
        for name, t, shape in (("o", part_o, (num_splits, tokens, heads, rank)),
                               ("lse", part_lse, (num_splits, tokens, heads))):  # fmt: skip
            check(t.shape == shape and t.dtype == torch.float32 and t.stride(-1) == 1 and t.device == dev,
                  f"partials: {name} must be float32 {list(shape)} on {dev} with a contiguous last dim")
    else:
        part_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=dev)
        part_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=dev)
    # 32 keys a tile at 8 warps: 178 registers, no spills at V3's width (ptxas -v, sm_90a, Triton 3.9); at 4 warps
    # the same tile spills (255 registers) and 16-key tiles take 188. Not yet timed on a GPU.
    _decode_kernel[(batch, row_blocks, num_splits)](
        q_abs, q_pe, latent_cache, block_tables, seq_lens, out, part_o, part_lse, float(scale) * LOG2E,
        q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), latent_cache.stride(0),
        latent_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        NUM_HEADS=heads, RANK=rank, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_R=max(16, next_pow2(rank)),
        BLOCK_P=max(16, next_pow2(rope)), BLOCK_N=block_n or DECODE_BLOCK_N, PAGE=page, NUM_SPLITS=num_splits,
        UPCAST_DOT=INTERPRETING, Q_LEN=q_len, num_warps=num_warps or DECODE_WARPS, num_stages=num_stages or 2,
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(tokens, heads, triton.cdiv(rank, _MERGE_D))](
            part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
            part_lse.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), RANK=rank, MERGE_D=_MERGE_D, num_warps=4,
        )  # fmt: skip
    return out


def mla_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                          block_tables: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, *,
                          q_lens: list[int], seq_lens: list[int]) -> torch.Tensor:  # fmt: skip
    """Causal MLA for prefill chunks, expanded: -> [T, H, v] (after W_UV; o_proj's input viewed per head).

    q_nope: [T, H, nope] (un-absorbed); q_pe: [T, H, rope] (rotated). Sequence b's q_lens[b] rows (packed in
    order) sit at the last positions of its seq_lens[b] tokens, whose latent rows (this chunk's included) are in the
    cache under block_tables[b]; a chunk after a cached prefix reads the prefix from the cache too. Per sequence:
    K = [W_UK c, k_pe] and V = W_UV c for every head, then SDPA with a bottom-right causal mask, in q's dtype.
    """
    check_tensor("q_nope", q_nope, ndim=3, dtypes=(*FLOAT_DTYPES, torch.float64))  # torch: float64 runs too
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,), device=q_nope.device)
    check(len(q_lens) == len(seq_lens) == block_tables.shape[0] and sum(q_lens) == q_nope.shape[0],
          f"q_lens/seq_lens: {len(q_lens)} and {len(seq_lens)} sequences, {sum(q_lens)} rows, for "
          f"{block_tables.shape[0]} block-table rows and {q_nope.shape[0]} query rows")
    rank, page = w_uk.shape[2], latent_cache.shape[1]
    heads = q_nope.shape[1]
    out = torch.empty((q_nope.shape[0], heads, w_uv.shape[1]), dtype=q_nope.dtype, device=q_nope.device)
    tables = block_tables.long()
    q0 = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        q1 = q0 + q_len
        if q_len == 0:
            continue
        check(q_len <= seq_len, f"q_lens: sequence {b} has {q_len} new tokens but seq_lens says {seq_len} in all")
        blocks = tables[b, : (seq_len + page - 1) // page]
        rows = latent_cache.index_select(0, blocks).reshape(-1, latent_cache.shape[2])[:seq_len].to(q_nope.dtype)
        c, k_pe = rows[:, :rank], rows[:, rank:]  # [L, rank], [L, rope]
        k_nope = torch.einsum("lr,hdr->hld", c, w_uk)  # [H, L, nope]
        k = torch.cat([k_nope, k_pe[None].expand(heads, -1, -1)], dim=-1)  # [H, L, nope + rope]
        v = torch.einsum("lr,hdr->hld", c, w_uv)  # [H, L, v]
        q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], dim=-1).transpose(0, 1)  # [H, q_len, nope + rope]
        visible = torch.arange(seq_len, device=q.device)[None, :] <= torch.arange(
            seq_len - q_len, seq_len, device=q.device)[:, None]  # [q_len, L], bottom-right causal
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
        q0 = q1
    return out
