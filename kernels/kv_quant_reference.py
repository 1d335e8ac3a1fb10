"""The float64 torch definition of the packed KV-cache formats of kv_quant.py: the Hadamard rotation, int4 and fp8
quantization, the packing, the cache write and paged attention over the dequantized cache.

Every function computes in float64 (inputs are upcast), so the Triton kernels are compared against exact
arithmetic on the same stored bits. Layouts (kv_quant.py's module docstring has the whole story):

- int4: a (token, KV head) row of D elements in groups of G, each with a bf16 scale s = (max - min)/15 and a bf16
  zero z = min; code = clamp(floor((x - z)/s + 1/2), 0, 15), x ≈ z + code·s. Byte j of the row holds element j in
  its low nibble and element j + D/2 in its high nibble (the "split-half" order: a kernel unpacks the two halves
  of a row without any shuffle). The row's scales [D/G] then its zeros [D/G] sit in its bf16 meta row.
- fp8: e4m3fn (max 448), one bf16 scale per (token, KV head): x / s rounded to nearest even by torch's cast.
"""

from __future__ import annotations

import functools
import math

import torch

from envex.kernels import reference

INT4_MAX = 7  # symmetric codes -7 .. 7, stored + 8 (1 .. 15; 0 is never written)
FP8_MAX = 448.0  # e4m3fn's largest finite value


def hadamard(d: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix [d, d] (d a power of two): H[i, j] = (-1)^popcount(i & j) / sqrt(d).
    Symmetric and orthogonal (H @ H = I), so (q H)·(k H) = q·k. Cached (the torch backend's packed cache writes
    with it every layer and step): do not modify the result."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim: {d} is not a power of two; the Hadamard rotation needs one")
    return _hadamard(d, dtype, torch.device(device))


@functools.lru_cache(maxsize=16)
def _hadamard(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    i = torch.arange(d)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(d)).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ H_D in float64 (its own inverse)."""
    return x.to(torch.float64) @ hadamard(x.shape[-1], device=x.device)


def quantize_int4(x: torch.Tensor, group: int, *, zero_point: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x [..., D] -> (codes int64 [..., D], scales bf16 [..., D/G], zeros bf16 [..., D/G] or None).

    zero_point (the cache's format): s = (max - min)/15, z = min, both rounded to bf16, codes 0..15 for
    x ≈ z + code·s. Symmetric (measured against it, offline_docs/kv_cache.md; not a cache format): s = absmax/7,
    codes -7..7."""
    xf = x.to(torch.float64)
    g = xf.reshape(*x.shape[:-1], x.shape[-1] // group, group)  # [..., D/G, G]
    if zero_point:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).to(torch.bfloat16)
        z = lo.to(torch.bfloat16)
        sf = s.to(torch.float64)
        inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
        codes = torch.floor((g - z.to(torch.float64)[..., None]) * inv[..., None] + 0.5).clamp(0, 15)
        return codes.reshape(x.shape).long(), s, z
    s = (g.abs().amax(-1) / INT4_MAX).to(torch.bfloat16)
    sf = s.to(torch.float64)
    inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
    codes = torch.floor(g * inv[..., None] + 0.5).clamp(-INT4_MAX, INT4_MAX)
    return codes.reshape(x.shape).long(), s, None


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of quantize_int4 in float64 -> [..., D]."""
    group = codes.shape[-1] // scales.shape[-1]
    c = codes.to(torch.float64).reshape(*codes.shape[:-1], scales.shape[-1], group)
    x = c * scales.to(torch.float64)[..., None]
    if zeros is not None:
        x = x + zeros.to(torch.float64)[..., None]
    return x.reshape(codes.shape)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., D] (0..15) -> bytes uint8 [..., D/2]: byte j = c_j | c_{j+D/2} << 4 (split-half order)."""
    half = codes.shape[-1] // 2
    u = codes.to(torch.int64)
    return (u[..., :half] | (u[..., half:] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """bytes uint8 [..., D/2] -> codes int64 [..., D] (0..15), the inverse of pack_int4."""
    b = packed.to(torch.int64)
    return torch.cat([b & 15, b >> 4], dim=-1)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], bf16 scale [...]): s = absmax/448 rounded to bf16, x/s clamped to
    ±448 and rounded to nearest even."""
    xf = x.to(torch.float64)
    s = (xf.abs().amax(-1) / FP8_MAX).to(torch.bfloat16)
    sf = s.to(torch.float64)
    inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
    y = (xf * inv[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn), s


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return data.to(torch.float64) * scales.to(torch.float64)[..., None]


def encode(x: torch.Tensor, kind: str, group: int, rotated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One operand (k after rotary, or v) [..., D] -> (stored data, stored meta) of the cache format: int4 packed
    bytes [..., D/2] and bf16 [..., 2·D/G] (scales, then zeros); fp8 [..., D] and its bf16 scale [..., 1]."""
    if rotated:
        x = rotate(x)
    if kind == "int4":
        codes, s, z = quantize_int4(x, group)
        assert z is not None
        return pack_int4(codes), torch.cat([s, z], dim=-1)
    data, s = quantize_fp8(x)
    return data, s[..., None]


def decode(data: torch.Tensor, meta: torch.Tensor, kind: str, rotated: bool) -> torch.Tensor:
    """Stored (data, meta) -> float64 [..., D] in the model's basis (un-rotated)."""
    if kind == "int4":
        ng = meta.shape[-1] // 2
        x = dequantize_int4(unpack_int4(data), meta[..., :ng], meta[..., ng:])
    else:
        x = dequantize_fp8(data, meta[..., 0])
    return rotate(x) if rotated else x


def write_kv(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             slot_mapping: torch.Tensor, k_data: torch.Tensor, k_meta: torch.Tensor, v_data: torch.Tensor,
             v_meta: torch.Tensor, *, kind: str, group: int, rotate_keys: bool, rotate_values: bool,
             round_to: torch.dtype | None = None) -> None:  # fmt: skip
    """Rotary on k [T, Hkv, D] (HF rotate_half, in float64; then rounded to round_to, as the write kernel rounds the
    rotated k to k's dtype, what a bf16 cache would hold), then encode k and v into the packed caches
    ([num_blocks, block_size, Hkv, ...]) at slot_mapping (negative: skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_rot = reference.rotary(k.to(torch.float64), positions, cos.to(torch.float64), sin.to(torch.float64))
    if round_to is not None:
        k_rot = k_rot.to(round_to)
    for x, data_c, meta_c, rot in ((k_rot, k_data, k_meta, rotate_keys), (v, v_data, v_meta, rotate_values)):
        data, s = encode(x[keep], kind, group, rot)
        data_c.view(-1, *data_c.shape[2:])[slots] = data
        meta_c.view(-1, *meta_c.shape[2:])[slots] = s


def paged_attention(q: torch.Tensor, k_data: torch.Tensor, k_meta: torch.Tensor, v_data: torch.Tensor,
                    v_meta: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, *, kind: str, rotate_keys: bool, rotate_values: bool,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:  # fmt: skip
    """reference.paged_attention (varlen causal, sinks, window) in float64 over the dequantized, un-rotated cache.
    q [T, Hq, D] is rotary-rotated, not Hadamard-rotated: (qH)·(kH) = q·k, so attending with the un-rotated keys
    is the same function the kernel computes in the rotated basis."""
    k = decode(k_data, k_meta, kind, rotate_keys)
    v = decode(v_data, v_meta, kind, rotate_values)
    sinks64 = None if sinks is None else sinks.to(torch.float64)
    return reference.paged_attention(q.to(torch.float64), k, v, cu_seqlens_q, seq_lens, block_tables, scale,
                                     sinks=sinks64, window=window)  # fmt: skip
