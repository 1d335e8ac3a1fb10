"""A whole decode step of a dense Llama-family model on the Triton kernels, built to be captured in a CUDA graph.

At batch 1 each layer reads its weights once in five kernels and a split merge: QKV GEMV (add + RMSNorm folded
in), decode attention with rotary and the KV write folded in (decode_attention.py) and its split-merge kernel
(the unfused chain of rotary + KV write and attention stays selectable), O GEMV, gate-up GEMV (add + RMSNorm
folded in), down GEMV (SwiGLU folded in). Above one row the projections are cuBLAS matmuls and the norms the fused
Triton kernels. The step ends with the LM head, greedy argmax on the device, and the bookkeeping for the next
step (position, slot, sequence length), so a captured graph can be replayed token after token with no host work
or sync.

The model object only needs the Llama parameter names of envex.runtime.models.llama (embed_tokens_weight,
layers[i].{input_layernorm,qkv_proj,o_proj,post_attention_layernorm,gate_up_proj,down_proj}_weight, norm_weight,
lm_head_weight); biases and q/k norms (Qwen2/3) are not on this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from envex.kernels import attention, decode_attention, gemv, rotary
from envex.kernels.ops import TritonOps


@dataclass(frozen=True, kw_only=True)
class DecodeShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    eps: float

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


class DecodeState:
    """Device buffers a decode step reads and advances in place (what a CUDA graph captures by address)."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)  # position of the token fed in
        self.block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        # False for padding rows of a graph batch: they compute garbage but write nothing into the KV cache.
        self.active = torch.ones(batch, dtype=torch.bool, device=device)


# Decode attention reads q/k/v straight from the QKV output and does rotary + the KV write itself (one launch
# fewer per layer). Shown equal to the unfused kernels under the interpreter (tests/test_kernels_attention.py).
FUSE_ROTARY_ATTENTION = True
# The key splits are merged by the last split program to finish (a per-(sequence, KV head) counter) instead of a
# second launch. Off: correct on the H200 (a 400-launch race probe per regime found no mismatch) but slower there,
# 5.8 us per layer at 1K and 11.7 at 10K, because the last split merges 16-64 partials alone (NOTES.md, v7).
MERGE_SPLITS_IN_KERNEL = False


class FusedDecoder:
    def __init__(self, model, shape: DecodeShape, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 cos: torch.Tensor, sin: torch.Tensor, *, gemv_configs: dict[tuple[int, int, int], tuple] | None = None,
                 use_gemv: bool = True, pdl: bool = False, attn_kwargs: dict | None = None,
                 fuse_rotary_attention: bool = FUSE_ROTARY_ATTENTION,
                 merge_splits_in_kernel: bool = MERGE_SPLITS_IN_KERNEL) -> None:  # fmt: skip
        """gemv_configs: (N, K, prologue) -> (BLOCK_N, BLOCK_K, num_warps), tuned by kernels/bench_h200.py.
        pdl: chain the batch-1 kernels with programmatic dependent launch (each waits on its predecessor).
        attn_kwargs: extra decode attention options (block_n, num_warps, num_stages).
        fuse_rotary_attention: decode_attention.decode_attention_fused instead of rotary_and_store_kv followed by
        paged_attention. merge_splits_in_kernel (fused path only): merge the key splits inside that launch."""
        self.model = model
        self.shape = shape
        self.kv_caches = kv_caches
        self.cos, self.sin = cos, sin
        self.block_size = kv_caches[0][0].shape[1]
        self.gemv_configs = gemv_configs or {}
        self.use_gemv = use_gemv
        self.pdl = pdl
        self.attn_kwargs = attn_kwargs or {}
        self.fuse_rotary_attention = fuse_rotary_attention
        self.merge_splits_in_kernel = merge_splits_in_kernel
        # Split-merge counters, one zeroed int32 buffer per batch size shared by every layer (each launch leaves
        # it at zero). Allocated by the first forward at that size: the eager warm-up before a graph capture.
        self._split_counters: dict[int, torch.Tensor] = {}
        self.ops = TritonOps()

    def _gemv(self, a: torch.Tensor, w: torch.Tensor, prologue: int = gemv.PROLOGUE_NONE,
              **kw) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        key = (w.shape[0], w.shape[1], gemv.PROLOGUE_ADD_RMS if prologue == gemv.PROLOGUE_RMS else prologue)
        return gemv.gemv(a, w, prologue=prologue, config=self.gemv_configs.get(key), pdl=self.pdl, **kw)

    def forward(self, state: DecodeState, num_splits: int, max_seq_len: int) -> torch.Tensor:
        """One token per sequence at state.positions -> logits [B, V]. Writes this token's K/V into the cache."""
        s, m = self.shape, self.model
        batch = state.input_ids.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        bs = self.block_size
        slots = state.block_tables.gather(1, (state.positions // bs)[:, None])[:, 0].long() * bs + state.positions % bs
        slots = torch.where(state.active, slots, -1)  # a negative slot skips the cache write
        seq_lens = None if self.fuse_rotary_attention else (state.positions + 1).to(torch.int32)
        counters = None
        if self.fuse_rotary_attention and self.merge_splits_in_kernel:
            counters = self._split_counters.get(batch)
            if counters is None:
                counters = decode_attention.new_split_counters(batch, s.num_kv_heads, state.positions.device)
                self._split_counters[batch] = counters
        one_row = batch == 1 and self.use_gemv
        x = m.embed_tokens_weight[state.input_ids]  # [B, H]
        h = None
        for layer, (k_cache, v_cache) in zip(m.layers, self.kv_caches, strict=True):
            if one_row:
                if h is None:
                    qkv, _ = self._gemv(x, layer.qkv_proj_weight, prologue=gemv.PROLOGUE_RMS,
                                        norm_weight=layer.input_layernorm_weight, eps=s.eps)  # fmt: skip
                    h = x
                else:
                    qkv, h = self._gemv(x, layer.qkv_proj_weight, prologue=gemv.PROLOGUE_ADD_RMS, b=h,
                                        norm_weight=layer.input_layernorm_weight, eps=s.eps)  # fmt: skip
            else:
                if h is None:
                    normed, h = self.ops.rms_norm(x, layer.input_layernorm_weight, s.eps), x
                else:
                    normed, h = self.ops.add_rms_norm(x, h, layer.input_layernorm_weight, s.eps)
                qkv = normed @ layer.qkv_proj_weight.t()
            pdl = self.pdl and one_row
            if self.fuse_rotary_attention:
                attn = decode_attention.decode_attention_fused(
                    qkv, state.positions, slots, self.cos, self.sin, k_cache, v_cache, state.block_tables,
                    s.head_dim**-0.5, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, max_seq_len=max_seq_len,
                    num_splits=num_splits, merge_in_kernel=self.merge_splits_in_kernel, counters=counters, pdl=pdl,
                    **self.attn_kwargs,
                ).view(batch, q_size)  # fmt: skip
            else:
                q = qkv[:, :q_size].view(batch, s.num_heads, s.head_dim)  # [B, Hq, D] views of the fused output
                k = qkv[:, q_size : q_size + kv_size].view(batch, s.num_kv_heads, s.head_dim)
                v = qkv[:, q_size + kv_size :].view(batch, s.num_kv_heads, s.head_dim)
                q, _ = rotary.rotary_and_store_kv(q, k, v, state.positions, self.cos, self.sin, k_cache, v_cache,
                                                  slots, pdl=pdl)  # fmt: skip
                attn = attention.paged_attention(
                    q, k_cache, v_cache, state.cu_seqlens_q, seq_lens, state.block_tables, s.head_dim**-0.5,
                    max_q_len=1, max_seq_len=max_seq_len, num_splits=num_splits, pdl=pdl, **self.attn_kwargs,
                ).view(batch, q_size)  # fmt: skip
            if one_row:
                o, _ = self._gemv(attn, layer.o_proj_weight)
                gu, h = self._gemv(o, layer.gate_up_proj_weight, prologue=gemv.PROLOGUE_ADD_RMS, b=h,
                                   norm_weight=layer.post_attention_layernorm_weight, eps=s.eps)  # fmt: skip
                x, _ = self._gemv(gu, layer.down_proj_weight, prologue=gemv.PROLOGUE_SILU_MUL)
            else:
                o = attn @ layer.o_proj_weight.t()
                normed, h = self.ops.add_rms_norm(o, h, layer.post_attention_layernorm_weight, s.eps)
                x = self.ops.silu_and_mul(normed @ layer.gate_up_proj_weight.t()) @ layer.down_proj_weight.t()
        if one_row:
            logits, _ = self._gemv(x, m.lm_head_weight, prologue=gemv.PROLOGUE_ADD_RMS, b=h,
                                   norm_weight=m.norm_weight, eps=s.eps)  # fmt: skip
        else:
            normed, _ = self.ops.add_rms_norm(x, h, m.norm_weight, s.eps)
            logits = normed @ m.lm_head_weight.t()
        return logits

    def greedy_step(self, state: DecodeState, num_splits: int, max_seq_len: int, out_tokens: torch.Tensor,
                    step: torch.Tensor) -> None:  # fmt: skip
        """forward + argmax on the device; the chosen token becomes the next input and is stored at out_tokens[:,
        step]. Everything stays on the GPU (no .item()), so replays of a captured step need no host sync."""
        logits = self.forward(state, num_splits, max_seq_len)
        nxt = torch.argmax(logits, dim=-1)  # [B]
        out_tokens.index_copy_(1, step, nxt[:, None])
        state.input_ids.copy_(nxt)
        state.positions.add_(1)
        step.add_(1)


@torch.inference_mode()
def prefill(model, shape: DecodeShape, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
            sin: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int,
            max_seq_len: int, attn_kwargs: dict | None = None) -> torch.Tensor:  # fmt: skip
    """Packed (chunked) prefill through TritonOps + cuBLAS -> logits [B, V] of each sequence's last token.
    attn_kwargs: extra paged_attention options (block_m, block_n, num_warps, num_stages)."""
    ops, s = TritonOps(), shape
    q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    tokens = input_ids.shape[0]
    x = model.embed_tokens_weight[input_ids]  # [T, H]
    h = None
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        if h is None:
            normed, h = ops.rms_norm(x, layer.input_layernorm_weight, s.eps), x
        else:
            normed, h = ops.add_rms_norm(x, h, layer.input_layernorm_weight, s.eps)
        qkv = normed @ layer.qkv_proj_weight.t()  # [T, q + 2kv]
        q = qkv[:, :q_size].view(tokens, s.num_heads, s.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, s.num_kv_heads, s.head_dim)
        v = qkv[:, q_size + kv_size :].view(tokens, s.num_kv_heads, s.head_dim)
        q, _ = ops.rotary_and_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
        attn = attention.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                         s.head_dim**-0.5, max_q_len=max_q_len, max_seq_len=max_seq_len,
                                         **(attn_kwargs or {}))  # fmt: skip
        o = attn.view(tokens, q_size) @ layer.o_proj_weight.t()
        normed, h = ops.add_rms_norm(o, h, layer.post_attention_layernorm_weight, s.eps)
        x = ops.silu_and_mul(normed @ layer.gate_up_proj_weight.t()) @ layer.down_proj_weight.t()
    last = (cu_seqlens_q[1:] - 1).long()
    normed, _ = ops.add_rms_norm(x[last], h[last], model.norm_weight, s.eps)
    return normed @ model.lm_head_weight.t()


def splits_for(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device, **kw) -> int:
    return attention.choose_num_splits(batch, num_kv_heads, max_seq_len, device, **kw)
