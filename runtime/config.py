"""Model configuration: one frozen dataclass built from an HF config.json (or GGUF metadata mapped onto it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
}
GPT_OSS = "GptOssForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
# What HF's GptOssConfig fills in when config.json leaves it out (configuration_gpt_oss.py).
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
QUANT_METHODS = ("mxfp4",)


class ConfigError(ValueError):
    """A model's configuration cannot be served; the message says which field and what to do."""


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
            if src.get("mscale") or src.get("mscale_all_dim"):
                raise ConfigError("config.json: yarn with mscale/mscale_all_dim is not supported; supported: "
                                  "factor, beta_fast, beta_slow, truncate, attention_factor")
            factor = src.get("factor")
            original = src.get("original_max_position_embeddings")
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
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
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


def _qwen3_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's MoE fields from its config.json, with HF Qwen3MoeConfig's defaults (transformers 5 writes
    num_experts as num_local_experts). A layer is sparse unless listed in mlp_only_layers or off the
    decoder_sparse_step (HF Qwen3MoeDecoderLayer: sparse where (i + 1) % step == 0)."""
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
    if cfg.get("quantization_config"):
        raise ConfigError("config.json: quantized Qwen3-MoE checkpoints are not supported yet; use the bf16 or "
                          "float32 checkpoint")  # fmt: skip
    dense_layers = tuple(i for i in range(layers) if i in dense or (i + 1) % step)
    return dict(moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=width, activation="silu",
                              norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense_layers))
