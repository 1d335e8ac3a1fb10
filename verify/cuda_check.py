"""CUDA smoke run of the gates and the benchmark harness, for a GPU box that the embedded weights cannot reach.

    python3 -m envex.verify.cuda_check --tok DIR --out OUT

DIR holds the embedded model's tokenizer.json, tokenizer_config.json and hf_config.json (a few MB); the weights
are a seeded random initialisation of the same shape, saved as an HF directory. The gates' verdicts on random
weights say little about quality; the run shows that every gate and the harness work on CUDA with the bf16
policy (the top-k rule, the bf16 KL bars, the Triton backend, static-cache and compiled HF baselines).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
         "bos_token_id", "eos_token_id")


def build_model_dir(tok_dir: Path, out: Path, seed: int = 0, **overrides: int) -> Path:
    """A seeded random-weight LlamaForCausalLM of hf_config.json's shape (`overrides` shrink it, for tests)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = json.loads((tok_dir / "hf_config.json").read_text())
    config = LlamaConfig(**{**{k: hf[k] for k in _KEYS if k in hf}, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tok", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    from envex.runtime.engine import EngineConfig, LLMEngine
    from envex.verify.bench import run_bench
    from envex.verify.bench_engines import EnvexInProcess, HFTransformers
    from envex.verify.gates import run_gates
    from envex.verify.reference import load_hf_model
    from envex.verify.workloads import named_workload

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(args.tok, Path("/tmp/envex-cuda-check-model"))
    summary: dict[str, object] = {}
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", enable_prefix_caching=False))
    summary["engine_load_s"] = time.perf_counter() - t
    report = run_gates(engine, suite="quick", out_dir=args.out)
    summary["gates"] = {g.name: [g.verdict, g.summary, g.seconds] for g in report.gates}
    summary["gates_seconds"] = report.seconds
    print(json.dumps(summary, indent=1), flush=True)
    hf_stock = HFTransformers(load_hf_model(engine.source, device="cuda", dtype="bfloat16"), pad_token_id=2)
    engines = [EnvexInProcess(engine), hf_stock]
    try:
        tuned = HFTransformers(load_hf_model(engine.source, device="cuda", dtype="bfloat16"), tuned=True,
                               pad_token_id=2)
        engines.append(tuned)
    except Exception as exc:  # a baseline that cannot be built is reported, the rest still runs
        summary["hf_tuned_error"] = f"{type(exc).__name__}: {exc}"
    w = named_workload("1k-256", num_requests=2)
    bench = run_bench(engines, workload_name=w, repeats=args.repeats, out_dir=args.out)
    summary["bench_markdown"] = bench.to_markdown()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(bench.to_markdown(), flush=True)


if __name__ == "__main__":
    main()
