"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2): one file, switched by the config.

Parameters keep HF's names, except that q/k/v and gate/up are packed into one matrix each (one matmul instead
of three or two); `packed_modules` maps the HF names onto their shard, so weights load by name with no
conversion step.

Under tensor parallelism (a ParallelState of W ranks) each rank holds its Megatron shard, cut from the HF tensors
as they load (`_rank_slice`; the rules are in runtime/parallel/state.py): its query and KV heads, its part of the
MLP, the matching input columns of O and down, and its range of the vocabulary. The forward is the same; the norms
reduce the partial sums (`comm`) and the LM head's logits are gathered.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from envex.kernels.ops import AttentionLayer, AttentionMetadata, LayerKVCache, Ops
from envex.runtime.config import ModelConfig
from envex.runtime.models.rope import rope_cos_sin
from envex.runtime.parallel.state import ParallelState

__all__ = ["LlamaForCausalLM", "rope_cos_sin"]  # rope_cos_sin lives in models/rope.py, shared by every model


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, parallel: ParallelState) -> None:
        super().__init__()
        c, p = config, parallel
        self.eps = c.rms_norm_eps
        heads, kv_heads, inter = p.heads(c), p.kv_heads(c), p.intermediate(c)  # this rank's share
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        qkv_out = q_size + 2 * kv_size
        self.input_layernorm_weight = _param(c.hidden_size, dtype=dtype, device=device)
        self.post_attention_layernorm_weight = _param(c.hidden_size, dtype=dtype, device=device)
        self.qkv_proj_weight = _param(qkv_out, c.hidden_size, dtype=dtype, device=device)
        self.qkv_proj_bias = _param(qkv_out, dtype=dtype, device=device) if c.attention_bias else None
        self.o_proj_weight = _param(c.hidden_size, q_size, dtype=dtype, device=device)
        self.q_norm_weight = _param(c.head_dim, dtype=dtype, device=device) if c.qk_norm else None
        self.k_norm_weight = _param(c.head_dim, dtype=dtype, device=device) if c.qk_norm else None
        self.gate_up_proj_weight = _param(2 * inter, c.hidden_size, dtype=dtype, device=device)
        self.down_proj_weight = _param(c.hidden_size, inter, dtype=dtype, device=device)
        self.attn = AttentionLayer(num_heads=heads, num_kv_heads=kv_heads, head_dim=c.head_dim,
                                   scale=c.head_dim**-0.5, q_norm=self.q_norm_weight, k_norm=self.k_norm_weight,
                                   norm_eps=c.rms_norm_eps)  # fmt: skip
        # O and down give partial sums under tensor parallelism: the next norm reduces them.
        self.comm = p.comm if p.world_size > 1 else None

    def forward(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: LayerKVCache, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden, residual [T, H] -> the MLP output and the residual stream before it (added by the next norm)."""
        qkv, residual = ops.norm_linear(hidden, residual, self.input_layernorm_weight, self.eps,
                                        self.qkv_proj_weight, self.qkv_proj_bias, comm=self.comm)  # [T, q + 2kv]
        attn = ops.attention(qkv, *kv_cache, meta, self.attn)  # [T, q]
        hidden = ops.linear(attn, self.o_proj_weight)
        gate_up, residual = ops.norm_linear(hidden, residual, self.post_attention_layernorm_weight, self.eps,
                                            self.gate_up_proj_weight, comm=self.comm)  # [T, 2I]
        return ops.act_linear(gate_up, self.down_proj_weight), residual


class LlamaForCausalLM(nn.Module):
    # What the layers need of a backend beyond the base entry points (kernels/ops.py FEATURES): nothing. A model
    # with a sliding window is served within it (config.model_window), so it needs no window kernels.
    features: frozenset[str] = frozenset()
    # HF name -> (our packed parameter, shard index); shard order is the order of the packed rows.
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState | None = None) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.parallel = p = parallel or ParallelState()
        self.comm = p.comm if p.world_size > 1 else None
        vocab = p.vocab_rows(config)  # this rank's vocabulary rows (all of them on one rank)
        self.embed_tokens_weight = _param(vocab, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaLayer(config, dtype, device, p) for _ in range(config.num_hidden_layers))
        self.norm_weight = _param(config.hidden_size, dtype=dtype, device=device)
        self.lm_head_weight = (
            self.embed_tokens_weight if config.tie_word_embeddings
            else _param(vocab, config.hidden_size, dtype=dtype, device=device)
        )

    def forward(self, ops: Ops, input_ids: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """input_ids [T] -> (hidden, residual) [T, H] after the last layer, before the final norm; compute_logits
        takes the rows that need logits."""
        hidden = self._embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(ops, hidden, residual, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return hidden, residual

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, H]; under tensor parallelism zeros for ids outside this rank's rows (a partial sum that the
        first norm reduces)."""
        if self.comm is None:
            return self.embed_tokens_weight[input_ids]
        rows = self.embed_tokens_weight.shape[0]
        local = input_ids - self.parallel.vocab_start(self.config)
        mine = (local >= 0) & (local < rows)
        hidden = self.embed_tokens_weight[local.clamp(0, rows - 1)]
        return torch.where(mine[:, None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))

    def compute_logits(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given rows -> logits [N, V] in the model's dtype."""
        logits = ops.norm_linear(hidden, residual, self.norm_weight, self.config.rms_norm_eps, self.lm_head_weight,
                                 comm=self.comm)[0]  # fmt: skip
        if self.comm is None:
            return logits
        return self.comm.all_gather(logits)[:, : self.config.vocab_size]  # [N, W * V/W] less the padding rows

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
        c, p = self.config, self.parallel
        if module == "qkv_proj":
            kv = p.kv_heads(c) * c.head_dim
            sizes = [p.heads(c) * c.head_dim, kv, kv]
        else:
            sizes = [p.intermediate(c), p.intermediate(c)]
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
            tensor = self._rank_slice(name, tensor)
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

    def _rank_slice(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of an HF tensor (the whole tensor on one rank)."""
        c, p = self.config, self.parallel
        if p.world_size == 1:
            return tensor
        d = c.head_dim
        module = hf_name.split(".")[-2]
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows, start = p.vocab_rows(c), p.vocab_start(c)
            part = tensor[start : start + rows]
            if part.shape[0] < rows:  # the last rank's padding rows: zero, their logits are cut off
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
            return part
        if module == "q_proj":  # column-parallel by head (weight rows, and the bias)
            return tensor.narrow(0, p.rank * p.heads(c) * d, p.heads(c) * d)
        if module in ("k_proj", "v_proj"):
            return tensor.narrow(0, p.kv_head_start(c) * d, p.kv_heads(c) * d)
        if module in ("gate_proj", "up_proj"):
            return tensor.narrow(0, p.rank * p.intermediate(c), p.intermediate(c))
        if module == "o_proj":  # row-parallel: the input columns of this rank's heads
            return tensor.narrow(1, p.rank * p.heads(c) * d, p.heads(c) * d)
        if module == "down_proj":
            return tensor.narrow(1, p.rank * p.intermediate(c), p.intermediate(c))
        return tensor  # norms: replicated

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
