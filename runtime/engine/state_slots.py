"""Per-sequence state slots for models with recurrent layers (Qwen3-Next's Gated DeltaNet; offline_docs/hybrid.md).

A recurrent layer keeps a fixed-size state per sequence (the delta rule's matrix, the convolution's last inputs)
instead of K/V pages. The model allocates one pool per such layer (`make_state_pools`), `max_num_seqs` slots
deep, before the KV cache takes its share of memory; this class hands each running sequence one slot for its whole
life and tells the layers, each step, which slot each sequence reads and whether that slot already holds its state
(`AttentionMetadata.state_slots`, `state_initialized`).

The state after token n is only right if it was built from tokens 0..n-1 of this sequence, in order, exactly once:
- a chunk starting at position 0 starts from zeros (a new sequence, or one preempted and recomputed: preemption
  frees its blocks and restarts it at 0, so recompute is correct with no swap);
- a chunk starting at p > 0 continues the slot only if the slot's state covers exactly p tokens; anything else
  would read a stale state, and raises instead (the known failure of hybrid serving);
- the prefix cache is off for these models (`prefix_caching`): a hit skips tokens whose state no slot holds (state
  snapshots at block boundaries, which the kernels can write, are not wired to the block manager yet);
- speculative decoding is refused: a verify step would leave rejected tokens in the state.
Slots are released when the engine frees a sequence's blocks (finished, aborted, preempted), seen at the next step.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from envex.kernels.ops import AttentionMetadata
from envex.runtime.engine.config import EngineConfig
from envex.runtime.engine.device import upload
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.engine.sequence import Sequence, Status


def has_state(model: torch.nn.Module) -> bool:
    """Whether the model keeps per-sequence state (it then allocates its pools with make_state_pools)."""
    return hasattr(model, "make_state_pools")


class StateSlots:
    """The state pools of a model's recurrent layers and which slot each running sequence holds."""

    prefix_caching = False  # see the module docstring

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        arch = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
        if config.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens: speculative decoding does not run with {arch}'s recurrent "
                             "(linear-attention) state yet (a verify step would keep rejected tokens in it); set it "
                             "to 0")  # fmt: skip
        self.num_slots = config.max_num_seqs
        self.device = device
        self.pools: dict[int, tuple[torch.Tensor, ...]] = model.make_state_pools(self.num_slots, dtype, device)
        self._free = list(range(self.num_slots - 1, -1, -1))  # a stack: the lowest ids are reused first
        self._slot: dict[Sequence, int] = {}
        self._covered: dict[Sequence, int] = {}  # tokens the slot's state holds, once this step's chunks are done
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None

    def place(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Put each recurrent layer's (state_pool, conv_pool) into its entry of the engine's per-layer caches."""
        for layer, pools in self.pools.items():
            assert kv_caches[layer] == (), f"layer {layer} has both KV pages and a state pool"
            kv_caches[layer] = pools

    @property
    def num_used_slots(self) -> int:
        return len(self._slot)

    def before_step(self, chunks: list[ScheduledChunk]) -> None:
        """Release the slots of freed sequences, give each chunk's sequence a slot, and record for the step which
        slot each chunk reads and whether it continues the state there."""
        for seq in [s for s in self._slot if not s.block_table]:  # its engine blocks are gone
            self._free.append(self._slot.pop(seq))
            self._covered.pop(seq, None)
        slots: list[int] = []
        initialized: list[int] = []
        for c in chunks:
            seq = c.seq
            if seq not in self._slot:
                if not self._free:
                    raise RuntimeError(f"state slots: all {self.num_slots} in use; this is a bug in their release "
                                       "(runtime/engine/state_slots.py)")  # fmt: skip
                self._slot[seq] = self._free.pop()
            covered = self._covered.get(seq, 0)
            if c.start > 0 and c.start != covered and seq.status is Status.RUNNING:
                raise RuntimeError(f"state slots: request {seq.request_id!r} resumes at token {c.start} but its "
                                   f"state holds {covered}; refusing to serve a stale state")  # fmt: skip
            # (A chunk at p > 0 of a sequence the scheduler never ran is the warm-up's throwaway launch: it only
            # needs the kernels to run, from zeros.)
            initialized.append(int(c.start > 0 and c.start == covered))
            slots.append(self._slot[seq])
            self._covered[seq] = c.start + c.num_tokens
        step = upload([slots, initialized], torch.int32, self.device)
        self._step = (step[0], step[1])

    def attach(self, meta: AttentionMetadata) -> AttentionMetadata:
        """meta with this step's state slots (before_step must have run for the same chunks)."""
        assert self._step is not None, "StateSlots.before_step runs before each step"
        return replace(meta, state_slots=self._step[0], state_initialized=self._step[1])
