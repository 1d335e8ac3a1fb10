"""The gates on a GPU: envex on CUDA (Triton backend, bfloat16, CUDA-graph decode) against HF transformers.

    python3 -m envex.verify.lab.cuda_check --model PATH --out OUT      # a GGUF file or an HF model directory
    python3 -m envex.verify.lab.cuda_check --tok DIR --out OUT         # seeded random weights of the embedded shape
    python3 -m envex.verify.lab.cuda_check --model M --device cpu --prompts 1 --gates stopping --out OUT   # a test

The reference is HF transformers on the same weights and device, in the engine's dtype unless --ref-dtype says
otherwise (bfloat16 on CUDA, float32 on CPU). The gates apply their own per-policy rules: on CUDA reference
equality uses the top-k rule at the first divergence and semantic regression the bfloat16 KL/top-1 bars; on CPU
float32 against float32 the tokens must be identical. The run also records both sides' greedy answer to one
chat question, checks that the engine really runs the Triton backend with CUDA graphs, and writes OUT/gates.json
(the gate report) and OUT/summary.json (rewritten after every stage, so a run cut short still leaves evidence).
The last lines printed are a compact table. Exit status: 0 when every gate passes and every policy check
holds, 1 otherwise.

--tok DIR holds the embedded model's tokenizer.json, tokenizer_config.json and hf_config.json (a few MB): for a
GPU box the real weights cannot reach. Verdicts on random weights say little about quality; they show that every
gate (and, with --bench, the benchmark harness) works on CUDA with the bf16 policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envex.verify.lab.devcarry import sha256_file

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
         "bos_token_id", "eos_token_id")
QUESTION = "What is the capital of France?"
RANDOM_MODEL_DIR = Path("/tmp/envex-cuda-check-model")


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from envex.verify.gates import GATE_NAMES, SUITES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a .gguf file, an HF model directory, or smollm2-135m-instruct")
    which.add_argument("--tok", type=Path, help="tokenizer dir: run on seeded random weights of its hf_config shape")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: Triton backend, bfloat16, CUDA graphs; cpu: torch backend, float32")
    parser.add_argument("--ref-dtype", choices=("engine", "float32", "bfloat16", "float16"), default="engine",
                        help="the HF reference's dtype (default: the engine's)")
    parser.add_argument("--suite", choices=tuple(SUITES), default="quick")
    parser.add_argument("--gates", default=",".join(GATE_NAMES), help="comma-separated subset (default: all)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="cap every prompt set of the suite at N (prompts, texts, tasks, needle lengths)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens for the capital-of-France answer")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine in deterministic mode or not (batch-invariant kernels; default: the "
                             "engine's, off; offline_docs/engine.md)")
    parser.add_argument("--bench", action="store_true", help="also run the benchmark harness (envex vs HF)")
    parser.add_argument("--repeats", type=int, default=4, help="benchmark repeats (with --bench)")
    args = parser.parse_args(argv)
    args.gates = tuple(g for g in args.gates.split(",") if g)
    unknown = set(args.gates) - set(GATE_NAMES)
    if unknown:
        parser.error(f"--gates: unknown {sorted(unknown)}; known: {', '.join(GATE_NAMES)}")
    if args.prompts is not None and args.prompts < 1:
        parser.error(f"--prompts: must be >= 1, got {args.prompts}")
    return args


def sized_suite(name: str, prompts: int | None, gates: tuple[str, ...]) -> Any:
    """The named suite restricted to `gates`, every prompt set capped at `prompts`."""
    from envex.verify.data import coding_tasks
    from envex.verify.gates import SUITES

    s = SUITES[name]
    s = dataclasses.replace(s, gates=gates)
    if prompts is None:
        return s
    tasks = s.coding_tasks if s.coding_tasks is not None else tuple(t.id for t in coding_tasks())
    return dataclasses.replace(
        s, name=f"{s.name}-{prompts}", reference_prompts=min(s.reference_prompts, prompts),
        stopping_prompts=min(s.stopping_prompts, prompts), semantic_texts=min(s.semantic_texts, prompts),
        coding_tasks=tasks[:prompts], needle_lengths=s.needle_lengths[:prompts])


def _policy_checks(device: str, engine: Any, gate_report: Any | None) -> dict[str, bool]:
    """What a bf16 GPU run must have used; each check is reported, none is assumed."""
    from envex.verify.gate_semantic import THRESHOLDS
    from envex.verify.types import NumericPolicy

    policy = NumericPolicy.of(engine)
    if device != "cuda":
        return {"engine cpu-float32-torch": policy.name == "cpu-float32-torch"}
    checks = {"engine cuda-bfloat16-triton": policy.name == "cuda-bfloat16-triton",
              "decode CUDA graphs captured": engine.runner.decode_graphs is not None}
    for g in gate_report.gates if gate_report is not None else ():
        if g.name == "reference_equality" and "mode" in g.thresholds:
            checks["reference_equality top-k rule"] = g.thresholds["mode"] == "topk"
        if g.name == "semantic_regression" and "max_mean_kl" in g.thresholds:
            bars = {k: g.thresholds[k] for k in THRESHOLDS["bfloat16"]}
            checks["semantic_regression bf16 bars"] = bars == THRESHOLDS["bfloat16"]
    return checks


def _ask(engine: Any, reference: Any, max_tokens: int) -> dict[str, Any]:
    """Both sides' greedy answer to QUESTION through the chat template."""
    from envex.runtime.engine import SamplingParams
    from envex.verify.common import chat_ids

    ids = chat_ids(engine.tokenizer, QUESTION)
    ours = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    theirs = reference.greedy(ids, max_tokens, top_k=0)
    same = [a == b for a, b in zip(ours.token_ids, theirs.token_ids, strict=False)]
    return {"question": QUESTION, "max_tokens": max_tokens, "engine_text": ours.text,
            "hf_text": engine.tokenizer.decode(theirs.token_ids), "engine_tokens": ours.token_ids,
            "hf_tokens": theirs.token_ids, "identical": ours.token_ids == theirs.token_ids,
            "common_prefix_tokens": same.index(False) if False in same else len(same)}


def table(summary: dict[str, Any]) -> str:
    """The few lines a person reads first: verdicts, policies, checks, the France answers."""
    lines = [f"{'gate':<22} {'verdict':<8} {'seconds':>8}  summary"]
    for name, g in summary.get("gates", {}).items():
        lines.append(f"{name:<22} {g['verdict']:<8} {g['seconds']:>8.1f}  {g['summary']}")
    eng, ref = summary.get("engine", {}), summary.get("reference", {})
    lines.append(f"overall: {str(summary.get('verdict', 'none')).upper()} ({summary.get('weights')}); engine "
                 f"{eng.get('policy')} graphs {eng.get('cuda_graphs')}; reference {ref.get('policy')}")
    for check, ok in summary.get("policy_checks", {}).items():
        lines.append(f"  check {'ok  ' if ok else 'FAIL'} {check}")
    france = summary.get("france")
    if france:
        lines.append(f"France engine: {france['engine_text']!r}")
        lines.append(f"France HF:     {france['hf_text']!r}  (identical: {france['identical']})")
    if summary.get("error"):
        lines.append(f"ERROR: {summary['error']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from envex.runtime.engine import EngineConfig, LLMEngine
    from envex.verify.gates import run_gates
    from envex.verify.reference import HFReference

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"status": "starting", "device": args.device}

    def save(status: str) -> None:
        summary["status"] = status
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")

    try:
        if args.tok is not None:
            model = str(build_model_dir(args.tok, RANDOM_MODEL_DIR))
            summary["weights"] = f"RANDOM (seeded) weights of {args.tok}/hf_config.json's shape"
        else:
            model = args.model
            summary["weights"] = f"real weights: {Path(model).name}"
            if Path(model).is_file():
                summary["model_sha256"] = sha256_file(Path(model))
        cuda = args.device == "cuda"
        config = EngineConfig(model=model, device=args.device, dtype="bfloat16" if cuda else "float32",
                              backend="triton" if cuda else "torch", use_cuda_graphs=True,
                              deterministic=args.deterministic)
        summary["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        save("loading engine")
        t = time.perf_counter()
        engine = LLMEngine(config)
        graphs = engine.runner.decode_graphs
        summary["engine"] = {"config": dataclasses.asdict(config), "load_s": round(time.perf_counter() - t, 1),
                             "policy": None, "cuda_graphs": list(graphs.sizes) if graphs is not None else None}
        from envex.verify.types import NumericPolicy

        summary["engine"]["policy"] = NumericPolicy.of(engine).name
        summary["policy_checks"] = _policy_checks(args.device, engine, None)
        save("loading reference")
        ref_dtype = str(engine.runner.dtype).removeprefix("torch.") if args.ref_dtype == "engine" else args.ref_dtype
        t = time.perf_counter()
        reference = HFReference(engine.source, device=args.device, dtype=ref_dtype,
                                eos_token_ids=engine.tokenizer.eos_token_ids)
        summary["reference"] = {"policy": reference.policy_name, "load_s": round(time.perf_counter() - t, 1)}
        suite = sized_suite(args.suite, args.prompts, args.gates)
        summary["suite"] = dataclasses.asdict(suite)
        save("running gates")
        report = run_gates(engine, reference=reference, suite=suite, out_dir=out,
                           progress=lambda name: print(f"gate {name} ...", flush=True))
        summary["verdict"] = report.verdict
        summary["gates_seconds"] = report.seconds
        summary["gates"] = {g.name: {"verdict": g.verdict, "summary": g.summary, "seconds": g.seconds,
                                     "thresholds": g.thresholds} for g in report.gates}
        summary["environment"] = report.environment
        summary["policy_checks"] = _policy_checks(args.device, engine, report)
        save("asking the France question")
        summary["france"] = _ask(engine, reference, args.max_tokens)
        if args.bench:
            save("benchmarking")
            summary["bench_markdown"] = _bench(engine, args)
        save("done")
    except Exception as exc:  # the evidence so far is kept; the error is the last thing recorded
        summary["error"] = f"{type(exc).__name__}: {exc}"
        summary["traceback"] = traceback.format_exc()
        save("error")
    return summary


def _bench(engine: Any, args: argparse.Namespace) -> str:
    """envex against HF stock and (where it builds) HF tuned, on the same device; the old smoke benchmark."""
    from envex.verify.bench import run_bench
    from envex.verify.bench_engines import EnvexInProcess, HFTransformers
    from envex.verify.reference import load_hf_model
    from envex.verify.workloads import named_workload

    dtype = str(engine.runner.dtype).removeprefix("torch.")
    engines = [EnvexInProcess(engine), HFTransformers(load_hf_model(engine.source, device=args.device, dtype=dtype),
                                                      pad_token_id=2)]
    try:
        engines.append(HFTransformers(load_hf_model(engine.source, device=args.device, dtype=dtype), tuned=True,
                                      pad_token_id=2))
    except Exception as exc:  # a baseline that cannot be built is reported, the rest still runs
        print(f"hf tuned baseline skipped: {type(exc).__name__}: {exc}", flush=True)
    bench = run_bench(engines, workload_name=named_workload("1k-256", num_requests=2), repeats=args.repeats,
                      out_dir=args.out)
    return bench.to_markdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("traceback", "gates", "france")},
                     indent=1, default=str), flush=True)
    if summary.get("traceback"):
        print(summary["traceback"], flush=True)
    print(table(summary), flush=True)
    checks_ok = all(summary.get("policy_checks", {}).values())
    return 0 if summary.get("verdict") == "pass" and summary.get("status") == "done" and checks_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
