"""A speculative verify step's inputs in one launch: kernels/reference.py's `verify_inputs` (about
20 small torch ops: the newest tokens gathered from the history, the ids, positions, cache slots and lengths of
the k + 1 rows per sequence) as one program per sequence. Inside the verify graph each small op is a launch of
1-2 µs plus its gap, which the batch-1 step pays in full (verify/lab/journal-kernels.md, v16).

Same rule, same outputs, for sequences of at least one token (every live row, and the padding row, has one):
- num_drafts[b] <- min(num_drafts[b], max(max_model_len - seq_lens[b], 0)) (in place: no draft past the context);
- ids[b] = (hist[rows[b], seq_lens[b] - 1], drafts[b, 0..K-1]);
- positions[b, j] = min(seq_lens[b] - 1 + j, max_model_len - 1) (garbage rows stay inside the rotary tables);
- slots[b, j] = block_tables[b, position // PAGE]·PAGE + position % PAGE where j <= num_drafts[b],
  k_limit[b] >= 0 and the unclamped position is below max_model_len, else -1 (nothing written: a step chained past
  the end of a finishing sequence must not overwrite its last cached key);
- seq_lens_after[b] = seq_lens[b] + K (int32: the attention metadata's lengths after the step).

Floor: latency (a few hundred bytes per sequence); one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import check, check_tensor, next_pow2


@triton.jit
def _verify_inputs_kernel(
    hist_ptr, rows_ptr, seq_lens_ptr, drafts_ptr, num_drafts_ptr, k_limit_ptr, bt_ptr,
    ids_ptr, pos_ptr, slots_ptr, seq_after_ptr,
    stride_h, stride_bt, max_model_len,
    K: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(seq_lens_ptr + b).to(tl.int64)
    nd = tl.minimum(tl.load(num_drafts_ptr + b), tl.maximum(max_model_len - n, 0))
    tl.store(num_drafts_ptr + b, nd)
    j = tl.arange(0, BLOCK)
    j_ok = j <= K
    newest = tl.load(hist_ptr + row * stride_h + n - 1)
    draft = tl.load(drafts_ptr + b * K + j - 1, mask=(j >= 1) & j_ok, other=0)
    out = b * (K + 1) + j
    tl.store(ids_ptr + out, tl.where(j == 0, newest, draft), mask=j_ok)
    pos = tl.minimum(n - 1 + j, max_model_len - 1)
    block = tl.load(bt_ptr + b * stride_bt + pos // PAGE, mask=j_ok, other=0).to(tl.int64)
    valid = (j <= nd) & (tl.load(k_limit_ptr + b) >= 0) & (n - 1 + j < max_model_len)
    tl.store(pos_ptr + out, pos, mask=j_ok)
    tl.store(slots_ptr + out, tl.where(valid, block * PAGE + pos % PAGE, -1), mask=j_ok)
    tl.store(seq_after_ptr + b, (n + K).to(tl.int32))


def verify_inputs(hist: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor, k_limit: torch.Tensor, block_tables: torch.Tensor, *, block_size: int,
                  max_model_len: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """-> (ids [B·(K+1)] int64, positions [B·(K+1)] int64, slots [B·(K+1)] int64, seq_lens_after [B] int32), and
    num_drafts capped in place; K = drafts.shape[1]. hist [S, L] int64; rows, seq_lens, num_drafts, k_limit [B]
    int64; drafts [B, K] int64 contiguous; block_tables [B, W] int32 covering every position below max_model_len.
    Static shapes and no host reads (graph-safe)."""
    check_tensor("hist", hist, ndim=2, dtypes=(torch.int64,))
    dev = hist.device
    for name, t in (("rows", rows), ("seq_lens", seq_lens), ("num_drafts", num_drafts), ("k_limit", k_limit)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int64,), device=dev)
        check(t.shape == rows.shape and t.is_contiguous(), f"{name}: must be contiguous [{rows.shape[0]}]")
    check_tensor("drafts", drafts, ndim=2, dtypes=(torch.int64,), device=dev)
    batch, k = drafts.shape
    check(batch == rows.shape[0] and drafts.is_contiguous(), f"drafts: must be contiguous [{rows.shape[0]}, K]")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=dev)
    check(block_tables.shape[0] == batch, f"block_tables: {block_tables.shape[0]} rows for batch {batch}")
    check(block_size >= 1 and max_model_len >= 1, f"block_size {block_size}, max_model_len {max_model_len}: need ≥ 1")
    width = block_tables.shape[1]
    check(width * block_size >= max_model_len,
          f"block_tables: {width} blocks of {block_size} cannot hold max_model_len {max_model_len}")
    ids = torch.empty(batch * (k + 1), dtype=torch.int64, device=dev)
    positions = torch.empty_like(ids)
    slots = torch.empty_like(ids)
    seq_after = torch.empty(batch, dtype=torch.int32, device=dev)
    if batch:
        _verify_inputs_kernel[(batch,)](
            hist, rows, seq_lens, drafts, num_drafts, k_limit, block_tables, ids, positions, slots, seq_after,
            hist.stride(0), block_tables.stride(0), max_model_len,
            K=k, BLOCK=next_pow2(k + 1), PAGE=block_size, num_warps=1,
        )  # fmt: skip
    return ids, positions, slots, seq_after
