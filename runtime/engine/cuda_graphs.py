"""CUDA-graph decode: the model file's forward captured once per batch size of a ladder, replayed token by token.

A decode step of B sequences replays the graph of the smallest ladder size ≥ B; the extra rows are padding
(inactive: they write nothing into the KV cache, and their logits are dropped). What is captured is
ModelRunner.forward_logits, the same forward every eager step runs, on static input buffers: the per-step
metadata (cache slots from the block tables and positions) is computed on the device inside the graph, and the
key-split count of decode attention is fixed per graph. Host work per step is a few small copies into the static
inputs; sampling stays with the engine.

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
from envex.runtime.engine.drafters import SpecInputs
from envex.runtime.engine.model_runner import fill_pending

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

    def __init__(self, batch: int, max_blocks: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)  # position of the token fed in
        self.block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        # False for padding rows: they compute garbage but write nothing into the KV cache.
        self.active = torch.ones(batch, dtype=torch.bool, device=device)


class DecodeGraphs:
    def __init__(self, runner, *, max_batch: int, capture: bool = True) -> None:  # runner: ModelRunner
        """capture=False runs the same step eagerly (for CPU tests under the Triton interpreter)."""
        self.runner = runner
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self.sizes = graph_ladder(max_batch)
        self.capture = capture and self.device.type == "cuda"
        kv_heads = getattr(runner, "num_kv_heads", runner.model_config.num_key_value_heads)  # this rank's
        self.parallel = getattr(runner, "parallel", None)
        # The graphs of one batch size share its input buffers; each (size, longest sequence) is one graph.
        self._inputs = {b: _Inputs(b, self.max_blocks, self.device) for b in self.sizes}
        head_dim = runner.model_config.head_dim
        self.lengths = {b: context_lengths(self.max_model_len, lambda n, b=b: attention_shape(
            b, kv_heads, head_dim, n, self.device)) for b in self.sizes}  # fmt: skip
        self.keys = [(b, n) for b in self.sizes for n in self.lengths[b]]
        self._splits = {(b, n): num_splits_for(b, kv_heads, n, self.device) for b, n in self.keys}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
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
        )  # fmt: skip
        return self.runner.forward_logits(x.input_ids, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for b, n in sorted(self.keys, reverse=True):  # largest first: the others fit in its pool
            self._inputs[b].active.zero_()  # warm-up and capture must not write into live KV blocks
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
            fill: tuple[list[int], list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """One decode token for each of B sequences -> logits [B, V] (a view of the graph's static output: use
        it before the next run). fill = (rows, source rows, source): input_ids[rows] come from the device tensor
        source[source rows] instead (tokens sampled by the previous step that the host has not read)."""
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
        if fill is not None:
            fill_pending(x.input_ids, *fill)
        if par is not None:  # rank 0's ids (sampled on its device) into every rank's graph input
            par.comm.broadcast(x.input_ids)
        if self.capture:
            self._graphs[(b, n)].replay()
            logits = self._logits[(b, n)]
        else:
            logits = self._forward(b, n)
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
        return self.run(ids, positions, [c.seq.block_table for c in chunks], fill).float()


def verify_inputs_torch(hist: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, drafts: torch.Tensor,
                        num_drafts: torch.Tensor, k_limit: torch.Tensor, block_tables: torch.Tensor, *,
                        block_size: int, max_model_len: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A verify step's inputs from the drafts: (ids, positions, slots [B·(K+1)], seq_lens_after [B] int32), and
    num_drafts capped in place so that no draft reaches past the context. Row b's k + 1 tokens are its newest
    (hist[rows[b], seq_lens[b] - 1], not yet cached) and its drafts; rows past its drafts, and every row of a
    padding sequence (k_limit -1), get slot -1 (nothing written). kernels/spec_inputs.py is the same in one launch."""
    k = drafts.shape[1]
    num_drafts.copy_(torch.minimum(num_drafts, (max_model_len - seq_lens).clamp(min=0)))
    newest = hist[rows, seq_lens - 1]  # [B]
    ids = torch.cat([newest[:, None], drafts], dim=1)  # [B, K+1]
    j = torch.arange(k + 1, device=hist.device)[None, :]
    pos = (seq_lens[:, None] - 1 + j).clamp(max=max_model_len - 1)  # garbage rows stay inside the rotary tables
    # A step chained past a finishing sequence's end (seq_lens up to max_model_len + 2) writes nothing: its clamped
    # positions would overwrite the last cached key.
    valid = (j <= num_drafts[:, None]) & (k_limit[:, None] >= 0) & (seq_lens[:, None] - 1 + j < max_model_len)
    slots = block_tables.gather(1, pos // block_size).long() * block_size + pos % block_size
    return (ids.reshape(-1), pos.reshape(-1), torch.where(valid, slots, -1).reshape(-1),
            (seq_lens + k).to(torch.int32))  # fmt: skip


class SpecGraphs:
    """Verify steps of B sequences x (K + 1) tokens, captured for a ladder of (batch, K) (speculative.py).

    Everything a step needs beyond a few host ints is derived on the device inside the graph: each row's length
    from SpecDecoder.lens (so the step may be launched before the host knows how many tokens the previous step
    appended), its newest token and the drafts from SpecDecoder.hist, positions, cache slots. Row b holds query
    rows b*(K+1) .. b*(K+1)+K: its newest token, then its drafts; rows past the row's proposed drafts (and
    padding sequences) compute garbage and write nothing into the KV cache. A drafter with its own model (a draft
    model) has a graph of its own per (batch, K), replayed first on the same static inputs.
    """

    def __init__(self, runner, spec, drafter, *, sizes: tuple[int, ...], ks: tuple[int, ...],
                 capture: bool = True) -> None:  # fmt: skip
        self.runner, self.spec, self.drafter = runner, spec, drafter
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.sizes, self.ks = sizes, ks
        # Block-table columns for every key a row may read (SpecDecoder.width: up to max_model_len + k + 1).
        self.width = -(-(self.max_model_len + max(ks) + 2) // self.block_size)
        self.capture = capture and self.device.type == "cuda"
        kv_heads = runner.model_config.num_key_value_heads
        self._inputs: dict[tuple[int, int], SpecInputs] = {}
        self._packed: dict[tuple[int, int], torch.Tensor] = {}
        self._cu: dict[tuple[int, int], torch.Tensor] = {}
        self._splits: dict[tuple[int, int], int | None] = {}
        self._kv_heads = kv_heads
        # Eager steps (no capture) run their exact batch (buffers made when first needed); pad=True pads them to
        # the ladder as the graphs do, padding rows included.
        self.pad = self.capture
        if self.capture:
            for b in sizes:
                for k in ks:
                    self._make_inputs(b, k)
        if not drafter.in_verify_graph:
            draft_heads = drafter.runner.model_config.num_key_value_heads
            for b in sizes:
                for q in (1, 2):
                    drafter.num_splits[(b, q)] = num_splits_for(b, draft_heads, self.max_model_len + max(ks) + 1,
                                                                self.device)  # fmt: skip
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._draft_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
        if self.capture:
            self._capture_all()

    def _make_inputs(self, b: int, k: int) -> None:
        packed = torch.zeros(2, b, dtype=torch.int64, device=self.device)  # rows, k_limit: one upload
        packed[0].fill_(self.spec.spare)
        packed[1].fill_(-1)
        self._packed[(b, k)] = packed
        self._inputs[(b, k)] = SpecInputs(
            hist=self.spec.hist, lens=self.spec.lens, rows=packed[0], k_limit=packed[1],
            block_tables=torch.zeros(b, self.width, dtype=torch.int32, device=self.device),
            drafts=torch.zeros(b, k, dtype=torch.int64, device=self.device),
            num_drafts=torch.zeros(b, dtype=torch.int64, device=self.device),
        )  # fmt: skip
        self._cu[(b, k)] = torch.arange(0, (b + 1) * (k + 1), k + 1, dtype=torch.int32, device=self.device)
        self._splits[(b, k)] = num_splits_for(b, self._kv_heads, self.max_model_len + k + 1, self.device)

    def _draft(self, key: tuple[int, int]) -> None:
        x = self._inputs[key]
        torch.index_select(x.lens, 0, x.rows, out=x.seq_lens)
        self.drafter.propose(x)

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        b, k = key
        x = self._inputs[key]
        # [B] tokens per sequence before this step; the newest is not cached
        torch.index_select(x.lens, 0, x.rows, out=x.seq_lens)
        if self.drafter.in_verify_graph:
            self.drafter.propose(x)
        inputs = verify_inputs_torch
        if x.hist.is_cuda:  # one Triton launch instead of ~20 small ops (kernels/spec_inputs.py)
            from envex.kernels.spec_inputs import verify_inputs as inputs  # Triton: only where tensors are on a GPU
        ids, positions, slots, seq_lens = inputs(x.hist, x.rows, x.seq_lens, x.drafts, x.num_drafts,
                                                 x.k_limit, x.block_tables, block_size=self.block_size,
                                                 max_model_len=self.max_model_len)  # fmt: skip
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, cu_seqlens_q=self._cu[key], block_tables=x.block_tables,
            cos=self.runner.cos, sin=self.runner.sin, max_q_len=k + 1, max_seq_len=self.max_model_len + k + 1,
            seq_lens=seq_lens, num_splits=self._splits[key], q_per_seq=k + 1,
        )  # fmt: skip
        return self.runner.forward_logits(ids, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for key in sorted(self._inputs, key=lambda bk: bk[0] * (bk[1] + 1), reverse=True):  # largest first
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # compiles the Triton kernels outside the capture
                if not self.drafter.in_verify_graph:
                    self._draft(key)
                self._forward(key)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if not self.drafter.in_verify_graph:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._draft(key)
                pool = graph.pool()
                self._draft_graphs[key] = graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[key] = self._forward(key)
            pool = graph.pool()
            self._graphs[key] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, batch: int) -> bool:
        return 1 <= batch <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, rows: list[int], ks: list[int], block_tables: list[list[int]], k: int):
        """One verify step: sequence i's tokens are hist[rows[i]], ks[i] drafts allowed (k = the ladder depth >=
        max(ks)) -> (the step's SpecInputs, logits [b * (k + 1), V], a view valid until the next run)."""
        batch = len(rows)
        if not self.fits(batch) or k not in self.ks:
            raise ValueError(f"batch {batch}, k {k}: no verify graph (batches 1..{self.sizes[-1]}, k in {self.ks})")
        b = next(s for s in self.sizes if s >= batch) if self.pad else batch
        key = (b, k)
        if key not in self._inputs:
            self._make_inputs(b, k)
        x = self._inputs[key]
        width = max(len(t) for t in block_tables)
        if width > self.width:
            raise ValueError(f"block_tables: {width} blocks > {self.width} that max_model_len allows")
        pad = b - batch
        flat = [0] * (b * width)
        for row, t in enumerate(block_tables):
            flat[row * width : row * width + len(t)] = t
        packed = torch.tensor(rows + [self.spec.spare] * pad + ks + [-1] * pad, dtype=torch.int64)
        self._packed[key].copy_(packed.view(2, b), non_blocking=True)
        x.block_tables[:, :width].copy_(torch.tensor(flat, dtype=torch.int32).view(b, width), non_blocking=True)
        if self.capture:
            if key in self._draft_graphs:
                self._draft_graphs[key].replay()
            self._graphs[key].replay()
            logits = self._logits[key]
        else:
            if not self.drafter.in_verify_graph:
                self._draft(key)
            logits = self._forward(key)
        return x, logits[: batch * (k + 1)]

    @torch.inference_mode()
    def measure_costs(self, decode_graphs: DecodeGraphs | None, replays: int = 3) -> dict[tuple[int, int], float]:
        """time(batch, K) / time(batch, 0) of the captured graphs (draft graph included), at the captured
        inputs (short contexts: the ratio of the weight-bound part of a step, which dominates it)."""
        if not self.capture or decode_graphs is None or not decode_graphs.capture:
            return {}

        def timed(replay) -> float:
            replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / replays

        table: dict[tuple[int, int], float] = {}
        for b in self.sizes:
            db = next((s for s in decode_graphs.sizes if s >= b), None)
            if db is None:
                continue
            # The decode graph captured for the longest context: the verify graphs' attention is launched for
            # max_model_len + k + 1 keys, so that is the decode step with the same launch shape.
            base = timed(decode_graphs.graph(db, decode_graphs.lengths[db][-1]).replay)
            for k in self.ks:
                key = (b, k)

                def step(key=key) -> None:
                    if key in self._draft_graphs:
                        self._draft_graphs[key].replay()
                    self._graphs[key].replay()

                table[key] = timed(step) / base
        return table
