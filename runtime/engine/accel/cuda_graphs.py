"""CUDA-graph decode: the model file's forward captured once per batch size of a ladder, replayed token by token.

A decode step of B sequences replays the graph of the smallest ladder size ≥ B; the extra rows are padding
(inactive: they write nothing into the KV cache, and their logits are dropped). What is captured is
ModelRunner.forward_logits, the same forward every eager step runs, on static input buffers: the per-step
metadata (cache slots from the block tables and positions) is computed on the device inside the graph, and the
key-split count of decode attention is fixed per graph. Host work per step is a few small copies into the static
inputs; sampling stays with the engine.

A model with per-sequence recurrent state (Qwen3-Next: StateSlots) also reads each row's state slot from a static
input, uploaded with its initialized flag in one copy. Padding rows, and every row while capturing, point at the
state pools' scratch slot, which no sequence holds: they read and write no live or snapshot state, as inactive rows
write no KV. A decode step takes no state snapshots; a step that would runs eagerly.

The split count and the attention's key tile follow the longest sequence a graph may meet. When a short context
(SHORT_CONTEXT tokens) would launch attention differently from max_model_len, a batch size gets a second graph
for it, which a step replays while all its sequences fit: a 131K server decoding 1K-token requests runs the
1K launch shape (gpt-oss-120b, batch 1: verify/lab/journal-kernels.md, "Long decode").

All graphs share one memory pool (captured largest first), so the ladder costs about one step's activations.

Under tensor parallelism every rank captures the same ladder (its collectives inside), rank 0 sends each step's
batch, positions and block tables before it replays, and the others replay the same graph from them (`follow`).
"""

from __future__ import annotations

import torch

from envex.kernels.ops import AttentionMetadata
from envex.runtime.engine.device import fill_pending

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
SHORT_CONTEXT = 4096  # tokens: the second graph's longest sequence, where its launch shape differs


def graph_ladder(max_batch: int, ladder: tuple[int, ...] = DEFAULT_LADDER) -> tuple[int, ...]:
    """The ladder's sizes up to max_batch, plus max_batch itself so every batch the scheduler forms fits."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    return tuple(sorted({b for b in ladder if b < max_batch} | {max_batch}))


def num_splits_for(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int | None:
    """A graph's fixed decode key-split count (None off CUDA: the eager launcher then chooses)."""
    if device.type != "cuda":
        return None
    from envex.kernels.attention import choose_num_splits  # Triton: only where graphs run

    return choose_num_splits(batch, num_kv_heads, max_seq_len, device)


def attention_shape(batch: int, num_kv_heads: int, head_dim: int, max_seq_len: int, device: torch.device
                    ) -> tuple[int, bool] | None:  # fmt: skip
    """What a graph's decode attention fixes from its longest sequence: (key splits, the long-split key tile);
    None off CUDA."""
    splits = num_splits_for(batch, num_kv_heads, max_seq_len, device)
    if splits is None:
        return None
    from envex.kernels.decode_attention import takes_long_tile

    return splits, takes_long_tile(head_dim, max_seq_len, splits)


def context_lengths(max_model_len: int, shape_at) -> tuple[int, ...]:
    """The longest sequences a batch size's graphs are captured for: max_model_len, and SHORT_CONTEXT first when
    attention launches differently there (shape_at(length) -> attention_shape)."""
    if max_model_len > SHORT_CONTEXT and shape_at(SHORT_CONTEXT) != shape_at(max_model_len):
        return (SHORT_CONTEXT, max_model_len)
    return (max_model_len,)


class _Inputs:
    """Device buffers a captured step reads (what the graph holds by address)."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device, scratch_slot: int | None) -> None:
        self.input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)  # position of the token fed in
        self.block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        # False for padding rows: they compute garbage but write nothing into the KV cache.
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        # A model with state (scratch_slot not None): int32 [2, b], each row's state slot and whether it continues
        # the state there (1), in one buffer so that a step uploads both in one copy; its rows are the metadata's.
        self.state: torch.Tensor | None = None
        if scratch_slot is not None:
            self.state = torch.tensor([[scratch_slot] * batch, [0] * batch], dtype=torch.int32, device=device)
        self.state_slots = self.state[0] if self.state is not None else None
        self.state_initialized = self.state[1] if self.state is not None else None


class DecodeGraphs:
    def __init__(self, runner, *, max_batch: int, capture: bool = True,
                 with_hidden: bool = False) -> None:  # runner: ModelRunner  # fmt: skip
        """capture=False runs the same step eagerly (for CPU tests under the Triton interpreter). with_hidden: the
        step also keeps its last hidden states after the final norm (`hidden`, for an MTP drafter)."""
        self.runner = runner
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self.sizes = graph_ladder(max_batch)
        self.capture = capture and self.device.type == "cuda"
        kv_heads = getattr(runner, "num_kv_heads", runner.model_config.num_key_value_heads)  # this rank's
        self.parallel = getattr(runner, "parallel", None)
        self.states = getattr(runner, "states", None)  # StateSlots of a model with recurrent layers, else None
        self.scratch_slot = self.states.scratch_slot if self.states is not None else None
        # The graphs of one batch size share its input buffers; each (size, longest sequence) is one graph.
        self._inputs = {b: _Inputs(b, self.max_blocks, self.device, self.scratch_slot) for b in self.sizes}
        head_dim = runner.model_config.head_dim
        self.lengths = {b: context_lengths(self.max_model_len, lambda n, b=b: attention_shape(
            b, kv_heads, head_dim, n, self.device)) for b in self.sizes}  # fmt: skip
        self.keys = [(b, n) for b in self.sizes for n in self.lengths[b]]
        self._splits = {(b, n): num_splits_for(b, kv_heads, n, self.device) for b, n in self.keys}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
        self.with_hidden = with_hidden
        self._hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.hidden: torch.Tensor | None = None  # the last run's [B, H] (with_hidden)
        if self.capture:
            self._capture_all()

    def _forward(self, b: int, max_seq_len: int | None = None) -> torch.Tensor:
        x = self._inputs[b]
        n = max_seq_len or self.max_model_len
        bs = self.block_size
        slots = x.block_tables.gather(1, (x.positions // bs)[:, None])[:, 0].long() * bs + x.positions % bs
        meta = AttentionMetadata(
            positions=x.positions, slot_mapping=torch.where(x.active, slots, -1), cu_seqlens_q=x.cu_seqlens_q,
            block_tables=x.block_tables, cos=self.runner.cos, sin=self.runner.sin, max_q_len=1,
            max_seq_len=n, num_splits=self._splits[(b, n)],
            state_slots=x.state_slots, state_initialized=x.state_initialized,
        )  # fmt: skip
        if self.with_hidden:
            logits, self._hidden[(b, n)] = self.runner.forward_logits(x.input_ids, meta, with_hidden=True)
            return logits
        return self.runner.forward_logits(x.input_ids, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for b, n in sorted(self.keys, reverse=True):  # largest first: the others fit in its pool
            x = self._inputs[b]
            x.active.zero_()  # warm-up and capture must not write into live KV blocks
            if x.state_slots is not None:  # nor into live state slots
                x.state_slots.fill_(self.scratch_slot)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(b, n)  # compiles the Triton kernels outside the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[(b, n)] = self._forward(b, n)
            pool = graph.pool()
            self._graphs[(b, n)] = graph
        torch.cuda.synchronize(self.device)

    def key_for(self, batch: int, positions: list[int]) -> tuple[int, int]:
        """The graph a step of `batch` sequences at these positions replays: the smallest size that takes the
        batch, and the shortest context that every sequence fits (a sequence at position p holds p + 1 keys)."""
        b = next(s for s in self.sizes if s >= batch)
        longest = max(positions, default=0) + 1
        return b, next(n for n in self.lengths[b] if n >= longest)

    def fits(self, batch: int) -> bool:
        return 1 <= batch <= self.sizes[-1]

    def graph(self, batch: int, max_seq_len: int) -> torch.cuda.CUDAGraph:
        """The captured graph of a ladder size and one of its context lengths (key_for picks them for a step)."""
        return self._graphs[(batch, max_seq_len)]

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]],
            fill: tuple[list[int], list[int], torch.Tensor] | None = None,
            states: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """One decode token for each of B sequences -> logits [B, V] (a view of the graph's static output: use
        it before the next run). fill = (rows, source rows, source): input_ids[rows] come from the device tensor
        source[source rows] instead (tokens sampled by the previous step that the host has not read). states: a
        model with state's (slots, initialized flags) of the B sequences (StateSlots.decode_inputs)."""
        batch = len(input_ids)
        if not self.fits(batch):
            raise ValueError(f"batch: {batch} sequences, the largest captured decode graph takes {self.sizes[-1]}")
        b, n = self.key_for(batch, positions)
        x = self._inputs[b]
        width = max(len(t) for t in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"block_tables: {width} blocks > {self.max_blocks} that max_model_len allows")
        pad = b - batch
        flat = [0] * (b * width)  # one host tensor for all tables: per-row tensors cost ~5 us each
        for row, t in enumerate(block_tables):
            flat[row * width : row * width + len(t)] = t
        par = self.parallel
        if par is not None and par.is_driver:
            par.channel.send_graph([batch, width, *positions, *flat[: batch * width]])
        # Only the first `width` columns matter: kernels read a sequence's table up to its own length.
        x.input_ids.copy_(torch.tensor(input_ids + [0] * pad, dtype=torch.int64), non_blocking=True)
        x.positions.copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64), non_blocking=True)
        x.active.copy_(torch.tensor([True] * batch + [False] * pad), non_blocking=True)
        x.block_tables[:, :width].copy_(torch.tensor(flat, dtype=torch.int32).view(b, width), non_blocking=True)
        if x.state is not None:
            assert states is not None, "a model with state: each step passes its sequences' state slots"
            slots, initialized = states
            x.state.copy_(torch.tensor([slots + [self.scratch_slot] * pad, initialized + [0] * pad],
                                       dtype=torch.int32), non_blocking=True)  # fmt: skip
        if fill is not None:
            fill_pending(x.input_ids, *fill)
        if par is not None:  # rank 0's ids (sampled on its device) into every rank's graph input
            par.comm.broadcast(x.input_ids)
        if self.capture:
            self._graphs[(b, n)].replay()
            logits = self._logits[(b, n)]
        else:
            logits = self._forward(b, n)
        self.hidden = self._hidden[(b, n)][:batch] if self.with_hidden else None
        return logits[:batch]

    def follow(self, data: list[int]) -> torch.Tensor:
        """A tensor-parallel worker's replay of rank 0's step (workers.follow): [batch, width, positions, tables]
        -> the same logits [B, V] as rank 0's (which a worker drops)."""
        batch, width = data[0], data[1]
        positions, flat = data[2 : 2 + batch], data[2 + batch :]
        return self.run([0] * batch, positions, [flat[r * width : (r + 1) * width] for r in range(batch)])

    def run_chunks(self, chunks, pending_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, V] float32 for a step of scheduled chunks if it is a pure decode step that fits, else None.
        chunks: envex.runtime.engine.scheduler.ScheduledChunk list; pending_tokens: see ModelRunner.execute."""
        if not chunks or not self.fits(len(chunks)):
            return None
        for c in chunks:
            if c.num_tokens != 1 or not c.completes or c.start < len(c.seq.prompt_token_ids):
                return None  # a prefill chunk, or a prompt token whose logprobs may be wanted: the eager path
        states = self.states.decode_inputs() if self.states is not None else None
        if self.states is not None and states is None:
            return None  # the step takes a state snapshot: the eager path
        ids: list[int] = []
        rows: list[int] = []
        src_rows: list[int] = []
        for row, c in enumerate(chunks):
            # The token at position start is the newest one (all_token_ids would copy the whole prompt); when it
            # is still pending on the device, the graph's input is filled from there.
            out = c.seq.output_token_ids
            k = c.start - len(c.seq.prompt_token_ids)
            if k < len(out):
                ids.append(out[k])
            else:
                assert pending_tokens is not None, "a pending token without its source tensor"
                ids.append(0)
                rows.append(row)
                src_rows.append(c.seq.pending_row)
        fill = (rows, src_rows, pending_tokens) if rows and pending_tokens is not None else None
        positions = [c.start for c in chunks]
        return self.run(ids, positions, [c.seq.block_table for c in chunks], fill, states).float()
