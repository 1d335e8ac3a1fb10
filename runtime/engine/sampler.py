"""Sampling for one step's batch: penalties, greedy or temperature / top-k / top-p, per-request seeds, logprobs.

Logprobs are those of the model's raw distribution (before penalties and temperature), as OpenAI reports them.
Greedy rows (temperature below GREEDY_TEMPERATURE) take the argmax; seeded rows draw from their own torch.Generator
so a seed gives the same tokens whatever else is in the batch. Every setting SamplingParams accepts gives a valid
distribution (sampling_probs); should a row still fail, it is reported and the other rows are sampled as usual.
"""

from __future__ import annotations

from collections import Counter

import torch

from envex.runtime.engine.device import upload
from envex.runtime.engine.sequence import Sequence
from envex.runtime.engine.types import SamplingParams, TokenLogprob


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


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [M, V] -> a valid distribution per row [M, V] (finite, >= 0, sums to 1) for every temperature >=
    GREEDY_TEMPERATURE, top_k and top_p that SamplingParams accepts, and for any logits, nan and inf included.

    Computed relative to each row's maximum: (logits - max) / temperature is <= 0, so exp() cannot overflow and
    the maximum's term is exactly 1 (the sum cannot underflow to 0). top_k keeps every token tied with the k-th;
    top_p drops a token once the mass before it reaches top_p, never the most likely one (a top_p of 1e-46 is 0
    in float32). All rows at once, and nothing waits for the device: a row with no finite logit (a model fault)
    becomes a point mass on its argmax by tensor ops, not by a host branch.
    """
    device, vocab = logits.device, logits.shape[-1]
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    top = logits.max(dim=-1, keepdim=True).values  # [M, 1]
    finite_top = torch.isfinite(top)
    temperature = upload([p.temperature for p in params], torch.float32, device)[:, None]  # [M, 1]
    # A row with no finite logit: zeros here, replaced by the point mass below.
    shifted = torch.where(finite_top, (logits - torch.where(finite_top, top, 0.0)) / temperature, 0.0)  # [M, V]
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):  # the sort costs: only when a row cuts
        ordered, order = torch.sort(shifted, dim=-1, descending=True)  # [M, V] each
        k = upload([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)[:, None]
        ordered = ordered.masked_fill(ordered < ordered.gather(-1, k - 1), float("-inf"))
        probs = ordered.softmax(-1)
        top_p = upload([p.top_p for p in params], torch.float32, device)[:, None]  # [M, 1]
        drop = ((probs.cumsum(-1) - probs) >= top_p) & (top_p < 1.0)  # cumsum may round past 1: no cut at 1
        drop[:, 0] = False
        shifted = torch.empty_like(shifted).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = shifted.softmax(-1)
    # Belt and braces: torch.multinomial on CUDA asserts on the device (fatal to every request) on a bad row.
    valid = finite_top & torch.isfinite(probs).all(-1, keepdim=True)
    point = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(valid, probs, point)


def _failure(params: SamplingParams, exc: Exception) -> str:
    return (f"sampling failed for this request (temperature={params.temperature!r}, top_p={params.top_p!r}, "
            f"top_k={params.top_k!r}): {type(exc).__name__}: {exc}").replace("\n", " ")


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, str]]:
    """logits: [N, V] float32 -> next token ids [N] int64, the raw log-probabilities [N, V] (None when no row
    asks for logprobs), both left on logits' device (nothing here waits for the device), and the rows whose
    sampling failed (row -> one line for people). A failed row fails its own request only: its id is the
    greedy one, which the engine must not use; every other row is sampled as usual.

    The sampled rows' distributions are computed together; a seeded row then draws alone from its own generator
    (so its tokens do not depend on the batch), the unseeded rows in one draw. Should a batched call fail, it is
    redone row by row to find the row at fault (no seeded generator has been drawn from by then).
    """
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if any(s.params.presence_penalty or s.params.frequency_penalty for s in seqs):
        logits = apply_penalties(logits.clone(), seqs)
    next_ids = torch.argmax(logits, dim=-1)  # the greedy answer for every row; sampled rows overwrite theirs
    errors: dict[int, str] = {}
    sampled = [row for row, s in enumerate(seqs) if not s.params.greedy]
    if not sampled:
        return next_ids, raw_logprobs, errors
    probs: dict[int, torch.Tensor] = {}  # row -> [V], when computed row by row
    try:
        batch = sampling_probs(logits[upload(sampled, torch.int64, logits.device)], [seqs[r].params for r in sampled])
    except Exception:  # noqa: BLE001 - one request's failure must not end the batch
        batch = None
        for row in sampled:
            try:
                probs[row] = sampling_probs(logits[row:row + 1], [seqs[row].params])[0]
            except Exception as exc:  # noqa: BLE001
                errors[row] = _failure(seqs[row].params, exc)
    if batch is not None:
        probs = {row: batch[j] for j, row in enumerate(sampled)}  # views: no copies
    shared = [row for row in sampled if seqs[row].generator is None and row not in errors]
    for row in sampled:
        generator = seqs[row].generator
        if generator is not None and row not in errors:
            try:
                next_ids[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
            except Exception as exc:  # noqa: BLE001
                errors[row] = _failure(seqs[row].params, exc)
    if shared:
        try:
            if batch is None:
                raise RuntimeError("distributions were computed row by row")
            chosen = set(shared)
            index = upload([j for j, row in enumerate(sampled) if row in chosen], torch.int64, logits.device)
            next_ids[upload(shared, torch.int64, logits.device)] = torch.multinomial(
                batch[index], 1, generator=default_generator)[:, 0]
        except Exception:  # noqa: BLE001
            for row in shared:
                try:
                    next_ids[row] = torch.multinomial(probs[row], 1, generator=default_generator)[0]
                except Exception as exc:  # noqa: BLE001
                    errors[row] = _failure(seqs[row].params, exc)
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
