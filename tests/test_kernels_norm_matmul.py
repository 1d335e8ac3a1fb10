"""Residual add + RMSNorm folded into a small-batch projection (kernels/norm_matmul.py) against the float64 torch
composition, on the interpreter on CPU: outputs within bf16 tolerance, the residual sum exact, inputs untouched."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit of envex.kernels

from envex.kernels import norm, norm_matmul  # noqa: E402
from envex.kernels import reference as ref  # noqa: E402
from envex.tests.support.kernels import assert_close  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k,residual,bias", [
    (2, 96, 256, True, False), (5, 64, 200, True, True),  # K not a multiple of BLOCK_K; a bias (Qwen2)
    (9, 130, 384, False, False), (16, 72, 128, True, False),  # the first layer (no residual); 16 rows
])  # fmt: skip
def test_equals_the_norm_then_the_projection(m: int, n: int, k: int, residual: bool, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    dtype = torch.bfloat16
    x = (torch.randn(m, k, generator=g) * 2).to(dtype).to(DEV)
    r = torch.randn(m, k, generator=g).to(dtype).to(DEV) if residual else None
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if bias else None
    x0 = x.clone()
    y, total = norm_matmul.norm_matmul(x, r, nw, 1e-5, w, b)
    # The sum bit for bit as the norm kernel it replaces stores it (x + r in fp32, rounded once to bf16).
    want_total = norm.add_rms_norm(x, r, nw, 1e-5)[1] if residual else x
    want = ref.linear(ref.rms_norm(want_total.double(), nw.double(), 1e-5), w.double(), None if b is None
                      else b.double())  # fmt: skip
    assert torch.equal(x, x0), "x must be left untouched"
    assert torch.equal(total, want_total), "the residual sum must equal the norm kernel's"
    assert_close(f"norm_matmul m={m} n={n} k={k}", y, want, dtype)


def test_takes_and_rejects() -> None:
    x = torch.zeros(5, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(128, 64, dtype=torch.bfloat16, device=DEV)
    assert norm_matmul.takes(x, w) and not norm_matmul.takes(x[:1], w) and not norm_matmul.takes(x.float(), w.float())
    assert not norm_matmul.takes(torch.zeros(17, 64, dtype=torch.bfloat16, device=DEV), w)
    assert not norm_matmul.takes(x, torch.zeros(norm_matmul.MAX_N + 1, 64, dtype=torch.bfloat16, device=DEV))
    nw = torch.ones(64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="norm_weight: 32 entries for hidden size 64"):
        norm_matmul.norm_matmul(x, None, nw[:32], 1e-5, w)
    with pytest.raises(ValueError, match="x: 17 rows"):
        norm_matmul.norm_matmul(torch.zeros(17, 64, dtype=torch.bfloat16, device=DEV), None, nw, 1e-5, w)
