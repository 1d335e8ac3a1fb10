"""Sampling for one step's batch: penalties, greedy or temperature / top-k / top-p, per-request seeds, logprobs.

Logprobs are those of the model's raw distribution (before penalties and temperature), as OpenAI reports them.
Greedy rows (temperature below GREEDY_TEMPERATURE) take the argmax; seeded rows draw from their own torch.Generator
so a seed gives the same tokens whatever else is in the batch. Every setting SamplingParams accepts gives a valid
distribution (sampling_probs); should a row still fail, it is reported and the other rows are sampled as usual.
"""

from __future__ import annotations

from collections import Counter

import torch

from envex.runtime.engine.sequence import Sequence
from envex.runtime.engine.types import TokenLogprob


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI semantics: logit -= presence * (count > 0) + frequency * count, over the tokens generated so far."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0) or not seq.output_token_ids:
            continue
        counts = Counter(seq.output_token_ids)
        ids = torch.tensor(list(counts.keys()), device=logits.device)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[row, ids] -= p.presence_penalty + p.frequency_penalty * freq
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] with a finite maximum -> the same with the cut tokens at -inf; the most likely token always
    stays, whatever top_k and top_p are (a top_p below float32's smallest subnormal rounds to 0)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; never the first (most likely) one.
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] float32 -> a valid distribution [V] (finite, >= 0, sums to 1) for every temperature >=
    GREEDY_TEMPERATURE, top_k and top_p that SamplingParams accepts, and for any logits, nan and inf included.

    Computed in log space relative to the row's maximum: (logits - max) / temperature is <= 0, so exp() cannot
    overflow and the maximum's term is exactly 1 (the sum never underflows to 0). Nothing here waits for the
    device: a row with no finite logit becomes a point mass on its argmax by tensor ops, not a host branch.
    """
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    top = logits.max()
    finite_top = torch.isfinite(top)
    shifted = (logits - torch.where(finite_top, top, torch.zeros_like(top))) / temperature
    shifted = torch.where(finite_top, shifted, torch.zeros_like(shifted))  # all -inf: uniform, fixed below
    probs = _filter_top_k_top_p(shifted, top_k, top_p).softmax(-1)
    # Belt and braces: torch.multinomial on CUDA asserts on the device (fatal to every request) on a bad row.
    probs = torch.where(torch.isfinite(probs) & (probs >= 0), probs, torch.zeros_like(probs))
    fallback = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(probs.sum() > 0, probs, fallback)


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, str]]:
    """logits: [N, V] float32 -> next token ids [N] int64, the raw log-probabilities [N, V] (None when no row
    asks for logprobs), both left on logits' device (nothing here waits for the device), and the rows whose
    sampling failed (row -> one line for people). A failed row fails its own request only: its id is the
    greedy one, which the engine must not use; every other row is sampled as usual."""
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if any(s.params.presence_penalty or s.params.frequency_penalty for s in seqs):
        logits = apply_penalties(logits.clone(), seqs)
    next_ids = torch.argmax(logits, dim=-1)  # the greedy answer for every row; sampled rows overwrite theirs
    errors: dict[int, str] = {}
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        try:
            probs = sampling_probs(logits[row], p.temperature, p.top_k, p.top_p)
            next_ids[row] = torch.multinomial(probs, 1, generator=seq.generator or default_generator)[0]
        except Exception as exc:  # noqa: BLE001 - isolate: one request's failure must not end the batch
            errors[row] = (f"sampling failed for this request (temperature={p.temperature!r}, top_p={p.top_p!r}, "
                           f"top_k={p.top_k!r}): {type(exc).__name__}: {exc}".replace("\n", " "))
    return next_ids, raw_logprobs, errors


def logprobs_for(raw_logprobs: torch.Tensor | None, seqs: list[Sequence], ids: list[int]
                 ) -> list[TokenLogprob | None]:
    """The TokenLogprob of each row that asked for logprobs (None for the others)."""
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if raw_logprobs is not None:
        for row, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                out[row] = token_logprob(raw_logprobs[row], ids[row], seq.params.logprobs)
    return out


def token_logprob(logprobs: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """logprobs: [V] log-probabilities at one position."""
    top: dict[int, float] = {}
    if top_n > 0:
        values, indices = torch.topk(logprobs, top_n)
        top = dict(zip(indices.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)
