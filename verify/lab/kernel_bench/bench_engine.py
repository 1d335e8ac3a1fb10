"""End to end through envex's engine (LLMEngine: scheduler, model runner, sampler) on the Llama-3.1-8B shape.

    python3 -m envex.verify.lab.kernel_bench.bench_engine --out $OUT [--dir /tmp/envex-8b]

Writes a random-weight bf16 checkpoint of the 8B shape (HF names, safetensors, a placeholder word-level
tokenizer) once, then times the engine with the triton backend (CUDA-graph decode), the triton backend without
graphs, and the torch reference backend: batch 1 at 1K/256 and 10K/512 (TTFT included), and 64 concurrent
requests at 1K/256 with prefill included. Greedy, ignore_eos, so every run emits exactly max_tokens tokens.
Prefix caching is off: the prompts are random and share no prefix. Runs beside the default (overlapped scheduling,
8K-token steps): triton-sync (no overlap) and triton-16k (16K-token steps), for the A/B in verify/lab/journal.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def write_checkpoint(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from envex.verify.lab.kernel_bench._bench_lib import build_hf_model

    if (path / "config.json").is_file():
        return
    hf = build_hf_model()
    hf.config.eos_token_id = 128001
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="4GB")
    vocab = {f"t{i}": i for i in range(hf.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t128001"}))
    del hf
    torch.cuda.empty_cache()


def timed_requests(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    from envex.runtime.engine.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{t0}", p, params)
    done = 0
    # The slowest steps, host wall clock: (seconds, sequences running before the step, prompt tokens admitted so far)
    slowest: list[tuple[float, int, int]] = []
    while done < len(prompts):
        t_step = time.perf_counter()
        running = len(engine.scheduler.running)
        outs = engine.step()
        slowest.append((time.perf_counter() - t_step, running, engine.stats().prompt_tokens_total))
        slowest = sorted(slowest, reverse=True)[:4]
        for out in outs:
            now = time.perf_counter() - t0
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now
            counts[out.request_id] = out.completion_token_count
            done += out.finished
    total = time.perf_counter() - t0
    tokens = sum(counts.values())
    assert tokens == len(prompts) * max_tokens, f"served {tokens} tokens, expected {len(prompts) * max_tokens}"
    ttft = sorted(first.values())
    decode_s = total - max(ttft)
    return dict(total_s=total, out_tok_s=tokens / total, ttft_s=ttft[len(ttft) // 2],
                decode_tok_s_per_seq=(max_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
                slowest_steps=[[round(t, 4), r, n] for t, r, n in slowest])  # fmt: skip


def main() -> None:
    from envex.runtime.engine.config import EngineConfig
    from envex.runtime.engine.engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--dir", type=Path, default=Path("/tmp/envex-8b"))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--runs", default="triton,triton-nograph,torch")
    args = ap.parse_args()
    t_start = time.perf_counter()
    write_checkpoint(args.dir)
    report = {"commit": args.commit, "device": torch.cuda.get_device_name(), "rows": [],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(0, 128000, (n, length), generator=gen).tolist()

    p1k, p10k, p64 = prompts(1, 1024), prompts(1, 10240), prompts(64, 1024)
    all_cases = [("1x1K/256", p1k, 256), ("1x10K/512", p10k, 512), ("64x1K/256", p64, 256)]
    plan = {
        "triton": (dict(backend="triton", use_cuda_graphs=True), all_cases),
        # the same without overlapped scheduling (each step's tokens read before the next step is scheduled)
        "triton-sync": (dict(backend="triton", use_cuda_graphs=True, async_scheduling=False), all_cases),
        # prefill in chunks of 16K tokens instead of the default 8K
        "triton-16k": (dict(backend="triton", use_cuda_graphs=True, max_num_batched_tokens=16384),
                       [("64x1K/256", p64, 256)]),
        # the 64-request case twice in one engine: a slow first pass is one-time work (Triton compiles)
        "triton-repeat": (dict(backend="triton", use_cuda_graphs=True), [("64x1K/256", p64, 256),
                                                                         ("64x1K/256 again", p64, 256)]),
        "triton-nograph": (dict(backend="triton", use_cuda_graphs=False), [("1x1K/256", p1k, 256)]),
        "torch": (dict(backend="torch", use_cuda_graphs=False), [("1x1K/64", p1k, 64)]),
    }  # fmt: skip
    for name in args.runs.split(","):
        opts, cases = plan[name]
        t0 = time.perf_counter()
        config = dict(model=str(args.dir), max_model_len=12288, max_num_seqs=64, num_kv_blocks=8192,
                      enable_prefix_caching=False)
        engine = LLMEngine(EngineConfig(**{**config, **opts}))
        load_s = time.perf_counter() - t0
        # warm-up: Triton compiles the prefill kernels for each tile shape once (mixed prefill + decode steps too)
        for n, length in ((1, 1024), (1, 10240), (16, 1024)):
            timed_requests(engine, prompts(n, length), 4)
        for case, ps, max_tokens in cases:
            row = dict(run=name, case=case, load_s=load_s, **timed_requests(engine, ps, max_tokens))
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "engine.json").write_text(json.dumps(report, indent=1))
        del engine
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t_start:.1f}s")
    for r in report["rows"]:
        print(f"{r['run']:15s} {r['case']:10s} out_tok_s={r['out_tok_s']:.1f} "
              f"decode_tok_s_per_seq={r['decode_tok_s_per_seq']:.1f} ttft_s={r['ttft_s']:.3f} load_s={r['load_s']:.1f}")


if __name__ == "__main__":
    main()
