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
tokens this one appended (overlapped scheduling; step.py). The host mirrors the counts when it reads a step.

Depth is chosen per request (`DepthController`): from the request's running acceptance and the measured relative
cost of a (batch, k) step, the k that maximises tokens per unit of step time, or none when no k pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from envex.runtime.engine.drafters import Drafter, NgramDrafter, NgramIndex
from envex.runtime.engine.model_runner import upload
from envex.runtime.engine.sampler import sampling_probs
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.engine.types import SamplingParams

K_LADDER = (1, 2, 4, 8, 16)


def k_ladder(max_k: int) -> tuple[int, ...]:
    """The draft depths verify graphs are captured for: powers of two below max_k, and max_k."""
    if max_k < 1:
        raise ValueError(f"num_speculative_tokens: must be >= 1 for a ladder, got {max_k}")
    return tuple(k for k in K_LADDER if k < max_k) + (max_k,)


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


# ---- per-request state and depth -------------------------------------------------------------------------------


@dataclass
class SpecState:
    """One sequence's speculative-decoding state (Sequence.spec)."""

    row: int | None = None  # its row of SpecDecoder.hist, while it holds one
    synced: int = 0  # leading tokens valid in that row
    draft_valid: int = 0  # leading positions whose draft-model K/V are valid
    pending_max: int = 0  # tokens the launched-but-unread verify steps may still append (1 + k each)
    on: bool = False  # speculating (hysteresis of DepthController)
    # Decayed sums: drafts accepted, drafts tried, steps with a proposal, steps; the prior is
    # DepthController.start's.
    hits: float = 1.0
    trials: float = 2.0
    proposed: float = 2.0
    steps: float = 2.0
    plain_steps: int = 0  # steps since it last speculated (probing, for drafters without a shadow)
    shadow: NgramIndex | None = None  # the host's n-gram index over its known tokens

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials

    @property
    def proposal_rate(self) -> float:
        return self.proposed / self.steps


class StepCosts:
    """Relative cost of a verify step: cost(batch, k) = time(batch, K) / time(batch, 0) at the ladder's K >= k.

    Measured on the captured graphs at start (cuda_graphs.SpecGraphs.measure_costs); without a measurement, a
    model where a draft row costs `per_row` of a step and k > 0 a fixed `switch` (the batch-1 GEMV gives way to
    GEMM when a sequence brings several rows), and `batch` rows saturate the device's compute."""

    def __init__(self, *, per_row: float = 0.02, switch: float = 0.1, saturate: int = 64) -> None:
        self.per_row, self.switch, self.saturate = per_row, switch, saturate
        self.table: dict[tuple[int, int], float] = {}

    def __call__(self, batch: int, k: int) -> float:
        if k == 0:
            return 1.0
        if self.table:
            sizes = sorted({b for b, _ in self.table})
            depths = sorted({kk for _, kk in self.table})
            b = next((s for s in sizes if s >= batch), sizes[-1])
            kk = next((d for d in depths if d >= k), depths[-1])
            return self.table[(b, kk)]
        rows, base = batch * (k + 1), max(1, batch)
        return (1.0 + self.switch + self.per_row * k * batch) * max(1.0, rows / self.saturate) / max(
            1.0, base / self.saturate)


class DepthController:
    """k per request: with per-draft acceptance a and proposal rate r (decayed averages), k drafts add
    r * (a + a^2 + ... + a^k) tokens per step at cost(batch, k); it picks the ladder k with the most tokens per
    unit of time, and none unless that beats plain decoding by `enter` (10%; staying on down to `stay`, 2%, so a
    request does not flap between the two: each switch costs the overlap one step, and an estimate near break-even
    gains nothing anyway)."""

    def __init__(self, ks: tuple[int, ...], costs: StepCosts, *, max_batch: int, decay: float = 0.9,
                 enter: float = 1.1, stay: float = 1.02, probe_every: int = 32, shadow: bool) -> None:  # fmt: skip
        self.ks, self.costs, self.max_batch = ks, costs, max_batch
        self.decay, self.enter, self.stay, self.probe_every, self.shadow = decay, enter, stay, probe_every, shadow

    @staticmethod
    def gain(state: SpecState, k: int) -> float:
        """Expected tokens a step with k drafts adds beyond the one plain decoding gives."""
        a = state.acceptance
        return state.proposal_rate * sum(a**i for i in range(1, k + 1))

    def value(self, state: SpecState, batch: int, k: int) -> float:
        """Tokens per unit of step time at depth k, relative to plain decoding."""
        return (1.0 + self.gain(state, k)) / self.costs(batch, k)

    def depth(self, state: SpecState, batch: int, cap: int) -> int:
        """The draft depth for this request in a step of `batch` sequences, at most `cap` (0: plain decoding)."""
        if batch > self.max_batch or cap < 1:
            return 0
        best_k, best = 0, 1.0
        for k in self.ks:
            if k <= cap and (v := self.value(state, batch, k)) > best:
                best_k, best = k, v
        if best < (self.stay if state.on else self.enter):
            state.on = False
            if not self.shadow and state.plain_steps >= self.probe_every:
                return min(self.ks[0], cap)  # no host-side estimate: try one short draft now and then
            return 0
        state.on = True
        return best_k

    def start(self) -> SpecState:
        """A new request's state. With a shadow (n-gram lookup), a request starts off and the host index turns it
        on once the answer repeats its context (a few tokens: chat answers never pay the wider steps); without
        one (a draft model, which usually agrees with the target), it starts on at a per-draft acceptance of 1/2."""
        if self.shadow:
            return SpecState(hits=0.8, trials=4.0, proposed=2.0, steps=4.0)  # a = 0.2, r = 0.5, as four steps
        return SpecState()

    def observe_step(self, state: SpecState, proposed: int, accepted: int) -> None:
        d = self.decay
        state.steps = d * state.steps + 1
        state.proposed = d * state.proposed + (proposed > 0)
        if proposed:
            state.hits = d * state.hits + accepted
            state.trials = d * state.trials + accepted + (accepted < proposed)
        state.plain_steps = 0

    def observe_shadow(self, state: SpecState, proposal: list[int], token: int) -> None:
        """A token decoded without speculation, and what the n-gram drafter would have proposed before it."""
        d = self.decay
        state.steps = d * state.steps + 1
        state.proposed = d * state.proposed + bool(proposal)
        if proposal:
            state.hits = d * state.hits + (proposal[0] == token)
            state.trials = d * state.trials + 1


# ---- the device-side decoder ------------------------------------------------------------------------------------


@dataclass
class SpecLaunch:
    """A launched verify step: per batch row [tokens (K+1) | accepted | proposed], on the device until read."""

    seqs: list[Sequence]
    ks: list[int]
    k: int
    result: torch.Tensor  # int64 [B, K+3]
    errors: dict[int, str] = field(default_factory=dict)
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def read(self) -> list[list[int]]:
        if self.ready is None:
            return self.result.tolist()
        self.ready.synchronize()
        assert self.host is not None
        return self.host.tolist()


class SpecDecoder:
    """The sequences' tokens on the device, the drafter, the (batch, k) verify graphs and the depth controller."""

    def __init__(self, runner, drafter: Drafter, *, max_k: int, max_batch: int, max_num_seqs: int,
                 capture: bool, costs: StepCosts | None = None) -> None:  # fmt: skip
        from envex.runtime.engine.cuda_graphs import SpecGraphs, graph_ladder

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
        spare = max_num_seqs  # padding rows of a graph read this row
        self.hist = torch.zeros(max_num_seqs + 1, self.width, dtype=torch.int64, device=self.device)
        self.lens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.lens[spare] = 2
        self.spare = spare
        self._free = list(range(max_num_seqs))
        self._owner: dict[int, Sequence] = {}
        self.costs = costs or StepCosts()
        self.controller = DepthController(self.ks, self.costs, max_batch=self.max_batch,
                                          shadow=isinstance(drafter, NgramDrafter))  # fmt: skip
        self.graphs = SpecGraphs(runner, self, drafter, sizes=graph_ladder(self.max_batch), ks=self.ks,
                                 capture=capture)  # fmt: skip

    # ---- host bookkeeping ---------------------------------------------------------------------------------

    def state(self, seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = self.controller.start()
        state = seq.spec
        if self.controller.shadow and state.shadow is None:  # built from the known tokens (a pending one joins later)
            state.shadow = NgramIndex()
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

    def _take_row(self, seq: Sequence) -> int | None:
        if not self._free:  # reclaim rows of sequences that left the running batch (preempted, finished)
            for owner in list(self._owner.values()):
                if owner.status is not Status.RUNNING:
                    self.release(owner)
        if not self._free:
            return None
        row = self._free.pop()
        self._owner[row] = seq
        return row

    def release(self, seq: Sequence) -> None:
        state = seq.spec
        if state is not None and state.row is not None:
            del self._owner[state.row]
            self._free.append(state.row)
            state.row, state.synced = None, 0

    def sync(self, seqs: list[Sequence]) -> bool:
        """Before a verify step launched from host-known state: give each sequence a row of hist holding all its
        known tokens and lens = its length (uploads only what the device lacks); the drafter catches up.
        False (nothing launched) when rows run out."""
        for seq in seqs:
            state = self.state(seq)
            if state.row is None:
                row = self._take_row(seq)
                if row is None:
                    return False
                state.row, state.synced = row, 0
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
    def launch(self, seqs: list[Sequence], ks: list[int], generator: torch.Generator | None) -> SpecLaunch:
        """Draft, verify and accept on the device for sequences whose hist rows hold their tokens; nothing
        waits for the device. Appends the accepted tokens to hist / lens there."""
        k = next(kk for kk in self.ks if kk >= max(ks))
        rows = [s.spec.row for s in seqs if s.spec is not None]
        assert len(rows) == len(seqs) and all(r is not None for r in rows), "sync() gives every sequence a row"
        x, logits = self.graphs.run(rows, ks, [s.block_table for s in seqs], k)  # type: ignore[arg-type]
        b = len(seqs)
        logits = logits.view(b, k + 1, -1)
        drafts, num_drafts = x.drafts[:b], x.num_drafts[:b]
        tokens, accepted, errors = self._accept(logits, drafts, num_drafts, seqs, generator)
        # Append on the device: hist[row, len + j] = tokens[j] (beyond the accepted ones: rewritten before read).
        rows_t, lens_t = x.rows[:b], x.seq_lens[:b]
        pos = lens_t[:, None] + torch.arange(k + 1, device=self.device)[None, :]
        self.hist.view(-1).index_copy_(0, (rows_t[:, None] * self.width + pos).reshape(-1), tokens.reshape(-1))
        self.lens.index_add_(0, rows_t, accepted + 1)
        result = torch.cat([tokens, accepted[:, None], num_drafts[:, None]], dim=1)
        launch = SpecLaunch(seqs, ks, k, result, errors)
        if result.is_cuda:
            launch.host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            launch.host.copy_(result, non_blocking=True)
            launch.ready = torch.cuda.Event()
            launch.ready.record()
        return launch

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
        shared = [j for j, i in enumerate(sampled) if seqs[i].generator is None]
        for j, i in enumerate(sampled):
            gen = seqs[i].generator
            if gen is None:
                continue
            try:  # a seeded request draws alone from its own generator, as many uniforms whatever the batch's k
                u = torch.rand((1, self.max_k), generator=gen, device=logits.device)[:, :k1 - 1]
                t, a = rejection_sample(probs[j:j + 1], drafts[i:i + 1], num_drafts[i:i + 1], u, gen)
                tokens[i], accepted[i] = t[0], a[0]
            except Exception as exc:  # noqa: BLE001
                errors[i] = _failure(seqs[i].params, exc)
        if shared:
            try:
                sel = upload(shared, torch.int64, logits.device)
                rows = upload([sampled[j] for j in shared], torch.int64, logits.device)
                u = torch.rand((len(shared), k1 - 1), generator=generator, device=logits.device)
                t, a = rejection_sample(probs[sel], drafts[rows], num_drafts[rows], u, generator)
                tokens[rows], accepted[rows] = t, a
            except Exception as exc:  # noqa: BLE001
                errors.update({sampled[j]: _failure(seqs[sampled[j]].params, exc) for j in shared})
        return tokens, accepted, errors


def _failure(params: SamplingParams, exc: Exception) -> str:
    return (f"sampling failed for this request (temperature={params.temperature!r}, top_p={params.top_p!r}, "
            f"top_k={params.top_k!r}): {type(exc).__name__}: {exc}").replace("\n", " ")


# ---- construction -----------------------------------------------------------------------------------------------

_TOKENIZER_PROBE = "def f(x):\n    return [x, 'ü', 1.5e-3]  # Grüße, 世界"


def build_runner(config, loaded, parallel=None):  # (EngineConfig, LoadedModel, ParallelState | None) -> ...
    """The target's ModelRunner and, when speculation is on, its SpecDecoder with the configured drafter. A draft
    model's KV cache takes its share of the same memory budget (the target gets fewer blocks) and the same block
    count, so both caches are addressed by the target's block tables. parallel: rank 0 of a tensor-parallel group
    (EngineConfig refuses speculation with it)."""
    from dataclasses import replace

    from envex.runtime.engine.drafters import DraftModelDrafter
    from envex.runtime.engine.model_runner import DTYPES, ModelRunner
    from envex.runtime.loader import load_model_info

    if not config.num_speculative_tokens:
        return ModelRunner(config, loaded, parallel=parallel), None
    drafter: Drafter
    if config.draft_model is None:
        runner = ModelRunner(config, loaded)
        drafter = NgramDrafter()
    else:
        draft = load_model_info(config.draft_model)
        dc, tc = draft.config, loaded.config
        if dc.vocab_size != tc.vocab_size or draft.tokenizer.encode(_TOKENIZER_PROBE) != loaded.tokenizer.encode(
                _TOKENIZER_PROBE):  # fmt: skip
            raise ValueError(f"draft_model: {config.draft_model!r} does not share the model's tokenizer "
                             f"(vocabulary {dc.vocab_size} vs {tc.vocab_size}); give a draft of the same family")
        if dc.max_position_embeddings < config.max_model_len:
            raise ValueError(f"draft_model: its window ({dc.max_position_embeddings}) is shorter than max_model_len "
                             f"({config.max_model_len}); lower --max-model-len")
        bits = torch.finfo(DTYPES[config.dtype]).bits
        extra = 2 * dc.num_hidden_layers * config.block_size * dc.num_key_value_heads * dc.head_dim * bits // 8
        runner = ModelRunner(config, loaded, extra_kv_bytes_per_block=extra)
        draft_config = replace(config, model=config.draft_model, num_kv_blocks=runner.num_blocks,
                               use_cuda_graphs=False, num_speculative_tokens=0, draft_model=None)  # fmt: skip
        drafter = DraftModelDrafter(ModelRunner(draft_config, draft),
                                    max_num_batched_tokens=config.max_num_batched_tokens)  # fmt: skip
    spec = SpecDecoder(runner, drafter, max_k=config.num_speculative_tokens, max_batch=config.speculative_max_batch,
                       max_num_seqs=config.max_num_seqs,
                       capture=config.use_cuda_graphs and runner.device.type == "cuda")  # fmt: skip
    if config.warm_up:  # the relative cost of every captured (batch, k) step on this device
        spec.costs.table = spec.graphs.measure_costs(runner.decode_graphs)
    return runner, spec
