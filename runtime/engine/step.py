"""One engine step after scheduling: launch it (model + sampling on the device, nothing waits), then finish it
(read the sampled tokens, append, accept drafts, stop, detokenize, emit).

Overlapped scheduling lives here: a pure decode step may stay launched-but-unread while the engine schedules and
launches the next one. Its sampled ids stay on the device (`LaunchedStep.token_ids`); each sequence counts the
token as pending (`Sequence.num_pending_tokens`, `pending_row`), and the next step's runner copies it into its
inputs on the device (model_runner.fill_pending). The host reads the ids later from a pinned copy behind an
event, so host work hides behind device work.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from envex.runtime.engine.block_manager import BlockManager
from envex.runtime.engine.model_runner import ModelRunner
from envex.runtime.engine.sampler import logprobs_for, sample_on_device, token_logprob
from envex.runtime.engine.scheduler import ScheduledChunk, Scheduler
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.engine.types import RequestOutput, TokenLogprob


@dataclass
class LaunchedStep:
    """A launched step: the chunks that sample a token, and the sampled ids (on the device until read)."""

    completing: list[ScheduledChunk]
    firsts: list[int]  # each completing chunk's first logits row (drafts follow it)
    logits: torch.Tensor
    token_ids: torch.Tensor  # [len(completing)] int64, on the device
    raw_logprobs: torch.Tensor | None
    pure_decode: bool = False  # one token per sequence, no drafts: the next step may launch before this is read
    host_ids: torch.Tensor | None = None  # pinned copy, valid once `ready` has fired
    ready: torch.cuda.Event | None = None
    errors: dict[int, str] = field(default_factory=dict)  # completing row -> why its sampling failed

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


class StepRunner:
    """Launches and finishes steps for the engine; owns the running requests' registry and the token counters."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, blocks: BlockManager, *, eos_token_ids,
                 max_model_len: int, generator: torch.Generator) -> None:  # fmt: skip
        self.runner = runner
        self.scheduler = scheduler
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generator = generator
        self.seqs: dict[str, Sequence] = {}
        self.counters = StepCounters()

    def launch(self, chunks: list[ScheduledChunk], previous: LaunchedStep | None) -> LaunchedStep:
        """Run the model and sample on the device; nothing here waits for the device."""
        result = self.runner.execute(chunks, previous.token_ids if previous is not None else None)
        completing: list[ScheduledChunk] = []
        for i, c in enumerate(chunks):
            seq = c.seq
            if c.start == seq.num_cached_prefix_tokens and c.start < len(seq.prompt_token_ids):
                self.counters.cached_tokens += seq.num_cached_prefix_tokens
                self.counters.prompt_tokens += len(seq.prompt_token_ids)
            seq.num_computed_tokens = c.start + c.num_tokens - c.num_draft  # drafts count once accepted
            self.blocks.commit(seq)
            if i in result.prompt_logits:
                self._record_prompt_logprobs(c, result.prompt_logits[i])
            if c.completes:
                completing.append(c)
        # Row layout: each completing chunk has 1 + num_draft rows; sample the first row of every chunk together.
        firsts, row = [], 0
        for c in completing:
            firsts.append(row)
            row += 1 + c.num_draft
        if not completing:
            empty = torch.zeros(0, dtype=torch.int64, device=self.runner.device)
            return LaunchedStep([], [], result.logits, empty, None)
        first_logits = result.logits if row == len(completing) else result.logits[firsts]
        token_ids, raw_logprobs, errors = sample_on_device(first_logits, [c.seq for c in completing], self.generator)
        for j, c in enumerate(completing):
            c.seq.num_pending_tokens += 1
            c.seq.pending_row = j
        pure_decode = all(c.start >= len(c.seq.prompt_token_ids) and not c.num_draft for c in chunks)
        launched = LaunchedStep(completing, firsts, result.logits, token_ids, raw_logprobs, pure_decode,
                                errors=errors)  # fmt: skip
        if token_ids.is_cuda:
            launched.host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            launched.host_ids.copy_(token_ids, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        return launched

    def finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens and apply them: append, accept drafts, stop, detokenize, emit."""
        if not launched.completing:
            return []
        ids = launched.read_ids()
        seqs = [c.seq for c in launched.completing]
        lps = logprobs_for(launched.raw_logprobs, seqs, ids)
        outputs: list[RequestOutput] = []
        for j, (c, first, token_id, lp) in enumerate(zip(launched.completing, launched.firsts, ids, lps,
                                                         strict=True)):  # fmt: skip
            seq = c.seq
            seq.num_pending_tokens -= 1
            if seq.is_finished:  # stopped or aborted while this token was in flight: the token is dropped
                continue
            if j in launched.errors:  # this request's sampling failed: end it alone, the batch goes on
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                outputs.append(replace(self.output(seq), error=launched.errors[j]))
                self.retire(seq)
                continue
            self._append_token(seq, token_id, lp)
            if c.num_draft:
                self._accept_drafts(c, launched.logits[first + 1:first + 1 + c.num_draft], token_id)
            self.blocks.commit(seq)
            outputs.append(self.output(seq))
            if seq.is_finished:
                self.retire(seq)
        return outputs

    def retire(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        del self.seqs[seq.request_id]

    def _accept_drafts(self, c: ScheduledChunk, draft_logits: torch.Tensor, first_token: int) -> None:
        """Keep drafted tokens while each equals the greedy token the model chose before it (exactly what plain
        decoding would have produced), then append the model's token after the last kept draft."""
        seq = c.seq
        drafts = seq.draft_token_ids
        seq.draft_token_ids = []
        choices = draft_logits.argmax(dim=-1).tolist()  # choices[j]: the model's token after drafts[j]
        previous = first_token
        for j, draft in enumerate(drafts):
            if seq.is_finished or previous != draft:
                break
            seq.num_computed_tokens += 1  # the draft's K/V, written this step, is now the real token's
            self.counters.accepted_drafts += 1
            previous = choices[j]
            self._append_token(seq, previous, None)
        self.blocks.commit(seq)

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
