"""The GEMV kernels (kernels/gemv.py) on gpt-oss-120b's one-row projections, whose K is not a multiple of 128:
hidden 2880 into QKV (norm + residual prologue, bias) and into the router (bias), q 4096 into O. Tuned tiles are
picked as on the GPU (config=None); against float64 through the torch reference."""

import pytest
import torch

from envex.kernels import gemv
from envex.kernels import reference as ref
from envex.tests.support.kernels import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,prologue", [(96, 2880, "add_rms"), (128, 2880, "none"), (64, 4096, "none")])
def test_gemv_at_gpt_oss_widths(n: int, k: int, prologue: str) -> None:
    g = torch.Generator().manual_seed(n + k)
    a = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(DEV)
    if prologue == "add_rms":
        res = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEV)
        nw = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(DEV)
        y, total = gemv.gemv(a, w, prologue=gemv.PROLOGUE_ADD_RMS, b=res, norm_weight=nw, eps=1e-5, bias=bias)
        h, want_total = ref.add_rms_norm(a.double(), res.double(), nw.double(), 1e-5)
        assert total is not None
        assert_close("residual", total, want_total, torch.bfloat16)
    else:
        y, _ = gemv.gemv(a, w, bias=bias)
        h = a.double()
    assert_close(f"gemv N={n} K={k}", y, ref.linear(h, w.double(), bias.double()), torch.bfloat16)
