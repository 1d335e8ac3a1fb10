"""The packed-KV decode attention (kernels/kv_quant.py, `packed_paged_attention`) over its tile and warp choices,
beside the bf16 cache's decode attention (kernels/attention.py, `paged_attention`) at the same shapes.

    python3 -P -m envex.verify.lab.kernel_bench.bench_kv_attention --out $OUT --commit C

Llama-3.1-8B's attention (32 query heads, 8 KV heads, head_dim 128, 16-token pages) at batch 1 over 32K and 128K
keys and at 64 sequences of 8K: the decode shapes of the GPU matrix's `llama8b-128k` cells, where the packed cache
ran at 0.91-0.97x bf16 (batch 1) and 0.73x (int4, 64 x 8K) through `envex serve` (H100, 94fe3f8). The cache holds
random codes with unit-scale meta (the time does not depend on the values); each config is timed in a CUDA graph
(graph_time_ms) with the product's split count. Per shape and format: us a layer for every (BLOCK_N, num_warps),
the product default's, and the KV bytes a layer read at the measured bandwidth (the floor). Writes
kv_attention.json. Not a test: needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from envex.kernels import kv_quant
from envex.kernels.attention import paged_attention
from envex.kernels.kv_quant_format import format_for
from envex.verify.lab.kernel_bench._bench_lib import graph_time_ms, measure_bandwidth

HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = {"b1_32k": (1, 32768), "b1_128k": (1, 131072), "c64_8k": (64, 8192)}  # (sequences, keys each)
CONFIGS = ((64, 4), (64, 8), (128, 4), (128, 8), (32, 4))  # (BLOCK_N, num_warps); the product's default first
DEFAULT = CONFIGS[0]


def _tables(batch: int, keys: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each sequence's pages, consecutive and disjoint -> (block_tables [batch, pages], total pages)."""
    pages = -(-keys // PAGE)
    return torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages), batch * pages


def _packed_cache(kind: str, blocks: int, device: torch.device) -> kv_quant.PackedKVCache:
    fmt = format_for(kind, D)
    assert fmt is not None
    cache = fmt.allocate(blocks, PAGE, HKV, D, device)
    for data in (cache.k_data, cache.v_data):
        data.view(torch.uint8).copy_(torch.randint(0, 120, data.shape, dtype=torch.uint8, device=device))
    for meta in (cache.k_meta, cache.v_meta):
        meta.fill_(0.01)
    return cache


def _bf16_us(q, cu, seq_lens, tables, blocks: int, keys: int) -> float:  # noqa: ANN001
    k = torch.randn(blocks, PAGE, HKV, D, dtype=torch.bfloat16, device=q.device) * 0.1
    v = torch.randn_like(k)
    return 1e3 * graph_time_ms(lambda _: paged_attention(q, k, v, cu, seq_lens, tables, D**-0.5, max_q_len=1,
                                                         max_seq_len=keys), 20)  # fmt: skip


def _packed_us(cache, q, cu, seq_lens, tables, keys: int) -> dict[str, float | str]:  # noqa: ANN001
    timed: dict[str, float | str] = {}
    for block_n, warps in CONFIGS:
        try:
            us = 1e3 * graph_time_ms(lambda _, bn=block_n, w=warps: kv_quant.packed_paged_attention(
                q, cache, cu, seq_lens, tables, D**-0.5, max_q_len=1, max_seq_len=keys, block_n=bn,
                num_warps=w), 20)  # fmt: skip
        except Exception as exc:  # a config that does not compile (shared memory, registers) is reported
            timed[f"{block_n},{warps}"] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        timed[f"{block_n},{warps}"] = round(us, 2)
    return timed


def bench_shape(name: str, batch: int, keys: int, device: torch.device, read_tbps: float) -> dict:
    tables, blocks = _tables(batch, keys, device)
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=device) * 0.1
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    out: dict = {"batch": batch, "keys": keys}
    bf16_bytes = 2 * batch * keys * HKV * D * 2
    out["bf16"] = {"us": round(_bf16_us(q, cu, seq_lens, tables, blocks, keys), 2),
                   "floor_us": round(bf16_bytes / read_tbps / 1e6, 2)}  # fmt: skip
    torch.cuda.empty_cache()
    for kind in ("fp8", "int4"):
        fmt = format_for(kind, D)
        assert fmt is not None
        timed = _packed_us(_packed_cache(kind, blocks, device), q, cu, seq_lens, tables, keys)
        torch.cuda.empty_cache()
        packed_bytes = 2 * batch * keys * HKV * (fmt.data_width(D) + 2 * fmt.meta_width(D))
        numbers = {k: v for k, v in timed.items() if isinstance(v, float)}
        best = min(numbers, key=numbers.__getitem__) if numbers else None
        out[kind] = {"floor_us": round(packed_bytes / read_tbps / 1e6, 2), "default": f"{DEFAULT[0]},{DEFAULT[1]}",
                     "best": best, "all": timed}  # fmt: skip
        print(f"{name} {kind}: bf16 {out['bf16']['us']} us, default {timed.get(out[kind]['default'])}, best {best} "
              f"{numbers.get(best) if best else None}, floor {out[kind]['floor_us']}", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for kv_attention.json")
    parser.add_argument("--commit", default="unknown", help="the commit measured (the device copy has no git)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"a comma list of {', '.join(SHAPES)}")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kv_attention: needs a CUDA device; run it on the GPU host", file=sys.stderr)
        return 2
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        print(f"bench_kv_attention: --shapes: unknown {', '.join(unknown)}; use {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bw = measure_bandwidth()
    result = {"commit": args.commit, "device": torch.cuda.get_device_name(), "bandwidth": bw,
              "shapes": {n: bench_shape(n, *SHAPES[n], device, bw["read_TBps"]) for n in names}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_attention.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
