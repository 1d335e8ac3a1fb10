"""LLMEngine: admits requests, runs scheduled steps, samples, detokenizes and reports per-request deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from envex.runtime.engine.block_manager import BlockManager
from envex.runtime.engine.config import EngineConfig
from envex.runtime.engine.detokenizer import IncrementalDetokenizer
from envex.runtime.engine.model_runner import ModelRunner
from envex.runtime.engine.sampler import logprobs_for, sample_on_device, token_logprob
from envex.runtime.engine.scheduler import ScheduledChunk, Scheduler
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.engine.types import (
    EngineError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from envex.runtime.loader import load_model_info

_MAX_DEFAULT_LEN = 32768


@dataclass(frozen=True)
class Completion:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None


@dataclass
class _Step:
    """A launched step: the chunks that sample a token, and the sampled ids (on the device until read)."""

    completing: list[ScheduledChunk]
    firsts: list[int]  # each completing chunk's first logits row (drafts follow it)
    logits: torch.Tensor
    token_ids: torch.Tensor  # [len(completing)] int64, on the device
    raw_logprobs: torch.Tensor | None
    host_ids: torch.Tensor | None = None  # pinned copy, valid once `ready` has fired
    ready: torch.cuda.Event | None = None
    errors: dict[int, str] = field(default_factory=dict)  # completing row -> why its sampling failed

    def read_ids(self) -> list[int]:
        if self.ready is None:
            return self.token_ids.tolist()
        self.ready.synchronize()  # waits for this step only; the step launched after it keeps the device busy
        assert self.host_ids is not None
        return self.host_ids.tolist()


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_hit_tokens_total: int
    preemptions_total: int
    accepted_draft_tokens_total: int = 0
    overlapped_steps_total: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        loaded = load_model_info(config.model)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_name or loaded.source.name
        self.source = loaded.source
        window = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:  # no sliding-window attention yet: serve within the window
            window = min(window, self.model_config.sliding_window)
        self.max_model_len = min(config.max_model_len or min(window, _MAX_DEFAULT_LEN), window)
        self.runner = ModelRunner(config, loaded, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens or (
                                       8192 if self.runner.device.type == "cuda" else 2048),
                                   num_speculative_tokens=self._speculative_tokens(),
                                   max_model_len=self.max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cached_tokens = 0
        self._accepted_drafts = 0
        # Overlapped scheduling: a pure decode step's sampled tokens stay on the device while the next step is
        # scheduled and launched; the host reads them afterwards (one step later), so host work hides behind
        # device work. Off while speculative decoding is on (drafts are verified against read tokens).
        cuda = self.runner.device.type == "cuda"
        overlap = cuda if config.async_scheduling is None else config.async_scheduling
        self._overlap = overlap and self.scheduler.num_speculative_tokens == 0
        self._in_flight: _Step | None = None
        self._overlapped_steps = 0
        if cuda if config.warm_up is None else config.warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """Run throwaway requests through every kind of step — a prefill chunk of the whole token budget, a step
        mixing decodes with a short prefill chunk, decode steps; odd and even lengths — so that Triton compiles its
        kernel variants now, not during the first real requests (seconds on a cold cache). Leaves the engine as
        it found it: idle, no blocks in use, nothing published to the prefix cache, counters at zero."""
        if self.has_unfinished():
            raise EngineError("warm_up needs an idle engine; wait for running requests to finish")
        vocab = self.model_config.vocab_size
        long = max(1, min(self.scheduler.max_num_batched_tokens, self.max_model_len - 4,
                          (self.blocks.num_blocks - 8) * self.blocks.block_size))
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        caching, self.blocks.enable_prefix_caching = self.blocks.enable_prefix_caching, False
        try:
            for i, n in enumerate((37, 48, long)):
                if n + params.max_tokens <= self.max_model_len:
                    self.add_request(f"warm-up-{i}", [(j * 7919 + i) % vocab for j in range(n)], params)
            while self.has_unfinished():
                self.step()
        finally:
            self.blocks.enable_prefix_caching = caching
        self._prompt_tokens = self._generation_tokens = self._cached_tokens = 0
        self._accepted_drafts = self._overlapped_steps = 0

    def _speculative_tokens(self) -> int:
        if self.config.num_speculative_tokens is not None:
            return self.config.num_speculative_tokens
        return 4 if self.runner.ops.name == "torch" else 0

    @property
    def capacity(self) -> int:
        """Requests that may be admitted at once, running or waiting; beyond it callers get QueueFullError."""
        return self.config.max_queue + self.config.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # ---- admission -----------------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the error this request would meet at admission (safe to call from any thread)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise EngineError("prompt: must contain at least one token")
        if n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has {n} prompt "
                f"tokens and asks for {params.max_tokens} more; shorten the prompt or lower max_tokens",
                max_model_len=self.max_model_len,
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineError(f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.check_request(prompt_token_ids, params)
        if request_id in self._seqs:
            raise EngineError(f"request_id: {request_id!r} is already in use")
        if len(self.scheduler.waiting) + len(self.scheduler.running) >= self.capacity:
            raise QueueFullError(
                f"the engine is at capacity ({self.capacity} requests running or waiting); retry later"
            )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop),
        )
        if params.seed is not None and not params.greedy:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- one step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs of the tokens read in it. With overlapped scheduling
        the tokens of a pure decode step are read during the next call, after that call has launched its own
        step, so outputs trail the device by one step."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not self._may_overlap():
            return self._finish(previous)  # read it first: the next step needs every token on the host
        chunks = self.scheduler.schedule()
        if not chunks:
            return self._finish(previous) if previous is not None else []
        launched = self._launch(chunks, previous)
        outputs = self._finish(previous) if previous is not None else []
        pure_decode = all(c.start >= len(c.seq.prompt_token_ids) and not c.num_draft for c in chunks)
        if self._overlap and pure_decode and not all(c.seq.is_finished for c in launched.completing):
            self._in_flight = launched  # a pure decode step: read its tokens next time
            self._overlapped_steps += 1
        else:
            outputs += self._finish(launched)
        return outputs

    def _may_overlap(self) -> bool:
        """False while any request needs the host to see every token before the next step: penalties count the
        generated tokens, logprobs and prompt logprobs are read per step."""
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            p = seq.params
            if p.logprobs is not None or p.prompt_logprobs is not None or p.presence_penalty or p.frequency_penalty:
                return False
        return True

    def _launch(self, chunks: list[ScheduledChunk], previous: _Step | None) -> _Step:
        """Run the model and sample on the device; nothing here waits for the device."""
        result = self.runner.execute(chunks, previous.token_ids if previous is not None else None)
        completing: list[ScheduledChunk] = []
        for i, c in enumerate(chunks):
            seq = c.seq
            if c.start == seq.num_cached_prefix_tokens and c.start < len(seq.prompt_token_ids):
                self._cached_tokens += seq.num_cached_prefix_tokens
                self._prompt_tokens += len(seq.prompt_token_ids)
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
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return _Step([], [], result.logits, empty, None)
        first_logits = result.logits if row == len(completing) else result.logits[firsts]
        token_ids, raw_logprobs, errors = sample_on_device(first_logits, [c.seq for c in completing],
                                                           self._generator)
        for j, c in enumerate(completing):
            c.seq.num_pending_tokens += 1
            c.seq.pending_row = j
        launched = _Step(completing, firsts, result.logits, token_ids, raw_logprobs, errors=errors)
        if token_ids.is_cuda:
            launched.host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            launched.host_ids.copy_(token_ids, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        return launched

    def _finish(self, launched: _Step) -> list[RequestOutput]:
        """Read a launched step's tokens and apply them: append, accept drafts, stop, detokenize, emit."""
        if not launched.completing:
            return []
        ids = launched.read_ids()
        seqs = [c.seq for c in launched.completing]
        lps = logprobs_for(launched.raw_logprobs, seqs, ids)
        outputs: list[RequestOutput] = []
        for j, (c, first, token_id, lp) in enumerate(zip(launched.completing, launched.firsts, ids, lps,
                                                         strict=True)):
            seq = c.seq
            seq.num_pending_tokens -= 1
            if seq.is_finished:  # stopped or aborted while this token was in flight: the token is dropped
                continue
            if j in launched.errors:  # this request's sampling failed: end it alone, the batch goes on
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                outputs.append(replace(self._output(seq), error=launched.errors[j]))
                self.scheduler.remove(seq)
                del self._seqs[seq.request_id]
                continue
            self._append_token(seq, token_id, lp)
            if c.num_draft:
                self._accept_drafts(c, launched.logits[first + 1:first + 1 + c.num_draft], token_id)
            self.blocks.commit(seq)
            outputs.append(self._output(seq))
            if seq.is_finished:
                self.scheduler.remove(seq)
                del self._seqs[seq.request_id]
        return outputs

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
            self._accepted_drafts += 1
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
        self._generation_tokens += 1
        if lp is not None:
            seq.logprobs.append(lp)
        is_eos = token_id in self.tokenizer.eos_token_ids and not p.ignore_eos
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

    def _output(self, seq: Sequence) -> RequestOutput:
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

    # ---- conveniences --------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            prefix_cache_hit_tokens_total=self._cached_tokens,
            preemptions_total=self.scheduler.num_preemptions,
            accepted_draft_tokens_total=self._accepted_drafts,
            overlapped_steps_total=self._overlapped_steps,
        )

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion, batched together; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        encoded = [self.encode_prompt(p) for p in prompts]
        for rid, toks, p in zip(ids, encoded, plist, strict=True):
            self.add_request(rid, toks, p)
        texts = {rid: "" for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        lps: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
        reasons: dict[str, str] = {}
        while len(reasons) < len(ids):
            for out in self.step():
                texts[out.request_id] += out.text
                tokens[out.request_id] += out.token_ids
                lps[out.request_id] += out.logprobs or []
                if out.finished:
                    reasons[out.request_id] = out.finish_reason or "stop"
        return [
            Completion(rid, toks, texts[rid], tokens[rid], reasons[rid], lps[rid] if p.logprobs is not None else None)
            for rid, toks, p in zip(ids, encoded, plist, strict=True)
        ]

    @torch.inference_mode()
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, [len, V] float32 (for the KL gate); needs an idle engine."""
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            self._finish(self._in_flight)  # only tokens of aborted requests were in flight
            self._in_flight = None
        if self.has_unfinished():
            raise EngineError("full_logits needs an idle engine; wait for running requests to finish")
        if not 0 < len(token_ids) <= self.max_model_len:
            raise EngineError(f"token_ids: length must be 1..{self.max_model_len}, got {len(token_ids)}")
        seq = Sequence("full-logits", list(token_ids), SamplingParams(max_tokens=1, prompt_logprobs=0), None)
        out = []
        try:
            step = self.scheduler.max_num_batched_tokens
            for start in range(0, len(token_ids), step):
                n = min(step, len(token_ids) - start)
                if not self.blocks.ensure(seq, start + n):
                    raise EngineError(f"token_ids: {len(token_ids)} tokens do not fit the KV cache")
                out.append(self.runner.execute([ScheduledChunk(seq, start, n)]).prompt_logits[0])
                seq.num_computed_tokens = start + n
        finally:
            self.blocks.free(seq)
        return torch.cat(out)
