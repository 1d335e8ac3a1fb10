"""Engine settings: one frozen dataclass, built from CLI options or a launch manifest and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from envex.runtime.loader import EMBEDDED_MODEL

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = EMBEDDED_MODEL
    served_name: str | None = None  # what /v1/models reports; default: the model's own name
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    backend: str = "auto"  # auto: triton on cuda, torch elsewhere
    max_model_len: int | None = None  # default: the model's window, capped at 32768
    max_num_seqs: int = 64
    # Tokens per step (prefill chunks plus decodes). None: 8192 on CUDA, where larger chunks keep the prefill
    # matmuls near the tensor-core peak (16384 measured no faster, with a later first token: benchmarks.md),
    # and 2048 on CPU.
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: from kv_cache_memory_gb (cpu) or free device memory (cuda)
    kv_cache_memory_gb: float = 1.0  # cpu only
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    max_queue: int = 256  # waiting requests beyond this are refused (HTTP 429)
    seed: int = 0
    use_cuda_graphs: bool = True
    # Prompt-lookup speculative decoding for greedy requests: up to this many drafted tokens verified per step
    # (0 turns it off; None: 4 on the torch backend, 0 on triton, whose decode steps replay CUDA graphs).
    # Exact: a draft token is kept only where it equals the model's own argmax.
    num_speculative_tokens: int | None = None
    # Overlapped scheduling: schedule and launch step N+1 before reading step N's sampled tokens (None: on for
    # CUDA, where host work then hides behind device work; on CPU it only delays outputs by a step).
    async_scheduling: bool | None = None
    # Compile the kernels' variants at start with a few throwaway requests (None: on for CUDA; see warm_up).
    warm_up: bool | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("device", DEVICES), ("dtype", DTYPES), ("backend", BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens: must be in 0..16, got {self.num_speculative_tokens}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queue"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.98:
            raise ValueError(f"gpu_memory_utilization: must be in [0.05, 0.98], got {self.gpu_memory_utilization}")
