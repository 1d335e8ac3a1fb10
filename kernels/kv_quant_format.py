"""The packed KV-cache formats (int4, fp8) without Triton: `KVCacheFormat`, `PackedKVCache`, `kv_bytes_per_token`
and `dequantize_blocks`, so the engine's config, its block count and the torch backend can use them where Triton is
not installed. kv_quant.py (the kernels) re-exports all of them; its module docstring and offline_docs/kv_cache.md
describe the layouts. torch is imported where a tensor is made: the installer plans with the formats (their bytes
per token, which head_dims they take) in a process that never loads torch."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KV_CACHE_DTYPES = ("bf16", "fp8", "int4")  # launch.json's kv_cache_dtype (bf16: the unpacked cache)
INT4_GROUP_SIZES = (32, 64)
DEFAULT_INT4_GROUP = 64


def _check(cond: bool, message: str) -> None:
    if not cond:  # as _common.check (which imports Triton): one ValueError for people
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class KVCacheFormat:
    """A packed KV-cache format. rotate_keys / rotate_values None: the default for the dtype, the lower attention
    error measured (offline_docs/kv_cache.md): int4 rotates both, fp8 the keys only."""

    dtype: str  # "int4" | "fp8"
    group_size: int = DEFAULT_INT4_GROUP  # int4 only
    rotate_keys: bool | None = None
    rotate_values: bool | None = None
    _resolved: tuple[bool, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("int4", "fp8"):
            raise ValueError(f"kv_cache_dtype: {self.dtype!r} is not a packed format; use 'int4' or 'fp8' "
                             "(bf16 is the unpacked cache)")  # fmt: skip
        if self.dtype == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size: {self.group_size} is not one of {INT4_GROUP_SIZES}")
        rk = True if self.rotate_keys is None else self.rotate_keys
        rv = self.dtype == "int4" if self.rotate_values is None else self.rotate_values
        object.__setattr__(self, "_resolved", (rk, rv))

    @property
    def keys_rotated(self) -> bool:
        return self._resolved[0]

    @property
    def values_rotated(self) -> bool:
        return self._resolved[1]

    def data_width(self, head_dim: int) -> int:
        """Bytes of one (token, head) row of K (or V) data."""
        return head_dim // 2 if self.dtype == "int4" else head_dim

    def meta_width(self, head_dim: int) -> int:
        """bf16 entries of one row's meta: int4 its D/G scales and D/G zeros, fp8 its one scale."""
        return 2 * (head_dim // self.group_size) if self.dtype == "int4" else 1

    def check_head_dim(self, head_dim: int) -> None:
        _check(head_dim >= 32 and head_dim & (head_dim - 1) == 0,
              f"head_dim: {head_dim} must be a power of two ≥ 32 for a packed KV cache (the Hadamard rotation and "
              "the split-half packing); use kv_cache_dtype bf16")  # fmt: skip
        if self.dtype == "int4":
            _check(head_dim % self.group_size == 0,
                  f"group_size: {self.group_size} does not divide head_dim {head_dim}")  # fmt: skip

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """K and V bytes of one token in one layer (data + meta)."""
        self.check_head_dim(head_dim)
        return 2 * num_kv_heads * (self.data_width(head_dim) + 2 * self.meta_width(head_dim))

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str) -> PackedKVCache:  # fmt: skip
        """One layer's zeroed packed cache."""
        import torch

        self.check_head_dim(head_dim)
        data_dtype = torch.uint8 if self.dtype == "int4" else torch.float8_e4m3fn
        shape = (num_blocks, block_size, num_kv_heads)
        dw, mw = self.data_width(head_dim), self.meta_width(head_dim)
        return PackedKVCache(
            fmt=self, head_dim=head_dim,
            k_data=torch.zeros(*shape, dw, dtype=data_dtype, device=device),
            k_meta=torch.zeros(*shape, mw, dtype=torch.bfloat16, device=device),
            v_data=torch.zeros(*shape, dw, dtype=data_dtype, device=device),
            v_meta=torch.zeros(*shape, mw, dtype=torch.bfloat16, device=device),
        )  # fmt: skip


def format_for(kv_cache_dtype: str, head_dim: int) -> KVCacheFormat | None:
    """The packed format the engine serves kv_cache_dtype in for heads of head_dim (None for bf16, the unpacked
    cache): int4 in groups of 64, or one group a row where the head has only 32 elements."""
    if kv_cache_dtype == "bf16":
        return None
    return KVCacheFormat(dtype=kv_cache_dtype, group_size=min(DEFAULT_INT4_GROUP, head_dim))


def kv_bytes_per_token(kv_cache_dtype: str, num_kv_heads: int, head_dim: int, *, dtype_bytes: int = 2,
                       group_size: int | None = None) -> int:  # fmt: skip
    """K and V bytes of one token in one layer for kv_cache_dtype "bf16" (unpacked, `dtype_bytes` an element: the
    activation dtype's), "fp8" or "int4" (packed as format_for packs heads of head_dim, unless group_size says
    otherwise). The one count behind the model runner's blocks, a draft model's share and the install plan's."""
    fmt = format_for(kv_cache_dtype, head_dim)
    if fmt is None:
        return 2 * num_kv_heads * head_dim * dtype_bytes
    if group_size is not None:
        fmt = KVCacheFormat(dtype=kv_cache_dtype, group_size=group_size)
    return fmt.bytes_per_token(num_kv_heads, head_dim)


@dataclass(frozen=True, kw_only=True)
class PackedKVCache:
    """One layer's packed K and V: data [num_blocks, block_size, Hkv, data_width], meta bf16 [..., meta_width]."""

    fmt: KVCacheFormat
    head_dim: int
    k_data: torch.Tensor
    k_meta: torch.Tensor
    v_data: torch.Tensor
    v_meta: torch.Tensor

    def __post_init__(self) -> None:
        import torch

        self.fmt.check_head_dim(self.head_dim)
        want_d = self.fmt.data_width(self.head_dim)
        want_m = self.fmt.meta_width(self.head_dim)
        data_dtype = torch.uint8 if self.fmt.dtype == "int4" else torch.float8_e4m3fn
        for name, t, width, dt in (("k_data", self.k_data, want_d, data_dtype), ("v_data", self.v_data, want_d,
                                   data_dtype), ("k_meta", self.k_meta, want_m, torch.bfloat16),
                                   ("v_meta", self.v_meta, want_m, torch.bfloat16)):  # fmt: skip
            _check(t.dim() == 4 and t.shape[3] == width and t.dtype == dt and t.is_contiguous(),
                  f"{name}: expected contiguous {dt} [num_blocks, block_size, Hkv, {width}], got {t.dtype} "
                  f"{tuple(t.shape)}")  # fmt: skip
        _check(self.k_data.shape == self.v_data.shape and self.k_meta.shape == self.v_meta.shape
              and self.k_data.shape[:3] == self.k_meta.shape[:3],
              "PackedKVCache: k/v data and meta must share [num_blocks, block_size, Hkv]")  # fmt: skip
        page = self.k_data.shape[1]
        _check(page >= 1 and page & (page - 1) == 0, f"k_data: block_size {page} must be a power of two")

    @property
    def block_size(self) -> int:
        return self.k_data.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_data.shape[2]


@functools.lru_cache(maxsize=8)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix [d, d] in float32 (cached: read, never modified)."""
    import torch

    h = torch.ones(1, 1, device=device)
    for _ in range(int(math.log2(d))):  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def dequantize_blocks(cache: PackedKVCache, blocks: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The K and V of cache blocks `blocks` [n] as a plain cache pair [n, block_size, Hkv, D] in dtype, in the
    model's basis (un-rotated): for a path that wants a bf16 cache (the torch backend, a prefill kernel that has
    no packed variant yet). Torch ops, fp32 math."""
    import torch

    fmt = cache.fmt
    h = _hadamard(cache.head_dim, blocks.device)

    def one(data: torch.Tensor, meta: torch.Tensor, rotated: bool) -> torch.Tensor:
        data, meta = data.index_select(0, blocks), meta.index_select(0, blocks).float()
        if fmt.dtype == "fp8":
            x = data.float() * meta
        else:
            b = data.to(torch.int32)
            codes = torch.cat([b & 15, b >> 4], dim=-1).float()  # [n, page, Hkv, D], split-half order undone
            ng = meta.shape[-1] // 2
            s = meta[..., :ng].repeat_interleave(fmt.group_size, -1)
            z = meta[..., ng:].repeat_interleave(fmt.group_size, -1)
            x = codes * s + z
        return (x @ h if rotated else x).to(dtype)

    return one(cache.k_data, cache.k_meta, fmt.keys_rotated), one(cache.v_data, cache.v_meta, fmt.values_rotated)
