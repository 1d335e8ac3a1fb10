"""FP8 block-scaled experts (DeepSeek-V3 / Qwen3-FP8 releases): the stack's layout (kernels.quant.FP8BlockStack,
gate/up rows and block rows interleaved) against each checkpoint matrix dequantized on its own, the fused expert
kernels reading FP8 codes and block scales (GEMV path at 1 and 3 rows, grouped at 9) against the float64
reference, Ops.moe on the Triton ops against the torch ops (Qwen3-MoE's routing and DeepSeek's with a shared
expert), and the one-line refusals of an inconsistent stack."""

import pytest
import torch

from envex.kernels import moe_mxfp4, quant
from envex.kernels import reference as ref
from envex.kernels.accuracy import rel_err
from envex.kernels.ops import MoEWeights
from envex.tests.support.kernels import assert_close, compile_for_hopper
from envex.tests.test_kernels_moe_gemv import AOT_PTX

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# H and I past one 128-column block and not a multiple of it: edge blocks in every direction of both projections
E, H, INTER, TOP_K = 8, 136, 144, 2
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _stacks(e: int, h: int, inter: int, seed: int = 0, block: tuple[int, int] = (128, 128)):
    """Random experts quantized to FP8 stacks (gate_up paired, down plain) on DEV, and their float64 values."""
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    wd = torch.randn(e, h, inter, generator=g) * inter**-0.5
    gu, dn = quant.quantize_fp8_stack(wg, block, paired=True), quant.quantize_fp8_stack(wd, block)
    f64 = tuple(torch.stack([s.expert(i, torch.float64) for i in range(e)]) for s in (gu, dn))
    on = tuple(quant.FP8BlockStack(data=s.data.to(DEV), scale=s.scale.to(DEV), block=block, paired=s.paired)
               for s in (gu, dn))  # fmt: skip
    return on, f64


def test_stack_layout_is_each_checkpoint_matrix_blocked_on_its_own() -> None:
    """An expert's gate and up rows (even, odd) dequantize as the checkpoint's gate_proj and up_proj would, each
    with its own weight_scale_inv: quant.dequantize of an fp8_block PackedWeight."""
    (gu, dn), _ = _stacks(3, H, INTER)
    gu, dn = (quant.FP8BlockStack(data=s.data.cpu(), scale=s.scale.cpu(), paired=s.paired) for s in (gu, dn))
    assert tuple(gu.scale.shape) == (3, 2 * 2, 2) and tuple(dn.scale.shape) == (3, 2, 2)
    for e in (0, 2):
        w = gu.expert(e, torch.float64)
        for p in (0, 1):  # 0: gate, 1: up
            part = quant.fp8_block(gu.data[e, p::2], gu.scale[e, p::2])
            assert torch.equal(w[p::2], quant.dequantize(part, torch.float64))
        assert torch.equal(dn.expert(e, torch.float64), quant.dequantize(quant.fp8_block(dn.data[e], dn.scale[e]),
                                                                         torch.float64))  # fmt: skip


# GEMV path (1, 3 rows) in float32; the grouped path (9 rows) multiplies on tensor cores, in bf16 (float32 there
# is TF32 on a GPU, as tests/test_runtime_qwen3_moe.py notes)
@pytest.mark.parametrize("tokens,renormalize,dtype", [(1, True, torch.float32), (3, False, torch.float32),
                                                      (9, True, torch.bfloat16)])
def test_fused_moe_reads_fp8_experts(tokens: int, renormalize: bool, dtype: torch.dtype) -> None:
    (gu, dn), (wg64, wd64) = _stacks(E, H, INTER, seed=tokens)
    g = torch.Generator().manual_seed(50 + tokens)
    x, logits = torch.randn(tokens, H, generator=g).to(dtype), torch.randn(tokens, E, generator=g).to(dtype)
    out = moe_mxfp4.fused_moe(x.to(DEV), logits.to(DEV), TOP_K, gate_up=gu, gate_up_bias=None, down=dn,
                              down_bias=None, alpha=1.702, limit=7.0, activation="silu",
                              renormalize=renormalize)  # fmt: skip
    w, ids = ref.moe_route(logits.double(), TOP_K, renormalize)
    want = ref.moe_experts(x.double(), w, ids, wg64, None, wd64, None, 1.702, 7.0, "silu")
    assert out.dtype == dtype
    assert_close(f"fp8 experts T={tokens}", out, want.to(out.device), dtype)


def assert_ops_moe_agree(experts: MoEWeights, g: torch.Generator, what: str) -> None:
    """Ops.moe end to end (add + norm + router + experts, H 64) on the Triton ops equals the torch ops at 2 rows
    (GEMV) and 6 (grouped)."""
    from envex.kernels.torch_ops import TorchOps
    from envex.kernels.triton_ops import TritonOps

    router = (torch.randn(E, 64, generator=g) * 0.125).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(64, generator=g)).to(DEV)
    for rows in (2, 6):
        x, res = torch.randn(2, rows, 64, generator=g).to(DEV)
        want = TorchOps().moe(x, res, norm_w, 1e-6, router, None, experts, TOP_K)
        got = TritonOps().moe(x, res, norm_w, 1e-6, router, None, experts, TOP_K)
        assert rel_err(got[0], want[0]) < 1e-4, f"{what}, {rows} rows: {rel_err(got[0], want[0]):.2e}"
        assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_triton_ops_moe_on_fp8_experts_equals_torch_ops(scoring: str) -> None:
    """Ops.moe at 2 rows (GEMV) and 6 (grouped): Qwen3-MoE's softmax routing, and DeepSeek-V3's sigmoid routing
    with a shared expert (the stacks' last one) on blocks of 16 x 32."""
    shared = 1 if scoring == "sigmoid" else 0
    (gu, dn), _ = _stacks(E + shared, 64, 48, seed=7, block=(16, 32))
    g = torch.Generator().manual_seed(8)
    extra = dict(scoring="sigmoid", correction_bias=torch.randn(E, generator=g).to(DEV) * 0.1, n_group=4,
                 topk_group=2, scaling=2.5, shared_experts=1) if shared else {}  # fmt: skip
    experts = MoEWeights(gate_up=gu.data, down=dn.data, gate_up_scale=gu.scale, down_scale=dn.scale, block=(16, 32),
                         activation="silu", **extra)  # fmt: skip
    assert_ops_moe_agree(experts, g, scoring)


def test_inconsistent_fp8_experts_are_one_line() -> None:
    (gu, dn), _ = _stacks(2, 64, 48)
    with pytest.raises(ValueError, match=r"gate_up experts: scale must be float32 \[2, 2, 1\] for data \[2, 96, 64\]"):
        MoEWeights(gate_up=gu.data, down=dn.data, gate_up_scale=gu.scale[:, :1], down_scale=dn.scale)
    with pytest.raises(ValueError, match="FP8 gate_up and down need their block scales"):
        MoEWeights(gate_up=gu.data, down=dn.data)
    with pytest.raises(ValueError, match="as FP8 ones with gate_up_scale and down_scale"):
        MoEWeights(gate_up=gu.data, down=dn.data, gate_up_scale=gu.scale)
    with pytest.raises(ValueError, match=r"fp8 experts: data must be float8_e4m3fn \[E, N, K\], got torch.float32"):
        MoEWeights(gate_up=gu.data, down=dn.data.float(), gate_up_scale=gu.scale, down_scale=dn.scale)
    paired_down = quant.FP8BlockStack(data=dn.data, scale=torch.ones(2, 2, 1, device=DEV), paired=True)
    with pytest.raises(ValueError, match="down: an FP8 stack with interleaved gate/up block rows"):
        moe_mxfp4.fused_moe(torch.zeros(1, 64, device=DEV), torch.zeros(1, 2, device=DEV), 1, gate_up=gu,
                            gate_up_bias=None, down=paired_down, down_bias=None, alpha=1.0, limit=1.0)  # fmt: skip


_AOT = AOT_PTX + r"""
def build(fn, args, consts, warps):
    ptx = ptx_of(fn, args, consts, warps)
    return {"e4m3": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)), "local": len(re.findall(r"(?:ld|st)\.local", ptx)),
            "wgmma": "wgmma.mma_async" in ptx, "v4": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32", ptx))}

w = dict(w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*bf16")
st = {n: "i32" for n in ("stride_we", "stride_wn", "stride_se", "stride_be")}
fp8 = dict(PACKED=False, FP8_BN=128, FP8_BK=128)
out = {
    "gate_up": build(m._gate_up_gemv_kernel, dict(x_ptr="*bf16", xp_ptr="*fp32", logits_ptr="*bf16",
                     ids_ptr="*i32", wts_ptr="*fp32", **w, act_ptr="*fp32", stride_xp="i32", stride_l="i32", **st,
                     stride_act="i32", alpha="fp32", limit="fp32"),
                     dict(K=2048, INTER=768, E=128, TOP_K=8, BLOCK_E=128, BLOCK_TK=8, BLOCK_I=m.GEMV_PAIRS, GB=128,
                          **fp8, USE_PDL=True), 1),
    "down": build(m._down_gemv_kernel, dict(act_ptr="*fp32", ids_ptr="*i32", wts_ptr="*fp32", **w, part_ptr="*fp32",
                  count_ptr="*i32", out_ptr="*bf16", stride_act="i32", **st, stride_o="i32"),
                  dict(N=2048, INTER=768, TOP_K=8, BLOCK_N=m.GEMV_DOWN_ROWS, GB=128, **fp8, USE_PDL=True), 1),
    "gate_up_grouped": build(m._gate_up_grouped_kernel, dict(x_ptr="*bf16", pairs_ptr="*i32", block_expert_ptr="*i32",
                             **w, act_ptr="*bf16", stride_x="i32", **st, stride_sn="i32", stride_act="i32",
                             alpha="fp32", limit="fp32"),
                             dict(K=2048, INTER=768, TOP_K=8, BLOCK_M=64, BLOCK_I=32, BLOCK_K=64, UPCAST_DOT=False,
                                  **fp8), 4),
    "down_grouped": build(m._down_grouped_kernel, dict(act_ptr="*bf16", pairs_ptr="*i32", block_expert_ptr="*i32",
                          wts_ptr="*fp32", **w, out_ptr="*fp32", stride_act="i32", **st, stride_sn="i32",
                          stride_o="i32"), dict(N=2048, INTER=768, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                          UPCAST_DOT=False, **fp8), 4),
}
print(json.dumps(out))
"""


def test_the_fp8_expert_kernels_compile_for_hopper() -> None:
    """The FP8 variants at Qwen3-30B-A3B-FP8's shape, built for sm_90 by Triton's ptxas: e4m3 widened by the
    hardware's cvt, no register spills, the GEMVs' codes read 16 bytes a thread, the grouped ones on wgmma."""
    got = compile_for_hopper(_AOT)
    assert all(k["e4m3"] >= 16 and not k["local"] for k in got.values()), got
    assert got["gate_up"]["v4"] >= 2 and got["down"]["v4"] >= 2, got
    assert got["gate_up_grouped"]["wgmma"] and got["down_grouped"]["wgmma"], got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_qwen3_30b_a3b_expert_width_on_gpu(tokens: int) -> None:
    """Qwen3-30B-A3B-FP8's experts (H 2048, I 768, 128 experts, top 8, 128 x 128 blocks) in bf16 against float64."""
    e, h, inter, top_k = 128, 2048, 768, 8
    (gu, dn), (wg64, wd64) = _stacks(e, h, inter, seed=3)
    g = torch.Generator().manual_seed(4)
    x, logits = torch.randn(tokens, h, generator=g).bfloat16(), torch.randn(tokens, e, generator=g).bfloat16()
    out = moe_mxfp4.fused_moe(x.to(DEV), logits.to(DEV), top_k, gate_up=gu, gate_up_bias=None, down=dn,
                              down_bias=None, alpha=1.702, limit=7.0, activation="silu")  # fmt: skip
    w, ids = ref.moe_route(logits.double(), top_k)
    want = ref.moe_experts(x.double(), w, ids, wg64, None, wd64, None, 1.702, 7.0, "silu")
    assert_close(f"qwen3-30b-a3b fp8 experts T={tokens}", out, want.to(out.device), torch.bfloat16)
