"""One-off kernel probes behind verify/lab/journal-kernels.md v19 (issue 16) and the deterministic tiles v4-v5
(issue 17).

    python3 -m envex.verify.lab.kernel_bench.bench_probes --section NAME --out FILE.json

(NAME: late_trigger, splitk, prefill_tiles, pieces, one_piece, swapped, decode_loads, narrow_mma)

- splitk: O and down at 2-64 rows followed by the add + RMSNorm: cuBLAS (with its own split-K) + the norm kernel,
  against one bmm over S K-slices into float32 partials + `norm.add_rms_norm_partials`; graph-timed over 8 weight
  copies (past the L2), kernel names at 5 rows.
- prefill_tiles: the invariant matmul at 4,096 rows on candidate prefill tiles, each checked row for row against
  PREFILL_TILE (bits must be identical) and timed against cuBLAS.
- pieces: gate-up, LM head and QKV at 1 and 64 rows with 1-8 K pieces on the small and 64-row tiles, with the reduce
  launch and with the pieces handed on, against the one-row GEMV.
- one_piece: QKV, O, down and gate-up with K in one piece: narrow decode tiles at 1 and 64 rows and the 128 x 256
  tile at 4,096 rows, rows checked bit for bit against the 4,096-row launch, beside today's schedule and cuBLAS.
- swapped: the same for QKV, O and down with swapped tiles of 3-8 stages at 1 and 16 rows
  (verify/lab/journal-kernels.md, "The prefill projections at cuBLAS speed").
- decode_loads: every projection at 1, 16 and 64 rows on today's tile with the operands through row pointers, TMA
  descriptors for both, or for the weight alone; at one row also deeper and wider tiles with the weight through
  TMA; each checked bit for bit against the pointer loads.

Llama-3.1-8B shapes, random bf16 weights, one GPU. Results are the raw JSON in verify/lab/results.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

H = 4096
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip  (N, K)


def _copies(n: int, k: int) -> int:
    return max(1, math.ceil(400e6 / (n * k * 2)))  # weights rotated past the 50 MB L2


def _graph_us(fn, copies: int, iters: int = 50) -> float:
    """µs per call of fn, which runs `copies` projections, replayed in a CUDA graph."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters / copies


def _kernel_names(fn) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in p.events() if e.device_type.name == "CUDA"})


def splitk() -> dict:
    import torch
    import torch.nn.functional as F

    from envex.kernels import norm

    torch.manual_seed(0)
    out: dict = {}
    copies = 8
    for pname, k in (("O", 4096), ("down", 14336)):
        ws = [torch.randn(H, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        nw = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        for m in (2, 5, 9, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)

            def base(x=x, r=r, ws=ws, nw=nw) -> None:
                for w in ws:
                    norm.add_rms_norm(F.linear(x, w), r, nw, 1e-5)

            row: dict = {"base": _graph_us(base, copies)}
            ref = norm.add_rms_norm(F.linear(x, ws[0]), r, nw, 1e-5)[0].float()
            for s in (1, 2, 4, 7, 8, 14):
                if k % (s * 64):
                    continue
                xs = x.view(m, s, k // s).transpose(0, 1)
                wts = [w.view(H, s, k // s).permute(1, 2, 0) for w in ws]

                def var(xs=xs, wts=wts, r=r, nw=nw) -> None:
                    for wt in wts:
                        norm.add_rms_norm_partials(torch.bmm(xs, wt, out_dtype=torch.float32), r, nw, 1e-5)

                row[f"S{s}"] = _graph_us(var, copies)
                got = norm.add_rms_norm_partials(torch.bmm(xs, wts[0], out_dtype=torch.float32), r, nw, 1e-5)[0]
                row[f"S{s}_err"] = float((got.float() - ref).abs().max())
                if m == 5:
                    row[f"S{s}_kernels"] = _kernel_names(var)
            if m == 5:
                row["base_kernels"] = _kernel_names(base)
            out[f"{pname}_M{m}"] = row
            print(pname, m, json.dumps({a: round(v, 2) if isinstance(v, float) else v for a, v in row.items()}),
                  flush=True)  # fmt: skip
    return out


def prefill_tiles() -> list[dict]:
    import torch

    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B

    cands = [im.PREFILL_TILE, im.Tile(128, 128, 64, 8, 4), im.Tile(128, 256, 64, 8, 3), im.Tile(128, 256, 64, 8, 4),
             im.Tile(256, 128, 64, 8, 3), im.Tile(128, 128, 128, 8, 3), im.Tile(128, 256, 32, 8, 4)]  # fmt: skip
    m, rows = 4096, []
    for name, (n, k) in SHAPES.items():
        copies = _copies(n, k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = im.matmul(x, ws[0], tile=im.PREFILL_TILE)
        base = B.graph_time_ms(lambda i, x=x, ws=ws, c=copies: x @ ws[i % c].t(), copies * 2) * 1e3
        for t in cands:
            same = int((im.matmul(x, ws[0], tile=t) != ref).reshape(m, -1).any(1).sum())
            us = B.graph_time_ms(lambda i, t=t, x=x, ws=ws, c=copies: im.matmul(x, ws[i % c], tile=t), copies * 2) * 1e3
            rows.append(dict(shape=name, tile=list(vars(t).values()), us=round(us, 1), cublas_us=round(base, 1),
                             tflops=round(2 * m * n * k / (us * 1e6), 1), mismatched_rows=same))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def pieces() -> list[dict]:
    import torch

    from envex.kernels import gemv
    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B

    rows = []
    for name in ("gate_up", "lm_head", "qkv"):
        n, k = SHAPES[name]
        copies = _copies(n, k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(copies)]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        g = B.graph_time_ms(lambda i, x=x, ws=ws, c=copies: gemv.gemv(x[:1], ws[i % c]), copies * 2) * 1e3
        rows.append(dict(shape=name, m=1, gemv_us=round(g, 1)))
        print(json.dumps(rows[-1]), flush=True)
        for count in (1, 2, 4, 8):
            for m in (1, 64):
                for tile in (im.SMALL_TILE, im.DECODE_TILE) if m == 1 else (im.DECODE_TILE,):
                    for partials in (False, True) if count > 1 else (False,):
                        us = B.graph_time_ms(lambda i, t=tile, c=k // count, p=partials, a=x[:m], ws=ws, n_c=copies:
                                             im.matmul(a, ws[i % n_c], tile=t, chunk=c, partials=p), copies * 2) * 1e3
                        rows.append(dict(shape=name, m=m, pieces=count, tile="small" if tile.swap else "64-row",
                                         partials=partials, us=round(us, 1)))  # fmt: skip
                        print(json.dumps(rows[-1]), flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def _one_piece_rows(names: tuple[str, ...], tiles_at) -> list[dict]:
    """For each shape: the GEMV at one row; at each M of tiles_at (M -> tiles) today's schedule (and, where it
    splits, with the pieces handed on) and each tile with K in one piece, every row checked bit for bit against the
    128 x 256 tile at 4,096 rows; at 4,096 rows cuBLAS, today's schedule and one piece."""
    import torch

    from envex.kernels import gemv
    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B

    rows: list[dict] = []

    def timed(name: str, m: int, label: str, fn, copies: int, **extra) -> None:
        us = B.graph_time_ms(fn, copies * 2) * 1e3
        rows.append(dict(shape=name, m=m, schedule=label, us=round(us, 2), **extra))
        print(json.dumps(rows[-1]), flush=True)

    def probe(name: str, n: int, k: int) -> None:  # one shape; its tensors go when it returns
        copies = _copies(n, k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(copies)]
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        full = im.matmul(x, ws[0], chunk=k, tile=im.WIDE_TILE)
        timed(name, 1, "gemv", lambda i: gemv.gemv(x[:1], ws[i % copies]), copies)
        for m, tiles in tiles_at.items():
            timed(name, m, "today", lambda i, m=m: im.matmul(x[:m], ws[i % copies]), copies)
            if im.chunk_size(n, k) < k:
                timed(name, m, "today, pieces handed on",
                      lambda i, m=m: im.matmul(x[:m], ws[i % copies], partials=True), copies)  # fmt: skip
            for t in tiles:
                t, tma = t if isinstance(t, tuple) else (t, None)  # (tile, TMA_*) or a tile with use_tma's loads
                swap = " swap" if t.swap else ""
                label = f"one piece, tile {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}{swap}"
                label += "" if tma is None else f" tma{tma}"
                try:
                    got = im.matmul(x[:m], ws[0], chunk=k, tile=t, tma=tma)
                    bad = int((got != full[:m]).reshape(m, -1).any(1).sum())
                    timed(name, m, label, lambda i, m=m, t=t, tma=tma: im.matmul(x[:m], ws[i % copies], chunk=k,
                                                                                 tile=t, tma=tma),
                          copies, mismatched_rows=bad)  # fmt: skip
                except Exception as exc:  # a tile Triton cannot build: record it, go on
                    rows.append(dict(shape=name, m=m, schedule=label, error=str(exc)[:300]))
                    print(json.dumps(rows[-1]), flush=True)
        timed(name, 4096, "cublas", lambda i: x @ ws[i % copies].t(), copies)
        timed(name, 4096, "today", lambda i: im.matmul(x, ws[i % copies]), copies)
        timed(name, 4096, "one piece, 128x256",
              lambda i: im.matmul(x, ws[i % copies], chunk=k, tile=im.WIDE_TILE), copies)  # fmt: skip

    for name in names:
        probe(name, *SHAPES[name])
        torch.cuda.empty_cache()
    return rows


def one_piece() -> list[dict]:
    """Every projection as one K piece (one chain of k16 steps per element, no split): narrow decode tiles (64 x
    rows on the wgmma's M side, 16-64 weight columns on N) at 1 and 64 rows, the 128 x 256 tile at 4,096 rows,
    each row checked bit for bit against the 4,096-row launch; beside today's schedule, the GEMV and cuBLAS."""
    from envex.kernels import invariant_matmul as im

    narrow = [im.Tile(64, 16, 128, 4, 4), im.Tile(64, 16, 256, 4, 4), im.Tile(64, 32, 128, 4, 4),
              im.Tile(64, 32, 256, 4, 3), im.DECODE_TILE]  # fmt: skip
    return _one_piece_rows(("qkv", "o", "down", "gate_up"), {1: narrow, 64: narrow[2:]})


def swapped() -> list[dict]:
    """One K piece for every weight, with the batch-1 side on swapped tiles (64 weight rows on the wgmma's M side,
    the x rows on N: no 64-row x tile) deep enough to stream a weight of few column tiles (QKV 96, O and down 64
    programs) at bandwidth, at 1 and 16 rows; 64 rows on the decode tile and deeper or narrower ones."""
    from envex.kernels import invariant_matmul as im

    small = [im.Tile(16, 64, 128, 4, 3, swap=True), im.Tile(16, 64, 128, 4, 5, swap=True),
             im.Tile(16, 64, 256, 4, 3, swap=True), im.Tile(16, 64, 256, 4, 4, swap=True),
             im.Tile(16, 64, 512, 4, 2, swap=True), im.Tile(16, 64, 64, 4, 8, swap=True)]  # fmt: skip
    decode = [im.DECODE_TILE, im.Tile(64, 32, 128, 4, 4), im.Tile(64, 64, 128, 4, 4), im.Tile(64, 64, 256, 4, 2)]
    return _one_piece_rows(("qkv", "o", "down"), {1: small, 16: small, 64: decode})


def narrow_mma() -> list[dict]:
    """O and down in one K piece on tiles of 16-32 weight rows, which Triton issues as mma.sync m16n8k16 (MMAv2:
    wgmma needs 64 rows on the M side and warps in fours) rather than wgmma: 128-256 programs for a batch-1 step
    without K pieces. Each row checked bit for bit against the 4,096-row wgmma launch (does a k16 step of mma.sync
    round as wgmma's does?), beside today's pieces, the GEMV and the deep swapped wgmma tile in one piece."""
    from envex.kernels import invariant_matmul as im

    T, none = im.Tile, im.TMA_NONE
    small = [T(16, 16, 128, 1, 4, swap=True), (T(16, 16, 128, 1, 4, swap=True), none), T(16, 16, 256, 1, 3, swap=True),
             T(16, 16, 128, 1, 6, swap=True), T(16, 16, 128, 2, 4, swap=True), T(16, 32, 128, 2, 4, swap=True),
             (T(16, 32, 128, 2, 4, swap=True), none), T(16, 32, 256, 2, 3, swap=True), T(16, 32, 128, 4, 5, swap=True),
             T(16, 64, 128, 2, 4, swap=True), im.DEEP_SMALL_TILE, (T(16, 64, 256, 4, 4, swap=True), none)]  # fmt: skip
    rows64 = [T(64, 16, 128, 4, 4), T(64, 32, 128, 4, 4), T(64, 16, 128, 2, 4, swap=True),
              T(64, 32, 128, 4, 4, swap=True), T(64, 32, 128, 2, 4, swap=True), im.DEEP_DECODE_TILE]  # fmt: skip
    return _one_piece_rows(("o", "down"), {1: small, 16: small[:1] + small[4:6], 64: rows64})


def decode_loads() -> list[dict]:
    """The decode launches' operand loads: today's tile at 1, 16 and 64 rows through row pointers, through TMA
    descriptors for both operands, and for the weight alone (x through pointers: no 16-64-row x box filled for
    one row); at one row also deeper or wider tiles with the weight through TMA (it frees the address registers
    that limited the stages). O and down hand their pieces on, as in a decode step. Every launch is checked bit for
    bit against today's pointer loads (a schedule: `mismatched_rows` must be 0)."""
    import torch

    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B

    both, weight = im.TMA_BOTH, im.TMA_WEIGHT
    swap = [im.Tile(16, 64, 128, 4, s, swap=True) for s in (3, 4, 5, 6, 8)] + [im.Tile(16, 64, 256, 4, 3, swap=True)]
    plain = [im.Tile(64, 64, 128, 4, 3), im.Tile(64, 64, 128, 4, 4), im.Tile(64, 64, 256, 4, 2),
             im.Tile(64, 128, 128, 4, 3), im.Tile(64, 32, 128, 4, 4), im.Tile(64, 32, 128, 4, 6)]  # fmt: skip
    extra = {"qkv": swap + plain[4:], "o": swap, "down": swap, "gate_up": plain + swap[:3], "lm_head": plain[:4]}
    rows: list[dict] = []

    def probe(name: str, n: int, k: int) -> None:  # one shape; its tensors go when it returns
        copies = _copies(n, k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(copies)]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        hand_on = im.chunk_size(n, k) < k

        def mm(m: int, i: int = 0, **kw):
            return im.matmul(x[:m], ws[i % copies], partials=hand_on, **kw)

        for m in (1, 16, 64):
            variants = [(None, im.TMA_NONE), (None, both), (None, weight)]
            variants += [(t, weight) for t in extra[name]] if m == 1 else []
            want = mm(m, tma=im.TMA_NONE)
            for tile, tma in variants:
                t = tile or im.tile_for(m, n, -(-k // im.chunk_size(n, k)))
                label = f"{t.block_m}x{t.block_n}x{t.block_k} s{t.num_stages}{' swap' if t.swap else ''}"
                try:
                    got = mm(m, tile=tile, tma=tma)
                    bad = int((got != want).reshape(-1, m, got.shape[-1]).any(2).any(0).sum())
                    us = B.graph_time_ms(lambda i, m=m, tile=tile, tma=tma: mm(m, i, tile=tile, tma=tma), copies * 2)
                    rows.append(dict(shape=name, m=m, tile=label, tma=tma, today=tile is None, us=round(us * 1e3, 2),
                                     mismatched_rows=bad))  # fmt: skip
                except Exception as exc:  # a tile Triton cannot build: record it, go on
                    rows.append(dict(shape=name, m=m, tile=label, tma=tma, error=str(exc)[:300]))
                print(json.dumps(rows[-1]), flush=True)

    for name in ("qkv", "o", "down", "gate_up", "lm_head"):
        probe(name, *SHAPES[name])
        torch.cuda.empty_cache()
    return rows


def late_trigger() -> list[dict]:
    """The deterministic decode chain (4 Llama-8B layers, final norm, LM head; `_bench_lib.decode_chain`) at 1 and 64
    sequences with the short launches' PDL trigger before or after their wait (`_common.LATE_TRIGGER`) and the
    projections' first WARM_K k of weight asked of L2 before their wait or not (`invariant_matmul.WARM_K`), each
    combination graph-timed twice, the default mode's chain beside them; the logits of every combination checked
    against the first's (a schedule: they must be equal). PDL runs at batch 1 only, so 64 is the control."""
    import torch

    from envex.kernels import _common
    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B
    from envex.verify.lab.kernel_bench.bench_server import SHAPES as SERVED

    models = Path("/tmp/envex-models")
    rows: list[dict] = []
    combos = [(False, 0), (True, 0), (False, 64), (True, 64), (True, 128), (True, 256), (False, 128)]
    for batch in (1, 64):
        chain = B.decode_chain(models, SERVED["llama8b"], layers=4, batch=batch, deterministic=True)
        timed = B.chain_timer(chain.step, width=40)
        want = chain.step(0).clone()
        kept = _common.LATE_TRIGGER, im.WARM_K
        for rep in range(2):
            for late, warm in combos:
                _common.LATE_TRIGGER, im.WARM_K = late, warm
                try:
                    us = timed(f"det b{batch} late={late} warm={warm} #{rep}")
                    same = bool(torch.equal(chain.step(0), want))
                    rows.append(dict(batch=batch, late=late, warm=warm, rep=rep, us=round(us, 2), same_logits=same))
                except Exception as exc:  # noqa: BLE001 - a combination that fails is a row
                    rows.append(dict(batch=batch, late=late, warm=warm, rep=rep, error=str(exc)[:300]))
                finally:
                    _common.LATE_TRIGGER, im.WARM_K = kept
                print(json.dumps(rows[-1]), flush=True)
        del chain, timed
        torch.cuda.empty_cache()
        chain = B.decode_chain(models, SERVED["llama8b"], layers=4, batch=batch, deterministic=False)
        timed = B.chain_timer(chain.step, width=40)
        for rep in range(2):
            rows.append(dict(batch=batch, mode="default", rep=rep, us=round(timed(f"default b{batch} #{rep}"), 2)))
            print(json.dumps(rows[-1]), flush=True)
        del chain, timed
        torch.cuda.empty_cache()
    return rows


SECTIONS = {"late_trigger": late_trigger, "splitk": splitk, "prefill_tiles": prefill_tiles, "pieces": pieces,
            "one_piece": one_piece, "swapped": swapped, "decode_loads": decode_loads, "narrow_mma": narrow_mma}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", required=True, choices=sorted(SECTIONS))
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = ap.parse_args()
    result = SECTIONS[args.section]()
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
