"""Gated DeltaNet (Qwen3-Next's linear attention): the gated delta rule, decode step and chunked prefill, the short
causal conv1d with its rolling state, and the gated RMSNorm of the output.

Per-sequence state lives in slots of two pools the engine owns beside the paged KV cache, picked by a per-sequence
slot id (`slots`, int32; a negative id is a padding row of a CUDA-graph batch: nothing is read or written):
- recurrent state `state_pool [num_slots, Hv, Dk, Dv]` (float32, or the model dtype), S with o = Sᵀq;
- conv state `conv_pool [num_slots, K-1, D]`, row j the input K-1-j tokens back, channels contiguous (HF keeps
  [batch, D, K]; this layout makes a token's channels one coalesced row).
Tokens are packed as in the rest of kernels/: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]. v head h reads
q/k head h // (Hv / Hk) (HF's repeat_interleave). q and k are L2-normalised in float32 (eps 1e-6) and q is scaled
by Dk^-0.5 inside the kernels, as HF's `use_qk_l2norm_in_kernel=True`. g is the log decay (≤ 0), beta the write
strength, both per (token, v head): passed ready, or computed in the kernels from the projection's raw a and b
(`gating=(A_log, dt_bias)`: g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b)). State math is float32.

Chunked prefill (after the WY/UT form of DeltaNet, Yang et al. 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length", and its gated form in Gated DeltaNet, Yang et al. 2025; the same algebra as HF's
torch_chunk_gated_delta_rule and flash-linear-attention's chunk kernels, written here anew), three launches, so
that only the state's recurrence runs chunk after chunk:
1. `_chunk_prep_kernel`, one program per (sequence, 64-token chunk, v head), all chunks in parallel: G the in-chunk
   cumulative log decay, T = (I + strict_lower(diag(β)·K·Kᵀ ⊙ Γ))⁻¹ (Γ_ij = exp(G_i − G_j); 16-row diagonal blocks
   by forward substitution, the rest by a product series), W = T·(β·exp(G)·K), U = T·(β·V) and the decayed keys
   exp(G_last − G)·K, into float32 scratch by token row;
2. `_chunk_state_kernel`, one program per (sequence, v head, Dv tile), chunks in order: it stores S at the chunk's
   start, V' = U − W·S (over U), S ← exp(G_last)·S + (exp(G_last − G)·K)ᵀ·V';
3. `_chunk_output_kernel`, one program per (sequence, chunk, v head, Dv tile), in parallel again:
   O = (exp(G)·Q)·S₀ + (Q·Kᵀ ⊙ Γ, causal)·V' from the chunk's starting state S₀, and the snapshots.
Chunks start at each sequence's first token of this call. Snapshots: the state after every multiple of
`snapshot_every` tokens of the sequence (any positive count, not only chunk boundaries: one more masked K·V' product
per snapshot) is written to further slots of the same pool, so a prefix cache can restore the state as of a hit;
the conv prefill writes its snapshots to the conv pool at the same counts.

Floors: decode is memory (the state read and written once: 2·Hv·Dk·Dv·4 B a sequence a layer, 4.2 MB at
Qwen3-Next-80B's 32 × 128 × 128); the chunked prefill is FLOPs (by count, ~16 MFLOP a 64-token chunk and v head
at Dk = Dv = 128, the output's q·kᵀ repeated in its four Dv tiles) plus its float32 scratch (~3 KB a token and v
head written and about as much read, the chunk-start states included). Not measured yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import FLOAT_DTYPES, INTERPRETING, check, check_tensor, next_pow2
from envex.kernels.ops import AttentionMetadata, LinearAttentionLayer

CHUNK = 64  # tokens of one chunk of the chunked prefill
# The state scan's W and decayed-key loads double-buffered: at Dk = 128 three stages take 240 KB of shared memory,
# over the H100's 227 KB a block; two take 168 KB (sm_90 compile, tests/test_kernels_delta_rule.py).
STATE_STAGES = 2
INVERSE_BLOCK = tl.constexpr(16)  # rows of the chunk inverse's diagonal blocks: CHUNK / 16 = 4 blocks, M⁴ = 0
L2_EPS = 1e-6  # HF's and FLA's l2norm epsilon
MAX_CONV_WIDTH = 4  # Qwen3-Next's linear_conv_kernel_dim (and Mamba's d_conv)
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _l2_rows(x, eps):
    """Rows of x [M, N] (float32, zeros past the head dim) scaled to unit L2 norm: x · rsqrt(Σx² + eps)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]


@triton.jit
def _state_tile(state_ptr, slot, h, stride_ss, stride_sh, stride_sk, init_ptr, b, DK: tl.constexpr,
                DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_INIT: tl.constexpr):  # fmt: skip
    """This program's [BLOCK_K, BLOCK_V] tile of slot's state for v head h (Dv tile program_id(2)) -> (its
    pointers, the Dk and Dv indices with their masks, the tile in float32; zeros where has_initial_state[b] is 0)."""
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = dk < DK
    v_ok = dv < DV
    ptrs = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    smask = k_ok[:, None] & v_ok[None, :]
    load_mask = smask
    if HAS_INIT:
        load_mask = tl.where(tl.load(init_ptr + b) != 0, smask, False)  # (a scalar & a block: the interpreter refuses)
    return ptrs, dk, dv, k_ok, v_ok, smask, tl.load(ptrs, mask=load_mask, other=0.0).to(tl.float32)


@triton.jit
def _store_state(ptrs, s, smask):
    tl.debug_barrier()  # every thread's loads of the old state before any thread's store over it
    tl.store(ptrs, s.to(ptrs.dtype.element_ty), mask=smask)


@triton.jit
def _gates(g_ptr, beta_ptr, g_off, b_off, ok, alog_ptr, dtb_ptr, h, GATING: tl.constexpr):
    """(g, β) in float32 at the given offsets, 0 where not ok. GATING: g_ptr and beta_ptr hold the projection's raw
    a and b; then g = -exp(A_log[h])·softplus(a + dt_bias[h]) in float32 and β = sigmoid(b) rounded to b's dtype,
    as HF computes them."""
    g = tl.load(g_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
    b_raw = tl.load(beta_ptr + b_off, mask=ok, other=0.0)
    if GATING:
        x = g + tl.load(dtb_ptr + h).to(tl.float32)
        soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's softplus (threshold 20)
        g = tl.where(ok, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * soft, 0.0)
        beta = tl.where(ok, tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32), 0.0)
    else:
        beta = b_raw.to(tl.float32)
    return g, beta


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, o_ptr, state_ptr, slots_ptr, cu_ptr, init_ptr, snap_ptr,
    scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk, stride_snap,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    VARLEN: tl.constexpr, HAS_INIT: tl.constexpr, GATING: tl.constexpr = False, SNAPSHOTS: tl.constexpr = False,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot < 0:
        return
    if VARLEN:
        lo = tl.load(cu_ptr + b)
        hi = tl.load(cu_ptr + b + 1)
    else:
        lo = b
        hi = b + 1
    hk = h // GROUP
    s_ptrs, dk, dv, k_ok, v_ok, smask, s = _state_tile(state_ptr, slot, h, stride_ss, stride_sh, stride_sk, init_ptr,
                                                       b, DK, DV, BLOCK_K, BLOCK_V, HAS_INIT)  # fmt: skip
    for i in range(0, hi - lo):
        t64 = (lo + i).to(tl.int64)
        qt = tl.load(q_ptr + t64 * stride_qt + hk * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + t64 * stride_kt + hk * stride_kh + dk, mask=k_ok, other=0.0).to(tl.float32)
        qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + eps) * scale
        kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + eps)
        vt = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
        gt, bt = _gates(g_ptr, beta_ptr, t64 * stride_gt + h, t64 * stride_bt + h, i < hi - lo, alog_ptr, dtb_ptr, h,
                        GATING)  # fmt: skip
        s = s * tl.exp(gt)
        delta = (vt - tl.sum(s * kt[:, None], axis=0)) * bt  # β(v − Sᵀk)
        s = s + kt[:, None] * delta[None, :]
        o = tl.sum(s * qt[:, None], axis=0)
        tl.store(o_ptr + t64 * stride_ot + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        if SNAPSHOTS:  # the state after this token into its snapshot slot (a verify step's rows: spec decoding)
            target = tl.load(snap_ptr + b * stride_snap + i).to(tl.int64)
            tl.store(s_ptrs + (target - slot) * stride_ss, s.to(s_ptrs.dtype.element_ty),
                     mask=tl.where(target >= 0, smask, False))  # fmt: skip
    _store_state(s_ptrs, s, smask)


@triton.jit
def _unit_lower_inverse(a, rows, n, C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower-triangular A [C, C] whose rows and columns from n on are zero, as a blocked
    triangular inverse with SUB-row blocks:
    1. the diagonal blocks, all at once, by forward substitution: row r = e_r − A[r, :]·Td, taking the rows at
       offset i of every block in step i. Td is block-diagonal, so the product stays inside r's own block and the
       blocks' rows share one [C] vector (disjoint columns);
    2. I + A = (I + D)(I + M) with M = Td·E (E: A below the diagonal blocks), M strictly block-lower, so M⁴ = 0 for
       four blocks and (I + M)⁻¹ = I − M + M² − M³: T = (I − M + M² − M·M²)·Td, four C×C products."""
    same_block = (rows[:, None] // SUB) == (rows[None, :] // SUB)
    d = tl.where(same_block, a, 0.0)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    inv = eye
    for i in range(1, tl.minimum(n, SUB)):
        at_i = (rows % SUB == i)[:, None]
        d_i = tl.sum(tl.where(at_i, d, 0.0), axis=0)  # [C] row i of each diagonal block, in its own columns
        inv = tl.where(at_i & same_block, inv - tl.sum(d_i[:, None] * inv, axis=0)[None, :], inv)
    if C > SUB:
        m = tl.dot(inv, tl.where(same_block, 0.0, a), input_precision=PRECISION)
        m2 = tl.dot(m, m, input_precision=PRECISION)
        inv = tl.dot(eye - m + m2 - tl.dot(m, m2, input_precision=PRECISION), inv, input_precision=PRECISION)
    return inv


@triton.jit
def _chunk_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, w_ptr, kd_ptr, u_ptr, gc_ptr, slots_ptr, cu_ptr, eps,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_wt, stride_wh, stride_ut, stride_uh,
    stride_gct,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    C: tl.constexpr, PRECISION: tl.constexpr, GATING: tl.constexpr = False,
):  # fmt: skip
    """One (sequence, chunk, v head): G = the in-chunk cumsum of g, T = (I + A)⁻¹ with A = strict_lower(diag(β)·K·Kᵀ
    ⊙ Γ), W = T·(β·exp(G)·K), U = T·(β·V) and the keys decayed to the chunk's end exp(G_last − G)·K, stored by token
    row (float32; the decayed keys in kd_ptr with W's strides)."""
    b = tl.program_id(0)
    c0 = tl.program_id(1) * C
    h = tl.program_id(2)
    lo = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - lo - c0  # tokens of the sequence from this chunk's start on
    if (n <= 0) | (tl.load(slots_ptr + b) < 0):
        return
    rows = tl.arange(0, C)
    ok = rows < n
    tok = (lo + c0 + rows).to(tl.int64)
    dk = tl.arange(0, BLOCK_K)
    k_ok = dk < DK
    k = tl.load(k_ptr + tok[:, None] * stride_kt + (h // GROUP) * stride_kh + dk[None, :],
                mask=ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
    k = _l2_rows(k, eps)
    g, beta = _gates(g_ptr, beta_ptr, tok * stride_gt + h, tok * stride_bt + h, ok, alog_ptr, dtb_ptr, h, GATING)
    gc = tl.cumsum(g, axis=0)
    tl.store(gc_ptr + tok * stride_gct + h, gc, mask=ok)
    below = rows[:, None] > rows[None, :]
    a = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PRECISION)  # [C, C]: β_i k_i·k_j
    a = tl.where(below, a * tl.exp(tl.where(below, gc[:, None] - gc[None, :], 0.0)), 0.0)
    inv = _unit_lower_inverse(a, rows, n, C, INVERSE_BLOCK, PRECISION)
    w = tl.dot(inv, k * (beta * tl.exp(gc))[:, None], input_precision=PRECISION)
    kmask = ok[:, None] & k_ok[None, :]
    tl.store(w_ptr + tok[:, None] * stride_wt + h * stride_wh + dk[None, :], w, mask=kmask)
    g_last = tl.sum(g, axis=0)  # masked rows add 0
    kd = k * tl.exp(g_last - gc)[:, None]
    tl.store(kd_ptr + tok[:, None] * stride_wt + h * stride_wh + dk[None, :], kd, mask=kmask)
    dv = tl.arange(0, BLOCK_DV)
    vmask = ok[:, None] & (dv < DV)[None, :]
    v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + dv[None, :], mask=vmask, other=0.0)
    u = tl.dot(inv, v.to(tl.float32) * beta[:, None], input_precision=PRECISION)
    tl.store(u_ptr + tok[:, None] * stride_ut + h * stride_uh + dv[None, :], u, mask=vmask)


@triton.jit
def _chunk_state_kernel(
    w_ptr, kd_ptr, u_ptr, gc_ptr, h_ptr, state_ptr, slots_ptr, cu_ptr, init_ptr, chunk_ptr,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_gct, stride_hc, stride_hh, stride_hk,
    stride_ss, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    C: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (sequence, v head, Dv tile), chunks in order, nothing but the state: it stores the state at each chunk's
    start (h), turns U into V' = U − W·S in place, and steps S ← exp(G_last)·S + (exp(G_last − G)·K)ᵀ·V'."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot < 0:
        return
    lo = tl.load(cu_ptr + b)
    seq_len = tl.load(cu_ptr + b + 1) - lo
    first_chunk = tl.load(chunk_ptr + b).to(tl.int64)
    s_ptrs, dk, dv, k_ok, v_ok, smask, s = _state_tile(state_ptr, slot, h, stride_ss, stride_sh, stride_sk, init_ptr,
                                                       b, DK, DV, BLOCK_K, BLOCK_V, HAS_INIT)  # fmt: skip
    rows = tl.arange(0, C)
    for c0 in range(0, seq_len, C):
        ok = c0 + rows < seq_len
        tok = (lo + c0 + rows).to(tl.int64)
        h_ptrs = h_ptr + (first_chunk + c0 // C) * stride_hc + h * stride_hh + dk[:, None] * stride_hk + dv[None, :]
        tl.store(h_ptrs, s, mask=smask)
        kmask = ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + tok[:, None] * stride_wt + h * stride_wh + dk[None, :], mask=kmask, other=0.0)
        u_ptrs = u_ptr + tok[:, None] * stride_ut + h * stride_uh + dv[None, :]
        umask = ok[:, None] & v_ok[None, :]
        v_new = tl.load(u_ptrs, mask=umask, other=0.0) - tl.dot(w, s, input_precision=PRECISION)
        tl.store(u_ptrs, v_new, mask=umask)  # V' over U: this program's own tile, read just above
        g_last = tl.load(gc_ptr + (lo + tl.minimum(seq_len, c0 + C) - 1).to(tl.int64) * stride_gct + h)
        kd = tl.load(kd_ptr + tok[:, None] * stride_wt + h * stride_wh + dk[None, :], mask=kmask, other=0.0)
        s = s * tl.exp(g_last) + tl.dot(tl.trans(kd), v_new, input_precision=PRECISION)
    _store_state(s_ptrs, s, smask)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, gc_ptr, vn_ptr, h_ptr, o_ptr, state_ptr, slots_ptr, cu_ptr, chunk_ptr, start_ptr, snap_ptr,
    snap_every, scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_gct, stride_vnt, stride_vnh, stride_hc, stride_hh, stride_hk,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, stride_snap,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    V_TILES: tl.constexpr, C: tl.constexpr, SNAPSHOTS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (sequence, chunk, v head, Dv tile), all chunks in parallel: O = (exp(G)·Q)·S₀ + (Q·Kᵀ ⊙ Γ, causal)·V'
    from the state S₀ at the chunk's start, and the snapshots that end inside the chunk."""
    b = tl.program_id(0)
    c0 = tl.program_id(1) * C
    h = tl.program_id(2) // V_TILES
    lo = tl.load(cu_ptr + b)
    seq_len = tl.load(cu_ptr + b + 1) - lo
    if (seq_len <= c0) | (tl.load(slots_ptr + b) < 0):
        return
    rows = tl.arange(0, C)
    ok = c0 + rows < seq_len
    tok = (lo + c0 + rows).to(tl.int64)
    dk = tl.arange(0, BLOCK_K)
    dv = (tl.program_id(2) % V_TILES) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = dk < DK
    v_ok = dv < DV
    smask = k_ok[:, None] & v_ok[None, :]
    chunk = tl.load(chunk_ptr + b).to(tl.int64) + tl.program_id(1)
    s = tl.load(h_ptr + chunk * stride_hc + h * stride_hh + dk[:, None] * stride_hk + dv[None, :], mask=smask)
    kmask = ok[:, None] & k_ok[None, :]
    hk = h // GROUP
    q = tl.load(q_ptr + tok[:, None] * stride_qt + hk * stride_qh + dk[None, :], mask=kmask, other=0.0)
    k = tl.load(k_ptr + tok[:, None] * stride_kt + hk * stride_kh + dk[None, :], mask=kmask, other=0.0)
    q = _l2_rows(q.to(tl.float32), eps) * scale
    k = _l2_rows(k.to(tl.float32), eps)
    gc = tl.load(gc_ptr + tok * stride_gct + h, mask=ok, other=0.0)
    v_new = tl.load(vn_ptr + tok[:, None] * stride_vnt + h * stride_vnh + dv[None, :],
                    mask=ok[:, None] & v_ok[None, :], other=0.0)  # fmt: skip
    causal = rows[:, None] >= rows[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    qk = tl.where(causal, qk * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    o = tl.dot(q * tl.exp(gc)[:, None], s, input_precision=PRECISION) + tl.dot(qk, v_new, input_precision=PRECISION)
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=ok[:, None] & v_ok[None, :])  # fmt: skip
    if SNAPSHOTS:  # the state after each multiple of snap_every tokens that ends inside this chunk
        start = tl.load(start_ptr + b)
        first = ((start + c0) // snap_every + 1) * snap_every
        for count in range(first, start + tl.minimum(c0 + C, seq_len) + 1, snap_every):
            j = count - start - c0 - 1  # the chunk row of the snapshot's last token
            gj = tl.sum(tl.where(rows == j, gc, 0.0), axis=0)
            upto = rows <= j
            kd = k * tl.where(upto, tl.exp(tl.where(upto, gj - gc, 0.0)), 0.0)[:, None]
            snap = s * tl.exp(gj) + tl.dot(tl.trans(kd), v_new, input_precision=PRECISION)
            target = tl.load(snap_ptr + b * stride_snap + count // snap_every - start // snap_every - 1).to(tl.int64)
            tl.store(state_ptr + target * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :],
                     snap.to(state_ptr.dtype.element_ty), mask=tl.where(target >= 0, smask, False))  # fmt: skip


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, bias_ptr, o_ptr, conv_ptr, slots_ptr, cu_ptr, init_ptr, start_ptr, snap_ptr, snap_every, D,
    stride_xt, stride_w, stride_ot, stride_cs, stride_cr, stride_snap,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SNAPSHOTS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot < 0:
        return
    if VARLEN:
        lo = tl.load(cu_ptr + b)
        seq_len = tl.load(cu_ptr + b + 1) - lo
    else:
        lo = b
        seq_len = 1
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    hist_ok = d_ok
    if HAS_INIT:
        hist_ok = tl.where(tl.load(init_ptr + b) != 0, hist_ok, False)
    hist = conv_ptr + slot * stride_cs + d  # row r of the old state: the input WIDTH-1-r tokens back
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    for t0 in range(0, seq_len, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = t < seq_len
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + bias[None, :]
        for j in tl.static_range(WIDTH):  # tap j reads the input at t - (WIDTH-1) + j
            src = t - (WIDTH - 1) + j
            from_x = ok & (src >= 0)
            from_hist = ok & (src < 0)
            xv = tl.load(x_ptr + (lo + src).to(tl.int64)[:, None] * stride_xt + d[None, :],
                         mask=from_x[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            hv = tl.load(hist[None, :] + (src + WIDTH - 1)[:, None] * stride_cr,
                         mask=from_hist[:, None] & hist_ok[None, :], other=0.0)  # fmt: skip
            wj = tl.load(w_ptr + d * stride_w + j, mask=d_ok, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + hv.to(tl.float32)) * wj[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(o_ptr + (lo + t).to(tl.int64)[:, None] * stride_ot + d[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=ok[:, None] & d_ok[None, :])  # fmt: skip
    r = tl.arange(0, 4)  # the state's rows (WIDTH - 1 ≤ 3 of them)
    r_ok = r < WIDTH - 1
    if SNAPSHOTS:  # the conv state after each multiple of snap_every tokens: inputs count-(WIDTH-1) .. count-1
        start = tl.load(start_ptr + b)
        first = (start // snap_every + 1) * snap_every
        for count in range(first, start + seq_len + 1, snap_every):
            target = tl.load(snap_ptr + b * stride_snap + count // snap_every - start // snap_every - 1).to(tl.int64)
            rows = _state_rows(x_ptr, hist, lo, count - start - (WIDTH - 1) + r, r_ok, d, d_ok, hist_ok, stride_xt,
                               stride_cr, WIDTH)  # fmt: skip
            keep = tl.where(target >= 0, r_ok[:, None] & d_ok[None, :], False)
            tl.store(conv_ptr + target * stride_cs + r[:, None] * stride_cr + d[None, :],
                     rows.to(conv_ptr.dtype.element_ty), mask=keep)  # fmt: skip
    # The new state: the last WIDTH-1 inputs (from the old state too, for a sequence shorter than that), all read
    # before any thread overwrites the old state.
    rows = _state_rows(x_ptr, hist, lo, seq_len - (WIDTH - 1) + r, r_ok, d, d_ok, hist_ok, stride_xt, stride_cr,
                       WIDTH)  # fmt: skip
    tl.debug_barrier()
    tl.store(hist[None, :] + r[:, None] * stride_cr, rows.to(conv_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])  # fmt: skip


@triton.jit
def _state_rows(x_ptr, hist, lo, src, r_ok, d, d_ok, hist_ok, stride_xt, stride_cr, WIDTH: tl.constexpr):
    """The inputs at this call's token indices src [R] (negative: from the old state) as rows [R, BLOCK_D]."""
    xv = tl.load(x_ptr + (lo + src).to(tl.int64)[:, None] * stride_xt + d[None, :],
                 mask=(r_ok & (src >= 0))[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    hv = tl.load(hist[None, :] + (src + WIDTH - 1)[:, None] * stride_cr,
                 mask=(r_ok & (src < 0))[:, None] & hist_ok[None, :], other=0.0)  # fmt: skip
    return xv.to(tl.float32) + hv.to(tl.float32)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, o_ptr, n_rows, H, D, eps,
    stride_xt, stride_xh, stride_zt, stride_zh, stride_ot, stride_oh,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    t = (r // H).to(tl.int64)
    h = r % H
    d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + (t * stride_xt + h * stride_xh)[:, None] + d[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + (t * stride_zt + h * stride_zh)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]).to(x.dtype).to(tl.float32)
    y = normed * w[None, :]
    if ROUND_PRODUCT:  # HF's weight · normed in the activation dtype (weight and activations both 16-bit)
        y = y.to(x.dtype).to(tl.float32)
    y = y * z * tl.sigmoid(z)
    tl.store(o_ptr + (t * stride_ot + h * stride_oh)[:, None] + d[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)


# --- launchers ---


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state_pool: torch.Tensor, slots: torch.Tensor, batch: int) -> tuple[int, int, int, int]:  # fmt: skip
    """Checks shared by the delta-rule launchers -> (Hk, Dk, Hv, Dv)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtypes=(q.dtype,), device=dev)
    tokens, n_k, d_k = q.shape
    check(k.shape == q.shape, f"k: shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    check(v.shape[0] == tokens, f"v: {v.shape[0]} tokens, q has {tokens}")
    n_v, d_v = v.shape[1], v.shape[2]
    check(n_v % n_k == 0, f"v: {n_v} value heads is not a multiple of the {n_k} q/k heads")
    check(16 <= d_k <= 256 and 16 <= d_v <= 256, f"q/v: head dims {d_k}, {d_v} must be within 16..256")
    for name, t in (("g", g), ("beta", beta)):
        check_tensor(name, t, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        check(t.shape == (tokens, n_v), f"{name}: shape {tuple(t.shape)} != [tokens, Hv] = {(tokens, n_v)}")
    check_tensor("state_pool", state_pool, ndim=4, dtypes=FLOAT_DTYPES, device=dev)
    check(state_pool.shape[1:] == (n_v, d_k, d_v),
          f"state_pool: slot shape {tuple(state_pool.shape[1:])} != [Hv, Dk, Dv] = {(n_v, d_k, d_v)}")  # fmt: skip
    check(state_pool.stride(2) == d_v, "state_pool: each slot's [Dk, Dv] rows must be contiguous")
    check_tensor("slots", slots, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
    check(slots.shape[0] == batch, f"slots: {slots.shape[0]} entries for {batch} sequences")
    return n_k, d_k, n_v, d_v


def _check_batch_flags(has_initial_state: torch.Tensor | None, batch: int, dev: torch.device) -> None:
    if has_initial_state is not None:
        check_tensor("has_initial_state", has_initial_state, ndim=1, device=dev)
        check(has_initial_state.shape[0] == batch, f"has_initial_state: {has_initial_state.shape[0]} entries for "
              f"{batch} sequences")  # fmt: skip


def _check_cu_seqlens(cu_seqlens: torch.Tensor, tokens: int, dev: torch.device) -> int:
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
    check(cu_seqlens.shape[0] >= 1, "cu_seqlens: needs at least one entry, [B + 1] offsets starting at 0")
    return cu_seqlens.shape[0] - 1


def _check_snapshots(snapshot_every: int, snapshot_slots: torch.Tensor | None, start_pos: torch.Tensor | None,
                     batch: int, dev: torch.device) -> bool:  # fmt: skip
    """Whether snapshots are on; checks their arguments when they are."""
    check(isinstance(snapshot_every, int) and snapshot_every >= 0,
          f"snapshot_every: {snapshot_every!r} must be a token count ≥ 0 (0: no snapshots)")  # fmt: skip
    if snapshot_every == 0:
        return False
    check(
        snapshot_slots is not None and start_pos is not None,
        "snapshot_slots/start_pos: snapshot_every > 0 needs both (where to write, and the tokens before this call)",
    )
    assert snapshot_slots is not None and start_pos is not None
    check_tensor("snapshot_slots", snapshot_slots, ndim=2, dtypes=_INDEX_DTYPES, device=dev)
    check(snapshot_slots.shape[0] == batch, f"snapshot_slots: {snapshot_slots.shape[0]} rows for {batch} sequences")
    check_tensor("start_pos", start_pos, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
    check(start_pos.shape[0] == batch, f"start_pos: {start_pos.shape[0]} entries for {batch} sequences")
    return True


def _gating(gating: tuple[torch.Tensor, torch.Tensor] | None, n_v: int, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' (A_log, dt_bias) pointers: checked when given, else g twice (unread placeholders)."""
    if gating is None:
        return g, g
    check(isinstance(gating, tuple) and len(gating) == 2, "gating: pass (A_log, dt_bias), the layer's [Hv] parameters")
    for name, t in zip(("A_log", "dt_bias"), gating, strict=True):
        check_tensor(f"gating {name}", t, ndim=1, dtypes=FLOAT_DTYPES, device=g.device)
        check(t.shape[0] == n_v, f"gating {name}: {t.shape[0]} entries for {n_v} value heads")
    return gating


def _out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    check_tensor("out", out, ndim=like.dim(), dtypes=(like.dtype,), device=like.device)
    check(out.shape == like.shape, f"out: shape {tuple(out.shape)} != {tuple(like.shape)}")
    return out


def _block_v(d_v: int) -> int:
    # Dv = 128 in four 32-wide tiles: 4 programs a (sequence, head), 128 at Qwen3-Next's 32 heads at batch 1, and a
    # [128, 32] float32 state tile (32 registers a thread at 4 warps).
    return max(16, min(32, next_pow2(d_v)))


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state_pool: torch.Tensor, slots: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                            has_initial_state: torch.Tensor | None = None,
                            gating: tuple[torch.Tensor, torch.Tensor] | None = None,
                            snapshot_slots: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The recurrent gated delta rule, state_pool[slots[b]] updated in place -> o [T, Hv, Dv] in v's dtype.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (any row strides, unit last stride: views of the conv
    output are fine). Without cu_seqlens row b is sequence b's one new token (decode); with it, each sequence's
    tokens run one after another and the state after its last is kept (a short prefill, or a speculative verify step
    with snapshot_slots [B, W]: the state after token i of sequence b also goes to state_pool[snapshot_slots[b, i]]
    (negative: nowhere), W >= its tokens; these slots must be none of the batch's own; each token's arithmetic is the
    one-token step's, so a verify step's outputs are a decode step's). A negative slot is a padding row: its output
    is left unwritten. has_initial_state [B]: where 0, the sequence starts from a zero state instead of its slot's.
    gating (A_log, dt_bias), each [Hv]: g and beta are then the projection's raw a and b, and the kernel computes
    g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b) (rounded to b's dtype) as HF's layer does."""
    tokens = q.shape[0] if q.dim() == 3 else 0
    batch = tokens if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, tokens, q.device)
    n_k, d_k, n_v, d_v = _check_heads(q, k, v, g, beta, state_pool, slots, batch)
    _check_batch_flags(has_initial_state, batch, q.device)
    if snapshot_slots is not None:
        check(cu_seqlens is not None, "snapshot_slots: a verify step's snapshots need cu_seqlens (tokens a sequence)")
        check_tensor("snapshot_slots", snapshot_slots, ndim=2, dtypes=_INDEX_DTYPES, device=q.device)
        check(snapshot_slots.shape[0] == batch, f"snapshot_slots: {snapshot_slots.shape[0]} rows for {batch} sequences")
    a_log, dt_bias = _gating(gating, n_v, g)
    out = _out(out, v)
    if batch == 0:
        return out
    block_v = _block_v(d_v)
    snaps = snapshot_slots if snapshot_slots is not None else slots.view(-1, 1)
    _recurrent_kernel[(batch, n_v, triton.cdiv(d_v, block_v))](
        q, k, v, g, beta, a_log, dt_bias, out, state_pool, slots, cu_seqlens if cu_seqlens is not None else slots,
        has_initial_state if has_initial_state is not None else slots, snaps, d_k**-0.5, L2_EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), snaps.stride(0),
        GROUP=n_v // n_k, DK=d_k, DV=d_v, BLOCK_K=next_pow2(d_k), BLOCK_V=block_v,
        VARLEN=cu_seqlens is not None, HAS_INIT=has_initial_state is not None, GATING=gating is not None,
        SNAPSHOTS=snapshot_slots is not None, num_warps=4,
    )  # fmt: skip
    return out


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, *,
                             max_q_len: int, has_initial_state: torch.Tensor | None = None,
                             start_pos: torch.Tensor | None = None, snapshot_slots: torch.Tensor | None = None,
                             snapshot_every: int = 0, gating: tuple[torch.Tensor, torch.Tensor] | None = None,
                             out: torch.Tensor | None = None,
                             dot_precision: str | None = None) -> torch.Tensor:  # fmt: skip
    """The chunked (64-token) gated delta rule over packed sequences, starting from state_pool[slots[b]] (zeros
    where has_initial_state[b] is 0) and writing the final state there -> o [T, Hv, Dv] in v's dtype.

    Shapes and gating as gated_delta_rule_decode; cu_seqlens [B + 1]; max_q_len ≥ the longest sequence of the call
    (sizes the grids of the chunk-parallel launches, as attention's max_q_len). Snapshots (snapshot_every > 0):
    the state after every multiple c of snapshot_every tokens of sequence b in (start_pos[b], start_pos[b] + len],
    start_pos [B] the tokens its state held before this call, goes to state_pool[snapshot_slots[b, n]] for the n-th
    such c (n from 0; a negative entry: not written). snapshot_slots [B, W] needs W ≥ that count. Snapshot slots
    must be none of the batch's own slots. dot_precision: Triton's input_precision for the float32 dots; default "ieee"
    for float32 inputs and "tf32" otherwise."""
    tokens = q.shape[0] if q.dim() == 3 else 0
    batch = _check_cu_seqlens(cu_seqlens, tokens, q.device)
    n_k, d_k, n_v, d_v = _check_heads(q, k, v, g, beta, state_pool, slots, batch)
    _check_batch_flags(has_initial_state, batch, q.device)
    snapshots = _check_snapshots(snapshot_every, snapshot_slots, start_pos, batch, q.device)
    check(isinstance(max_q_len, int) and max_q_len >= 0, f"max_q_len: {max_q_len!r} must be an int ≥ 0")
    precision = dot_precision or ("ieee" if q.dtype == torch.float32 else "tf32")
    check(precision in ("ieee", "tf32", "tf32x3"), f"dot_precision: {precision!r}; use ieee, tf32 or tf32x3")
    a_log, dt_bias = _gating(gating, n_v, g)
    out = _out(out, v)
    if batch == 0 or tokens == 0 or max_q_len == 0:
        return out
    dev, group, block_k, block_v = q.device, n_v // n_k, next_pow2(d_k), _block_v(d_v)
    v_tiles = triton.cdiv(d_v, block_v)
    max_chunks = triton.cdiv(max_q_len, CHUNK)
    # Scratch, float32: W and the decayed keys [T, Hv, Dk]; U [T, Hv, Dv], overwritten by V'; G [T, Hv]; the state
    # at each chunk's start [chunks, Hv, Dk, Dv], sequence b's chunks from first_chunk[b] on (T/64 + B bound their
    # count: no sync).
    w = torch.empty((tokens, n_v, d_k), dtype=torch.float32, device=dev)
    kd = torch.empty_like(w)
    u = torch.empty((tokens, n_v, d_v), dtype=torch.float32, device=dev)
    gc = torch.empty((tokens, n_v), dtype=torch.float32, device=dev)
    h = torch.empty((tokens // CHUNK + batch, n_v, d_k, d_v), dtype=torch.float32, device=dev)
    per_seq = (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK
    first_chunk = (torch.cumsum(per_seq, 0) - per_seq).to(torch.int32)
    gating_on = gating is not None
    _chunk_prep_kernel[(batch, max_chunks, n_v)](
        k, v, g, beta, a_log, dt_bias, w, kd, u, gc, slots, cu_seqlens, L2_EPS,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), w.stride(0), w.stride(1),
        u.stride(0), u.stride(1), gc.stride(0),
        GROUP=group, DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_DV=next_pow2(d_v), C=CHUNK, PRECISION=precision,
        GATING=gating_on, num_warps=4 if INTERPRETING or block_k <= 64 else 8,
    )  # fmt: skip
    _chunk_state_kernel[(batch, n_v, v_tiles)](
        w, kd, u, gc, h, state_pool, slots, cu_seqlens,
        has_initial_state if has_initial_state is not None else slots, first_chunk,
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), gc.stride(0),
        h.stride(0), h.stride(1), h.stride(2), state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_V=block_v, C=CHUNK,
        HAS_INIT=has_initial_state is not None, PRECISION=precision,
        num_warps=4 if INTERPRETING or block_k <= 64 else 8, num_stages=STATE_STAGES,
    )  # fmt: skip
    snap = snapshot_slots if snapshots else slots
    _chunk_output_kernel[(batch, max_chunks, n_v * v_tiles)](
        q, k, gc, u, h, out, state_pool, slots, cu_seqlens, first_chunk, start_pos if snapshots else slots, snap,
        max(snapshot_every, 1), d_k**-0.5, L2_EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), gc.stride(0), u.stride(0), u.stride(1),
        h.stride(0), h.stride(1), h.stride(2), out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), snap.stride(0),
        GROUP=group, DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_V=block_v, V_TILES=v_tiles, C=CHUNK,
        SNAPSHOTS=snapshots, PRECISION=precision, num_warps=4 if INTERPRETING or block_k <= 64 else 8,
    )  # fmt: skip
    return out


def _check_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                slots: torch.Tensor, batch: int) -> int:  # fmt: skip
    """Checks shared by the conv launchers -> the kernel width K."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    dev, dim = x.device, x.shape[1]
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    width = weight.shape[1]
    check(weight.shape[0] == dim, f"weight: {weight.shape[0]} channels != x's {dim}; pass conv1d.weight[:, 0, :]")
    check(2 <= width <= MAX_CONV_WIDTH, f"weight: kernel width {width} not supported; 2..{MAX_CONV_WIDTH}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        check(bias.shape[0] == dim, f"bias: {bias.shape[0]} channels != x's {dim}")
    check_tensor("conv_pool", conv_pool, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check(conv_pool.shape[1:] == (width - 1, dim),
          f"conv_pool: slot shape {tuple(conv_pool.shape[1:])} != [K-1, D] = {(width - 1, dim)}")  # fmt: skip
    check_tensor("slots", slots, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
    check(slots.shape[0] == batch, f"slots: {slots.shape[0]} entries for {batch} sequences")
    return width


def _conv_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                 slots: torch.Tensor, out: torch.Tensor, batch: int, width: int, *, cu_seqlens: torch.Tensor | None,
                 has_initial_state: torch.Tensor | None, silu: bool, snapshots: bool, start_pos: torch.Tensor | None,
                 snapshot_slots: torch.Tensor | None, snapshot_every: int, block_t: int) -> None:  # fmt: skip
    dim = x.shape[1]
    block_d = min(256, next_pow2(dim)) if cu_seqlens is None else min(64, next_pow2(dim))
    snap = snapshot_slots if snapshots and snapshot_slots is not None else slots
    _conv_kernel[(batch, triton.cdiv(dim, block_d))](
        x, weight, bias if bias is not None else weight, out, conv_pool, slots,
        cu_seqlens if cu_seqlens is not None else slots, has_initial_state if has_initial_state is not None else slots,
        start_pos if snapshots else slots, snap, max(snapshot_every, 1), dim,
        x.stride(0), weight.stride(0), out.stride(0), conv_pool.stride(0), conv_pool.stride(1), snap.stride(0),
        WIDTH=width, BLOCK_T=block_t, BLOCK_D=block_d, VARLEN=cu_seqlens is not None,
        HAS_INIT=has_initial_state is not None, HAS_BIAS=bias is not None, SILU=silu, SNAPSHOTS=snapshots,
        num_warps=4,
    )  # fmt: skip


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                         slots: torch.Tensor, *, silu: bool = True,
                         out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One decode step of the causal depthwise conv1d: x [B, D] the new token of each sequence, weight [D, K]
    (conv1d.weight[:, 0, :]), bias [D] or None -> [B, D] (SiLU applied unless silu=False); conv_pool[slots[b]]
    [K-1, D] then holds the last K-1 inputs. A negative slot is a padding row (nothing read or written)."""
    batch = x.shape[0] if x.dim() == 2 else 0
    width = _check_conv(x, weight, bias, conv_pool, slots, batch)
    out = _out(out, x)
    if batch:
        _conv_launch(x, weight, bias, conv_pool, slots, out, batch, width, cu_seqlens=None, has_initial_state=None,
                     silu=silu, snapshots=False, start_pos=None, snapshot_slots=None, snapshot_every=0,
                     block_t=1)  # fmt: skip
    return out


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                          conv_pool: torch.Tensor, slots: torch.Tensor, *,
                          has_initial_state: torch.Tensor | None = None, silu: bool = True,
                          start_pos: torch.Tensor | None = None, snapshot_slots: torch.Tensor | None = None,
                          snapshot_every: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The causal depthwise conv1d over packed sequences x [T, D] (cu_seqlens [B + 1]), each continuing from its
    conv state conv_pool[slots[b]] (zeros where has_initial_state[b] is 0), which then holds its last K-1 inputs
    -> [T, D]. Snapshots as gated_delta_rule_chunked's, into the conv pool: pass both calls the same arguments."""
    tokens = x.shape[0] if x.dim() == 2 else 0
    batch = _check_cu_seqlens(cu_seqlens, tokens, x.device)
    width = _check_conv(x, weight, bias, conv_pool, slots, batch)
    _check_batch_flags(has_initial_state, batch, x.device)
    snapshots = _check_snapshots(snapshot_every, snapshot_slots, start_pos, batch, x.device)
    out = _out(out, x)
    if batch:
        _conv_launch(x, weight, bias, conv_pool, slots, out, batch, width, cu_seqlens=cu_seqlens,
                     has_initial_state=has_initial_state, silu=silu, snapshots=snapshots, start_pos=start_pos,
                     snapshot_slots=snapshot_slots, snapshot_every=snapshot_every, block_t=16)  # fmt: skip
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """HF Qwen3NextRMSNormGated over the head dim: RMSNorm(x) · weight · silu(z) for x, z [T, H, D] (any token and
    head strides, unit last stride: z may be a view of the input projection) -> [T, H, D] in x's dtype."""
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("z", z, ndim=3, dtypes=FLOAT_DTYPES, device=x.device)
    check(z.shape == x.shape, f"z: shape {tuple(z.shape)} != x shape {tuple(x.shape)}")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check(weight.shape[0] == x.shape[2], f"weight: length {weight.shape[0]} != head dim {x.shape[2]}")
    check(x.shape[2] <= 1024, f"x: head dim {x.shape[2]} > 1024 is not supported")
    out = _out(out, x)
    n_rows = x.shape[0] * x.shape[1]
    if n_rows == 0:
        return out
    block_d = next_pow2(x.shape[2])
    block_r = max(1, 2048 // block_d)
    round_product = torch.promote_types(weight.dtype, x.dtype) != torch.float32
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x, z, weight, out, n_rows, x.shape[1], x.shape[2], float(eps),
        x.stride(0), x.stride(1), z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        BLOCK_R=block_r, BLOCK_D=block_d, ROUND_PRODUCT=round_product, num_warps=4,
    )  # fmt: skip
    return out


def gated_delta_net(mixed: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, meta: AttentionMetadata,
                    layer: LinearAttentionLayer) -> torch.Tensor:  # fmt: skip
    """One Gated DeltaNet layer between its projections on these kernels (the Triton backend's
    Ops.linear_attention): mixed [T, ...] the input projection's row (LinearAttentionLayer.split) -> [T, Hv·Dv].
    A step whose every sequence brings one token to a state it already has runs the decode kernels (state in
    place, nothing allocated: what a CUDA graph can hold); any other step the varlen conv and the chunked delta
    rule, each sequence from its slot or from zeros (meta.state_initialized), with the step's snapshots
    (meta.state_snapshots) where it asks for them; a verify step (q_per_seq, a snapshot after every token) the
    recurrent kernel over its tokens instead, with the decode step's arithmetic per token."""
    assert meta.state_slots is not None, "a model with linear-attention layers gets state slots (state_slots.py)"
    slots, initialized = meta.state_slots, meta.state_initialized
    x, z, b, a = layer.split(mixed)
    gating = (layer.a_log, layer.dt_bias)
    starts = (None if meta.seq_lens_host is None or meta.q_lens_host is None
              else [s - q for s, q in zip(meta.seq_lens_host, meta.q_lens_host, strict=True)])  # fmt: skip
    # Without the host's lengths (a captured decode step) every sequence continues a state it has.
    if meta.max_q_len == 1 and (starts is None or min(starts) > 0) and meta.state_snapshots is None:
        conv = causal_conv1d_update(x, layer.conv_weight, None, conv_pool, slots)
        q, k, v = layer.split_conv(conv)
        o = gated_delta_rule_decode(q, k, v, a, b, state_pool, slots, gating=gating)
    else:
        cu = meta.cu_seqlens_q
        snaps: dict = {}
        if meta.state_snapshots is not None:
            assert meta.seq_lens is not None, "a step that snapshots states carries its sequences' lengths"
            snaps = dict(start_pos=meta.seq_lens - (cu[1:] - cu[:-1]), snapshot_slots=meta.state_snapshots,
                         snapshot_every=meta.state_snapshot_every)  # fmt: skip
        conv = causal_conv1d_prefill(x, layer.conv_weight, None, cu, conv_pool, slots, has_initial_state=initialized,
                                     **snaps)  # fmt: skip
        q, k, v = layer.split_conv(conv)
        if meta.q_per_seq is not None and meta.state_snapshot_every == 1:  # a verify step: decode's arithmetic
            o = gated_delta_rule_decode(q, k, v, a, b, state_pool, slots, cu_seqlens=cu, has_initial_state=initialized,
                                        gating=gating, snapshot_slots=meta.state_snapshots)  # fmt: skip
        else:
            o = gated_delta_rule_chunked(q, k, v, a, b, cu, state_pool, slots, max_q_len=meta.max_q_len,
                                         has_initial_state=initialized, gating=gating, **snaps)  # fmt: skip
    return gated_rms_norm(o, z, layer.norm_weight, layer.norm_eps).flatten(1)
