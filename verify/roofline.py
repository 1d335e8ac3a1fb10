"""The memory-bandwidth roofline of one decode step: the bytes a step must read over the device's measured read
bandwidth. Batch-1 decode of a dense model is bandwidth bound, so `bytes / bandwidth` is the fastest a step can
possibly be on this device, and each measured step time can be quoted as a fraction of that limit.

Bytes per step = every layer's weights + the final norm + the LM head (+ one embedding row, the gather) + for each
sequence in the batch, the K and V of every cached position of every layer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from envex.runtime.config import ModelConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DecodeBytes:
    layer_weights: int
    lm_head: int
    embedding_row: int
    kv_per_sequence: int
    batch: int
    context_len: int

    @property
    def total(self) -> int:
        return self.layer_weights + self.lm_head + self.embedding_row + self.batch * self.kv_per_sequence


def decode_bytes(config: ModelConfig, *, dtype: str, context_len: int, batch: int = 1,
                 kv_dtype: str | None = None) -> DecodeBytes:
    """What one decode step of `batch` sequences, each attending `context_len` positions, must read."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
    w = _DTYPE_BYTES[dtype]
    kv_w = _DTYPE_BYTES[kv_dtype or dtype]
    c = config
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
    if c.attention_bias:
        per_layer += c.q_size + 2 * c.kv_size
    if c.qk_norm:
        per_layer += 2 * c.head_dim
    layers = (c.num_hidden_layers * per_layer + c.hidden_size) * w  # + the final norm
    kv = 2 * c.num_hidden_layers * c.kv_size * context_len * kv_w
    return DecodeBytes(layers, c.vocab_size * c.hidden_size * w, c.hidden_size * w, kv, batch, context_len)


def measure_read_bandwidth(device: str | torch.device = "cpu", *, size_bytes: int | None = None,
                           repeats: int = 7) -> float:
    """Bytes/s of a full read of a large float32 tensor (the best of `repeats` reductions)."""
    dev = torch.device(device)
    size = size_bytes or (2 * 2**30 if dev.type == "cuda" else 256 * 2**20)
    x = torch.ones(size // 4, dtype=torch.float32, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x.sum()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t)
    del x
    return size / best


@dataclass(frozen=True)
class Roofline:
    device: str
    dtype: str
    bytes_per_step: int
    bandwidth_bytes_per_s: float
    min_step_s: float
    max_steps_per_s: float
    batch: int
    context_len: int

    def fraction(self, measured_step_s: float) -> float:
        """Share of the physical limit reached: the floor step time over the measured one (1.0 = at the limit)."""
        return self.min_step_s / measured_step_s if measured_step_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def roofline(config: ModelConfig, *, device: str, dtype: str, context_len: int, batch: int = 1,
             bandwidth: float | None = None) -> Roofline:
    b = decode_bytes(config, dtype=dtype, context_len=context_len, batch=batch)
    bw = bandwidth if bandwidth is not None else measure_read_bandwidth(device)
    floor = b.total / bw
    return Roofline(device=str(device), dtype=dtype, bytes_per_step=b.total, bandwidth_bytes_per_s=bw,
                    min_step_s=floor, max_steps_per_s=1.0 / floor, batch=batch, context_len=context_len)
