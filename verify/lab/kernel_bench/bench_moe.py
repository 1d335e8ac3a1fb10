"""gpt-oss-120b's batch-1 MoE on one GPU, launch by launch, with the GEMV kernels' tile variants (issue 13).

    python3 -m envex.verify.lab.kernel_bench.bench_moe --out $OUT --commit C [--variants] [--ncu-pass]

One layer's full-size experts (128 × MXFP4 gate-up [5760, 2880] and down [2880, 2880], random codes at dummy
magnitudes) and its router, timed in CUDA graphs (verify/lab/journal-kernels.md, "gpt-oss"):

- each launch of TritonOps.moe alone: the add+RMSNorm writing the input planes, the router GEMV (on bf16 rows),
  the gate-up GEMV (top-4 redone in each program), the down GEMV, and the whole entry point; "cold" rotates 8
  inputs whose routings pick other experts (the weights come from HBM), "hot" repeats one input (its 4 experts'
  53 MB mostly stay in the 50 MB L2, so the time is close to the kernel's issue time). Runs before 2026-12-01's
  last commits timed add_rms_norm (no planes) and fed the router float32 planes;
- a streaming read of exactly the 4 chosen experts' bytes (the floor for those bytes on this GPU);
- --variants: the two GEMV kernels over their rows a program and register caps (maxnreg), with the registers and
  spills ptxas gave and the largest difference from the default tile's result;
- --ncu-pass: no timing; each kernel launched a few times for `ncu` (the device command wraps the script).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from envex.kernels import moe_mxfp4 as M
from envex.kernels import mxfp4
from envex.kernels._common import arrival_counters, next_pow2

E, H, INTER, TOP_K = 128, 2880, 2880, 4


@triton.jit
def _stream_kernel(w_ptr, ids_ptr, out_ptr, words_per_expert, stride_we, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Reads the chosen experts' words (program_id(1): the slot) as int32 and XOR-folds them: the bytes alone."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    base = w_ptr + e * stride_we
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(base + offs, mask=offs < words_per_expert, other=0)
    tl.store(out_ptr + pid * 4 + slot, tl.xor_sum(acc, axis=0))


class Layer:
    def __init__(self, dev: torch.device) -> None:
        gen = torch.Generator(device=dev).manual_seed(0)
        dt = torch.bfloat16
        self.gu_blocks = torch.empty(E, 2 * INTER, H // 32, 16, dtype=torch.uint8, device=dev)
        self.gu_scales = torch.empty(E, 2 * INTER, H // 32, dtype=torch.uint8, device=dev)
        self.dn_blocks = torch.empty(E, H, INTER // 32, 16, dtype=torch.uint8, device=dev)
        self.dn_scales = torch.empty(E, H, INTER // 32, dtype=torch.uint8, device=dev)
        mxfp4.fill_random_(self.gu_blocks, self.gu_scales, gen)
        mxfp4.fill_random_(self.dn_blocks, self.dn_scales, gen)
        self.gu_bias = (torch.randn(E, 2 * INTER, device=dev, generator=gen) * 0.02).to(dt)
        self.dn_bias = (torch.randn(E, H, device=dev, generator=gen) * 0.02).to(dt)
        self.router_w = (torch.randn(E, H, device=dev, generator=gen) * H**-0.5).to(dt)
        self.router_b = (torch.randn(E, device=dev, generator=gen) * 0.02).to(dt)
        self.norm_w = torch.ones(H, device=dev, dtype=dt)
        self.gu_words = self.gu_blocks.view(torch.int32)
        self.dn_words = self.dn_blocks.view(torch.int32)

    @property
    def expert_bytes(self) -> tuple[int, int]:
        gu = (self.gu_blocks[0].numel() + self.gu_scales[0].numel())
        dn = (self.dn_blocks[0].numel() + self.dn_scales[0].numel())
        return gu, dn


def planes(x: torch.Tensor) -> torch.Tensor:
    xp = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    M._planes_kernel[(x.shape[0],)](x, xp, x.stride(0), xp.stride(0), K=x.shape[1], BLOCK=1024, num_warps=4)
    return xp


def gate_up(L: Layer, xp, logits, ids, wts, act, *, pairs=M.GEMV_PAIRS, warps=1, maxnreg=None):
    """xp: the input as planes (M._planes_kernel); act: float32 planes [T · top_k, I]."""
    return M._gate_up_gemv_kernel[(triton.cdiv(INTER, pairs), xp.shape[0] * TOP_K)](
        L.norm_w[None], xp, logits, ids, wts, L.gu_words, L.gu_scales, L.gu_bias, act,
        xp.stride(0), logits.stride(0), L.gu_words.stride(0), L.gu_blocks.stride(1), L.gu_scales.stride(0),
        L.gu_bias.stride(0), act.stride(0), 1.702, 7.0, K=H, INTER=INTER, E=E, TOP_K=TOP_K, BLOCK_E=next_pow2(E),
        BLOCK_TK=next_pow2(TOP_K), BLOCK_I=pairs, GB=M.GEMV_GROUPS, PACKED=True, num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


def down(L: Layer, act, ids, wts, out, *, rows=M.GEMV_DOWN_ROWS, warps=1, maxnreg=None):
    blocks = triton.cdiv(H, rows)
    part = torch.empty(out.shape[0] * TOP_K, H, dtype=torch.float32, device=out.device)
    counters = arrival_counters("fused_moe", out.device, out.shape[0] * blocks)
    return M._down_gemv_kernel[(blocks, out.shape[0], TOP_K)](
        act, ids, wts, L.dn_words, L.dn_scales, L.dn_bias, part, counters,
        out,
        act.stride(0), L.dn_words.stride(0), L.dn_blocks.stride(1), L.dn_scales.stride(0), L.dn_bias.stride(0),
        out.stride(0), N=H, INTER=INTER, TOP_K=TOP_K, BLOCK_N=rows, GB=M.GEMV_GROUPS, PACKED=True,
        num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--ncu-pass", action="store_true")
    ap.add_argument("--one-launch", action="store_true",
                    help="the entry point with the two GEMV launches against one launch (moe_mxfp4.ONE_LAUNCH), "
                    "for each of a few settings")
    args = ap.parse_args()
    from envex.kernels.triton_ops import TritonOps
    from envex.verify.lab.kernel_bench import _bench_lib as B

    dev = torch.device("cuda")
    torch.manual_seed(0)
    L = Layer(dev)
    ops = TritonOps(pdl=True)
    dt = torch.bfloat16
    rot = 8
    xs = [torch.randn(1, H, device=dev, dtype=dt) for _ in range(rot)]
    res = [torch.randn(1, H, device=dev, dtype=dt) for _ in range(rot)]
    normed = [planes(x) for x in xs]  # any [1, H] rows, as the gate-up kernel takes them
    logits = [torch.randn(1, E, device=dev).to(dt) for _ in range(rot)]
    ids = torch.empty(TOP_K, dtype=torch.int32, device=dev)
    wts = torch.empty(TOP_K, dtype=torch.float32, device=dev)
    act = torch.empty(TOP_K, INTER, dtype=torch.float32, device=dev)
    out = torch.empty(1, H, dtype=dt, device=dev)
    from envex.kernels import norm
    from envex.kernels.ops import MoEWeights

    ex = MoEWeights(gate_up_bias=L.gu_bias, down_bias=L.dn_bias, gate_up_blocks=L.gu_blocks,
                    gate_up_scales=L.gu_scales, down_blocks=L.dn_blocks, down_scales=L.dn_scales)  # fmt: skip
    gu_b, dn_b = L.expert_bytes

    if args.ncu_pass:
        for r in range(4):
            ops.moe(xs[r], res[r], L.norm_w, 1e-5, L.router_w, L.router_b, ex, TOP_K)
        for r in range(2):  # the default tiles, then the sweep's best (ncu -k regex:gemv --launch-skip 4)
            gate_up(L, normed[r], logits[r], ids, wts, act)
            down(L, act, ids, wts, out)
            gate_up(L, normed[r], logits[r], ids, wts, act, pairs=2)
            down(L, act, ids, wts, out, rows=2)
        torch.cuda.synchronize()
        return

    report: dict[str, Any] = {"env": {"device": torch.cuda.get_device_name(), "commit": args.commit,
                                      "torch": torch.__version__, "triton": triton.__version__,
                                      "argv": " ".join(sys.argv)}}  # fmt: skip
    from envex.kernels import reference
    from envex.kernels.accuracy import TOLERANCE, rel_err

    check: dict[str, Any] = {"tolerance": TOLERANCE[dt]}
    for t in (1, 4, 32):  # the GEMV path (T <= GEMV_MAX_ROWS) and the grouped one, against float64
        x = torch.randn(t, H, device=dev).to(dt)
        lg = torch.randn(t, E, device=dev)  # float32: no ties between routings
        got = M.fused_moe(x, lg, TOP_K, gate_up=(L.gu_blocks, L.gu_scales), gate_up_bias=L.gu_bias,
                          down=(L.dn_blocks, L.dn_scales), down_bias=L.dn_bias, alpha=1.702, limit=7.0)
        w, ids_ = reference.moe_route(lg.double(), TOP_K)
        want = reference.moe_experts(x.double(), w, ids_, (L.gu_blocks, L.gu_scales), L.gu_bias.double(),
                                     (L.dn_blocks, L.dn_scales), L.dn_bias.double(), 1.702, 7.0)  # fmt: skip
        check[f"rows_{t}_rel_err"] = rel_err(got, want)
    check["ok"] = all(v <= check["tolerance"] for k, v in check.items() if k.endswith("rel_err"))
    report["check"] = check
    print("  fused_moe against float64:", check, flush=True)
    report["bandwidth"] = B.measure_bandwidth(2.0)
    bw = report["bandwidth"]["read_TBps"]
    rows: list[dict[str, Any]] = []
    report["rows"] = rows

    def row(name: str, fn, nbytes: float, *, hot: bool = False) -> float:
        ms = B.graph_time_ms(lambda i: fn(0 if hot else i % rot), n_inner=2 * rot)
        us = ms * 1e3
        rows.append({"name": name, "hot": hot, "us": us, "bytes": nbytes, "TBps": nbytes / us / 1e6,
                     "floor_us": nbytes / bw / 1e6})  # fmt: skip
        print(f"  {name:<58} {'hot ' if hot else 'cold'} {us:8.2f} us  {nbytes / 1e6:7.2f} MB "
              f"{nbytes / us / 1e6:6.2f} TB/s (floor {nbytes / bw / 1e6:6.2f} us)", flush=True)
        return us

    # routing for the kernels timed alone: the gate-up kernel writes ids/wts, the down kernel reads them
    acts = [torch.empty_like(act) for _ in range(rot)]
    idss = [torch.empty_like(ids) for _ in range(rot)]
    wtss = [torch.empty_like(wts) for _ in range(rot)]
    for r in range(rot):
        gate_up(L, normed[r], logits[r], idss[r], wtss[r], acts[r])
    torch.cuda.synchronize()
    gu_words, blk, iters = L.gu_words[0].numel(), 2048, 4
    sink = torch.empty(triton.cdiv(gu_words, blk * iters) * 4, dtype=torch.int32, device=dev)

    def stream(r: int) -> None:
        _stream_kernel[(triton.cdiv(gu_words, blk * iters), TOP_K)](
            L.gu_words, idss[r], sink, gu_words, L.gu_words.stride(0), BLOCK=blk, ITERS=iters, num_warps=8)

    moe_bytes = L.router_w.nbytes + TOP_K * (gu_b + dn_b)
    for hot in (False, True):
        row("entry: ops.moe (norm, router, gate-up, down)", lambda r: ops.moe(
            xs[r], res[r], L.norm_w, 1e-5, L.router_w, L.router_b, ex, TOP_K), moe_bytes, hot=hot)  # fmt: skip
        row("add + RMSNorm with the input planes (norm_planes)", lambda r: norm.norm_planes(
            xs[r], res[r], L.norm_w, 1e-5), 4 * H * 2 + H * 4, hot=hot)  # fmt: skip
        row("add + RMSNorm + planes + router logits in one launch (norm_router)", lambda r: M.norm_router(
            xs[r], res[r], L.norm_w, 1e-5, L.router_w, L.router_b), 4 * H * 2 + H * 4 + L.router_w.nbytes,
            hot=hot)  # fmt: skip
        row("router GEMV [128 x 2880] + bias", lambda r: ops.linear(xs[r], L.router_w, L.router_b),
            L.router_w.nbytes, hot=hot)  # fmt: skip
        row("x -> planes", lambda r: planes(xs[r]), 3 * H * 2, hot=hot)
        row("gate-up GEMV (top-4 in each program) baseline", lambda r: gate_up(
            L, normed[r], logits[r], idss[r], wtss[r], acts[r]), TOP_K * gu_b, hot=hot)  # fmt: skip
        row("down GEMV baseline", lambda r: down(L, acts[r], idss[r], wtss[r], out), TOP_K * dn_b, hot=hot)
        row("stream: the 4 experts' gate-up words only", stream, TOP_K * L.gu_blocks[0].nbytes, hot=hot)
    if args.one_launch:
        settings = [dict(ONE_LAUNCH=False)] + [
            dict(ONE_LAUNCH=True, ONE_LAUNCH_WARM=w, ONE_LAUNCH_SPIN_NS=ns, ONE_LAUNCH_MAXNREG=n,
                 ONE_LAUNCH_COOPERATIVE=co)
            for w, ns, n, co in ((True, 800, 168, True), (True, 800, 168, False), (False, 800, 168, True),
                                 (True, 0, 168, True), (True, 400, 168, True), (True, 800, 128, True))]
        saved = {k: getattr(M, k) for k in settings[1]}
        M.ONE_LAUNCH = False  # the two launches' output: what every setting must give, bit for bit
        want = ops.moe(xs[0], res[0], L.norm_w, 1e-5, L.router_w, L.router_b, ex, TOP_K)[0].clone()
        for setting in settings:
            name = "entry " + " ".join(f"{k.removeprefix('ONE_LAUNCH_').lower()}={v}" for k, v in setting.items())
            for k, v in setting.items():
                setattr(M, k, v)
            try:
                got = ops.moe(xs[0], res[0], L.norm_w, 1e-5, L.router_w, L.router_b, ex, TOP_K)[0]
                same = bool(torch.equal(got, want))
                built = [v for k, v in M._RESIDENT.items() if k[6:] == (
                    M.ONE_LAUNCH_WARM, M.ONE_LAUNCH_SPIN_NS, M.ONE_LAUNCH_MAXNREG, M.ONE_LAUNCH_COOPERATIVE)
                ] if M.ONE_LAUNCH else []
                for hot in (False, True):
                    row(name, lambda r: ops.moe(xs[r], res[r], L.norm_w, 1e-5, L.router_w, L.router_b, ex, TOP_K),
                        moe_bytes, hot=hot)  # fmt: skip
                    rows[-1].update(same_bits=same, fits_regs_spills=built)
                print(f"      same bits {same}; (programs that fit, regs, spills) {built}", flush=True)
            except Exception as exc:  # a setting Triton cannot build: record it, go on
                rows.append({"name": name, "error": str(exc)[:300]})
                print(f"  {name}: {str(exc)[:300]}", flush=True)
        for k, v in saved.items():
            setattr(M, k, v)
    if args.variants:
        def sweep(kind: str, variants, launch, nbytes: float, result: torch.Tensor) -> None:
            launch(0, variants[0])
            want = result.float().clone()
            for v in variants:
                name = f"{kind} " + " ".join(f"{k}={x}" for k, x in v.items())
                try:
                    result.zero_()
                    k = launch(0, v)
                    diff = (result.float() - want).abs().max().item()  # another tile sums in another order
                    row(name, lambda r, v=v: launch(r, v), nbytes)
                    rows[-1].update(regs=k.n_regs, spills=k.n_spills, max_abs_diff=diff)
                    print(f"      regs {k.n_regs} spills {k.n_spills} max |diff| {diff:.3g}", flush=True)
                except Exception as exc:  # a tile Triton cannot build: record it, go on
                    rows.append({"name": name, "error": str(exc)[:300]})
                    print(f"  {name}: {str(exc)[:200]}", flush=True)

        # (a `stages` variant, the K loop software-pipelined by Triton through shared memory, ran on 2026-12-02 at
        # 0ca1dca: slower at 2 and 3 stages for both kernels; register caps (maxnreg 96-112) and 2 pairs or 4 rows
        # a program, earlier: slower too; verify/lab/journal-kernels.md)
        gu = [dict(pairs=p, warps=w, maxnreg=m) for p, w, m in (
            (8, 1, None), (4, 1, None), (8, 2, None), (16, 2, None), (16, 1, None), (16, 4, None))]
        sweep("gate-up", gu, lambda r, v: gate_up(L, normed[r], logits[r], idss[r], wtss[r], acts[r], **v),
              TOP_K * gu_b, acts[0])
        dn = [dict(rows=n, warps=w, maxnreg=m) for n, w, m in (
            (8, 1, None), (16, 1, None), (16, 2, None), (8, 2, None), (32, 2, None), (32, 4, None))]
        sweep("down", dn, lambda r, v: down(L, acts[r], idss[r], wtss[r], out, **v), TOP_K * dn_b, out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
