"""N-gram prompt lookup for speculative decoding in one kernel: kernels/reference.py's ngram_propose
(about 30 small ops over a [B, window] gather, 0.16 ms per verify step on the H200 at batch 1) as one program per
sequence. Same rule, same outputs: the k tokens after the latest earlier occurrence (start >= len - window) of the
sequence's last n tokens, longest n first (n = max_ngram .. 1); count 0 when none occurs.

Floor: latency. A program reads max_ngram shifted copies of its window (3 x 2048 int64 = 48 KB) in a few tiles
whose loads are independent, then gathers k tokens; one launch inside the verify graph, a few µs.

The scan is indexed by the candidate's last token e rather than its start: run[e] counts how many tokens ending at
e equal the sequence's last tokens (h[e - j] == h[len - 1 - j], j = 0, 1, ..., capped at max_ngram), so one
vector per tile serves every n (an n-gram starts at e - n + 1 where run[e] >= n), and "longest n, then latest
start" is the maximum of one key, n * 2^40 + start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import check, check_tensor, next_pow2

# Candidate ends per tile: the default 2048-token window is two tiles of 1024 (8 int64 per thread and copy at
# 4 warps, no spills); a smaller window takes one tile of its own size.
BLOCK = 1024
_KEY_SHIFT = 40  # key = n << 40 | start: a start always fits (history rows are far shorter than 2^40)


@triton.jit
def _ngram_kernel(
    hist_ptr, rows_ptr, lens_ptr, drafts_ptr, count_ptr, limit_ptr,
    width, stride_h, window, k,
    MAX_NGRAM: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr, BLOCK_K: tl.constexpr,
    KEY_SHIFT: tl.constexpr, HAS_LIMIT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    n_tok = tl.load(lens_ptr + b).to(tl.int64)
    base = hist_ptr + row * stride_h
    offs = tl.arange(0, BLOCK)
    best_key = tl.full((), -1, tl.int64)
    for t in range(NUM_TILES):
        e = n_tok - window + t * BLOCK + offs  # candidate last tokens; a match must end before the newest token
        in_row = (e >= 0) & (e <= n_tok - 2)
        run = tl.zeros((BLOCK,), tl.int32)
        alive = in_row
        for j in tl.static_range(MAX_NGRAM):
            # Unmasked by `alive`, so the MAX_NGRAM loads of a tile issue together rather than one after another.
            tok = tl.load(base + (e - j), mask=in_row & (e >= j), other=0)
            tail = tl.load(base + tl.maximum(n_tok - 1 - j, 0))
            alive = alive & (e >= j) & (tok == tail)
            run += alive.to(tl.int32)
        for n in tl.static_range(1, MAX_NGRAM + 1):
            start = e - (n - 1)
            ok = (run >= n) & (start >= n_tok - window) & (start >= 0)
            key = tl.where(ok, (n << KEY_SHIFT) + start, -1)
            best_key = tl.maximum(best_key, tl.max(key, axis=0))
    found = best_key >= 0
    best_n = tl.where(found, best_key >> KEY_SHIFT, 0)
    best = tl.where(found, best_key & ((1 << KEY_SHIFT) - 1), -1)
    follow = best + best_n  # first proposed position (-1 when none: the gather below clamps as the torch rule does)
    count = tl.where(found, tl.minimum(tl.maximum(n_tok - follow, 0), k), 0)
    if HAS_LIMIT:  # at most max(limit, 0) drafts for this sequence (a negative limit: a padding row, none)
        count = tl.minimum(count, tl.maximum(tl.load(limit_ptr + b).to(tl.int64), 0))
    tl.store(count_ptr + b, count)
    j = tl.arange(0, BLOCK_K)
    pos = tl.minimum(tl.maximum(follow + j, 0), width - 1)
    drafts = tl.load(base + pos, mask=j < k, other=0)
    tl.store(drafts_ptr + b * k + j, drafts, mask=j < k)


def ngram_propose(hist: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, k: int, *, max_ngram: int,
                  window: int, block: int = BLOCK, limit: torch.Tensor | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """reference.ngram_propose in one launch: hist [S, L] int64, rows [B] (row of hist per sequence), lens [B] (its
    length, <= L) -> drafts [B, k] int64 and their count [B] int64, equal to the torch version's everywhere.
    Static shapes and no host reads (graph-safe). limit: [B], each count capped at max(limit, 0) as well (the
    verify step's k_limit). out: (drafts, count) to write, contiguous int64 [B, k] and [B] (the verify graph's
    own buffers: no copies after the launch); else fresh tensors.
    block: candidate ends per tile (a power of two; tests pass small ones to cover several tiles)."""
    check_tensor("hist", hist, ndim=2, dtypes=(torch.int64,))
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64), device=hist.device)
    check_tensor("lens", lens, ndim=1, dtypes=(torch.int32, torch.int64), device=hist.device)
    check(lens.shape == rows.shape, f"lens: shape {tuple(lens.shape)} != rows shape {tuple(rows.shape)}")
    check(k >= 0 and max_ngram >= 1 and window >= 1, f"k={k}, max_ngram={max_ngram}, window={window}: need k >= 0 "
          "and max_ngram, window >= 1")  # fmt: skip
    check(block >= 1 and block & (block - 1) == 0, f"block: {block} must be a power of two")
    batch, width = rows.shape[0], hist.shape[1]
    if limit is not None:
        check_tensor("limit", limit, ndim=1, dtypes=(torch.int32, torch.int64), device=hist.device)
        check(limit.shape == rows.shape, f"limit: shape {tuple(limit.shape)} != rows shape {tuple(rows.shape)}")
    if out is None:
        drafts = torch.empty(batch, k, dtype=torch.int64, device=hist.device)
        count = torch.empty(batch, dtype=torch.int64, device=hist.device)
    else:
        drafts, count = out
        check(drafts.shape == (batch, k) and drafts.dtype == torch.int64 and drafts.is_contiguous()
              and drafts.device == hist.device,
              f"out: drafts must be contiguous int64 [{batch}, {k}] on {hist.device}, got {drafts.dtype} "
              f"{list(drafts.shape)} on {drafts.device}")
        check(count.shape == (batch,) and count.dtype == torch.int64 and count.is_contiguous()
              and count.device == hist.device,
              f"out: count must be contiguous int64 [{batch}] on {hist.device}, got {count.dtype} "
              f"{list(count.shape)} on {count.device}")
    if batch == 0:
        return drafts, count
    window = min(window, width)
    tile = min(block, next_pow2(window))
    _ngram_kernel[(batch,)](
        hist, rows, lens, drafts, count, limit if limit is not None else count, width, hist.stride(0), window, k,
        MAX_NGRAM=max_ngram, BLOCK=tile, NUM_TILES=triton.cdiv(window, tile), BLOCK_K=next_pow2(max(k, 1)),
        KEY_SHIFT=_KEY_SHIFT, HAS_LIMIT=limit is not None, num_warps=4,
    )  # fmt: skip
    return drafts, count
