"""Verify steps captured as CUDA graphs, one per (batch, K) of a ladder (decoder.py launches them)."""

from __future__ import annotations

import torch

from envex.kernels.ops import AttentionMetadata
from envex.kernels.reference import verify_inputs
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs, num_splits_for
from envex.runtime.engine.spec.drafters import SpecInputs


class SpecGraphs:
    """Verify steps of B sequences x (K + 1) tokens, captured for a ladder of (batch, K) (decoder.py).

    Everything a step needs beyond a few host ints is derived on the device inside the graph: each row's length
    from SpecDecoder.lens (so the step may be launched before the host knows how many tokens the previous step
    appended), its newest token and the drafts from SpecDecoder.hist, positions, cache slots. Row b holds query
    rows b*(K+1) .. b*(K+1)+K: its newest token, then its drafts; rows past the row's proposed drafts (and
    padding sequences) compute garbage and write nothing into the KV cache. A drafter with its own model (a draft
    model) has a graph of its own per (batch, K), replayed first on the same static inputs. Recurrent state: the
    verify inputs of caches/state_slots.py.
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
        self._inputs: dict[tuple[int, int], SpecInputs] = {}
        self._packed: dict[tuple[int, int], torch.Tensor] = {}
        self._cu: dict[tuple[int, int], torch.Tensor] = {}
        self._splits: dict[tuple[int, int], int | None] = {}
        self._kv_heads = runner.model_config.num_key_value_heads
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
        self._hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.hidden: torch.Tensor | None = None  # the last run's [b (k + 1), H] (drafter.wants_hidden)
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
        inputs = verify_inputs
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
        if self.runner.states is not None:
            meta = self.runner.states.attach_verify(meta, key)
        if self.drafter.wants_hidden:  # an MTP drafter reads the target's hidden states of the accepted rows
            logits, self._hidden[key] = self.runner.forward_logits(ids, meta, with_hidden=True)
            return logits
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
    def run(self, rows: list[int], ks: list[int], block_tables: list[list[int]], k: int,
            state_slots: list[int] | None = None):  # fmt: skip
        """One verify step: sequence i's tokens are hist[rows[i]], ks[i] drafts allowed (k = the ladder depth >=
        max(ks)), state_slots[i] its live state slot (a model with recurrent state) -> (the step's SpecInputs,
        logits [b * (k + 1), V], a view valid until the next run)."""
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
        if self.runner.states is not None:
            self.runner.states.load_verify(key, state_slots)
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
        self.hidden = self._hidden.get(key)
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
