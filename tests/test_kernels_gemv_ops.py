"""Batch-1 GEMV with its fused prologues and bias, and TritonOps' projections against TorchOps (the reference)."""

import pytest
import torch

from envex.kernels import _common, gemv
from envex.kernels import reference as ref
from envex.kernels.torch_ops import TorchOps
from envex.kernels.triton_ops import TritonOps
from envex.tests.support.kernels import assert_close, f64

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [(8, 64, 4), (2, 0, 4, 1)])  # several K chunks / the persistent kernel
def test_gemv_prologue_rounds_like_hf(dtype: torch.dtype, cfg: tuple[int, ...]) -> None:
    """With one-hot weight rows, y is the prologue's input to the dot: the SwiGLU rounded where HF's MLP rounds it
    (silu's output, then the product, in the activation dtype) bit for bit, and in the persistent kernel (which
    holds the whole row) the RMSNorm rounded as HF's LlamaRMSNorm (the normalised row, then its product with the
    weight), all but a few elements whose fp32 rstd sums in another order. The kernels' bf16 rounding is integer
    arithmetic (_common.round_as), so ties, tiny and huge values are in the inputs."""
    k = 300
    w = torch.eye(k, device=DEV, dtype=dtype)[torch.randperm(k, device=DEV)]
    gu = torch.randn(1, 2 * k, device=DEV) * torch.logspace(-3, 2, 2 * k, device=DEV)
    gu = gu.to(dtype)
    g, u = gu[:, :k].float(), gu[:, k:].float()
    hf = (torch.nn.functional.silu(g).to(dtype).float() * u).to(dtype)  # LlamaMLP: act_fn(gate) * up in dtype
    y, _ = gemv.gemv(gu, w, prologue=gemv.PROLOGUE_SILU_MUL, config=cfg)
    assert torch.equal(y, hf @ w.t().to(dtype)), "SwiGLU prologue rounds unlike HF"
    if cfg[1] != 0:  # the chunked kernel applies the norm after the dot: no rounded row to compare
        return
    a = gu[:, :k]
    nw = (torch.rand(k, device=DEV) + 0.5).to(dtype)
    x = a.float()
    hf_norm = nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # LlamaRMSNorm
    y, _ = gemv.gemv(a, w, prologue=gemv.PROLOGUE_RMS, norm_weight=nw, eps=1e-5, config=cfg)
    assert (y != hf_norm.to(dtype) @ w.t()).sum() <= 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_act_linear_rounds_like_hf(dtype: torch.dtype) -> None:
    """The decode step's down projection at one row (the SwiGLU launch, then the plain GEMV) gives HF's MLP bits:
    one-hot weight rows make y the SwiGLU itself, rounded where LlamaMLP rounds it."""
    k = 300
    w = torch.eye(k, device=DEV, dtype=dtype)[torch.randperm(k, device=DEV)]
    gu = (torch.randn(1, 2 * k, device=DEV) * torch.logspace(-3, 2, 2 * k, device=DEV)).to(dtype)
    g, u = gu[:, :k].float(), gu[:, k:].float()
    hf = (torch.nn.functional.silu(g).to(dtype).float() * u).to(dtype)
    assert torch.equal(TritonOps().act_linear(gu, w), hf @ w.t()), "the one-row down projection rounds unlike HF"


def test_round_as_bf16_is_torchs_rounding_for_every_finite_value() -> None:
    """_common.round_as(x, bf16) (integer round to nearest even) against torch's fp32 -> bf16 cast: random values
    over 14 decades, exact ties (a bf16 value plus half its last place, both parities), signed zeros, subnormals
    and the largest finite values."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + i, _common.round_as(tl.load(x_ptr + i, mask=i < n), tl.bfloat16), mask=i < n)

    torch.manual_seed(0)
    b = torch.randn(4096).bfloat16().float()
    ties = (b.view(torch.int32) + 0x8000).view(torch.float32)
    x = torch.cat([torch.randn(4096) * torch.logspace(-7, 7, 4096), ties, b,
                   torch.tensor([0.0, -0.0, 3.3895e38, -3.3895e38, 1e-40, -1e-40, 3.0e38])]).to(DEV)  # fmt: skip
    out = torch.empty_like(x)
    round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out, x.bfloat16().float())


def test_gemv_rejects_mismatched_k() -> None:
    with pytest.raises(ValueError, match="a: last dim 64 != 128"):
        gemv.gemv(torch.randn(1, 64, device=DEV), torch.randn(8, 64, device=DEV), prologue=gemv.PROLOGUE_SILU_MUL)
    with pytest.raises(ValueError, match="b: the residual is required"):
        gemv.gemv(torch.randn(1, 64, device=DEV), torch.randn(8, 64, device=DEV), prologue=gemv.PROLOGUE_ADD_RMS,
                  norm_weight=torch.randn(64, device=DEV))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg", [(8, 64, 4), (2, 0, 4, 1)])
def test_gemv_bias(dtype: torch.dtype, cfg: tuple[int, ...]) -> None:
    """Qwen2's QKV bias in the GEMV epilogue, with and without the norm prologue."""
    n, k = 40, 96
    a, b = (torch.randn(1, k, device=DEV).to(dtype) for _ in range(2))
    nw = torch.randn(k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype)
    y, _ = gemv.gemv(a, w, bias=bias, config=cfg)
    assert_close("gemv bias", y, ref.linear(*f64(a, w, bias)), dtype)
    y, _ = gemv.gemv(a, w, prologue=gemv.PROLOGUE_ADD_RMS, b=b, norm_weight=nw, eps=1e-5, bias=bias, config=cfg)
    normed, _ = ref.add_rms_norm(*f64(a, b, nw), 1e-5)
    assert_close("add_rms gemv bias", y, ref.linear(normed, *f64(w, bias)), dtype)
    with pytest.raises(ValueError, match="bias: length 39 != N = 40"):
        gemv.gemv(a, w, bias=bias[:39])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3])  # one row: the GEMV kernels; more: cuBLAS with the Triton norms
def test_triton_ops_match_torch_ops(dtype: torch.dtype, rows: int) -> None:
    t_ops, x_ops = TorchOps(), TritonOps()
    x, r = (torch.randn(rows, 128, device=DEV).to(dtype) for _ in range(2))
    nw = torch.randn(128, device=DEV).to(dtype)
    w = (torch.randn(72, 128, device=DEV) / 128**0.5).to(dtype)
    bias = torch.randn(72, device=DEV).to(dtype)
    for residual in (None, r):
        for b in (None, bias):
            got = x_ops.norm_linear(x, residual, nw, 1e-5, w, b)
            want = t_ops.norm_linear(x, residual, nw, 1e-5, w, b)
            assert_close("ops.norm_linear", got[0], want[0], dtype)
            assert_close("ops.norm_linear residual", got[1], want[1], dtype)
    assert_close("ops.linear", x_ops.linear(x, w, bias), t_ops.linear(x, w, bias), dtype)
    gu = torch.randn(rows, 256, device=DEV).to(dtype)
    assert_close("ops.act_linear", x_ops.act_linear(gu, w), t_ops.act_linear(gu, w), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_k_projection_hands_its_partials_to_the_next_norm(dtype: torch.dtype,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """O and down at 2-16 rows (down: to 64) come back as float32 partials of two K halves; the next norm_linear
    sums them in its norm launch, materialize() gives the rows; both as the reference computes them."""
    from envex.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "SPLIT_K_MIN", 64)
    t_ops, x_ops = TorchOps(), TritonOps()
    w_o, w_down = ((torch.randn(n, k, device=DEV) / k**0.5).to(dtype) for n, k in ((72, 128), (48, 256)))
    nw, w_next = torch.randn(72, device=DEV).to(dtype), (torch.randn(40, 72, device=DEV) / 72**0.5).to(dtype)
    for rows in (2, 16):
        x, r = torch.randn(rows, 128, device=DEV).to(dtype), torch.randn(rows, 72, device=DEV).to(dtype)
        parts = x_ops.linear(x, w_o)
        assert parts.shape == (2, rows, 72) and parts.dtype == torch.float32
        assert_close("materialize", x_ops.materialize(parts, dtype), t_ops.linear(x, w_o), dtype)
        for residual in (r, None):  # None: the partials are summed first (no layer hands them on without one)
            got = x_ops.norm_linear(parts, residual, nw, 1e-5, w_next)
            want = t_ops.norm_linear(t_ops.linear(x, w_o), residual, nw, 1e-5, w_next)
            assert_close("norm_linear of partials", got[0], want[0], dtype)
            assert_close("norm_linear of partials, sum", got[1], want[1], dtype)
    gu = torch.randn(5, 512, device=DEV).to(dtype)
    assert x_ops.act_linear(gu, w_down).dim() == 3
    assert_close("act_linear", x_ops.materialize(x_ops.act_linear(gu, w_down), dtype), t_ops.act_linear(gu, w_down),
                 dtype)  # fmt: skip
    # Rows the rule leaves to a plain projection: one row (the GEMV), O-shaped at 17 and down-shaped at 65 rows, a
    # bias, and an ops built without split_k (tensor parallelism).
    for ops, x, w, bias in ((x_ops, torch.randn(1, 128), w_o, None), (x_ops, torch.randn(17, 128), w_o, None),
                            (x_ops, torch.randn(65, 256), w_down, None), (x_ops, torch.randn(4, 128), w_o, nw),
                            (TritonOps(split_k=False), torch.randn(4, 128), w_o, None)):  # fmt: skip
        assert ops.linear(x.to(DEV, dtype), w, bias).dim() == 2
    assert x_ops.linear(torch.randn(64, 256, device=DEV).to(dtype), w_down).dim() == 3  # down: K >= 2N


def test_tuned_config_for_an_unmeasured_shape_is_the_nearest_measured_regime() -> None:
    """Qwen3-8B's projections start from the Llama-3.1-8B tuning of the same prologue; a K past every measured
    persistent tile falls back to the chunked kernel (the persistent one holds all of K in registers)."""
    assert gemv.tuned_config(28672, 4096, gemv.PROLOGUE_ADD_RMS) == gemv.H200_CONFIGS[(28672, 4096, 1)]
    assert gemv.tuned_config(24576, 4096, gemv.PROLOGUE_ADD_RMS) == gemv.H200_CONFIGS[(28672, 4096, 1)]
    assert gemv.tuned_config(4096, 12288, gemv.PROLOGUE_SILU_MUL) == gemv.H200_CONFIGS[(4096, 14336, 3)]
    assert gemv.tuned_config(6144, 4096, gemv.PROLOGUE_RMS) == gemv.H200_CONFIGS[(6144, 4096, 1)]
    assert gemv.tuned_config(4096, 28672, gemv.PROLOGUE_SILU_MUL) == gemv.DEFAULT_CONFIG


@pytest.mark.parametrize("shape", ["llama70b-tp2", "llama8b-tp2"])
def test_tp2_shares_get_the_configs_their_sweep_measured_best(shape: str) -> None:
    """One GPU's share of each projection under TP=2, as the model file cuts it, gets the config that the H200
    sweep of those shapes measured fastest (verify/lab/results, f0d3761): the table and the sharding agree."""
    import json
    from pathlib import Path

    from envex.runtime.config import ModelConfig
    from envex.runtime.models.llama import LlamaForCausalLM
    from envex.runtime.parallel.state import ParallelState
    from envex.verify.lab.kernel_bench.bench_server import SHAPES
    from envex.verify.lab.kernel_bench.bench_tp import LLAMA70B

    config = ModelConfig.from_hf(LLAMA70B if shape.startswith("llama70b") else SHAPES["llama8b"])
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device=torch.device("meta"),
                             parallel=ParallelState(rank=0, world_size=2))  # fmt: skip
    layer = model.layers[0]
    # The sweep timed down with the SwiGLU in its prologue; the engine now asks for it without (the SwiGLU is a
    # launch of its own) and gets the same config: the one measured shape stands for both.
    asked = {(*layer.qkv_proj_weight.shape, gemv.PROLOGUE_ADD_RMS), (*layer.o_proj_weight.shape, gemv.PROLOGUE_NONE),
             (*layer.gate_up_proj_weight.shape, gemv.PROLOGUE_ADD_RMS),
             (*layer.down_proj_weight.shape, gemv.PROLOGUE_SILU_MUL),
             (*model.lm_head_weight.shape, gemv.PROLOGUE_ADD_RMS)}  # fmt: skip
    down = tuple(layer.down_proj_weight.shape)
    assert gemv.tuned_config(*down, gemv.PROLOGUE_NONE) == gemv.tuned_config(*down, gemv.PROLOGUE_SILU_MUL)
    results = Path(__file__).resolve().parents[1] / "verify" / "lab" / "results"
    raw = results / f"h200-2026-12-01-f0d3761-gemv-sweep-{shape}.json"
    if not raw.is_file():
        pytest.skip("the sweep's raw results live in the repository, not in the installed package")
    sweep = json.loads(raw.read_text())["gemv_best"]
    best = {}
    for key, cfg in sweep.items():
        nk, p = key.split("/p")
        n, k = map(int, nk.split("x"))
        best[(n, k, int(p))] = tuple(cfg)
    assert asked == set(best)  # the sweep measured exactly the shapes the engine asks for
    for (n, k, p), cfg in best.items():
        assert gemv.tuned_config(n, k, p) == cfg, (n, k, p)
