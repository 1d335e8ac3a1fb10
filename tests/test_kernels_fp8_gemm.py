"""The W8A8 FP8 GEMM (kernels/quant_gemm.py: fp8_act_quant, fp8_gemm; under the interpreter here): the activation
quantizer bit for bit against reference.fp8_act_quant (every e4m3 tie, carries into the exponent, zeros,
subnormals, signs, partial groups, strided rows, three input dtypes); the GEMM against float64 for every FP8
scheme, tile edges in every dimension, split-K and a bias; w8a8_config's tiles; the launchers' one-line errors;
the sm_90 build (FP8 wgmma, nothing spilled, the quantizer's correctly rounded division); a GPU check at
Llama-3.1-8B shapes."""

from collections.abc import Callable
from functools import partial

import pytest
import torch

from envex.kernels import quant as q
from envex.kernels import reference as ref
from envex.kernels.quant_gemm import GemmTiles, fp8_act_quant, fp8_gemm, w8a8_block_k, w8a8_config
from envex.tests.support.kernels import assert_close, compile_for_hopper

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Every positive e4m3fn value (codes 0..126; 127 is NaN), and the midpoints between neighbours: each a tie that
# rounds to the even code, several of them carrying into the next binade (15.5 * 2^e -> 16 * 2^e).
E4M3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
TIES = (E4M3[:-1] + E4M3[1:]) / 2
# Not ties, each next to a carry or a boundary: 125.2 -> 128 (where the interpreter's own cast gives 64), 15.9 -> 16,
# just under the smallest normal 2^-6, a quarter of the smallest subnormal (-> 0, and -0 for a negative), 447 -> 448.
SPECIALS = torch.tensor([125.2, 15.9, 0.0155, 0.0146, 2.0**-11, 447.0, 0.0, 1e-30, 3 * 2.0**-10, 10.5, 11.5])


def _codes_equal(name: str, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Codes equal bit for bit (a -0 is not a 0), scales equal exactly."""
    (codes, scales), (want_codes, want_scales) = got, want
    assert codes.dtype == torch.float8_e4m3fn and codes.is_contiguous() and codes.shape == want_codes.shape, name
    assert scales.dtype == torch.float32 and scales.shape == want_scales.shape, name
    bad = (codes.view(torch.uint8).cpu() != want_codes.view(torch.uint8).cpu()).nonzero()
    assert bad.numel() == 0, f"{name}: {bad.shape[0]} codes differ, first at {bad[0].tolist()}"
    assert torch.equal(scales.cpu(), want_scales.cpu()), f"{name}: scales differ"


def _ties_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 300 inputs (groups of 128, 128 and 44) whose groups each hold ±448 · 2^e first, so the scale is
    exactly 2^e and x / s is exact: the codes are the rounding of TIES and SPECIALS (float32 only: bf16 and fp16
    hold the ties exactly but not 125.2), both signs, at a binade shift e per row (fp16's range: e in -6..6)."""
    values = torch.cat([TIES, -TIES, SPECIALS, -SPECIALS]) if dtype == torch.float32 else torch.cat([TIES, -TIES])
    rows = []
    for i, e in enumerate((0, -6, 6, 3, -3)):
        row = values.roll(37 * i).repeat(3)[:300].clone()
        row[[0, 128, 256]] = torch.tensor([448.0, -448.0, 448.0])
        rows.append(row * 2.0**e)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_act_quant_bit_exact_on_ties_carries_zeros_and_subnormals(dtype: torch.dtype) -> None:
    """Exact scales (powers of two): every e4m3 tie and the carries, subnormal codes and signed zeros; then random
    rows at magnitudes 2^-12..2^12 (scales that are not powers of two, x / s rounded twice as the reference
    rounds), an all-zero group (scale 1), an all-zero row, a group of one negative tiny value, strided rows
    (a view into wider rows) and groups of 32 and 128 over 300 inputs (a partial last group)."""
    x = _ties_rows(dtype).to(DEV)
    _codes_equal(f"ties {dtype}", fp8_act_quant(x, 128), ref.fp8_act_quant(x, 128))
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(70, 360, generator=gen) * 2.0 ** torch.randint(-12, 13, (70, 1), generator=gen)
    wide[3, 40:168] = 0.0  # the second group of 128 (x starts at column 40)
    wide[4] = 0.0
    wide[5, 40 + 256 :] = 0.0
    wide[5, 40 + 290] = -1e-3  # alone in its partial group: its code is -448
    wide[6, 40:] = -0.0
    x = wide.to(DEV, dtype)[:, 40:340]  # [70, 300], rows 360 apart
    assert x.stride() == (360, 1)
    for group in (32, 128):
        got = fp8_act_quant(x, group)
        _codes_equal(f"random {dtype} group {group}", got, ref.fp8_act_quant(x, group))
        assert got[1][3, : 128 // group].eq(1.0).all() and got[1][4].eq(1.0).all()  # all-zero groups: scale 1
    codes = fp8_act_quant(x, 128)[0].view(torch.uint8)
    assert codes[6].eq(0x80).all() and codes[4].eq(0).all()  # -0 stays -0, as the cast gives
    assert codes[5, 290] == 0xFE  # -448: alone in its group


def test_act_quant_shapes_and_rows_past_the_padding() -> None:
    """One row, 129 rows (past one 128-row padding block of the scales) and K under one group: the same codes as
    the reference; the scales are [M, G] whatever the padding behind them."""
    gen = torch.Generator().manual_seed(2)
    for m, k, group in ((1, 300, 128), (129, 40, 32), (3, 20, 128)):
        x = torch.randn(m, k, generator=gen).to(DEV, torch.bfloat16)
        got = fp8_act_quant(x, group)
        assert got[1].shape == (m, -(-k // group))
        _codes_equal(f"M={m} K={k}", got, ref.fp8_act_quant(x, group))


FP8_QUANTIZERS: dict[str, Callable[[torch.Tensor], q.PackedWeight]] = {
    **{f"fp8_block_{b}": partial(q.quantize_fp8, scheme=q.FP8_BLOCK, block=(b, b)) for b in (32, 128)},
    "fp8_channel": partial(q.quantize_fp8, scheme=q.FP8_CHANNEL),
    "fp8_tensor": partial(q.quantize_fp8, scheme=q.FP8_TENSOR),
}
# 37 outputs, 300 inputs: no tile, block or group divides them (the last K step is partial, masked); 48 x 256: K a
# whole number of steps (the unmasked loads), N not a whole number of 64-row tiles.
_W = torch.randn(37, 300, generator=torch.Generator().manual_seed(7)) / 300**0.5
_W_EVEN = torch.randn(48, 256, generator=torch.Generator().manual_seed(8)) / 256**0.5
WEIGHTS = {name: make(_W) for name, make in FP8_QUANTIZERS.items()}
WEIGHTS.update({f"{name} K256": FP8_QUANTIZERS[name](_W_EVEN) for name in ("fp8_block_128", "fp8_channel")})


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_against_float64(name: str, dtype: torch.dtype) -> None:
    """M = 9 and 64 with the default tiles (one masked row tile), M = 200 (two 128-row tiles, the prefill tile),
    M = 37 with 32-wide tiles and BLOCK_K 32 (several tiles each way, groups of 32), split-K (3 splits asked for 10
    steps of 32: the bias added once; 16 asked for: 10 splits of one step); with and without a bias; strided rows
    at M = 64. Against reference.fp8_gemm (the quantized activations, float64); and within 6% of the unquantized
    product (e4m3's 3 mantissa bits: about 2-3% here), which a scale applied twice or not at all would miss."""
    w = WEIGHTS[name].to(DEV)
    n, k = w.shape
    gen = torch.Generator().manual_seed(3)
    split3, split16 = GemmTiles(32, 32, 32, 4, split=3), GemmTiles(32, 32, 32, 4, split=16)
    for m, cfg in ((9, None), (64, None), (200, None), (37, (32, 32, 32, 4)), (33, split3), (9, split16)):
        x = torch.randn(m, k + 24, generator=gen).to(DEV, dtype)
        x = x[:, 24:] if m == 64 else x[:, :k].contiguous()
        bias = None if m == 9 else torch.randn(n, generator=gen).to(DEV, dtype)
        y = fp8_gemm(x, w, bias, config=cfg)
        assert y.dtype == dtype and y.shape == (m, n)
        group = w8a8_block_k(w, 128 if cfg is None else cfg[2])
        assert_close(f"{name} M={m} {cfg}", y, ref.fp8_gemm(x, w, bias, group=group), dtype)
        plain = x.double() @ q.dequantize(w, torch.float64).t() + (0 if bias is None else bias.double())
        assert (y.double() - plain).norm() / plain.norm() < 0.06, f"{name} M={m}: far from the unquantized product"


def test_w8a8_config_table() -> None:
    """On an H100's 132 SMs: up to 64 rows the W8A16 GEMM's FP8 tiles and splits; past them 128 x 128 tiles on 8
    warps, or 128 x 64 on 4 where 128 x 128 leaves SMs idle; never split past 64 rows."""
    h100 = 132
    assert w8a8_config(16, 4096, 14336, h100) == (16, 64, 128, 4, 8)  # down at 16 rows: 64 tiles x 8 splits
    assert w8a8_config(64, 28672, 4096, h100) == (64, 64, 128, 4, 1)
    assert w8a8_config(256, 4096, 4096, h100) == (128, 64, 128, 4, 1)  # 2 x 32 tiles of 128 x 128 < 132
    assert w8a8_config(256, 28672, 4096, h100) == (128, 128, 128, 8, 1)
    assert w8a8_config(4096, 4096, 14336, h100) == (128, 128, 128, 8, 1)
    assert w8a8_config(65, 4096, 4096, h100)[0] == 128


def test_fp8_gemm_rejects_bad_inputs() -> None:
    w = WEIGHTS["fp8_channel"].to(DEV)
    x = torch.randn(9, 300, device=DEV)
    fp8_16 = q.quantize_fp8(_W, q.FP8_BLOCK, (16, 16)).to(DEV)
    int4 = q.quantize_int4(_W, 32).to(DEV)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: fp8_gemm(x, fp8_16), r"weight: fp8_block columns 16 must be a power of two >= 32 for the W8A8"),
        (lambda: fp8_gemm(x, int4), "weight: scheme int4_group has no W8A8 GEMM"),
        (lambda: fp8_gemm(torch.randn(9, 320, device=DEV), w), r"a: last dim 320 != 300 expected for weight"),
        (lambda: fp8_gemm(x.double(), w), "a: dtype torch.float64 not supported"),
        (lambda: fp8_gemm(x, w, torch.randn(36, device=DEV)), r"bias: shape \(36,\) != \(37,\)"),
        (lambda: fp8_gemm(x, w, config=(16, 16, 16, 4)), r"BLOCK_K \(a power of two >= 32"),
        (lambda: fp8_gemm(x, w, config=(256, 64, 128, 4)), r"BLOCK_M \(a power of two in 16..128\)"),
        (lambda: fp8_gemm(x, w, config=(16, 16, 32, 4, 0)), "and a split >= 1"),
        (lambda: fp8_act_quant(x, 100), "group: 100 must be a power of two"),
        (lambda: fp8_act_quant(x[0], 128), r"x: expected 2 dims, got shape \(300,\)"),
        (lambda: fp8_act_quant(x.t(), 128), "x: last dim must have stride 1"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


_AOT = r"""
import json, re
from envex.kernels import quant_gemm as qg

def compiled(fn, ptrs, consts, num_warps):
    # Ints as a launch specializes them: divisible by 16, but M, N and K (any size); the scales' row stride is 1.
    ptx, regs, stack = sm90_build(fn, ptrs, consts, num_warps=num_warps, any_size=("M", "N", "K"))
    return {"mma": sorted(set(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", ptx))),
            "div": sorted(set(re.findall(r"div\.\S*f32", ptx))), "cvt": sorted(set(re.findall(r"cvt\S*e4m3\S*", ptx))),
            "magic": "0f4B400000" in ptx, "local": ".local" in ptx, "regs": regs, "stack": stack}

ptrs = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
out = {}
for scheme, m, n, k in (("block", 16, 4096, 14336), ("block", 64, 4096, 14336), ("block", 256, 4096, 4096),
                        ("block", 4096, 4096, 14336), ("channel", 4096, 28672, 4096)):
    t = qg.w8a8_config(m, n, k, 132)
    consts = dict(K=k, stride_xsm=1, SCHEME=2 if scheme == "block" else 1, SCALE_ROWS=128, SCALE_COLS=128,
                  HAS_BIAS=False, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, UPCAST_DOT=False)
    out[f"{scheme} M{m} N{n} K{k} {tuple(t)}"] = compiled(qg._w8a8_gemm_kernel, ptrs, consts, t.num_warps)
out["act_quant"] = compiled(qg._fp8_act_quant_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                            dict(stride_sm=1, GROUP=128, ROWS=16), 4)
print(json.dumps(out))
"""


def test_the_w8a8_gemm_compiles_for_hopper() -> None:
    """The device code (not what the interpreter runs) for sm_90 with w8a8_config's tiles at Llama-3.1-8B's shapes,
    16 to 4096 rows: every dot is an FP8 wgmma (e4m3 x e4m3 into float32), nothing spills and no tile takes all
    255 registers. The quantizer divides with div.rn (not the approximate div.full), keeps the 1.5 · 2^23
    rounding constant (not folded away) and converts with the saturating round-to-nearest cvt."""
    got = compile_for_hopper(_AOT)
    quant = got.pop("act_quant")
    for name, k in got.items():
        assert k["mma"] and all(op.startswith("wgmma.mma_async") and op.endswith("e4m3.e4m3") for op in k["mma"]), (
            name,
            k,
        )
        assert not k["local"] and k["stack"] == 0 and k["regs"] < 255, (name, k)
    assert quant["div"] == ["div.rn.f32"] and quant["magic"], quant
    assert quant["cvt"] == ["cvt.rn.satfinite.e4m3x2.f32"] and quant["stack"] == 0, quant


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fp8_block_128", "fp8_channel"])
def test_fp8_gemm_llama_shapes_gpu(name: str) -> None:
    """Compiled, not interpreted: the quantizer bit for bit against the reference, and the GEMM at Llama-3.1-8B's
    o (4096 x 4096) and down (4096 x 14336) projections, 64 and 1024 rows (the decode and the prefill tiles),
    against float64: bf16 output within the bf16 contract (1.6e-2; the output's rounding alone is ~1e-3), and
    float32 output within 1e-3 (the FP8 MMA's own accumulation inside each 128-input step is all that is left)."""
    for n, k in ((4096, 4096), (4096, 14336)):
        w = FP8_QUANTIZERS[name](torch.randn(n, k, device="cuda") / k**0.5)
        for m in (64, 1024):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            _codes_equal(f"act_quant M={m} K={k}", fp8_act_quant(x, 128), ref.fp8_act_quant(x, 128))
            want = ref.fp8_gemm(x, w)
            assert_close(f"{name} {n}x{k} M={m}", fp8_gemm(x, w), want, torch.bfloat16)
            err = (fp8_gemm(x.float(), w).double() - want).norm() / want.norm()
            assert err < 1e-3, f"{name} {n}x{k} M={m} float32: relative error {err:.3g}"
