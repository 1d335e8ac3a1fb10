"""The packed weight-only GEMM (kernels/quant_gemm.py, under the interpreter here) against float64: every scheme,
the rows past the GEMV's, tile edges in every dimension; TritonOps' packed paths past GEMV_MAX_ROWS against
TorchOps; the launcher's one-line errors; the sm_90 build (tensor-core MMAs, nothing spilled); a GPU check at a
Llama-3.1-8B shape."""

from collections.abc import Callable
from functools import partial

import pytest
import torch

from envex.kernels import quant as q
from envex.kernels import reference as ref
from envex.kernels.quant_gemm import GemmTiles, dequantize_weight, gemm_config, quant_gemm
from envex.kernels.quant_gemv import GEMV_MAX_ROWS
from envex.kernels.torch_ops import TorchOps
from envex.kernels.triton_ops import TritonOps
from envex.tests.support.kernels import assert_close, compile_for_hopper, f64

DEV = "cuda" if torch.cuda.is_available() else "cpu"

QUANTIZERS: dict[str, Callable[[torch.Tensor], q.PackedWeight]] = {
    **{f"fp8_block_{b}": partial(q.quantize_fp8, scheme=q.FP8_BLOCK, block=(b, b)) for b in (32, 128)},
    **{scheme: partial(q.quantize_fp8, scheme=scheme) for scheme in (q.FP8_CHANNEL, q.FP8_TENSOR)},
    **{f"int4_g{g}_{'sym' if sym else 'zero'}": partial(q.quantize_int4, group=g, symmetric=sym,
                                                        scale_dtype=torch.float16 if g == 128 else torch.bfloat16)
       for g in (32, 128) for sym in (True, False)},
}  # fmt: skip
# 37 outputs, 300 inputs: no tile, FP8 block, INT4 group or (300 = 37.5 words) INT4 word divides them
_W = torch.randn(37, 300, generator=torch.Generator().manual_seed(7)) / 300**0.5
WEIGHTS = {name: make(_W) for name, make in QUANTIZERS.items()}


def _reference(x: torch.Tensor, w: q.PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """reference.linear on float64 copies of x, the dequantized weight and the bias."""
    return ref.linear(*f64(x), q.dequantize(w, torch.float64), None if bias is None else bias.double())


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_gemm_against_float64(name: str, dtype: torch.dtype) -> None:
    """M = 9, 17, 64 with the default tiles (one masked tile each way), M = 17 with 16-wide tiles (several row,
    output and K tiles, each with a ragged edge), and split-K: 3 splits of 128, 128 and 44 inputs (the bias added
    once), 16 asked for (only 10 steps of 32: 10 splits, one step each); with and without a bias."""
    w = WEIGHTS[name].to(DEV)
    gen = torch.Generator().manual_seed(3)
    split3, split16 = GemmTiles(16, 16, 32, 4, split=3), GemmTiles(16, 16, 32, 4, split=16)
    for m, cfg in ((9, None), (17, None), (64, None), (17, (16, 16, 32, 4)), (17, split3), (9, split3), (33, split16)):
        x = torch.randn(m, 300, generator=gen).to(DEV, dtype)
        bias = None if m == 9 else torch.randn(37, generator=gen).to(DEV, dtype)
        y = quant_gemm(x, w, bias, config=cfg)
        assert y.dtype == dtype and y.shape == (m, 37)
        assert_close(f"{name} M={m} {cfg}", y, _reference(x, w, bias), dtype)


def test_quant_linear_picks_gemv_then_gemm_then_a_dequantized_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to GEMV_MAX_ROWS the GEMV, then the GEMM up to GEMM_MAX_ROWS (16 here), then (prefill chunks) the weight
    dequantized for the call; each path equals the reference."""
    from envex.kernels import quant_gemm as module

    calls: list[str] = []
    for name, target in (("gemv", module.quant_gemv), ("gemm", module)):
        fn = getattr(target, f"quant_{name}")
        monkeypatch.setattr(target, f"quant_{name}", lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    monkeypatch.setattr(module, "GEMM_MAX_ROWS", 16)
    w = WEIGHTS["int4_g128_zero"].to(DEV)
    for m, path in ((GEMV_MAX_ROWS, "gemv"), (GEMV_MAX_ROWS + 1, "gemm"), (16, "gemm"), (17, None)):
        calls.clear()
        x = torch.randn(m, 300, device=DEV)
        assert_close(f"quant_linear {m}", module.quant_linear(x, w), _reference(x, w, None), torch.float32)
        assert calls == ([path] if path else []), (m, calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_dequantize_weight_is_quant_dequantize_bit_for_bit(dtype: torch.dtype) -> None:
    """The Triton pass that serves prefill chunks past GEMM_MAX_ROWS gives quant.dequantize's weight exactly, for
    every scheme at 37 x 300 (no tile, block, group or word divides it) and for a 20 x 300 weight in 8 x 8 blocks
    (no tile of whole block columns: quant.dequantize itself)."""
    weights = {**WEIGHTS, "fp8_block_8": q.quantize_fp8(_W[:20], scheme=q.FP8_BLOCK, block=(8, 8))}
    for name, w in weights.items():
        w = w.to(DEV)
        got, want = dequantize_weight(w, dtype), q.dequantize(w, dtype)
        assert got.dtype == dtype and torch.equal(got, want), name


def test_gemm_config_table() -> None:
    """Tiles and splits at Llama-3.1-8B's projections on an H100's 132 SMs: the inputs are split until there are
    2 programs an SM or a split would fall under 8 steps."""
    h100 = 132
    assert gemm_config(9, 4096, 14336, q.FP8_BLOCK, h100) == (16, 64, 128, 4, 8)  # down: 64 tiles x 8 = 512
    assert gemm_config(9, 4096, 4096, q.FP8_BLOCK, h100) == (16, 64, 128, 4, 4)  # O: 32 steps, 8 a split
    assert gemm_config(64, 28672, 4096, q.FP8_CHANNEL, h100) == (64, 64, 128, 4, 1)  # 448 tiles >= 264: no split
    assert gemm_config(64, 4096, 14336, q.INT4_GROUP, h100) == (64, 128, 64, 4, 16)  # 32 tiles, 224 steps
    assert gemm_config(2048, 28672, 4096, q.FP8_TENSOR, h100) == (64, 64, 128, 4, 1)  # 14,336 tiles: no split
    assert gemm_config(200, 4096, 4096, q.FP8_TENSOR, h100)[0] == 64


@pytest.mark.parametrize("name", ["fp8_block_128", "fp8_channel", "int4_g32_zero"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_ops_packed_paths_past_gemv_rows(name: str, dtype: torch.dtype) -> None:
    """linear (with bias), the SwiGLU + down projection and norm + projection (with and without the residual) on
    a packed weight at 9 and 33 rows: TritonOps (norm and activation kernels, then the GEMM) equals TorchOps (the
    dequantized reference) within the dtype's bar, as both equal float64."""
    w = WEIGHTS[name].to(DEV)
    triton_ops, torch_ops = TritonOps(), TorchOps()
    gen = torch.Generator().manual_seed(5)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEV, dtype)

    for m in (GEMV_MAX_ROWS + 1, 33):
        x, bias, gate_up, res, nw = rnd(m, 300), rnd(37), rnd(m, 600), rnd(m, 300), rnd(300)
        assert_close(f"linear {m}", triton_ops.linear(x, w, bias), torch_ops.linear(x, w, bias), dtype)
        assert_close(f"act_linear {m}", triton_ops.act_linear(gate_up, w), torch_ops.act_linear(gate_up, w), dtype)
        for residual in (None, res):
            y, h = triton_ops.norm_linear(x, residual, nw, 1e-5, w)
            y_ref, h_ref = torch_ops.norm_linear(x, residual, nw, 1e-5, w)
            assert_close(f"norm_linear {m} residual={residual is not None}", y, y_ref, dtype)
            assert_close(f"norm_linear sum {m}", h, h_ref, dtype)


def test_quant_gemm_rejects_bad_inputs() -> None:
    w = WEIGHTS["fp8_channel"].to(DEV)
    x = torch.randn(9, 300, device=DEV)
    fp8_8x8 = q.quantize_fp8(_W, q.FP8_BLOCK, (8, 8)).to(DEV)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: quant_gemm(torch.randn(9, 320, device=DEV), w), r"a: last dim 320 != 300 expected for weight"),
        (lambda: quant_gemm(x.double(), w), "a: dtype torch.float64 not supported"),
        (lambda: quant_gemm(x.to(torch.int32), w), "a: dtype torch.int32 not supported"),
        (lambda: quant_gemm(x, w, torch.randn(36, device=DEV)), r"bias: shape \(36,\) != \(37,\)"),
        (lambda: quant_gemm(x, w, config=(16, 16, 8, 4)), "must be BLOCK_M, BLOCK_N, BLOCK_K"),
        (lambda: quant_gemm(x, w, config=(16, 16, 16, 4, 0)), r"and a split >= 1"),
        (lambda: quant_gemm(x, fp8_8x8), "fp8_block columns 8 must be a power of two >= 16"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


_AOT = r"""
import json, re
from envex.kernels import quant_gemm as qg

def compiled(ptrs, consts):
    ptx, regs, stack = sm90_build(qg._quant_gemm_kernel, ptrs, consts)
    return {"mma": sorted(set(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", ptx)))[:3],
            "local": ".local" in ptx, "regs": regs, "stack": stack}

act = dict(x_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16")
fp8 = (dict(act, w_ptr="*fp8e4nv", s_ptr="*fp32", z_ptr="*fp32"),
       dict(SCHEME=2, SCALE_ROWS=128, SCALE_COLS=128, GROUP=8, HAS_ZERO=False))
int4 = (dict(act, w_ptr="*i32", s_ptr="*bf16", z_ptr="*u8"),
        dict(SCHEME=3, SCALE_ROWS=1, SCALE_COLS=1, GROUP=128, HAS_ZERO=True))
out = {}
for scheme, (ptrs, consts) in (("fp8_block", fp8), ("int4_group", int4)):
    for m in (16, 64):  # Llama-3.1-8B's down projection, N 4096, K 14336
        block_m, block_n, block_k, _, _ = qg.gemm_config(m, 4096, 14336, scheme, 132)
        out[f"{scheme} M{m}"] = compiled(ptrs, dict(consts, K=14336, HAS_BIAS=False, BLOCK_M=block_m,
                                                    BLOCK_N=block_n, BLOCK_K=block_k, UPCAST_DOT=False))
print(json.dumps(out))
"""


def test_the_gemm_compiles_for_hopper() -> None:
    """The device code (not what the interpreter runs) compiles for sm_90 at Llama-3.1-8B's down projection with
    the default tiles: the dots are wgmma (Hopper's tensor-core MMA, the weight tile on its 64-row side),
    nothing spills and no tile takes all 255 registers."""
    got = compile_for_hopper(_AOT)
    for name, k in got.items():
        assert k["mma"][0].startswith("wgmma.mma_async"), (name, k)  # the Hopper tensor-core MMA
        assert not k["local"] and k["stack"] == 0 and k["regs"] < 255, (name, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fp8_block_128", "fp8_channel", "int4_g128_zero", "int4_g32_sym"])
def test_quant_gemm_llama_shapes_gpu(name: str) -> None:
    """The default tiles on Llama-3.1-8B's down (4096 x 14336) and gate-up (28672 x 4096) shapes at 64 and 100
    rows (compiled, not interpreted), against float64."""
    for n, k in ((4096, 14336), (28672, 4096)):
        w = QUANTIZERS[name](torch.randn(n, k, device="cuda") / k**0.5)
        for m in (64, 100):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            assert_close(f"{name} {n}x{k} M={m}", quant_gemm(x, w), _reference(x, w, None), torch.bfloat16)
