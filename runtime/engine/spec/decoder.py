"""Speculative decoding on the device: verify several drafted tokens per sequence in one forward, exactly.

A verify step feeds each sequence's newest token and k drafted tokens (k+1 query rows, causal attention over the
paged cache) and keeps a draft only where the target model would have produced it:
- greedy rows keep draft j while it equals the argmax of the row before it (byte-identical to plain decoding
  wherever the forward's numerics do not depend on the batch shape: the CPU reference does not in practice);
- sampled rows use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): keep draft d with probability
  min(1, p(d) / q(d)); at the first rejection draw from max(p - q, 0) renormalised; after k kept drafts draw one
  more token from p. Drafters without a distribution (n-gram lookup, a greedy draft model) propose one-hot q:
  keep d with probability p(d), else draw from p with d removed. The output then follows p exactly.

The sequences' tokens live on the device (`SpecDecoder.hist`, `lens`): a verify step reads its inputs from there
and appends what it accepted there, so the next verify step can be launched before the host has read how many
tokens this one appended (overlapped scheduling; see below). The host mirrors the counts when it reads a step.

Depth is chosen per request (depth.py). The engine's step loop knows speculation through one hook
(step.StepHook), which SpecDecoder implements: it may take a step of pure decodes over as a verify step
(`launch_verify`), launch the successor of a verify step in flight from the device's state alone (`chain`),
before the host knows how many tokens the first appended (the host only allocates blocks for the most it could
have appended; the chain holds while the batch is steady: the same sequences, nothing waiting to be admitted,
blocks to spare, speculation still paying), and read its own steps (`finish_verify`). A plain decode step in
flight is read before a verify step is launched (`wants`: drafting needs every token on the device).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from envex.kernels.kv_quant_format import kv_bytes_per_token
from envex.runtime.engine.accel.cuda_graphs import graph_ladder
from envex.runtime.engine.config import MTP, EngineConfig, check_mtp
from envex.runtime.engine.device import upload
from envex.runtime.engine.model_runner import DTYPES, ModelRunner
from envex.runtime.engine.sampler import sampling_probs
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.engine.spec.depth import DepthController, SpecState, StepCosts, k_ladder
from envex.runtime.engine.spec.drafters import Drafter, DraftModelDrafter, NgramDrafter
from envex.runtime.engine.spec.graphs import SpecGraphs
from envex.runtime.engine.spec.mtp import MtpDrafter
from envex.runtime.engine.step import LaunchedStep, StepRunner
from envex.runtime.engine.types import RequestOutput, SamplingParams
from envex.runtime.loader import LoadedModel, load_model_info


def eligible(params: SamplingParams) -> bool:
    """Requests a verify step can serve: no logprobs (read per step) and no penalties (they count every
    generated token, so a draft's acceptance would depend on the tokens before it in the same step)."""
    return (params.logprobs is None and params.prompt_logprobs is None and not params.presence_penalty
            and not params.frequency_penalty)  # fmt: skip


# ---- acceptance -------------------------------------------------------------------------------------------------


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [B, K+1, V], drafts [B, K], num_drafts [B] -> tokens [B, K+1] and accepted drafts [B]: the row's
    tokens are tokens[:accepted + 1] (the kept drafts, then the model's own token after them)."""
    target = logits.argmax(dim=-1)  # [B, K+1]: the model's token after each input row
    k = drafts.shape[1]
    ok = (drafts == target[:, :k]) & (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None])
    return target, ok.long().cumprod(dim=1).sum(dim=1)


def rejection_sample(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, uniforms: torch.Tensor,
                     generator: torch.Generator | None, draft_probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """probs [N, K+1, V] (the target's distributions after each input row), drafts [N, K] proposed from q
    (draft_probs [N, K, V]; None: one-hot q, a deterministic proposal), uniforms [N, K] in [0, 1) ->
    tokens [N, K+1] and accepted drafts [N], as accept_greedy. One multinomial draw per row from `generator`."""
    n, k1, _ = probs.shape
    k = k1 - 1
    dev = probs.device
    p_draft = probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # [N, K] p(d_j)
    if draft_probs is None:
        keep = uniforms < p_draft  # min(1, p/q) with q(d) = 1
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
        keep = uniforms * q_draft < p_draft  # u < p/q without dividing by a q of 0
    keep &= torch.arange(k, device=dev)[None, :] < num_drafts[:, None]
    accepted = keep.long().cumprod(dim=1).sum(dim=1)  # [N]
    rows = torch.arange(n, device=dev)
    p_last = probs[rows, accepted]  # [N, V] where the row's own token is drawn
    at = accepted.clamp(max=max(k - 1, 0))
    if draft_probs is None:
        q_last = torch.zeros_like(p_last)
        if k:
            q_last.scatter_(-1, drafts[rows, at][:, None], 1.0)
    else:
        q_last = draft_probs[rows, at]
    residual = (p_last - q_last).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # After a rejection: the residual; after every draft kept (or a residual of no mass, which a rejection
    # cannot produce in exact arithmetic): p itself.
    rejected = (accepted < num_drafts)[:, None] & (mass > 0)
    final = torch.where(rejected, residual / torch.where(mass > 0, mass, 1.0), p_last)
    token = torch.multinomial(final, 1, generator=generator)  # [N, 1]
    padded = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)  # [N, K+1]
    pos = torch.arange(k1, device=dev)[None, :]
    tokens = torch.where(pos < accepted[:, None], padded, token.expand(-1, k1))
    return tokens, accepted


# ---- the device-side decoder, and the step loop's hook ----------------------------------------------------------


class SpecDecoder:
    """The sequences' tokens on the device, the drafter, the (batch, k) verify graphs and the depth controller."""

    def __init__(self, runner: ModelRunner, drafter: Drafter, *, max_k: int, max_batch: int, max_num_seqs: int,
                 capture: bool, costs: StepCosts | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.device = runner.device
        self.drafter = drafter
        self.max_k = max_k
        self.ks = k_ladder(max_k)
        self.max_batch = min(max_batch, max_num_seqs)
        self.max_model_len = runner.max_model_len
        # A row holds every position a verify step may write: a sequence the host has not yet seen finish at
        # max_model_len may have one more step chained (its length max_model_len + 2 at most), plus k + 1 tokens.
        self.width = self.max_model_len + max_k + 2
        self.spare = max_num_seqs  # padding rows of a graph read this row
        self.hist = torch.zeros(max_num_seqs + 1, self.width, dtype=torch.int64, device=self.device)
        self.lens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.lens[self.spare] = 2
        self._free = list(range(max_num_seqs))
        self._owner: dict[int, Sequence] = {}
        self.costs = costs or StepCosts()
        # n-gram lookup's rule on the host tells what speculation would have accepted while it is off
        self._shadow = drafter.shadow_index if isinstance(drafter, NgramDrafter) else None
        self.controller = DepthController(self.ks, self.costs, max_batch=self.max_batch,
                                          shadow=self._shadow is not None)  # fmt: skip
        self.graphs = SpecGraphs(runner, self, drafter, sizes=graph_ladder(self.max_batch), ks=self.ks,
                                 capture=capture)  # fmt: skip

    # ---- host bookkeeping ---------------------------------------------------------------------------------

    def state(self, seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = self.controller.start()
        state = seq.spec
        if self._shadow is not None and state.shadow is None:  # from the known tokens (a pending one joins later)
            state.shadow = self._shadow()
            state.shadow.extend(seq.all_token_ids)
        return state

    def on_token(self, seq: Sequence, token: int, *, speculated: bool, batch: int = 1) -> None:
        """Every token appended to a speculation-eligible sequence (before it is appended to seq). In batches
        too large to speculate the shadow index is dropped (rebuilt when the batch shrinks): no host work there."""
        if batch > self.max_batch:
            if seq.spec is not None:
                seq.spec.shadow = None
            return
        state = self.state(seq)
        if state.shadow is not None:
            if not speculated:
                self.controller.observe_shadow(state, state.shadow.propose(1), token)
            state.shadow.append(token)
        if not speculated:
            state.plain_steps += 1

    def plan(self, seqs: list[Sequence], *, budget: int, chained: bool = False) -> list[int] | None:
        """Draft depths for a step of these decoding sequences, or None when the step should decode plainly.
        chained: the sequences have a verify step in flight (appending 1..pending_max tokens not yet read)."""
        batch = len(seqs)
        if not 0 < batch <= self.max_batch or any(not eligible(s.params) for s in seqs):
            return None
        ks: list[int] = []
        for seq in seqs:
            state = self.state(seq)
            pending_min = 1 if chained else 0
            # Never past max_tokens (extra tokens would be dropped) or the context (the device clamps too).
            cap = min(self.max_k, seq.params.max_tokens - len(seq.output_token_ids) - pending_min - 1,
                      self.max_model_len - seq.num_known_tokens - state.pending_max - 1)  # fmt: skip
            ks.append(self.controller.depth(state, batch, cap))
        while sum(ks) + batch > budget and any(ks):
            i = max(range(batch), key=ks.__getitem__)
            ks[i] -= 1
        if not any(ks):
            return None
        k = next(kk for kk in self.ks if kk >= max(ks))
        # The whole batch pays the widest row's cost: speculate only if the batch's tokens beat it.
        tokens = sum(1.0 + self.controller.gain(self.state(s), kk) for s, kk in zip(seqs, ks, strict=True))
        if tokens < batch * self.costs(batch, k) * self.controller.stay:
            return None
        return ks

    def _row(self, seq: Sequence) -> int | None:
        """The sequence's row of hist, taken on first use (None: every row is taken)."""
        state = self.state(seq)
        if state.row is None:
            if not self._free:  # reclaim rows of sequences that left the running batch (preempted, finished)
                for owner in list(self._owner.values()):
                    if owner.status is not Status.RUNNING:
                        self.release(owner)
            if not self._free:
                return None
            state.row, state.synced = self._free.pop(), 0
            self._owner[state.row] = seq
        return state.row

    def release(self, seq: Sequence) -> None:
        state = seq.spec
        if state is not None and state.row is not None:
            del self._owner[state.row]
            self._free.append(state.row)
            state.row, state.synced = None, 0

    def on_hidden(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, pending: torch.Tensor | None) -> None:
        """The runner's plain steps (ModelRunner.on_hidden): an MTP drafter takes the target's hidden states of each
        speculation-eligible sequence's rows, under the sequence's row of hist (given one here)."""
        rows = [self._row(c.seq) if eligible(c.seq.params) else None for c in chunks]
        self.drafter.absorb(chunks, rows, hidden, pending)  # type: ignore[attr-defined]

    def sync(self, seqs: list[Sequence]) -> bool:
        """Before a verify step launched from host-known state: give each sequence a row of hist holding all its
        known tokens and lens = its length (uploads only what the device lacks); the drafter catches up.
        False (nothing launched) when rows run out."""
        if any(self._row(seq) is None for seq in seqs):
            return False
        index: list[int] = []
        values: list[int] = []
        for seq in seqs:
            state = self.state(seq)
            assert state.row is not None
            tokens = seq.all_token_ids
            base = state.row * self.width
            index.extend(range(base + state.synced, base + len(tokens)))
            values.extend(tokens[state.synced:])
            state.synced = len(tokens)
        if index:
            self.hist.view(-1).index_copy_(0, upload(index, torch.int64, self.device),
                                           upload(values, torch.int64, self.device))  # fmt: skip
        rows = [s.spec.row for s in seqs if s.spec is not None]
        self.lens.index_copy_(0, upload(rows, torch.int64, self.device),
                              upload([s.num_known_tokens for s in seqs], torch.int64, self.device))  # fmt: skip
        self.drafter.catch_up(seqs)
        return True

    # ---- the step ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], ks: list[int], generator: torch.Generator | None) -> LaunchedStep:
        """Draft, verify and accept on the device for sequences whose hist rows hold their tokens; nothing
        waits for the device. Appends the accepted tokens to hist / lens there."""
        k = next(kk for kk in self.ks if kk >= max(ks))
        rows = [s.spec.row for s in seqs if s.spec is not None]
        assert len(rows) == len(seqs) and all(r is not None for r in rows), "sync() gives every sequence a row"
        states = self.runner.states
        slots = [states.slot(s) for s in seqs] if states is not None else None
        x, logits = self.graphs.run(rows, ks, [s.block_table for s in seqs], k, slots)  # type: ignore[arg-type]
        b = len(seqs)
        logits = logits.view(b, k + 1, -1)
        drafts, num_drafts = x.drafts[:b], x.num_drafts[:b]
        tokens, accepted, errors = self._accept(logits, drafts, num_drafts, seqs, generator)
        if states is not None:  # the recurrent state after the last accepted token, into each live slot
            states.commit(accepted)
        if self.drafter.wants_hidden:  # an MTP drafter keeps the target's states of the accepted rows
            self.drafter.record(x, self.graphs.hidden, accepted)  # type: ignore[attr-defined]
        # Append on the device: hist[row, len + j] = tokens[j] (beyond the accepted ones: rewritten before read).
        rows_t, lens_t = x.rows[:b], x.seq_lens[:b]
        pos = lens_t[:, None] + torch.arange(k + 1, device=self.device)[None, :]
        self.hist.view(-1).index_copy_(0, (rows_t[:, None] * self.width + pos).reshape(-1), tokens.reshape(-1))
        self.lens.index_add_(0, rows_t, accepted + 1)
        result = torch.cat([tokens, accepted[:, None], num_drafts[:, None]], dim=1)  # [B, K+3]
        return LaunchedStep(seqs, result, errors=errors, may_overlap=True, ks=ks).copy_to_host()

    # ---- the step loop's hook (step.StepHook) ----------------------------------------------------------------

    def launch_verify(self, chunks: list[ScheduledChunk], steps: StepRunner) -> LaunchedStep | None:
        """A verify step for a step of pure decode chunks whose tokens the host knows, when speculation pays."""
        seqs = [c.seq for c in chunks]
        if any(c.num_tokens != 1 or not c.completes or c.start < len(c.seq.prompt_token_ids)
               or c.seq.num_pending_tokens for c in chunks):  # fmt: skip
            return None
        ks = self.plan(seqs, budget=steps.scheduler.max_num_batched_tokens)
        if ks is None:
            return None
        blocks = steps.blocks
        for i, seq in enumerate(seqs):  # drafts only in blocks to spare: they never preempt anyone
            if not blocks.ensure(seq, seq.num_tokens + ks[i]):
                ks[i] = max(0, min(ks[i], len(seq.block_table) * blocks.block_size - seq.num_tokens))
        if not any(ks) or not self.sync(seqs):
            return None
        return self._launch_step(seqs, ks, steps)

    def chain(self, previous: LaunchedStep, steps: StepRunner) -> LaunchedStep | None:
        """Launch the successor of a verify step in flight from the device's state alone, while the batch is
        steady: the same running sequences, nothing waiting, speculation still paying, blocks for the most the
        step in flight could append. None: read `previous` first and schedule from known tokens."""
        scheduler = steps.scheduler
        if not previous.is_verify or scheduler.waiting:
            return None
        seqs = [s for s in previous.seqs if not s.is_finished]
        if {id(s) for s in seqs} != {id(s) for s in scheduler.running}:
            return None
        # The step in flight appends at least one token: a sequence it takes to max_tokens has nothing left.
        seqs = [s for s in seqs if len(s.output_token_ids) + 1 < s.params.max_tokens]
        ks = self.plan(seqs, budget=scheduler.max_num_batched_tokens, chained=True) if seqs else None
        if ks is None:
            return None
        for seq, k in zip(seqs, ks, strict=True):
            state = seq.spec
            assert state is not None and state.row is not None
            if not steps.blocks.ensure(seq, min(seq.num_known_tokens + state.pending_max + k, self.max_model_len)):
                return None
        return self._launch_step(seqs, ks, steps)

    def _launch_step(self, seqs: list[Sequence], ks: list[int], steps: StepRunner) -> LaunchedStep:
        launched = self.launch(seqs, ks, steps.generator)
        for seq, k in zip(seqs, ks, strict=True):
            assert seq.spec is not None
            seq.spec.pending_max += 1 + k
        return launched

    def wants(self, steps: StepRunner) -> bool:
        """Whether the running batch would speculate now (then a plain step in flight is read first)."""
        scheduler, seqs = steps.scheduler, steps.scheduler.running
        if scheduler.waiting or not seqs or any(s.num_tokens - s.num_computed_tokens > 1 for s in seqs):
            return False  # (the last: a prompt still being computed)
        return self.plan(seqs, budget=scheduler.max_num_batched_tokens) is not None

    def on_decoded(self, seq: Sequence, token: int, batch: int) -> None:
        """A token a plain step decoded: what the drafter would have done, for its depth."""
        if eligible(seq.params):
            self.on_token(seq, token, speculated=False, batch=batch)

    def finish_verify(self, launched: LaunchedStep, steps: StepRunner) -> list[RequestOutput]:
        """Read a verify step: append each sequence's accepted tokens, stop, detokenize, emit."""
        assert launched.ks is not None
        rows = launched.read()
        k = launched.result.shape[1] - 3
        counters = steps.counters
        counters.spec_steps += 1
        counters.spec_depth = k
        outputs: list[RequestOutput] = []
        for j, seq in enumerate(launched.seqs):
            state = seq.spec
            assert state is not None
            state.pending_max -= 1 + launched.ks[j]
            if seq.is_finished:  # stopped or aborted while this step was in flight: its tokens are dropped
                continue
            if j in launched.errors:
                outputs.append(steps.fail(seq, launched.errors[j]))
                continue
            tokens, accepted, proposed = rows[j][:k + 1], rows[j][k + 1], rows[j][k + 2]
            self.controller.observe_step(state, proposed, accepted)
            appended = 0
            for token in tokens[:accepted + 1]:
                self.on_token(seq, token, speculated=True)
                steps.append_token(seq, token, None)
                appended += 1
                if seq.is_finished:
                    break
            counters.spec_sequence_steps += 1
            counters.spec_tokens += appended
            counters.draft_tokens += proposed
            counters.accepted_drafts += min(accepted, appended)
            counters.draft_rejections += accepted < proposed
            # The device holds every token read so far; K/V are cached for all but the newest.
            state.synced = seq.num_known_tokens
            state.draft_valid = max(state.draft_valid, seq.num_known_tokens - 2)
            seq.num_computed_tokens = seq.num_known_tokens - 1
            if self.runner.states is not None:
                self.runner.states.verified(seq, seq.num_computed_tokens)
            steps.blocks.commit(seq)
            outputs.append(steps.output(seq))
            if seq.is_finished:
                steps.retire(seq)
        return outputs

    def _accept(self, logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, seqs: list[Sequence],
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, dict[int, str]]:  # fmt: skip
        tokens, accepted = accept_greedy(logits, drafts, num_drafts)
        errors: dict[int, str] = {}
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return tokens, accepted, errors
        k1 = logits.shape[1]
        try:
            idx = upload(sampled, torch.int64, logits.device)
            params = [seqs[i].params for i in sampled for _ in range(k1)]
            probs = sampling_probs(logits[idx].reshape(len(sampled) * k1, -1), params).view(len(sampled), k1, -1)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not end the batch
            return tokens, accepted, {i: _failure(seqs[i].params, exc) for i in sampled}
        # A seeded request draws alone from its own generator, as many uniforms whatever the batch's k; the rest
        # draw together from the engine's.
        groups = [([i], seqs[i].generator, self.max_k) for i in sampled if seqs[i].generator is not None]
        if shared := [i for i in sampled if seqs[i].generator is None]:
            groups.append((shared, generator, k1 - 1))
        for group, gen, width in groups:
            try:
                rows = upload(group, torch.int64, logits.device)
                sel = upload([sampled.index(i) for i in group], torch.int64, logits.device)
                u = torch.rand((len(group), width), generator=gen, device=logits.device)[:, :k1 - 1]
                tokens[rows], accepted[rows] = rejection_sample(probs[sel], drafts[rows], num_drafts[rows], u, gen)
            except Exception as exc:  # noqa: BLE001
                errors.update({i: _failure(seqs[i].params, exc) for i in group})
        return tokens, accepted, errors


def _failure(params: SamplingParams, exc: Exception) -> str:
    return (f"sampling failed for this request (temperature={params.temperature!r}, top_p={params.top_p!r}, "
            f"top_k={params.top_k!r}): {type(exc).__name__}: {exc}").replace("\n", " ")


# ---- construction: speculation wraps the engine's runner ----------------------------------------------------------

_TOKENIZER_PROBE = "def f(x):\n    return [x, 'ü', 1.5e-3]  # Grüße, 世界"


def load_draft(config: EngineConfig, loaded: LoadedModel) -> LoadedModel | None:
    """The configured draft model (None: n-gram lookup, or speculation off), checked against the target: the same
    tokenizer, a window as long as max_model_len; for "mtp", the target itself, checked to have an MTP module."""
    if not config.num_speculative_tokens or config.draft_model is None:
        return None
    if config.draft_model == MTP:  # the model's own multi-token-prediction module
        check_mtp(loaded.config, loaded.source.name)
        return loaded
    draft = load_model_info(config.draft_model)
    dc, tc = draft.config, loaded.config
    if dc.vocab_size != tc.vocab_size or draft.tokenizer.encode(_TOKENIZER_PROBE) != loaded.tokenizer.encode(
            _TOKENIZER_PROBE):  # fmt: skip
        raise ValueError(f"draft_model: {config.draft_model!r} does not share the model's tokenizer "
                         f"(vocabulary {dc.vocab_size} vs {tc.vocab_size}); give a draft of the same family")
    if dc.hybrid is not None:  # its own steps would keep rejected drafts in its state (no verify slots there)
        raise ValueError(f"draft_model: {config.draft_model!r} has recurrent (linear-attention) layers, which a draft "
                         "model's passes cannot roll back; use n-gram lookup (no --draft-model) or --draft-model mtp")
    assert config.max_model_len is not None
    if dc.max_position_embeddings < config.max_model_len:
        raise ValueError(f"draft_model: its window ({dc.max_position_embeddings}) is shorter than max_model_len "
                         f"({config.max_model_len}); lower --max-model-len")
    return draft


def draft_kv_bytes(config: EngineConfig, draft: LoadedModel | None) -> int:
    """What a draft model's KV cache costs per block of the target's: it takes its share of the same memory budget
    (the target gets fewer blocks) and the same block count, so both caches are addressed by the target's block
    tables. Counted in the configured kv_cache_dtype's bytes (its runner packs the draft's cache too)."""
    if draft is None:
        return 0
    dc = draft.config
    bits = torch.finfo(DTYPES[config.dtype]).bits
    if dc.mla is not None:  # its own layout (models/deepseek.py): one latent row a token and layer, never packed
        layers = 1 if config.draft_model == MTP else dc.num_hidden_layers  # MTP: the module's one layer
        return layers * config.block_size * (dc.mla.kv_lora_rank + dc.mla.qk_rope_head_dim) * bits // 8
    if config.draft_model == MTP:  # the module's one layer of plain K/V (Qwen3-Next's), never packed
        return 2 * config.block_size * dc.num_key_value_heads * dc.head_dim * bits // 8
    # the draft's runner packs its cache as the target's
    per_token = kv_bytes_per_token(config.kv_cache_dtype, dc.num_key_value_heads, dc.head_dim, dtype_bytes=bits // 8)
    return dc.num_hidden_layers * config.block_size * per_token


def build_speculation(config: EngineConfig, runner: ModelRunner, draft: LoadedModel | None) -> SpecDecoder:
    """The SpecDecoder around the target's runner, with the configured drafter (a draft model's own runner over
    the same number of blocks, the target's MTP module with its own cache over them, or n-gram lookup); on warm-up,
    the relative cost of every captured (batch, k) step measured on this device. EngineConfig refuses speculation
    under tensor parallelism."""
    drafter: Drafter = NgramDrafter()
    if config.draft_model == MTP:
        assert draft is not None
        drafter = MtpDrafter(runner, draft, rows=config.max_num_seqs + 1, max_k=config.num_speculative_tokens)
    elif draft is not None:
        draft_config = replace(config, model=config.draft_model, num_kv_blocks=runner.num_blocks,
                               use_cuda_graphs=False, num_speculative_tokens=0, draft_model=None)  # fmt: skip
        assert config.max_num_batched_tokens is not None
        drafter = DraftModelDrafter(ModelRunner(draft_config, draft),
                                    max_num_batched_tokens=config.max_num_batched_tokens)  # fmt: skip
    assert config.speculative_max_batch is not None
    spec = SpecDecoder(runner, drafter, max_k=config.num_speculative_tokens, max_batch=config.speculative_max_batch,
                       max_num_seqs=config.max_num_seqs,
                       capture=config.use_cuda_graphs and runner.device.type == "cuda")  # fmt: skip
    if drafter.wants_hidden:
        runner.on_hidden = spec.on_hidden
    if config.warm_up:  # the relative cost of every captured (batch, k) step on this device
        spec.costs.table = spec.graphs.measure_costs(runner.decode_graphs)
    return spec
