"""CUDA-graph decode for the Triton backend: one captured step per batch size of a ladder.

A decode step of B sequences runs the graph of the smallest ladder size ≥ B; the extra rows are padding
(inactive: they write nothing into the KV cache, and their logits are dropped). The step itself is
envex.kernels.fused_decode.FusedDecoder: at batch 1 the projections are GEMVs with the norms and SwiGLU folded
in, chained with programmatic dependent launch; above that, cuBLAS matmuls and the fused Triton norms. Host work
per step is three small copies into the graph's static inputs; sampling stays with the engine's sampler.

All graphs share one memory pool (captured largest first), so the ladder costs about one step's activations.
"""

from __future__ import annotations

import torch

from envex.kernels.fused_decode import DecodeShape, DecodeState, FusedDecoder, splits_for
from envex.runtime.config import ModelConfig
from envex.runtime.engine.model_runner import fill_pending

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_ladder(max_batch: int, ladder: tuple[int, ...] = DEFAULT_LADDER) -> tuple[int, ...]:
    """The ladder's sizes up to max_batch, plus max_batch itself so every batch the scheduler forms fits."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    return tuple(sorted({b for b in ladder if b < max_batch} | {max_batch}))


def supports(config: ModelConfig) -> bool:
    """The fused step covers dense Llama-family layers without QKV bias or q/k norms (Llama, Mistral, SmolLM2)."""
    return not config.attention_bias and not config.qk_norm


class DecodeGraphs:
    def __init__(self, model, config: ModelConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 cos: torch.Tensor, sin: torch.Tensor, *, max_batch: int, max_model_len: int,
                 capture: bool = True, gemv_configs: dict | None = None) -> None:  # fmt: skip
        """capture=False runs the same step eagerly (for CPU tests under the Triton interpreter)."""
        if not supports(config):
            raise ValueError(f"model: {config.architecture} with QKV bias or q/k norm has no fused decode step; "
                             "run it with use_cuda_graphs=False")  # fmt: skip
        self.device = kv_caches[0][0].device
        self.block_size = kv_caches[0][0].shape[1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        self.sizes = graph_ladder(max_batch)
        self.capture = capture
        shape = DecodeShape(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                            head_dim=config.head_dim, hidden_size=config.hidden_size,
                            eps=config.rms_norm_eps)  # fmt: skip
        cuda = self.device.type == "cuda"
        self._states: dict[int, DecodeState] = {}
        self._decoders: dict[int, FusedDecoder] = {}
        self._splits: dict[int, int] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        for b in self.sizes:
            self._states[b] = DecodeState(b, self.max_blocks, self.device)
            self._decoders[b] = FusedDecoder(model, shape, kv_caches, cos, sin, gemv_configs=gemv_configs,
                                             use_gemv=b == 1, pdl=cuda and b == 1)  # fmt: skip
            self._splits[b] = splits_for(b, shape.num_kv_heads, max_model_len, self.device)
        if capture:
            self._capture_all()

    def _forward(self, b: int) -> torch.Tensor:
        return self._decoders[b].forward(self._states[b], self._splits[b], self.max_model_len)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for b in sorted(self.sizes, reverse=True):  # largest first: the others fit in its pool
            state = self._states[b]
            state.active.zero_()  # warm-up and capture must not write into live KV blocks
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(b)  # compiles the Triton kernels outside the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, batch: int) -> bool:
        return 1 <= batch <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]],
            fill: tuple[list[int], list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """One decode token for each of B sequences -> logits [B, V] (a view of the graph's static output: use
        it before the next run). fill = (rows, source rows, source): input_ids[rows] come from the device tensor
        source[source rows] instead (tokens sampled by the previous step that the host has not read)."""
        batch = len(input_ids)
        if not self.fits(batch):
            raise ValueError(f"batch: {batch} sequences, the largest captured decode graph takes {self.sizes[-1]}")
        b = next(s for s in self.sizes if s >= batch)
        state = self._states[b]
        width = max(len(t) for t in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"block_tables: {width} blocks > {self.max_blocks} that max_model_len allows")
        pad = b - batch
        ids = torch.tensor(input_ids + [0] * pad, dtype=torch.int64)
        pos = torch.tensor(positions + [0] * pad, dtype=torch.int64)
        active = torch.tensor([True] * batch + [False] * pad)
        flat = [0] * (b * width)  # one host tensor for all tables: per-row tensors cost ~5 us each
        for row, t in enumerate(block_tables):
            flat[row * width : row * width + len(t)] = t
        tables = torch.tensor(flat, dtype=torch.int32).view(b, width)
        # Only the first `width` columns matter: kernels read a sequence's table up to its own length.
        state.input_ids.copy_(ids, non_blocking=True)
        state.positions.copy_(pos, non_blocking=True)
        state.active.copy_(active, non_blocking=True)
        state.block_tables[:, :width].copy_(tables, non_blocking=True)
        if fill is not None:
            fill_pending(state.input_ids, *fill)
        if self.capture:
            self._graphs[b].replay()
            logits = self._logits[b]
        else:
            logits = self._forward(b)
        return logits[:batch]

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
