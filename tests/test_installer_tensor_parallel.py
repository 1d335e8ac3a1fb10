"""The plan's tensor-parallel degree: the fewest of this host's GPUs whose memory holds the model."""

from __future__ import annotations

from envex.installer.plan import tensor_parallel_degree
from envex.installer.probe import GPU, Probe

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
