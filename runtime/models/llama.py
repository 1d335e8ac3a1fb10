"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2): one file, switched by the config.

Parameters keep HF's names, except that q/k/v and gate/up are packed into one matrix each (one matmul instead
of three or two); `packed_modules` maps the HF names onto their shard, so weights load by name with no
conversion step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from envex.kernels.ops import AttentionLayer, AttentionMetadata, Ops
from envex.runtime.config import ModelConfig
from envex.runtime.models.rope import rope_cos_sin

__all__ = ["LlamaForCausalLM", "rope_cos_sin"]  # rope_cos_sin lives in models/rope.py, shared by every model


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        self.eps = c.rms_norm_eps
        qkv_out = c.q_size + 2 * c.kv_size
        self.input_layernorm_weight = _param(c.hidden_size, dtype=dtype, device=device)
        self.post_attention_layernorm_weight = _param(c.hidden_size, dtype=dtype, device=device)
        self.qkv_proj_weight = _param(qkv_out, c.hidden_size, dtype=dtype, device=device)
        self.qkv_proj_bias = _param(qkv_out, dtype=dtype, device=device) if c.attention_bias else None
        self.o_proj_weight = _param(c.hidden_size, c.q_size, dtype=dtype, device=device)
        self.q_norm_weight = _param(c.head_dim, dtype=dtype, device=device) if c.qk_norm else None
        self.k_norm_weight = _param(c.head_dim, dtype=dtype, device=device) if c.qk_norm else None
        self.gate_up_proj_weight = _param(2 * c.intermediate_size, c.hidden_size, dtype=dtype, device=device)
        self.down_proj_weight = _param(c.hidden_size, c.intermediate_size, dtype=dtype, device=device)
        self.attn = AttentionLayer(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                   head_dim=c.head_dim, scale=c.head_dim**-0.5, q_norm=self.q_norm_weight,
                                   k_norm=self.k_norm_weight, norm_eps=c.rms_norm_eps)  # fmt: skip

    def forward(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden, residual [T, H] -> the MLP output and the residual stream before it (added by the next norm)."""
        qkv, residual = ops.norm_linear(hidden, residual, self.input_layernorm_weight, self.eps,
                                        self.qkv_proj_weight, self.qkv_proj_bias)  # [T, q + 2kv]
        attn = ops.attention(qkv, *kv_cache, meta, self.attn)  # [T, q]
        hidden = ops.linear(attn, self.o_proj_weight)
        gate_up, residual = ops.norm_linear(hidden, residual, self.post_attention_layernorm_weight, self.eps,
                                            self.gate_up_proj_weight)  # [T, 2I]
        return ops.act_linear(gate_up, self.down_proj_weight), residual


class LlamaForCausalLM(nn.Module):
    # HF name -> (our packed parameter, shard index); shard order is the order of the packed rows.
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens_weight = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm_weight = _param(config.hidden_size, dtype=dtype, device=device)
        self.lm_head_weight = (
            self.embed_tokens_weight if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )

    def forward(self, ops: Ops, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """input_ids [T] -> (hidden, residual) [T, H] after the last layer, before the final norm; compute_logits
        takes the rows that need logits."""
        hidden = self.embed_tokens_weight[input_ids]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(ops, hidden, residual, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return hidden, residual

    def compute_logits(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given rows -> logits [N, V] in the model's dtype."""
        return ops.norm_linear(hidden, residual, self.norm_weight, self.config.rms_norm_eps, self.lm_head_weight)[0]

    # ---- loading -------------------------------------------------------------------------------------------

    def _target(self, hf_name: str) -> tuple[torch.Tensor, int | None] | None:
        """Our tensor for an HF parameter name, and the shard index if the HF tensor is one part of it."""
        c = self.config
        parts = hf_name.split(".")
        if hf_name == "model.embed_tokens.weight":
            return self.embed_tokens_weight, None
        if hf_name == "model.norm.weight":
            return self.norm_weight, None
        if hf_name == "lm_head.weight":
            return (None if c.tie_word_embeddings else (self.lm_head_weight, None))
        if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
            layer = self.layers[int(parts[2])]
            module, kind = parts[-2], parts[-1]
            shard = None
            if module in self.packed_modules:
                module, shard = self.packed_modules[module]
            attr = getattr(layer, f"{module}_{kind}", None)
            if isinstance(attr, torch.Tensor):
                return attr, shard
        return None

    def shard_slice(self, module: str, shard: int) -> slice:
        c = self.config
        if module == "qkv_proj":
            sizes = [c.q_size, c.kv_size, c.kv_size]
        else:
            sizes = [c.intermediate_size, c.intermediate_size]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model; every parameter must be written exactly once."""
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target = self._target(name)
            if target is None:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"weights: unexpected tensor {name!r} for {self.config.architecture}")
            param, shard = target
            if shard is not None:
                module = "qkv_proj" if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
                param = param[self.shard_slice(module, shard)]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.copy_(tensor)
            seen.add(name)
        expected = self.expected_weight_names()
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(
                f"weights: {len(missing)} tensors missing, e.g. {missing[:3]}; the checkpoint is incomplete"
            )

    def expected_weight_names(self) -> set[str]:
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"]
        if c.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if c.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        for i in range(c.num_hidden_layers):
            names.update(f"model.layers.{i}.{p}" for p in per_layer)
        return names
