"""The INT4 GEMV variants of the lab bench (verify/lab/kernel_bench/bench_int4_gemv.py) under the interpreter:
each equals the product's quant_gemv at a small shape in float32 and in bf16, refuses what it does not take, and
the bench's loop runs end to end with a stand-in timer (nothing is timed here)."""

import pytest
import torch

from envex.kernels import quant as q
from envex.kernels.accuracy import rel_err
from envex.kernels.quant_gemv import quant_gemv
from envex.verify.lab.kernel_bench import bench_int4_gemv as bench

N, K = 64, 512
# two configs a variant (BLOCK_K the whole K or less: one chunk and several, the prefetch's last mask)
CONFIGS = {
    "v0_replica": [(8, 512, 4), (16, 128, 2)],
    "v1_group_scales": [(8, 256, 4), (16, 512, 2)],
    "v2_strided_x": [(8, 256, 4), (32, 512, 4)],
    "v3_both": [(8, 128, 4), (16, 512, 4)],
    "v4_one_group": [(32, 128, 4), (64, 128, 8)],
    "v5_zero_fold": [(8, 256, 4), (16, 512, 2)],
    "v6_perm_x": [(8, 128, 4), (16, 512, 4)],
    "v7_native": [(8, 256, 4), (16, 512, 2)],
}


def _weight(n: int = N, k: int = K) -> q.PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) / k**0.5
    return q.quantize_int4(w, 128, symmetric=False)


def test_every_variant_has_test_configs() -> None:
    assert set(CONFIGS) == set(bench.VARIANTS) == set(bench.CONFIGS)


@pytest.mark.parametrize("variant", list(bench.VARIANTS))
def test_variant_equals_quant_gemv(variant: str) -> None:
    w = _weight()
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(4))
    pw = bench.prepare(variant, w)
    assert (pw is w) == (variant not in bench.PERMUTED)
    want32 = quant_gemv(x, w)[0]
    want16 = quant_gemv(x.bfloat16(), w)[0]
    for cfg in CONFIGS[variant]:
        y = bench.run(variant, x, pw, cfg)
        assert y.dtype == torch.float32 and y.shape == (1, N)
        assert rel_err(y, want32) < 1e-5, (variant, cfg, rel_err(y, want32))
        y16 = bench.run(variant, x.bfloat16(), pw, cfg)
        assert y16.dtype == torch.bfloat16
        torch.testing.assert_close(y16, want16, rtol=1e-2, atol=1e-2)


def test_run_refuses_what_a_variant_does_not_take() -> None:
    w = _weight()
    x = torch.randn(1, K)
    for variant, cfg, what in (("v4_one_group", (32, 256, 4), "BLOCK_K must be the group"),
                               ("v1_group_scales", (8, 64, 4), "BLOCK_K >= 128"),
                               ("v2_strided_x", (8, 1024, 4), "dividing K = 512"),
                               ("v3_both", (12, 128, 4), "powers of two")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            bench.run(variant, x, w, cfg)
    sym = q.quantize_int4(torch.randn(N, K), 128, symmetric=True)
    with pytest.raises(ValueError, match="zeros only"):
        bench.run("v3_both", x, sym, (8, 128, 4))


def test_bench_runs_end_to_end_with_a_stand_in_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shape, the product's default and each variant's configs reported with their errors; a config the
    variant refuses is recorded, not fatal, and never reaches the timer."""
    calls: list[int] = []

    def stand_in(fn, n_inner: int, replays: int = 7) -> float:
        fn(1)
        calls.append(1)
        return 0.01

    monkeypatch.setattr(bench, "graph_time_ms", stand_in)
    monkeypatch.setattr(bench, "SHAPES", {"qkv": (32, 512)})
    monkeypatch.setattr(bench, "CONFIGS", {v: [c[0], (8, 2048, 4)] for v, c in CONFIGS.items()})
    monkeypatch.setattr("envex.verify.lab.kernel_bench.bench_quant_gemm.L2_COPIES_BYTES", 20_000)
    report: dict = {"bandwidth": {"read_TBps": 1e-6}, "shapes": {}}
    bench.bench(report, torch.device("cpu"), torch.Generator().manual_seed(0))
    entry = report["shapes"]["qkv"]
    assert entry["floor_us"] == 32 * 512 / 2 + 32 * 4 * 3 and entry["copies"] > 1
    assert entry["product"]["us"] == 10.0 and entry["product"]["rel_err"] < 1e-2
    for variant, configs in CONFIGS.items():
        e = entry[variant]
        ok = ",".join(map(str, configs[0]))
        assert e["best"] == ok and e["best_us"] == 10.0, (variant, e)
        assert e["all"][ok]["rel_err"] < 1e-2 and e["all"][ok]["rel_err_vs_product"] < 1e-2
        assert e["all"]["8,2048,4"]["error"].startswith("ValueError"), e["all"]["8,2048,4"]
    assert len(calls) == 1 + len(CONFIGS)


def test_main_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["bench_int4_gemv", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main()
