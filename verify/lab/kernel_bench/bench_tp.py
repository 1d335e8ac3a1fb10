"""Tensor parallelism on a 2-GPU host (issue 15): the all-reduce, the share of a step it takes, and the server.

    python3 -m envex.verify.lab.kernel_bench.bench_tp --out $OUT --tree /tmp/ns
        [--sections ar,gate,server70,server8,share]
    python3 -m envex.verify.lab.kernel_bench.bench_tp --out /tmp/tp-dry --device cpu --shape tiny   # CPU dry run (gloo)

Sections, run in the order given (each writes its part of $OUT/tp.json as soon as it ends; a section that fails
is recorded and the next one runs; --deadline stops starting new work, so the whole run fits one device call):
- ar: two ranks (processes). The one-shot all-reduce over peer memory against NCCL, 8 KB .. 1 MB of bf16, eager (per
  call, host launch included) and captured in a CUDA graph (50 calls per replay, per call); the fused all-reduce +
  add + RMSNorm at 1 and 64 rows of H = 8192 against NCCL + the Triton add_rms_norm; the custom result against NCCL's
  (relative error) and rank 0's bits against rank 1's.
- gate: verify/gate_tensor_parallel.py in this process: TP=2 against TP=1 greedy on the same random weights (the
  8B shape cut to 4 layers), gate_reference's top-5 rule at the first difference.
- share: two ranks, the Llama-3.1-8B shape at TP=2 (dummy weights): the captured decode step (the model file's
  forward, as DecodeGraphs captures it) at batch 1 and 64, every sequence at 1K cached tokens, with the real
  all-reduce and with it replaced by a no-op (logits gathered in both): 1 - t_noop / t_real is the share of the
  step spent in all-reduce.
- server70, server8: bench_server's child-process server and streaming client (reused, not copied) on dummy
  weights: the Llama-3.1-70B shape at TP=2, batch 1, 1K prompt / 256 out, against the 2-GPU byte roofline (half of
  a step's bytes per GPU at the read bandwidth measured here); the Llama-3.1-8B shape at TP=1 and TP=2, batch 1
  and 64 concurrent.

Prints a Markdown table (also in tp.json's "markdown") for verify/lab/journal.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from envex.runtime.parallel.state import NO_MULTICAST_ENV
from envex.verify.lab.kernel_bench import bench_server as S

os.environ.update(NO_MULTICAST_ENV)  # before anything here starts NCCL or symmetric memory
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA70B = {
    **S.SHAPES["llama8b"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}  # Llama-3.1-70B: 8 KV heads, the 8B's vocabulary and rope
# The dry run's shape: the vocabulary covers the ids bench_server's prompts use (below 30000).
TINY = {
    **S.SHAPES["llama8b"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_scaling": None,
    "torch_dtype": "float32",
}
AR_SIZES_KB = (8, 16, 32, 64, 128, 256, 512, 1024)
# (batch, prompt, out, runs after the warm-up); the dry run's are small enough for two CPU cores.
CASES = {"b1_1k": (1, 1024, 256, 3), "c64_1k": (64, 1024, 256, 2)}
DRY_CASES = {"b1_1k": (1, 64, 16, 1), "c64_1k": (4, 64, 16, 1)}


# ---- the two-rank sections (one process per rank) -------------------------------------------------------------


def _timed(device: str, fn: Any, calls: int) -> float:
    """Per-call microseconds of fn() called `calls` times back to back, eager (host launch included)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _graphed(device: str, fn: Any, inner: int = 50) -> float | None:
    """Per-call microseconds of fn() captured `inner` times in one CUDA graph (None off CUDA)."""
    if device != "cuda":
        return None
    from envex.verify.lab.kernel_bench import _bench_lib as B

    return B.graph_time_ms(lambda _i: fn(), n_inner=inner) * 1e3


def _ar_section(state: Any, device: str) -> dict:
    import torch.distributed as dist

    from envex.kernels import allreduce

    comm, rank = state.comm, state.rank
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    peers = comm.peers
    rows: list[dict] = []
    for kb in AR_SIZES_KB:
        n = kb * 1024 * 8 // torch.finfo(dtype).bits  # elements
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(n, device=device, generator=g).to(dtype)
        buf = x.clone()
        row: dict[str, Any] = {"bytes": n * x.element_size()}
        if peers is not None:

            def custom(x: torch.Tensor = x) -> torch.Tensor:
                return allreduce.one_shot_all_reduce(
                    x, peers.buf_ptrs, peers.pad_ptrs, rank, buffer_elems=peers.data_bytes // x.element_size()
                )

            ours = custom()
            want = x.clone()
            dist.all_reduce(want, group=comm.group)
            both = comm.all_gather(ours.view(1, -1))  # [1, 2n]: rank 0's bits, then rank 1's
            row["custom_vs_nccl_rel_err"] = float((ours.float() - want.float()).norm() / want.float().norm())
            row["ranks_bitwise_equal"] = bool(torch.equal(both[0, :n], both[0, n:]))
            row["custom_eager_us"] = _timed(device, custom, 200)
            row["custom_graph_us"] = _graphed(device, custom)
        row["nccl_eager_us"] = _timed(device, lambda b=buf: dist.all_reduce(b, group=comm.group), 200)
        row["nccl_graph_us"] = _graphed(device, lambda b=buf: dist.all_reduce(b, group=comm.group))
        rows.append(row)
    fused: list[dict] = []
    if peers is not None:
        from envex.kernels import norm

        hidden = 8192
        for tokens in (1, 64):
            x = torch.randn(tokens, hidden, device=device).to(dtype)
            res = torch.randn(tokens, hidden, device=device).to(dtype)
            w = torch.ones(hidden, device=device, dtype=dtype)
            buf = x.clone()

            def unfused(b: torch.Tensor = buf, res: torch.Tensor = res, w: torch.Tensor = w) -> Any:
                dist.all_reduce(b, group=comm.group)
                return norm.add_rms_norm(b, res, w, 1e-5)

            fused.append(
                {
                    "rows": tokens,
                    "hidden": hidden,
                    "fused_graph_us": _graphed(
                        device, lambda x=x, r=res, w=w: comm.all_reduce_add_rms_norm(x, r, w, 1e-5)
                    ),
                    "nccl_then_norm_graph_us": _graphed(device, unfused),
                }
            )
    return {"dtype": str(dtype), "custom": comm.custom_note, "sizes": rows, "fused": fused}


class _NoReduce:
    """The communicator with its all-reduce removed (timing only: the sums are wrong); logits still gathered."""

    def __init__(self, comm: Any) -> None:
        self.world_size, self._comm = comm.world_size, comm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_add_rms_norm(self, *args: Any) -> None:
        return None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._comm.all_gather(x)


def _share_section(state: Any, device: str, model_dir: Path, context: int) -> dict:
    from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
    from envex.runtime.engine.config import EngineConfig, model_window
    from envex.runtime.engine.model_runner import ModelRunner
    from envex.runtime.loader import load_model_info

    loaded = load_model_info(str(model_dir))
    batches = (1, 64) if device == "cuda" else (1, 4)
    blocks_per_seq = context // 16 + 2
    config = EngineConfig(
        model=str(model_dir),
        device=device,
        load_format="dummy",
        max_model_len=context + 64,
        max_num_seqs=max(batches),
        num_kv_blocks=max(batches) * blocks_per_seq + 1,
        use_cuda_graphs=False,
        tensor_parallel=state.world_size,
        # the default kernels' TP scaling (verify/lab/journal.md); the deterministic mode's is its own
        deterministic=False,
    )
    config = config.resolved(window=model_window(loaded.config), cuda_available=device == "cuda",
                             architecture=loaded.config.architecture)
    runner = ModelRunner(config, loaded, parallel=state)
    graphs = DecodeGraphs(runner, max_batch=max(batches), capture=False)  # its inputs and captured step only
    out: dict[str, Any] = {"shape": model_dir.name, "context": context, "batches": {}}
    layers = [*runner.model.layers, runner.model]
    for b in batches:
        x = graphs._inputs[next(s for s in graphs.sizes if s >= b)]
        x.positions.fill_(context)
        x.block_tables.copy_(
            torch.arange(x.block_tables.numel(), device=x.block_tables.device).view_as(x.block_tables).int()
            % runner.num_blocks
        )
        x.active.fill_(True)
        size = x.positions.shape[0]
        step = {}
        for label, comm in (("real", state.comm), ("no_all_reduce", _NoReduce(state.comm))):
            for module in layers:
                module.comm = comm
            with torch.inference_mode():
                if device == "cuda":
                    step[label] = _graphed(device, lambda s=size: graphs._forward(s), inner=5)
                else:
                    step[label] = _timed(device, lambda s=size: graphs._forward(s), 5)
        for module in layers:
            module.comm = state.comm
        step["all_reduce_share"] = 1 - step["no_all_reduce"] / step["real"]
        out["batches"][str(size)] = step
    return out


def _rank_main(
    rank: int, world: int, init: str, device: str, sections: list[str], model_dir: str, context: int, result: str
) -> None:
    from envex.runtime.parallel.workers import init_rank

    state = init_rank(rank, world, init, device)
    report: dict[str, Any] = {}
    for name in sections:
        try:
            if name == "ar":
                report["ar"] = _ar_section(state, device)
            elif name == "share":
                report["share"] = _share_section(state, device, Path(model_dir), context)
        except Exception as exc:  # recorded; the other section still runs
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    if rank == 0:
        Path(result).write_text(json.dumps(report, indent=1))
    import torch.distributed as dist

    dist.destroy_process_group()


def run_ranks(device: str, sections: list[str], model_dir: Path, context: int, out: Path, timeout: float) -> dict:
    """The two-rank sections in two processes; killed after `timeout` seconds (a hung collective must not take
    the rest of the run with it)."""
    import torch.multiprocessing as mp

    from envex.runtime.parallel.workers import _free_port

    result = out / "ranks.json"
    result.unlink(missing_ok=True)
    init = f"tcp://127.0.0.1:{_free_port()}"
    args = (2, init, device, sections, str(model_dir), context, str(result))
    ctx = mp.spawn(_rank_main, args=args, nprocs=2, join=False)
    limit = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > limit:
                for proc in ctx.processes:
                    proc.kill()
                return {name: {"error": f"killed after {timeout:.0f} s (hung?)"} for name in sections}
    except Exception as exc:  # a rank died: its error, and whatever rank 0 wrote before
        got = json.loads(result.read_text()) if result.is_file() else {}
        return {name: got.get(name, {"error": f"{type(exc).__name__}: {exc}"[-2000:]}) for name in sections}
    return json.loads(result.read_text()) if result.is_file() else {"error": "rank 0 wrote no result"}


def _gate_child(args: argparse.Namespace, tiny: bool, result: str) -> None:
    try:
        out = _gate_section(args, tiny)
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    Path(result).write_text(json.dumps(out, indent=1, default=str))


def run_gate(args: argparse.Namespace, tiny: bool, timeout: float) -> dict:
    """The gate in a child process (its engines, its process group), killed after `timeout` seconds."""
    import multiprocessing

    result = args.out / "gate.json"
    result.unlink(missing_ok=True)
    proc = multiprocessing.get_context("spawn").Process(target=_gate_child, args=(args, tiny, str(result)))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()  # its worker follows (parent-death signal)
        return {"error": f"killed after {timeout:.0f} s (hung?)"}
    return json.loads(result.read_text()) if result.is_file() else {"error": f"exit code {proc.exitcode}"}


# ---- the gate: TP=2 against TP=1 on the same weights ----------------------------------------------------------


def _gate_section(args: argparse.Namespace, tiny: bool) -> dict:
    """gate_tensor_parallel on a random checkpoint (the 8B shape cut to 4 layers and a 32K vocabulary: its dummy
    weights would differ per rank), 8 prompts of 7..500 tokens, 32 greedy tokens each, in this process."""
    from dataclasses import asdict

    from envex.runtime.engine import EngineConfig, LLMEngine
    from envex.verify.gate_tensor_parallel import check_tensor_parallel_equality, write_random_checkpoint

    shape = TINY if tiny else {**S.SHAPES["llama8b"], "num_hidden_layers": 4, "vocab_size": 32000}
    path = args.models / ("tp-gate-tiny" if tiny else "tp-gate-8b-4l")
    if not (path / "model.safetensors").is_file():
        write_random_checkpoint(path, shape, seed=0, device=args.device)
    # Both engines share GPU 0: each gets a fixed cache (8 sequences of 1K tokens), not a share of free memory.
    settings: dict[str, Any] = {"model": str(path), "max_model_len": 1024, "max_num_seqs": 8, "warm_up": False,
                                "enable_prefix_caching": False, "num_kv_blocks": 8 * 64 + 8}  # fmt: skip
    if args.device == "cpu":
        settings["device"] = "cpu"
    prompts = [" ".join(f"t{(i * 7919 + j * 104729) % 30000 + 2}" for j in range(n))
               for i, n in enumerate((7, 12, 25, 40, 64, 100, 300, 500))]  # fmt: skip
    single = LLMEngine(EngineConfig(**settings))
    parallel = LLMEngine(EngineConfig(**settings, tensor_parallel=2))
    try:
        result = check_tensor_parallel_equality(parallel, single, prompts=prompts, max_tokens=32)
    finally:
        parallel.close()
    del single, parallel
    if args.device == "cuda":
        torch.cuda.empty_cache()
    out = asdict(result)
    for case in out["evidence"]["cases"]:  # the prompts are long id lists: keep what says what happened
        case.pop("prompt"), case.pop("engine_text"), case.pop("reference_text")
    print(f"gate: {result.verdict}: {result.summary}", flush=True)
    return out


# ---- the server section ------------------------------------------------------------------------------------------


def _server_run(
    label: str,
    shape_name: str,
    shape: dict,
    tp: int,
    cases: dict,
    args: argparse.Namespace,
    bw_tbps: float | None,
    port: int,
    deadline: float,
) -> dict:
    model_dir = args.models / shape_name
    S.write_model_dir(model_dir, shape, weights=False)
    # warm_up off: each case's discarded first run compiles what that case needs, and a cold Triton cache would
    # otherwise compile every variant at each of the three starts.
    settings: dict[str, Any] = {
        "warm_up": False,
        "model": str(model_dir),
        "load_format": "dummy",
        "max_model_len": 4096,
        "enable_prefix_caching": False,
        "tensor_parallel": tp,
        "max_num_seqs": max(c[0] for c in cases.values()),
    }
    if args.device == "cpu":
        settings.update(device="cpu", kv_cache_memory_gb=0.25)
    run: dict[str, Any] = {"label": label, "shape": shape_name, "tp": tp, "settings": settings, "cases": {}}
    base = f"http://127.0.0.1:{port}"
    proc = S.start_server(str(args.tree), settings, port, args.out / f"server-{label}.log")
    try:
        run["ready_s"] = S.wait_ready(base, proc, timeout=max(30.0, deadline - time.monotonic()))
        import httpx

        served = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        for case, (batch, prompt_len, out_len, reps) in cases.items():
            if time.monotonic() > deadline:
                run["cases"][case] = {"skipped": "deadline"}
                continue
            # the first run is the warm-up; a run is cut off a minute past the deadline (a hung server)
            wait = max(30.0, deadline + 60 - time.monotonic())
            rows = [asyncio.run(asyncio.wait_for(S.run_case(base, served, batch, prompt_len, out_len, seed=r), wait))
                    for r in range(reps + 1)][1:]  # fmt: skip
            ok = [r for r in rows if r["completion_tokens"] == out_len]
            key = "decode_tok_s" if batch == 1 else "output_tok_s"
            median = statistics.median(r[key] for r in ok) if ok else float("nan")
            ttft = statistics.median(r["ttft_ms"] for r in ok) if ok else None
            entry: dict[str, Any] = {"rows": rows, "metric": key, "median": median, "ttft_ms": ttft}
            if batch == 1 and bw_tbps:
                # Each GPU reads its half of the step's bytes (the shards split every matrix and the KV heads).
                roof = tp * bw_tbps * 1e12 / S.step_bytes(shape, prompt_len + out_len // 2)
                entry.update(roofline_tok_s=roof, share_of_roofline=entry["median"] / roof)
            run["cases"][case] = entry
            print(f"{label:>14} {case:>7}: {key} {entry['median']:9.1f}", flush=True)
    except Exception as exc:
        run["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{label}: {run['error']}", flush=True)
    finally:
        S.stop_server(proc)
    return run


def markdown(report: dict) -> str:
    lines = ["| what | setting | figure |", "|---|---|---|"]
    gate = report.get("gate", {})
    if "verdict" in gate:
        lines.append(f"| gate: TP=2 vs TP=1 greedy, same weights | top-5 rule at the first difference | "
                     f"{gate['verdict']}: {gate['summary']} |")  # fmt: skip
    elif "error" in gate:
        lines.append(f"| gate: TP=2 vs TP=1 | error | {gate['error']} |")
    ar = report.get("ranks", {}).get("ar", {})
    for row in ar.get("sizes", []):
        kb = row["bytes"] // 1024

        def us(key: str, row: dict = row) -> str:
            v = row.get(key)
            return f"{v:.1f}" if isinstance(v, float) else "-"

        lines.append(
            f"| all-reduce {kb} KB, TP=2 | custom / NCCL, in a CUDA graph (eager) | {us('custom_graph_us')} / "
            f"{us('nccl_graph_us')} us ({us('custom_eager_us')} / {us('nccl_eager_us')}) |"
        )
    for row in ar.get("fused", []):
        f, u = row.get("fused_graph_us"), row.get("nccl_then_norm_graph_us")
        if f is not None and u is not None:
            lines.append(
                f"| all-reduce + add + RMSNorm, {row['rows']} x {row['hidden']} | fused / NCCL then norm | "
                f"{f:.1f} / {u:.1f} us |"
            )
    share = report.get("ranks", {}).get("share", {})
    for size, step in share.get("batches", {}).items():
        lines.append(
            f"| share of a decode step in all-reduce, {share['shape']} TP=2, batch {size} | real / no "
            f"all-reduce | {step['real']:.0f} / {step['no_all_reduce']:.0f} us: "
            f"{100 * step['all_reduce_share']:.1f}% |"
        )
    for run in report.get("server", []):
        for case, c in run.get("cases", {}).items():
            if "median" not in c:
                continue
            roof = (
                f", {100 * c['share_of_roofline']:.1f}% of the {c['roofline_tok_s']:.0f} tok/s roofline"
                if (c.get("share_of_roofline"))
                else ""
            )
            lines.append(
                f"| {run['shape']} TP={run['tp']} through the server | {case} | {c['metric']} {c['median']:.1f}{roof} |"
            )
        if "error" in run:
            lines.append(f"| {run['shape']} TP={run['tp']} | error | {run['error']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--tree", type=Path, default=Path("/tmp/ns"), help="a folder holding envex/ (the server's tree)")
    ap.add_argument("--models", type=Path, default=Path("/tmp/envex-models"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=("full", "tiny"), default="full", help="tiny: the CPU dry run's shapes")
    ap.add_argument("--sections", default="ar,gate,server70,server8,share", help="run in this order")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--deadline", type=float, default=500.0, help="seconds after which no new work starts")
    args = ap.parse_args()
    deadline = time.monotonic() + args.deadline
    args.out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    tiny = args.shape == "tiny"
    report: dict[str, Any] = {
        "env": {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "gpus": torch.cuda.device_count(),
            "torch": torch.__version__,
            "commit": args.commit,
            "argv": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    }
    path = args.out / "tp.json"

    def save() -> None:
        report["markdown"] = markdown(report)
        path.write_text(json.dumps(report, indent=1))

    print(json.dumps(report["env"]), flush=True)
    small = TINY if tiny else S.SHAPES["llama8b"]
    small_name = "tiny" if tiny else "llama8b"
    cases = DRY_CASES if tiny else CASES
    servers = {
        "server70": [("70b-tp2", "tiny" if tiny else "llama70b", TINY if tiny else LLAMA70B, 2,
                      {"b1_1k": cases["b1_1k"]})],
        "server8": [("8b-tp1", small_name, small, 1, cases), ("8b-tp2", small_name, small, 2, cases)],
    }  # fmt: skip
    bw: dict | None = None
    report["ranks"], report["server"] = {}, []
    for section in sections:
        if time.monotonic() > deadline:
            report.setdefault("skipped", []).append(section)
            continue
        if section in ("ar", "share"):
            share_dir = args.models / small_name
            S.write_model_dir(share_dir, small, weights=False)
            t0 = time.monotonic()
            try:
                got = run_ranks(
                    args.device, [section], share_dir, 64 if tiny else 1024, args.out, max(60.0, deadline - t0)
                )
            except Exception as exc:
                got = {section: {"error": f"{type(exc).__name__}: {exc}"}}
            report["ranks"].update(got)
            report[f"{section}_s"] = time.monotonic() - t0
            print(json.dumps(got, indent=1)[:6000], flush=True)
        elif section == "gate":
            t0 = time.monotonic()
            report["gate"] = run_gate(args, tiny, max(60.0, deadline - t0))
            report["gate_s"] = time.monotonic() - t0
        elif section in servers:
            if bw is None and args.device == "cuda":
                from envex.verify.lab.kernel_bench import _bench_lib as B

                bw = report["bandwidth"] = B.measure_bandwidth()
                torch.cuda.empty_cache()
            for label, name, shape, tp, run_cases in servers[section]:
                if time.monotonic() > deadline:
                    report["server"].append({"label": label, "shape": name, "tp": tp, "error": "skipped: deadline"})
                    continue
                port = 18100 + len(report["server"])
                read = bw["read_TBps"] if bw else None
                report["server"].append(_server_run(label, name, shape, tp, run_cases, args, read, port, deadline))
        else:
            raise SystemExit(f"--sections: unknown section {section!r}; use ar, gate, server70, share, server8")
        save()
    save()
    print("\n" + report["markdown"], flush=True)


if __name__ == "__main__":
    main()
