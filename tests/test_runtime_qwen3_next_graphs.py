"""Qwen3-Next's decode steps in the decode graphs (runtime/engine/accel/cuda_graphs.py): each row's state slot is a
static input of the graph, and the padding rows of a batch rounded up to a ladder size read and write the state
pools' scratch slot only (StateSlots.scratch_slot). On the CPU the graph step runs eagerly (capture=False) on the
Triton ops under the interpreter; on a GPU (skipped here) the captured graphs replay."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from envex.kernels.triton_ops import TritonOps
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
from envex.tests.test_runtime_qwen3_next import PROMPTS, _hf_greedy, save_tiny_checkpoint

SEQS = 4  # the ladder is 1, 2, 4: three sequences decode at size 4, one row of padding
# (request, prompt, max_tokens): "b" finishes first; "late" joins at the third step, while the others decode
FIRST = [("a", PROMPTS[0], 6), ("b", PROMPTS[1], 2), ("c", [7, 3, 250, 11, 60], 5)]
LATE = ("late", PROMPTS[2], 4)
GraphStep = tuple[int, list[int], set[int]]  # (rows, their state slots, the slots whose state changed)


def _checkpoint(path: Path, **overrides) -> tuple[Path, dict[str, list[int]]]:
    """(the checkpoint's dir, HF's greedy tokens of each request run alone)."""
    model = save_tiny_checkpoint(path, **overrides)  # HF's greedy continuation of 6 tokens: each request's first n
    return path, {rid: _hf_greedy(model, prompt)[:n] for rid, prompt, n in [*FIRST, LATE]}


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory) -> tuple[Path, dict[str, list[int]]]:
    """The tiny Qwen3-Next with dense MLPs in every layer: the MoE kernels take most of an interpreted step, and
    the decode graphs of MoE models are checked elsewhere (test_runtime_qwen3_moe.py)."""
    return _checkpoint(tmp_path_factory.mktemp("qwen3_next_graphs") / "tiny", mlp_only_layers=[0, 1, 2, 3])


def _serve(engine: LLMEngine) -> dict[str, list[int]]:
    """The requests through engine.step, the late one added at the third step -> each request's tokens."""
    greedy = {n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, _, n in [*FIRST, LATE]}
    for rid, prompt, n in FIRST:
        engine.add_request(rid, prompt, greedy[n])
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished():
        if step == 2:
            engine.add_request(LATE[0], LATE[1], greedy[LATE[2]])
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    return tokens


def _watch(graphs: DecodeGraphs, pools: list[torch.Tensor]) -> list[GraphStep]:
    """Record, for each graph step, its rows, their state slots and the slots of `pools` whose contents it
    changed."""
    steps: list[GraphStep] = []
    run: Callable[..., torch.Tensor] = graphs.run

    def watched(input_ids, positions, block_tables, fill=None, states=None) -> torch.Tensor:
        before = [p.clone() for p in pools]
        logits = run(input_ids, positions, block_tables, fill, states)
        changed = {s for old, p in zip(before, pools, strict=True) for s in range(p.shape[0])
                   if not torch.equal(old[s], p[s])}  # fmt: skip
        steps.append((len(input_ids), list(states[0]), changed))
        return logits

    graphs.run = watched  # type: ignore[method-assign]
    return steps


def _check_graph_steps(steps: list[GraphStep], graphs: DecodeGraphs, scratch: int) -> None:
    """Every graph step changed the state of its own rows' slots and, with padding rows, the scratch slot, and no
    other slot: not the slot of a finished sequence or of none, nor a prefix snapshot."""
    assert any(rows == 3 for rows, _, _ in steps), "no step of three sequences (padded to four) ran in a graph"
    for rows, slots, changed in steps:
        padded = rows not in graphs.sizes
        assert scratch not in slots and set(slots) <= changed, (rows, slots, changed)
        assert changed - set(slots) <= ({scratch} if padded else set()), (rows, slots, changed)
    assert any(scratch in changed for _, _, changed in steps)


def _triton_engine(path, *, graphs: bool) -> LLMEngine:
    """The engine on the Triton ops (the CPU runner's default is torch), with overlapped scheduling as on CUDA (the
    graph's input ids then come from the device); graphs: with the decode-graph step, run eagerly."""
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.02,
                                    max_num_seqs=SEQS, max_model_len=32, async_scheduling=True))  # fmt: skip
    runner = engine.runner
    runner.ops = TritonOps()
    for p in runner.model.parameters():
        p.data = p.data.contiguous()  # the CPU runner stores matrices column-major (for BLAS); CUDA does not
    if graphs:
        runner.decode_graphs = DecodeGraphs(runner, max_batch=SEQS, capture=False)
    return engine


def test_decode_graph_steps_give_the_eager_tokens_and_pad_into_the_scratch_slot(tiny_dense) -> None:
    """Four requests of different lengths, one finishing early and one joining late, give the same greedy tokens
    through the decode-graph step (three sequences padded to a ladder size of four) as through the eager steps, and
    HF's tokens for each run alone; padding touches the scratch slot only, and the eager path never does."""
    path, want = tiny_dense
    eager = _triton_engine(path, graphs=False)
    graphed = _triton_engine(path, graphs=True)
    states = graphed.runner.states
    assert states is not None and graphed.runner.decode_graphs is not None
    scratch = states.scratch_slot
    assert scratch == 2 * SEQS  # after the live slots and the prefix snapshots, allocated with them
    pools = [p for layer in states.pools.values() for p in layer]
    assert all(p.shape[0] == scratch + 1 for p in pools)
    steps = _watch(graphed.runner.decode_graphs, pools)
    assert _serve(eager) == _serve(graphed) == want
    _check_graph_steps(steps, graphed.runner.decode_graphs, scratch)
    assert states.num_snapshots_kept > 0  # the snapshot slots were in use, and untouched by graph steps
    eager_states = eager.runner.states
    assert eager_states is not None
    assert all(not p[scratch].any() for layer in eager_states.pools.values() for p in layer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_decode_graphs_give_the_eager_tokens_on_cuda(tmp_path) -> None:
    """On a GPU, the engine with CUDA graphs (captured, replayed for every pure decode step) gives the tokens of
    the engine without them, and HF's, for the tiny model with its MoE layers; padding rows change the scratch slot
    only."""
    path, want = _checkpoint(tmp_path / "tiny")
    got = {}
    for use_graphs in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", block_size=4,
                                        num_kv_blocks=256, max_num_seqs=SEQS, use_cuda_graphs=use_graphs))  # fmt: skip
        graphs, states = engine.runner.decode_graphs, engine.runner.states
        assert states is not None and (graphs is not None) == use_graphs
        steps = _watch(graphs, [p for layer in states.pools.values() for p in layer]) if graphs is not None else []
        got[use_graphs] = _serve(engine)
        if graphs is not None:
            assert graphs.capture
            _check_graph_steps(steps, graphs, states.scratch_slot)
    assert got[True] == got[False] == want
