"""LLMEngine: admits requests and runs steps: schedule -> launch -> finish (step.py), with per-request deltas out.

The engine builds the plain model runner; speculative decoding (spec/), when configured, wraps it and joins the
step loop through one hook (step.StepHook)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from envex.runtime.detokenizer import IncrementalDetokenizer
from envex.runtime.engine.accel.warm_up import warm_up_steps
from envex.runtime.engine.block_manager import BlockManager
from envex.runtime.engine.config import EngineConfig, model_window
from envex.runtime.engine.model_runner import ModelRunner
from envex.runtime.engine.scheduler import ScheduledChunk, Scheduler
from envex.runtime.engine.sequence import Sequence, Status
from envex.runtime.engine.spec import SpecDecoder, build_speculation, draft_kv_bytes, load_draft
from envex.runtime.engine.step import LaunchedStep, StepRunner
from envex.runtime.engine.types import (
    EngineError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from envex.runtime.loader import load_model_info
from envex.runtime.parallel.state import check_tensor_parallel
from envex.runtime.parallel.workers import Workers


@dataclass(frozen=True)
class Completion:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None


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
    # Speculative decoding: the drafter ("" when off), its largest depth, verify steps read, the tokens they
    # appended per sequence and step (1 + accepted drafts), drafts proposed, the depth of the last verify step.
    speculative_drafter: str = ""
    speculative_max_k: int = 0
    spec_verify_steps_total: int = 0
    spec_tokens_per_step: float = 0.0
    spec_draft_tokens_total: int = 0
    spec_depth: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        loaded = load_model_info((config or EngineConfig()).model)
        # The one place where defaults become settings: everything below reads self.config only.
        self.config = config = (config or EngineConfig()).resolved(window=model_window(loaded.config),
                                                                   cuda_available=torch.cuda.is_available(),
                                                                   gpus=torch.cuda.device_count(),
                                                                   architecture=loaded.config.architecture)  # fmt: skip
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_name or loaded.source.name
        self.source = loaded.source
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.max_model_len = config.max_model_len
        # Tensor parallelism: this process is rank 0 (schedules, samples); workers hold the other shards.
        self.workers: Workers | None = None
        if config.tensor_parallel > 1:
            check_tensor_parallel(loaded.config, config.tensor_parallel)
            self.workers = Workers(config, config.tensor_parallel)
        parallel = self.workers.state if self.workers is not None else None
        # The plain runner; a draft model's KV cache takes its share of the same memory budget (spec/).
        draft = load_draft(config, loaded)
        self.runner = ModelRunner(config, loaded, parallel=parallel,
                                  extra_kv_bytes_per_block=draft_kv_bytes(config, draft))  # fmt: skip
        self.spec: SpecDecoder | None = (build_speculation(config, self.runner, draft)
                                         if config.num_speculative_tokens else None)  # fmt: skip
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size,
                                   enable_prefix_caching=config.enable_prefix_caching  # off: window_kv.py
                                   and (self.runner.windows is None or self.runner.windows.prefix_caching),
                                   # a prefix hit restores a state snapshot (state_slots.py)
                                   prefix_limit=self.runner.states.limit_prefix if self.runner.states else None)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len)  # fmt: skip
        self.steps = StepRunner(self.runner, self.scheduler, self.blocks, eos_token_ids=self.tokenizer.eos_token_ids,
                                max_model_len=self.max_model_len,
                                generator=torch.Generator(device=self.runner.device).manual_seed(config.seed),
                                spec=self.spec)
        self._in_flight: LaunchedStep | None = None  # a decode or verify step launched and not yet read (overlap)
        if config.warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """Compile now every Triton kernel variant a served step can meet, not during the first real requests
        (seconds on a cold cache; on a host without a C compiler, an error): throwaway requests through every kind
        of step (a prefill chunk of the whole token budget, decodes mixed with a short chunk, decode steps), then,
        on the Triton backend, the steps of warm_up.warm_up_steps, which take every per-step kernel choice
        through each of its values. Leaves the engine as it found it: idle, no blocks in use, nothing published to
        the prefix cache, counters at zero."""
        if self.has_unfinished():
            raise EngineError("warm_up needs an idle engine; wait for running requests to finish")
        vocab = self.model_config.vocab_size
        long = max(1, min(self.scheduler.max_num_batched_tokens, self.max_model_len - 4,
                          (self.blocks.num_blocks - 8) * self.blocks.block_size))  # fmt: skip
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        caching, self.blocks.enable_prefix_caching = self.blocks.enable_prefix_caching, False
        try:
            for i, n in enumerate((37, 48, long)):
                if n + params.max_tokens <= self.max_model_len:
                    self.add_request(f"warm-up-{i}", [(j * 7919 + i) % vocab for j in range(n)], params)
            while self.has_unfinished():
                self.step()
            self._warm_up_variants()
        finally:
            self.blocks.enable_prefix_caching = caching
        self.steps.counters = type(self.steps.counters)()

    def _warm_up_variants(self) -> None:
        """Run the steps of warm_up.warm_up_steps straight through the model runners (the target's and a draft
        model's), on throwaway sequences whose earlier keys are whatever the blocks hold: only the launches count."""
        runners = [self.runner]
        draft = getattr(self.spec.drafter, "runner", None) if self.spec is not None else None
        if draft is not None and draft is not self.runner:  # an MTP drafter runs on the target's runner
            runners.append(draft)
        if not any(getattr(r.ops, "name", "") == "triton" for r in runners):
            return  # the torch ops compile nothing
        vocab = self.model_config.vocab_size
        max_len = min(self.max_model_len, self.blocks.num_free_blocks * self.blocks.block_size)
        from envex.kernels.attention import choose_num_splits  # Triton: the ops are Triton's

        # The KV heads attention sees (the model's, or one tensor-parallel rank's share, split or replicated) and
        # the layers' windows; the keys a split count is chosen from, as the launchers take them: a full layer's
        # sequence length, a window layer's window (decode) or window + query (paged_attention).
        tp = self.config.tensor_parallel
        heads = sorted({h for r in runners for kv in [r.model_config.num_key_value_heads]
                        for h in (kv, max(1, kv // tp), -(-kv // tp))})  # fmt: skip
        # (None stands for the full layers; a model without windows lists none at all.)
        windows = sorted({None, *(w for r in runners for w in r.model_config.layer_windows)}, key=lambda w: w or 0)

        def split_counts(batch: int, q: int, n: int) -> tuple[int, ...]:
            keys = [n if w is None else min(n, w + (q if q > 1 else 0)) for w in windows]
            return tuple(choose_num_splits(batch, h, k, self.device) for h in heads for k in keys)

        plan = warm_up_steps(max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
                             max_num_seqs=self.config.max_num_seqs, max_len=max_len,
                             split_counts=split_counts)  # fmt: skip
        for s, step in enumerate(plan):
            params = SamplingParams(max_tokens=1, prompt_logprobs=0 if step.prompt_logits else None)
            seqs = [Sequence(f"warm-up-{s}-{i}", [(j * 7919 + i) % vocab for j in range(n)], params, None)
                    for i, (_, n) in enumerate(step.chunks)]  # fmt: skip
            try:
                if all(self.blocks.ensure(seq, n) for seq, (_, n) in zip(seqs, step.chunks, strict=True)):
                    chunks = [ScheduledChunk(seq, n - q, q) for seq, (q, n) in zip(seqs, step.chunks, strict=True)]
                    for runner in runners:
                        runner.execute(chunks)
            finally:
                for seq in seqs:
                    self.blocks.free(seq)
        for runner in runners:
            if runner.windows is not None:
                runner.windows.before_step([])  # releases the window blocks of the freed sequences

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done at exit); the engine cannot step afterwards."""
        if self.workers is not None:
            self.workers.stop()

    @property
    def capacity(self) -> int:
        """Requests that may be admitted at once, running or waiting; beyond it callers get QueueFullError."""
        return self.config.max_queue + self.config.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # ---- admission: the one place a request is judged ----------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, in_flight: int = 0) -> None:
        """Raise the error this request would meet at admission, with `in_flight` requests already admitted by the
        caller's count (safe to call from any thread: reads only settings)."""
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
        if in_flight >= self.capacity:
            raise QueueFullError(f"the server is at capacity ({self.capacity} requests running or waiting); "
                                 "retry later")  # fmt: skip

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.check_request(prompt_token_ids, params, in_flight=len(self.steps.seqs))
        if request_id in self.steps.seqs:
            raise EngineError(f"request_id: {request_id!r} is already in use")
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
        self.steps.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.steps.seqs.get(request_id)
        if seq is None:
            return None
        self.steps.retire(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
        return self.steps.output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- one step: schedule -> launch -> finish --------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs of the tokens read in it. With overlapped scheduling
        the tokens of a decode or verify step are read during the next call, after that call has launched its
        own step, so outputs trail the device by one step."""
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if previous is not None and previous.is_verify:
            # A verify step in flight: its successor can be launched from the device's state while the batch is
            # steady; otherwise it is read first and the scheduler plans from known tokens (spec/decoder.py).
            assert self.spec is not None
            chained = self.spec.chain(previous, self.steps)
            outputs = self.steps.finish(previous)
            if chained is not None:
                return outputs + self._hold_or_finish(chained)
            previous = None
        elif previous is not None and not self._may_overlap():
            return self.steps.finish(previous)  # read it first: the next step needs every token on the host
        elif previous is not None and self.spec is not None and self.spec.wants(self.steps):
            outputs, previous = self.steps.finish(previous), None  # drafting needs every token on the device
        chunks = self.scheduler.schedule()
        launched = self.steps.launch(chunks, previous) if chunks else None
        if previous is not None:
            outputs += self.steps.finish(previous)
        if launched is None:
            return outputs
        return outputs + self._hold_or_finish(launched)

    def _hold_or_finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Keep a decode or verify step in flight (read next time) under overlapped scheduling, else read it."""
        if (self.config.async_scheduling and launched.may_overlap
                and not all(seq.is_finished for seq in launched.seqs)):  # fmt: skip
            self._in_flight = launched
            self.steps.counters.overlapped_steps += 1
            return []
        return self.steps.finish(launched)

    def _may_overlap(self) -> bool:
        """False while any request needs the host to see every token before the next step: penalties count the
        generated tokens, logprobs and prompt logprobs are read per step."""
        for seq in self.steps.seqs.values():
            p = seq.params
            if p.logprobs is not None or p.prompt_logprobs is not None or p.presence_penalty or p.frequency_penalty:
                return False
        return True

    # ---- conveniences --------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        c = self.steps.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens,
            prefix_cache_hit_tokens_total=c.cached_tokens,
            preemptions_total=self.scheduler.num_preemptions,
            accepted_draft_tokens_total=c.accepted_drafts,
            overlapped_steps_total=c.overlapped_steps,
            speculative_drafter=self.spec.drafter.name if self.spec is not None else "",
            speculative_max_k=self.config.num_speculative_tokens,
            spec_verify_steps_total=c.spec_steps,
            spec_tokens_per_step=c.spec_tokens / c.spec_sequence_steps if c.spec_sequence_steps else 0.0,
            spec_draft_tokens_total=c.draft_tokens,
            spec_depth=c.spec_depth,
        )

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[Completion]:  # fmt: skip
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
            self.steps.finish(self._in_flight)  # only tokens of aborted requests were in flight
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
