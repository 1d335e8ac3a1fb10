"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (GQA, per-head q/k RMSNorm) and, in every layer
but the dense ones (ModelConfig.moe.dense_layers: mlp_only_layers, decoder_sparse_step), a routed MoE: router
logits without bias, softmax, top-k, renormalised when norm_topk_prob; each expert down(silu(gate(x)) · up(x)),
no biases, no shared expert.

HF reference: transformers/models/qwen3_moe/modeling_qwen3_moe.py. Parameters keep HF's names, with q/k/v packed
into one matrix as in models/llama.py. The published checkpoint holds each expert as its own
`mlp.experts.E.{gate,up,down}_proj.weight` ([out, in], HF's nn.Linear): they load into one stack a layer, gate and
up rows interleaved (gate_0, up_0, gate_1, ...), the layout `Ops.moe` takes (kernels/ops.py MoEWeights). An FP8
release (Qwen3-30B-A3B-FP8: quantization_config "fp8", 128 x 128 blocks) keeps its experts so: FP8 stacks beside
their `weight_scale_inv` block scales, interleaved alike (MoEConfig.fp8_layers; runtime/packed_load.py dequantizes
its other projections at load). An INT4 release (compressed-tensors pack-quantized, AWQ) keeps its experts as
int32 words with group scales and zeros (MoEConfig.int4_layers; kernels.quant.Int4GroupStack's layout), converted
at load by runtime/packed_load.py.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from envex.kernels.ops import MOE, AttentionLayer, AttentionMetadata, MoEWeights, Ops
from envex.runtime.config import ModelConfig
from envex.runtime.models.decoder import DecoderStack, expert_stacks, expert_tensor, int4_expert_names, param

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv|weight_packed|weight_scale|"
                     r"weight_zero)")
_QKV = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
# HF name within a layer -> our attribute
_DIRECT = {
    "input_layernorm.weight": "input_layernorm_weight",
    "post_attention_layernorm.weight": "post_attention_layernorm_weight",
    "self_attn.o_proj.weight": "o_proj_weight",
    "self_attn.q_norm.weight": "q_norm_weight",
    "self_attn.k_norm.weight": "k_norm_weight",
    "mlp.gate.weight": "router_weight",
    "mlp.down_proj.weight": "down_proj_weight",
}
_DENSE_GATE_UP = {"mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 1}  # [gate | up], as models/llama.py packs it


class Qwen3MoeLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        assert c.moe is not None, "Qwen3-MoE configs carry their MoE fields (ModelConfig.from_hf)"
        h = c.hidden_size
        self.eps = c.rms_norm_eps
        self.top_k = c.moe.top_k
        self.input_layernorm_weight = param(h, dtype=dtype, device=device)
        self.post_attention_layernorm_weight = param(h, dtype=dtype, device=device)
        qkv_out = c.q_size + 2 * c.kv_size
        self.qkv_proj_weight = param(qkv_out, h, dtype=dtype, device=device)
        self.qkv_proj_bias = param(qkv_out, dtype=dtype, device=device) if c.attention_bias else None
        self.o_proj_weight = param(h, c.q_size, dtype=dtype, device=device)
        self.q_norm_weight = param(c.head_dim, dtype=dtype, device=device)
        self.k_norm_weight = param(c.head_dim, dtype=dtype, device=device)
        self.attn = AttentionLayer(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                   head_dim=c.head_dim, scale=c.head_dim**-0.5, q_norm=self.q_norm_weight,
                                   k_norm=self.k_norm_weight, norm_eps=c.rms_norm_eps)  # fmt: skip
        self.sparse = index not in c.moe.dense_layers
        self.experts: MoEWeights | None = None
        if self.sparse:
            e, inter = c.moe.num_experts, c.moe.intermediate_size
            self.router_weight = param(e, h, dtype=dtype, device=device)
            fp8 = c.moe.fp8_block if index in c.moe.fp8_layers else None  # FP8 experts, kept so
            int4 = c.moe if index in c.moe.int4_layers else None  # INT4 experts, kept so
            stacks = expert_stacks(self, e, inter, h, dtype=dtype, device=device, fp8_block=fp8, int4=int4)
            self.experts = MoEWeights(**stacks, activation="silu", renormalize=c.moe.norm_topk_prob)
        else:
            self.gate_up_proj_weight = param(2 * c.intermediate_size, h, dtype=dtype, device=device)
            self.down_proj_weight = param(h, c.intermediate_size, dtype=dtype, device=device)

    def forward(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden, residual [T, H] -> the MLP output and the residual stream before it (added by the next norm)."""
        qkv, residual = ops.norm_linear(hidden, residual, self.input_layernorm_weight, self.eps,
                                        self.qkv_proj_weight, self.qkv_proj_bias)  # [T, q + 2kv]
        attn = ops.attention(qkv, *kv_cache, meta, self.attn)  # [T, q]
        hidden = ops.linear(attn, self.o_proj_weight)
        if self.experts is not None:
            return ops.moe(hidden, residual, self.post_attention_layernorm_weight, self.eps, self.router_weight,
                           None, self.experts, self.top_k)  # fmt: skip
        gate_up, residual = ops.norm_linear(hidden, residual, self.post_attention_layernorm_weight, self.eps,
                                            self.gate_up_proj_weight)  # [T, 2I]
        return ops.act_linear(gate_up, self.down_proj_weight), residual


class Qwen3MoeForCausalLM(DecoderStack, nn.Module):
    features = frozenset({MOE})  # what the layers need of a backend (kernels/ops.py)

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.init_stack(config, Qwen3MoeLayer, dtype, device)

    # ---- loading -------------------------------------------------------------------------------------------

    def _target(self, name: str) -> torch.Tensor | None:
        """Our tensor (a view for a packed shard) for an HF name; None for a tied LM head's copy."""
        c = self.config
        if name == "lm_head.weight" and c.tie_word_embeddings:
            return None
        top = {"model.embed_tokens.weight": self.embed_tokens_weight, "model.norm.weight": self.norm_weight,
               "lm_head.weight": self.lm_head_weight}  # fmt: skip
        if name in top:
            return top[name]
        m = _LAYER.fullmatch(name)
        if m is not None and int(m.group(1)) < len(self.layers):
            layer, rest = self.layers[int(m.group(1))], m.group(2)
            module, _, kind = rest.rpartition(".")
            if module in _QKV and (kind == "weight" or kind == "bias" and c.attention_bias):
                sizes = [c.q_size, c.kv_size, c.kv_size]
                start = sum(sizes[: _QKV[module]])
                whole = layer.qkv_proj_weight if kind == "weight" else layer.qkv_proj_bias
                return whole[start : start + sizes[_QKV[module]]]
            expert = _EXPERT.fullmatch(rest)
            stack = expert_tensor(layer, expert.group(2), expert.group(3)) if layer.sparse and expert else None
            if expert is not None and stack is not None and int(expert.group(1)) < stack.shape[0]:
                e, proj = int(expert.group(1)), expert.group(2)
                return stack[e] if proj == "down" else stack[e, (proj == "up") :: 2]
            if not layer.sparse and rest in _DENSE_GATE_UP:
                inter = c.intermediate_size
                return layer.gate_up_proj_weight[_DENSE_GATE_UP[rest] * inter : (_DENSE_GATE_UP[rest] + 1) * inter]
            target = getattr(layer, _DIRECT.get(rest, ""), None)
            if isinstance(target, torch.Tensor):
                return target
        raise ValueError(f"weights: unexpected tensor {name!r} for {c.architecture} (dense layers: "
                         f"{list(c.moe.dense_layers) if c.moe else []})")  # fmt: skip

    def expected_weight_names(self) -> set[str]:
        c = self.config
        assert c.moe is not None
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        attention = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight",
                     "self_attn.k_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
        if c.attention_bias:
            attention += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        sparse = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight" for e in range(c.moe.num_experts)
                                        for p in ("gate", "up", "down")]  # fmt: skip
        scales = [f"{n}_scale_inv" for n in sparse[1:]]  # FP8 experts' block scales
        int4 = [sparse[0]] + int4_expert_names(sparse[1:], c.moe.int4_zero)
        dense = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        for i, layer in enumerate(self.layers):
            mlp = (sparse + scales if i in c.moe.fp8_layers else int4 if i in c.moe.int4_layers else sparse) \
                if layer.sparse else dense  # fmt: skip
            names.update(f"model.layers.{i}.{p}" for p in attention + mlp)
        return names
