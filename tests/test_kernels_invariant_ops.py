"""InvariantTritonOps (deterministic mode) through the model file: within tolerance of the torch reference, and a
sequence's logits bit-identical whether it is prefilled in one chunk or in pieces next to another sequence, decoded
alone through the batch-1 step or in a padded graph batch, or recomputed by a prefill over its generated tokens (what
preemption does). On the CPU the kernels run under the Triton interpreter and the graphs run their step eagerly.
"""

from types import SimpleNamespace

import pytest
import torch

from envex.kernels import invariant_matmul
from envex.kernels.accuracy import rel_err
from envex.kernels.invariant_ops import InvariantTritonOps
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.runtime.config import ModelConfig
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
from envex.runtime.models import dummy_weights
from envex.runtime.models.llama import LlamaForCausalLM, rope_cos_sin
from envex.tests.support.kernels import compile_for_hopper, eager_step

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE, MAX_LEN, VOCAB = 8, 64, 40
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False}  # fmt: skip  (q/k norms: every attention input path)


class _Runner(SimpleNamespace):
    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.model(self.ops, input_ids, self.kv_caches, meta)
        return self.model.compute_logits(self.ops, hidden, residual)


def _runner(ops) -> _Runner:
    config = ModelConfig.from_hf(CONFIG)
    model = LlamaForCausalLM(config, dtype=torch.float32, device=DEV)
    dummy_weights(model, seed=1)
    cos, sin = rope_cos_sin(config, MAX_LEN, DEV)
    caches = [(torch.zeros(12, PAGE, 2, 32, device=DEV), torch.zeros(12, PAGE, 2, 32, device=DEV)) for _ in range(2)]
    return _Runner(model=model, ops=ops, kv_caches=caches, cos=cos, sin=sin, device=DEV, block_size=PAGE,
                   max_model_len=MAX_LEN, model_config=config)  # fmt: skip


def _step(runner: _Runner, ids: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
    """One eager step: sequence b feeds ids[b] at positions starts[b]..; logits of every token [T, V]."""
    tokens, meta, _ = eager_step(ids, starts, tables, runner.cos, runner.sin, PAGE, DEV)
    with torch.inference_mode():
        return runner.forward_logits(tokens, meta)


PROMPT = [4, 11, 29, 3, 8, 1, 2, 3, 5, 8, 13, 21, 34, 7, 11, 18, 9, 30, 2]  # 19 tokens
OTHER = [5, 6, 7, 8, 9, 10, 11]


def test_deterministic_triton_ops_equal_the_reference_within_tolerance() -> None:
    fast, slow = _runner(InvariantTritonOps()), _runner(TorchOps())
    for name, ids, starts in (("prefill", [PROMPT], [0]), ("decode", [[12]], [19])):
        want, got = _step(slow, ids, starts, [[3, 7, 1]]), _step(fast, ids, starts, [[3, 7, 1]])
        assert rel_err(got, want) < (2e-3 if DEV.type == "cpu" else 5e-3), f"{name}: {rel_err(got, want):.2e}"


def test_a_sequence_s_logits_do_not_depend_on_its_batch() -> None:
    runner = _runner(InvariantTritonOps())
    table, other_table = [3, 7, 1], [5, 9]
    full = _step(runner, [PROMPT], [0], [table])  # [19, V]: the whole prompt in one chunk
    decoded = [_step(runner, [[t]], [19 + i], [table])[0] for i, t in enumerate((12, 30))]  # batch-1 steps
    # The same prompt in two chunks, the second beside another sequence's prefill; then decoded in a padded graph
    # batch (3 sequences in the graph of 4) at row 1.
    first = _step(runner, [PROMPT[:6]], [0], [table])
    second = _step(runner, [OTHER, PROMPT[6:]], [0, 6], [other_table, table])[len(OTHER):]
    assert torch.equal(torch.cat([first, second]), full), "chunked prefill differs from one chunk"
    graphs = DecodeGraphs(runner, max_batch=4, capture=DEV.type == "cuda")
    for i, t in enumerate((12, 30)):
        got = graphs.run([1, t, 3], [7 + i, 19 + i, 2 + i], [other_table, table, [11]])[1]
        assert torch.equal(got, decoded[i]), f"decode step {i} in a graph batch differs from batch 1"
    # Recompute after preemption: the prompt and the generated tokens in one prefill, into other blocks.
    again = _step(runner, [PROMPT + [12, 30]], [0], [[2, 4, 6]])
    assert torch.equal(again[:19], full) and torch.equal(again[19:], torch.stack(decoded))
    # The KV the decode steps wrote equals the recomputed KV (blocks 1 and 6 hold positions 16-20).
    for k, v in runner.kv_caches:
        assert torch.equal(k[1, :5], k[6, :5]) and torch.equal(v[1, :5], v[6, :5])


def test_the_pieces_summed_by_the_norm_give_the_reduce_kernel_s_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-sized steps hand O's and down's K pieces to the next norm instead of the reduce launch: every logit
    equals the reduce kernel's path bit for bit (pieces of 32 here, so this small model's projections split)."""
    monkeypatch.setattr(invariant_matmul, "MIN_CHUNK", 32)
    monkeypatch.setattr(invariant_matmul, "K_ALIGN", 32)
    monkeypatch.setattr(invariant_matmul, "SMALL_TILE", invariant_matmul.Tile(16, 64, 32, 4, 3, swap=True))
    monkeypatch.setattr(invariant_matmul, "DECODE_TILE", invariant_matmul.Tile(64, 64, 32, 4, 3))
    monkeypatch.setattr(invariant_matmul, "PREFILL_TILE", invariant_matmul.Tile(128, 128, 32, 8, 3))
    monkeypatch.setattr(invariant_matmul, "WIDE_TILE", invariant_matmul.Tile(128, 256, 32, 8, 3))
    handed = []
    matmul = invariant_matmul.matmul

    def recording(*args, **kwargs):
        out = matmul(*args, **kwargs)
        handed.append(out.dim() == 3)
        return out

    monkeypatch.setattr(invariant_matmul, "matmul", recording)
    pieces, reduced = _runner(InvariantTritonOps()), _runner(InvariantTritonOps(split_k=False))
    reference = _runner(TorchOps())
    table, other_table = [3, 7, 1], [5, 9]
    for ids, starts, tables in (([PROMPT], [0], [table]), ([[12]], [19], [table]),
                                ([[1, 2], [30]], [0, 20], [other_table, table])):  # fmt: skip
        got, want = _step(pieces, ids, starts, tables), _step(reduced, ids, starts, tables)
        assert torch.equal(got, want), f"{ids}: the norm's sum of the pieces differs from the reduce kernel's"
        exact = _step(reference, ids, starts, tables)  # and both are the model's logits, not the same mistake
        assert rel_err(got, exact) < (2e-3 if DEV.type == "cpu" else 5e-3), f"{ids}: {rel_err(got, exact):.2e}"
    assert any(handed), "no projection handed its pieces on: the test shapes did not split"


# Compiles the deterministic kernels for Hopper (sm_90) with Triton's own ptxas, no GPU needed, in a process without
# the interpreter: the CPU tests run the kernels interpreted, which says nothing of what the GPU compiler makes of
# them. Prints the wgmma instruction shapes each kernel uses.
_AOT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import invariant_attention as ia, invariant_matmul as im

def shapes(fn, args, consts, warps, stages):
    sig = {**args, **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, ty) in enumerate(sig.items())
             if (n.endswith("_ptr") and ty.startswith("*")) or n.startswith("stride")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", k.asm["ptx"])))

mm = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", wraw_ptr="*bf16",
          M="i32", N="i32", stride_xm="i32", stride_wn="i32", stride_om="i32", stride_ps="i32", stride_pm="i32")
out = {}
for name, t, split, tma in (("small", im.SMALL_TILE, True, False), ("decode", im.DECODE_TILE, True, False),
                            ("small_tma", im.SMALL_TILE, True, 1), ("decode_tma", im.DECODE_TILE, True, 1),
                            ("small_tma_w", im.SMALL_TILE, True, 2), ("decode_tma_w", im.DECODE_TILE, True, 2),
                            ("prefill", im.PREFILL_TILE, False, True), ("wide", im.WIDE_TILE, False, True),
                            ("wide_pointers", im.WIDE_TILE, False, False),
                            ("deep_small", im.DEEP_SMALL_TILE, False, False),
                            ("deep_decode_tma_w", im.DEEP_DECODE_TILE, False, 2),
                            ("deep_decode", im.DEEP_DECODE_TILE, False, False)):
    c = dict(K=4096, CHUNK=1024, HAS_BIAS=True, SPLIT=split, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
             BLOCK_K=t.block_k, UPCAST_DOT=False, USE_PDL=split, SWAP=t.swap, GROUP_M=t.group_m, TMA=tma,
             WARM=0, LINE=64)
    desc = {"x_ptr": f"tensordesc<bf16[{t.block_m}, {t.block_k}]>"} if tma == 1 else {}
    desc = {**desc, "w_ptr": f"tensordesc<bf16[{t.block_n}, {t.block_k}]>"} if tma else desc
    out[name] = shapes(im._matmul_kernel, {**mm, **desc}, c, t.num_warps, t.num_stages)
attn = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16")
kv = dict(stride_kb="i32", stride_ks="i32", stride_kh="i32", stride_bt="i32")
common = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=ia.BLOCK_M, BLOCK_N=ia.BLOCK_N, PAGE=16,
              SPLIT=ia.SPLIT_KEYS, UPCAST_DOT=False)
out["full"] = shapes(ia._full_kernel, {**attn, "out_ptr": "*bf16", "cu_q_ptr": "*i32", "seq_lens_ptr": "*i32",
                     "block_tables_ptr": "*i32", "qk_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32",
                     "stride_ot": "i32", "stride_oh": "i32", **kv}, {**common, "USE_PDL": False}, ia.NUM_WARPS, 3)
split = {**attn, "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "seq_lens_ptr": "*i64", "pos_ptr": "*i64",
         "block_tables_ptr": "*i32", "qk_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", **kv,
         "stride_as": "i32", "stride_at": "i32", "stride_ah": "i32", "stride_ms": "i32", "stride_mt": "i32",
         "stride_mh": "i32", "num_progs": "i32", "k_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*fp32",
         "sin_ptr": "*fp32", "slot_ptr": "*i64", "stride_kt": "i32", "stride_khh": "i32", "stride_vt": "i32",
         "stride_vh": "i32", "stride_cos": "i32", "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32"}
for name, rotary, fold in (("split", False, False), ("split_rotary", True, False), ("split_fold", True, True)):
    out[name] = shapes(ia._split_kernel, split, {**common, "FROM_POSITIONS": True, "USE_PDL": True,
                       "ROTARY": rotary, "FOLD": fold}, ia.NUM_WARPS, 2)
print(json.dumps(out))
"""


def test_the_kernels_compile_for_hopper_with_the_same_instruction_in_every_schedule() -> None:
    shapes = compile_for_hopper(_AOT)
    # Attention: the decode and prefill schedules issue the same tensor-core instructions (QK and PV).
    assert shapes["split"] == shapes["split_rotary"] == shapes["split_fold"] == shapes["full"] == [
        "m64n128k16", "m64n64k16"], shapes  # fmt: skip
    # Matmul: every tile is m64 x k16 steps; only the instruction's N and, for the small tile, which operand holds
    # the weight differ (the assumption the H200 run checks).
    assert shapes["decode"] == ["m64n64k16"] and shapes["prefill"] == ["m64n128k16"], shapes
    assert shapes["small"] == shapes["deep_small"] == shapes["small_tma"] == shapes["small_tma_w"] == ["m64n16k16"]
    assert shapes["deep_decode_tma_w"] == shapes["decode"], shapes
    assert shapes["decode_tma"] == shapes["decode_tma_w"] == shapes["decode"], shapes
    assert shapes["wide"] == shapes["wide_pointers"] == ["m64n256k16"], shapes  # TMA loads, or masked ones
    assert shapes["deep_decode"] == shapes["decode"], shapes


# The batch-1 chain's schedule (verify/lab/journal-kernels.md, "The short launches trigger after their wait"): a decode
# projection asks L2 for its first weight columns before its programmatic wait, the short launches between two
# projections let the next launch start only after theirs. Compiled for sm_90 as above; the PTX order is checked.
_PDL_ORDER = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import invariant_attention as ia, invariant_matmul as im, norm

def ptx(fn, args, consts, warps=4, stages=1):
    sig = {**args, **{k: "constexpr" for k in consts}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return k.asm["ptx"]

def order(text):  # the PDL and prefetch instructions in program order, and the wgmma shapes
    marks = re.findall(r"(griddepcontrol\.wait|griddepcontrol\.launch_dependents|prefetch\.global\.L2)", text)
    return {"marks": [m.split(".")[-1] for m in marks],
            "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", text)))}

out = {}
t = im.SMALL_TILE
mm = dict(x_ptr="*bf16", w_ptr=f"tensordesc<bf16[{t.block_n}, {t.block_k}]>", bias_ptr="*bf16", out_ptr="*bf16",
          part_ptr="*fp32", wraw_ptr="*bf16", M="i32", N="i32", stride_xm="i32", stride_wn="i32", stride_om="i32",
          stride_ps="i32", stride_pm="i32")
for warm in (0, im.warm_span(1024, 4096, 2)):
    c = dict(K=4096, CHUNK=1024, HAS_BIAS=False, SPLIT=True, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
             BLOCK_K=t.block_k, UPCAST_DOT=False, USE_PDL=True, SWAP=t.swap, GROUP_M=t.group_m, TMA=2, WARM=warm,
             LINE=64)
    out[f"matmul_warm{warm}"] = order(ptx(im._matmul_kernel, mm, c, t.num_warps, t.num_stages))
for late in (False, True):
    out[f"norm_{late}"] = order(ptx(norm._rms_norm_kernel, dict(
        x_ptr="*fp32", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", sum_ptr="*bf16", planes_ptr="*bf16", H="i32",
        stride_x="i32", stride_res="i32", stride_out="i32", stride_sum="i32", stride_planes="i32", eps="fp32",
        stride_split="i32"), dict(HAS_RESIDUAL=True, BLOCK_H=4096, PLANES=False, USE_PDL=True, SPLITS=4, LATE=late),
        16))
    out[f"silu_{late}"] = order(ptx(im._silu_mul_kernel, dict(x_ptr="*bf16", out_ptr="*bf16", M="i32",
        stride_xm="i32", stride_om="i32"), dict(K=14336, BLOCK=1024, USE_PDL=True, LATE=late)))
    out[f"reduce_{late}"] = order(ptx(im._reduce_kernel, dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
        M="i32", N="i32", stride_ps="i32", stride_pm="i32", stride_om="i32"), dict(PIECES=4, HAS_BIAS=False,
        BLOCK_M=16, BLOCK_N=128, USE_PDL=True, LATE=late)))
    out[f"merge_{late}"] = order(ptx(ia._merge_kernel, dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32",
        out_ptr="*bf16", seq_lens_ptr="*i64", pos_ptr="*i64", qk_scale="fp32", stride_as="i32", stride_at="i32",
        stride_ah="i32", stride_ms="i32", stride_mt="i32", stride_mh="i32", stride_ot="i32", stride_oh="i32"),
        dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, BLOCK_D=128, SPLIT=ia.SPLIT_KEYS, FROM_POSITIONS=True,
             USE_PDL=True, LATE=late)))
print(json.dumps(out))
"""


def test_batch_one_chain_warms_the_weight_before_waiting_and_short_launches_trigger_after_theirs() -> None:
    got = compile_for_hopper(_PDL_ORDER)
    cold, warm = got["matmul_warm0"], got[f"matmul_warm{invariant_matmul.warm_span(1024, 4096, 2)}"]
    assert cold["marks"] == ["launch_dependents", "wait"], cold
    prefetches = warm["marks"][:-2]
    assert prefetches and set(prefetches) == {"L2"} and warm["marks"][-2:] == ["launch_dependents", "wait"], warm
    assert warm["wgmma"] == cold["wgmma"] == ["m64n16k16"], (warm, cold)  # the same k16 steps: the same bits
    for kernel in ("norm", "silu", "reduce", "merge"):
        assert got[f"{kernel}_False"]["marks"] == ["launch_dependents", "wait"], (kernel, got[f"{kernel}_False"])
        assert got[f"{kernel}_True"]["marks"] == ["wait", "launch_dependents"], (kernel, got[f"{kernel}_True"])


def test_the_warm_span_is_whole_lines_inside_the_piece() -> None:
    assert invariant_matmul.WARM_K and invariant_matmul.warm_span(1024, 4096, 2) == invariant_matmul.WARM_K
    assert invariant_matmul.warm_span(1024, 96, 2) == 64  # K = 96: the largest power of two inside it, one line
    assert invariant_matmul.warm_span(1024, 40, 2) == 0  # not one 128-byte line of a bf16 row
    assert invariant_matmul.warm_span(1024, 40, 4) == 32  # a float32 row's line is 32 elements
    assert invariant_matmul.warm_span(256, 4096, 2) == min(invariant_matmul.WARM_K, 256)
