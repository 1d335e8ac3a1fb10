"""Batch invariance on the GPU (issue 17): the deterministic mode's kernels row against row, and served tokens.

    python3 -m envex.verify.lab.kernel_bench.bench_invariance --out $OUT [--sweep | --matmul-only | --attention-only]
    python3 -m envex.verify.lab.kernel_bench.bench_invariance --out $OUT --chain       (decode tiles in the chain)
    python3 -m envex.verify.lab.kernel_bench.bench_invariance --out $OUT --ablate [--batches 1,64]

`--ablate` times the decode chain (4 Llama-3.1-8B layers, final norm, LM head, one CUDA graph) in both modes, whole
and with each kind of launch removed (`_bench_lib.without`): what each costs the step where it sits.

The kernel section (this module's main) checks and times, at the Llama-3.1-8B shapes in bf16:
- invariant_matmul for each projection: a row computed at M = 1, 3, 64 (decode tile, split pieces), inside a
  2048-row prefill (wide tile walking the pieces), at shifted slots and with split off must be bit-identical
  (`mismatched_rows`, target 0; this is where the one assumption, tensor-core k steps rounding alike in every
  tile, is tested); error against fp32; graph-timed against the default path's kernel (the GEMV at M = 1, cuBLAS
  above) at M = 1, 64, 512, 4096 and 8192, each also with the other operand loads of
  invariant_matmul.TMA_* (`pointers_us`, `tma_us`: both through descriptors, `tma_weight_us`: the weight alone,
  each with its `_mismatched` rows, target 0); with --sweep, decode tiles and piece counts at M = 1 and 64 (for tuning);
- invariant_attention: a 1,500-token sequence's rows from one prefill chunk, from chunks after cached prefixes,
  and as decode steps in batches with 1-33 split programs, bit-identical (target 0); decode timed with rotary
  against the fused decode kernel at B = 1 (1K, 10K) and B = 64 (1K), prefill against attention.paged_attention.
Weights and KV sets rotate so timings read HBM, not L2. Writes invariance.json and prints one line per row.

The served check, `run_invariance`, is bench_server's `inv` case: 64 token-id prompts (100-1,500 tokens) x 256
greedy tokens through the OpenAI server, each first seen cold at concurrency 1, 24 or 32 (staggered arrivals),
then again with prefix hits at concurrency 64, 5 and 1; every later answer is compared token by token with the
prompt's first (`differing_tokens`, target 0), with the prefix-cache hits and preemptions of each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from pathlib import Path

ROUNDS = (  # name, prompt indices, concurrency, seconds between arrivals
    ("cold c=1", range(0, 8), 1, 0.0), ("cold c=24", range(8, 32), 24, 0.0),
    ("cold c=32 staggered", range(32, 64), 32, 0.05), ("hits c=64", range(0, 64), 64, 0.0),
    ("hits c=5", range(0, 64), 5, 0.0), ("hits c=1", range(32, 40), 1, 0.0),
)  # fmt: skip


def _metric(base: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def _complete(client, base: str, model: str, prompt: list[int], max_tokens: int) -> list[str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post(f"{base}/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    return r.json()["choices"][0]["text"].split()  # the word-level tokenizer: one word per token


async def run_invariance(base: str, model: str, *, prompts: int = 64, max_tokens: int = 256, seed: int = 17) -> dict:
    """Serve every round of ROUNDS and count the tokens that differ from each prompt's first answer."""
    import httpx

    rng = random.Random(seed)
    texts = [[rng.randrange(1, 30000) for _ in range(rng.randrange(100, 1500))] for _ in range(prompts)]
    first: dict[int, list[str]] = {}
    rounds = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=prompts + 4)) as client:
        for name, idx, concurrency, stagger in ROUNDS:
            idx = [i for i in idx if i < prompts]
            gate = asyncio.Semaphore(concurrency)
            hits0, pre0, t0 = _metric(base, "envex_prefix_cache_hit_tokens_total"), \
                _metric(base, "envex_preemptions_total"), time.perf_counter()  # fmt: skip

            async def one(j: int, i: int, gate=gate, stagger=stagger) -> list[str]:
                await asyncio.sleep(j * stagger)
                async with gate:
                    return await _complete(client, base, model, texts[i], max_tokens)

            answers = await asyncio.gather(*(one(j, i) for j, i in enumerate(idx)))
            diff, compared, worst = 0, 0, []
            for i, got in zip(idx, answers, strict=True):
                if i not in first:
                    first[i] = got
                    continue
                want = first[i]
                compared += len(want)
                bad = sum(a != b for a, b in zip(want, got, strict=False)) + abs(len(want) - len(got))
                if bad:
                    where = next((j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
                    worst.append({"prompt": i, "differing": bad, "first_difference": where})
                diff += bad
            rounds.append({"round": name, "prompts": len(idx), "concurrency": concurrency,
                           "seconds": time.perf_counter() - t0, "compared_tokens": compared,
                           "differing_tokens": diff, "prompts_differing": len(worst), "examples": worst[:5],
                           "prefix_hit_tokens": _metric(base, "envex_prefix_cache_hit_tokens_total") - hits0,
                           "preemptions": _metric(base, "envex_preemptions_total") - pre0})  # fmt: skip
            print(f"  inv {name:>20}: {diff} differing tokens in {len(worst)} prompts, "
                  f"{rounds[-1]['prefix_hit_tokens']:.0f} prefix-hit tokens, {rounds[-1]['seconds']:.1f} s", flush=True)
    total = sum(r["differing_tokens"] for r in rounds)
    return {"prompts": prompts, "max_tokens": max_tokens, "rounds": rounds, "differing_tokens": total,
            "compared_tokens": sum(r["compared_tokens"] for r in rounds), "identical": total == 0}  # fmt: skip


# ---- kernels ------------------------------------------------------------------------------------------------

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, False),
          "down": (4096, 14336, True), "lm_head": (128256, 4096, False)}  # (N, K, SwiGLU prologue)
HQ, HKV, D, PAGE = 32, 8, 128, 16


class _Rows:
    """The report's rows: printed as they come and saved after each."""

    def __init__(self, report: dict, out: Path) -> None:
        self.report, self.out, self.t0 = report, out, time.perf_counter()
        report.setdefault("rows", [])

    def __call__(self, section: str, name: str, **fields) -> None:
        fields = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in fields.items()}
        self.report["rows"].append({"section": section, "name": name, **fields})
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {section:9s} {name:26s} {fields}", flush=True)
        (self.out / "invariance.json").write_text(json.dumps(self.report, indent=1))


def _mismatched(a, b) -> int:
    """Rows of a that are not bit-identical to b's."""
    return int((a != b).reshape(a.shape[0], -1).any(dim=1).sum())


def _matmul(row: _Rows, name: str, read_tbps: float, sweep: bool) -> None:
    import torch
    import torch.nn.functional as F

    from envex.kernels import gemv
    from envex.kernels import invariant_matmul as im
    from envex.kernels.accuracy import rel_err
    from envex.verify.lab.kernel_bench import _bench_lib as B

    n, k, silu = SHAPES[name]
    prologue = im.PROLOGUE_SILU_MUL if silu else im.PROLOGUE_NONE
    copies = max(1, math.ceil(400e6 / (n * k * 2)))  # rotate weights past the 50 MB L2
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(copies)]
    x = torch.randn(8192, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)

    def mm(a, i: int = 0, **kw):
        return im.matmul(a, ws[i % copies], prologue=prologue, **kw)

    big = mm(x[:2048])  # the wide prefill tile, one program walking the pieces
    checks = {f"M={m}": _mismatched(mm(x[:m]), big[:m]) for m in (1, 3, 16, 17, 64)}  # small tile to 16
    checks["M=3 decode tile"] = _mismatched(mm(x[:3], tile=im.DECODE_TILE), big[:3])
    checks["M=65 at slot 7"] = _mismatched(mm(x[7:72]), big[7:72])
    checks["M=64 one program"] = _mismatched(mm(x[:64], split=False), big[:64])
    checks["M=200 prefill tile"] = _mismatched(mm(x[:200]), big[:200])
    checks["M=64 prefill tile"] = _mismatched(mm(x[:64], tile=im.PREFILL_TILE), big[:64])
    checks["M=64 wide tile"] = _mismatched(mm(x[:64], tile=im.WIDE_TILE), big[:64])
    act = x[:64].float()
    act = F.silu(act[:, :k]) * act[:, k:] if silu else act
    pieces = -(-k // im.chunk_size(n, k))
    row("matmul", f"{name} equality", mismatched_rows=sum(checks.values()), checks=checks,
        rel_err=rel_err(big[:64], act @ ws[0].float().t()), pieces=pieces)  # fmt: skip
    floor_us = n * k * 2 / (read_tbps * 1e6)
    for m in (1, 64, 512, 4096, 8192):
        a = x[:m]
        inv = B.graph_time_ms(lambda i, a=a: mm(a, i), copies * 2) * 1e3
        if m == 1:
            gp = gemv.PROLOGUE_SILU_MUL if silu else gemv.PROLOGUE_NONE
            base = B.graph_time_ms(lambda i, a=a, gp=gp: gemv.gemv(a, ws[i % copies], prologue=gp), copies * 2)
        else:
            act_m = F.silu(a[:, :k]) * a[:, k:] if silu else a
            base = B.graph_time_ms(lambda i, act_m=act_m: act_m @ ws[i % copies].t(), copies * 2)
        extra = {"tflops": 2 * m * n * k / (inv * 1e6)} if m > 64 else {"of_floor": floor_us / inv}
        if m == 1:  # the 64-row tile the small one replaced, in the same run
            extra["decode_tile_us"] = B.graph_time_ms(lambda i, a=a: mm(a, i, tile=im.DECODE_TILE), copies * 2) * 1e3
        # The other operand loads (TMA descriptors or pointers, im.use_tma): a schedule, so the same bits.
        today = im.use_tma(a, ws[0], m, im.tile_for(m, n, pieces))
        for other in {im.TMA_NONE, im.TMA_BOTH, im.TMA_WEIGHT} - {today}:
            label = {im.TMA_NONE: "pointers", im.TMA_BOTH: "tma", im.TMA_WEIGHT: "tma_weight"}[other]
            extra[f"{label}_us"] = B.graph_time_ms(lambda i, a=a, o=other: mm(a, i, tma=o), copies * 2) * 1e3
            extra[f"{label}_mismatched"] = _mismatched(mm(a, tma=other), mm(a))
        row("matmul", f"{name} M={m}", invariant_us=inv, default_us=base * 1e3, cost=inv / (base * 1e3) - 1,
            **extra)  # fmt: skip
    if not sweep:
        return
    # The decode side's tiles and piece counts. Another piece count is another arithmetic (other bits, still
    # invariant); another tile at the default count must give the default's bits (`identical`), or it is unusable.
    tiles = (im.DECODE_TILE, im.Tile(64, 16, 64, 4, 4), im.Tile(64, 32, 128, 4, 3), im.Tile(64, 128, 64, 4, 3))
    for tile in tiles:
        for count in sorted({1, pieces, 2 * pieces}):
            chunk = min(k, math.ceil(math.ceil(k / count) / im.K_ALIGN) * im.K_ALIGN)
            same = _mismatched(mm(x[:64], tile=tile, chunk=chunk), big[:64]) == 0 if count == pieces else None
            for m in (1, 64):
                us = B.graph_time_ms(lambda i, a=x[:m], t=tile, c=chunk: mm(a, i, tile=t, chunk=c), copies * 2) * 1e3
                row("sweep", f"{name} M={m}", tile=list(vars(tile).values()), pieces=count, us=us,
                    of_floor=floor_us / us, identical=same)  # fmt: skip


def _attention_equality(row: _Rows) -> None:
    import torch

    from envex.kernels import invariant_attention as ia
    from envex.kernels import reference as ref
    from envex.kernels.accuracy import rel_err

    length, blocks = 1500, 400
    kc = torch.randn(blocks, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(blocks, device="cuda")[: -(-length // PAGE)].to(torch.int32)
    others = [torch.randperm(blocks, device="cuda")[:40].to(torch.int32) for _ in range(2)]
    q = torch.randn(length, HQ, D, device="cuda", dtype=torch.bfloat16)

    def attend(parts, programs=None):  # parts: (queries, first position, block table) per sequence
        lens = [len(p[0]) for p in parts]
        width = max(len(p[2]) for p in parts)
        out = ia.paged_attention(
            torch.cat([p[0] for p in parts]), kc, vc,
            torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32),
            torch.tensor([p[1] + n for p, n in zip(parts, lens, strict=True)], device="cuda", dtype=torch.int32),
            torch.stack([torch.cat([p[2], p[2].new_zeros(width - len(p[2]))]) for p in parts]), D**-0.5,
            max_q_len=max(lens), max_seq_len=4096, num_programs=programs)  # fmt: skip
        return list(out.split(lens))

    full = attend([(q, 0, table)])[0]
    checks = {f"chunk after {c}": _mismatched(attend([(q[c:], c, table)])[0], full[c:]) for c in (256, 700, 1499)}
    for pos in (0, 255, 256, 1000, 1499):
        for programs in (1, 4, 33):
            got = attend([(q[:1], 300, others[0]), (q[pos:pos + 1], pos, table), (q[1:2], 20, others[1])],
                         programs)[1]  # fmt: skip
            checks[f"decode {pos} P={programs}"] = _mismatched(got, full[pos:pos + 1])
    want = ref.paged_attention(q.double(), kc.double(), vc.double(), torch.tensor([0, length], device="cuda"),
                               torch.tensor([length], device="cuda"), table[None], D**-0.5)  # fmt: skip
    row("attention", "equality", mismatched_rows=sum(checks.values()), checks=checks, rel_err=rel_err(full, want))


def _attention_decode_time(row: _Rows, batch: int, seq: int, read_tbps: float) -> None:
    import torch

    from envex.kernels import attention, decode_attention, rotary
    from envex.kernels import invariant_attention as ia
    from envex.verify.lab.kernel_bench import _bench_lib as B

    sets = max(2, math.ceil(200e6 / (batch * seq * HKV * D * 4)))
    per = -(-seq // PAGE)
    kc = torch.randn(batch * per * sets + 1, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * per * sets, device="cuda").to(torch.int32).view(sets, batch, per)
    cos, sin = torch.randn(16384, D // 2, device="cuda"), torch.randn(16384, D // 2, device="cuda")
    qkv = torch.randn(batch, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((batch,), seq - 1, device="cuda", dtype=torch.int64)
    slots = torch.full((batch,), -1, device="cuda", dtype=torch.int64)  # time the reads; write nothing
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    splits = attention.choose_num_splits(batch, HKV, seq, torch.device("cuda"))

    qv, kv, vv = qkv.view(batch, HQ + 2 * HKV, D).split([HQ, HKV, HKV], dim=1)

    def det_two(i: int) -> None:  # rotary + KV write, then split programs and merge
        qr, _ = rotary.rotary_and_store_kv(qv, kv, vv, pos, cos, sin, kc, vc, slots)
        ia.paged_attention(qr, kc, vc, cu, None, tables[i % sets], D**-0.5, max_q_len=1, max_seq_len=seq,
                           positions=pos, num_programs=splits)  # fmt: skip

    def det(i: int) -> None:  # the deterministic decode layer as the engine runs it: rotary in the split launch
        ia.decode_attention_rotary(qv, kv, vv, pos, cos, sin, kc, vc, slots, tables[i % sets], D**-0.5,
                                   max_seq_len=seq, num_programs=splits)  # fmt: skip

    def fused(i: int) -> None:  # the default path: one fused decode kernel + the split merge
        decode_attention.decode_attention_fused(qkv, pos, slots, cos, sin, kc, vc, tables[i % sets], D**-0.5,
                                                num_heads=HQ, num_kv_heads=HKV, max_seq_len=seq, num_splits=splits,
                                                merge_in_kernel=False)  # fmt: skip

    us, base = B.graph_time_ms(det, sets * 2) * 1e3, B.graph_time_ms(fused, sets * 2) * 1e3
    two = B.graph_time_ms(det_two, sets * 2) * 1e3
    row("attention", f"decode B={batch} L={seq}", invariant_us=us, default_us=base, cost=us / base - 1,
        invariant_two_launches_us=two,
        floor_us=batch * seq * HKV * D * 4 / (read_tbps * 1e6))  # fmt: skip


def _attention_prefill_time(row: _Rows, batch: int, q_len: int) -> None:
    import torch

    from envex.kernels import attention
    from envex.kernels import invariant_attention as ia
    from envex.verify.lab.kernel_bench import _bench_lib as B

    kc = torch.randn(batch * -(-q_len // PAGE) + 1, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    args = (torch.randn(batch * q_len, HQ, D, device="cuda", dtype=torch.bfloat16), kc, vc,
            torch.arange(0, batch * q_len + 1, q_len, device="cuda", dtype=torch.int32),
            torch.full((batch,), q_len, device="cuda", dtype=torch.int32),
            torch.arange(batch * -(-q_len // PAGE), device="cuda", dtype=torch.int32).view(batch, -1), D**-0.5)
    kw = dict(max_q_len=q_len, max_seq_len=q_len)
    us = B.graph_time_ms(lambda _i: ia.paged_attention(*args, **kw), 3) * 1e3
    base = B.graph_time_ms(lambda _i: attention.paged_attention(*args, **kw), 3) * 1e3
    row("attention", f"prefill {batch}x{q_len}", invariant_us=us, default_us=base, cost=us / base - 1)


def _kernels(report: dict, out: Path, sweep: bool, attention: bool = True, matmul: bool = True) -> None:
    import torch

    row = _Rows(report, out)
    read = report["bandwidth"]["read_TBps"]
    for name in SHAPES if matmul else ():
        _matmul(row, name, read, sweep)
        torch.cuda.empty_cache()
    if not attention:
        return
    _attention_equality(row)
    for batch, seq in ((1, 1024), (1, 10240), (64, 1024)):
        _attention_decode_time(row, batch, seq, read)
    for batch, q_len in ((8, 1024), (1, 10240)):
        _attention_prefill_time(row, batch, q_len)


def _chain(report: dict, models: Path) -> None:
    """The deterministic batch-1 decode chain of the Llama-3.1-8B shape (4 layers, dummy weights, final norm and LM
    head, 1K keys in the 4K graph's launch) timed with each decode tile in turn: a tile is a schedule, never the
    arithmetic (the equality rows above check that on every shape), so any of them may run; the fastest in the
    chain is the candidate to serve (bench_server decides)."""
    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B
    from envex.verify.lab.kernel_bench.bench_server import SHAPES as SERVED

    step = B.decode_chain(models, SERVED["llama8b"], layers=4, deterministic=True).step

    timed = B.chain_timer(step, width=52)

    T = im.Tile
    candidates = {
        "SMALL_TILE": [T(16, 64, 128, 4, 2, True), T(16, 64, 128, 4, 4, True), T(16, 64, 128, 4, 5, True),
                       T(16, 128, 128, 4, 3, True), T(16, 64, 64, 4, 4, True), T(16, 64, 64, 4, 6, True),
                       T(16, 128, 64, 4, 4, True)],
        "DECODE_TILE": [T(64, 64, 128, 4, 2), T(64, 64, 128, 4, 4), T(64, 128, 128, 4, 3), T(64, 128, 128, 8, 3),
                        T(64, 64, 64, 4, 4), T(64, 64, 64, 4, 6), T(64, 128, 64, 4, 4)],
    }  # fmt: skip
    chain: dict = {"defaults_us": timed("defaults"), "rows": []}
    report["chain"] = chain
    for name, tiles in candidates.items():
        best = (chain["defaults_us"], getattr(im, name))
        for t, us, err in B.sweep(timed, name, tiles, im, name):
            chain["rows"].append({"name": name, "tile": repr(t), **({"error": err} if err else {"us": us})})
            if not err:
                best = min(best, (us, t), key=lambda b: b[0])
        chain[f"best_{name}"] = {"tile": repr(best[1]), "fields": list(best[1].__dict__.values()), "us": best[0]}
    chain["defaults_again_us"] = timed("defaults again")


def _ablate(report: dict, models: Path, batches: tuple[int, ...] = (1, 64)) -> None:
    """Where the decode step's time goes, in the deterministic mode and the default one: the chain (4 Llama-8B
    layers, dummy weights, final norm and LM head, 1K keys a sequence in the 4K graph's launch) timed whole, then
    with one kind of launch removed (`_bench_lib.without`). full - without = what those launches cost the step
    where they sit, overlap with their neighbours included: the figure that a change to them can win at most."""
    import contextlib

    import torch

    from envex.kernels import invariant_attention, norm
    from envex.kernels import invariant_matmul as im
    from envex.verify.lab.kernel_bench import _bench_lib as B
    from envex.verify.lab.kernel_bench.bench_server import SHAPES as SERVED

    shape = SERVED["llama8b"]
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv_rows = 2 * h // shape["num_attention_heads"] * shape["num_key_value_heads"]

    def weight(rows: int, cols: int):
        def only(*args, **kwargs) -> bool:
            return any(isinstance(a, torch.Tensor) and tuple(a.shape) == (rows, cols)
                       for a in (*args, *kwargs.values()))  # fmt: skip

        return only

    qkv, gate_up, lm_head = weight(h + kv_rows, h), weight(2 * inter, h), weight(vocab, h)
    report["ablation"] = rows = []
    for batch in batches:
        for det in (True, False):
            chain = B.decode_chain(models, shape, layers=4, batch=batch, deterministic=det)
            ops = chain.engine.runner.ops
            removals = {
                "attention": [(ops, "attention", None)], "qkv (norm + matmul)": [(ops, "norm_linear", qkv)],
                "o": [(ops, "linear", None)], "gate_up (norm + matmul)": [(ops, "norm_linear", gate_up)],
                "down (swiglu + matmul)": [(ops, "act_linear", None)],
                "lm_head (norm + matmul)": [(ops, "norm_linear", lm_head)],
            }
            if det:
                removals |= {
                    "norms": [(norm, "rms_norm", None), (norm, "add_rms_norm", None),
                              (norm, "add_rms_norm_partials", None)],
                    "qkv matmul": [(im, "matmul", qkv)], "gate_up matmul": [(im, "matmul", gate_up)],
                    "lm_head matmul": [(im, "matmul", lm_head)], "swiglu pass": [(im, "_silu_mul_kernel", None)],
                    "qkv reduce": [(im, "_reduce_kernel", None)], "attention merge": [
                        (invariant_attention, "_merge_kernel", None)],
                }  # fmt: skip
            mode = "det" if det else "default"
            timed = B.chain_timer(chain.step, width=40)
            full = timed(f"{mode} b{batch} full")
            for label, parts in removals.items():
                with contextlib.ExitStack() as stack:
                    for target, name, only in parts:
                        stack.enter_context(B.without(target, name, only))
                    try:
                        us = timed(f"{mode} b{batch} without {label}")
                    except Exception as exc:  # noqa: BLE001 - a row that fails is reported, the rest still run
                        rows.append({"mode": mode, "batch": batch, "removed": label, "error": str(exc)[:200]})
                        continue
                rows.append({"mode": mode, "batch": batch, "removed": label, "full_us": full, "without_us": us,
                             "cost_us": full - us})  # fmt: skip
            rows.append({"mode": mode, "batch": batch, "removed": "nothing (again)", "full_us": timed(
                f"{mode} b{batch} full again")})  # fmt: skip
            del chain, ops, timed
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--sweep", action="store_true", help="also time decode tiles and piece counts (tuning)")
    ap.add_argument("--matmul-only", action="store_true", help="the projections only, not attention")
    ap.add_argument("--attention-only", action="store_true", help="attention only, not the projections")
    ap.add_argument("--chain", action="store_true", help="only the decode chain's tile sweep (4 Llama-8B layers)")
    ap.add_argument("--ablate", action="store_true",
                    help="only the decode chain with each kind of launch removed, both modes, at --batches")
    ap.add_argument("--batches", default="1,64", help="the decode batches --ablate times (comma-separated)")
    ap.add_argument("--models", type=Path, default=Path("/tmp/envex-models"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from envex.verify.lab.kernel_bench import _bench_lib as B

    report: dict = {"env": {"device": torch.cuda.get_device_name(), "commit": args.commit, "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                    "bandwidth": B.measure_bandwidth(gib=2.0)}  # fmt: skip
    print(json.dumps(report), flush=True)
    try:
        if args.ablate:
            _ablate(report, args.models, tuple(int(b) for b in args.batches.split(",")))
        elif args.chain:
            _chain(report, args.models)
        else:
            _kernels(report, args.out, args.sweep, attention=not args.matmul_only, matmul=not args.attention_only)
    finally:
        (args.out / "invariance.json").write_text(json.dumps(report, indent=1))
    bad = [r for r in report.get("rows", []) if r.get("mismatched_rows")]
    print(f"\n{'IDENTICAL' if not bad else 'MISMATCHES: ' + ', '.join(r['name'] for r in bad)}", flush=True)


if __name__ == "__main__":
    main()
