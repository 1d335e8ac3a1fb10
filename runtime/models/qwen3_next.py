"""Qwen3-Next (Qwen3-Next-80B-A3B): Gated DeltaNet (linear-attention) layers beside gated full-attention layers, in
the pattern of the config (layer_types, or every full_attention_interval-th layer full), and Qwen3-MoE's routed
experts plus a shared expert gated per token by sigmoid(shared_expert_gate(h)). offline_docs/hybrid.md.

- Gated DeltaNet: in_proj_qkvz and in_proj_ba load into one matrix, rows reordered from HF's per-key-head groups
  (fix_query_key_value_ordering) into [q | k | v | z | b | a], heads in order, so q|k|v are the convolution's
  channels; then `Ops.linear_attention` (conv1d + SiLU, gated delta rule, gated RMSNorm) and out_proj. Each layer's
  "cache" is its per-sequence state: (state_pool [slots, Hv, Dk, Dv] float32, conv_pool [slots, K-1, conv_dim]),
  picked by meta.state_slots (runtime/engine/caches/state_slots.py hands each running sequence one slot for its life).
- Gated attention: q_proj gives each head's query and its output gate; out = o_proj(attention · sigmoid(gate)).
  q/k RMSNorm, then rotary on the first rotary_dim dims of each head only (partial_rotary_factor). The attention
  ops rotate pairs (i, i + D/2) over the whole head: the q/k dims (and q/k norm weights) are permuted at load so
  that the rotary half-pairs sit at (i, i + D/2) for i < rotary_dim/2, and the model's own rotary tables carry
  cos 1, sin 0 on the other dims. q·k is unchanged by a permutation applied to both.
- Norms: HF's Qwen3NextRMSNorm multiplies by (1 + weight): loaded as 1 + weight (input/post-attention, final,
  q/k norms), so the shared RMSNorm ops apply them; the gated norm's weight is plain.
- MTP: the published checkpoints' `mtp.*` tensors are one more full-attention MoE layer behind an fc over
  [embedding; hidden state]: `Qwen3NextMTP`, built only when drafting with it (draft_model "mtp"); the model's
  loader skips them.

HF reference: transformers/models/qwen3_next/modeling_qwen3_next.py. The published checkpoint holds each expert as
`mlp.experts.E.{gate,up,down}_proj.weight`, loaded into interleaved gate/up stacks as in models/qwen3_moe.py. The FP8
release (Qwen3-Next-80B-A3B-Instruct-FP8: quantization_config "fp8", 128 x 128 blocks) is kept as stored, never
dequantized: its routed experts as FP8 stacks beside their `weight_scale_inv` block scales (MoEConfig.fp8_layers),
and in the layers HybridConfig.fp8_layers names (the MTP layer's index num_hidden_layers too) every other FP8
projection (in_proj_qkvz, out_proj, q/k/v/o, the shared expert's or dense MLP's) as a kernels.quant.PackedWeight
(fp8_block) over an FP8 codes parameter and its float32 scales (`_matrix`), all expected by name. The fused
matrices gather the checkpoint's rows by index (`_row_maps`), codes and scales alike (quant.put_rows): the
release's blocks where the rows move whole blocks, else one scale row a row (q/k/v's rotary permutation). The
release's float in_proj_ba and shared-expert gate are then matrices of their own, projected by a second norm_linear
from the same normed input (a bf16 model keeps them fused). The MTP module's fc is dequantized at load by
runtime/packed_load.py, as is a float neighbour stored FP8 (offline_docs/quantization.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from envex.kernels import quant
from envex.kernels.ops import (
    LINEAR_ATTENTION,
    MOE,
    AttentionLayer,
    AttentionMetadata,
    LinearAttentionLayer,
    MoEWeights,
    Ops,
)
from envex.runtime.config import ModelConfig, qwen3_next_projections
from envex.runtime.models.decoder import DecoderStack, expert_stacks, expert_tensor, mtp_input, mtp_logits, param
from envex.runtime.quant_config import FP8_DEEPSEEK, WeightScheme, load_packed

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)")  # float or FP8
MTP_PREFIX = "mtp."  # the published checkpoints' names of the MTP module's tensors
_ONE_PLUS = ("input_layernorm.weight", "post_attention_layernorm.weight")  # Qwen3NextRMSNorm: x·(1 + w)


def _checked(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """new dim i <- HF dim order[i]: HF's rotary half-pairs (j, j + r/2), j < r/2, moved to (j, j + D/2), the
    pass-through dims split over both halves after them."""
    r2, p2 = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(r2), torch.arange(rotary_dim, rotary_dim + p2), torch.arange(r2, rotary_dim),
                      torch.arange(rotary_dim + p2, head_dim)])  # fmt: skip


def partial_rotary_tables(config: ModelConfig, positions: int, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos/sin [positions, D/2] float32 for the permuted dims: HF's default RoPE over rotary_dim dims (its
    compute_default_rope_parameters), then cos 1 and sin 0 (no rotation) on the pass-through pairs."""
    assert config.hybrid is not None
    dim, half = config.hybrid.rotary_dim, config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, r/2]
    cos = torch.ones(positions, half, dtype=torch.float32)
    sin = torch.zeros(positions, half, dtype=torch.float32)
    cos[:, : dim // 2], sin[:, : dim // 2] = freqs.cos(), freqs.sin()
    return cos.to(device), sin.to(device)


class Qwen3NextLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c, hy, moe = config, config.hybrid, config.moe
        assert hy is not None and moe is not None, "Qwen3-Next configs carry hybrid and MoE fields (from_hf)"
        h = c.hidden_size
        self.eps = c.rms_norm_eps
        self.top_k = moe.top_k
        self.input_layernorm_weight = param(h, dtype=dtype, device=device)
        self.post_attention_layernorm_weight = param(h, dtype=dtype, device=device)
        self.linear = index in hy.linear_layers
        self.sparse = index not in moe.dense_layers
        # an FP8 release's projections (HybridConfig.fp8_layers): kept packed as stored, their float neighbours (the
        # release's float in_proj_ba and shared-expert gate) as matrices of their own
        self.fp8_block = moe.fp8_block if index in hy.fp8_layers else None
        self.fp8_pending: dict[str, dict[str, torch.Tensor]] = {}  # an FP8 projection's tensors until both came
        self.row_maps = _row_maps(c, self.linear, self.sparse, self.fp8_block is not None)
        if self.linear:
            qkvz, ba = hy.conv_dim + hy.value_dim, 2 * hy.num_v_heads
            # rows [q | k | v | z | b | a] (LinearAttentionLayer.split); FP8: [q | k | v | z], and [b | a] apart
            self.in_proj_weight = self._matrix("in_proj", qkvz + (0 if self.fp8_block else ba), h, dtype, device)
            self.in_proj_ba_weight = param(ba, h, dtype=dtype, device=device) if self.fp8_block else None
            # [conv_dim, K]: 2-D, but not a matrix of a projection; the CPU's column-major pass must leave it
            # alone, so it is kept as a view of a 3-D parameter
            self.conv1d_weight = param(hy.conv_dim, 1, hy.conv_width, dtype=dtype, device=device)
            self.A_log = param(hy.num_v_heads, dtype=dtype, device=device)
            self.dt_bias = param(hy.num_v_heads, dtype=dtype, device=device)
            self.gated_norm_weight = param(hy.head_v_dim, dtype=dtype, device=device)
            self.out_proj_weight = self._matrix("out_proj", h, hy.value_dim, dtype, device)
            self.mixer = LinearAttentionLayer(num_k_heads=hy.num_k_heads, num_v_heads=hy.num_v_heads,
                                              head_k_dim=hy.head_k_dim, head_v_dim=hy.head_v_dim,
                                              conv_weight=self.conv1d_weight[:, 0], a_log=self.A_log,
                                              dt_bias=self.dt_bias, norm_weight=self.gated_norm_weight,
                                              norm_eps=c.rms_norm_eps)  # fmt: skip
        else:
            self.qkv_size = c.q_size + 2 * c.kv_size
            # [q|k|v|gate]
            self.qkvg_proj_weight = self._matrix("qkvg_proj", self.qkv_size + c.q_size, h, dtype, device)
            self.q_norm_weight = param(c.head_dim, dtype=dtype, device=device)
            self.k_norm_weight = param(c.head_dim, dtype=dtype, device=device)
            self.o_proj_weight = self._matrix("o_proj", h, c.q_size, dtype, device)
            self.attn = AttentionLayer(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                       head_dim=c.head_dim, scale=c.head_dim**-0.5, q_norm=self.q_norm_weight,
                                       k_norm=self.k_norm_weight, norm_eps=c.rms_norm_eps)  # fmt: skip
        self.experts: MoEWeights | None = None
        if self.sparse:
            e, inter, shared = moe.num_experts, moe.intermediate_size, hy.shared_expert_size
            self.shared_size = shared
            self.router_weight = param(e, h, dtype=dtype, device=device)
            fp8 = moe.fp8_block if index in moe.fp8_layers else None  # an FP8 release's experts, kept so
            stacks = expert_stacks(self, e, inter, h, dtype=dtype, device=device, fp8_block=fp8)
            self.experts = MoEWeights(**stacks, activation="silu", renormalize=moe.norm_topk_prob)
            # the shared expert's [gate | up] and its one-row gate, from the same normed input (FP8: the gate apart)
            self.shared_proj_weight = self._matrix("shared_proj", 2 * shared + (0 if self.fp8_block else 1), h, dtype,
                                                   device)  # fmt: skip
            self.shared_gate_weight = param(1, h, dtype=dtype, device=device) if self.fp8_block else None
            self.shared_down_weight = self._matrix("shared_down", h, shared, dtype, device)
        else:
            self.gate_up_proj_weight = self._matrix("gate_up_proj", 2 * c.intermediate_size, h, dtype, device)
            self.down_proj_weight = self._matrix("down_proj", h, c.intermediate_size, dtype, device)

    def _matrix(self, name: str, n: int, k: int, dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor | quant.PackedWeight:  # fmt: skip
        """A projection's weight [n, k]: a float parameter, or in an FP8 layer a kernels.quant.PackedWeight over the
        parameters `name` (the FP8 codes [1, n, k]: 3-D, which the CPU's column-major pass leaves alone) and
        `name`_scale (float32), in the release's blocks where the rows it gathers from the checkpoint move whole
        blocks (quant.keeps_blocks), else with one scale row a row (block (1, bk)), as quant.put_rows fills it."""
        if self.fp8_block is None:
            return param(n, k, dtype=dtype, device=device)
        bn, bk = self.fp8_block
        attr = f"{name}_weight"
        if not all(quant.keeps_blocks(rows, bn) for target, rows in self.row_maps.values() if target == attr):
            bn = 1
        setattr(self, name, param(1, n, k, dtype=quant.FP8_DTYPE, device=device))
        setattr(self, f"{name}_scale", param(1, -(-n // bn), -(-k // bk), dtype=torch.float32, device=device))
        return quant.PackedWeight(scheme=quant.FP8_BLOCK, shape=(n, k), data=getattr(self, name)[0],
                                  scale=getattr(self, f"{name}_scale")[0], block=(bn, bk))  # fmt: skip

    def forward(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden, residual [T, H] -> the MLP output and the residual stream before it (added by the next norm).
        kv_cache: (K, V) pages for a full-attention layer; (state_pool, conv_pool) for a Gated DeltaNet layer."""
        if self.linear:
            mixed, residual = ops.norm_linear(hidden, residual, self.input_layernorm_weight, self.eps,
                                              self.in_proj_weight)  # [T, q|k|v|z|b|a]; FP8: [T, q|k|v|z]
            if self.in_proj_ba_weight is not None:  # FP8: b|a (float) on the same normed input, joined on
                ba, _ = ops.norm_linear(residual, None, self.input_layernorm_weight, self.eps, self.in_proj_ba_weight)
                mixed = torch.cat([mixed, ba], dim=1)  # [T, q|k|v|z|b|a]
            o = ops.linear_attention(mixed, kv_cache[0], kv_cache[1], meta, self.mixer)  # [T, Hv Dv]
            hidden = ops.linear(o, self.out_proj_weight)
        else:
            qkvg, residual = ops.norm_linear(hidden, residual, self.input_layernorm_weight, self.eps,
                                             self.qkvg_proj_weight)  # [T, q + 2kv + q]
            attn = ops.attention(qkvg[:, : self.qkv_size].contiguous(), *kv_cache, meta, self.attn)  # [T, q]
            hidden = ops.linear(attn * torch.sigmoid(qkvg[:, self.qkv_size :]), self.o_proj_weight)
        if self.experts is None:
            gate_up, residual = ops.norm_linear(hidden, residual, self.post_attention_layernorm_weight, self.eps,
                                                self.gate_up_proj_weight)  # [T, 2I]
            return ops.act_linear(gate_up, self.down_proj_weight), residual
        shared, residual = ops.norm_linear(hidden, residual, self.post_attention_layernorm_weight, self.eps,
                                           self.shared_proj_weight)  # [T, 2S + 1]; FP8: [T, 2S]
        gate = shared[:, 2 * self.shared_size :]  # [T, 1]
        if self.shared_gate_weight is not None:  # FP8: the gate (float) on the same normed input
            gate, _ = ops.norm_linear(residual, None, self.post_attention_layernorm_weight, self.eps,
                                      self.shared_gate_weight)  # fmt: skip
        routed, _ = ops.moe(residual, None, self.post_attention_layernorm_weight, self.eps, self.router_weight, None,
                            self.experts, self.top_k)  # fmt: skip
        dtype = residual.dtype
        shared_out = ops.materialize(ops.act_linear(shared[:, : 2 * self.shared_size].contiguous(),
                                                    self.shared_down_weight), dtype)  # fmt: skip
        return ops.materialize(routed, dtype) + torch.sigmoid(gate) * shared_out, residual


# ---- loading a layer's tensors (the model's layers and the MTP module's one) -----------------------------------------


def _put(name: str, target: torch.Tensor, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    target.copy_(_checked(name, tensor, shape).reshape(target.shape))


def _row_maps(c: ModelConfig, linear: bool, sparse: bool, fp8: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """Where each checkpoint matrix of a layer goes: HF module name (after the layer's prefix) -> (our matrix's
    attribute, our row of each of its rows). Gated DeltaNet: HF's in_proj_qkvz rows come in key-head groups
    [q_g | k_g | v_g | z_g] (v_g, z_g: the group's Hv/Hk value heads) and in_proj_ba's as [b_g | a_g]; ours are
    [q | k | v | z | b | a], heads in order ([b | a] a matrix of its own in an FP8 layer). Gated attention: HF's
    q_proj rows are each head's query then its gate; ours [q | k | v | gate], q and k rows permuted in each head
    for the partial rotary (rotary_order). Shared expert: [gate | up | shared_expert_gate's row] (FP8: the gate row
    apart). The rows as indices, so the FP8 codes and their scales follow them alike (quant.put_rows)."""
    hy = c.hybrid
    assert hy is not None
    h, d, ar = c.hidden_size, c.head_dim, torch.arange

    def grouped(groups: int, sizes: tuple[int, ...], starts: tuple[int, ...]) -> torch.Tensor:
        # per group g, part p's s rows to starts[p] + g·s + (0..s-1); [groups, Σ sizes] -> flat, HF's row order
        g = ar(groups)[:, None]
        return torch.cat([st + g * sz + ar(sz) for sz, st in zip(sizes, starts, strict=True)], dim=1).flatten()

    if linear:
        nk, dk, hv = hy.num_k_heads, hy.head_k_dim, hy.num_v_heads
        gv, kd, vd, g = hv // nk * hy.head_v_dim, hy.key_dim, hy.value_dim, hv // nk
        base, ba = (0, "in_proj_ba_weight") if fp8 else (hy.conv_dim + vd, "in_proj_weight")
        maps = {"linear_attn.in_proj_qkvz": ("in_proj_weight", grouped(nk, (dk, dk, gv, gv), (0, kd, 2 * kd,
                                                                                            2 * kd + vd))),
                "linear_attn.in_proj_ba": (ba, grouped(nk, (g, g), (base, base + hv))),
                "linear_attn.out_proj": ("out_proj_weight", ar(h))}  # fmt: skip
    else:
        q, kv = c.q_size, c.kv_size
        inv = torch.argsort(rotary_order(d, hy.rotary_dim))  # HF dim j of a head -> our dim inv[j]
        heads = ar(c.num_attention_heads)[:, None] * d
        maps = {"self_attn.q_proj": ("qkvg_proj_weight", torch.cat([heads + inv, q + 2 * kv + heads + ar(d)],
                                                                   dim=1).flatten()),
                "self_attn.k_proj": ("qkvg_proj_weight", (q + ar(c.num_key_value_heads)[:, None] * d + inv).flatten()),
                "self_attn.v_proj": ("qkvg_proj_weight", q + kv + ar(kv)),
                "self_attn.o_proj": ("o_proj_weight", ar(h))}  # fmt: skip
    if sparse:
        s = hy.shared_expert_size
        gate = ("shared_gate_weight", ar(1)) if fp8 else ("shared_proj_weight", ar(2 * s, 2 * s + 1))
        maps |= {"mlp.shared_expert.gate_proj": ("shared_proj_weight", ar(s)),
                 "mlp.shared_expert.up_proj": ("shared_proj_weight", ar(s, 2 * s)), "mlp.shared_expert_gate": gate,
                 "mlp.shared_expert.down_proj": ("shared_down_weight", ar(h))}  # fmt: skip
    else:
        i = c.intermediate_size
        maps |= {"mlp.gate_proj": ("gate_up_proj_weight", ar(i)), "mlp.up_proj": ("gate_up_proj_weight", ar(i, 2 * i)),
                 "mlp.down_proj": ("down_proj_weight", ar(h))}  # fmt: skip
    return maps


def _load_rows(layer: Qwen3NextLayer, module: str, suffix: str, name: str, t: torch.Tensor) -> bool:
    """One tensor of a matrix that layer.row_maps places: a float one's rows copied in; an FP8 one's codes or block
    scales held until both came (`name`: the whole HF name), then read and checked (quant_config.load_packed) and
    written in packed (quant.put_rows). False for a tensor the matrix does not take."""
    attr, rows = layer.row_maps[module]
    target = getattr(layer, attr)
    if not isinstance(target, quant.PackedWeight):
        if suffix != "weight":
            return False
        if t.dtype == quant.FP8_DTYPE:  # a cast would drop its scales
            raise ValueError(f"weights: {name!r} is stored float8_e4m3fn where config.json's quantization_config "
                             "leaves this projection float; the config's modules_to_not_convert and the files "
                             "disagree")  # fmt: skip
        value = _checked(name, t, (rows.numel(), target.shape[1]))
        target[rows.to(target.device)] = value.to(target.device, target.dtype)  # index_put_: one device, one dtype
        return True
    if suffix not in ("weight", "weight_scale_inv"):
        return False
    pending = layer.fp8_pending.setdefault(module, {})
    pending[suffix] = t
    if len(pending) == 2:
        hf_module = name.rpartition(".")[0]
        assert layer.fp8_block is not None
        scheme = WeightScheme(kind=quant.FP8_BLOCK, layout=FP8_DEEPSEEK, block=layer.fp8_block)
        part = load_packed(scheme, layer.fp8_pending.pop(module), module=hf_module)
        _checked(f"{hf_module}.weight", part.data, (rows.numel(), target.shape[1]))
        quant.put_rows(target, rows, part.to(target.data.device))
    return True


def _load_layer(c: ModelConfig, layer: Qwen3NextLayer, rest: str, name: str, t: torch.Tensor) -> bool:
    """Load one tensor of a layer (rest: its HF name after `model.layers.N.` or `mtp.layers.0.`, name: the whole
    one); False for a name the layer does not have."""
    hy = c.hybrid
    assert hy is not None
    h, d = c.hidden_size, c.head_dim
    module, _, suffix = rest.rpartition(".")
    if module in layer.row_maps:
        return _load_rows(layer, module, suffix, name, t)
    if rest in _ONE_PLUS:
        target = getattr(layer, rest.replace(".", "_"))
        _put(name, target, t, (h,))
        target.add_(1.0)
        return True
    if layer.linear:
        direct = {"linear_attn.conv1d.weight": layer.conv1d_weight, "linear_attn.A_log": layer.A_log,
                  "linear_attn.dt_bias": layer.dt_bias, "linear_attn.norm.weight": layer.gated_norm_weight}
    elif rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        target = layer.q_norm_weight if rest == "self_attn.q_norm.weight" else layer.k_norm_weight
        target.copy_(_checked(name, t, (d,))[rotary_order(d, hy.rotary_dim).to(t.device)] + 1.0)
        return True
    else:
        direct = {}
    if layer.sparse:
        expert = _EXPERT.fullmatch(rest)
        stack = expert_tensor(layer, expert.group(2), expert.group(3)) if expert is not None else None
        if expert is not None and stack is not None and int(expert.group(1)) < stack.shape[0]:
            e, proj = int(expert.group(1)), expert.group(2)
            target = stack[e] if proj == "down" else stack[e, (proj == "up") :: 2]
            if quant.FP8_DTYPE in (t.dtype, target.dtype) and t.dtype != target.dtype:  # copy_ would cast it
                raise ValueError(f"weights: {name!r} is stored {t.dtype} where config.json's quantization_config "
                                 f"makes this layer's experts {target.dtype}; the config's modules_to_not_convert "
                                 "and the files disagree")  # fmt: skip
            _put(name, target, t, tuple(target.shape))
            return True
        direct["mlp.gate.weight"] = layer.router_weight
    if rest in direct:
        _put(name, direct[rest], t, tuple(direct[rest].shape))
        return True
    return False


def _layer_names(c: ModelConfig, layer: Qwen3NextLayer) -> list[str]:
    """The HF names after `model.layers.N.` (or `mtp.layers.0.`) of a layer's tensors."""
    assert c.moe is not None
    if layer.linear:
        names = [f"linear_attn.{p}" for p in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log",
                                              "dt_bias", "norm.weight", "out_proj.weight")]  # fmt: skip
    else:
        names = [f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    if layer.fp8_block is not None:  # an FP8 release's projections: their block scales too
        names += [f"{m}.weight_scale_inv" for m in qwen3_next_projections(layer.linear, layer.sparse)]
    if not layer.sparse:
        return [*_ONE_PLUS, *names, *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    experts = [f"mlp.experts.{e}.{p}_proj.weight" for e in range(c.moe.num_experts) for p in ("gate", "up", "down")]
    if layer.experts is not None and layer.experts.fp8:  # an FP8 release's experts: their block scales too
        experts += [f"{n}_scale_inv" for n in experts]
    shared = [f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
    return [*_ONE_PLUS, *names, "mlp.gate.weight", "mlp.shared_expert_gate.weight", *shared, *experts]


class _OwnRotary:
    """Qwen3-Next's partial rotary tables in place of the engine's (meta.cos/sin), as long as those: built once a
    length, shared by the model and its MTP module."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self.tables is None or self.tables[0].shape[0] != meta.cos.shape[0]:
            self.tables = partial_rotary_tables(self.config, meta.cos.shape[0], meta.cos.device)
        return replace(meta, cos=self.tables[0], sin=self.tables[1])


class Qwen3NextForCausalLM(DecoderStack, nn.Module):
    features = frozenset({MOE, LINEAR_ATTENTION})  # what the layers need of a backend (kernels/ops.py)

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hy = config.hybrid
        assert hy is not None, "Qwen3-Next configs carry their hybrid fields (ModelConfig.from_hf)"
        if (config.head_dim - hy.rotary_dim) % 2:
            raise ValueError(f"Qwen3-Next: head_dim {config.head_dim} minus rotary dims {hy.rotary_dim} must be even")
        self.init_stack(config, Qwen3NextLayer, dtype, device)
        self._rotary = _OwnRotary(config)

    def forward(self, ops: Ops, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """As DecoderStack's, with the model's own (partial) rotary tables, as long as the engine's."""
        return super().forward(ops, input_ids, kv_caches, self._rotary(meta))

    # ---- caches: paged K/V for the full layers, per-sequence state slots for the linear ones -----------------

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Only the full-attention layers hold pages; the linear layers' state is per sequence (state_bytes_per_slot)"""
        c = self.config
        full = sum(not layer.linear for layer in self.layers)
        return 2 * full * block_size * c.num_key_value_heads * c.head_dim * torch.finfo(dtype).bits // 8

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, ...]]:  # fmt: skip
        """(K, V) [num_blocks, block_size, Hkv, D] for each full layer; () for each linear layer, whose pools
        make_state_pools allocates (the engine's StateSlots puts them in these places)."""
        c = self.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        return [() if layer.linear else (torch.zeros(shape, dtype=dtype, device=device),
                                         torch.zeros(shape, dtype=dtype, device=device)) for layer in self.layers]

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """One sequence's state over all linear layers: the recurrent state in float32 and the conv history."""
        hy = self.config.hybrid
        assert hy is not None
        per_layer = hy.num_v_heads * hy.head_k_dim * hy.head_v_dim * 4 + (hy.conv_width - 1) * hy.conv_dim * (
            torch.finfo(dtype).bits // 8)
        return len(hy.linear_layers) * per_layer

    def make_state_pools(self, num_slots: int, dtype: torch.dtype,
                         device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """layer index -> (state_pool [num_slots, Hv, Dk, Dv] float32, conv_pool [num_slots, K-1, conv_dim])."""
        hy = self.config.hybrid
        assert hy is not None
        return {i: (torch.zeros(num_slots, hy.num_v_heads, hy.head_k_dim, hy.head_v_dim, dtype=torch.float32,
                                device=device),
                    torch.zeros(num_slots, hy.conv_width - 1, hy.conv_dim, dtype=dtype, device=device))
                for i in hy.linear_layers}  # fmt: skip

    # ---- loading -------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (reordered where our layout differs); every parameter written exactly once.
        The MTP module's tensors (`mtp.*`) are skipped: Qwen3NextMTP loads them when it drafts."""
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or name.startswith(Qwen3NextMTP.weight_prefix):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            self._load(name, tensor)
            seen.add(name)
        self.check_complete(seen)

    @torch.no_grad()
    def _load(self, name: str, t: torch.Tensor) -> None:
        c = self.config
        hy, moe = c.hybrid, c.moe
        assert hy is not None and moe is not None
        top = {"model.embed_tokens.weight": self.embed_tokens_weight, "model.norm.weight": self.norm_weight,
               "lm_head.weight": self.lm_head_weight}  # fmt: skip
        if name in top:
            target = top[name]
            _put(name, target, t, tuple(target.shape))
            if name == "model.norm.weight":
                target.add_(1.0)
            return
        m = _LAYER.fullmatch(name)
        layer = self.layers[int(m.group(1))] if m is not None and int(m.group(1)) < len(self.layers) else None
        if layer is None or m is None or not _load_layer(c, layer, m.group(2), name, t):
            raise ValueError(f"weights: unexpected tensor {name!r} for {c.architecture} (linear-attention layers: "
                             f"{list(hy.linear_layers)}, dense layers: {list(moe.dense_layers)})")  # fmt: skip

    def expected_weight_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            names.update(f"model.layers.{i}.{p}" for p in _layer_names(self.config, layer))
        return names

    unread_prefixes = (MTP_PREFIX,)  # the MTP module's tensors: not read from the files when the model loads

    def multi_token_predictor(self) -> Qwen3NextMTP:
        """The multi-token-prediction module over this model's embedding, head and rotary tables, on its device and
        dtype (weights unset: Qwen3NextMTP.load_weights or dummy_weights)."""
        return Qwen3NextMTP(self)


_MTP_NORMS = {"pre_fc_norm_embedding.weight": "pre_fc_norm_embedding_weight",
              "pre_fc_norm_hidden.weight": "pre_fc_norm_hidden_weight", "norm.weight": "norm_weight"}  # fmt: skip


class Qwen3NextMTP(nn.Module):
    """Qwen3-Next's multi-token-prediction module (the checkpoint's `mtp.*`; vLLM's qwen3_next_mtp.py): for the
    token t at position i+1 and the model's last hidden state h_i (after the final norm),
    x = fc([pre_fc_norm_embedding(embed(t)); pre_fc_norm_hidden(h_i)]) (the embedding's half first), then one
    full-attention MoE decoder layer (`mtp.layers.0.*`, named as a layer of the model: gated attention with the
    model's partial rotary over a paged K/V cache of its own, the routed experts and the gated shared expert) and
    mtp.norm -> its own hidden state, whose head (the model's) gives the logits for the token at i+2 (forward, then
    compute_logits). Chained on its own hidden state and greedy token it drafts k tokens (runtime/engine/spec/mtp.py,
    MtpDrafter). Its three norms are Qwen3NextRMSNorm's x·(1 + w): loaded as 1 + w. Embedding and head are the
    model's (the checkpoint stores no copies)."""

    weight_prefix = MTP_PREFIX  # the checkpoint's names of its tensors (MtpDrafter reads only those)

    def __init__(self, main: Qwen3NextForCausalLM) -> None:
        super().__init__()
        c = self.config = main.config
        dtype, device = main.norm_weight.dtype, main.norm_weight.device
        h, self.eps = c.hidden_size, c.rms_norm_eps
        self.pre_fc_norm_embedding_weight = param(h, dtype=dtype, device=device)
        self.pre_fc_norm_hidden_weight = param(h, dtype=dtype, device=device)
        # fc [H, 2H] as its two column halves [2, H, H]: the embedding's and the hidden state's projections
        self.fc = param(2, h, h, dtype=dtype, device=device)
        # index num_hidden_layers: past the model's layers, so neither a linear-attention nor a dense one (vLLM builds
        # it as a full-attention layer at that index, whose MLP is sparse with the published decoder_sparse_step 1)
        self.layer = Qwen3NextLayer(c, c.num_hidden_layers, dtype, device)
        assert not self.layer.linear and self.layer.sparse
        self.norm_weight = param(h, dtype=dtype, device=device)
        # plain tensors, not parameters: the model's (dummy_weights and the loader leave them alone)
        self.embed_tokens_weight = main.embed_tokens_weight.detach()
        self.head_weight = main.lm_head_weight.detach()
        self._rotary = main._rotary

    def forward(self, ops: Ops, input_ids: torch.Tensor, hidden: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """input_ids [T] (the token after each hidden state's position), hidden [T, H] (the model's last hidden
        states after the final norm, or this module's own), at the hidden states' positions in meta (their K/V
        written there; rotary with the model's own tables) -> the decoder layer's (hidden, residual) [T, H]."""
        x = mtp_input(ops, self.embed_tokens_weight[input_ids], hidden, self.pre_fc_norm_embedding_weight,
                      self.pre_fc_norm_hidden_weight, self.fc, self.eps)  # fmt: skip
        return self.layer(ops, x, None, kv_cache, self._rotary(meta))

    def compute_logits(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """forward's (hidden, residual) rows -> (logits [N, V] for the token after their input_ids, the module's
        hidden states after mtp.norm [N, H]: the next draft step's input)."""
        return mtp_logits(ops, hidden, residual, self.norm_weight, self.head_weight, self.eps)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """One full-attention layer's K and V, never packed."""
        c = self.config
        return 2 * block_size * c.num_key_value_heads * c.head_dim * torch.finfo(dtype).bits // 8

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(K, V) [num_blocks, block_size, Hkv, D], as a full layer's of the model."""
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy the checkpoint's `mtp.*` tensors in (others are skipped, and the layers after the first: only that
        one drafts); refuse, in one line, a checkpoint (named `source`) that stores none of them or leaves one out."""
        c, prefix, seen = self.config, self.weight_prefix, set()
        later = tuple(f"{prefix}layers.{i}." for i in range(1, c.mtp_layers))
        for name, tensor in weights:
            if not name.startswith(prefix) or name.startswith(later):
                continue
            rest = name.removeprefix(prefix)
            loaded = True
            if rest == "fc.weight":
                _put(name, self.fc.permute(1, 0, 2), tensor, (c.hidden_size, 2 * c.hidden_size))
            elif rest in _MTP_NORMS:
                target = getattr(self, _MTP_NORMS[rest])
                _put(name, target, tensor, (c.hidden_size,))
                target.add_(1.0)
            else:
                loaded = rest.startswith("layers.0.") and _load_layer(c, self.layer, rest.removeprefix("layers.0."),
                                                                      name, tensor)  # fmt: skip
            if not loaded:
                raise ValueError(f"weights: unexpected tensor {name!r} in the multi-token-prediction module")
            seen.add(rest)
        if not seen:
            raise ValueError(f"draft_model: 'mtp' needs the multi-token-prediction module's weights ({prefix}*), "
                             f"which {source} does not store; serve it without --draft-model mtp")  # fmt: skip
        missing = sorted(self.expected_weight_names() - {prefix + n for n in seen})
        if missing:
            raise ValueError(f"weights: {len(missing)} tensors of the multi-token-prediction module missing, e.g. "
                             f"{missing[:3]}; the checkpoint is incomplete")  # fmt: skip

    def expected_weight_names(self) -> set[str]:
        """The checkpoint's names of the module's tensors: fc, its norms and its decoder layer's (its FP8 experts'
        and projections' block scales too where MoEConfig.fp8_layers / HybridConfig.fp8_layers name its index,
        num_hidden_layers: runtime/packed_load.py load_mtp_weights hands those over as stored and dequantizes the
        fc, which stays a float matrix)."""
        names = ("fc.weight", *_MTP_NORMS, *(f"layers.0.{n}" for n in _layer_names(self.config, self.layer)))
        return {self.weight_prefix + n for n in names}
