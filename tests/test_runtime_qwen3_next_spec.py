"""Speculative decoding on Qwen3-Next's recurrent state (runtime/engine/caches/state_slots.py): a verify step runs
the newest token and K drafts through the Gated DeltaNet layers from each sequence's live slot, snapshots the state
after every token into its verify slots, and the snapshot after the last accepted token becomes the live state.
With drafts that are partly right and partly wrong (an oracle drafter that knows the plain answer and spoils some
drafts), greedy output is token for token the plain engine's, and after every step each live slot holds exactly
the state a fresh prefill of the sequence's computed tokens gives: no rejected token stays in it."""

from __future__ import annotations

import pytest
import torch

from envex.installer.plan import state_slots
from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.triton_ops import TritonOps
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.caches.state_slots import verify_slots
from envex.runtime.engine.spec import decoder
from envex.runtime.engine.spec.depth import DepthController
from envex.runtime.engine.spec.drafters import NgramIndex, SpecInputs
from envex.tests.test_runtime_qwen3_next import PROMPTS, _engine, save_tiny_checkpoint

TOKENS = 20
PARAMS = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


class OracleDrafter:
    """Drafts the plain engine's answer (`answers`: each prompt's full plain sequence; the prompts differ in their
    first token), except that a draft for a position p with p % spoil == spoil - 1 is off by one: most steps have
    drafts accepted and one rejected. Device ops only, static shapes: graph-safe, so a CUDA graph captures it."""

    name = "oracle"
    in_verify_graph = True
    wants_hidden = False

    def __init__(self, answers: list[list[int]], spoil: int, device: torch.device) -> None:
        width = max(map(len, answers))
        self.answers = torch.tensor([a + [0] * (width - len(a)) for a in answers], device=device)  # [N, L]
        self.spoil = spoil

    def catch_up(self, seqs) -> None:
        return None

    def propose(self, x: SpecInputs) -> None:
        which = (x.hist[x.rows, :1] == self.answers[None, :, 0]).int().argmax(dim=1)  # [B] the row's prompt
        pos = (x.seq_lens[:, None] + torch.arange(x.k, device=x.rows.device)[None, :]).clamp(
            max=self.answers.shape[1] - 1)  # [B, K]
        drafts = self.answers[which[:, None], pos]
        x.drafts.copy_(drafts + (pos % self.spoil == self.spoil - 1).to(drafts.dtype))
        x.num_drafts.copy_(x.k_limit.clamp(min=0, max=x.k))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_spec") / "tiny"
    save_tiny_checkpoint(path)
    want = [c.token_ids for c in _engine(path).generate(PROMPTS, PARAMS)]
    return path, want


def _with_oracle(engine, answers: list[list[int]], spoil: int) -> None:
    spec = engine.spec
    spec.drafter = spec.graphs.drafter = OracleDrafter(answers, spoil, engine.device)
    spec.controller = DepthController(spec.ks, spec.costs, max_batch=spec.max_batch, shadow=False)


@pytest.mark.parametrize(("k", "spoil", "overlap"), [(1, 3, False), (3, 3, True), (3, 5, False)])
def test_greedy_output_with_drafts_on_the_recurrent_state_is_the_plain_output(tiny, k: int, spoil: int,
                                                                             overlap: bool) -> None:  # fmt: skip
    path, want = tiny
    engine = _engine(path, num_speculative_tokens=k, async_scheduling=overlap)
    _with_oracle(engine, [p + w for p, w in zip(PROMPTS, want, strict=True)], spoil)
    assert [c.token_ids for c in engine.generate(PROMPTS, PARAMS)] == want
    stats = engine.stats()
    assert stats.spec_verify_steps_total > 3
    assert 0 < stats.accepted_draft_tokens_total < stats.spec_draft_tokens_total


def test_verify_steps_on_the_triton_kernels_padded_as_the_graphs_are(tiny) -> None:
    """The same on the Triton ops (the chunked kernels with a snapshot after every token, the CPU under the
    interpreter), verify batches padded to the ladder as the CUDA graphs pad them (padding rows: the scratch slot)."""
    path, want = tiny
    engine = _engine(path, num_speculative_tokens=3, max_num_seqs=4, speculative_max_batch=4)
    engine.runner.ops = TritonOps()
    for p in engine.runner.model.parameters():
        p.data = p.data.contiguous()  # the CPU runner stores matrices column-major (for BLAS); CUDA does not
    engine.spec.graphs.pad = True
    _with_oracle(engine, [p + w for p, w in zip(PROMPTS, want, strict=True)], 3)
    assert [c.token_ids for c in engine.generate(PROMPTS, PARAMS)] == want
    assert 0 < engine.stats().accepted_draft_tokens_total < engine.stats().spec_draft_tokens_total


def test_each_live_state_is_the_state_of_its_computed_tokens(tiny) -> None:
    """After every step (verify steps with rejected drafts among them): each running sequence's live slot, in
    every linear layer, equals a fresh prefill over its computed tokens (seq.num_computed_tokens: the newest token
    is fed by the next step)."""
    path, want = tiny
    engine = _engine(path, num_speculative_tokens=3)
    _with_oracle(engine, [p + w for p, w in zip(PROMPTS, want, strict=True)], 3)
    states, model, ops = engine.runner.states, engine.runner.model, engine.runner.ops
    assert states is not None and states.verify_base == states.scratch_slot + 1
    assert next(iter(states.pools.values()))[0].shape[0] == states.verify_base + engine.spec.max_batch * (3 + 1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, PARAMS)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.num_computed_tokens
            fresh = _fresh_states(model, ops, seq.all_token_ids[:n])
            live = states.slot(seq)
            for layer, pools in states.pools.items():
                for got, ref in zip(pools, fresh[layer], strict=True):
                    assert rel_err(got[live], ref[0]) < 1e-4, (seq.request_id, n, layer)
            checked += 1
    assert checked > 10 and engine.stats().spec_verify_steps_total > 3
    assert engine.stats().accepted_draft_tokens_total < engine.stats().spec_draft_tokens_total  # rejections ran


def _fresh_states(model, ops, tokens: list[int]) -> dict[int, tuple[torch.Tensor, ...]]:
    """Every linear layer's (state, conv) after a prefill of `tokens` from zeros, in a pool of one slot."""
    n, page = len(tokens), 4
    blocks = -(-n // page)
    caches = model.make_kv_caches(blocks, page, torch.float32, torch.device("cpu"))
    pools = model.make_state_pools(1, torch.float32, torch.device("cpu"))
    for layer, pool in pools.items():
        caches[layer] = pool
    cos = torch.zeros(n, model.config.head_dim // 2)  # the model swaps in its own tables
    meta = AttentionMetadata(
        positions=torch.arange(n), slot_mapping=torch.arange(n), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], cos=cos, sin=cos, max_q_len=n, max_seq_len=n,
        seq_lens=torch.tensor([n], dtype=torch.int32), state_slots=torch.tensor([0], dtype=torch.int32),
        state_initialized=torch.tensor([0], dtype=torch.int32), q_lens_host=[n], seq_lens_host=[n],
    )  # fmt: skip
    with torch.inference_mode():
        model(ops, torch.tensor(tokens), caches, meta)
    return pools


def test_a_hybrid_draft_model_is_refused_in_one_line(tiny) -> None:
    """A draft model with recurrent layers: its own draft passes would keep rejected drafts in its state."""
    path, _ = tiny
    with pytest.raises(ValueError, match=r"^draft_model: .* has recurrent \(linear-attention\) layers, which a draft "
                                         r"model's passes cannot roll back; use n-gram lookup") as err:
        _engine(path, num_speculative_tokens=2, draft_model=str(path))
    assert "\n" not in str(err.value)


def test_verify_slots_are_sized_from_the_speculation_settings(tiny) -> None:
    path, _ = tiny
    engine = _engine(path, num_speculative_tokens=3, max_num_seqs=6, speculative_max_batch=4)
    states = engine.runner.states
    assert states is not None and states.verify_base == 6 + 6 + 1  # after live, snapshot and scratch slots
    assert next(iter(states.pools.values()))[0].shape[0] == 6 + 6 + 1 + 4 * (3 + 1) == states.total_slots
    # what /metrics reports a sequence holds is one slot of every pool, as allocated
    slot_bytes = sum(t[0].numel() * t.element_size() for pools in states.pools.values() for t in pools)
    assert states.bytes_per_slot == slot_bytes > 0
    plain = _engine(path).runner.states
    assert plain is not None and next(iter(plain.pools.values()))[0].shape[0] == plain.verify_base
    assert state_slots({"max_num_seqs": 6, "num_speculative_tokens": 3, "speculative_max_batch": 4}) == 13 + 16
    assert state_slots({"max_num_seqs": 6, "num_speculative_tokens": 3}) == 13 + 6 * 4  # at most every sequence
    assert verify_slots(0, 4, 6) == 0 and verify_slots(3, None, 6) == verify_slots(3, 8, 6) == 6 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_verify_graphs_on_the_recurrent_state_give_the_plain_output(tiny, monkeypatch) -> None:
    """On a GPU with CUDA graphs (decode graphs, verify graphs with the drafter captured in them, warm-up's cost
    table): greedy output with the oracle's partly wrong drafts is the plain engine's on the same device."""
    path, _ = tiny

    def engine(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", block_size=4, num_kv_blocks=256,
                                      max_model_len=64, max_num_seqs=4, use_cuda_graphs=True, **kw))  # fmt: skip

    want = [c.token_ids for c in engine().generate(PROMPTS, PARAMS)]
    answers = [p + w for p, w in zip(PROMPTS, want, strict=True)]

    class Oracle(OracleDrafter):  # built where the n-gram drafter would be, so the verify graphs capture it
        def __init__(self) -> None:
            super().__init__(answers, 3, torch.device("cuda"))

        def shadow_index(self) -> NgramIndex:  # asked of whatever stands where the n-gram drafter is
            return NgramIndex()

    monkeypatch.setattr(decoder, "NgramDrafter", Oracle)
    for warm_up in (False, True):
        spec = engine(num_speculative_tokens=3, warm_up=warm_up)
        assert spec.spec.graphs.capture and isinstance(spec.spec.drafter, Oracle)
        spec.spec.controller = DepthController(spec.spec.ks, spec.spec.costs, max_batch=spec.spec.max_batch,
                                               shadow=False)  # fmt: skip
        assert [c.token_ids for c in spec.generate(PROMPTS, PARAMS)] == want, warm_up
        if not warm_up:
            stats = spec.stats()
            assert 0 < stats.accepted_draft_tokens_total < stats.spec_draft_tokens_total
