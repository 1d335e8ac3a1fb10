"""The sampler is total: every setting SamplingParams accepts gives a valid distribution, whatever the logits; a
setting it refuses is refused by name; and a row that still fails fails alone (issue #11)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.runtime.engine import LLMEngine, SamplingParams
from envex.runtime.engine.sampler import apply_penalties, sample_on_device, sampling_probs
from envex.runtime.engine.sequence import Sequence
from envex.runtime.engine.types import GREEDY_TEMPERATURE, MAX_TOP_LOGPROBS

VOCAB = 48
# Values where float32 arithmetic used to break (1e-38 / 1e-46 sent the old sampler to inf/nan), the smallest
# subnormal, the greedy threshold on both sides, and the ends of each range.
EDGES = [0.0, -0.0, 5e-324, 1e-300, 1e-46, 1.4e-45, 1e-38, 1.1754944e-38, 1e-20, 1e-7, GREEDY_TEMPERATURE * 0.999,
         GREEDY_TEMPERATURE, GREEDY_TEMPERATURE * 1.001, 1e-3, 0.5, 1.0 - 1e-16, 1.0, 1.0 + 1e-16, 2.0, 2.0000001]


def any_float() -> st.SearchStrategy[float]:
    """The whole float range (subnormals, huge, inf, nan, negative zero) with the edges above weighted in."""
    return st.one_of(st.sampled_from(EDGES), st.floats(), st.floats(min_value=-2.5, max_value=2.5))


@st.composite
def sampling_fields(draw: st.DrawFn) -> dict[str, object]:
    return {
        "temperature": draw(any_float()),
        "top_p": draw(any_float()),
        "top_k": draw(st.one_of(st.integers(-2, VOCAB + 2), st.integers(-2**70, 2**70))),
        "presence_penalty": draw(any_float()),
        "frequency_penalty": draw(any_float()),
        "seed": draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        "logprobs": draw(st.one_of(st.none(), st.integers(-1, MAX_TOP_LOGPROBS + 1))),
    }


@st.composite
def logits_rows(draw: st.DrawFn) -> torch.Tensor:
    """[VOCAB] float32 logits: ordinary, huge (up to float32's max), with -inf entries, or degenerate."""
    kind = draw(st.sampled_from(["normal", "huge", "masked", "all-equal", "one-finite", "nan", "inf"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    row = torch.randn(VOCAB, generator=g) * draw(st.sampled_from([1e-30, 1.0, 30.0]))
    if kind == "huge":
        row = row.sign() * torch.finfo(torch.float32).max * torch.rand(VOCAB, generator=g)
    elif kind == "masked":
        row[torch.rand(VOCAB, generator=g) < 0.7] = float("-inf")
        row[draw(st.integers(0, VOCAB - 1))] = 0.0
    elif kind == "all-equal":
        row = torch.zeros(VOCAB)
    elif kind == "one-finite":
        row = torch.full((VOCAB,), float("-inf"))
        row[draw(st.integers(0, VOCAB - 1))] = 1.0
    elif kind in ("nan", "inf"):  # a model bug, not the request's fault: sampling must still not raise
        row[draw(st.integers(0, VOCAB - 1))] = float("nan") if kind == "nan" else float("inf")
    return row.float()


def make_seq(params: SamplingParams, history: list[int]) -> Sequence:
    seq = Sequence(request_id="r", prompt_token_ids=[1, 2, 3], params=params, detokenizer=None)
    seq.output_token_ids = list(history)
    if params.seed is not None and not params.greedy:
        seq.generator = torch.Generator().manual_seed(params.seed)
    return seq


def accepted(fields: dict[str, object]) -> SamplingParams | None:
    """The params, or None when SamplingParams refuses them — by a one-line message that names the field."""
    try:
        return SamplingParams(max_tokens=4, **fields)  # type: ignore[arg-type]
    except ValueError as exc:
        param = getattr(exc, "param", None)
        assert param in fields and str(exc).startswith(f"{param}:") and "\n" not in str(exc), exc
        return None


def test_the_accepted_ranges_and_the_greedy_epsilon() -> None:
    """Every value of the documented ranges is accepted (subnormals included), nothing outside them; a temperature
    below GREEDY_TEMPERATURE is greedy."""
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-38).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE * 0.999).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    for temperature in (0.0, 5e-324, 1e-38, 2.0):
        assert SamplingParams(temperature=temperature).temperature == temperature
    for top_p in (5e-324, 1e-46, 1.0):
        assert SamplingParams(top_p=top_p).top_p == top_p
    for name, bad in (("temperature", math.nan), ("temperature", math.inf), ("temperature", -1e-300),
                      ("temperature", 2.0000001), ("top_p", 0.0), ("top_p", -0.0), ("top_p", math.nan),
                      ("top_p", 1.0000001), ("presence_penalty", math.inf), ("frequency_penalty", math.nan),
                      ("frequency_penalty", -2.0000001), ("logprobs", 21), ("top_k", -1)):
        with pytest.raises(ValueError, match=f"^{name}: ") as info:
            SamplingParams(**{name: bad})  # type: ignore[arg-type]
        assert info.value.param == name  # type: ignore[attr-defined]


@pytest.mark.parametrize(("temperature", "top_p"), [(1e-38, 1.0), (1e-45, 1.0), (1.0, 1e-46), (1.0, 5e-324),
                                                    (GREEDY_TEMPERATURE, 1e-46), (2.0, 1e-38)])
def test_the_reported_values_sample_the_top_token(temperature: float, top_p: float) -> None:
    """The issue's examples: these raised 'probability tensor contains inf, nan or element < 0' for the whole
    batch. A tiny temperature or top_p leaves (almost) only the most likely token."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7)) * 5
    seqs = [make_seq(SamplingParams(temperature=temperature, top_p=top_p, seed=i), []) for i in range(3)]
    ids, _, errors = sample_on_device(logits, seqs, torch.Generator().manual_seed(0))
    assert errors == {}
    assert ids.tolist() == logits.argmax(-1).tolist()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=sampling_fields(), row=logits_rows(), history=st.lists(st.integers(0, VOCAB - 1), max_size=12))
def test_every_accepted_setting_samples_a_valid_token(fields: dict[str, object], row: torch.Tensor,
                                                      history: list[int]) -> None:
    params = accepted(fields)
    if params is None:
        return
    seq = make_seq(params, history)
    other = make_seq(SamplingParams(temperature=0.7, seed=1), [])  # a neighbour in the same batch
    logits = torch.stack([row, torch.linspace(-3, 3, VOCAB)])
    ids, raw, errors = sample_on_device(logits.clone(), [seq, other], torch.Generator().manual_seed(0))
    assert errors == {}
    assert ids.shape == (2,) and all(0 <= i < VOCAB for i in ids.tolist())
    assert (raw is not None) == (params.logprobs is not None)
    penalized = apply_penalties(row.clone()[None], [seq])[0]
    ordinary = bool(torch.isfinite(penalized).any() and not penalized.isnan().any() and not penalized.isposinf().any())
    if params.greedy:
        assert ids[0] == penalized.argmax()
    elif ordinary:
        assert torch.isfinite(penalized[ids[0]]), "a token the distribution excluded (logit -inf) was sampled"
        if params.top_k == 1 and int((penalized == penalized.max()).sum()) == 1:
            assert ids[0] == penalized.argmax()
    if not params.greedy:
        probs = sampling_probs(row[None], [params])[0]
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        assert abs(float(probs.sum()) - 1.0) < 1e-4
        if not row.isnan().any():
            assert probs[row == row.max()].sum() > 0, "the most likely token must always stay in the distribution"


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    alone = sample_on_device(logits[:1].clone(), [make_seq(SamplingParams(temperature=1.0, seed=9), [])])[0]
    batch = [make_seq(SamplingParams(temperature=1.0, seed=9), [])] + [
        make_seq(SamplingParams(temperature=t, top_p=1e-46), []) for t in (1e-38, 1.0, 2.0)]
    together = sample_on_device(logits.clone(), batch, torch.Generator().manual_seed(0))[0]
    assert together[0] == alone[0]


def test_a_row_that_fails_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.multinomial

    def failing(probs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        if generator is not None and generator.initial_seed() == 666:
            raise RuntimeError("injected\nfailure")
        return real(probs, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", failing)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    seqs = [make_seq(SamplingParams(temperature=1.0, seed=s), []) for s in (1, 666, 2)]
    ids, _, errors = sample_on_device(logits.clone(), seqs, torch.Generator().manual_seed(0))
    assert list(errors) == [1]
    assert "injected failure" in errors[1] and "\n" not in errors[1] and "temperature=1.0" in errors[1]
    for row, seed in ((0, 1), (2, 2)):  # the neighbours drew exactly what they draw alone
        alone = sample_on_device(logits[row:row + 1].clone(), [make_seq(SamplingParams(temperature=1.0, seed=seed),
                                                                        [])])[0]
        assert ids[row] == alone[0]


def test_a_failure_in_the_batched_distribution_is_found_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from envex.runtime.engine import sampler

    real = sampler.sampling_probs

    def failing(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        if any(p.seed == 666 for p in params):
            raise RuntimeError("injected")
        return real(logits, params)

    monkeypatch.setattr(sampler, "sampling_probs", failing)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=1.0, seed=1, top_p=0.9), SamplingParams(temperature=1.0, seed=666),
              SamplingParams(temperature=0.5, top_k=5), SamplingParams(temperature=0.0)]
    ids, _, errors = sample_on_device(logits.clone(), [make_seq(p, []) for p in params],
                                      torch.Generator().manual_seed(0))
    assert list(errors) == [1] and "injected" in errors[1]
    alone = sample_on_device(logits[:1].clone(), [make_seq(params[0], [])])[0]
    assert ids[0] == alone[0] and ids[3] == logits[3].argmax()
    assert ids[2] in torch.topk(logits[2], 5).indices


def test_the_engine_ends_only_the_failed_request(embedded_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """finish_reason "error" with a message for the one request; its neighbours produce the same tokens as when
    they run alone, and every KV block comes back."""
    engine = embedded_engine
    prompt = engine.tokenizer.encode("The capital of France is")
    victims = {f"victim-{s}": SamplingParams(max_tokens=6, temperature=0.8, seed=s, ignore_eos=True)
               for s in (1, 2)}
    victims["tiny"] = SamplingParams(max_tokens=6, temperature=1e-38, top_p=1e-46, seed=3, ignore_eos=True)
    alone = {rid: engine.generate([prompt], p)[0].token_ids for rid, p in victims.items()}

    real = torch.multinomial

    def failing(probs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        if generator is not None and generator.initial_seed() == 666:
            raise RuntimeError("injected failure")
        return real(probs, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", failing)
    blocks_before = engine.stats().kv_blocks_used
    for rid, p in victims.items():
        engine.add_request(rid, prompt, p)
    engine.add_request("doomed", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=666))
    tokens: dict[str, list[int]] = {rid: [] for rid in (*victims, "doomed")}
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            last[out.request_id] = out
    assert last["doomed"].finished and last["doomed"].finish_reason == "error"
    assert last["doomed"].error is not None and "injected failure" in last["doomed"].error
    assert tokens["doomed"] == []
    for rid in victims:
        assert last[rid].finish_reason == "length" and last[rid].error is None
        assert tokens[rid] == alone[rid], rid
    assert engine.stats().kv_blocks_used == blocks_before
