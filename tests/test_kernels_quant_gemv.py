"""The packed GEMV's two fast paths (kernels/quant_gemv.py) under the interpreter, against float64: fp8_block with
its scale folded into the input (BLOCK_K spanning several block columns) and the per-row scale path beside it, and
the INT4 kernel in every prologue, with and without zero points, groups 32 and 128, K not a multiple of a
chunk (nor of a word), and groups whose words are no power of two or span several chunks (int4_segment)."""

import pytest
import torch

from envex.kernels import gemv
from envex.kernels import quant as q
from envex.kernels import reference as ref
from envex.kernels.quant_gemv import int4_segment, quant_gemv
from envex.tests.support.kernels import assert_close, f64

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROLOGUES = [gemv.PROLOGUE_NONE, gemv.PROLOGUE_RMS, gemv.PROLOGUE_ADD_RMS, gemv.PROLOGUE_SILU_MUL]


def _weight(n: int, k: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def _check_prologue(name: str, w: q.PackedWeight, prologue: int, cfg: tuple[int, int, int] | None,
                    dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    """quant_gemv(prologue) of w against the float64 definition of that prologue and the dequantized weight."""
    k = w.shape[1]
    w64 = q.dequantize(w, torch.float64)
    gen = torch.Generator().manual_seed(prologue)
    a, b = (torch.randn(1, k, generator=gen).to(dtype).to(DEV) for _ in range(2))
    nw = torch.randn(k, generator=gen).to(dtype).to(DEV)
    what = f"{name} prologue {prologue} config {cfg}"
    if prologue == gemv.PROLOGUE_NONE:
        y, _ = quant_gemv(a, w, config=cfg)
        assert_close(what, y, ref.linear(*f64(a), w64), dtype)
    elif prologue == gemv.PROLOGUE_RMS:
        y, _ = quant_gemv(a, w, prologue=prologue, norm_weight=nw, eps=1e-5, config=cfg)
        assert_close(what, y, ref.rms_norm_linear(*f64(a, nw), 1e-5, w64), dtype)
    elif prologue == gemv.PROLOGUE_ADD_RMS:
        y, h = quant_gemv(a, w, prologue=prologue, b=b, norm_weight=nw, eps=1e-5, config=cfg)
        y_ref, h_ref = ref.add_rms_norm_linear(*f64(a, b, nw), 1e-5, w64)
        assert h is not None
        assert_close(what, y, y_ref, dtype)
        assert_close(what + " sum", h, h_ref, dtype)
    else:
        gu = torch.randn(1, 2 * k, generator=gen).to(dtype).to(DEV)
        y, _ = quant_gemv(gu, w, prologue=prologue, config=cfg)
        assert_close(what, y, ref.silu_and_mul_linear(*f64(gu), w64), dtype)


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_fp8_block_folds_scales_across_block_columns(prologue: int) -> None:
    """A 512-input chunk over 128-column blocks (four block scales a chunk, folded into the input), K = 1000 not a
    multiple of the chunk nor of the block, and the default config; 32 rows in blocks of 16 rows, BLOCK_N 8."""
    w = q.quantize_fp8(_weight(32, 1000), q.FP8_BLOCK, (16, 128)).to(DEV)
    for cfg in ((8, 512, 4), (16, 256, 2), None):
        _check_prologue("fp8_block 16x128", w, prologue, cfg)


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_fp8_block_per_row_scales(prologue: int) -> None:
    """Scale rows of fewer rows than a program's (fp8_block_rows: a scale row a row, as put_rows gathers Qwen3-Next's
    q/k/v; and 16-row blocks under BLOCK_N 32): a scale a tile row, prefetched; the default config picks BLOCK_K
    within a block column."""
    part = q.quantize_fp8(_weight(37, 300), q.FP8_BLOCK, (32, 64))
    rows = q.PackedWeight(scheme=q.FP8_BLOCK, shape=(37, 300), block=(1, 64),
                          data=torch.zeros(37, 300, dtype=q.FP8_DTYPE), scale=torch.zeros(37, 5))  # fmt: skip
    q.put_rows(rows, torch.randperm(37, generator=torch.Generator().manual_seed(3)), part)
    rows = rows.to(DEV)
    for cfg in ((8, 64, 2), (16, 32, 4), None):
        _check_prologue("fp8_block 1x64", rows, prologue, cfg)
    blocks = q.quantize_fp8(_weight(48, 300), q.FP8_BLOCK, (16, 64)).to(DEV)
    _check_prologue("fp8_block 16x64", blocks, prologue, (32, 64, 4))


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_fp8_persistent_gemv_every_scale_mode(prologue: int) -> None:
    """The persistent FP8 kernel (a 4th config entry): 4 programs off CUDA (gemv._sm_count), so each streams
    several tiles; K = 1000 not a power of two, N = 37 not a multiple of BLOCK_N; block scales folded into the
    input tile by tile, channel and tensor scales after the sum."""
    w = _weight(37, 1000)
    packed = {"fp8_block 16x128": q.quantize_fp8(_weight(48, 1000), q.FP8_BLOCK, (16, 128)),
              "fp8_channel": q.quantize_fp8(w, q.FP8_CHANNEL), "fp8_tensor": q.quantize_fp8(w, q.FP8_TENSOR)}
    for name, pw in packed.items():
        for cfg in ((2, 0, 4, 1), (8, 0, 2, 1)):
            _check_prologue(name + " persistent", pw.to(DEV), prologue, cfg)


def test_the_persistent_fp8_gemv_refuses_what_it_cannot_run() -> None:
    a = torch.randn(1, 256, device=DEV)
    int4 = q.quantize_int4(_weight(16, 256), 128, symmetric=True).to(DEV)
    with pytest.raises(ValueError, match="INT4 has the chunked kernel only"):
        quant_gemv(a, int4, config=(2, 0, 4, 1))
    block = q.quantize_fp8(_weight(16, 256), q.FP8_BLOCK, (4, 128)).to(DEV)
    with pytest.raises(ValueError, match="persistent kernel needs BLOCK_N dividing the block's 4 rows"):
        quant_gemv(a, block, config=(8, 0, 4, 1))
    wide = q.quantize_fp8(_weight(8, 16392), q.FP8_CHANNEL).to(DEV)
    with pytest.raises(ValueError, match="K <= 16384"):
        quant_gemv(torch.randn(1, 16392, device=DEV), wide, config=(2, 0, 4, 1))


def test_fp8_block_refuses_a_tile_across_block_columns_with_per_row_scales() -> None:
    w = q.PackedWeight(scheme=q.FP8_BLOCK, shape=(16, 256), block=(1, 64), data=torch.zeros(16, 256,
                       dtype=q.FP8_DTYPE), scale=torch.ones(16, 4)).to(DEV)  # fmt: skip
    with pytest.raises(ValueError, match=r"BLOCK_K 128 must divide the block's 64 columns"):
        quant_gemv(torch.randn(1, 256, device=DEV), w, config=(8, 128, 4))


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "zero"])
def test_int4_gemv(prologue: int, group: int, symmetric: bool) -> None:
    """K = 300: 37.5 words, so a padding nibble and a partial last chunk (BLOCK_K 128 and 256) and group; odd N."""
    w = q.quantize_int4(_weight(21, 300), group, symmetric=symmetric).to(DEV)
    for cfg in ((8, 128, 2), (16, 256, 4)):
        _check_prologue(f"int4 g{group} {'sym' if symmetric else 'zero'}", w, prologue, cfg)


def test_a_scale_segment_never_straddles_two_groups() -> None:
    assert [int4_segment(g, 512) for g in (8, 24, 32, 128, 200, 304, 1024, 14336)] == [1, 1, 4, 16, 1, 2, 64, 64]
    assert int4_segment(128, 64) == 8 and int4_segment(4096, 128) == 16  # capped at a step's words
    for group in range(8, 2049, 8):
        for block_k in (64, 128, 512, 1024):
            seg = int4_segment(group, block_k)
            assert (group // 8) % seg == 0 and (block_k // 8) % seg == 0 and seg & (seg - 1) == 0


@pytest.mark.parametrize("group", [24, 200, 304, 512])
def test_int4_gemv_groups_of_any_multiple_of_eight(group: int) -> None:
    """Groups of 3 and 25 words (segments of one word), 38 (per channel at K = 300: segments of two), 64 (a group
    over several 128-input chunks), with zero points and the RMS prologue."""
    w = q.quantize_int4(_weight(19, 300, seed=group), group, symmetric=False).to(DEV)
    for cfg in ((8, 128, 2), (4, 512, 4)):
        _check_prologue(f"int4 g{group}", w, gemv.PROLOGUE_RMS, cfg)


def test_int4_gemv_default_config_float32() -> None:
    """The default config (BLOCK_K 512) on K = 1000 in float32 with a bias, against float64."""
    w = q.quantize_int4(_weight(24, 1000), 128, symmetric=False, scale_dtype=torch.float16).to(DEV)
    a = torch.randn(2, 1000, generator=torch.Generator().manual_seed(5)).to(DEV)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(6)).to(DEV)
    y, _ = quant_gemv(a, w, bias=bias)
    assert_close("int4 default", y, q.quant_linear_reference(*f64(a), w, bias.double()), torch.float32)
