"""The batch-invariant Triton backend (the deterministic mode, EngineConfig.deterministic): one path for every
batch, so a row's bits never depend on its batch, its place in it, or the chunking of its prompt.

The row-wise norm kernels, invariant_matmul for every projection (SwiGLU in a pass before it), rotary_and_store_kv
and invariant_attention for decode and prefill alike. Where the invariant matmul splits O or down into K pieces
(decode batches), the next norm adds the pieces in the reduce kernel's order instead of that launch: the same
bits. Under tensor parallelism the fused all-reduce + norm pass is never taken (it has its own norm arithmetic and
takes only the sizes that fit), and the all-reduce adds the ranks in rank order (Capabilities.ordered_all_reduce).
No MoE, sink or window kernels yet: backends.py declares so, and the engine's config refuses such a model.
"""

from __future__ import annotations

import torch

from envex.kernels import invariant_attention, invariant_matmul, norm, rotary
from envex.kernels._common import check, next_pow2
from envex.kernels.ops import AttentionLayer, AttentionMetadata, MoEWeights, split_qkv
from envex.kernels.triton_ops import TritonOps, _rows


class InvariantTritonOps(TritonOps):
    name = "triton"
    deterministic = True

    def _fuse_reduce(self, x: torch.Tensor) -> bool:
        return False

    def _norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if residual is None:  # one program per row: a row's norm never sees another row
            normed, residual = norm.rms_norm(x, norm_weight, eps), x
        else:
            normed, residual = norm.add_rms_norm(x, residual, norm_weight, eps)
        return invariant_matmul.matmul(normed, weight, bias, pdl=self._row_pdl(x)), residual

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        check(x.dim() == 2, f"x: expected [T, K] rows, got shape {tuple(x.shape)}")
        return invariant_matmul.matmul(x, weight, bias, pdl=self._row_pdl(x), partials=self.split_k)

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return invariant_matmul.matmul(x, weight, bias, pdl=self._row_pdl(x))

    def act_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        check(gate_up.dim() == 2, f"gate_up: expected [T, 2I] rows, got shape {tuple(gate_up.shape)}")
        return invariant_matmul.matmul(gate_up, weight, prologue=invariant_matmul.PROLOGUE_SILU_MUL,
                                       pdl=self._row_pdl(gate_up), partials=self.split_k)  # fmt: skip

    def attention(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  layer: AttentionLayer) -> torch.Tensor:  # fmt: skip
        """Decode and prefill alike: q/k norm, rotary + K/V write (one program per token), then the invariant
        attention reading every key, the new one included, from the cache."""
        if layer.sinks is not None or layer.sliding_window is not None:
            raise ValueError("InvariantTritonOps.attention: attention sinks and sliding windows have no "
                             "batch-invariant kernel; use TritonOps for such a layer")  # fmt: skip
        tokens = qkv.shape[0]
        pdl = self._row_pdl(qkv)
        q, k, v = split_qkv(qkv, layer)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = norm.rms_norm(_rows(q), layer.q_norm, layer.norm_eps).view(q.shape)
            k = norm.rms_norm(_rows(k), layer.k_norm, layer.norm_eps).view(k.shape)
        if meta.is_decode and layer.head_dim == next_pow2(layer.head_dim):  # rotary inside the split launch
            return invariant_attention.decode_attention_rotary(
                q, k, v, meta.positions, meta.cos, meta.sin, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                layer.scale, max_seq_len=meta.max_seq_len, num_programs=meta.num_splits, pdl=pdl,
            ).view(tokens, layer.q_size)  # fmt: skip
        q, _ = rotary.rotary_and_store_kv(q, k, v, meta.positions, meta.cos, meta.sin, k_cache, v_cache,
                                          meta.slot_mapping, pdl=pdl)  # fmt: skip
        out = invariant_attention.paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, layer.scale,
            max_q_len=meta.max_q_len, max_seq_len=meta.max_seq_len, positions=meta.positions,
            num_programs=meta.num_splits, pdl=pdl,
        )  # fmt: skip
        return out.view(tokens, layer.q_size)

    def moe(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
            router_weight: torch.Tensor, router_bias: torch.Tensor | None, experts: MoEWeights, top_k: int
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        raise ValueError("InvariantTritonOps.moe: mixture-of-experts layers have no batch-invariant kernel; use "
                         "TritonOps (EngineConfig.resolved refuses such a model in the deterministic mode)")
