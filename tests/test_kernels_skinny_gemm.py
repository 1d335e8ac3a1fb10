"""Skinny GEMM (decode batches 2–64) against float64: odd N/K, split-K on and off, persistent and one-per-unit
grids, poisoned outputs, run-to-run determinism."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit of envex.kernels

from envex.kernels import reference as ref  # noqa: E402
from envex.kernels import skinny_gemm as sg  # noqa: E402
from envex.tests.support.kernels import assert_close, f64  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
C = sg.SkinnyConfig
# (block_n, block_k, warps, stages, split_k, programs_per_sm): one slice; 3 slices over a persistent grid of 4
# programs (the CPU "SM count"), so programs walk several units; 2 slices with one program per unit.
CONFIGS = [C(32, 64, 4, 2, 1, 1), C(32, 32, 4, 2, 3, 1), C(16, 64, 4, 2, 2, 0)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    return x, w


@pytest.mark.parametrize("m", [2, 3, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"bn{c.block_n}k{c.block_k}s{c.split_k}p{c.programs_per_sm}")
def test_skinny_matches_float64(m: int, config: sg.SkinnyConfig) -> None:
    n, k = 72, 200  # neither a multiple of the blocks; K leaves a partial chunk and (split 3) an uneven last slice
    x, w = _inputs(m, n, k, seed=m)
    out = sg.skinny_matmul(x, w, config=config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert_close("skinny_matmul", out, ref.skinny_matmul(*f64(x, w)), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_default_config_and_fp16(dtype: torch.dtype) -> None:
    x, w = _inputs(5, 100, 300, dtype)
    assert_close("skinny_matmul default", sg.skinny_matmul(x, w), ref.skinny_matmul(*f64(x, w)), dtype)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=["split1", "split3"])
def test_skinny_writes_every_output(config: sg.SkinnyConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The output buffer starts as NaN (not whatever the allocator returns), so an element no program stores fails."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    x, w = _inputs(17, 90, 150)
    out = sg.skinny_matmul(x, w, config=config)
    assert torch.isfinite(out).all()
    assert_close("skinny_matmul poisoned", out, ref.skinny_matmul(*f64(x, w)), torch.bfloat16)


def test_skinny_is_deterministic_and_split_agrees() -> None:
    x, w = _inputs(33, 80, 256)
    cfg = C(32, 32, 4, 2, 4, 1)
    first, second = sg.skinny_matmul(x, w, config=cfg), sg.skinny_matmul(x, w, config=cfg)
    assert torch.equal(first, second)  # bit-identical: the split partials are summed in a fixed order
    unsplit = sg.skinny_matmul(x, w, config=cfg._replace(split_k=1))
    assert (first.float() - unsplit.float()).abs().max() <= 2 * 2**-8 * unsplit.float().abs().max()


def test_skinny_rejects_bad_inputs() -> None:
    x, w = _inputs(4, 32, 64)
    with pytest.raises(ValueError, match="x: last dim 32 != K = 64"):
        sg.skinny_matmul(x[:, :32], w)
    with pytest.raises(ValueError, match="x: 65 rows"):
        sg.skinny_matmul(torch.zeros(65, 64, dtype=w.dtype, device=DEV), w)
    with pytest.raises(ValueError, match="dtype torch.float32 not supported"):
        sg.skinny_matmul(x.float(), w.float())
    with pytest.raises(ValueError, match="x: dtype torch.float16 not supported"):
        sg.skinny_matmul(x.half(), w)
    with pytest.raises(ValueError, match="needs block_n, block_k ≥ 16"):
        sg.skinny_matmul(x, w, config=C(8, 64, 4, 2))


def test_default_configs_cover_the_llama_projections() -> None:
    for (n, k, bm), cfg in sg.H200_CONFIGS.items():
        assert sg.tuned_config(n, k, bm) == cfg
        assert cfg.split_k >= 1 and sg.smem_bytes(cfg, bm) * max(1, cfg.programs_per_sm) <= sg.SMEM_BYTES
    assert sg.block_m_for(2) == 16 and sg.block_m_for(17) == 32 and sg.block_m_for(64) == 64
