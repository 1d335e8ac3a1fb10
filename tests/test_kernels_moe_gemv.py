"""gpt-oss's MoE GEMV path (T <= GEMV_MAX_ROWS) at gpt-oss's widths: the K tails, the word-wise MXFP4 decode and
the down kernel's slot programs, against the float64 reference (tests/test_kernels_moe.py has the shared setup)."""

import pytest
import torch

from envex.kernels import mxfp4
from envex.kernels import reference as ref
from envex.tests.support.kernels import assert_close, compile_for_hopper
from envex.tests.test_kernels_moe import DEV, _expected, _experts, _moe

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.mark.parametrize("h,inter,tokens", [(2880, 32, 1), (64, 416, 1)])
def test_fused_moe_gemv_at_gpt_oss_widths(h: int, inter: int, tokens: int) -> None:
    """gpt-oss's hidden size K = 2880 (90 groups: two steps of 32 and a tail of 26) into the gate-up GEMV, and a
    down GEMV whose K (I = 416, 13 groups) ends inside its first step; bf16 with packed experts, against float64,
    top 4 of 6 (one down program per slot; the last to finish adds the 4)."""
    e, top_k = 6, 4
    weights, f64 = _experts(e, h, inter, packed=True, seed=7, spread_scales=True)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16).to(DEV)
    logits = torch.randn(tokens, e, generator=g).to(torch.bfloat16).to(DEV)
    out = _moe(x, logits, top_k, weights)
    assert_close(f"moe gemv H={h} I={inter}", out, _expected(x, logits, top_k, f64), torch.bfloat16)


def test_gemv_decodes_every_code_in_every_nibble() -> None:
    """Every byte value in every byte position of a word (the decode builds two fp16 halves per word with
    position-dependent shifts) and scales from 2^-15 to 2^-3, float32 activations: equal to float64 to float32
    rounding. Two tokens, top 2 of 3, so both slots' down programs are live."""
    e, h, inter, top_k = 3, 64, 64, 2
    g = torch.Generator().manual_seed(11)

    def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(112, 125, (e, n, k // 32), generator=g, dtype=torch.uint8)
        return blocks, scales

    gu, dn = packed(2 * inter, h), packed(h, inter)
    assert all(len(torch.unique(gu[0].reshape(-1, 4)[:, b])) == 256 for b in range(4))  # each byte of a word
    bg, bd = torch.randn(e, 2 * inter, generator=g) * 0.1, torch.randn(e, h, generator=g) * 0.1
    x = torch.randn(2, h, generator=g)  # gate/up mostly inside the SwiGLU's clamp, where errors would hide
    logits = torch.randn(2, e, generator=g)
    dev = (tuple(t.to(DEV) for t in gu), bg.to(DEV), tuple(t.to(DEV) for t in dn), bd.to(DEV))
    out = _moe(x.to(DEV), logits.to(DEV), top_k, dev)
    w, ids = ref.moe_route(logits.double(), top_k)
    want = ref.moe_experts(x.double(), w, ids, mxfp4.dequantize(*gu, torch.float64), bg.double(),
                           mxfp4.dequantize(*dn, torch.float64), bd.double(), 1.702, 7.0)  # fmt: skip
    assert_close("every code", out, want, torch.float32)


# Compiles the MoE kernels for Hopper (sm_90) with Triton's own ptxas, no GPU needed, in a process without the
# interpreter (which runs _e2m1_pair's tensor form, not its inline PTX), every stride a multiple of 16 as Triton's
# launcher specializes gpt-oss's. Per kernel: 16-byte weight and input-plane loads, the PTX widening of both
# halves, no local memory (spills), no shared-memory layout conversion in the GEMVs' K loop (weights and inputs
# share one layout: verify/lab/journal-kernels.md), PDL, and the grouped prefill tile on wgmma.
# AOT_PTX: the compile step, shared with tests/test_kernels_moe_fp8.py's FP8 variants.
AOT_PTX = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import moe_mxfp4 as m

def ptx_of(fn, args, consts, warps):
    import inspect  # parameters left out take their defaults (the INT4 ones: z_ptr None, INT4_G 0)
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                if n not in args and n not in consts and p.default is not inspect.Parameter.empty}
    consts = {**defaults, **consts}
    given = {**args, **{k: "constexpr" for k in consts}}
    sig = {n: given[n] for n in inspect.signature(fn.fn).parameters}  # in the kernel's order
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride"))}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return k.asm["ptx"]
"""
_AOT = AOT_PTX + r"""
def build(fn, args, consts, warps):
    ptx = ptx_of(fn, args, consts, warps)
    return {"v4": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32", ptx)), "cvt": ptx.count("cvt.f32.f16"),
            "local": len(re.findall(r"(?:ld|st)\.local", ptx)), "wgmma": "wgmma.mma_async" in ptx,
            "lds": len(re.findall(r"ld\.shared", ptx)), "pdl": "griddepcontrol.wait" in ptx}

w = dict(w_ptr="*i32", s_ptr="*u8", b_ptr="*bf16")
st = {n: "i32" for n in ("stride_we", "stride_wn", "stride_se", "stride_be")}
gemv = dict(BLOCK_TK=4, GB=m.GEMV_GROUPS, PACKED=True, FP8_BN=0, FP8_BK=0, USE_PDL=True)
out = {
    "gate_up": build(m._gate_up_gemv_kernel, dict(x_ptr="*bf16", xp_ptr="*fp32", logits_ptr="*bf16",
                     ids_ptr="*i32", wts_ptr="*fp32", **w, act_ptr="*fp32", stride_xp="i32", stride_l="i32", **st,
                     stride_act="i32", alpha="fp32", limit="fp32"),
                     dict(K=2880, INTER=2880, E=128, TOP_K=4, BLOCK_E=128, BLOCK_I=m.GEMV_PAIRS, **gemv), 1),
    "down": build(m._down_gemv_kernel, dict(act_ptr="*fp32", ids_ptr="*i32", wts_ptr="*fp32", **w, part_ptr="*fp32",
                  count_ptr="*i32", out_ptr="*bf16",
                  stride_act="i32", **st, stride_o="i32"), dict(N=2880, INTER=2880, TOP_K=4,
                  BLOCK_N=m.GEMV_DOWN_ROWS, GB=m.GEMV_GROUPS, PACKED=True, FP8_BN=0, FP8_BK=0, USE_PDL=True), 1),
    "down_grouped": build(m._down_grouped_kernel, dict(act_ptr="*bf16", pairs_ptr="*i32", block_expert_ptr="*i32",
                          wts_ptr="*fp32", **w, out_ptr="*fp32", stride_act="i32", **st, stride_sn="i32",
                          stride_o="i32"), dict(N=2880, INTER=2880, BLOCK_M=128, BLOCK_N=64, BLOCK_K=128,
                          PACKED=True, UPCAST_DOT=False, FP8_BN=0, FP8_BK=0), 8),
}
print(json.dumps(out))
"""


def test_the_moe_kernels_compile_for_hopper() -> None:
    got = compile_for_hopper(_AOT)
    assert got["gate_up"]["v4"] >= 8 and got["down"]["v4"] >= 8, got  # a 16-byte group per row and thread
    assert got["gate_up"]["cvt"] >= 128 and got["down"]["cvt"] >= 128, got  # every half widened in PTX
    assert not any(k["local"] for k in got.values()), got
    assert got["gate_up"]["pdl"] and got["down"]["pdl"], got  # batch 1 launches them as dependents
    assert got["gate_up"]["lds"] <= 2 and got["down"]["lds"] <= 2, got  # the epilogue's at most, none in the loop
    assert got["down_grouped"]["wgmma"], got
