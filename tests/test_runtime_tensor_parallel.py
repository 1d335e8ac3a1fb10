"""Tensor parallelism on the CPU: the Megatron shards of a tiny random Llama (float32), and the engine over two
processes (gloo) against one: the same greedy tokens, logits within float32 rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from envex.runtime.config import ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.models.llama import LlamaForCausalLM
from envex.runtime.parallel import ParallelState, check_tensor_parallel
from envex.verify.gate_tensor_parallel import check_tensor_parallel_equality, write_random_checkpoint

# vocab 101: two ranks get 51 rows each, the last one padded; kv heads 2 (split) or 1 (replicated on both ranks)
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=101, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=0,
            torch_dtype="float32")  # fmt: skip


def _model_dir(root: Path, seed: int = 3, **overrides: object) -> Path:
    shape = {**TINY, **overrides}
    name = f"tiny-{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return write_random_checkpoint(root / name, shape, seed=seed)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("tp"))


def _load(config: ModelConfig, weights: dict[str, torch.Tensor], parallel: ParallelState | None) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, dtype=torch.float32, device=torch.device("cpu"), parallel=parallel)
    model.load_weights(weights.items())
    return model


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_shards_are_the_megatron_slices(kv_heads: int, tmp_path: Path) -> None:
    config = ModelConfig.from_hf({**TINY, "num_key_value_heads": kv_heads})
    weights = _weights(_model_dir(tmp_path, seed=5, num_key_value_heads=kv_heads))
    full = _load(config, weights, None)
    shards = [_load(config, weights, ParallelState(rank=r, world_size=2)) for r in range(2)]
    d, x = config.head_dim, torch.randn(3, config.hidden_size)
    layer, parts = full.layers[0], [s.layers[0] for s in shards]
    # column-parallel: each rank's Q heads and gate/up rows; together every head and row exactly once
    q = [p.qkv_proj_weight[: 2 * d] for p in parts]
    assert torch.equal(torch.cat(q), layer.qkv_proj_weight[: 4 * d])
    k = [p.qkv_proj_weight[2 * d : 2 * d + d] for p in parts]
    full_k = layer.qkv_proj_weight[4 * d : 4 * d + kv_heads * d]
    assert torch.equal(k[0], full_k[:d]) and torch.equal(k[1], full_k[-d:]), "KV head split, or replicated"
    assert parts[0].attn.num_heads == 2 and parts[0].attn.num_kv_heads == 1
    inter = config.intermediate_size // 2
    assert torch.equal(torch.cat([p.gate_up_proj_weight[:inter] for p in parts]), layer.gate_up_proj_weight[:96])
    # row-parallel: the partial products of O and down sum to the full projection
    attn_in, mlp_in = torch.randn(3, 4 * d), torch.randn(3, 96)
    o = sum(attn_in[:, r * 2 * d : (r + 1) * 2 * d] @ parts[r].o_proj_weight.T for r in range(2))
    down = sum(mlp_in[:, r * inter : (r + 1) * inter] @ parts[r].down_proj_weight.T for r in range(2))
    torch.testing.assert_close(o, attn_in @ layer.o_proj_weight.T)
    torch.testing.assert_close(down, mlp_in @ layer.down_proj_weight.T)
    # vocabulary: 51 + 50 rows (+ 1 zero padding row); the embedding's partials sum to the full lookup
    assert [s.embed_tokens_weight.shape[0] for s in shards] == [51, 51]
    assert torch.equal(shards[1].lm_head_weight[-1], torch.zeros(config.hidden_size))
    logits = torch.cat([x @ s.lm_head_weight.T for s in shards], dim=1)[:, :101]
    torch.testing.assert_close(logits, x @ full.lm_head_weight.T)
    ids = torch.tensor([0, 50, 51, 100])
    full_emb = full.embed_tokens_weight[ids]

    class Partial:  # what _embed needs of a communicator: only that there is one
        world_size = 2

    emb = []
    for s in shards:
        s.comm = Partial()  # type: ignore[assignment]
        emb.append(s._embed(ids))
    assert torch.equal(emb[0] + emb[1], full_emb)
    assert (emb[0][2:] == 0).all() and (emb[1][:2] == 0).all()


def test_tensor_parallel_bad_input_is_one_line() -> None:
    config = ModelConfig.from_hf(TINY)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="one must divide the other"):
        check_tensor_parallel(ModelConfig.from_hf({**TINY, "num_attention_heads": 6, "num_key_value_heads": 3,
                                                   "head_dim": 16}), 2)  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor_parallel: must be in 1\.\.8"):
        EngineConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match="speculative decoding does not run under tensor parallelism"):
        EngineConfig(tensor_parallel=2, num_speculative_tokens=4)
    with pytest.raises(ValueError, match="4 GPUs asked for but 2 visible"):
        EngineConfig(tensor_parallel=4).resolved(window=256, cuda_available=True, gpus=2)


def test_engine_tp2_gives_tp1_greedy_tokens(tiny: Path) -> None:
    """Two processes over gloo against one: prompts of several lengths in one batch, chunked prefill (16-token
    budget), decode; the same greedy tokens, and logprobs within float32 rounding of the sharded sums."""
    prompts = [[5, 17, 33, 2, 90, 41, 7], list(range(1, 40)), [99, 98, 3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    settings = dict(model=str(tiny), device="cpu", max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128)
    single = LLMEngine(EngineConfig(**settings))
    want = single.generate(prompts, params)
    engine = LLMEngine(EngineConfig(**settings, tensor_parallel=2))
    # prompt logprobs: rows of the plan that rank 0 sends (EagerPlan.prompt_rows) and logits gathered for them
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    want_scored = single.generate(prompts[1:2], scored)
    try:
        got = engine.generate(prompts, params)
        again = engine.generate(prompts[:1], params)  # the workers keep following after a batch ends
        got_scored = engine.generate(prompts[1:2], scored)
        gate = check_tensor_parallel_equality(engine, single, prompts=["t5 t17 t33 t2", "t90 t41 t7"], max_tokens=6)
    finally:
        engine.close()
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert again[0].token_ids == want[0].token_ids
    assert got_scored[0].token_ids == want_scored[0].token_ids
    assert gate.verdict == "pass" and gate.name == "tensor_parallel_equality", gate.summary
    # The serving path too: each prompt alone without logprobs (overlapped steps), held to one GPU's answers.
    serving = gate.evidence["serving_path"]
    assert len(serving) == 2 and all(c["ok"] and c["tokens"] == 6 for c in serving), serving
    assert all(p.poll() == 0 for p in engine.workers.procs), "the worker must exit cleanly on close"


class _Recorder:
    """Rank 0's side of the step channel and of the input-id broadcast, recorded for a worker to replay."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []
        self.ids: list[torch.Tensor] = []

    def send_graph(self, data: list[int]) -> None:
        self.sent.append(data)

    def broadcast(self, x: torch.Tensor) -> None:
        self.ids.append(x.clone())


class _Replayer:
    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def broadcast(self, x: torch.Tensor) -> None:
        x.copy_(self.recorder.ids.pop(0))


def test_decode_graph_steps_replay_from_rank_0s_message(tmp_path: Path) -> None:
    """DecodeGraphs under tensor parallelism: rank 0 sends each step's batch, positions and block tables and
    broadcasts its ids; a worker that replays from them fills the same graph inputs and computes the same logits.
    (Graphs run eagerly here; the collectives are stand-ins.)"""
    from types import SimpleNamespace

    from envex.kernels.torch_ops import TorchOps
    from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
    from envex.runtime.models.rope import rope_cos_sin

    config = ModelConfig.from_hf(TINY)
    model = _load(config, _weights(_model_dir(tmp_path, seed=7)), None)
    recorder = _Recorder()

    def runner(parallel: object) -> SimpleNamespace:
        cos, sin = rope_cos_sin(config, 64, torch.device("cpu"))
        caches = [(torch.zeros(16, 8, 2, config.head_dim), torch.zeros(16, 8, 2, config.head_dim)) for _ in range(2)]
        r = SimpleNamespace(
            model=model,
            ops=TorchOps(),
            kv_caches=caches,
            cos=cos,
            sin=sin,
            device=torch.device("cpu"),
            block_size=8,
            max_model_len=64,
            model_config=config,
            num_kv_heads=2,
            parallel=parallel,
        )
        r.forward_logits = lambda ids, meta: model.compute_logits(r.ops, *model(r.ops, ids, r.kv_caches, meta))
        return r

    driver = DecodeGraphs(
        runner(SimpleNamespace(is_driver=True, channel=recorder, comm=recorder)), max_batch=4, capture=False
    )
    worker = DecodeGraphs(
        runner(SimpleNamespace(is_driver=False, channel=None, comm=_Replayer(recorder))), max_batch=4, capture=False
    )
    for ids, positions, tables in (([7, 9, 11], [3, 12, 0], [[1], [2, 3], [4]]), ([5], [20], [[6, 7, 8]])):
        want = driver.run(ids, positions, tables).clone()
        (data,) = recorder.sent
        recorder.sent.clear()
        got = worker.follow(data)
        b = next(s for s in driver.sizes if s >= len(ids))
        for name in ("input_ids", "positions", "active", "block_tables"):
            assert torch.equal(getattr(worker._inputs[b], name), getattr(driver._inputs[b], name)), name
        torch.testing.assert_close(got, want)


def test_the_serving_path_pass_holds_each_answer_to_one_gpus_top_k() -> None:
    """serving_path_cases: a token outside one GPU's top-k at the first difference fails; inside it passes; an
    answer cut short differs where it ends."""
    from types import SimpleNamespace

    from envex.verify.gate_tensor_parallel import serving_path_cases
    from envex.verify.reference import RefGeneration

    class Engine:
        tokenizer = SimpleNamespace(apply_chat_template=lambda messages, add_generation_prompt: messages[0]["content"],
                                    encode=lambda text, add_special_tokens: [len(text)])  # fmt: skip

        def __init__(self, answer: list[int]) -> None:
            self.answer = answer

        def generate(self, prompts, params):  # type: ignore[no-untyped-def]
            assert params.logprobs is None and params.temperature == 0.0  # the chat path: no logprobs
            return [SimpleNamespace(token_ids=self.answer)]

    class Reference:
        def greedy(self, ids, max_tokens, *, top_k=5):  # type: ignore[no-untyped-def]
            return RefGeneration([7, 8, 9], [{7: -0.1}, {8: -0.1}, {9: -0.2, 3: -0.3}])

    same, inside, outside, short = ([7, 8, 9], [7, 8, 3], [7, 8, 4], [7, 8])
    cases = [serving_path_cases(Engine(a), Reference(), prompts=["p"], max_tokens=3)[0]
             for a in (same, inside, outside, short)]  # fmt: skip
    assert [c["ok"] for c in cases] == [True, True, False, False]
    assert cases[0]["identical"] and cases[2]["divergence_index"] == 2 and cases[3]["divergence_index"] == 2


def test_workers_started_in_a_checkout_root_do_not_import_its_folders(tmp_path: Path) -> None:
    """The tensor-parallel workers run `python -m envex.runtime.parallel.workers` in the server's working directory;
    their environment keeps it off sys.path, so a source checkout's kernels/ cannot shadow the PyPI package
    `kernels` that transformers >= 5.25 imports (the installer's children have the same rule)."""
    import os
    import subprocess
    import sys

    from envex.runtime.parallel.workers import worker_env

    checkout, mods = tmp_path / "checkout", tmp_path / "mods"
    (checkout / "kernels").mkdir(parents=True)
    (checkout / "kernels" / "__init__.py").write_text("")
    mods.mkdir()
    (mods / "probe.py").write_text("import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)")
    base = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # conftest sets it for the tests' own
    base["PYTHONPATH"] = str(mods)

    def origin(env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-m", "probe"], cwd=checkout, env=env, capture_output=True, text=True,
                              check=True)  # fmt: skip
        return done.stdout.strip()

    shadow = str(checkout / "kernels" / "__init__.py")
    assert origin(base) == shadow  # the hazard, without the workers' environment
    env = worker_env(base, [str(mods), *sys.path])  # the module to run found through sys.path, as envex is
    assert env["PYTHONSAFEPATH"] == "1"
    got = origin(env)
    assert got != shadow and not got.startswith(str(checkout)), got


@pytest.mark.parametrize("world", [2, 4])
def test_deterministic_mode_under_tensor_parallelism(tiny: Path, world: int) -> None:
    """--deterministic with --tensor-parallel: a prompt's tokens and logprobs are bit-identical alone, inside a
    batch (its prefill chunks cut where the 16-token budget runs out) and after its prefix is cached, and they are
    one process's answers (within the rounding of the sharded sums). The all-reduce takes part: two ranks (gloo's
    two-term sum) and four (added in rank order, the one-shot kernel's arithmetic, whatever the message's size)."""
    probes = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 2]]
    others = [[5, 6, 7], list(range(50, 75)), [9] * 11]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    settings = dict(model=str(tiny), device="cpu", max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128,
                    deterministic=True)  # fmt: skip
    one = [(c.token_ids, c.logprobs) for c in LLMEngine(EngineConfig(**settings)).generate(probes, params)]
    engine = LLMEngine(EngineConfig(**settings, tensor_parallel=world))

    def answers(prompts: list[list[int]]) -> list[tuple]:
        return [(c.token_ids, [lp.logprob for lp in c.logprobs or []]) for c in engine.generate(prompts, params)]

    try:
        comm = engine.workers.state.comm if engine.workers is not None else None
        assert comm is not None and comm.ordered
        engine.blocks.enable_prefix_caching = False
        alone = [answers([p])[0] for p in probes]
        batched = answers([others[0], probes[0], others[1], probes[1], others[2]])
        engine.blocks.enable_prefix_caching = True
        engine.generate(probes, SamplingParams(max_tokens=1, temperature=0.0))  # publish the prompts' blocks
        hits = engine.stats().prefix_cache_hit_tokens_total
        cached = answers([others[2], probes[1], others[1], probes[0]])
        assert engine.stats().prefix_cache_hit_tokens_total > hits, "the prefix cache was not hit"
    finally:
        engine.close()
    assert all(len(tokens) == 8 and len(logprobs) == 8 for tokens, logprobs in alone)
    assert [batched[1], batched[3]] == alone, "a probe's tokens or logprobs changed inside a batch"
    assert [cached[3], cached[1]] == alone, "a probe's tokens or logprobs changed after its prefix was cached"
    for (tokens, logprobs), (want_tokens, want) in zip(alone, one, strict=True):  # and the sums are right:
        assert tokens == want_tokens  # one process's answers, within float32 rounding of the sharded sums
        assert logprobs == pytest.approx([lp.logprob for lp in want or []], abs=1e-4)
