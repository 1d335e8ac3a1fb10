"""Signed reference answers (verify/signed_reference.py): recorded by running the gates on HF transformers, replayed
where the reference does not fit. The gates pass on the embedded model against the replayed answers as against the
live reference, a planted weight fault still fails them, a question the file cannot answer fails its gate in one
line, the file is checked against the weights it answers for, and its parser survives any input.

A tiny suite keeps the recording to seconds on two cores; the quick suite's own recording is exercised by the media
build and the air-gapped install.
"""

from __future__ import annotations

import dataclasses
import json
import string
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.runtime.engine import EngineConfig, LLMEngine
from envex.runtime.loader import resolve_model
from envex.verify.gate_semantic import grouped_kl_and_top1, kl_and_top1
from envex.verify.gates import Suite, run_gates
from envex.verify.reference import HFReference
from envex.verify.references_file import (
    REFERENCES_FILE,
    ReferencesError,
    file_sha256,
    folder_digest,
    load_references,
    model_digest,
    parse_references,
    references_bytes,
)
from envex.verify.signed_reference import RECORDED_GATES, SignedReference, choose_reference, record_references

pytestmark = pytest.mark.slow

TINY = Suite(name="tiny", reference_prompts=1, reference_max_tokens=6, needle_lengths=(160,), needle_depths=(0.5,),
             needle_max_tokens=8, stopping_prompts=1, stopping_max_tokens=8, coding_tasks=("add",),
             coding_max_tokens=24, semantic_texts=1, semantic_max_len=24, gates=RECORDED_GATES)  # fmt: skip
WINDOW = 2048


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # Prefix caching off: a planted weight fault must not hide behind KV blocks cached before it.
    return LLMEngine(EngineConfig(device="cpu", max_model_len=WINDOW, enable_prefix_caching=False))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = resolve_model("smollm2-135m-instruct")
    refs = record_references(source, suites=[TINY], max_model_len=WINDOW, digest=folder_digest(source.path))
    path = tmp_path_factory.mktemp("refs") / REFERENCES_FILE
    path.write_bytes(references_bytes(refs))
    return path


@pytest.fixture(scope="module")
def signed(recorded: Path) -> SignedReference:
    source = resolve_model("smollm2-135m-instruct")
    return SignedReference(load_references(recorded, digest=folder_digest(source.path)), str(recorded))


def test_the_gates_pass_against_the_signed_answers_as_against_hf(engine, signed):
    report = run_gates(engine, reference=signed, suite=TINY)
    assert report.verdict == "pass", [(g.name, g.summary) for g in report.gates]
    assert report.reference_policy == "signed-cpu-float32-torch"
    assert [g.name for g in report.gates] == list(RECORDED_GATES)
    equality = report.gate("reference_equality")
    # Answers computed on another machine: the top-k rule, not bit equality; here they are identical anyway.
    assert equality.thresholds["mode"] == "topk" and equality.evidence["identical"] == 1
    assert "its signed answers" in equality.summary
    semantic = report.gate("semantic_regression")
    assert "lower bound" in semantic.evidence["kl_over"] and semantic.evidence["top1"] == 1.0

    # The replayed answers are HF's: a live reference gives the same texts now.
    live = HFReference(engine.source, eos_token_ids=engine.tokenizer.eos_token_ids)
    local = run_gates(engine, reference=live, suite=TINY)
    assert local.verdict == "pass" and local.reference_policy == "cpu-float32-torch"
    for name, field in (("reference_equality", "cases"), ("needle_retrieval", "cells")):
        assert [c["reference_text"] for c in local.gate(name).evidence[field]] == \
            [c["reference_text"] for c in report.gate(name).evidence[field]]  # fmt: skip
    assert local.gate("coding").evidence["tasks"][0]["reference_code"] == \
        report.gate("coding").evidence["tasks"][0]["reference_code"]  # fmt: skip
    # The grouped KL is a lower bound of the full one.
    assert semantic.evidence["mean_kl"] <= local.gate("semantic_regression").evidence["mean_kl"] + 1e-12


def test_a_planted_weight_fault_fails_against_the_signed_answers(engine, signed):
    param = dict(engine.runner.model.named_parameters())["layers.1.gate_up_proj_weight"]
    saved = param.detach().clone()
    noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * float(param.std()) * 3.0
    with torch.no_grad():
        param.add_(noise.to(param.dtype))
    try:
        report = run_gates(engine, reference=signed, suite=TINY, gates=("semantic_regression",))
    finally:
        with torch.no_grad():
            param.copy_(saved)
    semantic = report.gate("semantic_regression")
    assert report.verdict == "fail" and semantic.evidence["mean_kl"] > semantic.thresholds["max_mean_kl"]


def test_a_question_the_file_cannot_answer_fails_its_gate_in_one_line(engine, signed):
    other = dataclasses.replace(TINY, needle_lengths=(200,), gates=("needle_retrieval",))
    report = run_gates(engine, reference=signed, suite=other)
    needle = report.gate("needle_retrieval")
    assert report.verdict == "fail" and "\n" not in needle.summary
    assert "no signed answer for a greedy answer to a" in needle.summary and "tiny suite" in needle.summary
    assert f"max_model_len {WINDOW}" in needle.summary


def test_the_file_answers_for_its_weights_only(recorded, tmp_path):
    source = resolve_model("smollm2-135m-instruct")
    digest = folder_digest(source.path)
    assert digest == model_digest({source.path.name: file_sha256(source.path)})
    # Envex's own files beside the weights do not change the model's digest; another weights file does.
    assert model_digest({"w.gguf": "a" * 64, "envex-model.json": "b" * 64, REFERENCES_FILE: "c" * 64}) == \
        model_digest({"w.gguf": "a" * 64})  # fmt: skip
    assert model_digest({"w.gguf": "a" * 64}) != model_digest({"w.gguf": "d" * 64})
    with pytest.raises(ReferencesError, match="computed for other weights") as err:
        load_references(recorded, digest="0" * 64)
    assert "\n" not in str(err.value) and str(recorded) in str(err.value)


def test_choosing_the_reference(engine, recorded):
    ref, described = choose_reference(engine, "auto", recorded, need_bytes=10**18)
    assert isinstance(ref, SignedReference) and described["origin"] == "signed"
    assert "does not fit" in described["why"] and "needs" in described["why"]
    ref, described = choose_reference(engine, "signed", recorded, need_bytes=1)
    assert isinstance(ref, SignedReference) and described["why"] == "asked for (--reference signed)"
    # The local one: None, which run_gates loads where a gate needs it (HF transformers, float32, on the device)
    ref, described = choose_reference(engine, "auto", recorded, need_bytes=4 * 134_515_008)
    assert ref is None and described["origin"] == "local" and described["why"].startswith("it fits")
    assert described["reference_policy"] == "cpu-float32-torch"
    ref, described = choose_reference(engine, "auto", None, need_bytes=10**18)
    assert ref is None and described["why"].startswith("no signed answers to fall back on")
    with pytest.raises(ReferencesError, match="has none"):
        choose_reference(engine, "signed", None, need_bytes=1)
    with pytest.raises(ReferencesError, match="not auto, local or signed"):
        choose_reference(engine, "remote", recorded, need_bytes=1)


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 6), v=st.integers(2, 40), k=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       scale=st.floats(0.1, 20.0))  # fmt: skip
def test_the_grouped_kl_is_a_lower_bound_of_the_full_kl(t, v, k, seed, scale):
    k = min(k, v)
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(t, v, generator=gen, dtype=torch.float64) * scale
    eng = ref + torch.randn(t, v, generator=gen, dtype=torch.float64) * scale / 4
    full, top1 = kl_and_top1(ref, eng)
    values, ids = torch.log_softmax(ref, -1).topk(k, -1)
    grouped, grouped_top1 = grouped_kl_and_top1(ids, values, eng)
    assert torch.all(grouped <= full + 1e-9) and torch.all(grouped >= 0)
    if k == v:  # the top tokens hold all the mass: the same KL
        assert torch.allclose(grouped, full, atol=1e-9)
    assert torch.equal(grouped_top1, eng.argmax(-1) == ref.argmax(-1)) and torch.equal(top1, grouped_top1)


_SCALARS = st.none() | st.booleans() | st.integers(-5, 70) | st.floats(allow_nan=False) | st.text(string.printable,
                                                                                                 max_size=8)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip


def test_a_key_with_a_newline_stays_on_one_line(recorded) -> None:
    """The fuzzer's find (twentieth session): a field set to a mapping whose key is a newline gave a two-line error,
    the key being part of the field's path; the path is escaped now (bundles.files.one_line)."""
    doc = json.loads(recorded.read_bytes())
    doc["computed_on"] = {"\n": False}
    with pytest.raises(ReferencesError) as err:
        parse_references(json.dumps(doc).encode(), "refs.json")
    assert str(err.value) == ("refs.json: field computed_on.\\n: Input should be a valid string; compute it again "
                              "with `envex media references`")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_parser_refuses_anything_malformed_in_one_line(recorded, data):
    good = json.loads(recorded.read_bytes())
    choice = data.draw(st.sampled_from(["bytes", "field", "drop", "answer"]))
    if choice == "bytes":
        raw = data.draw(st.binary(max_size=64))
    else:
        doc = json.loads(json.dumps(good))
        if choice == "field":
            doc[data.draw(st.sampled_from(sorted(doc)))] = data.draw(_JSON)
        elif choice == "drop":
            del doc[data.draw(st.sampled_from(sorted(doc)))]
        else:
            answer = doc["greedy"][0]
            answer[data.draw(st.sampled_from(sorted(answer)))] = data.draw(_JSON)
        raw = json.dumps(doc).encode()
    try:
        refs = parse_references(raw, "refs.json")
    except ReferencesError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("refs.json: ")
    else:  # what parses is a usable file: every answer replays
        replay = SignedReference(refs, "refs.json")
        for answer in refs.greedy:
            assert replay._greedy[answer.key].token_ids == answer.token_ids
