"""Pure-torch definitions of every kernel in this package: what each Triton kernel must compute.

Each function follows the HF Llama conventions the engine's torch backend uses. Tests call these on float64
copies of the inputs and compare the Triton result by relative error (‖out − ref‖ / ‖ref‖).
"""

from __future__ import annotations

import torch


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
    if q_lens is None:
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    lens = seq_lens_host if seq_lens_host is not None else seq_lens.tolist()
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


def expert_matrix(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix [N, K] in dtype, from a float stack [E, N, K] or a packed MXFP4 (blocks, scales) pair:
    only that expert is dequantized (what the kernels do in registers, one tile at a time)."""
    if isinstance(w, tuple):
        from envex.kernels import mxfp4

        return mxfp4.dequantize(w[0][e], w[1][e], dtype)
    return w[e].to(dtype)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    down_bias: torch.Tensor | None,
    alpha: float,
    limit: float,
    activation: str = "swiglu_oai",
) -> torch.Tensor:
    """Σ_k weights[t, k] · down_e(act(gate_up_e(x[t]))) over each token's chosen experts e = ids[t, k].

    x [T, H]; gate_up [E, 2I, H] (rows interleaved gate/up) with bias [E, 2I]; down [E, H, I] with bias [E, H]
    (None: no bias); either float or MXFP4 (blocks, scales) pairs; act: moe_activation. Each projection, the
    activation and the weighting round to x's dtype where HF's expert loop does (GptOssExperts.forward,
    Qwen3MoeExperts.forward), so in bf16 this is HF's arithmetic.
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
    if q_lens is None:
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    lens = seq_lens_host if seq_lens_host is not None else seq_lens.tolist()
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
