"""Engine settings: one frozen dataclass, built from CLI options or a launch manifest, resolved once for the device
and the model (`EngineConfig.resolved`), and passed down. Nothing below the engine reads a default of its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

from envex.kernels import backends
from envex.kernels.kv_quant_format import KV_CACHE_DTYPES
from envex.kernels.ops import SLIDING_WINDOW
from envex.runtime.config import ModelConfig
from envex.runtime.loader import EMBEDDED_MODEL
from envex.runtime.models import MODEL_REGISTRY, model_features
from envex.runtime.weight_policy import policy_from_setting

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", *backends.NAMES)
# auto: the weights in the model's files; dummy: random weights of the right shapes and realistic magnitudes made
# on the device from config.json alone (for benchmarks: speed does not depend on the values; answers do).
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = EMBEDDED_MODEL
    served_name: str | None = None  # what /v1/models reports; default: the model's own name
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    backend: str = "auto"  # auto: triton on cuda, torch elsewhere
    load_format: str = "auto"
    max_model_len: int | None = None  # default: the model's window (or sliding window), capped at 32768
    max_num_seqs: int = 64
    # Tokens per step (prefill chunks plus decodes). None: see resolved().
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: from kv_cache_memory_gb (cpu) or free device memory (cuda)
    kv_cache_memory_gb: float = 1.0  # cpu only
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    # The KV cache's format (offline_docs/kv_cache.md): bf16, K and V as computed (in the activation dtype: float32
    # on the CPU); fp8 (e4m3, a bf16 scale per token and head: 1.97x bf16's tokens at head_dim 128) or int4 (groups
    # of 64 with a bf16 scale and zero, Hadamard-rotated: 3.56x), written packed and read packed by the attention
    # kernels. Sliding-window layers (gpt-oss) keep their own small pool in the activation dtype.
    kv_cache_dtype: str = "bf16"
    max_queue: int = 256  # waiting requests beyond this are refused (HTTP 429)
    seed: int = 0
    use_cuda_graphs: bool = True
    # Speculative decoding: at most this many drafted tokens verified per sequence and step (0: off). Exact:
    # greedy keeps a draft only where it equals the model's argmax, sampling uses rejection sampling. The depth
    # adapts per request to its acceptance and turns itself off where it does not pay (offline_docs/engine.md).
    # Off by default until chat traffic on the GPU measures within 3% of off (offline_docs/performance.md has the
    # fixed-length cases with speculation against the default).
    num_speculative_tokens: int = 0
    # A smaller model with the same tokenizer that drafts (None: n-gram prompt lookup, no model), or MTP ("mtp"): the
    # model's own multi-token-prediction module (DeepSeek-V3/R1, Qwen3-Next; spec/mtp.py). Setting it turns speculation
    # on (a num_speculative_tokens of 0 then resolves to 4).
    draft_model: str | None = None
    # Speculate only in steps of at most this many sequences (None: 32 on CUDA, 8 on CPU); above it a step's extra
    # rows cost more than the drafts save. Verify graphs are captured up to it.
    speculative_max_batch: int | None = None
    # Overlapped scheduling: schedule and launch step N+1 before reading step N's sampled tokens (None: on for
    # CUDA, where host work then hides behind device work; on CPU it only delays outputs by a step).
    async_scheduling: bool | None = None
    # Compile the kernels' variants at start with a few throwaway requests (None: on for CUDA; see warm_up).
    warm_up: bool | None = None
    # Batch-invariant kernels: a sequence's tokens do not depend on its batch, its place in it, prefix-cache hits,
    # chunk boundaries, preemption or overlap (offline_docs/engine.md). The mode is on by default only for a model
    # where, in one run through `envex serve` on the GPU, it clears every limit of DETERMINISTIC_BAR (below)
    # against the default kernels; no model has (the GPU acceptance matrix's table in offline_docs/performance.md
    # carries the figures), so None resolves to off everywhere and the admin chooses it (`envex-install
    # --deterministic`, then the gates require it). Asked for, it runs on the CPU (the torch backend's invariant
    # forms, slowly), with the triton backend on CUDA and under tensor parallelism; it is refused with the torch
    # backend on CUDA (cuBLAS picks kernels by shape) and for gpt-oss (no batch-invariant MoE, sink or window
    # attention kernels yet).
    deterministic: bool | None = None
    # Tensor parallelism: the model split over this many GPUs of one host, one process each (rank 0 is this
    # process: scheduler, sampler, server; runtime/parallel/). 1: one GPU holds the whole model.
    tensor_parallel: int = 1
    # Low-bit weights for a float model (offline_docs/quantization.md): a weights policy (runtime/weight_policy.py),
    # a scheme name ("fp8_channel", "int4_g128_sym", ...) or the policy's JSON text, by which the projections are
    # quantized at load and served packed. None: as the checkpoint stores them (a quantized one is served packed).
    weights: str | None = None

    def __post_init__(self) -> None:
        if self.weights is not None:  # a scheme name as given, a policy as its canonical JSON text
            policy = policy_from_setting(self.weights)  # PolicyError (a ValueError): one line
            if self.weights.lstrip().startswith("{"):
                object.__setattr__(self, "weights", policy.label)
        for name, allowed in (("device", DEVICES), ("dtype", DTYPES), ("backend", BACKENDS),
                               ("load_format", LOAD_FORMATS), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens: must be in 0..16, got {self.num_speculative_tokens}")
        if self.draft_model is not None and not self.draft_model.strip():
            raise ValueError("draft_model: must name a model (a directory, a .gguf file or the embedded name)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queue", "speculative_max_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.98:
            raise ValueError(f"gpu_memory_utilization: must be in [0.05, 0.98], got {self.gpu_memory_utilization}")
        if not 1 <= self.tensor_parallel <= MAX_TENSOR_PARALLEL:
            raise ValueError(f"tensor_parallel: must be in 1..{MAX_TENSOR_PARALLEL} (GPUs of one host), got "
                             f"{self.tensor_parallel}")  # fmt: skip
        if self.tensor_parallel > 1 and (self.num_speculative_tokens or self.draft_model):
            raise ValueError("tensor_parallel: speculative decoding does not run under tensor parallelism yet; drop "
                             "--speculative-tokens/--draft-model or use --tensor-parallel 1")  # fmt: skip

    def resolved(self, *, window: int, cuda_available: bool, gpus: int | None = None,
                 architecture: str | None = None) -> EngineConfig:
        """Every setting made concrete for this device and a model whose servable context is `window` tokens
        (model_window): the one place where defaults are decided. The engine runs on the result, and the
        installer records it in launch.json (from the model card, without loading the weights). gpus: how many
        CUDA devices this process sees (None: not checked). architecture: the model's (ModelConfig.architecture),
        whose needs the backend must support (check_backend; None: taken as one that needs nothing)."""
        if self.device == "cuda" and not cuda_available:
            raise ValueError("device: cuda was asked for but no CUDA device is visible; use --device cpu")
        device = ("cuda" if cuda_available else "cpu") if self.device == "auto" else self.device
        cuda = device == "cuda"
        if cuda and gpus is not None and self.tensor_parallel > gpus:
            raise ValueError(f"tensor_parallel: {self.tensor_parallel} GPUs asked for but {gpus} visible; lower "
                             "--tensor-parallel")  # fmt: skip
        backend = ("triton" if cuda else "torch") if self.backend == "auto" else self.backend
        num_speculative_tokens = self.num_speculative_tokens or (4 if self.draft_model else 0)
        refusal = check_backend(backend, device, deterministic=bool(self.deterministic), architecture=architecture,
                                speculation=num_speculative_tokens > 0, tensor_parallel=self.tensor_parallel > 1)
        if refusal is None:
            refusal = check_kv_cache_dtype(self.kv_cache_dtype, deterministic=bool(self.deterministic),
                                           architecture=architecture, tensor_parallel=self.tensor_parallel > 1)
        if refusal is None and self.weights is not None:
            refusal = check_weights(self.weights, backend, deterministic=bool(self.deterministic),
                                    architecture=architecture, tensor_parallel=self.tensor_parallel > 1)
        if refusal is not None:
            raise ValueError(refusal)
        return replace(
            self,
            device=device,
            backend=backend,
            dtype=("bfloat16" if cuda else "float32") if self.dtype == "auto" else self.dtype,
            max_model_len=min(self.max_model_len or min(window, _MAX_DEFAULT_LEN), window),
            # 8K-token steps on CUDA keep the prefill matmuls near the tensor-core peak (16K measured no faster,
            # with a later first token: verify/lab/journal.md); 2K on CPU.
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if cuda else 2048),
            use_cuda_graphs=self.use_cuda_graphs and backend == "triton",
            # Overlap hides host work behind device work; on the CPU it would only delay outputs by a step.
            # Verify steps keep their accepted counts on the device, so they overlap too (spec/decoder.py).
            async_scheduling=cuda if self.async_scheduling is None else self.async_scheduling,
            num_speculative_tokens=num_speculative_tokens,
            speculative_max_batch=self.speculative_max_batch or (32 if cuda else 8),
            warm_up=cuda if self.warm_up is None else self.warm_up,
            # off unless asked for: no model has met DETERMINISTIC_BAR (see the field)
            deterministic=bool(self.deterministic),
        )

    @property
    def kernels(self) -> backends.Backend:
        """The backend these settings choose (kernels/backends.py: `backend`, in its batch-invariant form when
        `deterministic`): what builds the model's Ops and states what they support."""
        return backends.backend(self.backend, deterministic=bool(self.deterministic))

    @property
    def is_resolved(self) -> bool:
        return (self.device != "auto" and self.backend != "auto" and self.dtype != "auto"
                and all(getattr(self, f.name) is not None for f in fields(self) if f.name in _RESOLVED))


_MAX_DEFAULT_LEN = 32768
MTP = "mtp"  # draft_model's value that drafts with the model's own multi-token-prediction module
MAX_TENSOR_PARALLEL = 8  # the GPUs of one NVLink host (and the one-shot all-reduce's limit)

# The most the deterministic mode may cost a model, against the default kernels measured in the same run through
# `envex serve` on the GPU, for the mode to be that model's default: a fraction (0.05: 5% slower; for TTFT, 5%
# later). Keys: the GPU acceptance matrix's cases (verify/lab/gpu_matrix.py). Until a model meets every limit, the mode
# is off by default for it (EngineConfig.deterministic).
DETERMINISTIC_BAR: Mapping[str, float] = MappingProxyType({
    "b1_1k": 0.05,  # tokens/s at batch 1, 1K-token prompts
    "b1_10k": 0.05,  # tokens/s at batch 1, 10K-token prompts
    "c64_1k": 0.10,  # output tokens/s at 64 concurrent requests of 1K-token prompts
    "ttft": 0.15,  # time to first token
})


def meets_deterministic_bar(costs: Mapping[str, float]) -> bool:
    """Whether the deterministic mode's measured costs (DETERMINISTIC_BAR's keys; fractions, 0.05 = 5% slower) are
    each within the bar. A figure not measured does not meet it; a key the bar does not have is a ValueError."""
    unknown = set(costs) - set(DETERMINISTIC_BAR)
    if unknown:
        raise ValueError(f"deterministic bar: unknown figures {sorted(unknown)}; known: {', '.join(DETERMINISTIC_BAR)}")
    return all(key in costs and costs[key] <= limit for key, limit in DETERMINISTIC_BAR.items())


_DEVICE_NAMES = {"cpu": "the CPU", "cuda": "CUDA"}


def check_backend(backend: str, device: str, *, deterministic: bool, architecture: str | None, speculation: bool,
                  tensor_parallel: bool) -> str | None:
    """The one place where a feature refuses another: what the backend (kernels/backends.py, with the deterministic
    mode its batch-invariant form) supports, against the device, what the model file of `architecture` needs
    (runtime/models, `features`) and the engine's optional parts. None when it can run; else the one-line refusal,
    with what to do."""
    chosen = backends.backend(backend, deterministic=deterministic)
    caps = chosen.capabilities
    if device not in caps.devices:
        if deterministic and device in backends.backend(backend).capabilities.devices:  # cuBLAS picks by shape
            where = " and ".join(_DEVICE_NAMES[d] for d in sorted(caps.devices))
            return (f"deterministic: the {backend} backend is batch-invariant on {where} only; use --backend triton "
                    "on cuda")
        return f"backend: {backend} needs a CUDA device; use --backend torch on cpu"
    needs = model_features(architecture) if architecture is not None else frozenset()
    missing = caps.missing(needs)
    if missing and deterministic:
        return (f"deterministic: {architecture} has no batch-invariant kernels yet ({', '.join(missing)}); serve it "
                "with --no-deterministic")
    if missing:
        return f"backend: {backend} has no kernels for {architecture}'s {', '.join(missing)}; use --backend torch"
    if speculation and SLIDING_WINDOW in needs:  # the window KV pool (window_kv.py) has no verify steps yet
        return (f"num_speculative_tokens: speculative decoding does not run with sliding-window layers "
                f"({architecture}) yet; set it to 0")
    if speculation and not caps.speculation:
        return f"num_speculative_tokens: speculative decoding does not run on {chosen.label}; set it to 0"
    if tensor_parallel and not caps.tensor_parallel:
        return f"tensor_parallel: {chosen.label} does not run under tensor parallelism; use --tensor-parallel 1"
    return None


def check_kv_cache_dtype(kv_cache_dtype: str, *, deterministic: bool, architecture: str | None,
                         tensor_parallel: bool) -> str | None:
    """What a packed KV cache (fp8, int4) cannot run with yet: None when it can; else the one-line refusal."""
    if kv_cache_dtype == "bf16":
        return None
    if architecture is not None and hasattr(MODEL_REGISTRY.get(architecture), "make_kv_caches"):
        # The model lays out its own cache (MLA's latent rows; make_kv_caches): no packed form of it yet.
        return (f"kv_cache_dtype: {kv_cache_dtype} is not available for {architecture}, whose model keeps a cache "
                "layout of its own; use --kv-cache-dtype bf16")
    if deterministic:
        return (f"kv_cache_dtype: {kv_cache_dtype} has no batch-invariant attention kernel yet; use "
                "--kv-cache-dtype bf16 with --deterministic, or --no-deterministic")
    if tensor_parallel:
        return (f"kv_cache_dtype: {kv_cache_dtype} has not been run under tensor parallelism yet; use "
                "--kv-cache-dtype bf16 or --tensor-parallel 1")
    return None


def check_weights(weights: str, backend: str, *, deterministic: bool, architecture: str | None,
                  tensor_parallel: bool) -> str | None:
    """What a weights policy (packed low-bit projections) cannot run with yet: None when it can; else one line."""
    chosen = backends.backend(backend, deterministic=deterministic)
    if not chosen.capabilities.packed_weights:
        return f"weights: {chosen.label} cannot read packed low-bit weights; drop --weights or --deterministic"
    if architecture is not None and MODEL_REGISTRY.get(architecture) is not MODEL_REGISTRY["LlamaForCausalLM"]:
        return (f"weights: packed low-bit weights are served for the Llama family only so far, not {architecture}; "
                "drop --weights")
    if tensor_parallel:
        return "weights: packed low-bit weights do not run under tensor parallelism yet; use --tensor-parallel 1"
    return None


def check_mtp(model: ModelConfig, name: str) -> None:
    """draft_model "mtp" (spec/mtp.py): refuse, in one line, a model without a multi-token-prediction module."""
    if not model.mtp_layers:
        raise ValueError(f"draft_model: 'mtp' needs a multi-token-prediction module, as DeepSeek-V3/R1 and "
                         f"Qwen3-Next ship (num_nextn_predict_layers ≥ 1 in config.json; Qwen3-Next's default 1); "
                         f"{name} ({model.architecture}) has none; drop --draft-model mtp")  # fmt: skip


def has_invariant_kernels(architecture: str) -> bool:
    """Whether the deterministic mode can serve this architecture (check_backend on the CPU, whose batch-invariant
    backend has the same kernels as the GPU's): the dense Llama family can; the MoE experts (gpt-oss, Qwen3-MoE)
    and gpt-oss's attention sinks and windows have no batch-invariant kernels yet."""
    return not backends.backend("torch", deterministic=True).capabilities.missing(model_features(architecture))


def model_window(model: ModelConfig) -> int:
    """The context a model can be served at: its position limit, or its sliding window where the model has one
    (no sliding-window attention in the Llama family yet, so such a model is served within the window)."""
    if model.sliding_window:
        return min(model.max_position_embeddings, model.sliding_window)
    return model.max_position_embeddings
_RESOLVED = ("max_model_len", "max_num_batched_tokens", "async_scheduling", "warm_up", "speculative_max_batch",
             "deterministic")
