"""Each gate passes on the real engine and fails on a planted fault: a perturbed weight, an off-by-one
max_tokens, a stop-string leak, a shuffled needle. The engine and the HF reference load once per session; the
prompt sets are the smallest that still exercise each rule (the gate functions take them as arguments).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.verify import data
from envex.verify.gate_coding import check_coding
from envex.verify.gate_needle import build_prompt, check_needle
from envex.verify.gate_reference import check_reference_equality
from envex.verify.gate_semantic import check_semantic
from envex.verify.gate_stopping import check_stopping
from envex.verify.gates import GATE_NAMES, Suite, run_gates
from envex.verify.reference import HFReference

pytestmark = pytest.mark.slow
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="session")
def verify_engine() -> LLMEngine:
    # Prefix caching off: a planted weight fault must not be hidden (or kept) by KV blocks cached before it.
    return LLMEngine(EngineConfig(model="smollm2-135m-instruct", device="cpu", enable_prefix_caching=False))


@pytest.fixture(scope="session")
def reference(verify_engine: LLMEngine) -> HFReference:
    return HFReference(verify_engine.source, eos_token_ids=verify_engine.tokenizer.eos_token_ids)


@contextmanager
def perturbed_weight(engine: LLMEngine, name: str = "layers.1.gate_up_proj_weight",
                     scale: float = 3.0) -> Iterator[None]:
    """Add Gaussian noise (`scale` x the weight's own std) to one weight in place; restore it afterwards."""
    param = dict(engine.runner.model.named_parameters())[name]
    saved = param.detach().clone()
    noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * float(param.std()) * scale
    with torch.no_grad():
        param.add_(noise.to(param.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            param.copy_(saved)


class Delegate:
    """Forwards everything to the real engine; subclasses override one method to plant a fault."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class OffByOneMaxTokens(Delegate):
    def _bump(self, p: SamplingParams) -> SamplingParams:
        return dataclasses.replace(p, max_tokens=p.max_tokens + 1)

    def generate(self, prompts: Any, params: Any) -> Any:
        ps = [self._bump(p) for p in params] if isinstance(params, list) else self._bump(params)
        return self._engine.generate(prompts, ps)

    def add_request(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        self._engine.add_request(request_id, ids, self._bump(params))


class LeakyStop(Delegate):
    """A detokenizer bug: the first two characters of the matched stop string are emitted before stopping."""

    def generate(self, prompts: Any, params: Any) -> Any:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        out = self._engine.generate(prompts, params)
        return [dataclasses.replace(c, text=c.text + p.stop[0][:2]) if c.finish_reason == "stop" and p.stop
                and c.token_ids and c.token_ids[-1] not in self.tokenizer.eos_token_ids else c
                for c, p in zip(out, plist, strict=True)]

    def step(self) -> Any:
        outs = self._engine.step()
        for o in outs:
            if o.finished and isinstance(o.stop_reason, str):
                o.text += o.stop_reason[:2]
        return outs


class ShuffledNeedle(Delegate):
    """Scrambles the context before the question (the needle with it): retrieval cannot succeed."""

    def generate(self, prompts: Any, params: Any) -> Any:
        g = torch.Generator().manual_seed(1)
        shuffled = []
        for ids in prompts:
            body = torch.tensor(ids[10:-40])
            shuffled.append(ids[:10] + body[torch.randperm(len(body), generator=g)].tolist() + ids[-40:])
        return self._engine.generate(shuffled, params)


# ---- reference equality -------------------------------------------------------------------------------------

def test_reference_equality_passes_on_the_engine(verify_engine: LLMEngine, reference: HFReference) -> None:
    r = check_reference_equality(verify_engine, reference, prompts=[PROMPT], max_tokens=8)
    assert r.verdict == "pass", r.evidence
    assert r.thresholds["mode"] == "exact" and r.evidence["identical"] == 1
    assert r.evidence["cases"][0]["divergence_index"] is None
    json.dumps(dataclasses.asdict(r))


def test_reference_equality_fails_on_a_perturbed_weight(verify_engine: LLMEngine, reference: HFReference) -> None:
    with perturbed_weight(verify_engine):
        r = check_reference_equality(verify_engine, reference, prompts=[PROMPT], max_tokens=8)
    assert r.verdict == "fail"
    case = r.evidence["cases"][0]
    assert case["identical"] is False and isinstance(case["divergence_index"], int)
    assert {"engine_token", "reference_token", "engine_token_in_reference_topk"} <= set(case)


def test_topk_rule_tolerates_a_near_tie_but_not_a_wrong_token(verify_engine: LLMEngine,
                                                             reference: HFReference) -> None:
    # A slight perturbation (different numerics, same function) under the top-k rule, then a gross one.
    with perturbed_weight(verify_engine, scale=0.02):
        mild = check_reference_equality(verify_engine, reference, prompts=[PROMPT], max_tokens=8, mode="topk")
    assert mild.verdict == "pass", mild.evidence
    with perturbed_weight(verify_engine, name="layers.0.qkv_proj_weight", scale=30.0):
        gross = check_reference_equality(verify_engine, reference, prompts=[PROMPT], max_tokens=8, mode="topk")
    assert gross.verdict == "fail"
    case = gross.evidence["cases"][0]
    assert not (case["engine_token_in_reference_topk"] and case["reference_token_in_engine_topk"])


# ---- semantic regression ------------------------------------------------------------------------------------

def test_semantic_regression_passes_then_fails_on_a_perturbed_weight(verify_engine: LLMEngine,
                                                                     reference: HFReference) -> None:
    texts = data.corpus_texts()[:1]
    ok = check_semantic(verify_engine, reference, texts=texts, max_len=48)
    assert ok.verdict == "pass" and ok.evidence["mean_kl"] < 1e-6 and ok.evidence["top1"] == 1.0
    assert ok.thresholds["policy"] == "cpu-float32-torch"
    with perturbed_weight(verify_engine, scale=0.5):
        bad = check_semantic(verify_engine, reference, texts=texts, max_len=48)
    assert bad.verdict == "fail" and bad.evidence["mean_kl"] > ok.thresholds["max_mean_kl"]


# ---- stopping -----------------------------------------------------------------------------------------------

def test_stopping_passes_on_the_engine(verify_engine: LLMEngine) -> None:
    r = check_stopping(verify_engine, prompts=[PROMPT], max_tokens=10, token_counts=(1, 5))
    assert r.verdict == "pass", [c["problems"] for c in r.evidence["cases"]]
    assert {"eos", "max_tokens", "stop_string", "stop_partial_only"} <= set(r.evidence["kinds_covered"])


def test_stopping_fails_on_off_by_one_max_tokens(verify_engine: LLMEngine) -> None:
    r = check_stopping(OffByOneMaxTokens(verify_engine), prompts=[PROMPT], max_tokens=8, token_counts=(3,),
                       stops_per_prompt=1)
    assert r.verdict == "fail"
    problems = [p for c in r.evidence["cases"] if c["kind"] == "max_tokens" for p in c["problems"]]
    assert any("expected" in p for p in problems)


def test_stopping_fails_on_a_stop_string_leak(verify_engine: LLMEngine) -> None:
    r = check_stopping(LeakyStop(verify_engine), prompts=[PROMPT], max_tokens=8, token_counts=(1,))
    assert r.verdict == "fail"
    leaked = [c for c in r.evidence["cases"] if c["kind"] == "stop_string"]
    assert leaked and all(not c["ok"] for c in leaked)


def test_stopping_says_which_cases_it_could_not_build(verify_engine: LLMEngine) -> None:
    # Two tokens of output hold no 4-character string across a token boundary: no stop-string case can be built.
    # The gate fails (each kind must run) and its summary counts only the cases run, naming the one left out.
    r = check_stopping(verify_engine, prompts=[PROMPT], max_tokens=2, token_counts=(1,))
    assert r.verdict == "fail"
    assert "stop_string" not in r.evidence["kinds_covered"]
    assert [u["case"].split(":")[0] for u in r.evidence["not_built"]] == ["2 of 2 stop_string"]
    run = r.evidence["total"]
    assert r.summary.startswith(f"{run}/{run} stopping cases run exact"), r.summary
    assert "not built: 1 (2 of 2 stop_string: the output before EOS (2 tokens" in r.summary, r.summary
    assert "fails: no stop_string case ran" in r.summary, r.summary


# ---- needle -------------------------------------------------------------------------------------------------

def test_needle_prompt_places_the_fact_at_depth(verify_engine: LLMEngine) -> None:
    tok = verify_engine.tokenizer
    nd = data.needle_data()
    for depth in (0.0, 0.5, 1.0):
        ids = build_prompt(tok, nd, nd.needles[0], length=300, depth=depth)
        text = tok.decode(ids)
        assert len(ids) <= 300 and len(ids) > 250
        where = text.index(nd.needles[0].fact) / len(text)
        assert abs(where - depth) < 0.25


def test_needle_passes_then_fails_when_the_needle_is_shuffled(verify_engine: LLMEngine,
                                                              reference: HFReference) -> None:
    kwargs: dict[str, Any] = {"lengths": (200,), "depths": (0.5,), "max_tokens": 14}
    ok = check_needle(verify_engine, reference, **kwargs)
    assert ok.verdict == "pass" and ok.evidence["reference_score"] == 1.0, ok.evidence
    bad = check_needle(ShuffledNeedle(verify_engine), reference, **kwargs)
    assert bad.verdict == "fail" and bad.evidence["engine_score"] < bad.evidence["reference_score"]


# ---- coding -------------------------------------------------------------------------------------------------

def test_coding_passes_then_fails_on_a_perturbed_weight(verify_engine: LLMEngine, reference: HFReference) -> None:
    tasks = [t for t in data.coding_tasks() if t.id == "add"]
    ok = check_coding(verify_engine, reference, tasks=tasks, max_tokens=24)
    assert ok.verdict == "pass", ok.evidence
    assert ok.evidence["reference_pass_rate"] == 1.0 and ok.evidence["engine_pass_rate"] == 1.0
    with perturbed_weight(verify_engine, name="layers.0.qkv_proj_weight", scale=30.0):
        bad = check_coding(verify_engine, reference, tasks=tasks, max_tokens=24)
    assert bad.verdict == "fail"
    assert bad.evidence["engine_pass_rate"] < bad.thresholds["band_low"]


# ---- the runner ---------------------------------------------------------------------------------------------

def test_run_gates_report_is_json_with_every_gate(verify_engine: LLMEngine, reference: HFReference,
                                                  tmp_path: Any) -> None:
    # The same questions as the gate tests above, so the memoized reference answers most of them for free.
    tiny = Suite(name="tiny", reference_prompts=1, reference_max_tokens=8, needle_lengths=(200,),
                 needle_depths=(0.5,), needle_max_tokens=14, stopping_prompts=1, stopping_max_tokens=6,
                 coding_tasks=("add",), coding_max_tokens=24, semantic_texts=1, semantic_max_len=48,
                 invariance_prompts=1, invariance_others=2, invariance_max_tokens=4)
    seen: list[str] = []
    report = run_gates(verify_engine, reference=reference, suite=tiny, out_dir=tmp_path, progress=seen.append)
    assert report.verdict == "pass", [(g.name, g.summary) for g in report.gates]
    assert seen == [g.name for g in report.gates] and len(report.gates) == len(GATE_NAMES)
    saved = json.loads((tmp_path / "gates.json").read_text())
    assert saved["verdict"] == "pass" and {g["name"] for g in saved["gates"]} == set(seen)
    assert all({"verdict", "thresholds", "evidence", "summary"} <= set(g) for g in saved["gates"])
    assert report.engine_policy == "cpu-float32-torch" and report.reference_policy == "cpu-float32-torch"


def test_run_gates_rejects_unknown_names(verify_engine: LLMEngine, reference: HFReference) -> None:
    with pytest.raises(ValueError, match="suite"):
        run_gates(verify_engine, reference=reference, suite="huge")
    with pytest.raises(ValueError, match="gates"):
        run_gates(verify_engine, reference=reference, gates=["vibes"])


def test_a_gate_that_crashes_fails_with_the_reason(verify_engine: LLMEngine, reference: HFReference) -> None:
    class Broken(Delegate):
        def full_logits(self, token_ids: list[int]) -> torch.Tensor:
            raise RuntimeError("logits are on fire")

    tiny = Suite(name="tiny", reference_prompts=1, reference_max_tokens=4, needle_lengths=(200,),
                 needle_depths=(0.0,), needle_max_tokens=4, stopping_prompts=1, stopping_max_tokens=4,
                 coding_tasks=("add",), coding_max_tokens=4, semantic_texts=1, semantic_max_len=16,
                 gates=("semantic_regression",))
    report = run_gates(Broken(verify_engine), reference=reference, suite=tiny)
    assert report.verdict == "fail" and "logits are on fire" in report.gates[0].summary


def test_cast_parameters_puts_every_parameter_in_the_reference_dtype() -> None:
    """A float32 reference computes in float32 even when transformers left some weights in bf16 (5.17's MXFP4
    dequantization does): those are widened, their values kept; buffers (rotary frequencies) are left alone, and a
    bf16 reference keeps the float32 parameters transformers keeps on purpose."""
    from envex.verify.reference import cast_parameters

    model = torch.nn.Linear(4, 3)
    model.weight.data = model.weight.data.to(torch.bfloat16)
    model.register_buffer("inv_freq", torch.arange(4, dtype=torch.bfloat16))
    before = model.weight.detach().clone()
    assert cast_parameters(model, torch.bfloat16) == []  # the float32 bias is not narrowed
    assert model.bias.dtype == torch.float32
    assert cast_parameters(model, torch.float32) == ["weight"]
    assert model.weight.dtype == torch.float32 and model.bias.dtype == torch.float32
    assert torch.equal(model.weight.detach(), before.float()) and model.inv_freq.dtype == torch.bfloat16
    assert cast_parameters(model, torch.float32) == []
