"""The batch-1 MoE's plane-layout inputs and the down GEMV's arrival counters (moe_mxfp4): the planes the norm
writes are the ones fused_moe makes itself, and the counters are left at zero, so a second call (or a call of
another shape in between) gives the same bits, as a CUDA graph replay would."""

import pytest
import torch

from envex.kernels import _common, moe_mxfp4, norm
from envex.tests.support.kernels import assert_close, planes_of
from envex.tests.test_kernels_moe import DEV, _expected, _experts, _moe

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def test_planes_kernel_and_norm_planes_write_the_same_layout() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 96, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(96, generator=g).to(torch.bfloat16).to(DEV)
    normed, _, planes = norm.norm_planes(x, None, w, 1e-5)
    xp = torch.empty(2, 96, dtype=torch.float32, device=DEV)
    moe_mxfp4._planes_kernel[(2,)](normed, xp, normed.stride(0), xp.stride(0), K=96, BLOCK=64, num_warps=4)
    assert torch.equal(xp, planes_of(normed)) and torch.equal(planes, xp)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_router_is_the_norm_its_planes_and_the_router_in_one_launch(with_residual: bool, rows: int) -> None:
    """norm_router against norm.norm_planes and the router product: the sum, the normed rows and their planes bit
    for bit (the same arithmetic), the logits within rounding (another summation order); 10 experts in programs of
    NORM_ROUTER_ROWS, so the last program is partly past the experts."""
    g = torch.Generator().manual_seed(11)
    h, e = 96, 10
    x = torch.randn(rows, h, generator=g).to(torch.bfloat16).to(DEV)
    res = torch.randn(rows, h, generator=g).to(torch.bfloat16).to(DEV) if with_residual else None
    nw = (1 + 0.3 * torch.randn(h, generator=g)).to(torch.bfloat16).to(DEV)
    rw = (torch.randn(e, h, generator=g) / 10).to(torch.bfloat16).to(DEV)
    rb = torch.randn(e, generator=g).to(torch.bfloat16).to(DEV)
    out, total, planes, logits = moe_mxfp4.norm_router(x, res, nw, 1e-5, rw, rb)
    want_out, want_total, want_planes = norm.norm_planes(x, res, nw, 1e-5)
    assert torch.equal(out, want_out) and torch.equal(total, want_total) and torch.equal(planes, want_planes)
    want = out.double() @ rw.double().t() + rb.double()
    assert logits.dtype == x.dtype and logits.shape == (rows, e)
    assert_close("router logits", logits, want, torch.bfloat16)
    _, _, _, no_bias = moe_mxfp4.norm_router(x, res, nw, 1e-5, rw)
    assert_close("router logits without bias", no_bias, out.double() @ rw.double().t(), torch.bfloat16)


def test_norm_router_refuses_a_router_of_another_width() -> None:
    x = torch.randn(1, 64, device=DEV).to(torch.bfloat16)
    nw = torch.ones(64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="router_weight"):
        moe_mxfp4.norm_router(x, None, nw, 1e-5, torch.zeros(4, 32, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="router_bias"):
        moe_mxfp4.norm_router(x, None, nw, 1e-5, torch.zeros(4, 64, device=DEV, dtype=torch.bfloat16),
                              torch.zeros(5, device=DEV, dtype=torch.bfloat16))  # fmt: skip


def test_gemv_path_takes_the_norms_planes_and_leaves_its_counters_at_zero() -> None:
    e, h, inter, top_k = 6, 64, 96, 4
    weights, f64 = _experts(e, h, inter, packed=True, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, h, generator=g).to(torch.bfloat16).to(DEV)
    logits = torch.randn(1, e, generator=g).to(DEV)
    first = _moe(x, logits, top_k, weights)  # planes made by fused_moe (_planes_kernel)
    assert_close("moe gemv T=1", first, _expected(x, logits, top_k, f64), torch.bfloat16)
    counters = _common._COUNTERS[("fused_moe", x.device)]
    assert not counters.any(), "the last program of each (token, rows) must reset its counter"
    # the planes handed in (as TritonOps.moe does with norm.norm_planes's) give the same bits, twice over
    assert torch.equal(_moe(x, logits, top_k, weights, x_planes=planes_of(x)), first)
    # another shape in between (3 tokens: other counters, other row blocks), then the first again
    x3 = torch.randn(3, h, generator=g).to(torch.bfloat16).to(DEV)
    l3 = torch.randn(3, e, generator=g).to(DEV)
    assert_close("moe gemv T=3", _moe(x3, l3, top_k, weights), _expected(x3, l3, top_k, f64), torch.bfloat16)
    assert not counters.any()
    assert torch.equal(_moe(x, logits, top_k, weights), first)


def test_fused_moe_refuses_planes_of_another_shape_or_dtype() -> None:
    weights, _ = _experts(4, 64, 64, packed=True, seed=2)
    x = torch.randn(1, 64, device=DEV).to(torch.bfloat16)
    logits = torch.randn(1, 4, device=DEV)
    with pytest.raises(ValueError, match="x_planes"):
        _moe(x, logits, 2, weights, x_planes=torch.zeros(1, 64, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="x_planes"):
        _moe(x, logits, 2, weights, x_planes=torch.zeros(2, 64, device=DEV))


def test_gemv_rounds_gate_up_to_the_activation_dtype_whatever_the_bias_dtype() -> None:
    # HF (and the grouped path) rounds the gate-up projection and the SwiGLU to the activation dtype: the same
    # bf16-representable biases held as bf16 or as float32 must give the same bits.
    (gu, bg, dn, bd), _ = _experts(6, 64, 64, packed=True, seed=9)
    bg16, bd16 = bg.to(torch.bfloat16), bd.to(torch.bfloat16)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16).to(DEV)
    logits = torch.randn(1, 6, generator=g).to(DEV)
    a = _moe(x, logits, 4, (gu, bg16, dn, bd16))
    b = _moe(x, logits, 4, (gu, bg16.float(), dn, bd16.float()))
    assert torch.equal(a, b)


def test_the_moe_entry_takes_norm_and_router_apart_for_rows_wider_than_one_program(monkeypatch) -> None:
    """TritonOps.moe at batch 1: norm_router where the row fits one program; past NORM_ROUTER_MAX_HIDDEN (made 32
    here) the norm with its planes and the router projection, launched apart. Both give the same bits (the norm's
    arithmetic is the same, and these logits are far from ties), and the residual sum is the torch backend's within
    bf16 rounding."""
    from envex.kernels.ops import MoEWeights
    from envex.kernels.torch_ops import TorchOps
    from envex.kernels.triton_ops import TritonOps

    e, h, inter, top_k = 6, 64, 64, 4
    (gu, bg, dn, bd), _ = _experts(e, h, inter, packed=True, seed=12)
    experts = MoEWeights(gate_up_bias=bg, down_bias=bd, gate_up_blocks=gu[0], gate_up_scales=gu[1],
                         down_blocks=dn[0], down_scales=dn[1])  # fmt: skip
    g = torch.Generator().manual_seed(13)
    x = torch.randn(1, h, generator=g).to(torch.bfloat16).to(DEV)
    res = torch.randn(1, h, generator=g).to(torch.bfloat16).to(DEV)
    nw = (1 + 0.2 * torch.randn(h, generator=g)).to(torch.bfloat16).to(DEV)
    rw = torch.randn(e, h, generator=g).to(torch.bfloat16).to(DEV)  # logits far apart: one routing for all
    rb = torch.randn(e, generator=g).to(torch.bfloat16).to(DEV)
    args = (x, res, nw, 1e-5, rw, rb, experts, top_k)
    _, want_res = TorchOps().moe(*args)
    launched: list[str] = []
    monkeypatch.setattr(moe_mxfp4, "norm_router", _recording(moe_mxfp4.norm_router, "norm_router", launched))
    monkeypatch.setattr(norm, "norm_planes", _recording(norm.norm_planes, "norm_planes", launched))
    fused, fused_res = TritonOps().moe(*args)
    monkeypatch.setattr(moe_mxfp4, "NORM_ROUTER_MAX_HIDDEN", 32)
    apart, apart_res = TritonOps().moe(*args)
    assert launched == ["norm_router", "norm_planes"]
    assert torch.equal(fused, apart) and torch.equal(fused_res, apart_res)
    assert_close("residual sum", fused_res, want_res, torch.bfloat16)


def _recording(fn, name: str, calls: list[str]):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("warm", "spin_ns", "cooperative"), [(True, 800, True), (True, 0, False), (False, 400, False)])
def test_one_launch_moe_gives_the_two_kernels_bits(monkeypatch, warm: bool, spin_ns: int, cooperative: bool) -> None:
    """gpt-oss's width at one token: the one-launch kernel (gate-up, a device-wide barrier, down) against the two
    GEMV launches, bit for bit, three calls in a row (the barrier counter only grows between them)."""
    e, h, inter, top_k = 16, 2880, 2880, 4
    weights, f64 = _experts(e, h, inter, packed=True, seed=14)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(1, h, generator=g).to(torch.bfloat16).to(DEV)
    logits = torch.randn(1, e, generator=g).to(DEV)
    monkeypatch.setattr(moe_mxfp4, "ONE_LAUNCH", False)
    want = _moe(x, logits, top_k, weights)
    monkeypatch.setattr(moe_mxfp4, "ONE_LAUNCH", True)
    monkeypatch.setattr(moe_mxfp4, "ONE_LAUNCH_WARM", warm)
    monkeypatch.setattr(moe_mxfp4, "ONE_LAUNCH_SPIN_NS", spin_ns)
    monkeypatch.setattr(moe_mxfp4, "ONE_LAUNCH_COOPERATIVE", cooperative)
    assert torch.equal(_moe(x, logits, top_k, weights), want)
    barrier = moe_mxfp4._BARRIERS[x.device, 360 * top_k]  # made by the first call (which also launched it dry once)
    before = barrier.item()
    for _ in range(2):
        assert torch.equal(_moe(x, logits, top_k, weights), want)
    assert barrier.item() - before == 2 * 360 * top_k, "one arrival a program a launch"
    assert_close("moe one launch", want, _expected(x, logits, top_k, f64), torch.bfloat16)


@pytest.mark.parametrize(("regs", "shared", "blocks"), [
    (168, 1024, 12),  # the one-launch kernel on the H200 (Triton 3.6): 12 x 132 SMs = 1,584 >= gpt-oss's 1,440
    (128, 0, 16), (124, 0, 16),  # a warp's registers are allocated in units of 8 a thread
    (255, 0, 8), (64, 0, 32), (8, 0, 32),  # at most 32 blocks an SM
    (64, 48 * 1024, 4),  # shared memory: 233,472 // (49,152 + 1,024)
])
def test_one_warp_blocks_per_sm(regs: int, shared: int, blocks: int) -> None:
    """The one-launch MoE's residency check: a grid is launched as one only where every program fits at once."""
    assert moe_mxfp4.one_warp_blocks_per_sm(regs, shared, 233_472) == blocks
