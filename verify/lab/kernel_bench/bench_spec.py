"""Speculative decoding on the H200 (issue 16): verify-step cost, and tokens/s with n-gram drafting on real text.

    python3 -m envex.verify.lab.kernel_bench.bench_spec --out $OUT [--model PATH] [--sections graphs,model]

Sections:
- graphs: the Llama-3.1-8B shape with random weights (config.json only, `--load-format dummy`): the captured decode
  graph (k = 0) and verify graphs (k = 1, 2, 4, 8, n-gram drafting included) replayed directly, every sequence at
  --context cached tokens, for batch 1, 4, 16, 64: milliseconds per step, and the ratio to k = 0.
  Also the batch-1 decode and k = 4 verify graphs kernel by kernel (torch.profiler; under PDL the decode
  step's kernels overlap, so their durations add up to more than the step).
- model: the model at --model (the embedded SmolLM2-135M-Instruct GGUF, real weights) through LLMEngine at batch 1,
  greedy, each request to its natural end: speculation off (overlapped plain decoding) against n-gram speculation
  (num_speculative_tokens 8, adaptive), one request each in turn, on the code-edit workload (verify/data_code_edit.json:
  hand a 40-80 line file back with one edit) and the chat-1 workload (chat prompts, little repetition). Reports
  output tok/s on and off, tokens per verify step, the per-draft acceptance, and whether the answers are
  byte-identical (bf16 numerics may differ where a verify step's GEMMs round differently from a decode step's).
- Then the projection for the 8B shape at the measured acceptance a: a step of k drafts yields
  E(k) = (1 - a^(k+1)) / (1 - a) tokens in t(1, k) ms, against 1 token in t(1, 0) ms.

Writes $OUT/spec.json and prints a Markdown table for verify/lab/journal.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BATCHES = (1, 4, 16, 64)
DEPTHS = (1, 2, 4, 8)
# The CPU dry run's shape (tests/test_runtime_speculative.py runs the script on it): the same code, seconds.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096)  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _write_shape(path: Path, shape: dict) -> None:
    """A model shape as an HF directory without weights (load_format dummy makes them on the device)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    config = {**shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "eos_token_id": 1,
              "tie_word_embeddings": False}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))


def _replay_ms(replay, iters: int = 20) -> float:
    replay()
    if not torch.cuda.is_available():  # the CPU dry run: wall time of one call
        t = time.perf_counter()
        replay()
        return (time.perf_counter() - t) * 1000
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def bench_graphs(context: int, shape: dict, device: str) -> dict:
    """Step time of the captured decode (k = 0) and verify graphs of a shape, every sequence at `context`."""
    from envex.runtime.engine.config import EngineConfig, model_window
    from envex.runtime.engine.model_runner import ModelRunner
    from envex.runtime.engine.spec.decoder import SpecDecoder
    from envex.runtime.engine.spec.drafters import NgramDrafter
    from envex.runtime.engine.spec.graphs import SpecGraphs
    from envex.runtime.loader import load_model_info

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        _write_shape(Path(tmp), shape)
        loaded = load_model_info(tmp)
        blocks_per_seq = -(-(context + max(DEPTHS) + 2) // 16)
        config = EngineConfig(model=tmp, load_format="dummy", device=device, max_model_len=context + 64,
                              max_num_seqs=max(BATCHES), num_kv_blocks=blocks_per_seq * max(BATCHES) + 8,
                              num_speculative_tokens=max(DEPTHS), speculative_max_batch=max(BATCHES), warm_up=False,
                              deterministic=False,
                              ).resolved(window=model_window(loaded.config), cuda_available=device == "cuda",
                                         architecture=loaded.config.architecture)  # fmt: skip
        runner = ModelRunner(config, loaded)
    spec = SpecDecoder(runner, NgramDrafter(), max_k=max(DEPTHS), max_batch=max(BATCHES),
                       max_num_seqs=max(BATCHES), capture=False)  # fmt: skip
    graphs = spec.graphs = SpecGraphs(runner, spec, spec.drafter, sizes=BATCHES, ks=DEPTHS, capture=True)
    capture_s = time.perf_counter() - t0
    gen = torch.Generator(device=device).manual_seed(0)
    spec.hist.random_(0, shape["vocab_size"], generator=gen)  # random text: n-gram lookup finds little
    spec.lens[: max(BATCHES)] = context + 1  # `context` tokens cached, the newest one fed in
    rows: list[dict] = []
    for b in BATCHES:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        decode = runner.decode_graphs
        if decode is None:  # the CPU dry run: the same step, eagerly
            from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs

            decode = runner.decode_graphs = DecodeGraphs(runner, max_batch=max(BATCHES), capture=False)
        decode.run([1] * b, [context] * b, tables)
        base = _replay_ms(decode.graph(*decode.key_for(b, [context] * b)).replay if decode.capture
                          else lambda d=decode, b=b, t=tables: d.run([1] * b, [context] * b, t))  # fmt: skip
        row = {"batch": b, "k0_ms": base}
        for k in DEPTHS:
            graphs.run(list(range(b)), [k] * b, tables, k)
            ms = _replay_ms(graphs._graphs[(b, k)].replay if graphs.capture
                            else lambda b=b, k=k, t=tables: graphs.run(list(range(b)), [k] * b, t, k))  # fmt: skip
            row[f"k{k}_ms"], row[f"k{k}_ratio"] = ms, ms / base
            # The whole launched step as the engine runs it: graph, acceptance, the device-side append.
            seqs = [_FakeSeq(i, tables[i]) for i in range(b)]

            def launch(seqs=seqs, k=k, b=b) -> None:
                spec.launch(seqs, [k] * b, None)  # type: ignore[arg-type]
                spec.lens[:b] = context + 1

            row[f"k{k}_launch_ms"] = _replay_ms(launch, iters=5)
        row["ngram_k8_ms"] = _ngram_ms(graphs, b)
        if b == 1 and graphs.capture:  # where the batch-1 verify step's time goes, kernel by kernel
            row["profile_k0"] = profile_graph(decode.graph(*decode.key_for(1, [context])).replay)
            row["profile_k4"] = profile_graph(graphs._graphs[(1, 4)].replay)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
    return {"context": context, "capture_s": capture_s, "rows": rows}


@torch.inference_mode()
def _ngram_ms(graphs, b: int) -> float:
    """The device n-gram drafter alone (k = 8, its 2048-token window), as captured inside the verify graph."""
    x = graphs._inputs[(b, max(DEPTHS))]
    if not graphs.capture:
        return _replay_ms(lambda: graphs.drafter.propose(x))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphs.drafter.propose(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphs.drafter.propose(x)
    return _replay_ms(graph.replay)


class _FakeSeq:
    """What SpecDecoder.launch reads of a sequence: its row, its block table and greedy sampling settings."""

    def __init__(self, row: int, table: list[int]) -> None:
        from envex.runtime.engine.spec.depth import SpecState
        from envex.runtime.engine.types import SamplingParams

        self.spec = SpecState(row=row)
        self.block_table = table
        self.params = SamplingParams(temperature=0.0)
        self.generator = None


def bench_model(model: str, repeats: int, device: str, max_tokens: int | None = None, *,
                deterministic: bool = False, draft_model: str | None = None,
                workloads: tuple[str, ...] = ("code-edit", "chat-1")) -> dict:  # fmt: skip
    """Batch-1 tok/s with and without n-gram speculation on the code-edit and chat-1 workloads (deterministic:
    both engines in the batch-invariant mode, where a verify step's rows round as a decode step's do;
    draft_model: speculation by that model, 4 drafts a step, instead of n-gram lookup)."""
    from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from envex.verify.workloads import WORKLOADS, build_requests

    common = dict(model=model, device=device, max_model_len=4096, max_num_seqs=8, num_kv_blocks=4096,
                  enable_prefix_caching=False, deterministic=deterministic,
                  load_format="dummy" if Path(model, "config.json").is_file()
                  and not any(Path(model).glob("*.safetensors")) else "auto")  # fmt: skip
    t0 = time.perf_counter()
    engines = {"off": LLMEngine(EngineConfig(**common)),
               "on": LLMEngine(EngineConfig(**common, num_speculative_tokens=4 if draft_model else 8,
                                            draft_model=draft_model))}  # fmt: skip
    load_s = time.perf_counter() - t0
    spec = engines["on"].spec
    report: dict = {"model": model, "load_s": load_s, "deterministic": deterministic, "draft_model": draft_model,
                    "drafter": spec.drafter.name if spec else None, "workloads": {},
                    "measured_costs": {f"{b},{k}": c for (b, k), c in spec.costs.table.items()} if spec else {}}
    for name in workloads:
        w = WORKLOADS[name]
        # warm-up (discarded): the first requests' Triton compiles and the adaptive depth's first steps
        for engine in engines.values():
            for req in build_requests(engines["on"].tokenizer, w, repeat="warm")[:2]:
                engine.generate([req.prompt_ids], SamplingParams(max_tokens=64, temperature=0.0))
        totals = {k: {"tokens": 0, "seconds": 0.0} for k in engines}
        answers: dict[str, list[list[int]]] = {k: [] for k in engines}
        before = {k: _counters(e) for k, e in engines.items()}
        for rep in range(repeats):
            for req in build_requests(engines["on"].tokenizer, w, repeat=rep):
                params = SamplingParams(max_tokens=max_tokens or req.max_tokens, temperature=0.0)
                order = ("on", "off") if len(answers["on"]) % 2 == 0 else ("off", "on")  # interleaved A/B
                for key in order:
                    _sync()
                    t = time.perf_counter()
                    out = engines[key].generate([req.prompt_ids], params)[0]
                    _sync()
                    totals[key]["seconds"] += time.perf_counter() - t
                    totals[key]["tokens"] += len(out.token_ids)
                    answers[key].append(out.token_ids)
        after = _counters(engines["on"])
        d = {k: after[k] - before["on"][k] for k in after}
        tok_s = {k: v["tokens"] / v["seconds"] for k, v in totals.items()}
        acceptance = d["accepted"] / max(1, d["accepted"] + d["rejections"])
        row = {"workload": name, "requests": len(answers["on"]), "tok_s_off": tok_s["off"], "tok_s_on": tok_s["on"],
               "speedup": tok_s["on"] / tok_s["off"], "tokens_off": totals["off"]["tokens"],
               "tokens_on": totals["on"]["tokens"],
               "verify_steps": d["steps"], "tokens_per_verify_step": d["spec_tokens"] / max(1, d["seq_steps"]),
               "share_of_tokens_from_verify_steps": d["spec_tokens"] / max(1, totals["on"]["tokens"]),
               "tokens_per_step_overall": totals["on"]["tokens"] / max(1, d["steps"] + d["plain"]),
               "acceptance": acceptance, "drafted": d["drafted"], "accepted": d["accepted"],
               "identical_answers": sum(a == b for a, b in zip(answers["on"], answers["off"], strict=True)),
               }  # fmt: skip
        report["workloads"][name] = row
        print(json.dumps(row), flush=True)
    return report


def _counters(engine) -> dict[str, int]:
    c = engine.steps.counters
    s = engine.stats()
    return {"steps": c.spec_steps, "seq_steps": c.spec_sequence_steps, "spec_tokens": c.spec_tokens,
            "drafted": c.draft_tokens, "accepted": c.accepted_drafts, "rejections": c.draft_rejections,
            "plain": s.generation_tokens_total - c.spec_tokens}  # fmt: skip


def profile_graph(replay, iters: int = 10) -> list[dict]:
    """Per-kernel device time of one replay of a captured graph (torch.profiler over `iters` replays): the
    kernels by total time, us per step."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:90], "us_per_step": e.device_time_total / iters, "calls_per_step": e.count / iters}
            for e in prof.key_averages() if e.device_time_total > 0]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us_per_step"])[:25]


def projection(graphs: dict, model: dict) -> list[str]:
    """The 8B shape's batch-1 tok/s at the acceptance measured on the code-edit workload, for each k."""
    row = next(r for r in graphs["rows"] if r["batch"] == 1)
    a = model["workloads"]["code-edit"]["acceptance"]
    lines = [f"acceptance a = {a:.3f} (code-edit, n-gram); batch 1, plain decode: 1 token / {row['k0_ms']:.3f} ms = "
             f"{1000 / row['k0_ms']:.1f} tok/s"]  # fmt: skip
    for k in DEPTHS:
        e = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
        tok_s = 1000 * e / row[f"k{k}_launch_ms"]
        lines.append(f"k={k}: E = (1 - {a:.3f}^{k + 1}) / (1 - {a:.3f}) = {e:.2f} tokens / {row[f'k{k}_launch_ms']:.3f}"
                     f" ms = {tok_s:.1f} tok/s ({tok_s * row['k0_ms'] / 1000:.2f}x)")  # fmt: skip
    return lines


def markdown(graphs: dict | None, model: dict | None) -> str:
    out = []
    if graphs:
        out += [f"Verify graphs, Llama-3.1-8B shape, {graphs['context']} cached tokens per sequence (ms per step; "
                "ratio to k = 0):", "", "| batch | k=0 | " + " | ".join(f"k={k}" for k in DEPTHS) + " |",
                "|---|---|" + "---|" * len(DEPTHS)]  # fmt: skip
        for r in graphs["rows"]:
            cells = " | ".join(f"{r[f'k{k}_ms']:.3f} ({r[f'k{k}_ratio']:.2f}x)" for k in DEPTHS)
            out.append(f"| {r['batch']} | {r['k0_ms']:.3f} | {cells} |")
        out += ["", "n-gram drafter alone (k = 8, inside the verify graph): " + ", ".join(
            f"batch {r['batch']} {1000 * r['ngram_k8_ms']:.1f} us" for r in graphs["rows"])]
    if model:
        out += ["", "| workload | tok/s off | tok/s on | speedup | tokens per verify step | acceptance | identical |",
                "|---|---|---|---|---|---|---|"]
        for r in model["workloads"].values():
            out.append(f"| {r['workload']} | {r['tok_s_off']:.1f} | {r['tok_s_on']:.1f} | {r['speedup']:.2f}x | "
                       f"{r['tokens_per_verify_step']:.2f} | {r['acceptance']:.3f} | {r['identical_answers']}/"
                       f"{r['requests']} |")  # fmt: skip
    if graphs and model:
        out += ["", *projection(graphs, model)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the model for the tok/s section")
    ap.add_argument("--sections", default="graphs,model")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence in the graphs section")
    ap.add_argument("--repeats", type=int, default=1, help="passes over each workload's 16 prompts")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--deterministic", action="store_true", help="the model section in deterministic mode")
    ap.add_argument("--draft-model", default=None, help="the model section drafts with this model, not n-grams")
    ap.add_argument("--workloads", default="code-edit,chat-1", help="the model section's workloads")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the same code (with --shape tiny)")
    ap.add_argument("--shape", default="8b", choices=("8b", "tiny"))
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every answer (the dry run)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from envex.verify.lab.kernel_bench._bench_lib import LLAMA31_8B

    shape = LLAMA31_8B if args.shape == "8b" else TINY
    report: dict = {"commit": args.commit, "shape": args.shape,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    if "graphs" in sections:
        report["graphs"] = bench_graphs(args.context, shape, args.device)
        torch.cuda.empty_cache()
        (args.out / "spec.json").write_text(json.dumps(report, indent=1))
    if "model" in sections:
        report["model"] = bench_model(args.model, args.repeats, args.device, args.max_tokens,
                                      deterministic=args.deterministic, draft_model=args.draft_model,
                                      workloads=tuple(args.workloads.split(",")))  # fmt: skip
    report["seconds"] = time.perf_counter() - t0
    report["markdown"] = markdown(report.get("graphs"), report.get("model"))
    (args.out / "spec.json").write_text(json.dumps(report, indent=1))
    print(report["markdown"])
    print(f"total {report['seconds']:.1f}s")


if __name__ == "__main__":
    main()
