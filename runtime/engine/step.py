"""One engine step after scheduling: launch it (model + sampling on the device, nothing waits), then finish it
(read the sampled tokens, append, stop, detokenize, emit).

Overlapped scheduling lives here: a pure decode step may stay launched-but-unread while the engine schedules and
launches the next one. Its sampled ids stay on the device (`LaunchedStep.result`); each sequence counts the
token as pending (`Sequence.num_pending_tokens`, `pending_row`), and the next step's runner copies it into its
inputs on the device (model_runner.fill_pending). The host reads the ids later from a pinned copy behind an
event, so host work hides behind device work.

Speculative decoding (spec/) plugs in through one hook, `StepHook`: it may take a step of decodes over as a
verify step, chain verify steps from the device's state, and read them; its steps are `LaunchedStep`s too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from envex.runtime.engine.block_manager import BlockManager
from envex.runtime.engine.model_runner import ModelRunner
from envex.runtime.engine.sampler import logprobs_for, sample_on_device, token_logprob
from envex.runtime.engine.scheduler import ScheduledChunk, Scheduler
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.engine.types import RequestOutput, TokenLogprob


@dataclass
class LaunchedStep:
    """A launched step, decode or verify: its sequences and what it sampled for them, on the device until read.

    A decode step samples one token per sequence: result [B] int64. A verify step (spec/) appends 1..k+1 tokens
    per sequence: result [B, K+3] int64 (the K+1 tokens, the accepted drafts, the proposed drafts), and `ks`
    holds the drafts each sequence was allowed."""

    seqs: list[Sequence]
    result: torch.Tensor
    raw_logprobs: torch.Tensor | None = None
    errors: dict[int, str] = field(default_factory=dict)  # row -> why its sampling failed
    may_overlap: bool = False  # the next step may be launched before this one is read
    ks: list[int] | None = None  # a verify step's draft depths (None: a decode step)
    host: torch.Tensor | None = None  # pinned copy of result, valid once `ready` has fired
    ready: torch.cuda.Event | None = None

    @property
    def is_verify(self) -> bool:
        return self.ks is not None

    def copy_to_host(self) -> LaunchedStep:
        """Start the copy of result into pinned host memory behind an event (on CUDA; elsewhere read directly)."""
        if self.result.is_cuda:
            self.host = torch.empty(self.result.shape, dtype=self.result.dtype, pin_memory=True)
            self.host.copy_(self.result, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        return self

    def read(self) -> list:
        if self.ready is None:
            return self.result.tolist()
        self.ready.synchronize()  # waits for this step only; the step launched after it keeps the device busy
        assert self.host is not None
        return self.host.tolist()


class StepHook(Protocol):
    """Speculative decoding as the step loop sees it (spec/decoder.py, SpecDecoder)."""

    def launch_verify(self, chunks: list[ScheduledChunk], steps: StepRunner) -> LaunchedStep | None:
        """A verify step in place of this step of decodes, or None: run it plainly."""
        ...

    def chain(self, previous: LaunchedStep, steps: StepRunner) -> LaunchedStep | None:
        """The successor of a verify step in flight, launched from the device's state; None: read it first."""
        ...

    def wants(self, steps: StepRunner) -> bool:
        """Whether the running batch would speculate now (a plain step in flight is then read first)."""
        ...

    def finish_verify(self, launched: LaunchedStep, steps: StepRunner) -> list[RequestOutput]:
        """Read a verify step and apply it (StepRunner.finish for a decode step)."""
        ...

    def on_decoded(self, seq: Sequence, token: int, batch: int) -> None:
        """A token a plain step of `batch` sequences decoded for seq (before it is appended)."""
        ...

    def release(self, seq: Sequence) -> None:
        """seq has left the engine."""
        ...


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
                 max_model_len: int, generator: torch.Generator, spec: StepHook | None = None) -> None:  # fmt: skip
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
        """Run the model and sample on the device; nothing here waits for the device. previous: a decode step in
        flight whose sampled ids this step's pending tokens read."""
        if self.spec is not None and previous is None:
            verify = self.spec.launch_verify(chunks, self)
            if verify is not None:
                return verify
        result = self.runner.execute(chunks, previous.result if previous is not None else None)
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
        seqs = [c.seq for c in completing]
        if not completing:
            return LaunchedStep([], torch.zeros(0, dtype=torch.int64, device=self.runner.device))
        token_ids, raw_logprobs, errors = sample_on_device(result.logits, seqs, self.generator)
        for j, seq in enumerate(seqs):
            seq.num_pending_tokens += 1
            seq.pending_row = j
        pure_decode = all(c.start >= len(c.seq.prompt_token_ids) for c in chunks)
        return LaunchedStep(seqs, token_ids, raw_logprobs, errors, may_overlap=pure_decode).copy_to_host()

    # ---- reading steps ------------------------------------------------------------------------------------------

    def finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens and apply them: append, stop, detokenize, emit."""
        if launched.is_verify:
            assert self.spec is not None
            return self.spec.finish_verify(launched, self)
        if not launched.seqs:
            return []
        ids = launched.read()
        seqs = launched.seqs
        lps = logprobs_for(launched.raw_logprobs, seqs, ids)
        outputs: list[RequestOutput] = []
        for j, (seq, token_id, lp) in enumerate(zip(seqs, ids, lps, strict=True)):
            seq.num_pending_tokens -= 1
            if seq.is_finished:  # stopped or aborted while this token was in flight: the token is dropped
                continue
            if j in launched.errors:  # this request's sampling failed: end it alone, the batch goes on
                outputs.append(self.fail(seq, launched.errors[j]))
                continue
            if self.spec is not None:
                self.spec.on_decoded(seq, token_id, len(seqs))
            self.append_token(seq, token_id, lp)
            self.blocks.commit(seq)
            outputs.append(self.output(seq))
            if seq.is_finished:
                self.retire(seq)
        return outputs

    def fail(self, seq: Sequence, error: str) -> RequestOutput:
        """End one request whose sampling failed (the batch goes on): its last output, with the error."""
        seq.status, seq.finish_reason = Status.FINISHED, "error"
        out = replace(self.output(seq), error=error)
        self.retire(seq)
        return out

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

    def append_token(self, seq: Sequence, token_id: int, lp: TokenLogprob | None) -> None:
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
