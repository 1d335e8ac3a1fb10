"""Per-step attention metadata: built once per step by the model runner, only read by layers and kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache.

    Tokens of all sequences are packed: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; they sit at
    positions seq_lens[b] - q_len_b .. seq_lens[b] - 1 and attend causally to cached keys 0 .. their position.
    A sequence's cached tokens live in blocks block_tables[b, :ceil(seq_lens[b] / block_size)].
    """

    is_decode: bool  # every sequence has exactly one query token
    slot_mapping: torch.Tensor  # int64 [T]: where each new token's K/V is written (block * block_size + offset)
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]: cached tokens after this step's writes
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    max_q_len: int
    max_seq_len: int
    scale: float
    # Torch backend only (None for the Triton backend): a dense gather of each sequence's cache, built on the host.
    kv_slots: torch.Tensor | None = None  # int64 [B, max_seq_len]: cache slot of each key (0 where padded)
    q_index: torch.Tensor | None = None  # int64 [B, max_q_len]: packed row of each padded query (0 where padded)
    q_rows: torch.Tensor | None = None  # int64 [T]: for each packed row, its index in the flattened [B * max_q_len]
    attn_mask: torch.Tensor | None = None  # bool [B, 1, max_q_len, max_seq_len]: True where attention is allowed
