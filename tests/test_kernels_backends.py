"""The backends and what they state they support (kernels/backends.py), against what each model file needs
(runtime/models, `features`): EngineConfig.resolved refuses in one place, through config.check_backend, what a
backend cannot serve, and the kernels' own errors name no command-line flag."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from envex.kernels import backends
from envex.kernels.ops import LINEAR_ATTENTION, MLA, MOE, SINKS, SLIDING_WINDOW, MoEWeights
from envex.kernels.torch_ops import InvariantTorchOps, TorchOps
from envex.runtime.config import GPT_OSS, QWEN3_MOE, QWEN3_NEXT
from envex.runtime.engine.config import EngineConfig, check_backend, has_invariant_kernels
from envex.runtime.models import model_features

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
LLAMA = "LlamaForCausalLM"


def test_each_backend_states_its_capabilities_and_builds_its_ops() -> None:
    cpu = torch.device("cpu")
    assert type(backends.backend("torch").make(cpu)) is TorchOps
    assert type(backends.backend("torch", deterministic=True).make(cpu)) is InvariantTorchOps
    for name in backends.NAMES:
        plain, invariant = backends.backend(name), backends.backend(name, deterministic=True)
        assert plain.capabilities.features == {MOE, SINKS, SLIDING_WINDOW, MLA, LINEAR_ATTENTION}
        assert not plain.capabilities.batch_invariant
        assert invariant.capabilities.batch_invariant and invariant.capabilities.ordered_all_reduce
    with pytest.raises(ValueError, match=r"^the triton backend: runs on cuda, not cpu$"):
        backends.backend("triton").make(cpu)
    with pytest.raises(ValueError, match="backend: 'tvm' is not one of torch, triton"):
        backends.backend("tvm")


def test_the_model_files_state_their_needs_and_resolved_checks_them_once() -> None:
    assert model_features(LLAMA) == frozenset() and model_features(QWEN3_MOE) == {MOE}
    assert model_features(GPT_OSS) == {MOE, SINKS, SLIDING_WINDOW}
    assert model_features(QWEN3_NEXT) == {MOE, LINEAR_ATTENTION} and not has_invariant_kernels(QWEN3_NEXT)
    assert has_invariant_kernels(LLAMA) and not has_invariant_kernels(GPT_OSS) and not has_invariant_kernels(QWEN3_MOE)
    ok = dict(deterministic=False, architecture=GPT_OSS, speculation=False, tensor_parallel=False)
    assert check_backend("triton", "cuda", **ok) is None and check_backend("torch", "cpu", **ok) is None
    assert check_backend("torch", "cpu", **{**ok, "deterministic": True}) == (
        "deterministic: GptOssForCausalLM has no batch-invariant kernels yet (mixture-of-experts layers, attention "
        "sinks, sliding-window attention); serve it with --no-deterministic")
    assert check_backend("triton", "cuda", **{**ok, "speculation": True}) == (
        "num_speculative_tokens: speculative decoding does not run with sliding-window layers (GptOssForCausalLM) "
        "yet; set it to 0")
    assert check_backend("triton", "cuda", **{**ok, "architecture": LLAMA, "deterministic": True,
                                             "speculation": True, "tensor_parallel": True}) is None  # fmt: skip
    with pytest.raises(ValueError, match=r"^num_speculative_tokens: .* sliding-window layers"):
        EngineConfig(draft_model="d").resolved(window=64, cuda_available=False, architecture=GPT_OSS)


def test_the_invariant_torch_backend_refuses_moe_without_naming_a_flag() -> None:
    experts = MoEWeights(gate_up=torch.zeros(2, 4, 2), down=torch.zeros(2, 2, 2))
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"^InvariantTorchOps.moe: mixture-of-experts layers") as err:
        InvariantTorchOps().moe(x, None, torch.ones(2), 1e-5, torch.zeros(2, 2), None, experts, 1)
    assert "--" not in str(err.value)


def test_no_kernel_error_names_a_command_line_flag() -> None:
    """A kernel is reached from the engine, the benches and the tests, not only from the CLI: its errors name the
    argument and what was wrong; the engine's config words the refusal for the command line."""
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "bundle_cache.py":  # not a kernel: Triton's cache over an installed kernel bundle
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise):
                strings = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                text = " ".join(strings)
                if re.search(r"--[a-z]", text):
                    found.append(f"{path.name}:{node.lineno}: {text}")
    assert not found, "\n".join(found)
