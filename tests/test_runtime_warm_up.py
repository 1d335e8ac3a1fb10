"""LLMEngine.warm_up compiles every Triton kernel variant a served workload meets (issue 14: on the H200 the first
request after start needed an attention variant the warm-up had not compiled, and a host without a C compiler
cannot compile it then).

On CPU the kernels run under the Triton interpreter, which compiles nothing; so each launch is also bound the way
Triton's JIT binds it for an H200 (triton.runtime.jit.create_function_from_signature with the CUDA backend for
sm_90): the specialisation list that makes its compile key (constexpr values, argument dtypes, each specialised
integer's == 1 / divisible-by-16 class, each pointer's 16-byte alignment) plus the launch options. The test records
those keys during the warm-up, then during a varied workload, and asserts the second set is inside the first. Only
the keys are judged, so a launch whose key is already recorded is not interpreted (`CompileKeys.skip_repeats`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

from envex.kernels import gemv
from envex.kernels.invariant_ops import InvariantTritonOps
from envex.kernels.triton_ops import TritonOps
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
from envex.runtime.engine.accel.warm_up import warm_up_steps

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches"),
    # Launches that are not interpreted leave their outputs unwritten (CompileKeys.skip_repeats), so later ones
    # compute on whatever the memory held: numpy's overflow and NaN warnings are expected and say nothing.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

VOCAB, MAX_LEN, BUDGET, SEQS, BLOCKS = 96, 320, 64, 8, 48
H200 = make_backend(GPUTarget("cuda", 90, 32))


class CompileKeys:
    """Records, per launch, the compile key Triton's JIT would use on an H200 (and, to show what the markings
    change, the key with every integer specialised)."""

    ALWAYS_RUN = frozenset({"_route_kernel"})  # its expert ids index tensors, so it runs even when skipping

    def __init__(self) -> None:
        self.keys: set[tuple[Any, ...]] = set()
        # While set, a launch whose key is already recorded is not interpreted (only its key counts): the warm-up
        # meets each key many times, and its outputs are thrown away. Interpreting them all took ~9 minutes for
        # the gpt-oss model on two cores.
        self.skip_repeats = False
        self.known: set[tuple[Any, ...]] = set()  # keys met before `keys` was cleared: repeats too, when skipping
        self.all_specialised: dict[str, set[tuple[Any, ...]]] = {}
        self._binders: dict[Any, tuple[Any, Any]] = {}

    def _bind(self, fn: InterpretedFunction) -> tuple[Any, Any]:
        if fn.fn not in self._binders:
            marked = JITFunction(fn.fn, do_not_specialize=fn.kwargs.get("do_not_specialize"),
                                 do_not_specialize_on_alignment=fn.kwargs.get("do_not_specialize_on_alignment"))
            plain = JITFunction(fn.fn)  # fmt: skip
            self._binders[fn.fn] = tuple(create_function_from_signature(j.signature, j.params, H200)
                                         for j in (marked, plain))  # fmt: skip
        return self._binders[fn.fn]

    def record(self, fn: InterpretedFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Records the launch's key; says whether the launch must still be interpreted."""
        marked, plain = self._bind(fn)
        _, spec, options = marked(*args, **kwargs)
        name = fn.fn.__qualname__
        key = (name, repr(spec), repr(sorted(options.items())))
        seen = key in self.keys or key in self.known
        self.keys.add(key)
        self.all_specialised.setdefault(name, set()).add(repr(plain(*args, **kwargs)[1]))
        return not (seen and self.skip_repeats and name not in self.ALWAYS_RUN)

    @classmethod
    def kernel(cls, key: tuple[Any, ...]) -> str:
        return key[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (4 query heads, 2 KV heads: a GQA group of 2) with random weights and a word tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    out = tmp_path_factory.mktemp("tiny-warm-up")
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "eos_token_id": VOCAB - 1,
    }))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def tiny_gpt_oss(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer gpt-oss (a sliding-window layer of 32 tokens with sinks, then a full one; 8 experts, top 2,
    MXFP4-packed) with random weights and the same tokenizer. (Top 2, not the real model's 4: whether the warm-up
    compiles what serving meets does not depend on it, and the MoE kernels' interpreted programs, one per token and
    chosen expert, took most of the test's 190 s.)"""
    out = tmp_path_factory.mktemp("tiny-gpt-oss")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tiny_model / name).read_bytes())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32, "attention_bias": True,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "eos_token_id": VOCAB - 1, "hidden_act": "silu",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }))  # fmt: skip
    return out


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[CompileKeys]:
    keys = CompileKeys()
    run = InterpretedFunction.run

    def recording_run(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if keys.record(self, args, kwargs):
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    yield keys


def _triton_engine(model: Path, monkeypatch: pytest.MonkeyPatch, *, deterministic: bool = False) -> LLMEngine:
    """The engine with the Triton ops on CPU, as on CUDA: row-major weights, the decode-graph step (run eagerly:
    capture=False; on CUDA its kernels are compiled by the capture, before the warm-up). The one-row projections
    take the chunked GEMV: the persistent one (what the H200 tuning picks) takes ~150 ms a launch interpreted."""
    monkeypatch.setattr(gemv, "tuned_config", lambda n, k, prologue: gemv.DEFAULT_CONFIG)
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", load_format="dummy", warm_up=False,
                                    max_model_len=MAX_LEN, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS,
                                    num_kv_blocks=BLOCKS, async_scheduling=True,
                                    deterministic=deterministic))  # fmt: skip
    runner = engine.runner
    runner.ops = InvariantTritonOps() if deterministic else TritonOps()
    for p in runner.model.parameters():
        p.data = p.data.contiguous()  # the CPU runner stores matrices column-major (for BLAS); CUDA does not
    runner.decode_graphs = DecodeGraphs(runner, max_batch=SEQS, capture=False)
    return engine


def _capture(graphs: DecodeGraphs) -> None:
    """What DecodeGraphs._capture_all runs before capturing each batch size (its kernels' compilation)."""
    with torch.inference_mode():
        for b, n in graphs.keys:
            graphs._inputs[b].active.zero_()
            graphs._forward(b, n)


def _ids(n: int, salt: int) -> list[int]:
    return [(j * 31 + salt * 7) % (VOCAB - 2) for j in range(n)]


def _warm_then_serve(engine: LLMEngine, recorder: CompileKeys,
                     lengths: tuple[int, ...] = (1, 2, 3, 6, 16, 17, 33, 64, 127, 129, 300)
                     ) -> tuple[set[Any], set[Any]]:  # fmt: skip
    """(the keys of the start: graph captures and warm-up; the keys of a varied workload after it)."""
    assert engine.runner.decode_graphs is not None
    # Only the keys are judged, so a launch whose key is already recorded is not interpreted, at the start (whose
    # outputs are thrown away) nor in the workload below: its outputs would only pick the next tokens, which nothing
    # here judges (ignore_eos, fixed max_tokens; the sampler takes the argmax of a row that is not finite). A new
    # key in the workload, a miss, still runs. (The workload ran every launch until 2026-12-08: 60-160 s a test.)
    recorder.skip_repeats = True
    _capture(engine.runner.decode_graphs)
    engine.warm_up()
    warm = set(recorder.keys)
    recorder.known = warm
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    recorder.keys.clear()
    recorder.all_specialised.clear()

    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    # A lone short request, then a lone 1-token prompt.
    engine.generate([_ids(7, 0)], greedy)
    engine.generate([_ids(1, 1)], greedy)
    # A batch of many, every length class: 1..300 with odd lengths and multiples of 16 (chunked prefill: the
    # budget is 64 tokens; more requests than max_num_seqs wait).
    engine.generate([_ids(n, i) for i, n in enumerate(lengths)],
                    SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True))  # fmt: skip
    # A repeat: a prefix-cache hit, whose first step computes only the prompt's last 4 tokens over 96 cached ones.
    hits = engine.stats().prefix_cache_hit_tokens_total
    engine.generate([_ids(100, 9)], greedy)
    engine.generate([_ids(100, 9)], SamplingParams(max_tokens=2, temperature=0.0, logprobs=2, ignore_eos=True))
    if engine.blocks.enable_prefix_caching:  # (off with sliding-window layers: window_kv.py)
        assert engine.stats().prefix_cache_hit_tokens_total > hits, "the repeated prompt did not hit the cache"
    return warm, set(recorder.keys)


def _assert_inside(served: set[Any], warm: set[Any]) -> set[str]:
    missing = served - warm
    assert not missing, "compiled during serving, not by the warm-up:\n" + "\n".join(map(str, sorted(missing)))
    return {CompileKeys.kernel(k) for k in served}


def test_the_warm_up_compiles_every_variant_a_varied_workload_meets(tiny_model: Path, recorder: CompileKeys,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    warm, served = _warm_then_serve(_triton_engine(tiny_model, monkeypatch), recorder)
    kernels = _assert_inside(served, warm)
    assert {"_attn_kernel", "_decode_fused_kernel", "_merge_splits_kernel", "_rotary_store_kernel",
            "_rms_norm_kernel", "_silu_and_mul_kernel"} <= kernels, kernels  # fmt: skip
    assert any(k.startswith("_gemv") for k in kernels), kernels
    # The workload does meet what the markings are for: with every integer specialised, its attention launches
    # fall into several classes of the block table's stride (the H200's failure).
    assert len(recorder.all_specialised["_attn_kernel"]) > len({k for k in served if k[0] == "_attn_kernel"})


@pytest.mark.slow
def test_the_deterministic_warm_up_compiles_every_variant_too(tiny_model: Path, recorder: CompileKeys,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch-invariant kernels: the matmul's tiles and split by M, the attention's split and full kernels."""
    warm, served = _warm_then_serve(_triton_engine(tiny_model, monkeypatch, deterministic=True), recorder)
    kernels = _assert_inside(served, warm)
    # (No _reduce_kernel: the tiny model's K of 64 is one piece, so no matmul splits it.)
    assert {"_matmul_kernel", "_full_kernel", "_split_kernel", "_merge_kernel", "_rotary_store_kernel",
            "_rms_norm_kernel"} <= kernels, kernels  # fmt: skip
    # M is not specialised: with it specialised, the matmul would meet more variants than the warm-up compiled.
    assert len(recorder.all_specialised["_matmul_kernel"]) > len({k for k in served if k[0] == "_matmul_kernel"})


def test_the_warm_up_steps_take_every_choice_through_each_value() -> None:
    """The plan itself: short queries at every power-of-two length (so every key-split count), prefill chunks of
    every power-of-two length up to the budget, and batches up to the sequence limit."""
    steps = warm_up_steps(max_num_batched_tokens=8192, max_num_seqs=64, max_len=8192)  # every length: no dedupe
    single = {s.chunks[0] for s in steps if len(s.chunks) == 1}
    for q in (1, 2, 3, 4):
        assert {(q, 1 << i) for i in range(2, 14)} <= single
    from envex.kernels.attention import choose_num_splits

    def splits(batch: int, n: int) -> int:  # as on an H200: 8 "SMs" off CUDA, times 33 = 132 SMs times 2
        return choose_num_splits(batch, 8, n, torch.device("cpu"), programs_per_sm=33)

    planned = {splits(1, n) for q, n in single if q == 1}
    assert planned == {1, 2, 4, 8, 16, 32}  # 264 programs over 8 KV heads: at most 33 splits, so 32
    for batch in (1, 2, 3, 64):  # any batch and length: its split count is one the plan's steps meet
        assert {splits(batch, n) for n in range(1, 8193, 37)} <= planned
    assert {(q, q) for q in (5, 6, 7, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)} <= single
    assert {len(s.chunks) for s in steps} == {1, 2, 4, 8, 16, 32, 64}
    assert all(sum(q for q, _ in s.chunks) <= 8192 for s in steps)
    # With the launchers' split counts known, one length per count is enough: the shortest.
    deduped = warm_up_steps(max_num_batched_tokens=8192, max_num_seqs=64, max_len=8192,
                            split_counts=lambda batch, q, n: splits(batch, n))  # fmt: skip
    for q in (1, 2, 3, 4):
        kept = [s.chunks[0][1] for s in deduped if len(s.chunks) == 1 and s.chunks[0][0] == q]
        assert kept == [q if q in (1, 2, 4) else 4, 128, 256, 512, 1024, 2048], (q, kept)
    small = warm_up_steps(max_num_batched_tokens=48, max_num_seqs=6, max_len=100)
    assert max(n for s in small for _, n in s.chunks) == 100 and max(len(s.chunks) for s in small) == 6
    assert all(sum(q for q, _ in s.chunks) <= 48 for s in small)


def test_split_counts_are_powers_of_two() -> None:
    from envex.kernels.attention import MAX_SPLITS, choose_num_splits

    seen = {choose_num_splits(b, h, n, torch.device("cpu"), programs_per_sm=p)
            for b in (1, 2, 5) for h in (1, 3, 8) for n in (1, 64, 65, 1000, 100000) for p in (2, 40)}  # fmt: skip
    assert seen <= {1 << i for i in range(7)} and max(seen) == MAX_SPLITS == 64
    assert triton.next_power_of_2(max(seen)) == max(seen)


@pytest.mark.slow
def test_the_gpt_oss_warm_up_compiles_every_variant_too(tiny_gpt_oss: Path, recorder: CompileKeys,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliding-window layers with sinks (their split counts from the window) and the MoE's GEMV and grouped tiles."""
    warm, served = _warm_then_serve(_triton_engine(tiny_gpt_oss, monkeypatch), recorder, lengths=(1, 3, 17, 40, 129))
    kernels = _assert_inside(served, warm)
    assert {"_attn_kernel", "_decode_fused_kernel", "_gate_up_gemv_kernel", "_down_gemv_kernel",
            "_gate_up_grouped_kernel", "_down_grouped_kernel", "_route_kernel"} <= kernels, kernels  # fmt: skip


def test_one_long_sequence_gets_splits_of_at_most_2k_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 1 on an H200's 132 SMs: 2 programs an SM give 32 splits; past 64K keys a split would hold more than
    LONG_SPLIT_KEYS, so it splits further (64 at 131K, MAX_SPLITS); short sequences and larger batches as before."""
    from envex.kernels import attention

    monkeypatch.setattr(attention, "_sm_count", lambda _device: 132)
    cpu = torch.device("cpu")
    assert [attention.choose_num_splits(1, 8, n, cpu) for n in (1024, 10240, 65536, 131072)] == [16, 32, 32, 64]
    assert attention.choose_num_splits(2, 8, 131072, cpu) == 16 and attention.choose_num_splits(64, 8, 131072, cpu) == 1
