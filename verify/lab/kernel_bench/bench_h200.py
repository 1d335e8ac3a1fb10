"""Check and time every kernel at full size on the GPU against its float64 reference and its floor.

    python3 -m envex.verify.lab.kernel_bench.bench_h200 --out $OUT [--sections bw,kernels,sweep,psweep]

One device call: measured read bandwidth (the roofline), each kernel against its reference and its floor, and the
batch-1 GEMV and attention config sweeps. The model end to end is measured through the OpenAI server by
bench_server.py (the fused-step and HF sections that lived here went with kernels/fused_decode.py, whose
hand-written forward the model file replaced). Prints a short table last and writes bench.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from envex.kernels import activation, attention, gemv, norm, rotary  # noqa: E402
from envex.kernels import reference as ref  # noqa: E402
from envex.kernels.accuracy import TOLERANCE, rel_err  # noqa: E402
from envex.verify.lab.kernel_bench import _bench_lib as B  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
MATMUL_TFLOPS = 790.0  # bf16 dense, measured on this workplace's H200s (KINDS.md); prefill floors use it
HQ, HKV, D, H, INTER, VOCAB, LAYERS = 32, 8, 128, 4096, 14336, 128256, 32
KV_BYTES_PER_TOKEN = LAYERS * 2 * HKV * D * 2


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict = {"rows": []}
        self.t0 = time.perf_counter()

    def row(self, section: str, name: str, **fields) -> None:
        fields = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in fields.items()}
        self.data["rows"].append({"section": section, "name": name, **fields})
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {section:8s} {name:40s} {fields}", flush=True)
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "bench.json").write_text(json.dumps(self.data, indent=1))


def _poison(nbytes: int) -> None:
    """Leave NaNs in the caching allocator's next block of this size, so an unwritten output element shows up."""
    t = torch.full((max(1, nbytes // 2),), float("nan"), dtype=BF16, device=DEV)
    del t


def check(rep: Report, section: str, name: str, out, want, dtype, bw: float, nbytes: float, time_fn,
          n_inner: int = 20, flops: float = 0.0) -> None:  # fmt: skip
    outs = out if isinstance(out, tuple) else (out,)
    wants = want if isinstance(want, tuple) else (want,)
    err = max(rel_err(o, w) for o, w in zip(outs, wants, strict=True))
    ms = B.graph_time_ms(time_fn, n_inner)
    floor_ms = max(nbytes / bw / 1e9, flops / MATMUL_TFLOPS / 1e9)
    rep.row(section, name, rel_err=err, ok=bool(err <= TOLERANCE[dtype]), us=ms * 1e3, floor_us=floor_ms * 1e3,
            of_floor=floor_ms / ms)  # fmt: skip


def section_kernels(rep: Report, bw: float) -> None:
    for t in (1, 4096):
        _row_kernels(rep, bw, t)
    _attention_checks(rep, bw)
    _gemv_checks(rep, bw)


def _row_kernels(rep: Report, bw: float, t: int) -> None:
    s = "kernel"
    x, r = torch.randn(t, H, device=DEV, dtype=BF16), torch.randn(t, H, device=DEV, dtype=BF16)
    w = torch.randn(H, device=DEV, dtype=BF16)
    _poison(x.nbytes)
    check(rep, s, f"rms_norm T={t}", norm.rms_norm(x, w, 1e-5), ref.rms_norm(x.double(), w.double(), 1e-5),
          BF16, bw, 2 * x.nbytes, lambda _i: norm.rms_norm(x, w, 1e-5))  # fmt: skip
    _poison(x.nbytes)
    check(rep, s, f"add_rms_norm T={t}", norm.add_rms_norm(x, r, w, 1e-5),
          ref.add_rms_norm(x.double(), r.double(), w.double(), 1e-5), BF16, bw, 4 * x.nbytes,
          lambda _i: norm.add_rms_norm(x, r, w, 1e-5))  # fmt: skip
    gu = torch.randn(t, 2 * INTER, device=DEV, dtype=BF16)
    _poison(gu.nbytes // 2)
    check(rep, s, f"silu_and_mul T={t}", activation.silu_and_mul(gu), ref.silu_and_mul(gu.double()), BF16, bw,
          1.5 * gu.nbytes, lambda _i: activation.silu_and_mul(gu))  # fmt: skip
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, dtype=BF16)
    q = qkv[:, : HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, -HKV * D :].view(t, HKV, D)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    freqs = torch.arange(8192, device=DEV).float()[:, None] * inv
    cos, sin = freqs.cos(), freqs.sin()
    nb = max(64, t // 16 + 8)
    kc = torch.zeros(nb, 16, HKV, D, device=DEV, dtype=BF16)
    vc = torch.zeros_like(kc)
    kr, vr = kc.double(), vc.double()
    pos = torch.randint(0, 8192, (t,), device=DEV)
    slots = torch.randperm(nb * 16, device=DEV)[:t]
    got = rotary.rotary_and_store_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    want = ref.rotary_and_store_kv(q.double(), k.double(), v.double(), pos, cos.double(), sin.double(), kr, vr,
                                   slots)  # fmt: skip
    check(rep, s, f"rotary_store_kv T={t}", (*got, kc, vc), (*want, kr, vr), BF16, bw, 2 * qkv.nbytes + t * D * 4,
          lambda _i: rotary.rotary_and_store_kv(q, k, v, pos, cos, sin, kc, vc, slots))  # fmt: skip


def _paged(batch: int, seq: int, sets: int):
    """Disjoint block tables for `sets` rotating copies (so timing reads HBM, not L2), one cache for all."""
    per = math.ceil(seq / 16)
    nb = batch * per * sets
    kc = torch.randn(nb, 16, HKV, D, device=DEV, dtype=BF16)
    vc = torch.randn(nb, 16, HKV, D, device=DEV, dtype=BF16)
    perm = torch.randperm(nb, device=DEV).to(torch.int32).view(sets, batch, per)
    return kc, vc, perm


def _attention_checks(rep: Report, bw: float) -> None:
    for batch, seq in ((1, 1024), (1, 10240), (64, 1024), (256, 1152)):
        sets = max(2, math.ceil(200e6 / (batch * seq * HKV * D * 4)))
        kc, vc, tables = _paged(batch, seq, sets)
        q = torch.randn(batch, HQ, D, device=DEV, dtype=BF16)
        cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        sl = torch.full((batch,), seq, device=DEV, dtype=torch.int32)
        splits = attention.choose_num_splits(batch, HKV, seq, DEV)

        def run(i: int, q=q, kc=kc, vc=vc, tables=tables, cu=cu, sl=sl, seq=seq, splits=splits, sets=sets):
            return attention.paged_attention(q, kc, vc, cu, sl, tables[i % sets], D**-0.5, max_q_len=1,
                                             max_seq_len=seq, num_splits=splits)  # fmt: skip

        want = ref.paged_attention(q.double(), kc.double(), vc.double(), cu, sl, tables[0], D**-0.5)
        _poison(q.nbytes)
        check(rep, "kernel", f"attn decode B={batch} L={seq} splits={splits}", run(0), want, BF16, bw,
              batch * seq * HKV * D * 4, run, n_inner=sets * 2)  # fmt: skip
        del kc, vc
    for prefix, q_len, do_check in ((2048, 2048, True), (0, 10240, False)):
        seq = prefix + q_len
        kc, vc, tables = _paged(1, seq, 1)
        q = torch.randn(q_len, HQ, D, device=DEV, dtype=BF16)
        cu = torch.tensor([0, q_len], device=DEV, dtype=torch.int32)
        sl = torch.tensor([seq], device=DEV, dtype=torch.int32)

        def runp(_i: int, q=q, kc=kc, vc=vc, tables=tables, cu=cu, sl=sl, seq=seq, q_len=q_len):
            return attention.paged_attention(q, kc, vc, cu, sl, tables[0], D**-0.5, max_q_len=q_len, max_seq_len=seq)

        out = runp(0)
        want = ref.paged_attention(q.double(), kc.double(), vc.double(), cu, sl, tables[0], D**-0.5) if do_check \
            else out  # fmt: skip
        flops = 4.0 * HQ * D * q_len * (prefix + (q_len + 1) / 2)
        check(rep, "kernel", f"attn prefill q={q_len} prefix={prefix}", out, want, BF16, bw, 0, runp, n_inner=3,
              flops=flops)  # fmt: skip
        del kc, vc


GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (VOCAB, 4096)}  # fmt: skip
# One GPU's share of a projection under tensor parallelism (QKV and gate-up split by column, O and down by row, the
# vocabulary split): the shapes --shapes sweeps besides the 8B model's own.
SWEEP_SHAPES = {
    "llama8b": GEMV_SHAPES,
    "llama70b-tp2": {"qkv": (5120, 8192), "o": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336),
                     "lm_head": (VOCAB // 2, 8192)},
    "llama8b-tp2": {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
                    "lm_head": (VOCAB // 2, 4096)},
    # gpt-oss-120b's attention projections (its experts are MXFP4, bench_moe; its LM head reads at ~97% already)
    "gpt-oss": {"qkv": (5120, 2880), "o": (2880, 4096)},
}  # fmt: skip
# The prologue each projection has in the fused decode step (down: none, the SwiGLU is a launch of its own).
GEMV_PROLOGUE = {"qkv": gemv.PROLOGUE_ADD_RMS, "o": gemv.PROLOGUE_NONE, "gate_up": gemv.PROLOGUE_ADD_RMS,
                 "down": gemv.PROLOGUE_NONE, "lm_head": gemv.PROLOGUE_ADD_RMS}  # fmt: skip
GEMV_BEST: dict[tuple[int, int, int], tuple[int, ...]] = {}
ATTN_BEST: dict[str, dict] = {}


def _weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, math.ceil(400e6 / (n * k * 2)))
    return [torch.randn(n, k, device=DEV, dtype=BF16) / math.sqrt(k) for _ in range(copies)]


def _gemv_call(name: str, ws: list[torch.Tensor], k: int, cfg, pdl: bool = False):
    prologue = GEMV_PROLOGUE[name]
    a = torch.randn(1, 2 * k if prologue == gemv.PROLOGUE_SILU_MUL else k, device=DEV, dtype=BF16)
    b, nw = torch.randn(1, k, device=DEV, dtype=BF16), torch.randn(k, device=DEV, dtype=BF16)
    extra = dict(b=b, norm_weight=nw, eps=1e-5) if prologue == gemv.PROLOGUE_ADD_RMS else {}
    return lambda i: gemv.gemv(a, ws[i % len(ws)], prologue=prologue, config=cfg, pdl=pdl, **extra)


def section_sweep(rep: Report, bw: float, configs: list[tuple[int, int, int]], shapes: dict | None = None,
                  deadline: float = float("inf")) -> None:
    """Every config on every projection of `shapes` (the 8B model's by default; its attention sweep follows then);
    past `deadline` (time.monotonic()) the remaining projections are skipped, so the sweep fits its device call."""
    for name, (n, k) in (shapes or GEMV_SHAPES).items():
        if time.monotonic() > deadline:
            rep.row("sweep", f"{name} {n}x{k}", error="skipped: deadline")
            continue
        ws = _weights(n, k)
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        nbytes = n * k * 2
        cub = B.graph_time_ms(lambda i, ws=ws, x=x: x @ ws[i % len(ws)].t(), 2 * len(ws))
        rep.row("sweep", f"{name} cuBLAS", us=cub * 1e3, of_bw=nbytes / bw / 1e9 / cub)
        best = (float("inf"), configs[0])
        current = gemv.tuned_config(n, k, GEMV_PROLOGUE[name])  # what the engine picks for this shape today
        times: dict[tuple[int, ...], float] = {}
        for cfg in dict.fromkeys([current, *configs]):
            try:
                ms = B.graph_time_ms(_gemv_call(name, ws, k, cfg), 2 * len(ws))
            except Exception as exc:  # a config the compiler rejects (registers/shared memory) is skipped
                rep.row("sweep", f"{name} {cfg}", error=str(exc)[:120])
                continue
            rep.data.setdefault("sweep_all", []).append([name, list(cfg), ms * 1e3])
            times[cfg] = ms
            best = min(best, (ms, cfg))
        pdl_ms = B.graph_time_ms(_gemv_call(name, ws, k, best[1], pdl=True), 2 * len(ws))
        rep.row("sweep", f"{name} best {best[1]} prologue={GEMV_PROLOGUE[name]}", us=best[0] * 1e3,
                of_bw=nbytes / bw / 1e9 / best[0], vs_cublas=cub / best[0], pdl_us=pdl_ms * 1e3,
                pdl_of_bw=nbytes / bw / 1e9 / pdl_ms, shape=f"{n}x{k}", current=list(current),
                current_us=times.get(current, float("nan")) * 1e3)  # fmt: skip
        GEMV_BEST[(n, k, GEMV_PROLOGUE[name])] = best[1]
        del ws
    if shapes is None or shapes is GEMV_SHAPES:
        _attention_sweep(rep, bw)


def _attention_sweep(rep: Report, bw: float) -> None:
    """Decode attention options per regime: (BLOCK_N, num_stages, min keys per split, programs per SM)."""
    for regime, batch, seq in (("b1_1k", 1, 1024), ("b1_10k", 1, 10240), ("b64_1k", 64, 1024)):
        _attention_regime(rep, bw, regime, batch, seq)


def _attention_regime(rep: Report, bw: float, regime: str, batch: int, seq: int) -> None:
    sets = max(2, math.ceil(200e6 / (batch * seq * HKV * D * 4)))
    kc, vc, tables = _paged(batch, seq, sets)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=BF16)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    sl = torch.full((batch,), seq, device=DEV, dtype=torch.int32)
    seen, best = set(), (float("inf"), None)
    for block_n in (32, 64):
        for stages in (1, 2, 3):
            for min_keys in (32, 64, 128, 256):
                for pps in (2, 4):
                    splits = attention.choose_num_splits(batch, HKV, seq, DEV, min_keys=min_keys, programs_per_sm=pps)
                    if (block_n, stages, splits) in seen:
                        continue
                    seen.add((block_n, stages, splits))
                    fn = lambda i, bn=block_n, st=stages, sp=splits: attention.paged_attention(  # noqa: E731
                        q, kc, vc, cu, sl, tables[i % sets], D**-0.5, max_q_len=1, max_seq_len=seq,
                        num_splits=sp, block_n=bn, num_stages=st)  # fmt: skip
                    ms = B.graph_time_ms(fn, 2 * sets)
                    opts = dict(block_n=block_n, num_stages=stages, min_keys=min_keys, programs_per_sm=pps)
                    best = min(best, (ms, opts), key=lambda t: t[0])
    floor_ms = batch * seq * HKV * D * 4 / bw / 1e9
    rep.row("sweep", f"attn {regime} best {best[1]}", us=best[0] * 1e3, of_floor=floor_ms / best[0])
    ATTN_BEST[regime] = best[1]


PREFILL_BEST: dict = {}


def section_prefill_sweep(rep: Report) -> None:
    """Prefill attention tile options on 8 packed 1K prompts (the 64-request run's chunk) and one 10K prompt."""
    for name, batch, seq in (("8x1k", 8, 1024), ("1x10k", 1, 10240)):
        _prefill_regime(rep, name, batch, seq)


def _prefill_regime(rep: Report, name: str, batch: int, seq: int) -> None:
    kc, vc, tables = _paged(batch, seq, 1)
    q = torch.randn(batch * seq, HQ, D, device=DEV, dtype=BF16)
    cu = torch.arange(0, (batch + 1) * seq, seq, device=DEV, dtype=torch.int32)
    sl = torch.full((batch,), seq, device=DEV, dtype=torch.int32)
    flops = 4.0 * HQ * D * batch * seq * (seq + 1) / 2
    best = (float("inf"), {})
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    opts = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                    fn = lambda _i, o=opts: attention.paged_attention(  # noqa: E731
                        q, kc, vc, cu, sl, tables[0], D**-0.5, max_q_len=seq, max_seq_len=seq, **o)
                    try:
                        ms = B.graph_time_ms(fn, 3, replays=3)
                    except Exception as exc:  # out of shared memory / registers for this tile
                        rep.row("psweep", f"{name} {opts}", error=str(exc)[:100])
                        continue
                    best = min(best, (ms, opts), key=lambda t: t[0])
    default_ms = B.graph_time_ms(lambda _i: attention.paged_attention(
        q, kc, vc, cu, sl, tables[0], D**-0.5, max_q_len=seq, max_seq_len=seq), 3, replays=3)  # fmt: skip
    rep.row("psweep", f"prefill attn {name} best {best[1]}", us=best[0] * 1e3, default_us=default_ms * 1e3,
            tflops=flops / best[0] / 1e9, of_floor=flops / MATMUL_TFLOPS / 1e9 / best[0])  # fmt: skip
    if name == "8x1k":
        PREFILL_BEST.update(best[1])


def _gemv_checks(rep: Report, bw: float) -> None:
    for name, (n, k) in GEMV_SHAPES.items():
        ws = _weights(n, k)
        cfg = GEMV_BEST.get((n, k, GEMV_PROLOGUE[name]))
        a, b = torch.randn(1, k, device=DEV, dtype=BF16), torch.randn(1, k, device=DEV, dtype=BF16)
        nw = torch.randn(k, device=DEV, dtype=BF16)
        if name in ("qkv", "gate_up", "lm_head"):
            got = gemv.gemv(a, ws[0], prologue=gemv.PROLOGUE_ADD_RMS, b=b, norm_weight=nw, eps=1e-5, config=cfg)
            want = ref.add_rms_norm_linear(a.double(), b.double(), nw.double(), 1e-5, ws[0].double())
            fn = lambda i, ws=ws, a=a, b=b, nw=nw, cfg=cfg: gemv.gemv(  # noqa: E731
                a, ws[i % len(ws)], prologue=gemv.PROLOGUE_ADD_RMS, b=b, norm_weight=nw, eps=1e-5, config=cfg)
            label = "add_rms+gemv"
        else:
            got = (gemv.gemv(a, ws[0], config=cfg)[0],)
            want = (ref.linear(a.double(), ws[0].double()),)
            fn = lambda i, ws=ws, a=a, cfg=cfg: gemv.gemv(a, ws[i % len(ws)], config=cfg)  # noqa: E731
            label = "gemv"
        check(rep, "kernel", f"{label} {name} {n}x{k}", tuple(got), tuple(want), BF16, bw, n * k * 2, fn,
              n_inner=2 * len(ws))  # fmt: skip
        del ws


def _configs(quick: bool, short: bool = False) -> list[tuple[int, ...]]:
    """quick: two configs (a smoke run); short: the regions where the 8B sweep's winners fell (34 configs)."""
    if quick:
        return [(8, 512, 4), (4, 1024, 4)]
    if short:
        chunked = [(bn, bk, nw) for bn in (2, 4, 8) for bk in (512, 1024, 2048) for nw in (4, 8)
                   if 2048 <= bn * bk <= 16384]  # fmt: skip
        return chunked + [(bn, 0, nw, pps) for bn in (1, 2, 4) for nw in (4, 8, 16) for pps in (2, 4)]
    chunked = [(bn, bk, nw) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024, 2048) for nw in (4, 8)
               if 2048 <= bn * bk <= 16384]  # fmt: skip
    persistent = [(bn, 0, nw, pps) for bn in (1, 2, 4) for nw in (4, 8, 16) for pps in (2, 4, 8)]
    return chunked + persistent


def guarded(rep: Report, name: str, fn, *args) -> None:
    """Run one section; a failure is recorded and printed, and the other sections still run."""
    try:
        fn(*args)
    except Exception as exc:  # the report must survive any one section breaking
        import traceback

        traceback.print_exc()
        rep.row("error", name, error=f"{type(exc).__name__}: {str(exc)[:300]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--sections", default="bw,kernels,sweep")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--quick", action="store_true", help="few GEMV configs, short generations (smoke run)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--shapes", default="llama8b", choices=sorted(SWEEP_SHAPES),
                    help="the projections the sweep tunes: the 8B model's, or one GPU's share under TP=2")
    ap.add_argument("--short", action="store_true", help="sweep 34 configs instead of the full list's 51")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which the sweep stops")
    args = ap.parse_args()
    if args.shapes != "llama8b" and set(args.sections.split(",")) - {"bw", "sweep"}:
        ap.error(f"--shapes {args.shapes}: only the bw and sweep sections take it (the others time the 8B model's "
                 "own projections); run them without --shapes")  # fmt: skip
    t_end = time.monotonic() + args.deadline
    sections = set(args.sections.split(","))
    rep = Report(args.out)
    props = torch.cuda.get_device_properties(DEV)
    import transformers
    import triton

    rep.data["env"] = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                           triton=triton.__version__, transformers=transformers.__version__, commit=args.commit,
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           argv=" ".join(os.sys.argv))  # fmt: skip
    print(rep.data["env"], flush=True)
    bw = 4.22
    if "bw" in sections:
        bws = B.measure_bandwidth()
        bw = bws["read_TBps"]
        rep.row("bw", "device memory", **bws)
    rep.data["read_TBps"] = bw
    if "sweep" in sections:
        guarded(rep, "sweep", section_sweep, rep, bw, _configs(args.quick, args.short), SWEEP_SHAPES[args.shapes],
                t_end)
    else:  # the measured best of the e2aed4e sweep (verify/lab/journal-kernels.md)
        GEMV_BEST.update(gemv.H200_CONFIGS)
        ATTN_BEST.update(b1_1k=dict(block_n=64, num_stages=1, min_keys=64, programs_per_sm=2),
                         b1_10k=dict(block_n=32, num_stages=2, min_keys=32, programs_per_sm=4),
                         b64_1k=dict(block_n=64, num_stages=2, min_keys=32, programs_per_sm=2))  # fmt: skip
    if "psweep" in sections:
        guarded(rep, "psweep", section_prefill_sweep, rep)
    rep.data["gemv_best"] = {f"{n}x{k}/p{p}": list(c) for (n, k, p), c in GEMV_BEST.items()}
    rep.data["attn_best"] = ATTN_BEST
    if "kernels" in sections:
        guarded(rep, "kernels", section_kernels, rep, bw)
    _table(rep)


def _table(rep: Report) -> None:
    env = rep.data.get("env", {})
    print("\n=== summary ===", env.get("device"), "read BW", round(rep.data["read_TBps"], 3), "TB/s")
    keys = ("ok", "rel_err", "us", "of_floor", "of_bw", "vs_cublas", "tok_s", "of_roofline", "roofline_tok_s",
            "ttft_ms", "step_ms", "out_tok_s", "same_prefix_tokens", "same_greedy_prefix_as_envex", "decode_tok_s",
            "top1_same", "default_us", "tflops", "pdl_us", "vs_unfused", "vs_unfused_rel_err",
            "cache_rows_equal_unfused", "mismatches", "counters_zero", "saved_us_per_layer", "step_logits_vs_unfused",
            "shape", "current_us", "error")  # fmt: skip
    for r in rep.data["rows"]:
        if r["section"] == "sweep" and "best" not in r["name"] and "cuBLAS" not in r["name"]:
            continue
        vals = " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r)
        print(f"{r['section']:7s} {r['name']:44s} {vals}")
    rep.save()


if __name__ == "__main__":
    main()
