"""Runs the model for one scheduled step: builds the packed inputs and attention metadata, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from envex.runtime.config import ModelConfig
from envex.runtime.engine.attention import AttentionMetadata
from envex.runtime.engine.config import EngineConfig
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.engine.torch_ops import TorchOps
from envex.runtime.loader import LoadedModel
from envex.runtime.models import model_class
from envex.runtime.models.llama import rope_cos_sin

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no CUDA device is visible; use --device cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def pick_ops(backend: str, device: torch.device):  # -> TorchOps | TritonOps
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TorchOps()
    if device.type != "cuda":
        raise ValueError("backend: triton needs a CUDA device; use --backend torch on cpu")
    from envex.kernels.ops import TritonOps  # imported only on CUDA: the kernels need a GPU (or the interpreter)

    return TritonOps()


def _column_major_weights(model: torch.nn.Module) -> None:
    """Store every matrix transposed in memory (same shape, column-major strides).

    F.linear(x, W) then runs BLAS on a contiguous [in, out] matrix, which at batch 1 reads memory at two to three
    times the rate of the row-major layout on the CPUs we measured (offline_docs/benchmarks.md).
    """
    for param in model.parameters():
        if param.dim() == 2:
            param.data = param.data.t().contiguous().t()


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device's queue (a blocking copy from pageable
    memory would first drain the stream, and with it the overlap of host and device work)."""
    t = torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


def fill_pending(input_ids: torch.Tensor, rows: list[int], src_rows: list[int], src: torch.Tensor) -> None:
    """input_ids[rows] = src[src_rows], on the device: tokens the previous step sampled that the host has not read
    (overlapped scheduling). The steady state, the same decode batch as the last step in the same order, is one
    copy."""
    if rows == src_rows == list(range(len(rows))):
        input_ids[:len(rows)].copy_(src[:len(rows)])
    else:
        dev = input_ids.device
        input_ids.index_copy_(0, upload(rows, torch.int64, dev),
                              src.index_select(0, upload(src_rows, torch.int64, dev)))


@dataclass
class StepResult:
    # [N, V] float32: per chunk that completes its sequence, in chunk order, 1 + num_draft rows
    logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor]  # chunk index -> [num_tokens, V] float32 (prompt logprobs only)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> None:
        self.config = config
        self.model_config: ModelConfig = loaded.config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.ops = pick_ops(config.backend, self.device)
        mc = self.model_config
        with torch.no_grad():
            self.model = model_class(mc)(mc, dtype=self.dtype, device=self.device)
            self.model.load_weights(loaded.iter_weights())
            if self.device.type == "cpu":
                _column_major_weights(self.model)
        self.cos, self.sin = rope_cos_sin(mc, max_model_len, self.device)
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks(max_model_len)
        shape = (self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(mc.num_hidden_layers)
        ]
        self.scale = mc.head_dim ** -0.5
        self.decode_graphs = self._decode_graphs(max_model_len)

    def _decode_graphs(self, max_model_len: int):  # -> DecodeGraphs | None
        """CUDA-graph decode steps (runtime/engine/cuda_graphs.py) for the Triton backend, when the model has one."""
        if not (self.config.use_cuda_graphs and self.device.type == "cuda" and self.ops.name == "triton"):
            return None
        from envex.runtime.engine.cuda_graphs import DecodeGraphs, supports

        if not supports(self.model_config):
            return None
        return DecodeGraphs(self.model, self.model_config, self.kv_caches, self.cos, self.sin,
                            max_batch=self.config.max_num_seqs, max_model_len=max_model_len)

    def _num_blocks(self, max_model_len: int) -> int:
        mc = self.model_config
        bytes_per_block = (2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim
                           * torch.finfo(self.dtype).bits // 8)
        if self.config.num_kv_blocks is not None:
            blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
            blocks = int(budget // bytes_per_block)
        else:
            blocks = int(self.config.kv_cache_memory_gb * 2**30 // bytes_per_block)
        needed = -(-max_model_len // self.block_size)
        if blocks < needed:
            raise ValueError(
                f"num_kv_blocks: {blocks} blocks of {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len={max_model_len}; lower --max-model-len or give the KV cache more memory"
            )
        return blocks

    def _metadata(self, chunks: list[ScheduledChunk], slot_mapping: torch.Tensor) -> AttentionMetadata:
        q_lens = [c.num_tokens for c in chunks]
        seq_lens = [c.start + c.num_tokens for c in chunks]
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = [c.seq.block_table + [0] * (max_blocks - len(c.seq.block_table)) for c in chunks]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            is_decode=all(n == 1 for n in q_lens),
            slot_mapping=slot_mapping,
            cu_seqlens_q=upload(cu, torch.int32, self.device),
            seq_lens=upload(seq_lens, torch.int32, self.device),
            block_tables=upload(tables, torch.int32, self.device),
            max_q_len=max(q_lens),
            max_seq_len=max(seq_lens),
            scale=self.scale,
        )
        if isinstance(self.ops, TorchOps):
            self._torch_gather(meta, chunks, q_lens, seq_lens)
        return meta

    def _torch_gather(self, meta: AttentionMetadata, chunks: list[ScheduledChunk], q_lens: list[int],
                      seq_lens: list[int]) -> None:
        """Dense per-sequence views of the paged cache for the reference attention (host-built, small)."""
        bs = self.block_size
        b, max_q, max_s = len(chunks), meta.max_q_len, meta.max_seq_len
        pos = torch.arange(max_s)
        tables = meta.block_tables.cpu().long()  # [B, max_blocks]
        kv_slots = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1).expand(b, -1)) * bs + pos % bs
        seq_t = torch.tensor(seq_lens)
        q_t = torch.tensor(q_lens)
        starts = torch.tensor([0] + q_lens[:-1]).cumsum(0)
        qi = torch.arange(max_q)
        q_valid = qi[None, :] < q_t[:, None]  # [B, Q]
        q_index = torch.where(q_valid, starts[:, None] + qi[None, :], 0)
        q_pos = (seq_t - q_t)[:, None] + qi[None, :]  # [B, Q] absolute position of each query
        mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < seq_t[:, None, None])
        mask &= q_valid[:, :, None]
        mask[:, :, 0] |= ~q_valid  # padded query rows attend to one key so softmax stays finite
        dev = self.device
        meta.kv_slots = torch.where(pos[None, :] < seq_t[:, None], kv_slots, 0).to(dev)
        meta.q_index = q_index.to(dev)
        meta.q_rows = q_valid.reshape(-1).nonzero().squeeze(1).to(dev)
        meta.attn_mask = mask.unsqueeze(1).to(dev)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], pending_tokens: torch.Tensor | None = None) -> StepResult:
        """pending_tokens: the previous step's sampled ids, still on the device; a sequence whose newest token is
        pending (seq.num_pending_tokens) reads it from row seq.pending_row there."""
        if self.decode_graphs is not None:  # a pure decode step replays a captured graph
            graph_logits = self.decode_graphs.run_chunks(chunks, pending_tokens)
            if graph_logits is not None:
                return StepResult(logits=graph_logits, prompt_logits={})
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        fill_at: list[int] = []  # rows of `ids` whose token is pending on the device
        fill_from: list[int] = []
        bs = self.block_size
        for c in chunks:
            known = c.seq.all_token_ids + c.seq.draft_token_ids if c.num_draft else c.seq.all_token_ids
            tokens = known[c.start:c.start + c.num_tokens]
            if len(tokens) < c.num_tokens:  # the chunk ends on the sequence's pending token
                assert pending_tokens is not None and len(tokens) == c.num_tokens - 1, "pending token without source"
                fill_at.append(len(ids) + len(tokens))
                fill_from.append(c.seq.pending_row)
                tokens = tokens + [0]
            ids.extend(tokens)
            for p in range(c.start, c.start + c.num_tokens):
                positions.append(p)
                slots.append(c.seq.block_table[p // bs] * bs + p % bs)
        input_ids = upload(ids, torch.int64, self.device)
        if fill_at:
            assert pending_tokens is not None
            fill_pending(input_ids, fill_at, fill_from, pending_tokens)
        meta = self._metadata(chunks, upload(slots, torch.int64, self.device))
        hidden = self.model(self.ops, input_ids, upload(positions, torch.int64, self.device), self.cos, self.sin,
                            self.kv_caches, meta)
        ends, prompt_rows = [], {}
        offset = 0
        for i, c in enumerate(chunks):
            if c.seq.params.prompt_logprobs is not None and c.start < len(c.seq.prompt_token_ids):
                prompt_rows[i] = (offset, offset + c.num_tokens)
            offset += c.num_tokens
            if c.completes:  # the last row, or with drafts the last 1 + num_draft rows (each verifies one)
                ends.extend(range(offset - 1 - c.num_draft, offset))
        logits = (self.model.compute_logits(hidden[upload(ends, torch.int64, self.device)]).float() if ends
                  else hidden.new_zeros((0, 0)))
        prompt_logits = {
            i: self.model.compute_logits(hidden[a:b]).float() for i, (a, b) in prompt_rows.items()
        }
        return StepResult(logits=logits, prompt_logits=prompt_logits)
