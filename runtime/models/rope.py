"""Rotary tables for every architecture: plain RoPE, Llama 3.1's frequency scaling and YaRN, computed as HF does."""

from __future__ import annotations

import math

import torch

from envex.runtime.config import ModelConfig, YarnScaling


def _yarn_inv_freq(base: float, dim: int, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters: interpolated frequencies below the correction range, extrapolated
    above it, a linear ramp in between; and the attention factor that scales cos and sin."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    factor = yarn.attention_factor
    if factor is None:
        factor = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0
    return inv_freq, factor


def rope_cos_sin(config: ModelConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim / 2] in float32, computed exactly as HF computes them."""
    dim = config.head_dim
    attention_factor = 1.0
    if config.rope_yarn is not None:
        inv_freq, attention_factor = _yarn_inv_freq(config.rope_theta, dim, config.rope_yarn)
    else:
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is not None:  # Llama 3.1: stretch low frequencies, keep high ones, blend in between
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return (freqs.cos() * attention_factor).to(device), (freqs.sin() * attention_factor).to(device)
