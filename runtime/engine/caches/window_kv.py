"""KV memory for sliding-window layers (gpt-oss): each sequence keeps only the blocks its window can still see.

The full-attention layers use the engine's paged cache and block tables as every model does. The window layers
have their own, much smaller pool of blocks, addressed through one device tensor `remap`: the window block that
holds the window layers' K/V for each block id of the engine's pool. The per-step metadata of the window layers is
the step's own, passed through `remap` on the device (`attach`): the block tables gathered, the slots re-based. So
a captured CUDA graph holds the window layers too, and nothing else in the engine (scheduler, block manager,
graphs) knows about windows.

Before each step (`before_step`), on the host, for every scheduled chunk of positions [start, start + n):
- the blocks of positions < start - window + 1 are released: no query of this chunk or a later one sees them;
- every block of [start - window + 1, start + n) gets a window block (kept if the sequence already has one);
- a sequence whose engine blocks were freed (finished, aborted, preempted) releases all of its window blocks;
- after the step, the chunk's sequence keeps only [start + n - window + 1, ...): trimmed at the next call.
Each sequence so holds at most ceil((window - 1) / block) + 1 blocks between steps, plus its chunk's during one,
and the pool is sized for max_num_seqs of those and one token budget of chunks: it never runs out.

Prefix caching stays off for these models (`prefix_caching`): a reused prefix would need window blocks its
sequence never computed.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from envex.kernels.ops import AttentionMetadata
from envex.runtime.config import ModelConfig
from envex.runtime.engine.config import EngineConfig
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.engine.sequence import Sequence


class WindowBlocks:
    """The window layers' block pool, their caches, and which window block backs which engine block."""

    prefix_caching = False

    def __init__(self, config: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_engine_blocks: int) -> None:  # fmt: skip
        windows = {w for w in model.layer_windows if w is not None}
        assert len(windows) == 1, "one window size per model (gpt-oss)"
        self.window = windows.pop()
        self.block_size = bs = config.block_size
        self.layers = [i for i, w in enumerate(model.layer_windows) if w is not None]
        self.num_blocks = self.pool_blocks(config, self.window)
        shape = (self.num_blocks, bs, model.num_key_value_heads, model.head_dim)
        self.caches = {i: (torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for i in self.layers}  # fmt: skip
        self.remap = torch.zeros(num_engine_blocks, dtype=torch.int32, device=device)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: the lowest ids are reused first
        # sequence -> {logical block j: (engine block, window block)}
        self._held: dict[Sequence, dict[int, tuple[int, int]]] = {}
        self._last: list[ScheduledChunk] = []

    @staticmethod
    def pool_blocks(config: EngineConfig, window: int) -> int:
        """max_num_seqs sequences' last windows (plus a partial block at each end) and one token budget of chunks."""
        bs = config.block_size
        assert config.max_num_batched_tokens is not None
        return config.max_num_seqs * ((window - 1) // bs + 3) + -(-config.max_num_batched_tokens // bs)

    @staticmethod
    def bytes_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
        """What the pool costs, to leave out of the full layers' budget (known before it is allocated)."""
        window = next(w for w in model.layer_windows if w is not None)
        layers = sum(w is not None for w in model.layer_windows)
        per_block = 2 * layers * config.block_size * model.num_key_value_heads * model.head_dim
        return WindowBlocks.pool_blocks(config, window) * per_block * torch.finfo(dtype).bits // 8

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def _release(self, held: dict[int, tuple[int, int]], below: int) -> None:
        for j in [j for j in held if j < below]:
            self._free.append(held.pop(j)[1])

    def before_step(self, chunks: list[ScheduledChunk]) -> None:
        """Release what no query can see any more, and give every position this step writes or reads a block."""
        bs, window = self.block_size, self.window
        for c in self._last:  # the previous step's chunks are computed: keep only their last window
            held = self._held.get(c.seq)
            if held is not None:
                self._release(held, max(0, c.start + c.num_tokens - window + 1) // bs)
        self._last = list(chunks)
        for seq in [s for s in self._held if not s.block_table]:  # its engine blocks are gone
            self._release(self._held.pop(seq), 1 << 62)
        index: list[int] = []
        value: list[int] = []
        for c in chunks:
            held = self._held.setdefault(c.seq, {})
            first = max(0, c.start - window + 1) // bs
            self._release(held, first)
            for j in range(first, (c.start + c.num_tokens - 1) // bs + 1):
                engine_block = c.seq.block_table[j]
                entry = held.get(j)
                if entry is not None and entry[0] == engine_block:
                    continue
                if entry is None:
                    if not self._free:
                        raise RuntimeError(f"window KV pool: all {self.num_blocks} blocks in use; this is a bug "
                                           "in its sizing (runtime/engine/caches/window_kv.py)")  # fmt: skip
                    entry = (engine_block, self._free.pop())
                else:  # the sequence was preempted and recomputes into new engine blocks
                    entry = (engine_block, entry[1])
                held[j] = entry
                index.append(engine_block)
                value.append(entry[1])
        if index:
            dev = self.remap.device
            idx = torch.tensor(index, dtype=torch.int64)
            val = torch.tensor(value, dtype=torch.int32)
            if dev.type != "cpu":  # no wait on the device's queue (see model_runner.upload)
                idx, val = idx.to(dev, non_blocking=True), val.to(dev, non_blocking=True)
            self.remap[idx] = val

    def attach(self, meta: AttentionMetadata) -> AttentionMetadata:
        """meta with `window` set: the same step for the window layers, through `remap`, on the device (so a CUDA
        graph captures it). Padding rows (slot < 0) still write nothing."""
        bs = self.block_size
        slots = meta.slot_mapping
        engine_block = torch.clamp(slots, min=0) // bs
        window_slots = torch.where(slots >= 0, self.remap[engine_block].to(slots.dtype) * bs + slots % bs, slots)
        window = replace(meta, block_tables=self.remap[meta.block_tables.long()], slot_mapping=window_slots,
                         window=None)  # fmt: skip
        return replace(meta, window=window)
