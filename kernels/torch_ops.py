"""The torch backend: kernels/reference.py behind the `Ops` interface (kernels/ops.py), on any device and dtype.

`TorchOps` is the reference every other backend is proven against (tests, and the gates against HF
transformers). `InvariantTorchOps` is its batch-invariant form (reference.linear_invariant,
paged_attention_invariant), which gives a row the same bits whatever its batch on the CPU; norms and activations
are row-wise already. Neither imports Triton, so this backend runs where Triton is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F

from envex.kernels import quant, reference
from envex.kernels.kv_quant_format import PackedKVCache, dequantize_blocks
from envex.kernels.ops import (
    AttentionLayer,
    AttentionMetadata,
    Communicator,
    LinearAttentionLayer,
    MLALayer,
    MoEWeights,
    split_qkv,
)
from envex.kernels.quant import PackedWeight


class TorchOps:
    """kernels/reference.py as a backend: any device, any dtype; the definition the fast paths must equal."""

    name = "torch"
    deterministic: ClassVar[bool] = False
    _linear: ClassVar[Callable[..., torch.Tensor]] = staticmethod(F.linear)
    _attend: ClassVar[Callable[..., torch.Tensor]] = staticmethod(reference.paged_attention)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, comm: Communicator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if comm is not None:
            x = comm.all_reduce(x)
        if residual is None:
            normed, residual = reference.rms_norm(x, norm_weight, eps), x
        else:
            normed, residual = reference.add_rms_norm(x, residual, norm_weight, eps)
        return self._project(normed, weight, bias), residual

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._project(x, weight, bias)

    def act_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._project(reference.silu_and_mul(gate_up), weight)

    def _project(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if isinstance(weight, PackedWeight):  # low-bit weights: the reference, dequantized to x's dtype
            return quant.quant_linear_reference(x, weight, bias)
        return self._linear(x, weight, bias)

    def materialize(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return hidden

    def attention(self, qkv: torch.Tensor, k_cache: torch.Tensor | PackedKVCache, v_cache: torch.Tensor | None,
                  meta: AttentionMetadata, layer: AttentionLayer) -> torch.Tensor:  # fmt: skip
        q, k, v = split_qkv(qkv, layer)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = reference.rms_norm(q, layer.q_norm, layer.norm_eps)
            k = reference.rms_norm(k, layer.k_norm, layer.norm_eps)
        block_tables = meta.block_tables
        if isinstance(k_cache, PackedKVCache):
            q, k_cache, v_cache, block_tables = _packed_write_and_read(q, k, v, k_cache, meta)
        else:
            assert v_cache is not None, "a plain cache comes as a (k, v) pair"
            q, _ = reference.rotary_and_store_kv(q, k, v, meta.positions, meta.cos, meta.sin, k_cache, v_cache,
                                                 meta.slot_mapping)  # fmt: skip
        seq_lens = meta.seq_lens if meta.seq_lens is not None else (meta.positions + 1).to(torch.int32)
        out = self._attend(q, k_cache, v_cache, meta.cu_seqlens_q, seq_lens, block_tables, layer.scale,
                           q_lens=meta.q_lens_host, seq_lens_host=meta.seq_lens_host, sinks=layer.sinks,
                           window=layer.sliding_window)  # fmt: skip
        return out.reshape(-1, layer.q_size)

    def moe(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
            router_weight: torch.Tensor, router_bias: torch.Tensor | None, experts: MoEWeights, top_k: int
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if residual is None:
            h, residual = reference.rms_norm(x, norm_weight, eps), x
        else:
            h, residual = reference.add_rms_norm(x, residual, norm_weight, eps)
        if experts.scoring != "softmax":  # DeepSeek's routing, shared experts included; the router in its dtype
            logits = F.linear(h.to(router_weight.dtype), router_weight, router_bias)
            weights, ids = experts.deepseek_route(logits, top_k)
        else:
            weights, ids = reference.moe_route(F.linear(h, router_weight, router_bias), top_k, experts.renormalize)
        out = reference.moe_experts(h, weights, ids, experts.gate_up_matrix(), experts.gate_up_bias,
                                    experts.down_matrix(), experts.down_bias, experts.alpha, experts.limit,
                                    experts.activation)  # fmt: skip
        return out, residual

    def linear_attention(self, mixed: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor,
                         meta: AttentionMetadata, layer: LinearAttentionLayer) -> torch.Tensor:  # fmt: skip
        return reference.gated_delta_net(mixed, state_pool, conv_pool, meta, layer)

    def mla_attention(self, q: torch.Tensor, kv_a: torch.Tensor, latent_cache: torch.Tensor,
                      meta: AttentionMetadata, layer: MLALayer) -> torch.Tensor:  # fmt: skip
        q = q.view(-1, layer.num_heads, layer.q_head_dim)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)
        reference.mla_store_latent(kv_a, layer.kv_norm, layer.norm_eps, meta.positions, meta.cos, meta.sin,
                                   meta.slot_mapping, latent_cache, interleaved=layer.interleaved)  # fmt: skip
        q_pe = reference.deepseek_rope(q_pe, meta.positions, meta.cos, meta.sin, interleaved=layer.interleaved)
        q_abs = torch.einsum("thd,hdr->thr", q_nope, layer.w_uk)  # [T, H, rank]: W_UK absorbed into the query
        seq_lens = meta.seq_lens if meta.seq_lens is not None else (meta.positions + 1).to(torch.int32)
        o = reference.mla_paged_attention(q_abs, q_pe, latent_cache, meta.cu_seqlens_q, seq_lens,
                                          meta.block_tables, layer.scale, q_lens=meta.q_lens_host,
                                          seq_lens_host=meta.seq_lens_host)  # fmt: skip
        return torch.einsum("thr,hvr->thv", o, layer.w_uv).reshape(q.shape[0], -1)  # [T, H v]


def _packed_write_and_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PackedKVCache,
                           meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed cache on the torch backend: this step's K/V encoded by the float64 reference (the same bytes as the
    Triton write kernel), then the blocks this step reads dequantized into a plain cache in q's dtype and the model's
    basis, so the plain attention reads them (q needs no Hadamard rotation: the keys come back un-rotated).
    -> (q after rotary, k_cache, v_cache [B·max_blocks, block_size, Hkv, D], block tables into them)."""
    fmt = cache.fmt
    reference.write_packed_kv(k, v, meta.positions, meta.cos, meta.sin, meta.slot_mapping, cache.k_data,
                              cache.k_meta, cache.v_data, cache.v_meta, kind=fmt.dtype, group=fmt.group_size,
                              rotate_keys=fmt.keys_rotated, rotate_values=fmt.values_rotated,
                              round_to=k.dtype)  # fmt: skip
    q = reference.rotary(q, meta.positions, meta.cos, meta.sin)
    tables = meta.block_tables  # [B, max_blocks]: every row's blocks, padding included (block 0, never read)
    k_plain, v_plain = dequantize_blocks(cache, tables.reshape(-1).long(), q.dtype)
    local = torch.arange(tables.numel(), dtype=tables.dtype, device=tables.device).view(tables.shape)
    return q, k_plain, v_plain, local


class InvariantTorchOps(TorchOps):
    """TorchOps with the batch-invariant projections and attention (batch-invariant on the CPU; on CUDA cuBLAS
    picks kernels by shape, so backends.py declares it CPU-only). No invariant MoE: the expert projections group
    tokens by expert, so a token's rows meet BLAS in batch-dependent shapes."""

    deterministic = True
    _linear = staticmethod(reference.linear_invariant)
    _attend = staticmethod(reference.paged_attention_invariant)

    def moe(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("InvariantTorchOps.moe: mixture-of-experts layers have no batch-invariant kernel; use "
                         "TorchOps (EngineConfig.resolved refuses such a model in the deterministic mode)")
