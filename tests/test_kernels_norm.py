"""RMSNorm, add+RMSNorm and SwiGLU kernels against their float64 torch references (interpreter on CPU)."""

import pytest
import torch

from envex.kernels import activation, norm
from envex.kernels import reference as ref
from envex.tests.support.kernels import assert_close, f64, planes_of

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 96), (5, 576), (2, 1000)])
def test_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = torch.randn(tokens, hidden, device=DEV).to(dtype) * 3
    w = torch.randn(hidden, device=DEV).to(dtype)
    out = norm.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close("rms_norm", out, ref.rms_norm(*f64(x, w), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (4, 200), (7, 512)])
def test_add_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = torch.randn(tokens, hidden, device=DEV).to(dtype)
    res = torch.randn(tokens, hidden, device=DEV).to(dtype)
    w = torch.randn(hidden, device=DEV).to(dtype)
    x0, res0 = x.clone(), res.clone()
    out, total = norm.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_total = ref.add_rms_norm(*f64(x, res, w), 1e-6)
    assert_close("add_rms_norm.out", out, ref_out, dtype)
    assert_close("add_rms_norm.sum", total, ref_total, dtype)
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must not be modified"


def test_rms_norm_strided_rows() -> None:
    base = torch.randn(4, 256, device=DEV, dtype=torch.bfloat16)
    x = base[:, :128]  # row stride 256, unit last stride
    w = torch.randn(128, device=DEV, dtype=torch.bfloat16)
    assert_close("rms_norm strided", norm.rms_norm(x, w, 1e-5), ref.rms_norm(*f64(x, w), 1e-5), torch.bfloat16)


def test_norm_rejects_bad_input() -> None:
    x = torch.randn(2, 64, device=DEV)
    with pytest.raises(ValueError, match="weight: length 32"):
        norm.rms_norm(x, torch.randn(32, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="last dim must have stride 1"):
        norm.rms_norm(torch.randn(64, 2, device=DEV).t(), torch.randn(64, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="residual: shape"):
        norm.add_rms_norm(x, torch.randn(3, 64, device=DEV), torch.randn(64, device=DEV), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (3, 100), (2, 1536)])
def test_silu_and_mul(dtype: torch.dtype, tokens: int, inter: int) -> None:
    x = (torch.randn(tokens, 2 * inter, device=DEV) * 2).to(dtype)
    out = activation.silu_and_mul(x)
    assert out.shape == (tokens, inter)
    assert_close("silu_and_mul", out, ref.silu_and_mul(*f64(x)), dtype)


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="must be even"):
        activation.silu_and_mul(torch.randn(2, 7, device=DEV))


@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_planes_gives_the_norm_and_its_plane_layout(with_residual: bool) -> None:
    # The MoE GEMV's input: the same normed rows (bit for bit) and sum as add_rms_norm, plus the rows as float32
    # planes, input c + 8j at c·(H/8) + j.
    x = torch.randn(3, 96, device=DEV).to(torch.bfloat16) * 3
    res = torch.randn(3, 96, device=DEV).to(torch.bfloat16) if with_residual else None
    w = torch.randn(96, device=DEV).to(torch.bfloat16)
    out, total, planes = norm.norm_planes(x, res, w, 1e-5)
    want, want_total = norm.add_rms_norm(x, res, w, 1e-5) if with_residual else (norm.rms_norm(x, w, 1e-5), x)
    assert torch.equal(out, want) and torch.equal(total, want_total)
    assert planes.dtype == torch.float32
    assert torch.equal(planes, planes_of(out))


def test_norm_planes_refuses_a_width_that_is_not_a_multiple_of_8() -> None:
    x = torch.randn(1, 100, device=DEV)
    with pytest.raises(ValueError, match="multiple of 8"):
        norm.norm_planes(x, None, torch.ones(100, device=DEV), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits,tokens,hidden", [(1, 2, 64), (2, 5, 96), (3, 16, 200)])
def test_add_rms_norm_partials_is_the_reduce_then_add_rms_norm(dtype: torch.dtype, splits: int, tokens: int,
                                                                hidden: int) -> None:  # fmt: skip
    # Partials of quarter-integers: every partial sum is exact in float32 and in dtype, so the kernel's one rounding
    # of the sum is exact too, and the result must be add_rms_norm's on the summed rows bit for bit.
    partials = torch.randint(-16, 17, (splits, tokens, hidden), device=DEV).float() / 4
    res = torch.randn(tokens, hidden, device=DEV).to(dtype)
    w = torch.randn(hidden, device=DEV).to(dtype)
    x = partials.sum(0).to(dtype)
    out, total = norm.add_rms_norm_partials(partials, res, w, 1e-5)
    want, want_total = norm.add_rms_norm(x, res, w, 1e-5)
    assert out.dtype == dtype and torch.equal(out, want) and torch.equal(total, want_total)
    # General partials: within the dtype's tolerance of the float64 reference.
    partials = torch.randn(splits, tokens, hidden, device=DEV)
    out, total = norm.add_rms_norm_partials(partials, res, w, 1e-5)
    ref_out, ref_total = ref.add_rms_norm(partials.double().sum(0), *f64(res, w), 1e-5)
    assert_close("add_rms_norm_partials.out", out, ref_out, dtype)
    assert_close("add_rms_norm_partials.sum", total, ref_total, dtype)


def test_add_rms_norm_partials_rejects_bad_input() -> None:
    p = torch.randn(2, 3, 64, device=DEV)
    res, w = torch.randn(3, 64, device=DEV), torch.randn(64, device=DEV)
    with pytest.raises(ValueError, match="partials: dtype torch.bfloat16 not supported"):
        norm.add_rms_norm_partials(p.bfloat16(), res, w, 1e-5)
    with pytest.raises(ValueError, match=r"residual: shape \(4, 64\) != the partials' rows \(3, 64\)"):
        norm.add_rms_norm_partials(p, torch.randn(4, 64, device=DEV), w, 1e-5)
    with pytest.raises(ValueError, match="weight: length 32"):
        norm.add_rms_norm_partials(p, res, torch.randn(32, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="partials: last dim must have stride 1"):
        norm.add_rms_norm_partials(torch.randn(2, 64, 3, device=DEV).transpose(1, 2), res, w, 1e-5)
    with pytest.raises(ValueError, match="partials: need at least one split"):
        norm.add_rms_norm_partials(torch.randn(0, 3, 64, device=DEV), res, w, 1e-5)
