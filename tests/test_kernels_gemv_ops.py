"""Batch-1 GEMV with its fused prologues, and TritonOps against the engine's TorchOps reference."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit of envex.kernels

from envex.kernels import gemv  # noqa: E402
from envex.kernels import reference as ref  # noqa: E402
from envex.kernels.ops import TritonOps  # noqa: E402
from envex.tests.support.kernels import assert_close, f64  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [(8, 128, 4), (4, 256, 4), (16, 64, 2), (2, 0, 4, 1), (4, 0, 2, 2)]  # 4th entry: persistent kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (1, 37, 300), (2, 100, 64), (1, 130, 1000)])
@pytest.mark.parametrize("config", CONFIGS)
def test_gemv_plain(dtype: torch.dtype, m: int, n: int, k: int, config: tuple[int, ...]) -> None:
    a = torch.randn(m, k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    y, extra = gemv.gemv(a, w, config=config)
    assert extra is None and y.shape == (m, n)
    assert_close("gemv", y, ref.linear(*f64(a, w)), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(48, 64), (33, 320)])
@pytest.mark.parametrize("cfg", [(8, 64, 4), (2, 0, 4, 1)])  # several K chunks / the persistent kernel
def test_gemv_prologues(dtype: torch.dtype, n: int, k: int, cfg: tuple[int, ...]) -> None:
    a = torch.randn(1, k, device=DEV).to(dtype)
    b = torch.randn(1, k, device=DEV).to(dtype)
    nw = torch.randn(k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    y, h = gemv.gemv(a, w, prologue=gemv.PROLOGUE_ADD_RMS, b=b, norm_weight=nw, eps=1e-5, config=cfg)
    y_ref, h_ref = ref.add_rms_norm_linear(*f64(a, b, nw), 1e-5, *f64(w))
    assert_close("add_rms gemv", y, y_ref, dtype)
    assert h is not None
    assert_close("add_rms gemv sum", h, h_ref, dtype)
    y, _ = gemv.gemv(a, w, prologue=gemv.PROLOGUE_RMS, norm_weight=nw, eps=1e-5, config=cfg)
    assert_close("rms gemv", y, ref.rms_norm_linear(*f64(a, nw), 1e-5, *f64(w)), dtype)
    gu = torch.randn(1, 2 * k, device=DEV).to(dtype)
    y, _ = gemv.gemv(gu, w, prologue=gemv.PROLOGUE_SILU_MUL, config=cfg)
    assert_close("silu gemv", y, ref.silu_and_mul_linear(*f64(gu, w)), dtype)


def test_gemv_rejects_mismatched_k() -> None:
    with pytest.raises(ValueError, match="a: last dim 64 != 128"):
        gemv.gemv(torch.randn(1, 64, device=DEV), torch.randn(8, 64, device=DEV), prologue=gemv.PROLOGUE_SILU_MUL)
    with pytest.raises(ValueError, match="b: the residual is required"):
        gemv.gemv(torch.randn(1, 64, device=DEV), torch.randn(8, 64, device=DEV), prologue=gemv.PROLOGUE_ADD_RMS,
                  norm_weight=torch.randn(64, device=DEV))  # fmt: skip


def _torch_ops():
    torch_ops = pytest.importorskip("envex.runtime.engine.torch_ops")
    return torch_ops.TorchOps()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_ops_match_torch_ops(dtype: torch.dtype) -> None:
    t_ops, x_ops = _torch_ops(), TritonOps()
    x = torch.randn(3, 128, device=DEV).to(dtype)
    r = torch.randn(3, 128, device=DEV).to(dtype)
    w = torch.randn(128, device=DEV).to(dtype)
    assert_close("ops.rms_norm", x_ops.rms_norm(x, w, 1e-5), t_ops.rms_norm(x, w, 1e-5), dtype)
    for got, want in zip(x_ops.add_rms_norm(x, r, w, 1e-5), t_ops.add_rms_norm(x, r, w, 1e-5), strict=True):
        assert_close("ops.add_rms_norm", got, want, dtype)
    heads = torch.randn(3, 4, 64, device=DEV).to(dtype)  # Qwen3 q/k norm: RMSNorm over each head
    hw = torch.randn(64, device=DEV).to(dtype)
    assert_close("ops.rms_norm 3d", x_ops.rms_norm(heads, hw, 1e-6), t_ops.rms_norm(heads, hw, 1e-6), dtype)
    gu = torch.randn(3, 256, device=DEV).to(dtype)
    assert_close("ops.silu_and_mul", x_ops.silu_and_mul(gu), t_ops.silu_and_mul(gu), dtype)

    q, k, v = (torch.randn(3, h, 64, device=DEV).to(dtype) for h in (4, 2, 2))
    positions = torch.tensor([4, 9, 2], device=DEV)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = torch.arange(16).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    slots = torch.tensor([4, 9, 2], device=DEV)
    caches = [torch.zeros(2, 8, 2, 64, device=DEV).to(dtype) for _ in range(4)]
    got = x_ops.rotary_and_store_kv(q, k, v, positions, cos, sin, caches[0], caches[1], slots)
    want = t_ops.rotary_and_store_kv(q, k, v, positions, cos, sin, caches[2], caches[3], slots)
    for name, a, b in (("q_rot", got[0], want[0]), ("k_rot", got[1], want[1]), ("k_cache", caches[0], caches[2]),
                       ("v_cache", caches[1], caches[3])):  # fmt: skip
        assert_close(f"ops.{name}", a, b, dtype)


def test_triton_ops_attention_reads_metadata() -> None:
    attention_meta = pytest.importorskip("envex.runtime.engine.attention")
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(6, 8, 2, 64, generator=g).to(DEV)
    vc = torch.randn(6, 8, 2, 64, generator=g).to(DEV)
    q = torch.randn(4, 8, 64, generator=g).to(DEV)
    meta = attention_meta.AttentionMetadata(
        is_decode=False, slot_mapping=torch.zeros(4, dtype=torch.long, device=DEV),
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([20, 9], dtype=torch.int32, device=DEV),
        block_tables=torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32, device=DEV),
        max_q_len=3, max_seq_len=20, scale=0.125,
    )  # fmt: skip
    out = TritonOps().attention(q, kc, vc, meta)
    want = ref.paged_attention(*f64(q, kc, vc), meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.125)
    assert_close("ops.attention", out, want, torch.float32)
