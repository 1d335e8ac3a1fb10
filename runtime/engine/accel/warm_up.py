"""The warm-up's step shapes: chosen so that every Triton kernel variant a served step can meet is compiled at start.

Triton compiles a kernel once per key: its constexprs, its arguments' dtypes, and for each integer argument not
marked do_not_specialize whether it is 1 or divisible by 16 (pointers: 16-byte alignment). The kernels leave the
integers that vary between steps unspecialised and pad their per-step scratch buffers (verify/lab/journal-kernels.md,
"Compile keys"), so all that still varies between steps is what the launchers choose from a step's shape:

- from the longest query chunk (max_q_len): attention's short-query path (≤ 4 tokens: key splits, no causal
  split), its BLOCK_M (next power of two of max_q_len·GQA group, 16..128) and long-prompt tiles (≥ 4096); the
  MoE's GEMV (≤ 4 tokens) or tile rows (tokens·top_k against 16 and 128 times the experts); the deterministic
  matmul's tile (rows ≤ 16, ≤ 64, < 2048, more) and the one-row GEMV and programmatic dependent launch (one row);
- from the batch and the longest sequence: the number of key splits of a short query, a power of two
  (attention.choose_num_splits);
- from the chunks that complete: the rows of the LM head.

Each of those is a threshold at a power of two, at 4, or between powers of two, so each quantity is taken through
every power of two up to its limit (and 1..8): every class of every threshold then occurs. CUDA-graph and
speculative verify steps are compiled when their graphs are captured, at start; these steps run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SHORT_QUERY = 4  # the longest chunk that takes attention's (and the MoE's) short-query path, kernels/attention.py
PROMPT_LOGITS_ROWS = 128  # chunks up to this long also compute prompt logits: the LM head at > 64 rows


@dataclass(frozen=True)
class WarmStep:
    """One step: each chunk as (query tokens, sequence length after the step), the chunk ending its sequence."""

    chunks: tuple[tuple[int, int], ...]
    prompt_logits: bool = False


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(0, limit).bit_length()) if 1 << i <= limit]


def warm_up_steps(*, max_num_batched_tokens: int, max_num_seqs: int, max_len: int,
                  split_counts: Callable[[int, int, int], object] | None = None) -> list[WarmStep]:  # fmt: skip
    """The steps for an engine with this token budget and batch limit, whose sequences may reach max_len tokens
    (the smaller of max_model_len and what the KV cache holds for one sequence). split_counts(batch, query,
    length): the key-split counts the launchers choose for a step of `batch` chunks of `query` tokens at that
    length (the only choice the length makes); a length whose counts an earlier one had is then left out."""
    budget = max_num_batched_tokens
    lengths = sorted(set(_powers_of_two(max_len)) | {max_len})

    def distinct(q: int, batch: int) -> list[int]:
        if split_counts is None:
            return [n for n in lengths if n >= q]
        seen: dict[object, int] = {}
        for n in lengths:
            if n >= q:
                seen.setdefault(split_counts(batch, q, n), n)
        return sorted(seen.values())

    steps: list[WarmStep] = []
    # Short queries (decode, speculative verify, a prompt's last chunk, a prefix-cache hit) at every power-of-two
    # sequence length: every split count. One chunk, then two (the one-row kernels and PDL against the rest).
    for q in range(1, min(SHORT_QUERY, budget) + 1):
        steps += [WarmStep(((q, n),)) for n in distinct(q, 1)]
    if budget >= 2 and max_num_seqs >= 2:
        steps += [WarmStep(((1, n), (1, n))) for n in distinct(1, 2)]
    # Prefill chunks of every power-of-two length, 5..7 and the whole budget: every tile choice by max_q_len.
    prefill = sorted(({5, 6, 7} | set(_powers_of_two(budget)) | {budget}) - set(range(1, SHORT_QUERY + 1)))
    steps += [WarmStep(((q, q),), prompt_logits=q <= PROMPT_LOGITS_ROWS) for q in prefill if q <= min(budget, max_len)]
    # Batches of one-token sequences: the LM head at every power-of-two row count up to the batch limit.
    rows = sorted((set(_powers_of_two(max_num_seqs)) | {max_num_seqs}) - {1, 2})  # two: above
    steps += [WarmStep(((1, 1),) * b) for b in rows if b <= budget]
    return steps
