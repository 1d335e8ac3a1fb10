"""Drafters for speculative decoding: who proposes the tokens a verify step checks (decoder.py verifies them).

A drafter proposes up to k tokens per sequence, on the device, from the sequences' token histories (a device
buffer, `SpecInputs.hist`) and writes them into the step's static draft buffer; everything it does is static
shapes and no host sync, so it can be captured in a CUDA graph. Two ship:

- `NgramDrafter`: prompt lookup (Saxena's "prompt lookup decoding", vLLM's n-gram proposer): find the latest
  earlier occurrence of the sequence's last n tokens (n = 3, 2, 1, longest first) within the last `window` tokens
  and propose the k tokens that followed it. Costs no model; pays on text that repeats its context (code edits,
  extraction). Runs inside the verify graph. `NgramIndex` is the same rule on the host, incremental (a dict per
  n), which the depth controller uses to see what the drafter would have accepted while speculation is off.
- `DraftModelDrafter`: a smaller model with the same tokenizer drafts k tokens greedily in its own CUDA graph,
  with its own KV cache addressed by the target's block tables (same blocks, same slots: no second allocator).

`MtpDrafter` (mtp.py) drafts with DeepSeek-V3's multi-token-prediction module from the target's hidden states,
which `wants_hidden` asks for; an EAGLE-style head would too (offline_docs/engine.md has EAGLE-3's layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from envex.kernels.ops import AttentionMetadata
from envex.kernels.reference import NGRAM_MAX, NGRAM_WINDOW, ngram_propose
from envex.runtime.engine.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from envex.runtime.engine.sequence import Sequence


@dataclass
class SpecInputs:
    """The device buffers one (batch, K) verify step reads and writes (a CUDA graph holds them by address).

    Row b of the batch is the sequence whose history is hist[rows[b]]; it has lens[rows[b]] tokens, the newest
    not yet in the KV cache. Padding rows have k_limit -1 and write nothing.
    """

    hist: torch.Tensor  # int64 [S + 1, L] every speculating sequence's tokens (row S: padding)
    lens: torch.Tensor  # int64 [S + 1] tokens in each row of hist
    rows: torch.Tensor  # int64 [B] row of hist per batch row
    k_limit: torch.Tensor  # int64 [B] drafts allowed per row (0..K; -1: padding row)
    block_tables: torch.Tensor  # int32 [B, W] the target's (and a draft model's) block tables
    drafts: torch.Tensor  # int64 [B, K] written by the drafter
    num_drafts: torch.Tensor  # int64 [B] written by the drafter: proposed tokens per row (<= k_limit)
    seq_lens: torch.Tensor = field(init=False)  # int64 [B] lens[rows], gathered once per step

    def __post_init__(self) -> None:
        self.seq_lens = torch.zeros_like(self.rows)

    @property
    def batch(self) -> int:
        return self.rows.shape[0]

    @property
    def k(self) -> int:
        return self.drafts.shape[1]


class Drafter(Protocol):
    """Proposes tokens for a verify step. `propose` must be graph-safe: static shapes, no host reads."""

    name: str
    in_verify_graph: bool  # True: propose() is captured in the verify graph; False: in a graph of its own
    wants_hidden: bool  # True: needs the target's hidden states (MTP): `record` after a verify, `absorb` eagerly

    def propose(self, x: SpecInputs) -> None:
        """Write x.drafts[:, :k] and x.num_drafts (<= max(x.k_limit, 0)) for every row, from x.hist / x.seq_lens."""
        ...

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Host side, before a step whose sequences' device state was rebuilt: bring any drafter state (a draft
        model's KV cache) up to each sequence's known tokens. Nothing for a stateless drafter."""
        ...


# ---- n-gram prompt lookup --------------------------------------------------------------------------------------


class NgramIndex:
    """kernels/reference.py's propose_ngram, incrementally: for each n, the latest start of every n-gram that has a
    token after it. Appending a token is a few dict writes; a proposal is a few dict reads (the reference rule scans
    the window)."""

    def __init__(self, *, max_ngram: int = NGRAM_MAX, window: int = NGRAM_WINDOW) -> None:
        self.max_ngram = max_ngram
        self.window = window
        self.tokens: list[int] = []
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        toks = self.tokens
        end = len(toks)  # the new token sits at `end`: n-grams ending just before it now have a continuation
        for n in range(1, self.max_ngram + 1):
            if end - n >= 0:
                self._latest[n][tuple(toks[end - n:end])] = end - n
        toks.append(token)

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        size = len(toks)
        lo = max(0, size - self.window)
        for n in range(min(self.max_ngram, size - 1), 0, -1):
            start = self._latest[n].get(tuple(toks[size - n:]))
            if start is not None and start >= lo:
                return toks[start + n:start + n + k]
        return []


class NgramDrafter:
    name = "ngram"
    in_verify_graph = True
    wants_hidden = False

    def __init__(self, *, max_ngram: int = NGRAM_MAX, window: int = NGRAM_WINDOW) -> None:
        self.max_ngram = max_ngram
        self.window = window

    def propose(self, x: SpecInputs) -> None:
        if x.hist.is_cuda:  # one Triton launch instead of ~30 small ops (0.16 ms per step at batch 1 on the H200),
            # writing the step's buffers with the k_limit cap applied (no copies after it)
            from envex.kernels import ngram  # Triton: only where the tensors are on a GPU
            ngram.ngram_propose(x.hist, x.rows, x.seq_lens, x.k, max_ngram=self.max_ngram, window=self.window,
                                limit=x.k_limit, out=(x.drafts, x.num_drafts))  # fmt: skip
            return
        drafts, count = ngram_propose(x.hist, x.rows, x.seq_lens, x.k, max_ngram=self.max_ngram, window=self.window)
        x.drafts.copy_(drafts)
        x.num_drafts.copy_(torch.minimum(count, x.k_limit.clamp(min=0)))

    def catch_up(self, seqs: list[Sequence]) -> None:
        return None

    def shadow_index(self) -> NgramIndex:
        """The host's incremental form of this drafter's rule (the depth controller's view while speculation is off)."""
        return NgramIndex(max_ngram=self.max_ngram, window=self.window)


# ---- draft model -----------------------------------------------------------------------------------------------


class DraftModelDrafter:
    """A smaller model of the same tokenizer drafts k tokens greedily (a one-hot proposal, so acceptance is exact
    for sampled requests too: decoder.rejection_sample). It has its own ModelRunner (weights and KV cache) whose cache
    has the target's number of blocks, addressed by the target's block tables.

    Per step, in its own graph: pass 1 feeds each sequence's last two tokens (positions len-2, len-1; the first
    re-writes a K/V it may already hold, which covers the step after all drafts were accepted, whose last draft
    was never fed), then k-1 single-token passes feed its own drafts. Rejected drafts' K/V lie beyond the
    sequence's length and are rewritten later. Where the draft cache has gaps (tokens decoded while speculation
    was off, a prefix found in the cache), `catch_up` runs the draft model over them; a gap it missed would only
    lower acceptance, never change an answer: the target verifies every token.
    """

    name = "draft_model"
    in_verify_graph = False
    wants_hidden = False

    def __init__(self, runner, *, max_num_batched_tokens: int) -> None:  # runner: ModelRunner of the draft
        self.runner = runner
        self.max_model_len = runner.max_model_len
        self.block_size = runner.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_splits: dict[tuple[int, int], int | None] = {}  # (batch, q_len) -> fixed split count in graphs

    def _meta(self, positions: torch.Tensor, slots: torch.Tensor, x: SpecInputs, q_len: int,
              seq_lens: torch.Tensor | None) -> AttentionMetadata:  # fmt: skip
        b = x.batch
        return AttentionMetadata(
            positions=positions, slot_mapping=slots,
            cu_seqlens_q=torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=positions.device),
            block_tables=x.block_tables, cos=self.runner.cos, sin=self.runner.sin, max_q_len=q_len,
            max_seq_len=self.max_model_len + x.k + 1, seq_lens=seq_lens, num_splits=self.num_splits.get((b, q_len)),
        )  # fmt: skip

    def _slots(self, x: SpecInputs, positions: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        blocks = x.block_tables.gather(1, (positions // bs).to(torch.int64)).to(torch.int64)
        return torch.where(write, blocks * bs + positions % bs, -1)

    def propose(self, x: SpecInputs) -> None:
        runner = self.runner
        active = x.k_limit >= 0  # [B]
        last = self.max_model_len - 1
        # Pass 1: tokens len-2 and len-1 of every sequence.
        pos = (x.seq_lens[:, None] - 2 + torch.arange(2, device=x.rows.device)[None, :]).clamp(0, last)  # [B, 2]
        ids = x.hist.reshape(-1)[(x.rows * x.hist.shape[1])[:, None] + pos]  # [B, 2]
        slots = self._slots(x, pos, active[:, None].expand(-1, 2))
        meta = self._meta(pos.reshape(-1), slots.reshape(-1), x, 2, (pos[:, 1] + 1).to(torch.int32))
        logits = runner.forward_logits(ids.reshape(-1), meta).view(x.batch, 2, -1)[:, 1]  # [B, V]
        token = logits.argmax(dim=-1)
        x.drafts[:, 0] = token
        for i in range(1, x.k):  # draft i+1 from draft i at position len - 1 + i
            pos1 = (x.seq_lens - 1 + i).clamp(max=last)  # [B]
            write = active & (i < x.k_limit) & (x.seq_lens - 1 + i <= last)
            meta = self._meta(pos1, self._slots(x, pos1[:, None], write[:, None])[:, 0], x, 1, None)
            token = runner.forward_logits(token, meta).argmax(dim=-1)
            x.drafts[:, i] = token
        x.num_drafts.copy_(x.k_limit.clamp(min=0))

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Run the draft model over each sequence's tokens it has not seen (all but the last two, which the next
        step's pass 1 feeds), in chunks of the token budget, eagerly."""
        chunks: list[ScheduledChunk] = []
        budget = self.max_num_batched_tokens
        for seq in seqs:
            state = seq.spec
            assert state is not None
            end = seq.num_known_tokens - 2
            while state.draft_valid < end:
                n = min(end - state.draft_valid, budget)
                chunks.append(ScheduledChunk(seq, state.draft_valid, n))
                state.draft_valid += n
                budget -= n
                if budget == 0:
                    self.runner.execute(chunks)
                    chunks, budget = [], self.max_num_batched_tokens
        if chunks:
            self.runner.execute(chunks)
