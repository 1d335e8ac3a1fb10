"""What the kernel tests share: float64 upcasts for the reference and an assertion against the accuracy contract
(kernels/accuracy.py, which the H200 benches use too)."""

from __future__ import annotations

import torch

from envex.kernels.accuracy import TOLERANCE, rel_err


def f64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Float tensors upcast to float64 (for the reference); integer tensors unchanged."""
    return [t.to(torch.float64) if t.is_floating_point() else t for t in tensors]


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    err = rel_err(out, ref)
    tol = TOLERANCE[dtype]
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g} for {dtype}"
    return err
