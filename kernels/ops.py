"""The one interface between a model file and the kernels: `Ops`, its per-step metadata, and what a backend can do.

A model (envex.runtime.models.<arch>) calls only these fused entry points, on every device and batch size; the
backend chooses the kernel inside each (the batch-1 GEMV with the norm or activation folded in, cuBLAS, the
torch reference):

    norm_linear   residual add + RMSNorm + projection (+ bias)      -> (y, new residual)
    linear        projection (+ bias)
    act_linear    SwiGLU + projection
    attention     (q/k RMSNorm) + rotary + KV-cache write + paged causal attention (+ sinks, sliding window)
    moe           residual add + RMSNorm + router (top-k, softmax) + experts (float, MXFP4, FP8) -> (y, new residual)
    mla_attention latent-row write (kv_a_layernorm + rotary) + latent-cache attention (DeepSeek's MLA) -> o_proj input

The backends live in their own files: torch_ops.py (kernels/reference.py behind this interface, and its
batch-invariant forms), triton_ops.py (the CUDA fast path), invariant_ops.py (the batch-invariant Triton path).
Each states what it supports (`Capabilities`); backends.py lists them and builds one. A model file states what it
needs (`features`), and the engine's config checks one against the other once (EngineConfig.resolved). This
module imports no backend and no Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from envex.kernels import quant, reference
from envex.kernels.kv_quant_format import PackedKVCache


@dataclass(frozen=True, kw_only=True)
class AttentionLayer:
    """One attention layer's static shape and weights, as the model file owns them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    q_norm: torch.Tensor | None = None  # [D] Qwen3's per-head RMSNorm weights (both or neither)
    k_norm: torch.Tensor | None = None
    norm_eps: float = 1e-6
    sinks: torch.Tensor | None = None  # [Hq] gpt-oss's per-head sink logits (join the softmax, carry no value)
    sliding_window: int | None = None  # a query at position p sees keys p-window+1 .. p only

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache; built once per step by the engine, only read here.

    Tokens of all sequences are packed: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; they sit at
    positions seq_len_b - q_len_b .. seq_len_b - 1 and attend causally to cached keys 0 .. their position.
    A sequence's cached tokens live in blocks block_tables[b, :ceil(seq_len_b / block_size)].
    """

    positions: torch.Tensor  # int64 [T]: position of each token
    slot_mapping: torch.Tensor  # int64 [T]: where each token's K/V is written (block * block_size + offset; < 0: not)
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    cos: torch.Tensor  # float32 [max_positions, D / 2] rotary tables
    sin: torch.Tensor
    max_q_len: int
    max_seq_len: int  # bounds every sequence's length after this step (a CUDA graph passes max_model_len)
    # int32 [B]: cached tokens after this step's writes. None for a pure decode step, where it is positions + 1.
    seq_lens: torch.Tensor | None = None
    num_splits: int | None = None  # decode key splits; None: chosen per launch (a CUDA graph fixes it)
    # Every sequence brings exactly this many query tokens, at consecutive positions (decode: 1; a speculative
    # verify step: k + 1), so a backend may run the step as decode; None: unknown or varying.
    q_per_seq: int | None = None
    # The same lengths on the host, for backends that loop over sequences (the torch reference); None in graphs.
    q_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # The same step for layers with a sliding window, where the engine keeps their K/V in a pool of their own
    # (runtime/engine/caches/window_kv.py): other block tables and slots, everything else equal. None: those layers use
    # this metadata's blocks.
    window: AttentionMetadata | None = None
    # Per-sequence state of recurrent layers (Qwen3-Next's Gated DeltaNet; runtime/engine/caches/state_slots.py):
    # int32 [B] each sequence's slot in the layers' state pools, and int32 [B] 1 where the slot holds the sequence's
    # state after its first positions (this step's start), 0 where it starts from zeros. None: the model has none.
    state_slots: torch.Tensor | None = None
    state_initialized: torch.Tensor | None = None
    # State snapshots for the prefix cache (needs seq_lens): int32 [B, W], where sequence b's state after the n-th
    # multiple of state_snapshot_every tokens of the sequence within this step is also written (-1: nowhere), into
    # that slot of the same pools (delta_rule.gated_delta_rule_chunked's snapshot_slots). None: no snapshots.
    state_snapshots: torch.Tensor | None = None
    state_snapshot_every: int = 0

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1


# One attention layer's cache as the engine hands it to the model and the model to Ops.attention (`*kv_cache`):
# K and V [num_blocks, block_size, Hkv, D], or a packed cache (int4 / fp8) and None.
LayerKVCache = tuple[torch.Tensor, torch.Tensor] | tuple[PackedKVCache, None]


@dataclass(frozen=True, kw_only=True)
class MoEWeights:
    """One MoE layer's experts, as the model file owns them: float stacks, MXFP4-packed ones (kernels/mxfp4.py), or
    FP8 block-scaled ones (gate_up and down float8_e4m3fn with gate_up_scale and down_scale, block bn x bk:
    kernels.quant.FP8BlockStack gives the layout), or INT4 group-quantized ones (gate_up and down int32 words with
    gate_up_scale and down_scale per group of `group` inputs, optional uint8 gate_up_zero and down_zero:
    kernels.quant.Int4GroupStack), one of the four. Rows are outputs (the packed checkpoints'
    orientation); gate_up's rows interleave gate and up (gate_0, up_0, gate_1, ...), as gpt-oss publishes them.
    activation: gpt-oss's clamped SwiGLU ("swiglu_oai", with alpha and limit) or the plain silu(gate) · up ("silu",
    Qwen3-MoE). Biases None: none. renormalize: the chosen experts' weights are the softmax over their k logits
    (gpt-oss; Qwen3-MoE's norm_topk_prob); False: their probabilities under the softmax over all experts
    (reference.moe_route)."""

    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, H]
    gate_up: torch.Tensor | None = None  # [E, 2I, H] float, or float8_e4m3fn with gate_up_scale; INT4 [E, 2I, H/8]
    down: torch.Tensor | None = None  # [E, H, I] float, or float8_e4m3fn with down_scale; INT4 int32 [E, H, I/8]
    gate_up_scale: torch.Tensor | None = None  # FP8: float32 [E, 2·ceil(I/bn), ceil(H/bk)] (block rows gate/up)
    down_scale: torch.Tensor | None = None  # FP8: float32 [E, ceil(H/bn), ceil(I/bk)]
    block: tuple[int, int] = (128, 128)  # FP8: rows x columns per scale (weight_block_size)
    # INT4: scales [E, 2I, ceil(H/G)] / [E, H, ceil(I/G)] in gate_up_scale / down_scale, zeros (uint8, same shapes)
    # or None for symmetric experts, G = group
    gate_up_zero: torch.Tensor | None = None
    down_zero: torch.Tensor | None = None
    group: int = 0
    gate_up_blocks: torch.Tensor | None = None  # [E, 2I, H/32, 16] uint8, with scales [E, 2I, H/32] uint8
    gate_up_scales: torch.Tensor | None = None
    down_blocks: torch.Tensor | None = None  # [E, H, I/32, 16] uint8, with scales [E, H, I/32] uint8
    down_scales: torch.Tensor | None = None
    activation: str = "swiglu_oai"
    alpha: float = 1.702
    limit: float = 7.0
    renormalize: bool = True
    # DeepSeek's routing (MoEWeights.deepseek_route; runtime.config.MoEConfig.scoring): "sigmoid" (V3, with
    # correction_bias, n_group and topk_group), "softmax_greedy" / "softmax_group_limited" (V2); "softmax" is
    # reference.moe_route's.
    scoring: str = "softmax"
    correction_bias: torch.Tensor | None = None  # [E] V3's e_score_correction_bias: it biases the choice only
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor: the routed experts' weights are multiplied by it
    shared_experts: int = 0  # the stacks' last experts: DeepSeek's shared MLP split, chosen for every token, weight 1

    def __post_init__(self) -> None:
        packed = (self.gate_up_blocks, self.gate_up_scales, self.down_blocks, self.down_scales)
        floats = (self.gate_up, self.down)
        fp8 = (self.gate_up_scale, self.down_scale)
        if not (all(t is not None for t in floats) and all(t is None for t in packed)
                and (all(t is None for t in fp8) or all(t is not None for t in fp8))
                or all(t is None for t in floats + fp8) and all(t is not None for t in packed)):
            raise ValueError("MoEWeights: give gate_up and down as float tensors, as FP8 ones with gate_up_scale and "
                             "down_scale, or all four MXFP4 tensors")  # fmt: skip
        gate_up, down = self.gate_up, self.down
        if (self.gate_up_zero is not None or self.down_zero is not None) and not self.int4:
            raise ValueError("MoEWeights: zero points are for INT4 experts (int32 gate_up and down) only")
        if gate_up is not None and down is not None and (self.fp8 or self.int4):
            gu, dn = self._quant_stacks  # quant.FP8BlockStack / Int4GroupStack check each stack (one line)
            e, h, inter = dn.shape
            if tuple(gu.shape) != (e, 2 * inter, h):
                raise ValueError(f"MoEWeights: {'INT4' if self.int4 else 'FP8'} gate_up {list(gu.shape)} is not "
                                 f"[E, 2I, H] = {[e, 2 * inter, h]} for down {[e, h, inter]}")  # fmt: skip
        elif gate_up is not None and down is not None and torch.int32 in (gate_up.dtype, down.dtype):
            raise ValueError("MoEWeights: INT4 gate_up and down need their group scales (gate_up_scale, down_scale)")
        elif gate_up is not None and down is not None and quant.FP8_DTYPE in (gate_up.dtype, down.dtype):
            raise ValueError("MoEWeights: FP8 gate_up and down need their block scales (gate_up_scale, down_scale)")
        if self.activation not in reference.MOE_ACTIVATIONS:
            raise ValueError(f"MoEWeights: activation {self.activation!r} is not one of "
                             f"{', '.join(reference.MOE_ACTIVATIONS)}")  # fmt: skip

    @property
    def intermediate_size(self) -> int:
        """I, each expert's width (gate_up has 2I rows, float or packed)."""
        gate_up = self.gate_up if self.gate_up is not None else self.gate_up_blocks
        assert gate_up is not None
        return gate_up.shape[1] // 2

    @property
    def quantized(self) -> bool:
        return self.gate_up is None or self.gate_up_scale is not None

    @property
    def fp8(self) -> bool:
        """FP8 block-scaled experts (float8 gate_up with gate_up_scale and down_scale)."""
        return self.gate_up_scale is not None and not self.int4

    @property
    def int4(self) -> bool:
        """INT4 group-quantized experts (int32 gate_up words with gate_up_scale and down_scale)."""
        return self.gate_up is not None and self.gate_up.dtype == torch.int32 and self.gate_up_scale is not None

    def deepseek_route(self, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's router on logits [T, E routed] -> (weights [T, top_k + shared], ids [T, top_k + shared] int64):
        reference.deepseek_v3_routing ("sigmoid") or deepseek_v2_routing, then the shared experts (the stacks' last
        ones) with weight 1, so one expert pass adds them (HF: routed experts + shared_experts(x))."""
        if self.scoring == "sigmoid":
            assert self.correction_bias is not None, "V3 routing carries its e_score_correction_bias"
            weights, ids = reference.deepseek_v3_routing(
                logits, self.correction_bias, top_k=top_k, n_group=self.n_group, topk_group=self.topk_group,
                norm_topk_prob=self.renormalize, routed_scaling_factor=self.scaling)  # fmt: skip
        else:
            method = {"softmax_greedy": "greedy", "softmax_group_limited": "group_limited_greedy"}[self.scoring]
            weights, ids = reference.deepseek_v2_routing(logits, top_k=top_k, topk_method=method,
                                                         n_group=self.n_group, topk_group=self.topk_group,
                                                         routed_scaling_factor=self.scaling)  # fmt: skip
        t, routed = logits.shape
        shared = torch.arange(routed, routed + self.shared_experts, device=ids.device).expand(t, -1)
        return torch.cat([weights, weights.new_ones(shared.shape)], 1), torch.cat([ids, shared], 1)

    @functools.cached_property
    def _quant_stacks(self) -> tuple[quant.FP8BlockStack, quant.FP8BlockStack] | tuple[quant.Int4GroupStack,
                                                                                          quant.Int4GroupStack]:
        """(gate_up, down) as FP8 or INT4 stacks, made (and checked) once."""
        assert self.gate_up is not None and self.down is not None and self.gate_up_scale is not None
        assert self.down_scale is not None
        if self.int4:
            return (quant.Int4GroupStack(data=self.gate_up, scale=self.gate_up_scale, zero=self.gate_up_zero,
                                         group=self.group),
                    quant.Int4GroupStack(data=self.down, scale=self.down_scale, zero=self.down_zero,
                                         group=self.group))  # fmt: skip
        return (quant.FP8BlockStack(data=self.gate_up, scale=self.gate_up_scale, block=self.block, paired=True),
                quant.FP8BlockStack(data=self.down, scale=self.down_scale, block=self.block))  # fmt: skip

    def gate_up_matrix(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | quant.FP8BlockStack \
            | quant.Int4GroupStack:  # fmt: skip
        """The float stack, the MXFP4 (blocks, scales) pair or the FP8 / INT4 stack (what kernels/reference.py
        takes)."""
        if self.fp8 or self.int4:
            return self._quant_stacks[0]
        if self.gate_up is not None:
            return self.gate_up
        assert self.gate_up_blocks is not None and self.gate_up_scales is not None
        return self.gate_up_blocks, self.gate_up_scales

    def down_matrix(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | quant.FP8BlockStack \
            | quant.Int4GroupStack:  # fmt: skip
        if self.fp8 or self.int4:
            return self._quant_stacks[1]
        if self.down is not None:
            return self.down
        assert self.down_blocks is not None and self.down_scales is not None
        return self.down_blocks, self.down_scales


# Model features a backend may have kernels for (a model file's `features` names those it needs).
MOE = "mixture-of-experts layers"
SINKS = "attention sinks"
SLIDING_WINDOW = "sliding-window attention"
MLA = "multi-head latent attention"
LINEAR_ATTENTION = "gated delta-rule linear attention"
FEATURES = (MOE, SINKS, SLIDING_WINDOW, MLA, LINEAR_ATTENTION)


@dataclass(frozen=True, kw_only=True)
class MLALayer:
    """One multi-head latent attention layer (DeepSeek-V2/V3; kernels/mla.py, offline_docs/mla.md): its cache holds
    one row per token, [kv_a_layernorm(c) (kv_lora_rank), rotary(k_pe) (qk_rope_head_dim, half-split)]."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float  # the softmax scale (runtime.config.MLAConfig.softmax_scale)
    kv_norm: torch.Tensor  # [rank] kv_a_layernorm's weight
    w_uk: torch.Tensor  # [H, nope, rank] and [H, v, rank]: kv_b_proj's weight split per head (mla.split_kv_b_proj)
    w_uv: torch.Tensor
    norm_eps: float = 1e-6
    interleaved: bool = True  # the checkpoint's rope pairs are (x0, x1), (x2, x3), ... (HF rope_interleave)

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class LinearAttentionLayer:
    """One Gated DeltaNet layer (Qwen3-Next; kernels/delta_rule.py, offline_docs/hybrid.md): its heads and weights.
    Its input is the projection's row [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv) | z (Hv·Dv) | b (Hv) | a (Hv)], heads in
    order; q|k|v are the convolution's channels."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_weight: torch.Tensor  # [q|k|v channels, K] HF's conv1d.weight[:, 0, :] (no bias)
    a_log: torch.Tensor  # [Hv] A_log, dt_bias
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor  # [Dv] the gated RMSNorm's
    norm_eps: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    def split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of the projection's row [T, conv_dim + 2·value_dim... ]: (q|k|v [T, conv_dim], z [T, Hv, Dv],
        b [T, Hv], a [T, Hv])."""
        c, vd, hv = self.conv_dim, self.value_dim, self.num_v_heads
        z = mixed[:, c : c + vd].unflatten(1, (hv, self.head_v_dim))
        return mixed[:, :c], z, mixed[:, c + vd : c + vd + hv], mixed[:, c + vd + hv : c + vd + 2 * hv]

    def split_conv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views q, k [T, Hk, Dk] and v [T, Hv, Dv] of the convolution's output [T, conv_dim]."""
        kd = self.num_k_heads * self.head_k_dim
        return (x[:, :kd].unflatten(1, (self.num_k_heads, self.head_k_dim)),
                x[:, kd : 2 * kd].unflatten(1, (self.num_k_heads, self.head_k_dim)),
                x[:, 2 * kd :].unflatten(1, (self.num_v_heads, self.head_v_dim)))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend supports: checked against a model's needs and the engine's settings in one place
    (EngineConfig.resolved), so a kernel never meets a request it cannot serve."""

    devices: frozenset[str]  # device types it runs on ("cpu", "cuda")
    features: frozenset[str]  # model features (FEATURES) it has kernels for
    batch_invariant: bool = False  # a row's bits never depend on its batch (the deterministic mode)
    # Under tensor parallelism its batch invariance needs every all-reduce to add the ranks in rank order
    # (envex.runtime.parallel.comm, `ordered`).
    ordered_all_reduce: bool = False
    speculation: bool = True  # verify steps (k + 1 query tokens per sequence, q_per_seq)
    tensor_parallel: bool = True  # row-parallel projections reduced through a Communicator
    # Projections whose weight is a kernels.quant.PackedWeight (FP8 / INT4, issue 42) in norm_linear, linear and
    # act_linear; a backend without it is refused such a model in one line (runtime/packed_load.py).
    packed_weights: bool = False

    def missing(self, needs: frozenset[str] | set[str]) -> list[str]:
        """The needed features this backend has no kernels for, in FEATURES order."""
        return [f for f in FEATURES if f in needs and f not in self.features]



class Communicator(Protocol):
    """Tensor parallelism's collectives (envex.runtime.parallel.comm): every rank calls each one in the same order
    with the same shapes, eagerly or inside the same captured graph."""

    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, as a new tensor (the same bits on every rank). Not launched with
        programmatic dependent launch: at 70B TP=2 that measured no faster (verify/lab/journal-kernels.md)."""
        ...

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual) in one pass, or None where this size
        has no fused path (the caller then reduces and norms separately)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] on each rank -> [N, W * D], rank r's columns at r * D."""
        ...


class Ops(Protocol):
    """The fused entry points a model file calls. Shapes: x [T, H]; residual [T, H] or None (the first layer).

    What `linear` and `act_linear` return is "hidden": the model hands it to the next `norm_linear` or `moe`, or
    returns it from its forward, and reads nothing else of it. A backend may keep it in its own form until then
    (TritonOps: a split-K product's float32 partials, summed by the next norm's launch); `materialize(hidden,
    dtype)` gives its [T, H] rows, for a caller that indexes them."""

    name: str

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, comm: Communicator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(linear(rms_norm(x + residual)), x + residual); with residual None, (linear(rms_norm(x)), x).
        comm: x is this rank's partial sum (a row-parallel projection's output): it is all-reduced first."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias), as hidden (above)."""
        ...

    def act_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """linear(silu(gate) * up) for the fused gate-up row [gate | up], as hidden (above)."""
        ...

    def materialize(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """hidden as [T, H] rows: a backend's own form summed into dtype (the model's); rows are returned as they
        are."""
        ...

    def attention(self, qkv: torch.Tensor, k_cache: torch.Tensor | PackedKVCache, v_cache: torch.Tensor | None,
                  meta: AttentionMetadata, layer: AttentionLayer) -> torch.Tensor:  # fmt: skip
        """qkv [T, (Hq + 2 Hkv) D] un-rotated -> attention output [T, Hq D]; writes this step's K/V into the cache:
        k_cache and v_cache [num_blocks, block_size, Hkv, D], or k_cache a PackedKVCache (kv_quant_format.py: K and
        V packed as int4 or fp8, written and read packed) with v_cache None. A model file passes its layer's cache
        pair as the engine made it (`*kv_cache`) and never looks inside."""
        ...

    def moe(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
            router_weight: torch.Tensor, router_bias: torch.Tensor | None, experts: MoEWeights, top_k: int
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(moe(rms_norm(x + residual)), x + residual): router logits = linear(h, router_weight, router_bias), the
        top_k experts of each token weighted by the softmax of their logits (reference.moe_route, with
        experts.renormalize), each expert down(act(gate_up(h))) (reference.moe_activation, experts.activation).
        With experts.scoring not "softmax": DeepSeek's routing (MoEWeights.deepseek_route), shared experts included."""
        ...

    def linear_attention(self, mixed: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor,
                         meta: AttentionMetadata, layer: LinearAttentionLayer) -> torch.Tensor:  # fmt: skip
        """A Gated DeltaNet layer between its projections: mixed [T, conv_dim + 2 value_dim + 2 Hv] (the input
        projection's row, LinearAttentionLayer) -> [T, Hv Dv], out_proj's input: causal conv1d + SiLU over q|k|v,
        the gated delta rule, RMSNorm(o)·w·silu(z). Each sequence continues from its slot (meta.state_slots) of
        state_pool [slots, Hv, Dk, Dv] (float32) and conv_pool [slots, K-1, conv_dim], or from zeros where
        meta.state_initialized is 0, and leaves its state there."""
        ...

    def mla_attention(self, q: torch.Tensor, kv_a: torch.Tensor, latent_cache: torch.Tensor,
                      meta: AttentionMetadata, layer: MLALayer) -> torch.Tensor:  # fmt: skip
        """Multi-head latent attention: q [T, H (nope + rope)] (q_b_proj's or q_proj's output, un-rotated), kv_a
        [T, rank + rope] (kv_a_proj_with_mqa's) -> [T, H v], o_proj's input; writes this step's latent rows
        (kv_a_layernorm, rotary) into latent_cache [num_blocks, block_size, rank + rope]."""
        ...


def split_qkv(qkv: torch.Tensor, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, Hq, D], k and v [T, Hkv, D] of the fused QKV output."""
    q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    return (q.reshape(-1, layer.num_heads, layer.head_dim), k.reshape(-1, layer.num_kv_heads, layer.head_dim),
            v.reshape(-1, layer.num_kv_heads, layer.head_dim))  # fmt: skip

