"""The MXFP4 weight format (OCP Microscaling, as gpt-oss publishes its experts), in pure torch: no Triton here.

A matrix W [N, K] (N outputs, K inputs; K a multiple of 32) is stored as
  blocks [N, K/32, 16] uint8: 32 e2m1 values per group, two per byte, element 2j in the low nibble of byte j
                             and element 2j+1 in the high nibble;
  scales [N, K/32]     uint8: e8m0, one shared power of two per group: 2^(scale - 127).
An e2m1 nibble is sign(bit 3) · {0, 0.5, 1, 1.5, 2, 3, 4, 6}[bits 0-2]. This is the layout of the published
checkpoints' `*_blocks` / `*_scales` tensors (one such matrix per expert: [E, N, K/32, 16] and [E, N, K/32]) and
of transformers.integrations.mxfp4, whose dequantization returns the transpose [E, K, N].
"""

from __future__ import annotations

import math

import torch

GROUP = 32  # values per shared scale
SCALE_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# RMS of an e2m1 value drawn uniformly from the 16 codes: sqrt(mean(v^2)) = sqrt(68.5 / 8).
_E2M1_RMS = math.sqrt(68.5 / 8)


def check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """One line naming what is wrong with a (blocks, scales) pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + (16,)")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., N, K/32, 16], scales [..., N, K/32] -> W [..., N, K] in dtype (exact in float32 and wider;
    bf16 holds every e2m1 value times a power of two exactly too, unless it under- or overflows)."""
    check_packed(blocks, scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    values = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., N, K/32, 32]: element 2j, then 2j+1
    exp = scales.to(torch.int32) - SCALE_BIAS
    w = values * torch.exp2(exp.to(torch.float32))[..., None]  # exact: a power of two times a 3-bit value
    return w.flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] -> (blocks, scales), round-to-nearest e2m1 under the smallest power-of-two scale that keeps
    each group's largest magnitude within 6 (OCP MX v1.0 picks floor(log2(amax)) - 2, which can clip; this never
    clips). For tests and benchmarks: checkpoints arrive already quantized."""
    *lead, n, k = w.shape
    if k % GROUP:
        raise ValueError(f"mxfp4: the input dimension {k} must be a multiple of {GROUP}")
    g = w.detach().to(torch.float32).reshape(*lead, n, k // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)  # 2^exp · 6 ≥ amax
    scaled = g / torch.exp2(exp)[..., None]
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    code = (scaled.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude (ties: the smaller code)
    code = code | ((scaled < 0).long() << 3)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + SCALE_BIAS).to(torch.uint8)


def scale_for_std(fan_in: int, std: float | None = None) -> int:
    """The e8m0 scale byte whose groups of uniformly random e2m1 codes have standard deviation `std`
    (default 1/sqrt(fan_in), the magnitude dummy weights use for every matrix)."""
    target = fan_in**-0.5 if std is None else std
    return int(round(math.log2(target / _E2M1_RMS))) + SCALE_BIAS


@torch.no_grad()
def fill_random_(blocks: torch.Tensor, scales: torch.Tensor, generator: torch.Generator) -> None:
    """Random packed weights in place, made where the tensors live (no host copy of a 61 GB expert set): every
    byte of `blocks` uniform (so every e2m1 code is equally likely) and every scale the one that gives the matrix
    a standard deviation of 1/sqrt(K), as the float dummy weights have. NaN-free: e2m1 has no NaN codes."""
    check_packed(blocks, scales)
    blocks.random_(0, 256, generator=generator)
    scales.fill_(scale_for_std(scales.shape[-1] * GROUP))
