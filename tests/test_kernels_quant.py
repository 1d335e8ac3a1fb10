"""Low-bit weights: each published packing read into the internal form bit for bit (packed here by the formats' own
definitions, tests/support/quant_packing.py), dequantization against the float64 definition, the quantizers'
round trips, and the packed GEMV kernels (under the interpreter here) against float64."""

import dataclasses
from collections.abc import Callable

import pytest
import torch

from envex.kernels import gemv
from envex.kernels import quant as q
from envex.kernels import reference as ref
from envex.kernels.quant_gemm import quant_linear
from envex.kernels.quant_gemv import GEMV_MAX_ROWS, quant_gemv
from envex.tests.support.kernels import assert_close, compile_for_hopper, f64
from envex.tests.support.quant_packing import (
    awq_pack,
    ct_pack,
    gptq_pack_weight,
    gptq_pack_zeros,
    int4_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _codes(*shape: int, lo: int = 0, hi: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed))


def _scales(*shape: int, dtype: torch.dtype = torch.float16, seed: int = 1) -> torch.Tensor:
    return (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 0.02 + 0.001).to(dtype)


# ---- each published layout, read exactly --------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (24, 256, 128), (8, 96, None)])  # None: per channel
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_reads_exactly(n: int, k: int, group: int | None, symmetric: bool) -> None:
    g = group or k
    qs = _codes(n, k, lo=-8, hi=8) - 0  # signed codes -8..7
    scale = _scales(n, k // g, dtype=torch.bfloat16)
    zp = None if symmetric else _codes(n, k // g, lo=-8, hi=8, seed=2)
    packed = ct_pack(qs.to(torch.int8))
    w = q.from_pack_quantized(packed, scale, torch.tensor([n, k]), group,
                              None if zp is None else ct_pack(zp.to(torch.int8), packed_dim=0))  # fmt: skip
    assert torch.equal(w.data, packed)  # already the internal layout
    assert torch.equal(q.unpack_int4(w.data, k), (qs + 8).to(torch.uint8))
    want = int4_reference(qs - (0 if zp is None else zp.repeat_interleave(g, 1)), scale, g)
    assert torch.equal(q.dequantize(w, torch.float64), want)
    assert torch.equal(q.dequantize(w, torch.float32), want.float())  # INT4 is exact in float32 too


def test_pack_quantized_pads_k_to_a_word() -> None:
    n, k = 4, 20  # K not a multiple of 8: compressed-tensors pads the last word with zeros
    qs = _codes(n, k, lo=-8, hi=8)
    scale = _scales(n, 1, dtype=torch.bfloat16)
    w = q.from_pack_quantized(ct_pack(qs.to(torch.int8)), scale, (n, k), None)
    assert w.group == 24 and w.data.shape == (n, 3)
    assert torch.equal(q.dequantize(w, torch.float64), int4_reference(qs, scale, k))


def test_naive_quantized_int4() -> None:
    n, k, g = 8, 64, 32
    qs, zp = _codes(n, k, lo=-8, hi=8), _codes(n, k // g, lo=-8, hi=8, seed=3)
    scale = _scales(n, k // g, dtype=torch.bfloat16)
    w = q.from_naive_int4(qs.to(torch.int8), scale, g, zp.to(torch.int8))
    assert torch.equal(q.dequantize(w, torch.float64), int4_reference(qs - zp.repeat_interleave(g, 1), scale, g))


@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (32, 256, 128), (8, 64, -1)])
def test_awq_reads_exactly(n: int, k: int, group: int) -> None:
    g = k if group == -1 else group
    u, z = _codes(k, n), _codes(k // g, n, seed=4)  # AWQ keeps everything [K, N]: intweight and zeros transposed
    scales = _scales(k // g, n)
    w = q.from_awq(awq_pack(u), awq_pack(z), scales, group)
    assert w.shape == (n, k) and w.zero is not None
    assert torch.equal(q.unpack_int4(w.data, k), u.t().to(torch.uint8))
    want = int4_reference((u - z.repeat_interleave(g, 0)).t(), scales.t(), g)
    assert torch.equal(q.dequantize(w, torch.float64), want)


@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_reads_exactly(v1: bool, symmetric: bool) -> None:
    n, k, g = 16, 256, 128
    u = _codes(k, n)
    z = torch.full((k // g, n), 8) if symmetric else _codes(k // g, n, lo=1, seed=5)  # v1 cannot store a zero of 0
    scales = _scales(k // g, n)
    g_idx = torch.arange(k, dtype=torch.int32) // g
    qzeros = gptq_pack_zeros(z, v1=v1)
    if symmetric and v1:
        assert bool((qzeros == 0x77777777).all())  # what symmetric v1 checkpoints store
    w = q.from_gptq(gptq_pack_weight(u), qzeros, scales, g, g_idx, zero_plus_one=v1)
    assert (w.zero is None) == symmetric  # a zero of 8 everywhere is the symmetric kernel path
    want = int4_reference((u - z.repeat_interleave(g, 0)).t(), scales.t(), g)
    assert torch.equal(q.dequantize(w, torch.float64), want)


def test_gptq_refuses_act_order() -> None:
    k, n, g = 64, 8, 32
    g_idx = (torch.arange(k) // g).flip(0).to(torch.int32)
    with pytest.raises(ValueError, match="act-order"):
        q.from_gptq(gptq_pack_weight(_codes(k, n)), gptq_pack_zeros(torch.full((2, n), 8)), _scales(2, n), g, g_idx)


def test_fp8_block_as_deepseek_defines_it() -> None:
    n, k = 200, 300  # partial blocks at both edges
    data = (torch.randn(n, k) * 100).clamp(-448, 448).to(q.FP8_DTYPE)
    scale_inv = torch.rand(2, 3) + 0.5
    w = q.fp8_block(data, scale_inv)
    want = torch.empty(n, k, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            rs, cs = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            want[rs, cs] = data[rs, cs].double() * float(scale_inv[i, j])
    assert torch.equal(q.dequantize(w, torch.float64), want)


def test_fp8_block_matches_transformers() -> None:
    """transformers' own FP8 dequantization (integrations/finegrained_fp8.py, what HF runs for these checkpoints'
    backward pass) gives the same float32 weight bit for bit, partial blocks included."""
    finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    data = (torch.randn(200, 300) * 100).clamp(-448, 448).to(q.FP8_DTYPE)
    scale_inv = torch.rand(2, 3) + 0.5
    hf = finegrained_fp8._dequantize_fp8_weight(data, scale_inv, [128, 128], torch.float32)
    assert torch.equal(q.dequantize(q.fp8_block(data, scale_inv), torch.float32), hf)


def test_fp8_channel_and_tensor() -> None:
    data = (torch.randn(12, 40) * 50).to(q.FP8_DTYPE)
    ch = torch.rand(12, 1, dtype=torch.float32).to(torch.bfloat16)  # compressed-tensors: [N, 1] in the model dtype
    assert torch.equal(q.dequantize(q.fp8_channel(data, ch), torch.float64), data.double() * ch.double())
    t = torch.tensor(0.0123)
    assert torch.equal(q.dequantize(q.fp8_tensor(data, t), torch.float64), data.double() * float(t))


def test_concat_outputs_fuses_projections_exactly() -> None:
    """Q, K and V (gate and up) stacked into one projection read the same rows as the parts."""
    x = [torch.randn(n, 256, generator=torch.Generator().manual_seed(n)) for n in (128, 64, 64)]

    def check(parts: list[q.PackedWeight], scheme: str) -> None:
        fused = q.concat_outputs(parts)
        assert fused.scheme == scheme and fused.shape == (256, 256)
        rows = torch.cat([q.dequantize(p, torch.float64) for p in parts])
        assert torch.equal(q.dequantize(fused, torch.float64), rows)

    check([q.quantize_int4(w, 32, symmetric=i != 1) for i, w in enumerate(x)], q.INT4_GROUP)  # mixed zero points
    check([q.quantize_fp8(w, q.FP8_TENSOR) for w in x], q.FP8_CHANNEL)  # three matrix scales -> per row
    check([q.quantize_fp8(w, q.FP8_CHANNEL) for w in x], q.FP8_CHANNEL)
    check([q.quantize_fp8(w, q.FP8_BLOCK, (64, 128)) for w in x], q.FP8_BLOCK)
    with pytest.raises(ValueError, match="not whole 128-row blocks"):
        q.concat_outputs([q.quantize_fp8(w, q.FP8_BLOCK) for w in x])
    with pytest.raises(ValueError, match="one group size"):
        q.concat_outputs([q.quantize_int4(x[0], 32), q.quantize_int4(x[1], 128)])


def test_packed_weight_bytes_and_device() -> None:
    w = q.quantize_int4(torch.randn(16, 256), 128, symmetric=False)
    assert w.nbytes == 16 * 256 // 2 + 16 * 2 * 2 + 16 * 2  # codes, bf16 scales, uint8 zeros
    moved = w.to("cpu")
    assert moved.shape == w.shape and torch.equal(moved.data, w.data) and moved.zero is not None


def test_packed_weight_validates() -> None:
    data = torch.zeros(8, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="int4 weight: scale must be float"):
        q.PackedWeight(scheme=q.INT4_GROUP, shape=(8, 32), data=data, scale=torch.ones(8, 2), group=32)
    with pytest.raises(ValueError, match="group 12 must be a positive multiple of 8"):
        q.PackedWeight(scheme=q.INT4_GROUP, shape=(8, 32), data=data, scale=torch.ones(8, 3), group=12)
    with pytest.raises(ValueError, match="fp8_block weight: scale must be float32"):
        q.fp8_block(torch.zeros(8, 8, dtype=q.FP8_DTYPE), torch.ones(2, 2))
    with pytest.raises(ValueError, match="weight_packed: must be int32"):
        q.from_pack_quantized(data, torch.ones(8, 1), (8, 40), None)


# ---- quantizers ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [q.FP8_BLOCK, q.FP8_CHANNEL, q.FP8_TENSOR])
def test_fp8_quantizer_round_trips_on_grid(scheme: str) -> None:
    """W already e4m3 codes times power-of-two scales, each block/row/matrix reaching 448: quantizing it gives back
    the same codes and scales bit for bit; a random W stays within e4m3's half step."""
    n, k = 64, 96
    codes = (torch.randn(n, k) * 60).clamp(-448, 448).to(q.FP8_DTYPE)
    codes[:, ::32] = torch.tensor(448.0).to(q.FP8_DTYPE)  # a 448 in every block of 8 x 32, every row
    block = (8, 32)
    if scheme == q.FP8_BLOCK:
        scale = torch.exp2(torch.randint(-12, -4, (n // 8, k // 32)).float())
        per = scale.repeat_interleave(8, 0).repeat_interleave(32, 1)
    elif scheme == q.FP8_CHANNEL:
        scale = torch.exp2(torch.randint(-12, -4, (n,)).float())
        per = scale[:, None]
    else:
        scale = torch.tensor([2.0**-9])
        per = scale
    w = q.quantize_fp8(codes.float() * per, scheme, block)
    assert torch.equal(w.data.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(w.scale, scale)
    x = torch.randn(n, k)
    wx = q.quantize_fp8(x, scheme, block)
    per_x = q.dequantize(dataclasses.replace(wx, data=torch.ones(n, k).to(q.FP8_DTYPE)))  # each element's scale
    # e4m3 rounds to half a step: 2^-4 relative (3 mantissa bits), or half the 2^-9 subnormal step near zero.
    assert ((q.dequantize(wx) - x).abs() <= x.abs() * 2**-4 + per_x * 2**-10).all()


def test_int4_quantizer() -> None:
    n, k, g = 16, 96, 32
    # Asymmetric on the grid (each group using codes 0 and 15, power-of-two scales): exact round trip.
    u, z = _codes(n, k), _codes(n, k // g, seed=6)
    u[:, ::g], u[:, 1::g] = 0, 15
    s = torch.exp2(torch.randint(-8, -3, (n, k // g)).float()).to(torch.bfloat16)
    w_grid = int4_reference(u - z.repeat_interleave(g, 1), s, g).float()
    back = q.quantize_int4(w_grid, g, symmetric=False)
    assert torch.equal(back.scale, s) and back.zero is not None and torch.equal(back.zero, z.to(torch.uint8))
    assert torch.equal(q.unpack_int4(back.data, k), u.to(torch.uint8))
    # Random weights, both kinds: every element within half a step of its group's scale.
    x = torch.randn(n, k)
    for symmetric in (True, False):
        w = q.quantize_int4(x, g, symmetric=symmetric)
        step = w.scale.float().repeat_interleave(g, 1)
        assert ((q.dequantize(w) - x).abs() <= step / 2 + 1e-6).all()
        assert (w.zero is None) == symmetric


# ---- the GEMV kernels against float64 -----------------------------------------------------------------------------


QUANTIZERS: dict[str, Callable[[torch.Tensor], q.PackedWeight]] = {
    "fp8_block": lambda w: q.quantize_fp8(w, q.FP8_BLOCK, (16, 64)),
    "fp8_block_128": lambda w: q.quantize_fp8(w, q.FP8_BLOCK),
    "fp8_channel": lambda w: q.quantize_fp8(w, q.FP8_CHANNEL),
    "fp8_tensor": lambda w: q.quantize_fp8(w, q.FP8_TENSOR),
    "int4_g32_sym": lambda w: q.quantize_int4(w, 32),
    "int4_g128_zero": lambda w: q.quantize_int4(w, 128, symmetric=False, scale_dtype=torch.float16),
}


def _weights(n: int, k: int) -> dict[str, q.PackedWeight]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)) / k**0.5
    return {name: make(w) for name, make in QUANTIZERS.items()}


WEIGHTS_40x320 = _weights(40, 320)
WEIGHTS_37x300 = _weights(37, 300)  # odd N, K not a multiple of the tile (nor of a word for INT4 at 300 = 37.5 words)


@pytest.mark.parametrize("name", list(WEIGHTS_40x320))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_gemv_plain(name: str, dtype: torch.dtype) -> None:
    for weights, m, cfg in ((WEIGHTS_40x320, 1, (8, 64, 2)), (WEIGHTS_37x300, 2, (16, 128, 4))):
        w = weights[name].to(DEV)
        a = torch.randn(m, w.shape[1], device=DEV).to(dtype)
        bias = torch.randn(w.shape[0], device=DEV).to(dtype)
        y, extra = quant_gemv(a, w, bias=bias, config=cfg)
        assert extra is None and y.dtype == dtype and y.shape == (m, w.shape[0])
        assert_close(f"{name} gemv", y, q.quant_linear_reference(*f64(a), w, bias.double()), dtype)


@pytest.mark.parametrize("name", ["fp8_block", "fp8_channel", "int4_g32_sym", "int4_g128_zero"])
def test_quant_gemv_prologues(name: str) -> None:
    dtype = torch.bfloat16
    w = WEIGHTS_40x320[name].to(DEV)
    k = w.shape[1]
    w64 = q.dequantize(w, torch.float64)
    a, b = (torch.randn(1, k, device=DEV).to(dtype) for _ in range(2))
    nw = torch.randn(k, device=DEV).to(dtype)
    cfg = (8, 128, 4)
    y, h = quant_gemv(a, w, prologue=gemv.PROLOGUE_ADD_RMS, b=b, norm_weight=nw, eps=1e-5, config=cfg)
    y_ref, h_ref = ref.add_rms_norm_linear(*f64(a, b, nw), 1e-5, w64)
    assert h is not None
    assert_close(f"{name} add_rms", y, y_ref, dtype)
    assert_close(f"{name} add_rms sum", h, h_ref, dtype)
    y, _ = quant_gemv(a, w, prologue=gemv.PROLOGUE_RMS, norm_weight=nw, eps=1e-5, config=cfg)
    assert_close(f"{name} rms", y, ref.rms_norm_linear(*f64(a, nw), 1e-5, w64), dtype)
    gu = torch.randn(1, 2 * k, device=DEV).to(dtype)
    y, _ = quant_gemv(gu, w, prologue=gemv.PROLOGUE_SILU_MUL, config=cfg)
    assert_close(f"{name} silu", y, ref.silu_and_mul_linear(*f64(gu), w64), dtype)


def test_quant_linear_rows() -> None:
    """Up to GEMV_MAX_ROWS rows the kernel; past it, the packed GEMM: both are the same product."""
    w = WEIGHTS_40x320["int4_g32_sym"].to(DEV)
    for m in (1, GEMV_MAX_ROWS + 1):
        x = torch.randn(m, 320, device=DEV)
        assert_close(f"quant_linear {m}", quant_linear(x, w), q.quant_linear_reference(*f64(x), w), torch.float32)


def test_quant_gemv_rejects_bad_inputs() -> None:
    w = WEIGHTS_40x320["fp8_channel"].to(DEV)
    with pytest.raises(ValueError, match="a: last dim 320 != 640"):
        quant_gemv(torch.randn(1, 320, device=DEV), w, prologue=gemv.PROLOGUE_SILU_MUL)
    with pytest.raises(ValueError, match="b: required"):
        quant_gemv(torch.randn(1, 320, device=DEV), w, prologue=gemv.PROLOGUE_ADD_RMS,
                   norm_weight=torch.randn(320, device=DEV))  # fmt: skip
    with pytest.raises(ValueError, match=r"bias: shape \(39,\) != \(40,\)"):
        quant_gemv(torch.randn(1, 320, device=DEV), w, bias=torch.randn(39, device=DEV))


_AOT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import quant_gemv as qg

def compiled(fn, ptrs, consts):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "eps" else "i32") for n in fn.arg_names}
    # pointers and strides 16-aligned, as a launch specialises them; the row count N left unaligned
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in consts
             and n not in ("N", "eps")}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return {"loads": sorted(set(re.findall(r"ld\.global\S*", ptx))), "e4m3": "e4m3" in ptx,
            "pdl": "griddepcontrol.wait" in ptx, "local": ".local" in ptx}

act = dict(a_ptr="*bf16", b_ptr="*bf16", nw_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", h_ptr="*bf16")
common = dict(K=4096, PROLOGUE=1, HAS_BIAS=False, USE_PDL=True)
fp8 = dict(act, w_ptr="*fp8e4nv", s_ptr="*fp32")
cfg = lambda scheme: dict(zip(("BLOCK_N", "BLOCK_K"), qg.DEFAULT_CONFIGS[scheme][:2]))
print(json.dumps({
    "fp8_block": compiled(qg._fp8_gemv_kernel, fp8, dict(common, SCALE_MODE=2, SCALE_ROWS=128, SCALE_COLS=128,
                                                           FOLD_SCALE=True, **cfg("fp8_block"))),
    "fp8_block_rows": compiled(qg._fp8_gemv_kernel, fp8, dict(common, SCALE_MODE=2, SCALE_ROWS=1, SCALE_COLS=128,
                                                                FOLD_SCALE=False, BLOCK_N=qg.FP8_BLOCK_ROWS_CONFIG[0],
                                                                BLOCK_K=qg.FP8_BLOCK_ROWS_CONFIG[1])),
    "fp8_channel": compiled(qg._fp8_gemv_kernel, fp8, dict(common, SCALE_MODE=1, SCALE_ROWS=1, SCALE_COLS=1,
                                                             FOLD_SCALE=False, **cfg("fp8_channel"))),
    "int4": compiled(qg._int4_gemv_kernel, dict(act, w_ptr="*i32", s_ptr="*bf16", z_ptr="*u8"),
                     dict(common, HAS_ZERO=True, GROUP=128, SEG=qg.int4_segment(128, cfg("int4_group")["BLOCK_K"]),
                          **cfg("int4_group"))),
}))
"""


def test_the_kernels_compile_for_hopper() -> None:
    """The device code (not what the interpreter runs) compiles for sm_90 at a Llama-3.1-8B shape with the default
    configs: the packed weight streamed in 16-byte evict-first loads, FP8 converted by the hardware's e4m3
    instructions, the PDL wait, and nothing spilled to local memory."""
    got = compile_for_hopper(_AOT)
    for name, k in got.items():
        assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in k["loads"], (name, k)
        assert k["pdl"] and not k["local"], (name, k)
        assert k["e4m3"] == name.startswith("fp8"), (name, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fp8_block_128", "fp8_channel", "int4_g128_zero", "int4_g32_sym"])
def test_quant_gemv_llama_shapes_gpu(name: str) -> None:
    """The default configs on Llama-3.1-8B's projection shapes (compiled, not interpreted), against float64."""
    for n, k in ((6144, 4096), (4096, 14336)):
        w = QUANTIZERS[name](torch.randn(n, k, device="cuda") / k**0.5)
        a = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y, _ = quant_gemv(a, w)
        assert_close(f"{name} {n}x{k}", y, q.quant_linear_reference(*f64(a), w), torch.bfloat16)
