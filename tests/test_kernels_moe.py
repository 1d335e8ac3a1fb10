"""gpt-oss's MoE: the MXFP4 format, routing, and the fused expert kernels (GEMV and grouped paths, packed and float
weights) against the float64 reference with the experts dequantized."""

import pytest
import torch

from envex.kernels import moe_mxfp4, mxfp4
from envex.kernels import reference as ref
from envex.kernels.accuracy import rel_err
from envex.tests.support.kernels import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA, LIMIT = 1.702, 7.0
# sigmoid(alpha·g) of a very negative gate overflows exp() to inf and correctly gives 0; numpy (the interpreter)
# warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _experts(e: int, h: int, inter: int, *, packed: bool, seed: int = 0, spread_scales: bool = False):
    """Random experts (gate_up [E, 2I, H], down [E, H, I], biases), packed or float, and their float64 values."""
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    wd = torch.randn(e, h, inter, generator=g) * inter**-0.5
    bg, bd = torch.randn(e, 2 * inter, generator=g) * 0.1, torch.randn(e, h, generator=g) * 0.1
    if not packed:
        return (wg.to(DEV), bg.to(DEV), wd.to(DEV), bd.to(DEV)), (wg.double(), bg.double(), wd.double(), bd.double())
    gu, dn = mxfp4.quantize(wg), mxfp4.quantize(wd)
    if spread_scales:  # exponents far from 127 on both sides: the kernel builds 2^(s-127) from bits
        gu = (gu[0], (gu[1].int() + torch.randint(-6, 7, gu[1].shape, generator=g)).to(torch.uint8))
    f64 = (mxfp4.dequantize(*gu, torch.float64), bg.double(), mxfp4.dequantize(*dn, torch.float64), bd.double())
    dev = (tuple(t.to(DEV) for t in gu), bg.to(DEV), tuple(t.to(DEV) for t in dn), bd.to(DEV))
    return dev, f64


def _moe(x, logits, top_k, weights, **kw):
    gu, bg, dn, bd = weights
    return moe_mxfp4.fused_moe(x, logits, top_k, gate_up=gu, gate_up_bias=bg, down=dn, down_bias=bd, alpha=ALPHA,
                               limit=LIMIT, **kw)  # fmt: skip


def _expected(x, logits, top_k, f64):
    """The float64 reference on the CPU (where the float64 experts are), returned on x's device."""
    w, ids = ref.moe_route(logits.double().cpu(), top_k)
    return ref.moe_experts(x.double().cpu(), w, ids, f64[0], f64[1], f64[2], f64[3], ALPHA, LIMIT).to(x.device)


def test_mxfp4_format_matches_transformers_dequantization() -> None:
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8)
    scales = torch.randint(115, 135, (3, 40, 2), dtype=torch.uint8)
    w = mxfp4.dequantize(blocks, scales)  # [E, N, K]
    # element 2j is the low nibble of byte j, 2j+1 the high one; each group of 32 shares 2^(scale-127)
    code = int(blocks[1, 7, 1, 5])
    lo, hi = mxfp4.E2M1_VALUES[code & 15], mxfp4.E2M1_VALUES[code >> 4]
    s = 2.0 ** (int(scales[1, 7, 1]) - 127)
    assert (float(w[1, 7, 32 + 10]), float(w[1, 7, 32 + 11])) == (lo * s, hi * s)
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    assert torch.equal(hf.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), w.transpose(1, 2))
    # quantize never clips and is idempotent on values it produced
    x = torch.randn(2, 8, 64) * torch.logspace(-3, 2, 64)
    b, sc = mxfp4.quantize(x)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(mxfp4.dequantize(b, sc))), mxfp4.dequantize(b, sc))
    assert rel_err(mxfp4.dequantize(b, sc), x) < 0.2


def test_random_packed_weights_have_the_dummy_magnitude() -> None:
    blocks = torch.empty(2, 64, 90, 16, dtype=torch.uint8)
    scales = torch.empty(2, 64, 90, dtype=torch.uint8)
    mxfp4.fill_random_(blocks, scales, torch.Generator().manual_seed(0))
    std = float(mxfp4.dequantize(blocks, scales).std())
    assert 2880**-0.5 / 1.5 < std < 2880**-0.5 * 1.5
    assert len(torch.unique(blocks & 15)) == 16


def test_route_matches_reference() -> None:
    logits = torch.randn(7, 20, generator=torch.Generator().manual_seed(1)).to(DEV)
    ids, w = moe_mxfp4.route(logits, 4)
    w_ref, ids_ref = ref.moe_route(logits.double(), 4)
    assert torch.equal(ids.long().cpu(), ids_ref.cpu())
    assert rel_err(w, w_ref) < 1e-6
    assert torch.allclose(w.sum(-1).cpu(), torch.ones(7, dtype=torch.float32))


def test_route_keeps_expert_ids_in_range_on_nan_logits() -> None:
    """A NaN in a row's router logits (a broken activation) gives NaN weights, never an id past the experts: the
    expert kernels would read out of bounds. Rows without NaN route as before."""
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(2))
    logits[1, 3] = float("nan")
    logits[2] = float("nan")
    ids, w = moe_mxfp4.route(logits.to(DEV), 4)
    ids = ids.long().cpu()
    assert ids.min() >= 0 and ids.max() < 20, ids
    assert torch.isnan(w[2].cpu()).all()
    w_ref, ids_ref = ref.moe_route(logits[[0, 3]].double(), 4)
    assert torch.equal(ids[[0, 3]], ids_ref) and rel_err(w[[0, 3]], w_ref) < 1e-6


@pytest.mark.parametrize("tokens,packed", [(1, True), (3, False), (9, True)])  # 1, 3: GEMV path; 9: grouped
def test_fused_moe_float32(tokens: int, packed: bool) -> None:
    e, h, inter, top_k = 8, 64, 96, 4
    weights, f64 = _experts(e, h, inter, packed=packed, seed=tokens)
    g = torch.Generator().manual_seed(10 + tokens)
    x, logits = torch.randn(tokens, h, generator=g).to(DEV), torch.randn(tokens, e, generator=g).to(DEV)
    assert_close(f"moe T={tokens}", _moe(x, logits, top_k, weights), _expected(x, logits, top_k, f64), torch.float32)


@pytest.mark.parametrize("tokens,gemv_max_rows", [(1, 4), (2, 0), (20, 4)])
def test_fused_moe_bf16_mxfp4(tokens: int, gemv_max_rows: int) -> None:
    """bf16 activations with packed experts (the gpt-oss serving path); (2, 0) runs two rows grouped, and at 20
    rows every token picks experts 0 and 1 (biased logits), two tiles each. Odd widths (H = 96, I = 160) leave
    partial K chunks."""
    e, h, inter, top_k = 16, 96, 160, 4
    weights, f64 = _experts(e, h, inter, packed=True, seed=3, spread_scales=True)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16).to(DEV)
    logits = torch.randn(tokens, e, generator=g)
    logits[:, :2] += 8.0
    logits = logits.to(torch.bfloat16).to(DEV)
    out = _moe(x, logits, top_k, weights, gemv_max_rows=gemv_max_rows)
    assert out.dtype == torch.bfloat16
    assert_close(f"moe bf16 T={tokens}", out, _expected(x, logits, top_k, f64), torch.bfloat16)


def test_reference_dequantizes_in_the_loop() -> None:
    """reference.moe_experts on the packed pairs (one expert dequantized at a time) equals it on the whole
    dequantized float64 set: the reference the serving path is held to is the published weights' values."""
    (gu, bg, dn, bd), f64 = _experts(6, 64, 32, packed=True)
    x = torch.randn(5, 64, dtype=torch.float64)
    w, ids = ref.moe_route(torch.randn(5, 6, dtype=torch.float64), 2)
    packed = ref.moe_experts(x, w, ids, tuple(t.cpu() for t in gu), bg.cpu().double(), tuple(t.cpu() for t in dn),
                             bd.cpu().double(), ALPHA, LIMIT)  # fmt: skip
    assert torch.equal(packed, ref.moe_experts(x, w, ids, *f64, ALPHA, LIMIT))


def test_align_by_expert_tiles_each_pair_once() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 1]], dtype=torch.int32, device=DEV)
    pairs, tile_expert = moe_mxfp4.align_by_expert(ids, 4, 2)
    pairs, tile_expert = pairs.cpu(), tile_expert.cpu()
    assert sorted(pairs[pairs >= 0].tolist()) == list(range(10))
    flat = ids.reshape(-1).cpu()
    for t, e in enumerate(tile_expert.tolist()):
        rows = pairs[2 * t : 2 * t + 2]
        if e < 0:
            assert (rows < 0).all()
        else:
            assert all(int(flat[p]) == e for p in rows[rows >= 0]), f"tile {t} mixes experts"
    assert len(tile_expert) == 5 + 4  # ceil(10 / 2) + E: sized for any routing, never read back


def test_swiglu_clamps_as_hf() -> None:
    gate_up = torch.tensor([[9.0, 9.0, -9.0, -9.0, 1.0, 0.5]])
    out = ref.swiglu_oai(gate_up, ALPHA, LIMIT)
    g, u = torch.tensor([7.0, -9.0, 1.0]), torch.tensor([7.0, -7.0, 0.5])
    assert torch.allclose(out[0], (u + 1) * g * torch.sigmoid(ALPHA * g))


def test_fused_moe_rejects_bad_inputs() -> None:
    (gu, bg, dn, bd), _ = _experts(4, 64, 32, packed=True)
    x, logits = torch.randn(2, 64, device=DEV), torch.randn(2, 4, device=DEV)
    with pytest.raises(ValueError, match="top_k: 5 must be in 1..4"):
        _moe(x, logits, 5, (gu, bg, dn, bd))
    with pytest.raises(ValueError, match="gate_up/down: both MXFP4, both FP8 or both float"):
        _moe(x, logits, 2, (gu, bg, torch.randn(4, 64, 32, device=DEV), bd))
    with pytest.raises(ValueError, match="mxfp4: blocks"):
        _moe(x, logits, 2, ((gu[0][..., :8], gu[1]), bg, dn, bd))


@pytest.mark.parametrize("e,h,inter,tokens,top_k", [(6, 2880, 64, 3, 4), (2, 64, 96, 130, 2)])
def test_fused_moe_grouped_tiles(e: int, h: int, inter: int, tokens: int, top_k: int) -> None:
    """The grouped path at gpt-oss's K = 2880 (22 steps of 128 and a tail of 64, 16-row tiles), and with more than
    128 pairs an expert (130 tokens, top 2 of 2: the 128-row prefill tile, a partial second tile per expert)."""
    weights, f64 = _experts(e, h, inter, packed=True, seed=e)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16).to(DEV)
    logits = torch.randn(tokens, e, generator=g).to(torch.bfloat16).to(DEV)
    out = _moe(x, logits, top_k, weights, gemv_max_rows=0)
    assert_close(f"moe grouped E={e} H={h} T={tokens}", out, _expected(x, logits, top_k, f64), torch.bfloat16)
