"""Continuous batching with chunked prefill and preemption.

Every step: running sequences first (one token each when decoding, or their next prompt chunk), then waiting
ones while the token budget, the sequence limit and free blocks allow. When blocks run out, the most recently
admitted sequence is preempted: its blocks are freed and it waits again, to be recomputed (prefix reuse makes
that cheap when its blocks have not been overwritten).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from envex.runtime.engine.block_manager import BlockManager
from envex.runtime.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token index (== position) computed in this step
    num_tokens: int

    num_draft: int = 0  # speculative tokens at the end of the chunk (seq.draft_token_ids), verified this step

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so the step samples its next token."""
        return self.start + self.num_tokens == self.seq.num_tokens + self.num_draft


def propose_ngram(tokens: list[int], k: int, *, max_ngram: int = 3, window: int = 2048) -> list[int]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first) and propose the k tokens that followed it. Costs no model; pays off on text that repeats its context
    (code edits, extraction, summaries), and costs one wider forward pass where it does not."""
    n_tokens = len(tokens)
    lo = max(0, n_tokens - window)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        pattern = tokens[n_tokens - n:]
        for i in range(n_tokens - n - 1, lo - 1, -1):
            if tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 num_speculative_tokens: int = 0, max_model_len: int | None = None) -> None:
        self.blocks = block_manager
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Speculative tokens for a decoding sequence: only greedy requests without penalties or logprobs, so
        that accepting a draft token can never change the answer."""
        p = seq.params
        if (self.num_speculative_tokens == 0 or not p.greedy or p.logprobs is not None
                or p.presence_penalty or p.frequency_penalty):
            return []
        k = min(self.num_speculative_tokens, budget, p.max_tokens - len(seq.output_token_ids) - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        return propose_ngram(seq.all_token_ids, k) if k > 0 else []

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            if seq.awaits_final_token or (seq.num_pending_tokens and self.max_model_len is not None
                                          and seq.num_tokens >= self.max_model_len):
                continue  # its in-flight token is its last: it finishes when the engine reads that token
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = self._draft(seq, budget - n) if n == 1 else []
            n += len(draft)
            while not self.blocks.ensure(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is Status.WAITING:
                continue
            seq.draft_token_ids = draft
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, len(draft)))
            budget -= n
        # Admit new work only when nothing had to be preempted: otherwise we would thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.ensure(seq, seq.num_computed_tokens + n):
                # No room now; the engine guarantees one whole sequence always fits, so running ones will free some.
                self.blocks.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return chunks
