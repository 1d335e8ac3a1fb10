"""DeepSeek-V3 (Kimi K2, Moonlight, DeepSeek-V3/R1) and DeepSeek-V2 (V2-Lite): multi-head latent attention and
DeepSeek's MoE, one file; V2 differs only in its routing (softmax scores, greedy or group-limited top-k, never
renormalised), which ModelConfig.moe.scoring carries.

Attention (MLA, offline_docs/mla.md): q through a LoRA (q_a_proj, q_a_layernorm, q_b_proj) or one q_proj; K/V
compressed by kv_a_proj_with_mqa into a latent c (kv_lora_rank) and one shared rotary key k_pe; the cache holds one
row [kv_a_layernorm(c), rotary(k_pe)] per token and layer (`make_kv_caches`), and kv_b_proj's per-head up-projections
are applied on the query and output sides (`Ops.mla_attention`). q_a_proj (or q_proj) and kv_a_proj_with_mqa read
the same normed input: they load into one matrix, one `norm_linear`.

MLP: dense below first_k_dense_replace, else routed experts plus shared ones: the shared MLP (n_shared_experts ×
moe_intermediate_size wide) loads as n_shared_experts more experts at the end of the stacks, each token always
routed to them with weight 1 (ops.deepseek_route), so one expert pass computes both (SGLang's shared-expert fusion).

HF reference: transformers/models/deepseek_v3/modeling_deepseek_v3.py (and deepseek_v2). Parameter names are HF's;
the checkpoint holds each expert as `mlp.experts.E.{gate,up,down}_proj.weight`, loaded into interleaved gate/up
stacks as in models/qwen3_moe.py (FP8 releases' experts, shared ones included, kept FP8 as there; INT4 releases'
experts kept INT4, and a float shared MLP beside them, Kimi K2 Thinking's, served as its own MLP on the same normed
input and added to the experts' output as HF adds it). The router and
e_score_correction_bias stay float32, as HF keeps them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from envex.kernels.ops import MLA, MOE, AttentionMetadata, MLALayer, MoEWeights, Ops
from envex.runtime.config import DEEPSEEK_V3, ModelConfig
from envex.runtime.models.decoder import (
    DecoderStack,
    expert_stacks,
    expert_tensor,
    int4_expert_names,
    mtp_input,
    mtp_logits,
    param,
)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SUFFIX = r"(weight|weight_scale_inv|weight_packed|weight_scale|weight_zero)"  # float, FP8, INT4 (decoder.py)
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\." + _SUFFIX)
_SHARED = re.compile(r"mlp\.shared_experts\.(gate|up|down)_proj\." + _SUFFIX)
_LORA_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF builds them without the config's eps
_DIRECT = {
    "input_layernorm.weight": "input_layernorm_weight",
    "post_attention_layernorm.weight": "post_attention_layernorm_weight",
    "self_attn.q_a_layernorm.weight": "q_a_layernorm_weight",
    "self_attn.q_b_proj.weight": "q_b_proj_weight",
    "self_attn.kv_a_layernorm.weight": "kv_a_layernorm_weight",
    "self_attn.o_proj.weight": "o_proj_weight",
    "mlp.gate.weight": "router_weight",
    "mlp.gate.e_score_correction_bias": "e_score_correction_bias",
    "mlp.down_proj.weight": "down_proj_weight",
    "mlp.shared_experts.down_proj.weight": "shared_down_proj_weight",  # float beside INT4 experts (Kimi K2)
}
_DENSE_GATE_UP = {"mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 1}  # [gate | up], as models/llama.py packs it


class DeepseekLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c, m, moe = config, config.mla, config.moe
        assert m is not None and moe is not None, "DeepSeek configs carry MLA and MoE fields (ModelConfig.from_hf)"
        h, heads = c.hidden_size, c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.top_k = moe.top_k
        self.input_layernorm_weight = param(h, dtype=dtype, device=device)
        self.post_attention_layernorm_weight = param(h, dtype=dtype, device=device)
        q_out = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        # rows: q_a_proj (q_lora_rank) or q_proj (q_out), then kv_a_proj_with_mqa (kv_lora_rank + qk_rope_head_dim)
        self.q_width = m.q_lora_rank if m.q_lora_rank is not None else q_out
        self.qkv_a_proj_weight = param(self.q_width + m.kv_lora_rank + m.qk_rope_head_dim, h, dtype=dtype,
                                        device=device)  # fmt: skip
        self.lora = m.q_lora_rank is not None
        if self.lora:
            self.q_a_layernorm_weight = param(self.q_width, dtype=dtype, device=device)
            self.q_b_proj_weight = param(q_out, self.q_width, dtype=dtype, device=device)
        self.kv_a_layernorm_weight = param(m.kv_lora_rank, dtype=dtype, device=device)
        # [H, nope + v, rank]: 3-D, so the CPU's column-major pass leaves it (and the views below) alone
        self.kv_b_proj = param(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank, dtype=dtype, device=device)
        self.o_proj_weight = param(h, heads * m.v_head_dim, dtype=dtype, device=device)
        self.attn = MLALayer(num_heads=heads, qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                             v_head_dim=m.v_head_dim, kv_lora_rank=m.kv_lora_rank, scale=m.softmax_scale,
                             kv_norm=self.kv_a_layernorm_weight, w_uk=self.kv_b_proj[:, : m.qk_nope_head_dim],
                             w_uv=self.kv_b_proj[:, m.qk_nope_head_dim :], norm_eps=_LORA_EPS,
                             interleaved=m.interleaved)  # fmt: skip
        self.sparse = index not in moe.dense_layers
        self.experts: MoEWeights | None = None
        if self.sparse:
            e, inter = moe.num_experts, moe.intermediate_size
            int4 = moe if index in moe.int4_layers else None  # INT4 experts, kept so
            # routed experts, then the shared MLP split into experts; float shared experts beside INT4 routed ones
            # (Kimi K2) are a dense MLP of their own, added to the experts' output as HF adds them
            shared = moe.shared_experts if int4 is None or moe.int4_shared else 0
            stack = e + shared
            self.router_weight = param(e, h, dtype=torch.float32, device=device)
            self.e_score_correction_bias = (param(e, dtype=torch.float32, device=device)
                                            if c.architecture == DEEPSEEK_V3 else None)  # fmt: skip
            fp8 = moe.fp8_block if index in moe.fp8_layers else None  # FP8 experts (shared ones too), kept so
            stacks = expert_stacks(self, stack, inter, h, dtype=dtype, device=device, fp8_block=fp8, int4=int4)
            if moe.shared_experts and not shared:
                width = moe.shared_experts * inter
                self.shared_gate_up_proj_weight = param(2 * width, h, dtype=dtype, device=device)  # [gate | up]
                self.shared_down_proj_weight = param(h, width, dtype=dtype, device=device)
            self.experts = MoEWeights(**stacks, activation="silu",
                                      renormalize=moe.norm_topk_prob, scoring=moe.scoring,
                                      correction_bias=self.e_score_correction_bias, n_group=moe.n_group,
                                      topk_group=moe.topk_group, scaling=moe.routed_scaling_factor,
                                      shared_experts=shared)  # fmt: skip
        else:
            self.gate_up_proj_weight = param(2 * c.intermediate_size, h, dtype=dtype, device=device)
            self.down_proj_weight = param(h, c.intermediate_size, dtype=dtype, device=device)

    def forward(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: tuple[torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden, residual [T, H] -> the MLP output and the residual stream before it (added by the next norm)."""
        qkv_a, residual = ops.norm_linear(hidden, residual, self.input_layernorm_weight, self.eps,
                                          self.qkv_a_proj_weight)  # [T, q_width + rank + rope]
        q = qkv_a[:, : self.q_width]
        if self.lora:
            q = ops.norm_linear(q, None, self.q_a_layernorm_weight, _LORA_EPS, self.q_b_proj_weight)[0]
        attn = ops.mla_attention(q, qkv_a[:, self.q_width :], kv_cache[0], meta, self.attn)  # [T, H v]
        hidden = ops.linear(attn, self.o_proj_weight)
        if self.experts is not None:
            out, residual = ops.moe(hidden, residual, self.post_attention_layernorm_weight, self.eps,
                                    self.router_weight, None, self.experts, self.top_k)  # fmt: skip
            if hasattr(self, "shared_down_proj_weight"):  # float shared experts beside INT4 ones
                gate_up = ops.norm_linear(residual, None, self.post_attention_layernorm_weight, self.eps,
                                          self.shared_gate_up_proj_weight)[0]  # fmt: skip
                out = out + ops.act_linear(gate_up, self.shared_down_proj_weight)
            return out, residual
        gate_up, residual = ops.norm_linear(hidden, residual, self.post_attention_layernorm_weight, self.eps,
                                            self.gate_up_proj_weight)  # [T, 2I]
        return ops.act_linear(gate_up, self.down_proj_weight), residual


def _layer_target(c: ModelConfig, layer: DeepseekLayer, rest: str) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """A decoder layer's tensor (a view for a packed shard) for the HF name after `model.layers.N.`, and the shape
    the checkpoint stores it in; None for a name the layer does not have."""
    m, moe = c.mla, c.moe
    assert m is not None and moe is not None
    q_name = "self_attn.q_a_proj.weight" if layer.lora else "self_attn.q_proj.weight"
    if rest == q_name:
        view = layer.qkv_a_proj_weight[: layer.q_width]
        return view, tuple(view.shape)
    if rest == "self_attn.kv_a_proj_with_mqa.weight":
        view = layer.qkv_a_proj_weight[layer.q_width :]
        return view, tuple(view.shape)
    if rest == "self_attn.kv_b_proj.weight":
        return layer.kv_b_proj, (layer.kv_b_proj.shape[0] * layer.kv_b_proj.shape[1], m.kv_lora_rank)
    expert = _EXPERT.fullmatch(rest)
    stack = expert_tensor(layer, expert.group(2), expert.group(3)) if layer.sparse and expert else None
    if expert is not None and stack is not None and int(expert.group(1)) < moe.num_experts:
        e, proj = int(expert.group(1)), expert.group(2)
        view = stack[e] if proj == "down" else stack[e, (proj == "up") :: 2]
        return view, tuple(view.shape)
    shared = _SHARED.fullmatch(rest)
    if shared is not None and layer.sparse and shared.group(1) != "down" and hasattr(layer, "shared_down_proj_weight"):
        width = layer.shared_down_proj_weight.shape[1]  # float shared experts beside INT4 ones: [gate | up]
        view = layer.shared_gate_up_proj_weight[(shared.group(1) == "up") * width :][:width]
        return (view, tuple(view.shape)) if shared.group(2) == "weight" else None
    stack = expert_tensor(layer, shared.group(1), shared.group(2)) if layer.sparse and shared else None
    if shared is not None and stack is not None and moe.shared_experts:
        first, s = moe.num_experts, moe.shared_experts  # (FP8 scales: the same split, in blocks)
        if shared.group(1) == "down":  # [H, S·I] -> S experts' [H, I]
            view = stack[first:].permute(1, 0, 2)
            return view, (view.shape[0], s * view.shape[2])
        view = stack[first:, (shared.group(1) == "up") :: 2]  # [S, I, H] from [S·I, H]
        return view, (s * view.shape[1], view.shape[2])
    if not layer.sparse and rest in _DENSE_GATE_UP:
        inter = c.intermediate_size
        view = layer.gate_up_proj_weight[_DENSE_GATE_UP[rest] * inter : (_DENSE_GATE_UP[rest] + 1) * inter]
        return view, tuple(view.shape)
    target = getattr(layer, _DIRECT.get(rest, ""), None)
    if isinstance(target, torch.Tensor):
        return target, tuple(target.shape)
    return None


def _layer_names(c: ModelConfig, sparse: bool, fp8: bool = False, int4: bool = False) -> list[str]:
    """The HF names after `model.layers.N.` of a decoder layer (MoE when sparse, else a dense MLP; fp8: its
    experts' block scales too; int4: its experts' INT4 tensors as runtime/packed_load.py hands them over)."""
    m, moe = c.mla, c.moe
    assert m is not None and moe is not None
    q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if m.q_lora_rank is not None else ["q_proj"]
    names = [f"self_attn.{p}.weight" for p in q + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]]
    names += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if not sparse:
        return names + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    experts = [f"mlp.experts.{e}.{p}_proj.weight" for e in range(moe.num_experts) for p in ("gate", "up", "down")]
    if moe.shared_experts:
        experts += [f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    names += ["mlp.gate.weight", *experts]
    if c.architecture == DEEPSEEK_V3:
        names.append("mlp.gate.e_score_correction_bias")
    if fp8:  # FP8 experts' block scales
        names += [f"{n}_scale_inv" for n in experts]
    if int4:  # INT4 experts (the shared ones too unless they are float)
        packed = [n for n in experts if moe.int4_shared or "shared_experts" not in n]
        names = [n for n in names if n not in packed] + int4_expert_names(packed, moe.int4_zero)
    return names


class DeepseekV3ForCausalLM(DecoderStack, nn.Module):
    features = frozenset({MOE, MLA})  # what the layers need of a backend (kernels/ops.py)

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.init_stack(config, DeepseekLayer, dtype, device)

    # ---- the latent cache (runtime/engine/model_runner.py asks for it) ---------------------------------------

    def _latent_width(self) -> int:
        m = self.config.mla
        assert m is not None
        return m.kv_lora_rank + m.qk_rope_head_dim

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """One latent row per token and layer, no V: (kv_lora_rank + qk_rope_head_dim) elements."""
        return len(self.layers) * block_size * self._latent_width() * torch.finfo(dtype).bits // 8

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor]]:  # fmt: skip
        """Each layer's cache: ([num_blocks, block_size, kv_lora_rank + qk_rope_head_dim],)."""
        shape = (num_blocks, block_size, self._latent_width())
        return [(torch.zeros(shape, dtype=dtype, device=device),) for _ in self.layers]

    # ---- loading -------------------------------------------------------------------------------------------

    def _target(self, name: str) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """Our tensor (a view for a packed shard) for an HF name and the shape the checkpoint stores it in; None
        for a tied LM head's copy."""
        c = self.config
        m, moe = c.mla, c.moe
        assert m is not None and moe is not None
        if name == "lm_head.weight" and c.tie_word_embeddings:
            return None
        top = {"model.embed_tokens.weight": self.embed_tokens_weight, "model.norm.weight": self.norm_weight,
               "lm_head.weight": self.lm_head_weight}  # fmt: skip
        if name in top:
            return top[name], tuple(top[name].shape)
        match = _LAYER.fullmatch(name)
        if match is not None and int(match.group(1)) < len(self.layers):
            found = _layer_target(c, self.layers[int(match.group(1))], match.group(2))
            if found is not None:
                return found
        elif match is not None and int(match.group(1)) < len(self.layers) + c.mtp_layers:
            return None  # the multi-token-prediction layer: DeepseekMTP loads it when it drafts
        raise ValueError(f"weights: unexpected tensor {name!r} for {c.architecture} (dense layers: "
                         f"{list(moe.dense_layers)}, q LoRA: {m.q_lora_rank is not None})")  # fmt: skip

    def expected_weight_names(self) -> set[str]:
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            names.update(f"model.layers.{i}.{p}" for p in _layer_names(c, layer.sparse, i in c.moe.fp8_layers,
                                                                          i in c.moe.int4_layers))
        return names

    @property
    def unread_prefixes(self) -> tuple[str, ...]:
        """The multi-token-prediction layers' tensors: not read from the files when the model loads."""
        n = self.config.num_hidden_layers
        return tuple(f"model.layers.{i}." for i in range(n, n + self.config.mtp_layers))

    def multi_token_predictor(self) -> DeepseekMTP:
        """The multi-token-prediction module over this model's embedding and head, on its device and dtype (weights
        unset: DeepseekMTP.load_weights or dummy_weights)."""
        return DeepseekMTP(self)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 (V2-Lite): the same layers; its softmax routing comes with its config (MoEConfig.scoring)."""


_MTP_OWN = {"enorm.weight": "enorm_weight", "hnorm.weight": "hnorm_weight",
            "shared_head.norm.weight": "head_norm_weight"}  # fmt: skip
_MTP_SHARED = {"embed_tokens.weight": "embed_tokens_weight", "shared_head.head.weight": "head_weight"}


class DeepseekMTP(nn.Module):
    """DeepSeek-V3's multi-token-prediction module (the checkpoint's `model.layers.{N}.*`, N = num_hidden_layers):
    for the token t at position i+1 and the model's last hidden state h_i (after the final norm, as transformers'
    MTP generation, vLLM and SGLang feed it), h' = eh_proj([enorm(embed(t)); hnorm(h_i)]), then one decoder layer
    (MLA over a latent cache of its own, MoE) and shared_head's norm -> its own hidden state (transformers'
    MtpLayer output), whose head gives the logits for the token at i+2 (forward, then compute_logits). Chained on
    its own hidden state and greedy token it drafts k tokens (runtime/engine/spec/mtp.py, MtpDrafter).

    Its embedding and head are the model's, unless the checkpoint stores copies that differ (DeepSeek-V3's files
    store equal copies: they are not held twice)."""

    config: ModelConfig
    embed_tokens_weight: torch.Tensor
    head_weight: torch.Tensor

    def __init__(self, main: DeepseekV3ForCausalLM) -> None:
        super().__init__()
        c = self.config = main.config
        self.layer: DeepseekLayer
        dtype, device = main.norm_weight.dtype, main.norm_weight.device
        h, self.eps, self.index = c.hidden_size, c.rms_norm_eps, c.num_hidden_layers
        self.weight_prefix = f"model.layers.{self.index}."  # the checkpoint's names of its tensors (MtpDrafter)
        self.enorm_weight = param(h, dtype=dtype, device=device)
        self.hnorm_weight = param(h, dtype=dtype, device=device)
        # eh_proj [H, 2H] as its two column halves [2, H, H]: the embedding's and the hidden state's projections
        self.eh_proj = param(2, h, h, dtype=dtype, device=device)
        self.layer = DeepseekLayer(c, self.index, dtype, device)
        self.head_norm_weight = param(h, dtype=dtype, device=device)
        # plain tensors, not parameters: the model's (dummy_weights and the loader leave them alone)
        self.embed_tokens_weight = main.embed_tokens_weight.detach()
        self.head_weight = main.lm_head_weight.detach()

    def forward(self, ops: Ops, input_ids: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """input_ids [T] (the token after each hidden state's position), hidden [T, H] (the model's last hidden
        states after the final norm, or this module's own), at the hidden states' positions in meta (vLLM's; the
        latent rows are written there) -> the decoder layer's (hidden, residual) [T, H] (compute_logits)."""
        x = mtp_input(ops, self.embed_tokens_weight[input_ids], hidden, self.enorm_weight, self.hnorm_weight,
                      self.eh_proj, self.eps)  # [T, H] eh_proj([e; h])
        return self.layer(ops, x, None, kv_cache, meta)

    def compute_logits(self, ops: Ops, hidden: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """forward's (hidden, residual) rows -> (logits [N, V] for the token after their input_ids, the module's
        hidden states after shared_head's norm [N, H]: the next draft step's input)."""
        return mtp_logits(ops, hidden, residual, self.head_norm_weight, self.head_weight, self.eps)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """One latent row a token, as each layer of the model (DeepseekV3ForCausalLM.make_kv_caches)."""
        m = self.config.mla
        assert m is not None
        return block_size * (m.kv_lora_rank + m.qk_rope_head_dim) * torch.finfo(dtype).bits // 8

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor]:  # fmt: skip
        m = self.config.mla
        assert m is not None
        return (torch.zeros(num_blocks, block_size, m.kv_lora_rank + m.qk_rope_head_dim, dtype=dtype, device=device),)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy the checkpoint's `model.layers.{N}.*` tensors in (others are skipped; a quantized checkpoint's as
        runtime/packed_load.load_mtp_weights hands them over: FP8 or INT4 experts as stored, any other quantized
        projection dequantized); refuse, in one line, a checkpoint (named `source`) that stores none of them or
        leaves one out."""
        prefix = self.weight_prefix
        seen: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if rest in _MTP_SHARED:  # a copy of the model's embedding or head: held once unless it differs
                own = getattr(self, _MTP_SHARED[rest])
                if tuple(tensor.shape) != tuple(own.shape):
                    raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own.shape)}")
                copy = tensor.to(own.device, own.dtype)
                if not torch.equal(copy, own):
                    setattr(self, _MTP_SHARED[rest], nn.Parameter(copy, requires_grad=False))
                continue
            if rest == "eh_proj.weight":
                found = self.eh_proj.permute(1, 0, 2), (self.config.hidden_size, 2 * self.config.hidden_size)
            elif rest in _MTP_OWN:
                target = getattr(self, _MTP_OWN[rest])
                found = target, tuple(target.shape)
            else:
                found = _layer_target(self.config, self.layer, rest)
            if found is None:
                raise ValueError(f"weights: unexpected tensor {name!r} in the multi-token-prediction layer")
            target, stored = found  # type: ignore[misc]
            if tuple(tensor.shape) != stored:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {stored}")
            target.copy_(tensor.reshape(target.shape))
            seen.add(rest)
        if not seen:
            raise ValueError(f"draft_model: 'mtp' needs the multi-token-prediction layer's weights ({prefix}*), which "
                             f"{source} does not store; serve it without --draft-model mtp")  # fmt: skip
        missing = sorted(self.expected_weight_names() - {prefix + n for n in seen})
        if missing:
            raise ValueError(f"weights: {len(missing)} tensors of the multi-token-prediction layer missing, e.g. "
                             f"{missing[:3]}; the checkpoint is incomplete")  # fmt: skip

    def expected_weight_names(self) -> set[str]:
        """The checkpoint's names of the tensors it must store (the embedding and head copies it may leave out), as
        load_weights takes them: its experts' block scales, or INT4 tensors as runtime/packed_load.py hands them
        over, where MoEConfig.fp8_layers / int4_layers name its index."""
        moe = self.config.moe
        assert moe is not None
        own = _layer_names(self.config, self.layer.sparse, self.index in moe.fp8_layers, self.index in moe.int4_layers)
        return {self.weight_prefix + n for n in (*own, "eh_proj.weight", *_MTP_OWN)}

