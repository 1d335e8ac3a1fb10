"""The packed-KV attention sweep (verify/lab/kernel_bench/bench_kv_attention.py) off the GPU: its pages and cache
are what the kernel reads, and without CUDA or with an unknown shape it stops with one line."""

from __future__ import annotations

import torch

from envex.kernels import kv_quant
from envex.kernels.kv_quant_format import format_for
from envex.verify.lab.kernel_bench import bench_kv_attention as bench


def test_each_sequence_gets_its_own_pages() -> None:
    tables, blocks = bench._tables(3, 40, torch.device("cpu"))
    assert tables.shape == (3, 3) and blocks == 9
    assert sorted(tables.flatten().tolist()) == list(range(9))


def test_the_cache_is_the_product_format_with_codes_and_unit_meta() -> None:
    cache = bench._packed_cache("int4", 4, torch.device("cpu"))
    assert cache.fmt == format_for("int4", bench.D)
    assert cache.k_data.shape[:3] == (4, bench.PAGE, bench.HKV) and int(cache.k_data.view(torch.uint8).max()) < 120
    assert torch.all(cache.k_meta == torch.tensor(0.01, dtype=cache.k_meta.dtype))
    assert isinstance(cache, kv_quant.PackedKVCache)


def test_without_cuda_or_with_an_unknown_shape_it_stops_in_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "bench_kv_attention: needs a CUDA device; run it on the GPU host"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--out", str(tmp_path), "--shapes", "b1_32k,b2"]) == 2
    assert "--shapes: unknown b2" in capsys.readouterr().err
    assert not (tmp_path / "kv_attention.json").exists()
