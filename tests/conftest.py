"""Shared fixtures: the embedded model is loaded once per test session (about 15 s on two cores)."""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of pyproject's two workers: one core each, not two threads each
    import torch

    torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def embedded_engine():
    """An LLMEngine on the embedded SmolLM2-135M-Instruct, float32 on CPU. Tests must leave it idle."""
    from envex.runtime.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(device="cpu"))


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers on the same GGUF weights, float32 on CPU: the reference the engine must match."""
    import torch
    from transformers import AutoModelForCausalLM

    from envex.runtime.loader import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model
