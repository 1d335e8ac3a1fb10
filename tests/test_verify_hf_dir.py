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
