"""The gpt-oss GPU bench's CPU-runnable parts: the byte counts behind its rooflines, and its correctness section
on a tiny model (the published layout written from Envex's weights, read back by Envex and by HF transformers)."""

from __future__ import annotations

import pytest

from envex.verify.lab.kernel_bench import bench_gpt_oss as bench
from envex.verify.lab.kernel_bench.bench_server import SHAPES
from envex.verify.lab.kernel_bench.bench_server import step_bytes as server_step_bytes

TINY = {**SHAPES["gpt-oss-120b"], "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "vocab_size": 300,
        "sliding_window": 4, "max_position_embeddings": 256, "pad_token_id": None, "eos_token_id": 299}  # fmt: skip


def test_gpt_oss_120b_bytes() -> None:
    """The issue's figures: ~61 GB of packed experts, ~5.0 GB read per short-context decode step, and ~234 GB
    for the bf16 weights HF transformers would load; the KV of the 18 full layers at 131K is 4.8 GB."""
    shape = SHAPES["gpt-oss-120b"]
    mb = bench.model_bytes(shape)
    assert 60e9 < mb["experts_packed"] < 62e9 and 64e9 < mb["total"] < 67e9
    assert 116e9 < mb["params"] < 118e9 and 232e9 < mb["bf16_total"] < 236e9
    short = bench.step_bytes(shape, 1024)
    assert 4.9e9 < short < 5.2e9
    assert bench.step_bytes(shape, 131072) - bench.step_bytes(shape, 128) == pytest.approx(
        18 * (131072 - 128) * 2 * 8 * 64 * 2)  # only the full layers grow past the window
    assert server_step_bytes(shape, 1024) == short  # bench_server's roofline knows the MoE shape
    assert bench.step_bytes(shape, 2048, batch=32) < 32 * bench.step_bytes(shape, 2048)  # experts are shared


def test_check_section_on_a_tiny_model(tmp_path) -> None:
    path = tmp_path / "gpt-oss-tiny"
    bench.write_reduced_checkpoint(path, TINY, 2, device="cpu")
    engine = bench.reduced_engine(path, device="cpu", dtype="float32")
    result = bench.check(engine, path, prompts=2, max_tokens=6, texts=1, text_len=24)
    equality, semantic = result["reference_equality"], result["semantic"]
    assert equality["verdict"] == "pass" and equality["thresholds"]["mode"] == "exact"  # float32 on a CPU
    assert equality["evidence"]["identical"] == 2
    assert semantic["verdict"] == "pass" and semantic["evidence"]["top1"] == 1.0


def test_noise_floor_on_a_tiny_model(tmp_path) -> None:
    """The noise section: HF in bf16 and the engine given, each against HF in float32. An Envex engine in float32
    on a CPU is HF float32's twin (exact), while HF's own bf16 run is measurably off it."""
    path = tmp_path / "gpt-oss-tiny"
    bench.write_reduced_checkpoint(path, TINY, 2, device="cpu")
    engine = bench.reduced_engine(path, device="cpu", dtype="float32")
    noise = bench.noise_floor(engine, path, prompts=2, max_tokens=6, texts=1, text_len=24)
    assert noise["envex"]["dtype"] == "float32" and noise["envex"]["mean_kl"] < 1e-8 and noise["envex"]["top1"] == 1.0
    assert noise["envex"]["greedy"] == {"identical": 2, "top5_rule": 2, "verdict": "pass", "prompts": 2}
    assert noise["hf_bf16"]["mean_kl"] > 1e-7  # bf16 rounding moves the logits
    assert 0 <= noise["hf_bf16"]["greedy"]["identical"] <= noise["hf_bf16"]["greedy"]["top5_rule"] <= 2


TINY_LLAMA = {**SHAPES["llama8b"], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256, "eos_token_id": 299}


@pytest.mark.parametrize(("shape", "batch"), [(TINY, 1), (TINY_LLAMA, 1), (TINY_LLAMA, 3)],
                         ids=["gpt-oss", "llama", "llama-batch-3"])  # fmt: skip
def test_the_decode_chain_is_one_decode_step(tmp_path, shape, batch) -> None:
    """The chain the benches time (`_bench_lib.decode_chain`) is a real decode step: its logits are those of the
    same tokens decoded with the sequences' exact length as the bound, not the graph's, and it writes each
    sequence's K/V at the slot after its context, in its own blocks, in every layer."""
    import dataclasses

    import torch

    from envex.verify.lab.kernel_bench import _bench_lib as B

    context = 40
    chain = B.decode_chain(tmp_path, shape, layers=2, context=context, graph_len=128, device="cpu", dtype="float32",
                           batch=batch)  # fmt: skip
    before = [k.clone() for k, _ in chain.caches]
    logits = chain.step(0)
    runner = chain.engine.runner
    assert logits.shape == (batch, shape["vocab_size"]) and torch.isfinite(logits).all()
    exact = dataclasses.replace(chain.meta, max_seq_len=context + 1)
    hidden, residual = runner.model.forward(runner.ops, chain.ids, chain.caches, exact)
    assert torch.equal(runner.model.compute_logits(runner.ops, hidden, residual), logits)
    bs = runner.block_size
    blocks = chain.meta.block_tables.shape[1]
    for (k, _), old in zip(chain.caches, before, strict=True):
        changed = (k != old).flatten(2).any(-1).nonzero().tolist()  # (block, offset) rows that the step wrote
        assert changed == [[b * blocks + context // bs, context % bs] for b in range(batch)]


def test_without_removes_the_launches_and_puts_back_what_it_replaced(tmp_path) -> None:
    """`_bench_lib.without` (the ablation rows of bench_invariance): inside the block a function runs once per
    argument shape and its result is reused, a Triton kernel launches nothing, an ops method is the object's own
    again afterwards; `only` leaves the calls it refuses alone."""
    from types import SimpleNamespace

    import torch
    import triton

    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B

    calls = []
    module = SimpleNamespace(f=lambda x: calls.append(tuple(x.shape)) or x * 2)
    real = module.f
    with B.without(module, "f"):
        first = module.f(torch.ones(2))
        assert module.f(torch.zeros(2)) is first and calls == [(2,)]
        assert torch.equal(module.f(torch.ones(3)), torch.full((3,), 2.0)) and calls == [(2,), (3,)]
    assert module.f is real
    with B.without(module, "f", only=lambda x: x.shape == (3,)):
        assert torch.equal(module.f(torch.ones(2)), torch.full((2,), 2.0))
        module.f(torch.ones(2))
        module.f(torch.ones(3))
    assert calls == [(2,), (3,), (2,), (2,), (3,)]
    out = torch.zeros(4)
    with B.without(im, "_reduce_kernel"):
        im._reduce_kernel[(1, 1)](out, out, out, 1, 4, 0, 0, 0, PIECES=1, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=128,
                                  USE_PDL=False)  # fmt: skip
    assert isinstance(im._reduce_kernel, triton.runtime.jit.KernelInterface)
    assert torch.equal(out, torch.zeros(4))
    chain = B.decode_chain(tmp_path, TINY_LLAMA, layers=1, context=8, graph_len=64, device="cpu", dtype="float32")
    ops = chain.engine.runner.ops
    with B.without(ops, "attention"):
        assert "attention" in vars(ops)
        chain.step(0)
    assert "attention" not in vars(ops)


def test_a_sweep_restores_the_setting_it_varies_even_when_a_value_fails() -> None:
    """The chain sweeps vary one tuning setting at a time (a module constant, or an entry of a config table) and
    must leave it as they found it: the next setting's row is timed against the defaults."""
    from types import SimpleNamespace

    from envex.verify.lab.kernel_bench import _bench_lib as B

    module, table = SimpleNamespace(SPIN=800), {("qkv",): (2, 0, 8, 4)}
    seen = []

    def timed(label: str) -> float:
        seen.append((label, module.SPIN, table.get(("o",))))
        if "bad" in label:
            raise RuntimeError("out of shared memory")
        return float(len(seen))

    rows = B.sweep(timed, "SPIN", (200, "bad"), module, "SPIN")
    assert rows == [(200, 1.0, ""), ("bad", None, "out of shared memory")] and module.SPIN == 800
    assert seen == [("SPIN 200", 200, None), ("SPIN bad", "bad", None)]
    assert B.sweep(timed, "o", [(4, 512, 4)], table, ("o",)) == [((4, 512, 4), 3.0, "")]
    assert seen[-1] == ("o (4, 512, 4)", 800, (4, 512, 4))
    assert table == {("qkv",): (2, 0, 8, 4)}  # an entry the table did not have is removed again
    B.sweep(timed, "qkv", [(1, 0, 8, 4)], table, ("qkv",))
    assert table == {("qkv",): (2, 0, 8, 4)}
