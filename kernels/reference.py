"""The pure-torch definition of every kernel in this package: what each Triton kernel must compute.

All of them live here, a section per family: norms, rotary, paged attention and the fused projections (HF Llama's
conventions, as the engine's torch backend uses them), mixture of experts, the batch-invariant forms, speculative
decoding, tensor parallelism, the packed KV caches (kv_quant.py), Gated DeltaNet (delta_rule.py), DeepSeek's
latent attention and expert routing (mla.py), and the W8A8 FP8 GEMM with its activation quantizer (quant_gemm.py).
Tests call these on float64 copies of the inputs and compare the Triton result by relative error
(‖out − ref‖ / ‖ref‖).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from envex.kernels.ops import AttentionMetadata, LinearAttentionLayer
    from envex.kernels.quant import FP8BlockStack, Int4GroupStack, PackedWeight

    ExpertStack = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | FP8BlockStack | Int4GroupStack  # expert_matrix's


def host_lengths(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, q_lens: list[int] | None = None,
                 seq_lens_host: list[int] | None = None) -> tuple[list[int], list[int]]:  # fmt: skip
    """Each sequence's query rows and cached length on the host, for code that loops over sequences: the given
    host lists where the metadata carries them (AttentionMetadata.q_lens_host / seq_lens_host), else read from
    the device tensors."""
    if q_lens is None:
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    return q_lens, seq_lens_host if seq_lens_host is not None else seq_lens.tolist()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: fp32 (or wider) math, cast back to the input dtype, then times the weight."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is rounded to the input dtype first, as HF does."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def all_reduce_add_rms_norm(parts: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Tensor parallelism's reduce-then-norm: (rms_norm(sum(parts) + residual), sum(parts) + residual), the sum
    over ranks in rank order; residual None: no add."""
    total = torch.stack(parts).sum(0)
    if residual is None:
        return rms_norm(total, weight, eps), total
    return add_rms_norm(total, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation on a fused gate-up output: silu(x[:, :I]) * x[:, I:]."""
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half rotary on x [T, H, D] with cos/sin caches [max_pos, D/2] (non-interleaved halves)."""
    half = x.shape[-1] // 2
    c = cos[positions].to(x.dtype)[:, None, :]  # [T, 1, D/2]
    s = sin[positions].to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] at slot = block*bs + offset.

    A negative slot means "padding token, write nothing" (CUDA-graph batches are padded this way).
    """
    keep = slot_mapping >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks*block_size, Hkv, D]
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    flat_v[slot_mapping[keep]] = v[keep].to(v_cache.dtype)


def rotary_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_rot = rotary(q, positions, cos, sin)
    k_rot = rotary(k, positions, cos, sin)
    store_kv(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot, k_rot


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    q_lens: list[int] | None = None,
    seq_lens_host: list[int] | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed varlen queries [T, Hq, D] over a paged KV cache.

    Sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (q_len of them), which sit at positions
    seq_len-q_len .. seq_len-1 and attend to keys 0..own position. Decode is q_len == 1. q_lens / seq_lens_host:
    the same lengths as host lists, when the caller has them (saves a device read per sequence).
    sinks [Hq]: gpt-oss's per-head attention sink, a logit that joins each row's softmax and carries no value
    (HF GptOssAttention). window: sliding window, a query at position p sees keys p-window+1 .. p only (HF's
    `kv_idx > q_idx - sliding_window`); blocks wholly before the window are never read.
    """
    num_tokens, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    q_lens, lens = host_lengths(cu_seqlens_q, seq_lens, q_lens, seq_lens_host)
    tables = block_tables.long()
    out = torch.empty_like(q)
    q0 = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        q1 = q0 + q_len
        if q_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        # With a window, start at the block of the first key the chunk's first query sees.
        first = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
        blocks = tables[b, first:n_blocks]
        k0 = first * block_size  # position of the first gathered key
        keys = k_cache.index_select(0, blocks).reshape(-1, hkv, d)[:seq_len - k0].to(q.dtype)  # [L, Hkv, D]
        vals = v_cache.index_select(0, blocks).reshape(-1, hkv, d)[:seq_len - k0].to(q.dtype)
        qg = q[q0:q1].reshape(q_len, hkv, group, d)  # the GQA group of each KV head, without repeating K/V
        scores = torch.einsum("qhgd,khd->hgqk", qg, keys) * scale  # [Hkv, G, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(k0, seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden = hidden | (k_pos <= q_pos - window)
        acc = torch.promote_types(q.dtype, torch.float32)
        scores = scores.masked_fill(hidden, float("-inf")).to(acc)
        if sinks is not None:  # one extra logit per head, dropped after the softmax
            sink = sinks.to(acc).reshape(hkv, group, 1, 1).expand(hkv, group, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[q0:q1] = torch.einsum("hgqk,khd->qhgd", probs, vals).reshape(q_len, hq, d)
        q0 = q1
    return out


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
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    q_len: int = 1,
) -> torch.Tensor:
    """q_len new tokens per sequence from the fused QKV rows [B·q_len, (Hq + 2·Hkv)·D]: (q/k RMSNorm per head with
    q_norm/k_norm,) rotary on q and k, k and v written at slot_mapping (negative: not written), then causal
    attention over positions 0..position -> [B·q_len, Hq, D] (with sinks and a window as paged_attention takes
    them). The unfused composition (rotary_and_store_kv, then paged_attention) the fused kernel must equal."""
    tokens = qkv.shape[0]
    if tokens % q_len:
        raise ValueError(f"q_len: {q_len} does not divide qkv's {tokens} rows")
    batch = tokens // q_len
    d = k_cache.shape[3]
    q = qkv[:, : num_heads * d].view(tokens, num_heads, d)  # [T, Hq, D] views of the fused rows
    k = qkv[:, num_heads * d : (num_heads + num_kv_heads) * d].view(tokens, num_kv_heads, d)
    v = qkv[:, (num_heads + num_kv_heads) * d :].view(tokens, num_kv_heads, d)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, norm_eps), rms_norm(k, k_norm, norm_eps)
    q_rot, _ = rotary_and_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=qkv.device)
    seq_lens = positions.view(batch, q_len)[:, 0] + q_len  # from the first position, as the kernel counts
    return paged_attention(q_rot, k_cache, v_cache, cu, seq_lens, block_tables, scale, sinks=sinks, window=window)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias), the projection every GEMV kernel computes."""
    y = x @ weight.t()
    return y if bias is None else y + bias


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): a pre-norm projection with its residual add."""
    normed, h = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight), h


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    return linear(rms_norm(x, norm_weight, eps), weight)


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(silu_and_mul(gate_up)): the MLP's down projection with its activation."""
    return linear(silu_and_mul(gate_up), weight)


# ---- mixture of experts (gpt-oss, Qwen3-MoE) --------------------------------------------------------------------


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k] int64): the top k logits, softmaxed over those
    k alone in the logits' dtype (HF GptOssTopKRouter; Qwen3-MoE's softmax, top k, renormalised to sum 1
    (norm_topk_prob) is the same: exp(l_i - m) / Σ_top-k exp(l_j - m) either way). Ties go to the lower expert
    id, as torch.topk breaks them. renormalize False: the chosen experts' probabilities under the softmax over all
    E logits (HF Qwen3MoeTopKRouter with norm_topk_prob false), which sum to less than 1."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    if renormalize:
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    acc = torch.promote_types(logits.dtype, torch.float32)  # HF takes this softmax in float32
    return torch.softmax(logits, dim=-1, dtype=acc).gather(-1, ids).to(logits.dtype), ids


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved columns [g0, u0, g1, u1, ...] -> [..., I]:
    (clamp(u, -limit, limit) + 1) · g' · sigmoid(alpha · g') with g' = min(g, limit) (HF GptOssExperts)."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


MOE_ACTIVATIONS = ("swiglu_oai", "silu")  # MoEWeights.activation: gpt-oss's clamped SwiGLU, or silu(gate) · up


def moe_activation(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """An expert's activation on interleaved columns [g0, u0, g1, u1, ...] -> [..., I]: swiglu_oai, or the plain
    SwiGLU silu(g) · u (Qwen3-MoE's experts, HF Qwen3MoeExperts)."""
    if activation == "silu":
        return torch.nn.functional.silu(gate_up[..., 0::2]) * gate_up[..., 1::2]
    return swiglu_oai(gate_up, alpha, limit)


def expert_matrix(w: ExpertStack, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix [N, K] in dtype, from a float stack [E, N, K], a packed MXFP4 (blocks, scales) pair or an
    FP8 block-scaled stack (quant.FP8BlockStack: data · scale per block) or an INT4 group-quantized one
    (quant.Int4GroupStack: (u - zero) · scale per group): only that expert is dequantized, exactly in float32 and
    float64 (what the kernels do in registers, one tile at a time)."""
    if isinstance(w, tuple):
        from envex.kernels import mxfp4

        return mxfp4.dequantize(w[0][e], w[1][e], dtype)
    if isinstance(w, torch.Tensor):
        return w[e].to(dtype)
    return w.expert(e, dtype)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: ExpertStack,
    gate_up_bias: torch.Tensor | None,
    down: ExpertStack,
    down_bias: torch.Tensor | None,
    alpha: float,
    limit: float,
    activation: str = "swiglu_oai",
) -> torch.Tensor:
    """Σ_k weights[t, k] · down_e(act(gate_up_e(x[t]))) over each token's chosen experts e = ids[t, k].

    x [T, H]; gate_up [E, 2I, H] (rows interleaved gate/up) with bias [E, 2I]; down [E, H, I] with bias [E, H]
    (None: no bias); float, MXFP4 (blocks, scales) pairs or FP8 / INT4 stacks (expert_matrix); act: moe_activation.
    Each projection, the activation and the weighting round to x's dtype where HF's expert loop does
    (GptOssExperts.forward, Qwen3MoeExperts.forward), so in bf16 this is HF's arithmetic.
    """
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        h = x[tok]
        gu = h @ expert_matrix(gate_up, e, x.dtype).t()
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].to(x.dtype)
        y = moe_activation(gu, activation, alpha, limit) @ expert_matrix(down, e, x.dtype).t()
        if down_bias is not None:
            y = y + down_bias[e].to(x.dtype)
        out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
    return out


# ---- batch-invariant forms (the deterministic mode's torch path) --------------------------------------------
# CPU BLAS rounds a row by the shape of the call it sits in: MKL's M = 1 path is a GEMV, and its GEMM handles rows
# in micro-tiles whose tail rows take another kernel (measured: a row's bits differ between M = 1, 2 and >= 4, and
# by slot at M = 6, 7, 9). These forms only ever hand BLAS shapes that do not depend on the batch.

INVARIANT_ROW_BLOCK = 8  # rows are padded to a multiple of this: every row then sits in a full micro-tile


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with x [M, K] copied into fresh rows padded to a multiple of INVARIANT_ROW_BLOCK: on MKL (AVX-512,
    measured for M = 8 .. 2064, at every slot, on 1 and 2 threads) a row's result then depends on that row alone.
    A fresh buffer also fixes the alignment, which MKL's results may depend on. The batch-invariance gate checks
    the property on the machine it runs on."""
    m = x.shape[0]
    padded = x.new_zeros((-(-m // INVARIANT_ROW_BLOCK) * INVARIANT_ROW_BLOCK, x.shape[1]))
    padded[:m] = x
    return torch.nn.functional.linear(padded, weight, bias)[:m]


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    q_lens: list[int] | None = None,
    seq_lens_host: list[int] | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """paged_attention (same arguments) with every query computed alone against exactly the keys it sees: the
    same torch calls on the same shapes, from buffers aligned the same way, whether the query is a decode step or
    a row of a prefill chunk, whatever the batch. Slower than paged_attention for long chunks (a call per query)."""
    num_tokens, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    q_lens, lens = host_lengths(cu_seqlens_q, seq_lens, q_lens, seq_lens_host)
    tables = block_tables.long()
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    q0 = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len == 0:
            continue
        # Keys from the block of the chunk's first query's first visible key (0 without a window).
        first = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
        blocks = tables[b, first:-(-seq_len // block_size)]
        keys = k_cache.index_select(0, blocks).reshape(-1, hkv, d).to(q.dtype)  # [L, Hkv, D], a fresh buffer
        vals = v_cache.index_select(0, blocks).reshape(-1, hkv, d).to(q.dtype)
        for i in range(q_len):
            pos = seq_len - q_len + i
            own = 0 if window is None else max(0, pos - window + 1) // block_size  # this query's first block
            lo, hi = (own - first) * block_size, pos + 1 - first * block_size  # its keys within the gather
            k_pos = torch.arange(own * block_size, pos + 1, device=q.device)
            qg = q[q0 + i].reshape(1, hkv, group, d).clone()  # a fresh row: alignment independent of the batch
            scores = torch.einsum("qhgd,khd->hgqk", qg, keys[lo:hi]) * scale  # [Hkv, G, 1, keys]
            if window is not None:
                scores = scores.masked_fill(k_pos <= pos - window, float("-inf"))
            scores = scores.to(acc)
            if sinks is not None:
                sink = sinks.to(acc).reshape(hkv, group, 1, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
            else:
                probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[q0 + i] = torch.einsum("hgqk,khd->qhgd", probs, vals[lo:hi]).reshape(hq, d)
        q0 += q_len
    return out

# ---- speculative decoding (runtime/engine/spec/): n-gram prompt lookup and a verify step's inputs ---------------

# Prompt lookup's search window and longest n-gram: the drafter's defaults, shared by every form of the rule.
NGRAM_WINDOW = 2048
NGRAM_MAX = 3


def propose_ngram(tokens: list[int], k: int, *, max_ngram: int = NGRAM_MAX, window: int = NGRAM_WINDOW) -> list[int]:
    """The reference rule: the k tokens after the latest earlier occurrence (start >= len - window) of the last n
    tokens, longest n first; [] when none occurs. ngram_propose (below: torch, on the device), kernels/ngram.py
    (the same in one Triton kernel, which the n-gram drafter runs on a GPU) and the drafter's host index
    (runtime/engine/spec/drafters.py, NgramIndex) must equal it."""
    n_tokens = len(tokens)
    lo = max(0, n_tokens - window)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        pattern = tokens[n_tokens - n:]
        for i in range(n_tokens - n - 1, lo - 1, -1):
            if tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []


def ngram_propose(hist: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, k: int, *,
                  max_ngram: int = NGRAM_MAX, window: int = NGRAM_WINDOW) -> tuple[torch.Tensor, torch.Tensor]:
    """propose_ngram for a batch, on the device, in static shapes (graph-safe): hist [S, L] int64, rows [B] (row
    of hist per sequence), lens [B] (its length) -> drafts [B, k] int64 and their count [B] (0: no match).

    Every candidate start i in [len - window, len - 2] is compared with the last n tokens at once ([B, window]
    gathers), and the latest matching i wins, longest n first, exactly as the reference rule."""
    width = hist.shape[1]
    window = min(window, width)
    flat = hist.reshape(-1)
    base = (rows * width)[:, None]  # [B, 1]
    lens = lens[:, None]  # [B, 1]

    def at(pos: torch.Tensor) -> torch.Tensor:  # hist[row, pos] with pos clamped into the row
        return flat[base + pos.clamp(0, width - 1)]

    starts = lens - window + torch.arange(window, device=hist.device)[None, :]  # [B, W] candidate starts
    shifted = [at(starts + m) for m in range(max_ngram)]  # shifted[m][b, w] = token at starts + m
    best = torch.full_like(lens, -1)  # [B, 1]
    best_n = torch.zeros_like(lens)
    for n in range(max_ngram, 0, -1):
        ok = (starts >= 0) & (starts <= lens - n - 1)
        for m in range(n):
            ok &= shifted[m] == at(lens - n + m)
        latest = torch.where(ok, starts, -1).amax(dim=1, keepdim=True)  # [B, 1]
        take = (best < 0) & (latest >= 0)
        best = torch.where(take, latest, best)
        best_n = torch.where(take, n, best_n)
    follow = best + best_n  # [B, 1] first proposed position
    count = torch.where(best >= 0, (lens - follow).clamp(0, k), 0)[:, 0]
    drafts = at(follow + torch.arange(k, device=hist.device)[None, :])  # [B, k]
    return drafts, count


def verify_inputs(hist: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, drafts: torch.Tensor,
                        num_drafts: torch.Tensor, k_limit: torch.Tensor, block_tables: torch.Tensor, *,
                        block_size: int, max_model_len: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A verify step's inputs from the drafts: (ids, positions, slots [B·(K+1)], seq_lens_after [B] int32), and
    num_drafts capped in place so that no draft reaches past the context. Row b's k + 1 tokens are its newest
    (hist[rows[b], seq_lens[b] - 1], not yet cached) and its drafts; rows past its drafts, and every row of a
    padding sequence (k_limit -1), get slot -1 (nothing written). kernels/spec_inputs.py is the same in one launch."""
    k = drafts.shape[1]
    num_drafts.copy_(torch.minimum(num_drafts, (max_model_len - seq_lens).clamp(min=0)))
    newest = hist[rows, seq_lens - 1]  # [B]
    ids = torch.cat([newest[:, None], drafts], dim=1)  # [B, K+1]
    j = torch.arange(k + 1, device=hist.device)[None, :]
    pos = (seq_lens[:, None] - 1 + j).clamp(max=max_model_len - 1)  # garbage rows stay inside the rotary tables
    # A step chained past a finishing sequence's end (seq_lens up to max_model_len + 2) writes nothing: its clamped
    # positions would overwrite the last cached key.
    valid = (j <= num_drafts[:, None]) & (k_limit[:, None] >= 0) & (seq_lens[:, None] - 1 + j < max_model_len)
    slots = block_tables.gather(1, pos // block_size).long() * block_size + pos % block_size
    return (ids.reshape(-1), pos.reshape(-1), torch.where(valid, slots, -1).reshape(-1),
            (seq_lens + k).to(torch.int32))  # fmt: skip


# ---- tensor parallelism ---------------------------------------------------------------------------------------


def ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """[W, n] -> [n]: the rows added in order to a float32 zero and rounded once to their dtype, the one-shot
    kernel's arithmetic (kernels/allreduce.py) for a message of any size."""
    total = torch.zeros(parts.shape[1:], dtype=torch.float32, device=parts.device)
    for part in parts:
        total += part.float()
    return total.to(parts.dtype)


# ---- packed KV caches (kv_quant.py): Hadamard rotation, int4 and fp8 quantization, packing, write, attention --------
# Every function computes in float64 (inputs are upcast), so the Triton kernels are compared against exact arithmetic
# on the same stored bits. Layouts (kv_quant.py's module docstring has the whole story):
# - int4: a (token, KV head) row of D elements in groups of G, each with a bf16 scale s = (max - min)/15 and a bf16
#   zero z = min; code = clamp(floor((x - z)/s + 1/2), 0, 15), x ≈ z + code·s. Byte j of the row holds element j in
#   its low nibble and element j + D/2 in its high nibble (the "split-half" order: a kernel unpacks the two halves of
#   a row without any shuffle). The row's scales [D/G] then its zeros [D/G] sit in its bf16 meta row.
# - fp8: e4m3fn (max 448), one bf16 scale per (token, KV head): x / s rounded to nearest even by torch's cast.

INT4_MAX = 7  # symmetric codes -7 .. 7, stored + 8 (1 .. 15; 0 is never written)
FP8_MAX = 448.0  # e4m3fn's largest finite value


def hadamard(d: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix [d, d] (d a power of two): H[i, j] = (-1)^popcount(i & j) / sqrt(d).
    Symmetric and orthogonal (H @ H = I), so (q H)·(k H) = q·k. Cached (the torch backend's packed cache writes
    with it every layer and step): do not modify the result."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim: {d} is not a power of two; the Hadamard rotation needs one")
    return _hadamard(d, dtype, torch.device(device))


@functools.lru_cache(maxsize=16)
def _hadamard(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    i = torch.arange(d)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(d)).to(dtype=dtype, device=device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ H_D in float64 (its own inverse)."""
    return x.to(torch.float64) @ hadamard(x.shape[-1], device=x.device)


def quantize_int4(x: torch.Tensor, group: int, *, zero_point: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x [..., D] -> (codes int64 [..., D], scales bf16 [..., D/G], zeros bf16 [..., D/G] or None).

    zero_point (the cache's format): s = (max - min)/15, z = min, both rounded to bf16, codes 0..15 for
    x ≈ z + code·s. Symmetric (measured against it, offline_docs/kv_cache.md; not a cache format): s = absmax/7,
    codes -7..7."""
    xf = x.to(torch.float64)
    g = xf.reshape(*x.shape[:-1], x.shape[-1] // group, group)  # [..., D/G, G]
    if zero_point:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).to(torch.bfloat16)
        z = lo.to(torch.bfloat16)
        sf = s.to(torch.float64)
        inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
        codes = torch.floor((g - z.to(torch.float64)[..., None]) * inv[..., None] + 0.5).clamp(0, 15)
        return codes.reshape(x.shape).long(), s, z
    s = (g.abs().amax(-1) / INT4_MAX).to(torch.bfloat16)
    sf = s.to(torch.float64)
    inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
    codes = torch.floor(g * inv[..., None] + 0.5).clamp(-INT4_MAX, INT4_MAX)
    return codes.reshape(x.shape).long(), s, None


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of quantize_int4 in float64 -> [..., D]."""
    group = codes.shape[-1] // scales.shape[-1]
    c = codes.to(torch.float64).reshape(*codes.shape[:-1], scales.shape[-1], group)
    x = c * scales.to(torch.float64)[..., None]
    if zeros is not None:
        x = x + zeros.to(torch.float64)[..., None]
    return x.reshape(codes.shape)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., D] (0..15) -> bytes uint8 [..., D/2]: byte j = c_j | c_{j+D/2} << 4 (split-half order)."""
    half = codes.shape[-1] // 2
    u = codes.to(torch.int64)
    return (u[..., :half] | (u[..., half:] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """bytes uint8 [..., D/2] -> codes int64 [..., D] (0..15), the inverse of pack_int4."""
    b = packed.to(torch.int64)
    return torch.cat([b & 15, b >> 4], dim=-1)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], bf16 scale [...]): s = absmax/448 rounded to bf16, x/s clamped to
    ±448 and rounded to nearest even."""
    xf = x.to(torch.float64)
    s = (xf.abs().amax(-1) / FP8_MAX).to(torch.bfloat16)
    sf = s.to(torch.float64)
    inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
    y = (xf * inv[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn), s


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return data.to(torch.float64) * scales.to(torch.float64)[..., None]


def kv_encode(x: torch.Tensor, kind: str, group: int, rotated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One operand (k after rotary, or v) [..., D] -> (stored data, stored meta) of the cache format: int4 packed
    bytes [..., D/2] and bf16 [..., 2·D/G] (scales, then zeros); fp8 [..., D] and its bf16 scale [..., 1]."""
    if rotated:
        x = hadamard_rotate(x)
    if kind == "int4":
        codes, s, z = quantize_int4(x, group)
        assert z is not None
        return pack_int4(codes), torch.cat([s, z], dim=-1)
    data, s = quantize_fp8(x)
    return data, s[..., None]


def kv_decode(data: torch.Tensor, meta: torch.Tensor, kind: str, rotated: bool) -> torch.Tensor:
    """Stored (data, meta) -> float64 [..., D] in the model's basis (un-rotated)."""
    if kind == "int4":
        ng = meta.shape[-1] // 2
        x = dequantize_int4(unpack_int4(data), meta[..., :ng], meta[..., ng:])
    else:
        x = dequantize_fp8(data, meta[..., 0])
    return hadamard_rotate(x) if rotated else x


def write_packed_kv(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slot_mapping: torch.Tensor, k_data: torch.Tensor, k_meta: torch.Tensor, v_data: torch.Tensor,
                    v_meta: torch.Tensor, *, kind: str, group: int, rotate_keys: bool, rotate_values: bool,
                    round_to: torch.dtype | None = None) -> None:  # fmt: skip
    """Rotary on k [T, Hkv, D] (HF rotate_half, in float64; then rounded to round_to, as the write kernel rounds the
    rotated k to k's dtype, what a bf16 cache would hold), then encode k and v into the packed caches
    ([num_blocks, block_size, Hkv, ...]) at slot_mapping (negative: skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_rot = rotary(k.to(torch.float64), positions, cos.to(torch.float64), sin.to(torch.float64))
    if round_to is not None:
        k_rot = k_rot.to(round_to)
    for x, data_c, meta_c, rot in ((k_rot, k_data, k_meta, rotate_keys), (v, v_data, v_meta, rotate_values)):
        data, s = kv_encode(x[keep], kind, group, rot)
        data_c.view(-1, *data_c.shape[2:])[slots] = data
        meta_c.view(-1, *meta_c.shape[2:])[slots] = s


def packed_kv_paged_attention(q: torch.Tensor, k_data: torch.Tensor, k_meta: torch.Tensor, v_data: torch.Tensor,
                              v_meta: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, scale: float, *, kind: str, rotate_keys: bool,
                              rotate_values: bool, sinks: torch.Tensor | None = None,
                              window: int | None = None) -> torch.Tensor:  # fmt: skip
    """paged_attention (varlen causal, sinks, window) in float64 over the dequantized, un-rotated cache.
    q [T, Hq, D] is rotary-rotated, not Hadamard-rotated: (qH)·(kH) = q·k, so attending with the un-rotated keys
    is the same function the kernel computes in the rotated basis."""
    k = kv_decode(k_data, k_meta, kind, rotate_keys)
    v = kv_decode(v_data, v_meta, kind, rotate_values)
    sinks64 = None if sinks is None else sinks.to(torch.float64)
    return paged_attention(q.to(torch.float64), k, v, cu_seqlens_q, seq_lens, block_tables, scale,
                           sinks=sinks64, window=window)  # fmt: skip


# ---- Gated DeltaNet (delta_rule.py): Qwen3-Next's linear-attention layers -------------------------------------------
# HF `Qwen3NextGatedDeltaNet`: a short causal depthwise convolution with SiLU over the packed q/k/v channels, the
# gated delta rule, and RMSNorm(o) * silu(z). Each function takes the kernels' packed layout (tokens of all sequences
# one after another, `cu_seqlens` marking where each starts) and their state pools (one slot per sequence, picked by
# `slots`), and updates the pools in place as the kernels do. The delta rule is written as its token-by-token
# recurrence, which HF's chunked and recurrent functions both equal (tests/test_kernels_delta_rule.py checks that in
# float32).

L2_EPS = 1e-6  # HF's l2norm (and FLA's): x * rsqrt(sum(x²) + eps), in float32 or wider


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _snapshot_counts(start: int, length: int, every: int) -> list[int]:
    """The token counts c in (start, start + length] that are multiples of `every`: where snapshots are taken."""
    if every <= 0:
        return []
    first = (start // every + 1) * every
    return list(range(first, start + length + 1, every))


def _state_sequences(cu_seqlens: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(b, slot, first row, end row) of each sequence whose slot is not negative (padding rows are skipped)."""
    bounds = cu_seqlens.tolist()
    return [(b, slot, bounds[b], bounds[b + 1]) for b, slot in enumerate(slots.tolist()) if slot >= 0]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, *,
                     has_initial_state: torch.Tensor | None = None, start_pos: torch.Tensor | None = None,
                     snapshot_slots: torch.Tensor | None = None, snapshot_every: int = 0) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over packed sequences: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, ≤ 0) and beta
    [T, Hv]; sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] and its state is state_pool[slots[b]] [Hv, Dk, Dv]
    (zeros instead where has_initial_state[b] is False). v head h reads q/k head h // (Hv / Hk). Per token, with
    q and k L2-normalised and q scaled by Dk^-0.5:  S ← S·exp(g);  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq.
    Returns o [T, Hv, Dv] in v's dtype; the final state goes to state_pool[slots[b]] (nothing where slots[b] < 0).
    Snapshots: with snapshot_every > 0, the state after c tokens of the sequence (counting start_pos[b] tokens
    before this call) for each multiple c of snapshot_every in (start_pos[b], start_pos[b] + len] is also written to
    state_pool[snapshot_slots[b, n]], n counting those c from 0 (nothing where the entry is negative)."""
    num_k, dk = q.shape[1], q.shape[2]
    group = v.shape[1] // num_k
    out = torch.zeros_like(v)
    for b, slot, lo, hi in _state_sequences(cu_seqlens, slots):
        state = state_pool[slot].to(v.dtype).clone()  # [Hv, Dk, Dv]
        if has_initial_state is not None and not bool(has_initial_state[b]):
            state.zero_()
        start = int(start_pos[b]) if start_pos is not None else 0
        snaps = _snapshot_counts(start, hi - lo, snapshot_every)
        for t in range(lo, hi):
            qt = l2_normalize(q[t].to(v.dtype)).repeat_interleave(group, 0) * dk**-0.5  # [Hv, Dk]
            kt = l2_normalize(k[t].to(v.dtype)).repeat_interleave(group, 0)
            state = state * g[t].to(v.dtype).exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", state, kt)
            delta = (v[t] - predicted) * beta[t].to(v.dtype)[:, None]
            state = state + kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qt)
            done = start + t - lo + 1
            if done in snaps and snapshot_slots is not None:
                target = int(snapshot_slots[b, snaps.index(done)])
                if target >= 0:
                    state_pool[target] = state.to(state_pool.dtype)
        state_pool[slot] = state.to(state_pool.dtype)
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                  conv_pool: torch.Tensor, slots: torch.Tensor, *, has_initial_state: torch.Tensor | None = None,
                  silu: bool = True, start_pos: torch.Tensor | None = None, snapshot_slots: torch.Tensor | None = None,
                  snapshot_every: int = 0) -> torch.Tensor:  # fmt: skip
    """Causal depthwise conv1d over packed sequences x [T, D] with weight [D, K] (HF's conv1d.weight[:, 0, :]),
    optional bias [D] and SiLU: out[t, d] = Σ_j weight[d, j] · x[t - (K-1) + j, d], where inputs before the
    sequence's first token come from its conv state conv_pool[slots[b]] [K-1, D] (row j holds the input K-1-j
    tokens back; zeros where has_initial_state[b] is False). The state then holds the sequence's last K-1 inputs
    (nothing written where slots[b] < 0). Snapshots as in `gated_delta_rule`: the conv state after c tokens goes to
    conv_pool[snapshot_slots[b, n]]. Returns out [T, D] in x's dtype."""
    width = weight.shape[1]
    out = torch.zeros_like(x)
    for b, slot, lo, hi in _state_sequences(cu_seqlens, slots):
        history = conv_pool[slot].to(x.dtype).clone()  # [K-1, D]
        if has_initial_state is not None and not bool(has_initial_state[b]):
            history.zero_()
        window = torch.cat([history, x[lo:hi]])  # [K-1 + L, D]
        for t in range(hi - lo):
            acc = (window[t : t + width] * weight.to(x.dtype).t()).sum(0)  # [D]
            if bias is not None:
                acc = acc + bias.to(x.dtype)
            out[lo + t] = torch.nn.functional.silu(acc) if silu else acc
        start = int(start_pos[b]) if start_pos is not None else 0
        for n, c in enumerate(_snapshot_counts(start, hi - lo, snapshot_every)):
            target = int(snapshot_slots[b, n]) if snapshot_slots is not None else -1
            if target >= 0:
                done = c - start  # tokens of this call in the snapshot: window rows done .. done + K-2
                conv_pool[target] = window[done : done + width - 1].to(conv_pool.dtype)
        conv_pool[slot] = window[window.shape[0] - (width - 1) :].to(conv_pool.dtype)
    return out


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """HF's gating of one layer from the projection's raw a, b [T, Hv] and the layer's A_log, dt_bias [Hv] -> (g, beta):
    g = -exp(A_log)·softplus(a + dt_bias) in float32 (or wider), beta = sigmoid(b) in b's dtype."""
    acc = torch.promote_types(a.dtype, torch.float32)
    g = -a_log.to(acc).exp() * torch.nn.functional.softplus(a.to(acc) + dt_bias.to(acc))
    return g, b.sigmoid()


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3NextRMSNormGated over the last dim: RMSNorm(x) in float32 (or wider), cast to x's dtype, times the
    weight, times silu(z) in float32 (or wider), cast to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).to(acc) * torch.nn.functional.silu(z.to(acc))).to(x.dtype)


def gated_delta_net(mixed: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, meta: AttentionMetadata,
                    layer: LinearAttentionLayer) -> torch.Tensor:  # fmt: skip
    """One Gated DeltaNet layer between its projections, as HF's Qwen3NextGatedDeltaNet computes it (the torch
    backend's Ops.linear_attention): mixed [T, ...] the input projection's row (LinearAttentionLayer.split) ->
    [T, Hv·Dv] in mixed's dtype. The convolution runs in the activation dtype, the delta rule in float32 (or wider),
    as HF's torch path; the pools are updated in place (meta.state_slots), with the step's snapshots
    (meta.state_snapshots) where it asks for them."""
    assert meta.state_slots is not None, "a model with linear-attention layers gets state slots (state_slots.py)"
    slots, cu = meta.state_slots, meta.cu_seqlens_q
    snaps: dict = {}
    if meta.state_snapshots is not None:
        assert meta.seq_lens is not None, "a step that snapshots states carries its sequences' lengths"
        snaps = dict(start_pos=meta.seq_lens - (cu[1:] - cu[:-1]), snapshot_slots=meta.state_snapshots,
                     snapshot_every=meta.state_snapshot_every)  # fmt: skip
    x, z, b, a = layer.split(mixed)
    conv = causal_conv1d(x, layer.conv_weight, None, cu, conv_pool, slots, has_initial_state=meta.state_initialized,
                         **snaps)  # fmt: skip
    q, k, v = layer.split_conv(conv)
    g, beta = delta_gates(a, b, layer.a_log, layer.dt_bias)
    acc = torch.promote_types(mixed.dtype, torch.float32)
    o = gated_delta_rule(q.to(acc), k.to(acc), v.to(acc), g, beta.to(acc), cu, state_pool, slots,
                         has_initial_state=meta.state_initialized, **snaps)  # fmt: skip
    return gated_rms_norm(o.to(mixed.dtype), z, layer.norm_weight, layer.norm_eps).flatten(1)


# ---- DeepSeek (mla.py): multi-head latent attention on a paged latent cache, and expert routing ---------------------
# Latent cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one row per token: the compressed KV c
# after kv_a_layernorm, then k_pe after rotary, in the half-split layout (`deepseek_rope`). Absorbed attention: per
# head h, q_nope_h · (W_UK_h c) = (W_UK_hᵀ q_nope_h) · c, so a query row [q_abs_h (rank), q_pe_h (rope)] scores
# against the 576-wide latent row, and its output Σ p·c (rank wide) becomes the head's value W_UV_h (Σ p·c).


def deepseek_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  interleaved: bool) -> torch.Tensor:  # fmt: skip
    """Rotary on the rope part x [T, ..., R] with cos/sin [max_pos, R/2] -> [T, ..., R] in the half-split layout
    [x1·c − x2·s, x2·c + x1·s]. interleaved: the pairs are (x0, x1), (x2, x3), ... (DeepSeek's checkpoints; HF
    DeepseekV3 `apply_rotary_pos_emb_interleave` with rope_interleave true, DeepseekV2's complex rotation), else the
    halves (x_i, x_{i+R/2}) (rotate_half). Either way the output is half-split, as HF V3 returns it: a layout
    shared by q and k, so q_pe · k_pe is the same as in V2's interleaved output."""
    half = x.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos[positions].to(x.dtype).reshape(shape)
    s = sin[positions].to(x.dtype).reshape(shape)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_store_latent(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, latent_cache: torch.Tensor, *,
                     interleaved: bool) -> None:  # fmt: skip
    """Write each token's latent row: kv_a [T, rank + rope] (kv_a_proj_with_mqa's output) -> [RMSNorm(c) (HF
    DeepseekV3RMSNorm: float32 or wider statistics, rounded to the input dtype, times the weight), rotary(k_pe)]
    at latent_cache.view(-1, rank + rope)[slot]. A negative slot writes nothing (a padding row)."""
    rank = norm_weight.shape[0]
    c, pe = kv_a[:, :rank], kv_a[:, rank:]
    acc = torch.promote_types(kv_a.dtype, torch.float32)
    cf = c.to(acc)
    c_n = norm_weight * (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + eps)).to(kv_a.dtype)
    row = torch.cat([c_n.to(kv_a.dtype), deepseek_rope(pe, positions, cos, sin, interleaved=interleaved)], dim=-1)
    keep = slot_mapping >= 0
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    flat[slot_mapping[keep]] = row[keep].to(latent_cache.dtype)


def mla_paged_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                        *, q_lens: list[int] | None = None,
                        seq_lens_host: list[int] | None = None) -> torch.Tensor:  # fmt: skip
    """Absorbed causal MLA over the paged latent cache -> [T, H, rank] (before W_UV).

    q_abs [T, H, rank]: q_nope absorbed per head (q_nope_h @ W_UK_h); q_pe [T, H, rope]: rotated, half-split.
    Keys are the whole latent rows, values their first `rank` columns; all heads share the one latent head.
    Sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] at the last q_len of its seq_lens[b] positions
    (already written) and sees keys 0 .. its own position. scale: the softmax scale (mla.mla_softmax_scale)."""
    rank = q_abs.shape[-1]
    page = latent_cache.shape[1]
    q_lens, lens = host_lengths(cu_seqlens_q, seq_lens, q_lens, seq_lens_host)
    tables = block_tables.long()
    acc = torch.promote_types(q_abs.dtype, torch.float32)
    q = torch.cat([q_abs, q_pe], dim=-1).to(acc)  # [T, H, rank + rope]
    out = torch.empty_like(q_abs)
    q0 = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        q1 = q0 + q_len
        if q_len == 0:
            continue
        blocks = tables[b, : (seq_len + page - 1) // page]
        rows = latent_cache.index_select(0, blocks).reshape(-1, latent_cache.shape[-1])[:seq_len].to(acc)  # [L, W]
        scores = torch.einsum("qhw,lw->hql", q[q0:q1], rows) * scale  # [H, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        hidden = torch.arange(seq_len, device=q.device)[None, :] > q_pos
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("hql,lr->qhr", probs, rows[:, :rank]).to(out.dtype)
        q0 = q1
    return out


def _expert_group_mask(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """[T, E] True for the experts of each token's topk_group best groups; a group scores the sum of its two best
    choice scores ("top2_sum", V3) or its best one ("max", V2's group_limited_greedy)."""
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    if group_score == "top2_sum":
        scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)
    else:
        scores = grouped.max(-1).values
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(1, scores.topk(topk_group, dim=-1).indices, True)
    return keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)


def deepseek_v3_routing(router_logits: torch.Tensor, correction_bias: torch.Tensor, *, top_k: int, n_group: int,
                        topk_group: int, norm_topk_prob: bool,
                        routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """DeepSeek-V3's router (Kimi K2, Moonlight; HF DeepseekV3TopkRouter): router logits [T, E] -> (weights [T, k],
    expert ids [T, k] int64), as moe_route orders them, best choice first.

    scores = sigmoid(logits); experts are chosen by scores + correction_bias, only among the topk_group groups (of
    n_group equal groups) whose two best biased scores sum highest; the weights are the chosen experts' unbiased
    scores, divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor. In float32 or wider."""
    acc = torch.promote_types(router_logits.dtype, torch.float32)
    scores = router_logits.to(acc).sigmoid()
    choice = scores + correction_bias.to(acc)
    choice = choice.masked_fill(~_expert_group_mask(choice, n_group, topk_group, "top2_sum"), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def deepseek_v2_routing(router_logits: torch.Tensor, *, top_k: int, topk_method: str, n_group: int | None,
                        topk_group: int | None,
                        routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """DeepSeek-V2's router (V2-Lite: "greedy"; V2: "group_limited_greedy"; HF DeepseekV2TopkRouter): router logits
    [T, E] -> (weights [T, k], expert ids [T, k] int64), best first. scores = softmax(logits) in float32 or wider;
    greedy: the top k; group_limited_greedy: the top k among the topk_group groups with the highest single score.
    Weights: the chosen scores times routed_scaling_factor, never renormalised (HF's router ignores norm_topk_prob,
    which every V2 checkpoint sets false)."""
    acc = torch.promote_types(router_logits.dtype, torch.float32)
    scores = router_logits.to(acc).softmax(dim=-1)
    if topk_method == "group_limited_greedy":
        assert n_group is not None and topk_group is not None, "group_limited_greedy needs n_group and topk_group"
        scores = scores.masked_fill(~_expert_group_mask(scores, n_group, topk_group, "max"), 0.0)
    elif topk_method != "greedy":
        raise ValueError(f"topk_method: {topk_method!r} is not one of 'greedy', 'group_limited_greedy'")
    weights, ids = scores.topk(top_k, dim=-1)
    return weights * routed_scaling_factor, ids


# ---- W8A8: FP8 activations times FP8 weights (quant_gemm.fp8_act_quant, quant_gemm.fp8_gemm) ---------------------


def fp8_act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes float8_e4m3fn [M, K], scales float32 [M, ceil(K / group)]): per row and group of `group`
    consecutive inputs (the last may be partial), s = amax|x| / 448 in float32 (1 where the group is all zero) and
    codes = x / s in float32, rounded to nearest even in e4m3. Each quotient is taken in float64 and rounded once
    to float32, which is the correctly rounded float32 quotient (53 >= 2 · 24 + 2 bits make the double rounding
    harmless) on every device: CUDA's float32 division by a CPU scalar multiplies by its reciprocal instead."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = xf.abs().amax(-1)  # [M, G]
    s = torch.where(amax > 0, (amax.double() / FP8_MAX).float(), torch.ones_like(amax))
    v = (xf.double() / s.double()[..., None]).float().view(m, groups * group)[:, :k]
    return v.to(torch.float8_e4m3fn).contiguous(), s


def fp8_gemm(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *,
             group: int = 128) -> torch.Tensor:  # fmt: skip
    """y [M, N] in float64 = the dequantized activations (fp8_act_quant's codes · scales, per group of `group`)
    @ the dequantized FP8 weight^T (+ bias): what the W8A8 GEMM computes, the activations' quantization included."""
    from envex.kernels.quant import dequantize

    codes, s = fp8_act_quant(x, group)
    xq = codes.double() * s.double().repeat_interleave(group, dim=1)[:, : x.shape[1]]
    y = xq @ dequantize(weight, torch.float64).t()
    return y if bias is None else y + bias.double()
