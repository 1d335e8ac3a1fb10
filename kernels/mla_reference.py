"""Pure-torch definitions of the DeepSeek kernels in kernels/mla.py (multi-head latent attention on a paged latent
cache) and of DeepSeek's expert routing: what each must compute. Tests call them on float64 copies.

To move into kernels/reference.py once that file's refactor has landed; nothing here imports it.

Latent cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one row per token: the compressed KV c
after kv_a_layernorm, then k_pe after rotary, in the half-split layout (`deepseek_rope`). Absorbed attention: per
head h, q_nope_h · (W_UK_h c) = (W_UK_hᵀ q_nope_h) · c, so a query row [q_abs_h (rank), q_pe_h (rope)] scores
against the 576-wide latent row, and its output Σ p·c (rank wide) becomes the head's value W_UV_h (Σ p·c).
"""

from __future__ import annotations

import torch


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
    if q_lens is None:
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    lens = seq_lens_host if seq_lens_host is not None else seq_lens.tolist()
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


def _grouped_mask(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
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
    expert ids [T, k] int64), as reference.moe_route orders them, best choice first.

    scores = sigmoid(logits); experts are chosen by scores + correction_bias, only among the topk_group groups (of
    n_group equal groups) whose two best biased scores sum highest; the weights are the chosen experts' unbiased
    scores, divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor. In float32 or wider."""
    acc = torch.promote_types(router_logits.dtype, torch.float32)
    scores = router_logits.to(acc).sigmoid()
    choice = scores + correction_bias.to(acc)
    choice = choice.masked_fill(~_grouped_mask(choice, n_group, topk_group, "top2_sum"), float("-inf"))
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
        scores = scores.masked_fill(~_grouped_mask(scores, n_group, topk_group, "max"), 0.0)
    elif topk_method != "greedy":
        raise ValueError(f"topk_method: {topk_method!r} is not one of 'greedy', 'group_limited_greedy'")
    weights, ids = scores.topk(top_k, dim=-1)
    return weights * routed_scaling_factor, ids
