"""What every decoder-only model file shares above its layers: embed, run the layers, final norm + LM head.

A model class mixes `DecoderStack` in and owns `embed_tokens_weight`, `layers` (each called as
`layer(ops, hidden, residual, kv_cache, meta) -> (hidden, residual)`, the residual added by the next norm),
`norm_weight`, `lm_head_weight` and `config`. models/llama.py keeps its own (it embeds a vocabulary shard under
tensor parallelism and gathers the logits).
"""

from __future__ import annotations

import torch

from envex.kernels.ops import AttentionMetadata, Ops
from envex.runtime.config import ModelConfig


class DecoderStack:
    embed_tokens_weight: torch.Tensor
    norm_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    layers: torch.nn.ModuleList
    config: ModelConfig

    def forward(self, ops: Ops, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """input_ids [T] -> (hidden, residual) [T, H] after the last layer, before the final norm."""
        hidden = self.embed_tokens_weight[input_ids]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(ops, hidden, residual, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return hidden, residual

    def compute_logits(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given rows -> logits [N, V] in the model's dtype."""
        return ops.norm_linear(hidden, residual, self.norm_weight, self.config.rms_norm_eps, self.lm_head_weight)[0]
