"""Runs the model for one scheduled step: builds the packed inputs and the attention metadata, returns logits.

The model file's forward is the only forward: eager steps call it directly, and on the triton backend a pure
decode step replays a CUDA graph that captured the same forward (cuda_graphs.py).

Under tensor parallelism every rank holds a ModelRunner over its shard. Rank 0's sends each step's host metadata
once (an `EagerPlan`, or a decode graph's positions and block tables) over the step channel and broadcasts the
input ids from its device (they may be tokens sampled there and never read by its host); the other ranks run the
same plan or replay the same graph from it (runtime/parallel/workers.py), so no layer waits on a host.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from envex.kernels.kv_quant_format import format_for, kv_bytes_per_token
from envex.kernels.ops import AttentionMetadata, LayerKVCache
from envex.runtime.config import ModelConfig
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
from envex.runtime.engine.caches.state_slots import StateSlots, has_state
from envex.runtime.engine.caches.window_kv import WindowBlocks
from envex.runtime.engine.config import MTP, EngineConfig
from envex.runtime.engine.device import fill_pending, upload
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.loader import LoadedModel
from envex.runtime.models import model_class
from envex.runtime.models.rope import rope_cos_sin
from envex.runtime.packed_load import build_device, load_model_weights
from envex.runtime.parallel.plan import EagerPlan
from envex.runtime.parallel.state import ParallelState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _column_major_weights(model: torch.nn.Module) -> None:
    """Store every matrix transposed in memory (same shape, column-major strides).

    F.linear(x, W) then runs BLAS on a contiguous [in, out] matrix, which at batch 1 reads memory at two to three
    times the rate of the row-major layout on the CPUs we measured (verify/lab/journal.md).
    """
    for param in model.parameters():
        if param.dim() == 2:
            param.data = param.data.t().contiguous().t()


@dataclass
class StepResult:
    # [N, V] float32: the last row of each chunk that completes its sequence, in chunk order
    logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor]  # chunk index -> [num_tokens, V] float32 (prompt logprobs only)
    hidden: torch.Tensor | None = None  # [T, H] every row's last hidden state after the final norm (on_hidden)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, *, extra_kv_bytes_per_block: int = 0,
                 parallel: ParallelState | None = None) -> None:  # fmt: skip
        """config: resolved (EngineConfig.resolved) for this device and model. extra_kv_bytes_per_block: what
        another cache indexed by the same blocks costs per block (a draft model's), out of the same budget.
        parallel: this rank of a tensor-parallel group (None: one device holds the whole model)."""
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block
        assert config.is_resolved and config.max_model_len is not None, "the engine passes a resolved config"
        self.config = config
        self.model_config: ModelConfig = loaded.config
        self.parallel = parallel if parallel is not None and parallel.world_size > 1 else None
        self.device = self.parallel.device if self.parallel is not None else torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        # Split-K partials only on one device: under tensor parallelism the next norm all-reduces its input first.
        self.ops = config.kernels.make(self.device, split_k=self.parallel is None)
        mc = self.model_config
        shard = self.parallel or ParallelState()
        self.num_kv_heads = shard.kv_heads(mc)  # this rank's KV heads: what its cache holds
        with torch.no_grad():
            extra = {"parallel": self.parallel} if self.parallel is not None else {}
            # a quantized checkpoint's model is built on the meta device: its float projections never take memory
            build = build_device(loaded, config.load_format, self.device, weights=config.weights,
                                 backend=config.kernels, world_size=shard.world_size)  # fmt: skip
            self.model = model_class(mc)(mc, dtype=self.dtype, device=build, **extra)
            # float, or low-bit projections kept packed (a quantized checkpoint, or quantized by config.weights)
            self.packed = load_model_weights(self.model, loaded, load_format=config.load_format, seed=config.seed,
                                             weights=config.weights, backend=config.kernels, device=self.device)
            if self.device.type == "cpu":
                _column_major_weights(self.model)
        self.max_model_len = config.max_model_len
        self.cos, self.sin = rope_cos_sin(mc, self.max_model_len, self.device)
        self.block_size = config.block_size
        # Recurrent layers (Qwen3-Next) keep per-sequence state in slots, allocated before the KV cache takes its
        # share of memory (state_slots.py).
        self.states = StateSlots(config, self.model, self.device, self.dtype) if has_state(self.model) else None
        # bf16: the unpacked cache in the activation dtype; fp8 / int4: packed (kv_quant_format.py)
        self.kv_format = format_for(config.kv_cache_dtype, mc.head_dim)
        if self.kv_format is not None:
            self.kv_format.check_head_dim(mc.head_dim)
        self.num_blocks = self._num_blocks()
        # Sliding-window layers (gpt-oss) keep their K/V in a pool sized for their windows (window_kv.py).
        self.windows = (WindowBlocks(config, mc, self.device, self.dtype, self.num_blocks)
                        if any(w is not None for w in mc.layer_windows) else None)  # fmt: skip
        # A model with a cache layout of its own (MLA: one latent row per token and layer) allocates it.
        own_caches = getattr(self.model, "make_kv_caches", None)
        self.kv_caches = own_caches(self.num_blocks, self.block_size, self.dtype, self.device) if own_caches else [
            self.windows.caches[i] if self.windows is not None and i in self.windows.caches else self._layer_cache()
            for i in range(mc.num_hidden_layers)
        ]
        if self.states is not None:
            self.states.place(self.kv_caches)
        self.decode_graphs: DecodeGraphs | None = None
        if config.use_cuda_graphs and self.device.type == "cuda":  # state slots too: a static input (cuda_graphs.py)
            self.decode_graphs = DecodeGraphs(self, max_batch=config.max_num_seqs,
                                              with_hidden=config.draft_model == MTP)  # fmt: skip
        # Set by an MTP drafter (spec/): called after each step with its chunks, the last hidden states after the
        # final norm of all their rows [T, H] (a decode graph's too: it keeps them for draft_model "mtp") and the
        # step's pending_tokens.
        self.on_hidden: Callable[[list[ScheduledChunk], torch.Tensor, torch.Tensor | None], None] | None = None

    def _layer_cache(self) -> LayerKVCache:
        """One layer's cache in the engine's pool, as the model passes it to Ops.attention: a (k, v) pair in the
        activation dtype, or a PackedKVCache and None."""
        mc = self.model_config
        if self.kv_format is not None:
            return self.kv_format.allocate(self.num_blocks, self.block_size, self.num_kv_heads, mc.head_dim,
                                           self.device), None  # fmt: skip
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))  # fmt: skip

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer of the engine's pool, in the configured kv_cache_dtype."""
        return kv_bytes_per_token(self.config.kv_cache_dtype, self.num_kv_heads, self.model_config.head_dim,
                                  dtype_bytes=torch.finfo(self.dtype).bits // 8)  # fmt: skip

    def _num_blocks(self) -> int:
        mc = self.model_config
        windowed = sum(w is not None for w in mc.layer_windows)  # in their own pool, reserved first
        reserved = WindowBlocks.bytes_for(self.config, mc, self.dtype) if windowed else 0
        # Blocks counted by bytes: a packed format's bytes per token (int4 at head_dim 64 or 128: 3.56x fewer than
        # bf16) give the same memory that many more blocks.
        bytes_per_block = ((mc.num_hidden_layers - windowed) * self.block_size * self.kv_bytes_per_token
                           + self.extra_kv_bytes_per_block)  # fmt: skip
        if hasattr(self.model, "kv_cache_bytes_per_block"):  # a cache layout of its own (make_kv_caches)
            bytes_per_block = (self.model.kv_cache_bytes_per_block(self.block_size, self.dtype)
                               + self.extra_kv_bytes_per_block)  # fmt: skip
        if self.config.num_kv_blocks is not None:
            blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            # What this process's allocator caches but no tensor holds is free for the cache too (an engine built
            # after other work in the same process, as in a test run, saw its budget go negative without this).
            # An engine dropped earlier in the process is freed by the cycle collector only (its runner and decode
            # graphs refer to each other): collect first, or its ~85% of the GPU still counts as used (H100,
            # 2026-12-07: the second engine of a GPU test got -5,438 blocks).
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total - reserved
            blocks = int(budget // bytes_per_block)
        else:
            blocks = int((self.config.kv_cache_memory_gb * 2**30 - reserved) // bytes_per_block)
        if self.parallel is not None:  # rank 0's block manager hands out ids every rank must hold
            blocks = self.parallel.min_across(blocks)
        needed = -(-self.max_model_len // self.block_size)
        if blocks < needed:
            raise ValueError(
                f"num_kv_blocks: {blocks} blocks of {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; lower --max-model-len or give the KV cache more memory"
            )
        return blocks

    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata, *, with_hidden: bool = False):
        """The whole model on a step whose every token needs logits (a decode step) -> [T, V] in the model dtype;
        with_hidden: (logits, the last hidden states after the final norm [T, H]), which an MTP drafter reads.
        What a CUDA graph captures."""
        if self.windows is not None:
            meta = self.windows.attach(meta)
        hidden, residual = self.model(self.ops, input_ids, self.kv_caches, meta)
        normed = self.model.final_hidden(self.ops, hidden, residual) if with_hidden else None
        logits = self.model.compute_logits(self.ops, hidden, residual)
        return (logits, normed) if with_hidden else logits

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], pending_tokens: torch.Tensor | None = None) -> StepResult:
        """pending_tokens: the previous step's sampled ids, still on the device; a sequence whose newest token is
        pending (seq.num_pending_tokens) reads it from row seq.pending_row there."""
        if self.windows is not None:
            self.windows.before_step(chunks)
        if self.states is not None:
            self.states.before_step(chunks)
        if self.decode_graphs is not None:  # a pure decode step replays a captured graph (with the slots just set)
            graph_logits = self.decode_graphs.run_chunks(chunks, pending_tokens)
            if graph_logits is not None:
                if self.on_hidden is not None and self.decode_graphs.hidden is not None:
                    self.on_hidden(chunks, self.decode_graphs.hidden, pending_tokens)
                return StepResult(logits=graph_logits, prompt_logits={})
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        fill_at: list[int] = []  # rows of `ids` whose token is pending on the device
        fill_from: list[int] = []
        ends: list[int] = []
        prompt_rows: dict[int, tuple[int, int]] = {}
        bs = self.block_size
        for i, c in enumerate(chunks):
            tokens = c.seq.all_token_ids[c.start:c.start + c.num_tokens]
            if len(tokens) < c.num_tokens:  # the chunk ends on the sequence's pending token
                assert pending_tokens is not None and len(tokens) == c.num_tokens - 1, "pending token without source"
                fill_at.append(len(ids) + len(tokens))
                fill_from.append(c.seq.pending_row)
                tokens = tokens + [0]
            if c.seq.params.prompt_logprobs is not None and c.start < len(c.seq.prompt_token_ids):
                prompt_rows[i] = (len(ids), len(ids) + c.num_tokens)
            ids.extend(tokens)
            if c.completes:
                ends.append(len(ids) - 1)
            for p in range(c.start, c.start + c.num_tokens):
                positions.append(p)
                slots.append(c.seq.block_table[p // bs] * bs + p % bs)
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = [c.seq.block_table + [0] * (max_blocks - len(c.seq.block_table)) for c in chunks]
        plan = EagerPlan(ids, positions, slots, [c.num_tokens for c in chunks],
                         [c.start + c.num_tokens for c in chunks], tables, ends, prompt_rows)  # fmt: skip
        input_ids = upload(ids, torch.int64, self.device)
        if fill_at:
            assert pending_tokens is not None
            fill_pending(input_ids, fill_at, fill_from, pending_tokens)
        result = self.run_plan(plan, input_ids)
        if self.on_hidden is not None and result.hidden is not None:
            self.on_hidden(chunks, result.hidden, pending_tokens)
        return result

    def run_plan(self, plan: EagerPlan, input_ids: torch.Tensor | None = None) -> StepResult:
        """Run an eager step. Under tensor parallelism rank 0 (with input_ids) first sends the plan and its ids to
        the other ranks, which call this without ids (workers.follow)."""
        par = self.parallel
        if par is not None:
            assert par.comm is not None and par.channel is not None
            if par.is_driver:
                par.channel.send_eager(plan.pack())
            else:
                input_ids = torch.empty(len(plan.positions), dtype=torch.int64, device=self.device)
            assert input_ids is not None
            par.comm.broadcast(input_ids)
        assert input_ids is not None
        q_lens, seq_lens = plan.q_lens, plan.seq_lens
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            positions=upload(plan.positions, torch.int64, self.device),
            slot_mapping=upload(plan.slots, torch.int64, self.device),
            cu_seqlens_q=upload(cu, torch.int32, self.device),
            block_tables=upload(plan.tables, torch.int32, self.device),
            cos=self.cos, sin=self.sin, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
            seq_lens=upload(seq_lens, torch.int32, self.device), q_lens_host=q_lens, seq_lens_host=seq_lens,
        )  # fmt: skip
        if self.windows is not None:
            meta = self.windows.attach(meta)
        if self.states is not None:
            meta = self.states.attach(meta)
        hidden, residual = self.model(self.ops, input_ids, self.kv_caches, meta)
        hidden = self.ops.materialize(hidden, residual.dtype)  # rows are picked from it below
        normed = self.model.final_hidden(self.ops, hidden, residual) if self.on_hidden is not None else None
        logits = hidden.new_zeros((0, 0))
        if plan.ends:
            rows = upload(plan.ends, torch.int64, self.device)
            logits = self.model.compute_logits(self.ops, hidden[rows], residual[rows]).float()
        prompt_logits = {
            i: self.model.compute_logits(self.ops, hidden[a:b], residual[a:b]).float()
            for i, (a, b) in plan.prompt_rows.items()
        }
        return StepResult(logits=logits, prompt_logits=prompt_logits, hidden=normed)
