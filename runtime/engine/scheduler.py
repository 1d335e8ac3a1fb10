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

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so the step samples its next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None) -> None:
        self.blocks = block_manager
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
        if seq.spec is not None:  # a draft model's K/V went with the blocks
            seq.spec.draft_valid = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

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
            while not self.blocks.ensure(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is Status.WAITING:
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
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
