"""The plan's tensor-parallel degree: the fewest of this host's GPUs whose memory holds the model; and the gate run
of a release planned over several: TP=N against TP=1 on a cut of the model, a verdict in gates.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from envex.installer import gate_runner
from envex.installer.plan import tensor_parallel_degree
from envex.installer.probe import GPU, Probe
from envex.runtime.models.llama import LlamaForCausalLM
from envex.verify.gate_tensor_parallel import write_random_checkpoint

GIB = 1 << 30


def _probe(*gpus: tuple[str, int, str]) -> Probe:
    return Probe(
        mode="cuda", driver_version="580.159.04", cuda_driver_version="13.0", cpu_model="test", cpu_count=16,
        ram_total=256 * GIB, ram_available=200 * GIB, disk_free=500 * GIB, python="3.12.3", torch="2.11.0",
        torch_cuda="13.0", triton="3.6.0", cuda_smoke="ok",
        gpus=tuple(GPU(index=i, name=name, compute_capability="9.0", accelerator="sm_90", memory_total=mem * GIB,
                       memory_free=mem * GIB, mig_mode=mig, ecc_uncorrected=0)
                   for i, (name, mem, mig) in enumerate(gpus)),
    )  # fmt: skip


H200 = ("NVIDIA H200", 141, "disabled")


def test_one_gpu_when_the_model_fits_it() -> None:
    assert tensor_parallel_degree(_probe(H200, H200), weights=16 * GIB, kv=1 * GIB, budget=119 * GIB, kv_heads=8) == 1


def test_the_fewest_gpus_that_hold_a_70b() -> None:
    # Llama-3.1-70B in bf16: 141 GB of weights, 10 GiB of KV for one 32K sequence; 85% of an H200 each
    weights, kv, budget = 141 * 10**9, 10 * GIB, int(141 * GIB * 0.85)
    assert tensor_parallel_degree(_probe(H200, H200), weights=weights, kv=kv, budget=budget, kv_heads=8) == 2
    a100 = ("NVIDIA A100-SXM4-80GB", 80, "disabled")
    four = _probe(a100, a100, a100, a100)
    assert tensor_parallel_degree(four, weights=weights, kv=kv, budget=int(80 * GIB * 0.85), kv_heads=8) == 4
    assert tensor_parallel_degree(_probe(a100, a100), weights=weights, kv=kv, budget=68 * GIB, kv_heads=8) is None


def test_only_gpus_like_the_first_and_without_mig_count() -> None:
    mixed = _probe(H200, ("NVIDIA L4", 24, "disabled"), ("NVIDIA H200", 141, "enabled"))
    assert tensor_parallel_degree(mixed, weights=200 * GIB, kv=GIB, budget=119 * GIB, kv_heads=8) is None


def test_a_degree_that_cannot_split_the_kv_heads_is_skipped() -> None:
    # 6 KV heads: 4 GPUs would split them unevenly (and 4 is no multiple of 6), so 8 is not reachable either
    probe = _probe(*[H200] * 8)
    assert tensor_parallel_degree(probe, weights=300 * GIB, kv=GIB, budget=119 * GIB, kv_heads=6) is None
    assert tensor_parallel_degree(probe, weights=200 * GIB, kv=GIB, budget=119 * GIB, kv_heads=6) == 2


# ---- the gate run under tensor parallelism (CPU, two processes over gloo) ----------------------------------------

# Three layers, so the gate's cut to two shows; vocab 101: the last rank's vocabulary rows are padded.
SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=101, max_position_embeddings=256,
             eos_token_id=0, torch_dtype="float32")  # fmt: skip
TP_GATE = "verify.tensor_parallel_equality"


def _release(root: Path, tensor_parallel: int) -> Path:
    """A release slot holding a tiny random model and a launch.json at `tensor_parallel`; returns launch.json."""
    write_random_checkpoint(root / "model", SHAPE, seed=1)
    ref = {"name": "tiny", "kind": "model", "version": "1.0.0", "manifest_sha256": "a" * 64}
    launch = {"release": "0001-tiny-1.0.0", "created": "2026-12-01T00:00:00Z", "mode": "cpu",
              "model": {"path": "model", "served_name": "tiny", "format": "hf", "architecture": "LlamaForCausalLM",
                        "quantization": "float32", "sha256": "b" * 64, "bundle": ref},
              "engine": {"device": "cpu", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 4,
                         "tensor_parallel": tensor_parallel},
              "numeric_policy": "float32", "kv_cache": {"dtype": "float32", "block_size": 16}, "kernels": None,
              "runtime": {"envex_version": "0.1.0", "python": "3.12", "torch": None, "triton": None, "venv": "venv",
                          "bundle": {**ref, "name": "envex-runtime", "kind": "runtime"}}}  # fmt: skip
    (root / "launch.json").write_text(json.dumps(launch))
    return root / "launch.json"


@pytest.fixture
def gates_on_the_engine_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quality suite stubbed to a pass (it has its own tests, and needs HF): the run is about the TP gate."""
    import envex.verify.gates

    monkeypatch.setattr(envex.verify.gates, "run_gates", lambda engine, **_: {"verdict": "pass", "gates": {}})


def _run(launch: Path, out: Path) -> dict:
    # The smoke prompt in the tiny tokenizer's words; "" is in every answer, so smoke checks determinism only.
    return gate_runner.run(launch, out, "quick", False, ("t5 t17 t33", ""))


def test_the_gate_run_under_tensor_parallel_compares_with_one_device(gates_on_the_engine_alone: None,
                                                                     tmp_path: Path) -> None:  # fmt: skip
    report = _run(_release(tmp_path / "release", 2), tmp_path / "out")
    assert report["gates"][TP_GATE] == "pass" and report["verdict"] == "pass", report["details"][TP_GATE]
    gate = report["details"][TP_GATE]
    assert gate["evidence"]["tensor_parallel"] == 2 and gate["evidence"]["reference_policy"] == "cpu-float32-torch-tp1"
    assert gate["evidence"]["model"]["layers"] == 2 and gate["evidence"]["model"]["model_layers"] == 3
    assert gate["evidence"]["model"]["hidden_size"] == 64 and gate["evidence"]["model"]["vocab_size"] == 101
    # prompts up to 256 - 32 tokens fit: 7, 25 and 64; float32 on a CPU: the same greedy tokens
    assert [c["prompt_tokens"] for c in gate["evidence"]["cases"]] == [7, 25, 64]
    assert gate["evidence"]["identical"] == 3
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("tensor-parallel-gate")] == []
    one = _run(_release(tmp_path / "single", 1), tmp_path / "out-single")
    assert TP_GATE not in one["gates"] and one["verdict"] == "pass"


def test_a_wrong_shard_fails_the_gate(gates_on_the_engine_alone: None, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Rank 0 cuts o_proj's input columns at rank 1's offset (an off-by-one rank in a row-parallel shard): its
    heads' outputs are projected by the wrong columns. Only this process (rank 0) is patched."""
    right = LlamaForCausalLM._rank_slice

    def wrong(self: LlamaForCausalLM, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        if p.world_size > 1 and hf_name.endswith("o_proj.weight"):
            width = p.heads(self.config) * self.config.head_dim
            return tensor.narrow(1, (p.rank + 1) % p.world_size * width, width)
        return right(self, hf_name, tensor)

    monkeypatch.setattr(LlamaForCausalLM, "_rank_slice", wrong)
    report = _run(_release(tmp_path / "release", 2), tmp_path / "out")
    assert report["gates"][TP_GATE] == "fail" and report["verdict"] == "fail"
    cases = report["details"][TP_GATE]["evidence"]["cases"]
    assert not all(c["ok"] for c in cases)
