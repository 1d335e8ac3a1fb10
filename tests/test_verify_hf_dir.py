"""The gates on an HF model directory (safetensors + tokenizer.json), not the GGUF: a small random-weight Llama
with the embedded model's tokenizer, built by verify/lab/cuda_check.py's builder (the CUDA smoke run's model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from envex.runtime.engine import EngineConfig, LLMEngine
from envex.verify.gate_reference import check_reference_equality
from envex.verify.gate_semantic import check_semantic
from envex.verify.lab.cuda_check import build_model_dir
from envex.verify.lab.devcarry import write_tokenizer_dir
from envex.verify.reference import HFReference


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = write_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    return build_model_dir(tok, tmp_path_factory.mktemp("model"), num_hidden_layers=2, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def test_gates_on_an_hf_directory(tiny_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), device="cpu", max_model_len=512))
    assert engine.source.kind == "hf"
    reference = HFReference(engine.source, eos_token_ids=engine.tokenizer.eos_token_ids)
    r = check_reference_equality(engine, reference, prompts=["Hello there"], max_tokens=6)
    assert r.verdict == "pass" and r.evidence["identical"] == 1, r.evidence
    s = check_semantic(engine, reference, texts=["The quick brown fox jumps over the lazy dog."], max_len=16)
    assert s.verdict == "pass" and s.evidence["top1"] == 1.0


def test_a_base_model_without_a_chat_template_is_gated_on_plain_prompts(tiny_dir: Path, tmp_path: Path) -> None:
    """A base model (no chat template: served through /v1/completions) is still gated: the gates ask it their
    prompts as plain text, with its special tokens, and the smoke test is a sentence to complete."""
    import json
    import shutil

    from envex.installer.gate_runner import smoke_gate
    from envex.installer.model_card import BASE_SMOKE
    from envex.verify.common import chat_ids
    from envex.verify.gates import Suite, run_gates

    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", max_model_len=512))
    assert engine.tokenizer.chat_template is None
    assert chat_ids(engine.tokenizer, "Hello there") == engine.tokenizer.encode("Hello there")
    suite = Suite(name="tiny", reference_prompts=1, reference_max_tokens=6, needle_lengths=(96,),
                  needle_depths=(0.5,), needle_max_tokens=6, stopping_prompts=1, stopping_max_tokens=12,
                  coding_tasks=("add",), coding_max_tokens=16, semantic_texts=1, semantic_max_len=16,
                  gates=("reference_equality", "stopping", "semantic_regression"))  # fmt: skip
    report = run_gates(engine, suite=suite)
    assert report.verdict == "pass", [(g.name, g.summary) for g in report.gates]
    smoke = smoke_gate(engine, BASE_SMOKE.prompt, BASE_SMOKE.expect)  # random weights: no Paris, but it runs
    assert smoke["evidence"]["deterministic"] and smoke["evidence"]["text"]
