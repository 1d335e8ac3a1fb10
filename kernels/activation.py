"""SwiGLU on a fused gate-up projection: out = silu(x[:, :I]) * x[:, I:].

Floor: memory, read 2·T·I and write T·I elements. silu(g) is computed in fp32 and rounded to the activation dtype
before the product, as HF's MLP rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels import _common
from envex.kernels._common import FLOAT_DTYPES, check, check_tensor, pdl_enter, pdl_launch, round_as


@triton.jit
def silu_mul_as_hf(g, u):
    """silu(g) * u rounded where HF's MLP rounds it (silu's output, then the product, in the activation dtype),
    computed in fp32 in between; the result in fp32 (for a dot, or a store that is then exact)."""
    gf = g.to(tl.float32)
    act = round_as(gf * tl.sigmoid(gf), g.dtype)
    return round_as(act * u.to(tl.float32), g.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                         LATE: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    pdl_enter(USE_PDL, LATE)
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul_as_hf(g, u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """silu_and_mul(x[T, 2I]) -> [T, I] in x's dtype. pdl: programmatic dependent launch, between two PDL-launched
    projections of the one-row decode chain (the next one may start, and request its weights, once this one's wait
    has returned: `_common.LATE_TRIGGER`)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check(x.shape[1] % 2 == 0, f"x: last dim {x.shape[1]} must be even (gate and up halves side by side)")
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block, USE_PDL=pdl,
                               LATE=pdl and _common.LATE_TRIGGER, num_warps=4, **pdl_launch(pdl))  # fmt: skip
    return out
