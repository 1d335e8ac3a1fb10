"""One engine step after scheduling: launch it (model + sampling on the device, nothing waits), then finish it
(read the sampled tokens, append, accept drafts, stop, detokenize, emit).

Overlapped scheduling lives here: a pure decode step may stay launched-but-unread while the engine schedules and
launches the next one. Its sampled ids stay on the device (`LaunchedStep.token_ids`); each sequence counts the
token as pending (`Sequence.num_pending_tokens`, `pending_row`), and the next step's runner copies it into its
inputs on the device (model_runner.fill_pending). The host reads the ids later from a pinned copy behind an
event, so host work hides behind device work.

Speculative decoding (speculative.py) adds verify steps. A verify step reads each sequence's tokens from the
device (SpecDecoder.hist) and appends what it accepted there, so while one is in flight the next verify step
can be launched from the device's state alone (`chain`), before the host knows how many tokens the first
appended: the host only allocates blocks for the most it could have appended. The chain holds while the batch
is steady (the same sequences, nothing waiting to be admitted, blocks to spare, speculation still paying);
otherwise the step in flight is read first and the scheduler plans the next one from known tokens. A plain
decode step in flight is read before a verify step is launched (drafting needs every token on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from envex.runtime.engine.block_manager import BlockManager
from envex.runtime.engine.model_runner import ModelRunner
from envex.runtime.engine.sampler import logprobs_for, sample_on_device, token_logprob
from envex.runtime.engine.scheduler import ScheduledChunk, Scheduler
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.engine.speculative import SpecDecoder, SpecLaunch, eligible
from envex.runtime.engine.types import RequestOutput, TokenLogprob


@dataclass
class LaunchedStep:
    """A launched step: the chunks that sample a token, and the sampled ids (on the device until read); or a
    verify step (`spec`)."""

    completing: list[ScheduledChunk]
    token_ids: torch.Tensor  # [len(completing)] int64, on the device
    raw_logprobs: torch.Tensor | None
    pure_decode: bool = False  # one token per sequence: the next step may launch before this is read
    host_ids: torch.Tensor | None = None  # pinned copy, valid once `ready` has fired
    ready: torch.cuda.Event | None = None
    errors: dict[int, str] = field(default_factory=dict)  # completing row -> why its sampling failed
    spec: SpecLaunch | None = None

    @property
    def sequences(self) -> list[Sequence]:
        return self.spec.seqs if self.spec is not None else [c.seq for c in self.completing]

    @property
    def may_overlap(self) -> bool:
        """The next step may be launched before this one is read."""
        return self.pure_decode or self.spec is not None

    def read_ids(self) -> list[int]:
        if self.ready is None:
            return self.token_ids.tolist()
        self.ready.synchronize()  # waits for this step only; the step launched after it keeps the device busy
        assert self.host_ids is not None
        return self.host_ids.tolist()


@dataclass
class StepCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    accepted_drafts: int = 0
    overlapped_steps: int = 0
    spec_steps: int = 0  # verify steps read
    spec_sequence_steps: int = 0  # sequences in them (the tokens per sequence and step: generated / these)
    spec_tokens: int = 0  # tokens they appended
    draft_tokens: int = 0  # drafts proposed in them
    draft_rejections: int = 0  # sequence-steps that stopped at a rejected draft (acceptance = accepted / (+ these))
    spec_depth: int = 0  # the ladder depth k of the last verify step


class StepRunner:
    """Launches and finishes steps for the engine; owns the running requests' registry and the token counters."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, blocks: BlockManager, *, eos_token_ids,
                 max_model_len: int, generator: torch.Generator, spec: SpecDecoder | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.spec = spec
        self.scheduler = scheduler
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generator = generator
        self.seqs: dict[str, Sequence] = {}
        self.counters = StepCounters()

    def launch(self, chunks: list[ScheduledChunk], previous: LaunchedStep | None) -> LaunchedStep:
        """Run the model and sample on the device; nothing here waits for the device."""
        if self.spec is not None and previous is None:
            verify = self._launch_verify(chunks)
            if verify is not None:
                return verify
        result = self.runner.execute(chunks, previous.token_ids if previous is not None else None)
        completing: list[ScheduledChunk] = []
        for i, c in enumerate(chunks):
            seq = c.seq
            if c.start == seq.num_cached_prefix_tokens and c.start < len(seq.prompt_token_ids):
                self.counters.cached_tokens += seq.num_cached_prefix_tokens
                self.counters.prompt_tokens += len(seq.prompt_token_ids)
            seq.num_computed_tokens = c.start + c.num_tokens
            self.blocks.commit(seq)
            if i in result.prompt_logits:
                self._record_prompt_logprobs(c, result.prompt_logits[i])
            if c.completes:
                completing.append(c)
        if not completing:
            return LaunchedStep([], torch.zeros(0, dtype=torch.int64, device=self.runner.device), None)
        token_ids, raw_logprobs, errors = sample_on_device(result.logits, [c.seq for c in completing], self.generator)
        for j, c in enumerate(completing):
            c.seq.num_pending_tokens += 1
            c.seq.pending_row = j
        pure_decode = all(c.start >= len(c.seq.prompt_token_ids) for c in chunks)
        launched = LaunchedStep(completing, token_ids, raw_logprobs, pure_decode, errors=errors)
        if token_ids.is_cuda:
            launched.host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            launched.host_ids.copy_(token_ids, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        return launched

    # ---- verify steps -------------------------------------------------------------------------------------------

    def _launch_verify(self, chunks: list[ScheduledChunk]) -> LaunchedStep | None:
        """A verify step for a step of pure decode chunks whose tokens the host knows, when speculation pays."""
        assert self.spec is not None
        seqs = [c.seq for c in chunks]
        if any(c.num_tokens != 1 or not c.completes or c.start < len(c.seq.prompt_token_ids)
               or c.seq.num_pending_tokens for c in chunks):  # fmt: skip
            return None
        ks = self.spec.plan(seqs, budget=self.scheduler.max_num_batched_tokens)
        if ks is None:
            return None
        bs = self.blocks.block_size
        for i, seq in enumerate(seqs):  # drafts only in blocks to spare: they never preempt anyone
            if not self.blocks.ensure(seq, seq.num_tokens + ks[i]):
                ks[i] = max(0, min(ks[i], len(seq.block_table) * bs - seq.num_tokens))
        if not any(ks) or not self.spec.sync(seqs):
            return None
        return self._launch_spec(seqs, ks)

    def chain(self, previous: LaunchedStep) -> LaunchedStep | None:
        """Launch the successor of a verify step in flight from the device's state alone, while the batch is
        steady: the same running sequences, nothing waiting, speculation still paying, blocks for the most the
        step in flight could append. None: read `previous` first and schedule from known tokens."""
        if self.spec is None or previous.spec is None or self.scheduler.waiting:
            return None
        seqs = [s for s in previous.spec.seqs if not s.is_finished]
        if {id(s) for s in seqs} != {id(s) for s in self.scheduler.running}:
            return None
        # The step in flight appends at least one token: a sequence it takes to max_tokens has nothing left.
        seqs = [s for s in seqs if len(s.output_token_ids) + 1 < s.params.max_tokens]
        ks = self.spec.plan(seqs, budget=self.scheduler.max_num_batched_tokens, chained=True) if seqs else None
        if ks is None:
            return None
        for seq, k in zip(seqs, ks, strict=True):
            state = seq.spec
            assert state is not None and state.row is not None
            if not self.blocks.ensure(seq, min(seq.num_known_tokens + state.pending_max + k, self.max_model_len)):
                return None
        return self._launch_spec(seqs, ks)

    def _launch_spec(self, seqs: list[Sequence], ks: list[int]) -> LaunchedStep:
        assert self.spec is not None
        launch = self.spec.launch(seqs, ks, self.generator)
        for seq, k in zip(seqs, ks, strict=True):
            assert seq.spec is not None
            seq.spec.pending_max += 1 + k
        empty = torch.zeros(0, dtype=torch.int64, device=self.runner.device)
        return LaunchedStep([], empty, None, spec=launch)

    def _finish_spec(self, launch: SpecLaunch) -> list[RequestOutput]:
        assert self.spec is not None
        rows = launch.read()
        k = launch.k
        counters = self.counters
        counters.spec_steps += 1
        counters.spec_depth = k
        outputs: list[RequestOutput] = []
        for j, seq in enumerate(launch.seqs):
            state = seq.spec
            assert state is not None
            state.pending_max -= 1 + launch.ks[j]
            if seq.is_finished:  # stopped or aborted while this step was in flight: its tokens are dropped
                continue
            if j in launch.errors:
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                outputs.append(replace(self.output(seq), error=launch.errors[j]))
                self.retire(seq)
                continue
            tokens, accepted, proposed = rows[j][:k + 1], rows[j][k + 1], rows[j][k + 2]
            self.spec.controller.observe_step(state, proposed, accepted)
            appended = 0
            for token in tokens[:accepted + 1]:
                self.spec.on_token(seq, token, speculated=True)
                self._append_token(seq, token, None)
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
            self.blocks.commit(seq)
            outputs.append(self.output(seq))
            if seq.is_finished:
                self.retire(seq)
        return outputs

    def wants_spec(self) -> bool:
        """Whether the running batch would speculate now (then a plain step in flight is read first)."""
        if self.spec is None or self.scheduler.waiting or not self.scheduler.running:
            return False
        seqs = self.scheduler.running
        if any(s.num_tokens - s.num_computed_tokens > 1 for s in seqs):  # a prompt still being computed
            return False
        return self.spec.plan(seqs, budget=self.scheduler.max_num_batched_tokens) is not None

    # ---- reading steps ------------------------------------------------------------------------------------------

    def finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens and apply them: append, stop, detokenize, emit."""
        if launched.spec is not None:
            return self._finish_spec(launched.spec)
        if not launched.completing:
            return []
        ids = launched.read_ids()
        seqs = [c.seq for c in launched.completing]
        lps = logprobs_for(launched.raw_logprobs, seqs, ids)
        outputs: list[RequestOutput] = []
        for j, (c, token_id, lp) in enumerate(zip(launched.completing, ids, lps, strict=True)):
            seq = c.seq
            seq.num_pending_tokens -= 1
            if seq.is_finished:  # stopped or aborted while this token was in flight: the token is dropped
                continue
            if j in launched.errors:  # this request's sampling failed: end it alone, the batch goes on
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                outputs.append(replace(self.output(seq), error=launched.errors[j]))
                self.retire(seq)
                continue
            if self.spec is not None and eligible(seq.params):  # what the drafter would have done, for its depth
                self.spec.on_token(seq, token_id, speculated=False, batch=len(launched.completing))
            self._append_token(seq, token_id, lp)
            self.blocks.commit(seq)
            outputs.append(self.output(seq))
            if seq.is_finished:
                self.retire(seq)
        return outputs

    def retire(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.release(seq)
        del self.seqs[seq.request_id]

    def _record_prompt_logprobs(self, c: ScheduledChunk, logits: torch.Tensor) -> None:
        seq = c.seq
        assert seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
        logprobs = torch.log_softmax(logits, dim=-1)
        prompt = seq.prompt_token_ids
        for row in range(c.num_tokens):
            nxt = c.start + row + 1  # the prompt token this row predicts
            if nxt < len(prompt) and len(seq.prompt_logprobs) == nxt:
                seq.prompt_logprobs.append(token_logprob(logprobs[row], prompt[nxt], seq.params.prompt_logprobs))

    def _append_token(self, seq: Sequence, token_id: int, lp: TokenLogprob | None) -> None:
        p = seq.params
        seq.output_token_ids.append(token_id)
        self.counters.generation_tokens += 1
        if lp is not None:
            seq.logprobs.append(lp)
        is_eos = token_id in self.eos_token_ids and not p.ignore_eos
        if is_eos or token_id in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", (None if is_eos else token_id)
        else:
            assert seq.detokenizer is not None
            seq.detokenizer.add_token(token_id)
            if seq.detokenizer.stopped_on is not None:
                seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stopped_on
            elif len(seq.output_token_ids) >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.status = Status.FINISHED

    def output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        assert seq.detokenizer is not None
        text = seq.detokenizer.release(final=finished)
        new_ids = seq.output_token_ids[seq.num_emitted_tokens:]
        new_lps = seq.logprobs[seq.num_emitted_tokens:] if seq.params.logprobs is not None else None
        prompt_lps = None
        if seq.prompt_logprobs is not None and seq.num_emitted_tokens == 0:
            prompt_lps = seq.prompt_logprobs
        seq.num_emitted_tokens = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=new_ids,
            logprobs=new_lps,
            finished=finished,
            finish_reason=seq.finish_reason,
            prompt_token_count=len(seq.prompt_token_ids),
            completion_token_count=len(seq.output_token_ids),
            prompt_logprobs=prompt_lps,
            stop_reason=seq.stop_reason,
        )
