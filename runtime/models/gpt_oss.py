"""gpt-oss (OpenAI's gpt-oss-20b / -120b): attention with per-head sinks on alternating sliding-window and full
layers, YaRN rope, and a mixture-of-experts MLP whose experts may stay MXFP4-packed in memory.

HF reference: transformers/models/gpt_oss/modeling_gpt_oss.py. Parameters keep HF's names, with q/k/v packed into
one matrix as in models/llama.py. The experts are stored with output rows first ([E, N, K], the orientation of
the published MXFP4 blocks): the float checkpoint's [E, K, N] tensors are transposed once at load. With
`quantization == "mxfp4"` the experts hold the checkpoint's `*_blocks` / `*_scales` bytes as they are, and the
kernels dequantize tiles in registers; the whole expert set is never dequantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from envex.kernels import mxfp4
from envex.kernels.ops import MOE, SINKS, SLIDING_WINDOW, AttentionLayer, AttentionMetadata, MoEWeights, Ops
from envex.runtime.config import ModelConfig
from envex.runtime.models.decoder import DecoderStack, param

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# HF name within a layer -> our attribute (and the qkv shard for q/k/v).
_QKV = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
_DIRECT = {
    "input_layernorm.weight": "input_layernorm_weight",
    "post_attention_layernorm.weight": "post_attention_layernorm_weight",
    "self_attn.o_proj.weight": "o_proj_weight",
    "self_attn.o_proj.bias": "o_proj_bias",
    "self_attn.sinks": "sinks",
    "mlp.router.weight": "router_weight",
    "mlp.router.bias": "router_bias",
    "mlp.experts.gate_up_proj_bias": "gate_up_proj_bias",
    "mlp.experts.down_proj_bias": "down_proj_bias",
    "mlp.experts.gate_up_proj_blocks": "gate_up_proj_blocks",
    "mlp.experts.gate_up_proj_scales": "gate_up_proj_scales",
    "mlp.experts.down_proj_blocks": "down_proj_blocks",
    "mlp.experts.down_proj_scales": "down_proj_scales",
}
# The float checkpoint's experts are [E, in, out] (HF multiplies x @ W); ours are [E, out, in].
_TRANSPOSED = {"mlp.experts.gate_up_proj": "gate_up_proj", "mlp.experts.down_proj": "down_proj"}


class GptOssLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        assert c.moe is not None, "gpt-oss configs carry their MoE fields (ModelConfig.from_hf)"
        h, e, inter = c.hidden_size, c.moe.num_experts, c.intermediate_size
        self.eps = c.rms_norm_eps
        self.top_k = c.moe.top_k
        self.input_layernorm_weight = param(h, dtype=dtype, device=device)
        self.post_attention_layernorm_weight = param(h, dtype=dtype, device=device)
        qkv_out = c.q_size + 2 * c.kv_size
        self.qkv_proj_weight = param(qkv_out, h, dtype=dtype, device=device)
        self.qkv_proj_bias = param(qkv_out, dtype=dtype, device=device)
        self.o_proj_weight = param(h, c.q_size, dtype=dtype, device=device)
        self.o_proj_bias = param(h, dtype=dtype, device=device)
        self.sinks = param(c.num_attention_heads, dtype=dtype, device=device)
        self.router_weight = param(e, h, dtype=dtype, device=device)
        self.router_bias = param(e, dtype=dtype, device=device)
        self.gate_up_proj_bias = param(e, 2 * inter, dtype=dtype, device=device)
        self.down_proj_bias = param(e, h, dtype=dtype, device=device)
        if c.quantization == "mxfp4":
            u8 = torch.uint8
            g = mxfp4.GROUP
            self.gate_up_proj_blocks = param(e, 2 * inter, h // g, g // 2, dtype=u8, device=device)
            self.gate_up_proj_scales = param(e, 2 * inter, h // g, dtype=u8, device=device)
            self.down_proj_blocks = param(e, h, inter // g, g // 2, dtype=u8, device=device)
            self.down_proj_scales = param(e, h, inter // g, dtype=u8, device=device)
            self.experts = MoEWeights(
                gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                gate_up_blocks=self.gate_up_proj_blocks, gate_up_scales=self.gate_up_proj_scales,
                down_blocks=self.down_proj_blocks, down_scales=self.down_proj_scales,
                alpha=c.moe.swiglu_alpha, limit=c.moe.swiglu_limit,
            )  # fmt: skip
        else:
            self.gate_up_proj = param(e, 2 * inter, h, dtype=dtype, device=device)
            self.down_proj = param(e, h, inter, dtype=dtype, device=device)
            self.experts = MoEWeights(gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                                      gate_up=self.gate_up_proj, down=self.down_proj, alpha=c.moe.swiglu_alpha,
                                      limit=c.moe.swiglu_limit)  # fmt: skip
        window = c.layer_windows[index] if c.layer_windows else None
        self.attn = AttentionLayer(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                   head_dim=c.head_dim, scale=c.head_dim**-0.5, sinks=self.sinks,
                                   sliding_window=window)  # fmt: skip

    def forward(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden, residual [T, H] -> the MoE output and the residual stream before it (added by the next norm)."""
        qkv, residual = ops.norm_linear(hidden, residual, self.input_layernorm_weight, self.eps,
                                        self.qkv_proj_weight, self.qkv_proj_bias)  # [T, q + 2kv]
        if self.attn.sliding_window is not None and meta.window is not None:
            meta = meta.window  # this layer's K/V live in the window pool (runtime/engine/caches/window_kv.py)
        attn = ops.attention(qkv, *kv_cache, meta, self.attn)  # [T, q]
        hidden = ops.linear(attn, self.o_proj_weight, self.o_proj_bias)
        return ops.moe(hidden, residual, self.post_attention_layernorm_weight, self.eps, self.router_weight,
                       self.router_bias, self.experts, self.top_k)  # fmt: skip


class GptOssForCausalLM(DecoderStack, nn.Module):
    features = frozenset({MOE, SINKS, SLIDING_WINDOW})  # what the layers need of a backend (kernels/ops.py)

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if config.tie_word_embeddings:
            raise ValueError("config.json: gpt-oss has an untied LM head; tie_word_embeddings must be false")
        self.init_stack(config, GptOssLayer, dtype, device)  # untied, as checked above

    # ---- loading -------------------------------------------------------------------------------------------

    def _checkpoint_target(self, name: str) -> tuple[torch.Tensor, bool]:
        """Our tensor (a view for a q/k/v shard) for an HF name, and whether the HF tensor is its transpose."""
        c = self.config
        top = {"model.embed_tokens.weight": self.embed_tokens_weight, "model.norm.weight": self.norm_weight,
               "lm_head.weight": self.lm_head_weight}  # fmt: skip
        if name in top:
            return top[name], False
        m = _LAYER.fullmatch(name)
        if m is not None and int(m.group(1)) < len(self.layers):
            layer, rest = self.layers[int(m.group(1))], m.group(2)
            module, _, kind = rest.rpartition(".")
            if module in _QKV and kind in ("weight", "bias"):
                sizes = [c.q_size, c.kv_size, c.kv_size]
                start = sum(sizes[: _QKV[module]])
                whole = layer.qkv_proj_weight if kind == "weight" else layer.qkv_proj_bias
                return whole[start : start + sizes[_QKV[module]]], False
            attr = _DIRECT.get(rest) or _TRANSPOSED.get(rest)
            target = getattr(layer, attr, None) if attr else None
            if isinstance(target, torch.Tensor):
                return target, rest in _TRANSPOSED
            if rest.endswith(("_blocks", "_scales")) or rest in _TRANSPOSED:
                have = "MXFP4-packed" if rest.endswith(("_blocks", "_scales")) else "unquantized"
                want = "quantization_config mxfp4" if c.quantization == "mxfp4" else "no quantization_config"
                raise ValueError(f"weights: {name!r} holds {have} experts but config.json has {want}; the "
                                 "checkpoint and its config.json disagree")  # fmt: skip
        raise ValueError(f"weights: unexpected tensor {name!r} for {c.architecture}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model; every parameter must be written exactly once. MXFP4 blocks are
        copied as bytes (a [E, N, K/2] checkpoint layout is accepted as well as [E, N, K/32, 16])."""
        seen: set[str] = set()
        for name, tensor in weights:
            target, transposed = self._checkpoint_target(name)
            if transposed:
                tensor = tensor.transpose(-1, -2)
            elif target.dtype == torch.uint8 and tensor.shape != target.shape and tensor.numel() == target.numel():
                tensor = tensor.reshape(target.shape)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                                 + (" (transposed)" if transposed else ""))  # fmt: skip
            if (target.dtype == torch.uint8) != (tensor.dtype == torch.uint8):
                raise ValueError(f"weights: {name!r} has dtype {tensor.dtype}, expected {target.dtype}")
            target.copy_(tensor)
            seen.add(name)
        self.check_complete(seen)

    def expected_weight_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        experts = (["gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"]
                   if self.config.quantization == "mxfp4" else ["gate_up_proj", "down_proj"])  # fmt: skip
        per_layer = [f"self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")]
        per_layer += ["self_attn.sinks", "mlp.router.weight", "mlp.router.bias", "input_layernorm.weight",
                      "post_attention_layernorm.weight", "mlp.experts.gate_up_proj_bias",
                      "mlp.experts.down_proj_bias"] + [f"mlp.experts.{p}" for p in experts]  # fmt: skip
        for i in range(self.config.num_hidden_layers):
            names.update(f"model.layers.{i}.{p}" for p in per_layer)
        return names
