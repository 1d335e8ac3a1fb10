"""Qwen3-Next end to end on a tiny random config: Envex's model file (Gated DeltaNet layers over per-sequence state
slots, gated full attention with partial rotary, the MoE with its gated shared expert, a dense layer) gives HF
transformers' logits and greedy tokens from the published checkpoint layout, through the real engine: sequences of
different lengths batched together, a prompt cut into prefill chunks and a run with preemptions all give the tokens
of uninterrupted single runs; what the engine refuses for this model (deterministic mode, fp8 KV, a stale state;
speculation: tests/test_runtime_qwen3_next_spec.py) and the config it reads."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.runtime.config import QWEN3_NEXT, ConfigError, ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.models.qwen3_next import Qwen3NextForCausalLM
from envex.tests.test_runtime_gpt_oss import VOCAB, _write_tokenizer

# Layers: linear (MoE), full (MoE), linear (dense: mlp_only_layers), full (MoE). GQA 2 in the full layers, two
# v heads per k head in the linear ones, partial rotary over 8 of 32 dims.
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            full_attention_interval=2, mlp_only_layers=[2], tie_word_embeddings=False)  # fmt: skip
PROMPTS = [[5, 17, 300, 9, 44, 12, 7, 8, 9, 100, 3, 3, 99], [1, 2], list(range(100, 121))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# The published Qwen3-Next-80B-A3B-Instruct config.json, the fields ModelConfig.from_hf reads.
PUBLISHED = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "vocab_size": 151936,
}  # fmt: skip


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.02, **kw))


def save_tiny_checkpoint(path, **overrides) -> transformers.Qwen3NextForCausalLM:
    """HF's model on TINY and these overrides (random, decisive logits), saved with a tokenizer into `path`."""
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # decisive logits; every norm weight and gate away from its default, so a dropped one shows
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            elif name.endswith(("A_log", "dt_bias")):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.3, 0.3)  # Qwen3NextRMSNorm multiplies by 1 + weight
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF model, its save_pretrained dir, HF's greedy continuation of each prompt run alone)."""
    path = tmp_path_factory.mktemp("qwen3_next") / "tiny"
    model = save_tiny_checkpoint(path)
    return model, path, [_hf_greedy(model, prompt) for prompt in PROMPTS]


def test_prefill_logits_match_transformers(checkpoint) -> None:
    hf_model, path, _ = checkpoint
    names = load_file(str(path / "model.safetensors")).keys()
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.1.mlp.experts.7.up_proj.weight",
            "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.2.mlp.up_proj.weight"} <= set(names)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = Qwen3NextForCausalLM(config, dtype=torch.float32, device=torch.device("cpu"))
    model.load_weights(load_file(str(path / "model.safetensors")).items())
    prompt, page = PROMPTS[2], 4
    n, blocks = len(prompt), -(-len(prompt) // page)
    table = list(range(blocks))[::-1]
    caches = model.make_kv_caches(blocks, page, torch.float32, torch.device("cpu"))
    for layer, pools in model.make_state_pools(3, torch.float32, torch.device("cpu")).items():
        caches[layer] = tuple(p.normal_() for p in pools)  # garbage in the slot: state_initialized 0 must ignore it
    cos = torch.zeros(64, config.head_dim // 2)
    meta = AttentionMetadata(
        positions=torch.arange(n), slot_mapping=torch.tensor([table[p // page] * page + p % page for p in range(n)]),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), block_tables=torch.tensor([table], dtype=torch.int32),
        cos=cos, sin=cos, max_q_len=n, max_seq_len=n, seq_lens=torch.tensor([n], dtype=torch.int32),
        state_slots=torch.tensor([1], dtype=torch.int32), state_initialized=torch.tensor([0], dtype=torch.int32),
    )  # fmt: skip
    with torch.inference_mode():
        got = model.compute_logits(TorchOps(), *model(TorchOps(), torch.tensor(prompt), caches, meta))
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0]
    assert rel_err(got, want) < 1e-5
    assert torch.allclose(torch.log_softmax(got, -1), torch.log_softmax(want, -1), atol=1e-4)


def test_greedy_batched_matches_transformers_run_alone(checkpoint) -> None:
    """Three prompts of 13, 2 and 21 tokens in one engine (batched in every step) give HF's tokens for each run
    alone; the paged KV holds only the full layers, the linear layers' state sits in one slot per sequence."""
    _, path, want = checkpoint
    engine = _engine(path)
    runner = engine.runner
    assert isinstance(runner.model, Qwen3NextForCausalLM) and runner.states is not None
    assert [len(c) for c in runner.kv_caches] == [2, 2, 2, 2]
    assert tuple(runner.kv_caches[0][0].shape[1:]) == (4, 16, 16) and runner.kv_caches[1][0].shape[2:] == (2, 32)
    # The 21-token prompt asks for prompt logprobs, which bypass the prefix cache: it takes no snapshot while the
    # 13-token one takes its own (after 12 tokens) in the same prefill step.
    params = [GREEDY, GREEDY, dataclasses.replace(GREEDY, prompt_logprobs=0)]
    got = engine.generate(PROMPTS, params)
    assert [c.token_ids for c in got] == want
    assert runner.states.num_used_slots == 3 and runner.states.num_snapshots_kept == 1
    runner.states.before_step([])  # the next step releases the slots of the sequences whose blocks were freed
    assert runner.states.num_used_slots == 0


def test_prefix_hits_restore_the_state_snapshot(checkpoint) -> None:
    """A prompt's state is kept after its last full block (20 of 21 tokens), taken inside a prefill chunk (a 5-token
    budget: the chunk 15..20); the same prompt again, and a later turn that extends it with the answer and three
    more tokens, reuse those 20 tokens (paged K/V and the state snapshot). Prompts sharing a 12-token system prompt:
    the second finds its blocks but no state there, and keeps one; the third hits it. Every run gives HF's tokens
    of an uninterrupted run."""
    hf_model, path, want = checkpoint
    engine = _engine(path, max_num_batched_tokens=5)
    prompt = PROMPTS[2]
    turn = prompt + want[2] + [7, 8, 9]
    system = PROMPTS[0][:12]
    runs = [(prompt, 0), (prompt, 20), (turn, 20)] + [(system + [u, u + 1, u + 2, 5, 6], hit)
                                                      for u, hit in ((40, 0), (50, 0), (60, 12))]  # fmt: skip
    for tokens, hit in runs:
        before = engine.steps.counters.cached_tokens
        expected = want[2] if tokens == prompt else _hf_greedy(hf_model, tokens)
        assert engine.generate([tokens], GREEDY)[0].token_ids == expected
        assert engine.steps.counters.cached_tokens - before == hit
    states = engine.runner.states
    # after the prompt's 20 tokens; the turn's 24 (the end of its cached blocks, 4 past the hit) and 28; each
    # system-prompt request's 16, and the system prompt's 12
    assert states is not None and states.num_snapshots_kept == 7


def test_chunked_prefill_and_preemption_give_the_uninterrupted_tokens(checkpoint) -> None:
    """A 5-token step budget cuts the prompts into prefill chunks that carry the state across steps (and mixes
    them with other sequences' decodes); then a KV pool too small for all three preempts and recomputes."""
    _, path, want = checkpoint
    chunked = _engine(path, max_num_batched_tokens=5)
    assert [c.token_ids for c in chunked.generate(PROMPTS, GREEDY)] == want
    # 11 blocks: the three prompts fit (4 + 1 + 6 blocks), their growth to 19, 8 and 27 tokens does not
    tight = _engine(path, num_kv_blocks=11, max_model_len=44)
    assert [c.token_ids for c in tight.generate(PROMPTS, GREEDY)] == want
    assert tight.scheduler.num_preemptions > 0


def test_linear_attention_on_triton_ops_equals_the_reference(checkpoint) -> None:
    """Ops.linear_attention of a loaded Gated DeltaNet layer on the Triton ops under the interpreter (delta_rule's
    varlen conv, chunked prefill, decode kernels and gated norm) equals it on the torch ops, step after step over
    the same slots: a prefill of two sequences (slots 2 and 0, holding garbage) taking a snapshot each, a chunk
    continuing both, a decode step of both; outputs and the states and snapshots left in the pools."""
    from envex.kernels.triton_ops import TritonOps

    _, path, _ = checkpoint
    dev = torch.device("cpu")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = Qwen3NextForCausalLM(config, dtype=torch.float32, device=dev)
    model.load_weights(load_file(str(path / "model.safetensors")).items())
    layer = model.layers[0]
    steps = (([5, 9], [0, 0]), ([3, 4], [5, 9]), ([1, 1], [8, 13]))  # (tokens, starts) of the two sequences
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(sum(n), layer.in_proj_weight.shape[0], generator=gen) for n, _ in steps]
    garbage = [p.normal_(generator=gen) for p in model.make_state_pools(4, torch.float32, dev)[0]]

    def run(ops) -> list[torch.Tensor]:
        pools = [p.clone() for p in garbage]
        out = []
        for (lens, starts), mixed in zip(steps, inputs, strict=True):
            ends = [s + n for s, n in zip(starts, lens, strict=True)]
            cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
            meta = AttentionMetadata(
                positions=torch.zeros(0), slot_mapping=torch.zeros(0), cu_seqlens_q=cu, block_tables=torch.zeros(0),
                cos=torch.zeros(0), sin=torch.zeros(0), max_q_len=max(lens), max_seq_len=0,
                seq_lens=torch.tensor(ends, dtype=torch.int32), q_lens_host=lens, seq_lens_host=ends,
                state_slots=torch.tensor([2, 0], dtype=torch.int32),
                state_initialized=torch.tensor([int(s > 0) for s in starts], dtype=torch.int32),
            )  # fmt: skip
            if starts == [0, 0]:  # snapshots: sequence 0 after 4 tokens into slot 1, sequence 1 after 8 into slot 3
                meta = dataclasses.replace(meta, state_snapshots=torch.tensor([[1, -1], [-1, 3]], dtype=torch.int32),
                                           state_snapshot_every=4)  # fmt: skip
            out.append(ops.linear_attention(mixed, pools[0], pools[1], meta, layer.mixer))
        return out + [pools[0], pools[1]]

    names = ("prefill", "chunk", "decode", "recurrent states and snapshots", "conv states and snapshots")
    for name, want, got in zip(names, run(TorchOps()), run(TritonOps()), strict=True):
        assert rel_err(got, want) < 1e-4, f"{name}: {rel_err(got, want):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_triton_backend_on_cuda_gives_the_same_tokens(checkpoint) -> None:
    """On a GPU, the default engine (triton backend, warm-up, overlapped scheduling) in float32 gives HF's tokens:
    batched, with prefill chunks, and with a prefix hit restored from a snapshot."""
    _, path, want = checkpoint
    for budget in (None, 5):
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", block_size=4,
                                        num_kv_blocks=512, max_num_batched_tokens=budget))  # fmt: skip
        assert engine.config.backend == "triton" and engine.runner.decode_graphs is not None  # state slots in graphs
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == want
        assert engine.generate([PROMPTS[2]], GREEDY)[0].token_ids == want[2]
        assert engine.steps.counters.cached_tokens == 20


def test_refusals(checkpoint) -> None:
    _, path, _ = checkpoint
    with pytest.raises(ValueError, match=r"^deterministic: Qwen3NextForCausalLM has no batch-invariant kernels yet "
                                         r"\(.*gated delta-rule linear attention\)"):
        _engine(path, deterministic=True)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: fp8 is not available for Qwen3NextForCausalLM"):
        _engine(path, kv_cache_dtype="fp8")


def test_a_stale_state_is_refused(checkpoint) -> None:
    """A running sequence whose chunk does not start where its state ends (a prefix hit or a lost step) raises."""
    _, path, _ = checkpoint
    states = _engine(path).runner.states
    assert states is not None
    seq = Sequence("r", list(range(12)), GREEDY, None, status=Status.RUNNING, block_table=[0, 1, 2])
    states.before_step([ScheduledChunk(seq, 0, 8)])
    states.before_step([ScheduledChunk(seq, 8, 4)])  # continues: fine
    with pytest.raises(RuntimeError, match="resumes at token 4 but its state holds 12; refusing to serve a stale"):
        states.before_step([ScheduledChunk(seq, 4, 4)])


def test_published_config() -> None:
    c = ModelConfig.from_hf(PUBLISHED)
    assert c.architecture == QWEN3_NEXT and c.hybrid is not None and c.moe is not None
    assert c.hybrid.linear_layers == tuple(i for i in range(48) if (i + 1) % 4)
    assert (c.hybrid.rotary_dim, c.hybrid.conv_dim, c.hybrid.shared_expert_size) == (64, 8192, 512)
    assert (c.moe.num_experts, c.moe.top_k, c.moe.norm_topk_prob, c.moe.dense_layers) == (512, 10, True, ())
    model = Qwen3NextForCausalLM(c, dtype=torch.bfloat16, device=torch.device("meta"))
    # 36 linear layers: 32 x 128 x 128 float32 state + 3 x 8192 bf16 conv rows each (offline_docs/hybrid.md)
    assert model.state_bytes_per_slot(torch.bfloat16) == 36 * (2 * 2**20 + 48 * 2**10)
    assert model.kv_cache_bytes_per_block(16, torch.bfloat16) == 12 * 2 * 16 * 2 * 256 * 2
    with pytest.raises(ConfigError, match="layer_types must list 48"):
        ModelConfig.from_hf({**PUBLISHED, "layer_types": ["full_attention"]})
    # FP8 releases are read (tests/test_runtime_qwen3_next_fp8.py); INT4 experts are not
    with pytest.raises(ConfigError, match="INT4 experts are not supported for Qwen3-Next"):
        ModelConfig.from_hf({**PUBLISHED, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}})


def test_the_model_card_written_for_the_checkpoint_has_its_hybrid_section(checkpoint) -> None:
    """envex media build / bundle build write the card from the model folder: its hybrid section is the runtime's
    (only the full-attention layers count for K/V; the plan reserves the linear layers' state)."""
    from envex.installer.cards import HybridCard
    from envex.installer.model_card import card_for_model

    _, path, _ = checkpoint
    card = card_for_model(path, "tiny-qwen3-next")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert card.hybrid is not None and card.hybrid == HybridCard.of(config)
    assert card.hybrid.full_attention_layers + card.hybrid.linear_attention_layers == card.num_layers
