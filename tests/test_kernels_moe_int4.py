"""INT4 group-quantized experts (Kimi K2's compressed-tensors pack-quantized experts, Qwen3-MoE AWQ/GPTQ releases):
the stack (kernels.quant.Int4GroupStack) against each expert's matrix dequantized on its own, the fused expert
kernels reading words, group scales and zeros (GEMV path at 1 and 3 rows, grouped at 9) against the float64
reference for groups of 32 and 128, symmetric and with zeros, Ops.moe on the Triton ops against the torch ops,
and the one-line refusals of an inconsistent stack."""

import pytest
import torch

from envex.kernels import moe_mxfp4, quant
from envex.kernels import reference as ref
from envex.kernels.ops import MoEWeights
from envex.tests.support.kernels import assert_close, compile_for_hopper
from envex.tests.test_kernels_moe_fp8 import assert_ops_moe_agree
from envex.tests.test_kernels_moe_gemv import AOT_PTX

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# H past one 128-group and not a whole number of 32-groups: ragged last groups; I = 80 likewise (one partial 128-group)
E, H, INTER, TOP_K = 8, 136, 80, 2
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _stacks(e: int, h: int, inter: int, group: int, symmetric: bool, seed: int = 0):
    """Random experts quantized to INT4 stacks on DEV, and their float64 values."""
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    wd = torch.randn(e, h, inter, generator=g) * inter**-0.5
    stacks = [quant.quantize_int4_stack(w, group, symmetric=symmetric) for w in (wg, wd)]
    f64 = tuple(torch.stack([s.expert(i, torch.float64) for i in range(e)]) for s in stacks)
    on = tuple(quant.Int4GroupStack(data=s.data.to(DEV), scale=s.scale.to(DEV), group=group,
                                    zero=None if s.zero is None else s.zero.to(DEV)) for s in stacks)  # fmt: skip
    return on, f64


def test_stack_is_each_expert_matrix_packed_on_its_own() -> None:
    """Expert e of the stack dequantizes as its own int4_group PackedWeight (quant.dequantize), and a stack of
    pack-quantized checkpoint matrices keeps their words as they are."""
    w = torch.randn(3, 48, 72, generator=torch.Generator().manual_seed(1))
    for symmetric in (True, False):
        s = quant.quantize_int4_stack(w, 32, symmetric=symmetric)
        assert s.shape == (3, 48, 72) and (s.zero is None) == symmetric and s.scale.dtype == torch.bfloat16
        for e in (0, 2):
            one = quant.quantize_int4(w[e], 32, symmetric=symmetric)
            assert torch.equal(s.data[e], one.data)
            assert torch.equal(s.expert(e, torch.float64), quant.dequantize(one, torch.float64))
            assert (s.expert(e) - w[e]).abs().max() <= s.scale[e].float().max() * (0.5 if symmetric else 1.0)
    ct = quant.from_pack_quantized(s.data[1], s.scale[1].float(), (48, 72), 32)
    assert torch.equal(quant.stack_int4([ct, ct]).data[0], s.data[1])


# GEMV path (1, 3 rows) in float32; the grouped path (9 rows) multiplies on tensor cores, in bf16
@pytest.mark.parametrize("tokens,group,symmetric,dtype", [
    (1, 32, True, torch.float32), (3, 128, False, torch.float32),
    (9, 32, False, torch.bfloat16), (9, 128, True, torch.bfloat16)])  # fmt: skip
def test_fused_moe_reads_int4_experts(tokens: int, group: int, symmetric: bool, dtype: torch.dtype) -> None:
    (gu, dn), (wg64, wd64) = _stacks(E, H, INTER, group, symmetric, seed=tokens + group)
    g = torch.Generator().manual_seed(50 + tokens)
    x, logits = torch.randn(tokens, H, generator=g).to(dtype), torch.randn(tokens, E, generator=g).to(dtype)
    out = moe_mxfp4.fused_moe(x.to(DEV), logits.to(DEV), TOP_K, gate_up=gu, gate_up_bias=None, down=dn,
                              down_bias=None, alpha=1.702, limit=7.0, activation="silu")  # fmt: skip
    w, ids = ref.moe_route(logits.double(), TOP_K, True)
    want = ref.moe_experts(x.double(), w, ids, wg64, None, wd64, None, 1.702, 7.0, "silu")
    assert out.dtype == dtype
    assert_close(f"int4 experts T={tokens} G={group} symmetric={symmetric}", out, want.to(out.device), dtype)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_triton_ops_moe_on_int4_experts_equals_torch_ops(scoring: str) -> None:
    """Ops.moe at 2 rows (GEMV) and 6 (grouped): Qwen3-MoE's softmax routing with zeros (AWQ), and DeepSeek-V3's
    sigmoid routing with a shared expert, symmetric (Kimi K2)."""
    shared = 1 if scoring == "sigmoid" else 0
    (gu, dn), _ = _stacks(E + shared, 64, 48, 16, symmetric=bool(shared), seed=7)
    g = torch.Generator().manual_seed(8)
    extra = dict(scoring="sigmoid", correction_bias=torch.randn(E, generator=g).to(DEV) * 0.1, n_group=4,
                 topk_group=2, scaling=2.5, shared_experts=1) if shared else {}  # fmt: skip
    experts = MoEWeights(gate_up=gu.data, down=dn.data, gate_up_scale=gu.scale, down_scale=dn.scale,
                         gate_up_zero=gu.zero, down_zero=dn.zero, group=16, activation="silu", **extra)  # fmt: skip
    assert experts.int4 and not experts.fp8 and experts.quantized and experts.intermediate_size == 48
    assert_ops_moe_agree(experts, g, scoring)


def test_inconsistent_int4_experts_are_one_line() -> None:
    (gu, dn), _ = _stacks(2, 64, 48, 16, symmetric=False)
    with pytest.raises(ValueError, match=r"int4 experts: need data int32 \[E, N, K/8\].*got data torch.int32 "
                                         r"\[2, 96, 8\], scale torch.bfloat16 \[2, 96, 2\]"):  # fmt: skip
        MoEWeights(gate_up=gu.data, down=dn.data, gate_up_scale=gu.scale[:, :, :2], down_scale=dn.scale, group=16)
    with pytest.raises(ValueError, match="group 24"):
        quant.Int4GroupStack(data=gu.data, scale=gu.scale, group=24)
    with pytest.raises(ValueError, match="INT4 gate_up and down need their group scales"):
        MoEWeights(gate_up=gu.data, down=dn.data)
    with pytest.raises(ValueError, match="zero points are for INT4 experts"):
        MoEWeights(gate_up=gu.data.float(), down=dn.data.float(), gate_up_zero=gu.zero)
    with pytest.raises(ValueError, match=r"INT4 gate_up \[2, 96, 48\] is not \[E, 2I, H\] = \[2, 96, 64\]"):
        MoEWeights(gate_up=gu.data[:, :, :6], down=dn.data, gate_up_scale=gu.scale[:, :, :3],
                   down_scale=dn.scale, group=16)  # fmt: skip
    with pytest.raises(ValueError, match="INT4 stacks of one group, both with zeros or neither"):
        moe_mxfp4.fused_moe(torch.zeros(1, 64, device=DEV), torch.zeros(1, 2, device=DEV), 1, gate_up=gu,
                            gate_up_bias=None, down=quant.Int4GroupStack(data=dn.data, scale=dn.scale, group=16),
                            down_bias=None, alpha=1.0, limit=1.0)  # fmt: skip


_AOT = AOT_PTX + r"""
def build(fn, args, consts):
    ptx = ptx_of(fn, args, consts, 1)
    return {"local": len(re.findall(r"(?:ld|st)\.local", ptx)),
            "v4": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32", ptx))}

w = dict(w_ptr="*i32", s_ptr="*bf16", b_ptr="*bf16", z_ptr="*u8")
st = {n: "i32" for n in ("stride_we", "stride_wn", "stride_se", "stride_be")}
int4 = dict(PACKED=False, FP8_BN=0, FP8_BK=0, INT4_G=128)
print(json.dumps({
    "gate_up": build(m._gate_up_gemv_kernel, dict(x_ptr="*bf16", xp_ptr="*fp32", logits_ptr="*bf16",
                     ids_ptr="*i32", wts_ptr="*fp32", **w, act_ptr="*fp32", stride_xp="i32", stride_l="i32", **st,
                     stride_act="i32", alpha="fp32", limit="fp32"),
                     dict(K=7168, INTER=2048, E=384, TOP_K=8, BLOCK_E=512, BLOCK_TK=8, BLOCK_I=m.GEMV_PAIRS,
                          GB=m.GEMV_GROUPS, **int4, USE_PDL=True)),
    "down": build(m._down_gemv_kernel, dict(act_ptr="*fp32", ids_ptr="*i32", wts_ptr="*fp32", **w, part_ptr="*fp32",
                  count_ptr="*i32", out_ptr="*bf16", stride_act="i32", **st, stride_o="i32"),
                  dict(N=7168, INTER=2048, TOP_K=8, BLOCK_N=m.GEMV_DOWN_ROWS, GB=m.GEMV_GROUPS, **int4, USE_PDL=True)),
}))
"""


def test_the_int4_expert_gemvs_compile_for_hopper() -> None:
    """The INT4 expert GEMVs at Kimi K2's width (H 7168, I 2048, 384 experts, groups of 32 words), built for sm_90
    by Triton's ptxas (the scale and zero loaded once a quad of words): the words read 16 bytes a thread, no
    register spills."""
    got = compile_for_hopper(_AOT)
    for name, k in got.items():
        assert k["v4"] >= 1 and not k["local"], (name, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_moe_int4_at_kimi_k2_width() -> None:
    """Kimi K2's expert width (H 7168, I 2048, symmetric groups of 32, bf16 scales), 4 experts top 2, both paths
    on the GPU in bf16 against float64."""
    (gu, dn), (wg64, wd64) = _stacks(4, 7168, 2048, 32, symmetric=True, seed=3)
    g = torch.Generator().manual_seed(4)
    for tokens in (1, 33):
        x, logits = torch.randn(tokens, 7168, generator=g).bfloat16(), torch.randn(tokens, 4, generator=g).bfloat16()
        out = moe_mxfp4.fused_moe(x.to(DEV), logits.to(DEV), 2, gate_up=gu, gate_up_bias=None, down=dn,
                                  down_bias=None, alpha=1.702, limit=7.0, activation="silu")  # fmt: skip
        w, ids = ref.moe_route(logits.double(), 2, True)
        want = ref.moe_experts(x.double(), w, ids, wg64, None, wd64, None, 1.702, 7.0, "silu")
        assert_close(f"kimi k2 width T={tokens}", out, want.to(out.device), torch.bfloat16)
