"""The reference backend: every fused operation the model needs, in plain torch, on any device.

The Triton backend (envex.kernels.ops.TritonOps) has the same methods; the gates prove the two agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from envex.runtime.engine.attention import AttentionMetadata


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF Llama convention: x * cos + rotate_half(x) * sin, cos/sin repeated over both halves.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_and_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos/sin: [max_pos, D/2] float32 -> [T, 1, D] in the activations' dtype, as HF casts them.
        c = cos[positions].repeat(1, 2).unsqueeze(1).to(q.dtype)
        s = sin[positions].repeat(1, 2).unsqueeze(1).to(q.dtype)
        q, k = _rotate(q, c, s), _rotate(k, c, s)
        flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, slot_mapping, k)
        flat_v.index_copy_(0, slot_mapping, v)
        return q, k

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        assert meta.kv_slots is not None and meta.q_index is not None
        assert meta.q_rows is not None and meta.attn_mask is not None
        b, max_s = meta.kv_slots.shape
        max_q = meta.q_index.shape[1]
        # index_select on flat views: several times faster on CPU than advanced indexing.
        slots = meta.kv_slots.reshape(-1)
        flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        keys = flat_k.index_select(0, slots).view(b, max_s, *k_cache.shape[2:]).transpose(1, 2)  # [B, Hkv, S, D]
        values = flat_v.index_select(0, slots).view(b, max_s, *v_cache.shape[2:]).transpose(1, 2)
        queries = q.index_select(0, meta.q_index.reshape(-1)).view(b, max_q, *q.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.attn_mask, scale=meta.scale,
                                             enable_gqa=queries.shape[1] != keys.shape[1])  # [B, Hq, Q, D]
        out = out.transpose(1, 2).reshape(b * max_q, *q.shape[1:])
        return out.index_select(0, meta.q_rows)  # [T, Hq, D], rows back in packed order
