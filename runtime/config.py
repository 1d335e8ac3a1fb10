"""Model configuration: one frozen dataclass built from an HF config.json (or GGUF metadata mapped onto it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# defined in runtime/errors.py (quant_config.py, which this module calls, raises it too); read from here
from envex.runtime.errors import ConfigError as ConfigError

# architectures name -> (qkv bias default, q/k norm). The Llama family shares one model file (models/llama.py)
# and differs only in these switches, read from the config where it states them; gpt-oss has its own file
# (models/gpt_oss.py) and the MoE, sink, window and quantization fields below; Qwen3-MoE (models/qwen3_moe.py) is
# Qwen3's attention with MoE fields of its own.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "GptOssForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "DeepseekV3ForCausalLM": (False, False),
    "DeepseekV2ForCausalLM": (False, False),
    "Qwen3NextForCausalLM": (False, True),
}
GPT_OSS = "GptOssForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
# DeepSeek's architecture (models/deepseek.py): multi-head latent attention (MLAConfig) and DeepSeek's MoE routing.
DEEPSEEK_V3, DEEPSEEK_V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"
DEEPSEEK = (DEEPSEEK_V3, DEEPSEEK_V2)
# Qwen3-Next (models/qwen3_next.py): Gated DeltaNet layers beside gated full attention (HybridConfig), Qwen3-MoE's
# routing plus a sigmoid-gated shared expert.
QWEN3_NEXT = "Qwen3NextForCausalLM"
# What HF's GptOssConfig fills in when config.json leaves it out (configuration_gpt_oss.py).
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
QUANT_METHODS = ("mxfp4",)


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 style frequency scaling ("rope_type": "llama3"); None on the config means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN ("rope_type": "yarn"), as transformers' _compute_yarn_parameters reads it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # cos/sin multiplier; None: 0.1·ln(factor) + 1


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts MLP: a layer routes each token to top_k of num_experts experts, each
    intermediate_size wide (gpt-oss: every layer; Qwen3-MoE: all but dense_layers)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    activation: str  # kernels.ops.MoEWeights.activation: "swiglu_oai" (gpt-oss) or "silu" (Qwen3-MoE)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # the chosen experts' weights sum to 1 (Qwen3-MoE's norm_topk_prob; gpt-oss always); False: their share of
    # the softmax over all experts
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (ModelConfig.intermediate_size wide) instead
    # DeepSeek's routing (reference.deepseek_v3_routing / deepseek_v2_routing); "softmax": reference.moe_route.
    # "sigmoid" (V3): choose by score + e_score_correction_bias among topk_group of n_group groups; "softmax_greedy"
    # / "softmax_group_limited" (V2). The chosen weights are multiplied by routed_scaling_factor.
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0  # always-on experts, each intermediate_size wide (DeepSeek's shared_experts MLP, split)
    # FP8 experts (a quantization_config "fp8" checkpoint, runtime/quant_config.moe_experts): the layers whose
    # experts are stored FP8 with fp8_block (rows, cols) block scales, loaded and served so (kernels.ops.MoEWeights);
    # the other sparse layers' experts are float (left so by modules_to_not_convert). Here and in int4_layers,
    # DeepSeek's multi-token-prediction layers (num_hidden_layers, ...: models/deepseek.py DeepseekMTP) too, and
    # (fp8_layers only) Qwen3-Next's one, index num_hidden_layers (models/qwen3_next.py Qwen3NextMTP).
    fp8_block: tuple[int, int] | None = None
    fp8_layers: tuple[int, ...] = ()
    # INT4 experts (compressed-tensors pack-quantized: Kimi K2; AWQ): the layers whose routed experts are stored in
    # groups of int4_group inputs (int4_zero: with zero points), loaded into kernels.quant.Int4GroupStack's layout;
    # int4_shared: DeepSeek's shared experts are INT4 too (else float, served beside the routed ones: Kimi K2).
    int4_group: int = 0
    int4_zero: bool = False
    int4_layers: tuple[int, ...] = ()
    int4_shared: bool = True
    int4_scale_dtype: str | None = None  # the scales as stored where fixed (AWQ: float16); None: the model dtype


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): q through a LoRA (q_a_proj, q_a_layernorm, q_b_proj) or one
    q_proj (q_lora_rank None); K/V compressed to kv_lora_rank plus one shared rotary key of qk_rope_head_dim, cached
    as one row per token (kernels/mla.py)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved: bool  # rope pairs (x0, x1), (x2, x3)...: V3's rope_interleave, always for V2 (complex rotation)
    softmax_scale: float  # (nope + rope)^-1/2 · yarn mscale(factor, mscale_all_dim)², as HF's yarn_apply_mscale


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Qwen3-Next's hybrid layers (offline_docs/hybrid.md): Gated DeltaNet (linear attention) layers, each with a
    fixed-size per-sequence state, and gated full-attention layers that rotate only the first rotary_dim dims of
    each head (partial_rotary_factor); every MoE layer adds a shared expert of shared_expert_size, gated per token."""

    linear_layers: tuple[int, ...]  # the Gated DeltaNet layers; the others are full attention
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int  # linear_conv_kernel_dim
    rotary_dim: int
    shared_expert_size: int
    # An FP8 release (quantization_config "fp8"): the layers whose projections (qwen3_next_projections) are all
    # stored FP8 in MoEConfig.fp8_block blocks, loaded and served so (kernels.quant.PackedWeight); the MTP layer's
    # index num_hidden_layers too where the config quantizes it so. A layer not listed is dequantized at load.
    fp8_layers: tuple[int, ...] = ()

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v of every head, packed."""
        return 2 * self.key_dim + self.value_dim


def qwen3_next_projections(linear: bool, sparse: bool) -> tuple[str, ...]:
    """A Qwen3-Next layer's projections an FP8 release stores FP8 beside its routed experts, as HF names after the
    layer's prefix: the Gated DeltaNet's in_proj_qkvz and out_proj (linear) or the gated attention's q/k/v/o, and the
    shared expert's gate/up/down (sparse) or the dense MLP's. The router, the shared-expert gate and in_proj_ba are
    float in the release (its modules_to_not_convert) and stay so."""
    mixer = ("in_proj_qkvz", "out_proj") if linear else ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp = "mlp.shared_expert." if sparse else "mlp."
    return (*(f"{'linear_attn' if linear else 'self_attn'}.{m}" for m in mixer),
            *(f"{mlp}{p}_proj" for p in ("gate", "up", "down")))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # gpt-oss. sliding_window above caps every layer (and, unimplemented, the served length); layer_windows gives
    # each layer its own window (None: full attention), which the attention kernels implement.
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False
    moe: MoEConfig | None = None
    quantization: str | None = None  # "mxfp4": the MoE experts are stored packed (kernels/mxfp4.py)
    rope_yarn: YarnScaling | None = None
    mla: MLAConfig | None = None  # DeepSeek: head_dim is then qk_rope_head_dim (the rotary tables' width), as HF
    hybrid: HybridConfig | None = None  # Qwen3-Next
    # Multi-token-prediction layers (num_nextn_predict_layers), read only by the MTP drafter (draft_model "mtp"):
    # DeepSeek-V3's, stored as model.layers.{N}.* after the last (models/deepseek.py DeepseekMTP); Qwen3-Next's, as
    # mtp.* (models/qwen3_next.py Qwen3NextMTP; 1 where config.json has no such key, as its published ones: the
    # module's loader refuses a checkpoint without the tensors).
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF config.json; unknown architectures get a clear error listing ours."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"config.json: architectures {archs or '(missing)'} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        bias_default, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ConfigError(f"config.json: {key} must be a positive integer, got {cfg.get(key)!r}")
        heads = cfg["num_attention_heads"]
        # transformers 5 moved rope settings under "rope_parameters"; older configs keep them at top level.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if arch == GPT_OSS and not rope and not legacy:
            rope = dict(_GPT_OSS_ROPE)
        if arch == GPT_OSS:
            rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 150000.0)))
        rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
        scaling = None
        yarn = None
        if rope_type == "llama3":
            src = {**legacy, **rope}
            scaling = RopeScaling(
                factor=float(src["factor"]),
                low_freq_factor=float(src["low_freq_factor"]),
                high_freq_factor=float(src["high_freq_factor"]),
                original_max_position_embeddings=int(src["original_max_position_embeddings"]),
            )
        elif rope_type == "yarn":
            src = {**legacy, **rope}
            if arch not in DEEPSEEK and (src.get("mscale") or src.get("mscale_all_dim")):
                raise ConfigError("config.json: yarn with mscale/mscale_all_dim is not supported; supported: "
                                  "factor, beta_fast, beta_slow, truncate, attention_factor")
            factor = src.get("factor")
            original = src.get("original_max_position_embeddings")
            if arch in DEEPSEEK and src.get("attention_factor") is None and src.get("mscale") and src.get(
                    "mscale_all_dim") and isinstance(factor, int | float):  # HF _compute_yarn_parameters
                src["attention_factor"] = _yarn_mscale(factor, src["mscale"]) / _yarn_mscale(factor,
                                                                                           src["mscale_all_dim"])
            if not isinstance(factor, int | float) or not isinstance(original, int):
                raise ConfigError("config.json: yarn rope scaling needs a numeric factor and an integer "
                                  "original_max_position_embeddings")
            yarn = YarnScaling(
                factor=float(factor), original_max_position_embeddings=original,
                beta_fast=float(src.get("beta_fast") or 32.0), beta_slow=float(src.get("beta_slow") or 1.0),
                truncate=bool(src.get("truncate", True)),
                attention_factor=None if src.get("attention_factor") is None else float(src["attention_factor"]),
            )  # fmt: skip
        elif rope_type != "default":
            raise ConfigError(
                f"config.json: rope type {rope_type!r} is not supported; supported: default, llama3, yarn"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        extra = _gpt_oss_fields(cfg) if arch == GPT_OSS else _qwen3_moe_fields(cfg) if arch == QWEN3_MOE else {}
        if arch in DEEPSEEK:
            extra = _deepseek_fields(cfg, arch, {**legacy, **rope} if rope_type == "yarn" else {})
        if arch == QWEN3_NEXT:
            extra = _qwen3_next_fields(cfg, rope_type, {**legacy, **rope})
        if arch == GPT_OSS:
            sliding = None  # per layer, in layer_windows
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=(extra["mla"].qk_rope_head_dim if "mla" in extra
                      else cfg.get("head_dim") or cfg["hidden_size"] // heads),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", bias_default)),
            qk_norm=qk_norm,
            sliding_window=sliding if isinstance(sliding, int) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_yarn=yarn,
            **extra,
        )


def _gpt_oss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The gpt-oss fields of ModelConfig from its config.json, with HF GptOssConfig's defaults."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(f"config.json: layer_types must list {layers} of 'sliding_attention' / 'full_attention'")
    window = cfg.get("sliding_window", 128)
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 128))
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4))
    if not isinstance(experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"config.json: num_experts_per_tok ({top_k!r}) must be in 1..num_local_experts "
                          f"({experts!r})")  # fmt: skip
    quant = cfg.get("quantization_config") or None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method is not None and method not in QUANT_METHODS:
        raise ConfigError(f"config.json: quantization {method!r} is not supported for gpt-oss; supported: "
                          f"{', '.join(QUANT_METHODS)} (or none)")  # fmt: skip
    if method == "mxfp4" and (cfg["hidden_size"] % 32 or cfg["intermediate_size"] % 32):
        raise ConfigError("config.json: mxfp4 experts need hidden_size and intermediate_size divisible by 32")
    return dict(
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attention_sinks=True,
        moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=cfg["intermediate_size"],
                      activation="swiglu_oai", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(cfg.get("swiglu_limit", 7.0))),
        quantization=method,
    )


def _qwen3_moe_fields(cfg: dict[str, Any], mtp: int = 0, mtp_prefix: str | None = None) -> dict[str, Any]:
    """Qwen3-MoE's MoE fields from its config.json, with HF Qwen3MoeConfig's defaults (transformers 5 writes
    num_experts as num_local_experts). A layer is sparse unless listed in mlp_only_layers or off the
    decoder_sparse_step (HF Qwen3MoeDecoderLayer: sparse where (i + 1) % step == 0). mtp, mtp_prefix: MTP layers
    whose quantized experts to list too (_quantized_experts; Qwen3-Next's)."""
    layers = cfg["num_hidden_layers"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    top_k = cfg.get("num_experts_per_tok", 8)
    width = cfg.get("moe_intermediate_size", 768)
    step = cfg.get("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(experts, int) or experts < 1 or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"config.json: num_experts_per_tok ({top_k!r}) must be in 1..num_experts ({experts!r})")
    if not isinstance(width, int) or width < 1:
        raise ConfigError(f"config.json: moe_intermediate_size must be a positive integer, got {width!r}")
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise ConfigError(f"config.json: mlp_only_layers must list layer indices in 0..{layers - 1}, got {dense!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported for Qwen3-MoE; "
                          "supported: silu")  # fmt: skip
    dense_layers = tuple(i for i in range(layers) if i in dense or (i + 1) % step)
    packed = _quantized_experts(cfg, layers, dense_layers, experts, mtp=mtp, mtp_prefix=mtp_prefix)
    return dict(moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=width, activation="silu",
                              norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense_layers,
                              **packed))


def _quantized_experts(cfg: dict[str, Any], layers: int, dense: tuple[int, ...], experts: int, shared: bool = False,
                       mtp: int = 0, mtp_prefix: str | None = None) -> dict[str, Any]:  # fmt: skip
    """A quantized MoE checkpoint's FP8 or INT4 experts as MoEConfig's fields (runtime/quant_config.moe_experts; one
    ConfigError for a scheme the expert kernels do not read). shared: DeepSeek's shared_experts MLP, loaded as more
    experts (or beside them, float, next to INT4 routed experts). mtp: DeepSeek's multi-token-prediction layers after
    the model's (MoE layers), listed where the config quantizes their experts as the model's (from the config alone,
    as the model's layers: a checkpoint without their tensors serves as before); a config that would put them in
    another scheme leaves them out rather than refusing a model that serves without them (their quantized experts
    are then dequantized at load into float ones, runtime/packed_load.load_mtp_weights). mtp_prefix: where the
    checkpoint names the MTP layers (Qwen3-Next's "mtp.layers.": the j-th is module mtp.layers.j, index layers + j
    here); None: as more of the model's layers (DeepSeek's model.layers.{layers + j})."""
    if not cfg.get("quantization_config"):
        return {}
    from envex.kernels import quant
    from envex.runtime.quant_config import moe_experts  # (quant_config imports runtime.errors, not this module)

    names = [f"experts.{e}.{p}_proj" for e in range(experts) for p in ("gate", "up", "down")]
    sparse = [i for i in range(layers + mtp) if i not in dense]
    prefix = {i: f"{mtp_prefix}{i - layers}" if i >= layers and mtp_prefix else f"model.layers.{i}" for i in sparse}
    side = {i: [f"{prefix[i]}.mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")] for i in sparse}
    routed = {i: [f"{prefix[i]}.mlp.{n}" for n in names] for i in sparse}
    found = moe_experts(cfg, {i: m for i, m in routed.items() if i < layers}, side if shared else None)
    if mtp:
        try:
            found = moe_experts(cfg, routed, side if shared else None)
        except ConfigError:
            pass  # the MTP layers' experts are float (docstring); the model's were read above
    if found.scheme is None:
        return {}
    if found.scheme.kind == quant.INT4_GROUP:
        return dict(int4_group=found.scheme.group_size, int4_zero=not found.scheme.symmetric, int4_layers=found.layers,
                    int4_shared=found.shared_packed,
                    int4_scale_dtype="float16" if found.scheme.layout == "awq-gemm" else None)  # fmt: skip
    return dict(fp8_block=found.scheme.block, fp8_layers=found.layers)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's 0.1·mscale·ln(factor) + 1 (1 for factor ≤ 1): HF's yarn_get_mscale, DeepSeek's yarn_get_mscale."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _positive(cfg: dict[str, Any], key: str, default: Any = None) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _deepseek_fields(cfg: dict[str, Any], arch: str, yarn: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3's MLA and MoE fields from its config.json, with HF DeepseekV3Config's / DeepseekV2Config's
    defaults. Layers below first_k_dense_replace are dense (HF: layer_idx >= first_k_dense_replace is MoE)."""
    v3 = arch == DEEPSEEK_V3
    layers = cfg["num_hidden_layers"]
    q_lora = cfg.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = _positive(cfg, "q_lora_rank")
    rank, nope = _positive(cfg, "kv_lora_rank", 512), _positive(cfg, "qk_nope_head_dim", 128)
    rope, v_dim = _positive(cfg, "qk_rope_head_dim", 64), _positive(cfg, "v_head_dim", 128)
    if rope % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim must be even, got {rope}")
    experts = _positive(cfg, "n_routed_experts", 256 if v3 else 64)
    top_k = cfg.get("num_experts_per_tok", 8 if v3 else None)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"config.json: num_experts_per_tok ({top_k!r}) must be in 1..n_routed_experts ({experts})")
    shared = cfg.get("n_shared_experts", 1 if v3 else 2) or 0
    first_dense = cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0
    if not isinstance(shared, int) or shared < 0 or not isinstance(first_dense, int) or not 0 <= first_dense <= layers:
        raise ConfigError(f"config.json: n_shared_experts ({shared!r}) must be ≥ 0 and first_k_dense_replace "
                          f"({first_dense!r}) in 0..{layers}")  # fmt: skip
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"config.json: moe_layer_freq {cfg['moe_layer_freq']!r} is not supported; supported: 1 "
                          "(every layer from first_k_dense_replace on is MoE, as HF builds it)")  # fmt: skip
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring_func = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    supported = {("noaux_tc", "sigmoid"): "sigmoid"} if v3 else {("greedy", "softmax"): "softmax_greedy",
                                                                 ("group_limited_greedy", "softmax"):
                                                                 "softmax_group_limited"}  # fmt: skip
    if (method, scoring_func) not in supported:
        raise ConfigError(f"config.json: topk_method {method!r} with scoring_func {scoring_func!r} is not supported "
                          f"for {arch}; supported: {', '.join(f'{m} with {s}' for m, s in supported)}")  # fmt: skip
    grouped = method != "greedy"
    n_group = _positive(cfg, "n_group", 8) if grouped else 1
    topk_group = _positive(cfg, "topk_group", 4) if grouped else 1
    if experts % n_group or topk_group > n_group or (v3 and experts // n_group < 2):
        raise ConfigError(f"config.json: n_group {n_group} must divide n_routed_experts {experts} (V3: into groups "
                          f"of two or more) and topk_group {topk_group} must be ≤ n_group")  # fmt: skip
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported for {arch}; "
                          "supported: silu")  # fmt: skip
    if cfg.get("attention_bias"):
        raise ConfigError(f"config.json: attention_bias true is not supported for {arch}; no published checkpoint "
                          "has it")  # fmt: skip
    inter = _positive(cfg, "moe_intermediate_size", 2048 if v3 else 1407)
    mtp = _mtp_layers(cfg, 0) if v3 else 0
    packed = _quantized_experts(cfg, layers, tuple(range(first_dense)), experts, shared=shared > 0, mtp=mtp)
    block = packed.get("fp8_block")
    if block is not None and shared > 1 and (inter % block[0] or inter % block[1]):
        raise ConfigError(f"config.json: moe_intermediate_size {inter} is not a whole number of FP8 blocks "
                          f"{list(block)}, which splitting {shared} shared experts needs; serve a bf16 checkpoint")
    group = packed.get("int4_group", 0)
    if group and (inter % 8 or packed["int4_shared"] and shared > 1 and inter % group):
        raise ConfigError(f"config.json: moe_intermediate_size {inter} is not a whole number of INT4 groups of "
                          f"{group} (and words of 8), which the INT4 experts need; serve a bf16 checkpoint")
    scale = (nope + rope) ** -0.5
    if yarn.get("mscale_all_dim"):  # HF yarn_apply_mscale: the scale of the whole q·k, not only the rotary dims
        scale *= _yarn_mscale(float(yarn["factor"]), float(yarn["mscale_all_dim"])) ** 2
    routed_scale = cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)
    return dict(
        mtp_layers=mtp,
        mla=MLAConfig(q_lora_rank=q_lora, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                      v_head_dim=v_dim, interleaved=bool(cfg.get("rope_interleave", True)) if v3 else True,
                      softmax_scale=scale),
        moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, activation="silu",
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
                      dense_layers=tuple(range(first_dense)), scoring=supported[(method, scoring_func)],
                      n_group=n_group, topk_group=topk_group, routed_scaling_factor=float(routed_scale),
                      shared_experts=shared, **packed),
    )  # fmt: skip


def _qwen3_next_fields(cfg: dict[str, Any], rope_type: str, rope: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's fields from its config.json, with HF Qwen3NextConfig's defaults: the MoE as Qwen3-MoE's (plus
    shared_expert_intermediate_size) and the hybrid layers (layer_types, or every full_attention_interval-th layer
    full attention)."""
    layers = cfg["num_hidden_layers"]
    interval = _positive(cfg, "full_attention_interval", 4)
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                       for i in range(layers)]  # fmt: skip
    if len(types) != layers or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ConfigError(f"config.json: layer_types must list {layers} of 'linear_attention' / 'full_attention'")
    if rope_type != "default":
        raise ConfigError(f"config.json: rope type {rope_type!r} is not supported for Qwen3-Next; supported: default")
    head_dim = _positive(cfg, "head_dim", 256)
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    rotary_dim = int(head_dim * factor) if isinstance(factor, int | float) else 0
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"config.json: partial_rotary_factor {factor!r} must give an even number of rotary dims "
                          f"in 2..head_dim ({head_dim})")  # fmt: skip
    num_k, num_v = _positive(cfg, "linear_num_key_heads", 16), _positive(cfg, "linear_num_value_heads", 32)
    if num_v % num_k:
        raise ConfigError(f"config.json: linear_num_value_heads ({num_v}) must be a multiple of linear_num_key_heads "
                          f"({num_k})")  # fmt: skip
    width = _positive(cfg, "linear_conv_kernel_dim", 4)
    if not 2 <= width <= 4:
        raise ConfigError(f"config.json: linear_conv_kernel_dim {width} is not supported; supported: 2..4")
    if cfg.get("attention_bias"):
        raise ConfigError("config.json: attention_bias true is not supported for Qwen3-Next; no published checkpoint "
                          "has it")  # fmt: skip
    mtp = _mtp_layers(cfg, 1)
    # a quantized checkpoint's FP8 experts (the model's layers', and the one MTP layer Qwen3NextMTP reads, index
    # num_hidden_layers, where the config quantizes it); its other FP8 projections too (HybridConfig.fp8_layers)
    moe = _qwen3_moe_fields({**cfg, "num_experts": cfg.get("num_experts", 512),
                             "num_experts_per_tok": cfg.get("num_experts_per_tok", 10),
                             "moe_intermediate_size": cfg.get("moe_intermediate_size", 512),
                             "norm_topk_prob": cfg.get("norm_topk_prob", True)},
                            mtp=min(mtp, 1), mtp_prefix="mtp.layers.")["moe"]  # fmt: skip
    if moe.int4_layers:
        raise ConfigError("config.json: INT4 experts are not supported for Qwen3-Next yet; serve its FP8 release "
                          "(quant_method fp8) or the bf16 checkpoint")  # fmt: skip
    hybrid = HybridConfig(linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                          num_k_heads=num_k, num_v_heads=num_v, head_k_dim=_positive(cfg, "linear_key_head_dim", 128),
                          head_v_dim=_positive(cfg, "linear_value_head_dim", 128), conv_width=width,
                          rotary_dim=rotary_dim,
                          shared_expert_size=_positive(cfg, "shared_expert_intermediate_size", 512),
                          fp8_layers=_qwen3_next_fp8_layers(cfg, types, moe, min(mtp, 1)))  # fmt: skip
    return dict(moe=moe, hybrid=hybrid, mtp_layers=mtp)


def _qwen3_next_fp8_layers(cfg: dict[str, Any], types: list[str], moe: MoEConfig, mtp: int) -> tuple[int, ...]:
    """HybridConfig.fp8_layers: of the model's layers and its MTP layer (index len(types), module mtp.layers.0,
    full attention and sparse), those whose projections (qwen3_next_projections) the config makes FP8 in the
    experts' blocks, every one of them (from the config alone, as MoEConfig.fp8_layers)."""
    if moe.fp8_block is None:
        return ()
    from envex.kernels import quant
    from envex.runtime.quant_config import FP8_DEEPSEEK, quant_config_from_hf

    qc = quant_config_from_hf(cfg)
    assert qc is not None, "fp8_block comes from a quantization_config"
    n, layers = len(types), []
    for i in range(n + mtp):
        prefix = f"model.layers.{i}" if i < n else "mtp.layers.0"
        names = qwen3_next_projections(i < n and types[i] == "linear_attention", i not in moe.dense_layers)
        schemes = [qc.scheme_for(f"{prefix}.{m}") for m in names]
        if all(s is not None and s.kind == quant.FP8_BLOCK and s.layout == FP8_DEEPSEEK and s.block == moe.fp8_block
               for s in schemes):  # fmt: skip
            layers.append(i)
    return tuple(layers)


def _mtp_layers(cfg: dict[str, Any], default: int) -> int:
    """num_nextn_predict_layers (or HF DeepseekV3Config's alias num_mtp_layers); default where neither is set."""
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers"))
    mtp = default if mtp is None else mtp
    if not isinstance(mtp, int) or mtp < 0:
        raise ConfigError(f"config.json: num_nextn_predict_layers must be an integer ≥ 0, got {mtp!r}")
    return mtp
