"""Per-sequence state slots for models with recurrent layers (Qwen3-Next's Gated DeltaNet; offline_docs/hybrid.md).

A recurrent layer keeps a fixed-size state per sequence (the delta rule's matrix, the convolution's last inputs)
instead of K/V pages. The model allocates one pool per such layer (`make_state_pools`) before the KV cache takes
its share of memory: `max_num_seqs` live slots, then as many snapshot slots, then one scratch slot that no sequence
holds: the padding rows of a CUDA-graph decode step (and every row of its capture) read and write there, so they
touch no live or snapshot state; then, with speculative decoding, K + 1 verify slots per row of the largest verify
batch (`verify_slots`). This class hands each running sequence one live slot for its whole life and tells
the layers, each step, which slot each sequence reads and whether that slot already holds its state
(`AttentionMetadata.state_slots`, `state_initialized`), or a decode graph the same as host lists (`decode_inputs`).

The state after token n is only right if it was built from tokens 0..n-1 of this sequence, in order, exactly once:
- a chunk starting at position 0 starts from zeros (a new sequence, or one preempted and recomputed: preemption
  frees its blocks and restarts it at 0, so recompute is correct with no swap);
- a chunk starting at p > 0 continues the slot only if the slot's state covers exactly p tokens; anything else
  would read a stale state, and raises instead (the known failure of hybrid serving);
- a prefix-cache hit of p tokens is allowed only where a snapshot of the state after exactly those p tokens is kept
  (`limit_prefix`, the block manager's prefix_limit); the snapshot is copied into the sequence's slot before its
  first chunk. Snapshots are keyed by the block manager's chained hash of the prefix's last block, so a key names
  one token prefix, whatever became of its blocks. One is taken per prompt, after its last full block (the longest
  hit an equal prompt, or a later turn that extends it, can have), by the prefill kernels as they pass it
  (`state_snapshots`); least recently used ones are overwritten first;
- a verify step (speculative decoding: the newest token and K drafts per sequence) runs the decode kernels token
  after token from the live slot with a snapshot after every token, into that row's K + 1 verify slots; once the
  drafts are judged on the device, the snapshot after the last accepted token is copied back into the live slot
  (`commit`), so no rejected token stays in the state, and the host counts the tokens it holds when it reads the
  step (`verified`).
Slots are released when the engine frees a sequence's blocks (finished, aborted, preempted), seen at the next step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import torch

from envex.kernels.ops import AttentionMetadata
from envex.runtime.engine.config import EngineConfig
from envex.runtime.engine.device import upload
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.engine.sequence import Sequence, Status


def verify_slots(num_speculative_tokens: int, speculative_max_batch: int | None, max_num_seqs: int) -> int:
    """The state slots verify steps write their per-token snapshots into: K + 1 for each row of the largest verify
    batch (speculative_max_batch, at most max_num_seqs; unset: max_num_seqs), none without speculative decoding."""
    batch = min(speculative_max_batch or max_num_seqs, max_num_seqs)
    return batch * (num_speculative_tokens + 1) if num_speculative_tokens else 0


def has_state(model: torch.nn.Module) -> bool:
    """Whether the model keeps per-sequence state (it then allocates its pools with make_state_pools)."""
    return hasattr(model, "make_state_pools")


class StateSlots:
    """The state pools of a model's recurrent layers, which live slot each running sequence holds, and the prefix
    snapshots."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.num_slots = config.max_num_seqs
        self.num_snapshots = config.max_num_seqs if config.enable_prefix_caching else 0
        self.block_size = config.block_size
        self.device = device
        self.scratch_slot = self.num_slots + self.num_snapshots  # padding rows of a decode graph: held by no sequence
        self.verify_base = self.scratch_slot + 1  # row b of a verify batch: slots verify_base + b (K + 1) + j
        self.total_slots = self.verify_base + verify_slots(config.num_speculative_tokens, config.speculative_max_batch,
                                                           config.max_num_seqs)  # fmt: skip
        self.bytes_per_slot = model.state_bytes_per_slot(dtype)  # one sequence's state over all recurrent layers
        self.pools: dict[int, tuple[torch.Tensor, ...]] = model.make_state_pools(self.total_slots, dtype, device)
        self._free = list(range(self.num_slots - 1, -1, -1))  # a stack: the lowest ids are reused first
        self._slot: dict[Sequence, int] = {}
        self._covered: dict[Sequence, int] = {}  # tokens the slot's state holds, once this step's chunks are done
        # prefix snapshots: chained hash of the prefix's last block -> snapshot slot, least recently used first
        self._snapshots: OrderedDict[int, int] = OrderedDict()
        self._free_snapshots = list(range(self.num_slots + self.num_snapshots - 1, self.num_slots - 1, -1))
        self._restore: dict[Sequence, tuple[int, int]] = {}  # admitted with a hit: (tokens, its snapshot's key)
        self._take: dict[Sequence, list[tuple[int, int]]] = {}  # snapshots to take: (after how many tokens, key)
        # this step's (slots, initialized, snapshot table or None) on the host: uploaded by attach, or copied into a
        # decode graph's static inputs (decode_inputs)
        self._step: tuple[list[int], list[int], list[list[int]] | None] | None = None
        self._verify: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (live slots, verify slots)
        self._last_verify = (0, 0)

    def slot(self, seq: Sequence) -> int:
        """The live slot a running sequence holds (a verify step reads and commits there)."""
        return self._slot[seq]

    # ---- verify steps (speculative decoding: spec/graphs.py, spec/decoder.py) ----------------------------------

    def _verify_inputs(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify step's static inputs for (batch, K): the rows' live slots [batch] (padding rows: the scratch
        slot) and where each row's state after each of its K + 1 tokens goes, [batch, K + 1]."""
        if key not in self._verify:
            b, k = key
            table = torch.arange(b * (k + 1), dtype=torch.int32, device=self.device).view(b, k + 1)
            live = torch.full((b,), self.scratch_slot, dtype=torch.int32, device=self.device)
            self._verify[key] = (live, table + self.verify_base)
        return self._verify[key]

    def attach_verify(self, meta: AttentionMetadata, key: tuple[int, int]) -> AttentionMetadata:
        """meta of a verify step (batch, K) from each row's live slot, with a snapshot after every token
        (kernels/delta_rule.py gated_delta_net: decode's arithmetic), none of which stays in the live slot until
        `commit`."""
        live, table = self._verify_inputs(key)
        return replace(meta, state_slots=live, state_initialized=torch.ones_like(live), state_snapshots=table,
                       state_snapshot_every=1)  # fmt: skip

    def load_verify(self, key: tuple[int, int], slots: list[int] | None) -> None:
        """Before a verify step (batch, K) is launched: its sequences' live slots (`slot`), one upload."""
        assert slots is not None, "a verify step of a model with state names each sequence's live slot"
        live, _ = self._verify_inputs(key)
        host = slots + [self.scratch_slot] * (key[0] - len(slots))
        live.copy_(torch.tensor(host, dtype=torch.int32), non_blocking=True)
        self._last_verify = key

    def commit(self, accepted: torch.Tensor) -> None:
        """After the last verify step, on the device: each row's state after its last accepted token (accepted [B]
        drafts: the snapshot after token `accepted` of the step) into its live slot; every layer's recurrent and
        conv state."""
        live, table = self._verify[self._last_verify]
        rows = accepted.shape[0]
        source = table[:rows].gather(1, accepted.view(-1, 1).to(torch.int64)).view(-1).to(torch.int64)
        target = live[:rows].to(torch.int64)
        for pools in self.pools.values():
            for pool in pools:
                pool.index_copy_(0, target, pool.index_select(0, source))

    def verified(self, seq: Sequence, tokens: int) -> None:
        """The host read a verify step: seq's live slot now holds the state after `tokens` tokens."""
        self._covered[seq] = tokens

    def place(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Put each recurrent layer's (state_pool, conv_pool) into its entry of the engine's per-layer caches."""
        for layer, pools in self.pools.items():
            assert kv_caches[layer] == (), f"layer {layer} has both KV pages and a state pool"
            kv_caches[layer] = pools

    @property
    def num_used_slots(self) -> int:
        return len(self._slot)

    @property
    def num_snapshots_kept(self) -> int:
        return len(self._snapshots)

    def limit_prefix(self, seq: Sequence, hashes: list[int], cached: int) -> int:
        """The block manager's prefix_limit: of a new prompt's `cached` leading blocks found in the cache, the most
        whose end has a state snapshot (0: none). Records the snapshots the prompt's prefill takes (hashes: the
        chained hashes of every block a hit could cover): after its last full block (for an equal prompt, or a later
        turn that extends it), and after the `cached` blocks where no snapshot is kept there (the end of the prefix
        it shares with an earlier prompt, such as a system prompt: the next prompt that shares it hits there)."""
        bs = self.block_size
        usable = next((j for j in range(cached, 0, -1) if hashes[j - 1] in self._snapshots), 0)
        wanted = sorted({n for n in (cached, len(hashes)) if n > usable and hashes[n - 1] not in self._snapshots})
        self._take.pop(seq, None)
        if self.num_snapshots and wanted:
            self._take[seq] = [(n * bs, hashes[n - 1]) for n in wanted]
        if usable:
            self._snapshots.move_to_end(hashes[usable - 1])
            self._restore[seq] = (usable * bs, hashes[usable - 1])
        else:
            self._restore.pop(seq, None)
        return usable

    def _snapshot_slot(self, key: int, busy: set[int]) -> int | None:
        """A snapshot slot for `key`: a free one, else the least recently used one not read or written this step."""
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        else:
            old = next((k for k, s in self._snapshots.items() if s not in busy), None)
            if old is None:
                return None
            slot = self._snapshots.pop(old)
        self._snapshots[key] = slot
        return slot

    def before_step(self, chunks: list[ScheduledChunk]) -> None:
        """Release the slots of freed sequences, give each chunk's sequence a slot (restoring a prefix hit's
        snapshot into it), and record for the step which slot each chunk reads, whether it continues the state
        there, and where its prompt's snapshot goes."""
        for seq in [s for s in self._slot if not s.block_table]:  # its engine blocks are gone
            self._free.append(self._slot.pop(seq))
            self._covered.pop(seq, None)
        for table in (self._restore, self._take):
            for seq in [s for s in table if not s.block_table and s.status is not Status.WAITING]:
                del table[seq]
        slots: list[int] = []
        initialized: list[int] = []
        snapshots: list[tuple[int, int, int]] = []  # (row, column, snapshot slot)
        # the snapshots this step's hits read: not to be overwritten by the snapshots it takes
        busy = {self._snapshots[self._restore[c.seq][1]] for c in chunks if c.seq in self._restore}
        bs = self.block_size
        for c in chunks:
            seq = c.seq
            if seq not in self._slot:
                if not self._free:
                    raise RuntimeError(f"state slots: all {self.num_slots} in use; this is a bug in their release "
                                       "(runtime/engine/caches/state_slots.py)")  # fmt: skip
                self._slot[seq] = self._free.pop()
            restore = self._restore.pop(seq, None)
            if restore is not None and restore[0] == c.start:  # a prefix hit: its state from the snapshot
                source = self._snapshots[restore[1]]
                for pools in self.pools.values():
                    for pool in pools:
                        pool[self._slot[seq]].copy_(pool[source])
                self._covered[seq] = c.start
            covered = self._covered.get(seq, 0)
            if c.start > 0 and c.start != covered and seq.status is Status.RUNNING:
                raise RuntimeError(f"state slots: request {seq.request_id!r} resumes at token {c.start} but its "
                                   f"state holds {covered}; refusing to serve a stale state")  # fmt: skip
            # (A chunk at p > 0 of a sequence the scheduler never ran is the warm-up's throwaway launch: it only
            # needs the kernels to run, from zeros.)
            initialized.append(int(c.start > 0 and c.start == covered))
            slots.append(self._slot[seq])
            self._covered[seq] = c.start + c.num_tokens
            for tokens, key in [t for t in self._take.get(seq, ()) if c.start < t[0] <= c.start + c.num_tokens]:
                self._take[seq].remove((tokens, key))
                if key not in self._snapshots:
                    target = self._snapshot_slot(key, busy)
                    if target is not None:  # the n-th multiple of bs in (start, start + len] is column n
                        busy.add(target)
                        snapshots.append((len(slots) - 1, (tokens - (c.start // bs + 1) * bs) // bs, target))
        table = None
        if snapshots:  # [B, W], W ≥ every chunk's count of multiples of bs (the kernels' contract); -1: not kept
            width = max((c.start + c.num_tokens) // bs - c.start // bs for c in chunks)
            table = [[-1] * width for _ in chunks]
            for row, n, target in snapshots:
                table[row][n] = target
        self._step = (slots, initialized, table)

    def attach(self, meta: AttentionMetadata) -> AttentionMetadata:
        """meta with this step's state slots and snapshots (before_step must have run for the same chunks)."""
        assert self._step is not None, "StateSlots.before_step runs before each step"
        slots, initialized, table = self._step
        step = upload([slots, initialized], torch.int32, self.device)
        snapshots = upload(table, torch.int32, self.device) if table is not None else None
        return replace(meta, state_slots=step[0], state_initialized=step[1], state_snapshots=snapshots,
                       state_snapshot_every=self.block_size if snapshots is not None else 0)

    def decode_inputs(self) -> tuple[list[int], list[int]] | None:
        """This step's (slots, initialized flags) for a captured decode step, which takes no snapshots: None when
        the step takes one (it then runs eagerly). A decode chunk takes none today (a prompt's snapshots fall before
        its last token: match_prefix's hashes), but one taken after an answer's block (hybrid.md) would."""
        assert self._step is not None, "StateSlots.before_step runs before each step"
        slots, initialized, table = self._step
        return (slots, initialized) if table is None else None
