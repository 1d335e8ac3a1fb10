"""The kernels' accuracy contract, shared by the kernel tests and the H200 benches: relative error against float64,
and the bound per output dtype."""

from __future__ import annotations

import torch

# ‖out − ref‖ / ‖ref‖ bounds against a float64 reference. bf16/fp16: a few units of the output rounding
# (2^-9 and 2^-12 relative) plus the rounding of intermediates HF also rounds; fp32: tf32 tensor-core dots on GPU.
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2.5e-3, torch.float32: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or Inf anywhere in out counts as infinitely wrong."""
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-300))
