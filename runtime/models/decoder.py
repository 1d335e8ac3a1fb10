"""What every decoder-only model file shares above its layers: embed, run the layers, final norm + LM head.

A model class mixes `DecoderStack` in and owns `embed_tokens_weight`, `layers` (each called as
`layer(ops, hidden, residual, kv_cache, meta) -> (hidden, residual)`, the residual added by the next norm),
`norm_weight`, `lm_head_weight` and `config`. models/llama.py keeps its own (it embeds a vocabulary shard under
tensor parallelism and gathers the logits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from envex.kernels import quant, reference
from envex.kernels.ops import AttentionMetadata, LayerKVCache, Ops
from envex.runtime.config import ModelConfig, MoEConfig


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter (weights are copied in by load_weights or dummy_weights)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def expert_stacks(layer: nn.Module, experts: int, inter: int, hidden: int, *, dtype: torch.dtype,
                  device: torch.device, fp8_block: tuple[int, int] | None = None,
                  int4: MoEConfig | None = None) -> dict[str, Any]:  # fmt: skip
    """Give an MoE layer its expert stacks, gate_up_proj [E, 2I, H] (rows gate_0, up_0, gate_1, ...) and down_proj
    [E, H, I]: in dtype, or with fp8_block (MoEConfig.fp8_layers) float8_e4m3fn as the checkpoint stores them, with
    their float32 block scales gate_up_proj_scale and down_proj_scale (kernels.quant.FP8BlockStack's layout), or
    with int4 (the MoEConfig of a layer in int4_layers) int32 words [E, 2I, H/8] / [E, H, I/8] with their group
    scales gate_up_proj_scale / down_proj_scale (int4_scale_dtype or dtype) and, int4_zero, uint8 zero points
    gate_up_proj_zero / down_proj_zero (kernels.quant.Int4GroupStack's layout). Returns them as MoEWeights' fields."""
    if int4 is not None:
        g = int4.int4_group
        sdt = getattr(torch, int4.int4_scale_dtype) if int4.int4_scale_dtype else dtype
        layer.gate_up_proj = param(experts, 2 * inter, hidden // 8, dtype=torch.int32, device=device)
        layer.down_proj = param(experts, hidden, inter // 8, dtype=torch.int32, device=device)
        layer.gate_up_proj_scale = param(experts, 2 * inter, -(-hidden // g), dtype=sdt, device=device)
        layer.down_proj_scale = param(experts, hidden, -(-inter // g), dtype=sdt, device=device)
        out: dict[str, Any] = dict(gate_up=layer.gate_up_proj, down=layer.down_proj,
                                   gate_up_scale=layer.gate_up_proj_scale, down_scale=layer.down_proj_scale, group=g)
        if int4.int4_zero:
            layer.gate_up_proj_zero = param(experts, 2 * inter, -(-hidden // g), dtype=torch.uint8, device=device)
            layer.down_proj_zero = param(experts, hidden, -(-inter // g), dtype=torch.uint8, device=device)
            out.update(gate_up_zero=layer.gate_up_proj_zero, down_zero=layer.down_proj_zero)
        return out
    if fp8_block is None:
        layer.gate_up_proj = param(experts, 2 * inter, hidden, dtype=dtype, device=device)
        layer.down_proj = param(experts, hidden, inter, dtype=dtype, device=device)
        return dict(gate_up=layer.gate_up_proj, down=layer.down_proj)
    bn, bk = fp8_block
    layer.gate_up_proj = param(experts, 2 * inter, hidden, dtype=quant.FP8_DTYPE, device=device)
    layer.down_proj = param(experts, hidden, inter, dtype=quant.FP8_DTYPE, device=device)
    layer.gate_up_proj_scale = param(experts, 2 * -(-inter // bn), -(-hidden // bk), dtype=torch.float32, device=device)
    layer.down_proj_scale = param(experts, -(-hidden // bn), -(-inter // bk), dtype=torch.float32, device=device)
    return dict(gate_up=layer.gate_up_proj, down=layer.down_proj, gate_up_scale=layer.gate_up_proj_scale,
                down_scale=layer.down_proj_scale, block=fp8_block)  # fmt: skip


# An INT4 expert's tensors as runtime/packed_load.load_dequantized hands them over (each expert's matrix in the
# internal int4_group layout, whatever the checkpoint's packing): suffix -> the stack's attribute suffix.
INT4_EXPERT_SUFFIXES = {"weight_packed": "", "weight_scale": "_scale", "weight_zero": "_zero"}


def int4_expert_names(weights: list[str], zero: bool) -> list[str]:
    """The names an INT4 layer's experts load under, for their `...weight` names (INT4_EXPERT_SUFFIXES)."""
    suffixes = [n for n in INT4_EXPERT_SUFFIXES if zero or n != "weight_zero"]
    return [f"{w.removesuffix('weight')}{s}" for w in weights for s in suffixes]


def expert_tensor(layer: nn.Module, proj: str, suffix: str) -> torch.Tensor | None:
    """The stack a checkpoint's expert tensor `...{proj}_proj.{suffix}` goes into: gate_up_proj or down_proj
    ("weight"), or their block scales ("weight_scale_inv", FP8 experts only; None for float ones), or for INT4
    experts their words, group scales and zeros (INT4_EXPERT_SUFFIXES). An expert's slice of a scale stack is taken
    as of the weight stack (the scale rows interleave gate and up as the rows)."""
    name = "down_proj" if proj == "down" else "gate_up_proj"
    words = getattr(layer, name, None)
    if words is not None and words.dtype == torch.int32:
        return getattr(layer, name + INT4_EXPERT_SUFFIXES[suffix], None) if suffix in INT4_EXPERT_SUFFIXES else None
    if suffix not in ("weight", "weight_scale_inv"):
        return None
    return getattr(layer, name if suffix == "weight" else f"{name}_scale", None)


def mtp_input(ops: Ops, embeds: torch.Tensor, hidden: torch.Tensor, embed_norm: torch.Tensor,
              hidden_norm: torch.Tensor, proj: torch.Tensor, eps: float) -> torch.Tensor:  # fmt: skip
    """A multi-token-prediction module's input to its decoder layer, proj([norm(embeds); norm(hidden)]) [T, H]
    (DeepSeek's eh_proj, Qwen3-Next's fc), with proj [2, H, H] the [H, 2H] matrix's two column halves (the
    embedding's first): one norm_linear each."""
    emb = ops.norm_linear(embeds, None, embed_norm, eps, proj[0])[0]
    prev = ops.norm_linear(hidden, None, hidden_norm, eps, proj[1])[0]
    return ops.materialize(emb, hidden.dtype) + ops.materialize(prev, hidden.dtype)


def mtp_logits(ops: Ops, hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, head: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A multi-token-prediction module's output rows -> (logits [N, V] through its norm and head, its own state
    after that norm [N, H]: what the next draft step chains on, as transformers' MtpLayer returns it)."""
    logits, summed = ops.norm_linear(hidden, residual, norm_weight, eps, head)
    return logits, reference.rms_norm(summed, norm_weight, eps)


class DecoderStack:
    embed_tokens_weight: torch.Tensor
    norm_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    layers: torch.nn.ModuleList
    config: ModelConfig

    def init_stack(self, config: ModelConfig, make_layer: Callable[[ModelConfig, int, torch.dtype, torch.device],
                   nn.Module], dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        """The parameters every stack holds, in this order: the embedding table, the layers
        (make_layer(config, index, dtype, device)), the final norm and the LM head (the embedding table when tied).
        Called from the model's __init__ after nn.Module's."""
        self.config = config
        self.embed_tokens_weight = param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(make_layer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm_weight = param(config.hidden_size, dtype=dtype, device=device)
        self.lm_head_weight = (
            self.embed_tokens_weight if config.tie_word_embeddings
            else param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )  # fmt: skip

    def forward(self, ops: Ops, input_ids: torch.Tensor, kv_caches: list[LayerKVCache],
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

    def final_hidden(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last hidden states after the final norm [T, H] (HF's hidden_states[-1]): what an MTP module reads
        (as transformers' MTP generation, vLLM and SGLang feed it). Taken before compute_logits, which may update
        the residual in place."""
        summed = ops.materialize(hidden, residual.dtype) + residual
        return reference.rms_norm(summed, self.norm_weight, self.config.rms_norm_eps)

    # ---- loading ---------------------------------------------------------------------------------------------

    def _target(self, name: str) -> torch.Tensor | tuple[torch.Tensor, tuple[int, ...]] | None:
        """Our tensor (a view for a packed shard) for an HF name, or (tensor, the checkpoint's shape of it) where
        the two differ; None for a tensor that is not stored (a tied LM head's copy). Raises for an unknown name."""
        raise NotImplementedError

    def expected_weight_names(self) -> set[str]:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model; every parameter must be written exactly once."""
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            found = self._target(name)
            if found is None:
                continue
            target, stored = found if isinstance(found, tuple) else (found, tuple(found.shape))
            if tuple(tensor.shape) != stored:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {stored}")
            target.copy_(tensor.reshape(target.shape))
            seen.add(name)
        self.check_complete(seen)

    def check_complete(self, seen: set[str]) -> None:
        """Refuse a checkpoint that left any expected tensor unwritten."""
        missing = sorted(self.expected_weight_names() - seen)
        if missing:
            raise ValueError(
                f"weights: {len(missing)} tensors missing, e.g. {missing[:3]}; the checkpoint is incomplete"
            )
