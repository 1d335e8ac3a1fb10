"""Run a release's quality gates and benchmark, inside that release's own venv: `python -m envex.installer.gate_runner`.

The installer starts this with the new release's interpreter, so what is gated is exactly the code, weights and
kernels that will be served. It writes `<out>/gates.json` (the verdict, each gate, the benchmark's headline
numbers) and exits 0 when every gate passed, 1 when one failed, 2 when the gates could not run.

Gates: `installer.smoke` (the engine loads from launch.json, answers the model card's smoke prompt greedily and
deterministically), then the quality suite of `envex.verify.gates` (required: a release without it fails closed)
and the benchmark of `envex.verify.bench` when present. The suite's reference (--reference auto | local | signed,
envex.verify.signed_reference.choose_reference): HF transformers in float32 beside the engine where it fits in
memory (--reference-bytes), else the model bundle's signed answers (--references); details.reference says which
and why. Where launch.json's engine.tensor_parallel is above 1, then
`verify.tensor_parallel_equality`: greedy answers at that degree equal one GPU's, on a two-layer cut of the model
(envex.verify.gate_tensor_parallel.run_tensor_parallel_gate).

A release that packs (launch.json's engine.weights quantizes the model at load, engine.kv_cache_dtype is fp8 or
int4) first runs its band gates: `verify.weight_quality_band` (the policy's mean KLD and top-1 against the model's
bf16 self, envex.verify.weight_quality.band_gate) and `verify.kv_cache_band` (the release's settings with the
packed cache against the same with the bf16 cache: KV_GATE_PROMPTS prompts of up to KV_GATE_TOKENS tokens, the
needle at the window's end, stopping; envex.verify.gate_kv_cache.kv_band_gate); outside its band the release is
refused with the figure. Then the smoke test, the suite and the benchmark run on the release's engine exactly as it
will serve, packed formats included; the suite's checks against HF tokens and logits (verify.gates.BANDED) report
the band measurements in their place ("judged against the fp8 band: KLD x / top-1 y"), and the benchmark's details
name the settings it timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SMOKE_PROMPT = "What is the capital of France?"
SMOKE_EXPECT = "Paris"
TENSOR_PARALLEL_GATE = "verify.tensor_parallel_equality"
WEIGHTS_GATE = "verify.weight_quality_band"
KV_CACHE_GATE = "verify.kv_cache_band"
KV_GATE_TOKENS, KV_GATE_PROMPTS = 4096, 2  # the 4K-8K-token prompts (capped at the release's window)


def as_json(value: Any) -> Any:
    """Best-effort JSON form of a report object (pydantic model, dataclass, dict, or an object with to_dict)."""
    for attr in ("model_dump", "to_dict", "as_dict"):
        method = getattr(value, attr, None)
        if callable(method):
            try:
                return json.loads(json.dumps(method(mode="json") if attr == "model_dump" else method(), default=str))
            except TypeError:
                return json.loads(json.dumps(method(), default=str))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json.loads(json.dumps(dataclasses.asdict(value), default=str))
    return json.loads(json.dumps(value, default=str))


def verdict_of(report: Any) -> str:
    """'pass' or 'fail' from a report: `passed` (bool) or `verdict`/`overall` ('pass'...); unknown counts as fail."""
    for key in ("passed", "ok"):
        if isinstance(report, dict) and isinstance(report.get(key), bool):
            return "pass" if report[key] else "fail"
    for key in ("verdict", "overall", "status"):
        value = report.get(key) if isinstance(report, dict) else None
        if isinstance(value, str):
            return "pass" if value.lower() in ("pass", "passed", "ok") else "fail"
        if isinstance(value, dict):
            return verdict_of(value)
    return "fail"


def gate_verdicts(report: Any) -> dict[str, str]:
    """Per-gate verdicts from a report's `gates` (a list of {name, verdict} or a mapping name -> gate)."""
    gates = report.get("gates") if isinstance(report, dict) else None
    out: dict[str, str] = {}
    if isinstance(gates, list):
        for i, gate in enumerate(gates):
            if isinstance(gate, dict):
                out[str(gate.get("name", f"gate{i}"))] = _gate_word(gate)
    elif isinstance(gates, dict):
        for name, gate in gates.items():
            out[str(name)] = (
                _gate_word(gate) if isinstance(gate, dict) else ("pass" if gate in (True, "pass") else "fail")
            )
    return out


def _gate_word(gate: dict[str, Any]) -> str:
    for key in ("verdict", "status"):
        value = gate.get(key)
        if isinstance(value, str):
            v = value.lower()
            return "pass" if v in ("pass", "passed", "ok") else ("skip" if v in ("skip", "skipped") else "fail")
    if isinstance(gate.get("passed"), bool):
        return "pass" if gate["passed"] else "fail"
    return "fail"


def smoke_gate(engine: Any, prompt: str, expect: str) -> dict[str, Any]:
    from envex.runtime.engine import SamplingParams

    tok = engine.tokenizer
    # A base model (no chat template) is asked the card's prompt as a completion (model_card.BASE_SMOKE).
    chat = prompt if tok.chat_template is None else tok.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=12, temperature=0.0)  # "The capital of France is Paris." is 8 tokens
    start = time.perf_counter()
    first = engine.generate([chat], params)[0]
    elapsed = time.perf_counter() - start
    second = engine.generate([chat], params)[0]
    ok = expect.lower() in first.text.lower() and first.token_ids == second.token_ids
    return {
        "name": "installer.smoke",
        "verdict": "pass" if ok else "fail",
        "evidence": {
            "prompt": prompt,
            "text": first.text,
            "expect": expect,
            "deterministic": first.token_ids == second.token_ids,
        },
        "bench": {"smoke_decode_tokens_per_s": len(first.token_ids) / elapsed if elapsed > 0 else 0.0},
    }


def _call(fn: Any, engine: Any, **wanted: Any) -> Any:
    """Call `fn(engine, ...)` with the keyword arguments it accepts (the verify/ API is young)."""
    params = inspect.signature(fn).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return fn(engine, **{k: v for k, v in wanted.items() if accepts_any or k in params})


@dataclasses.dataclass(frozen=True)
class ReferenceChoice:
    """--reference, --references and --reference-bytes (envex.verify.signed_reference.choose_reference)."""

    choice: str = "auto"
    references: Path | None = None
    need_bytes: int | None = None


def run(launch_path: Path, out: Path, suite: str, bench: bool, smoke: tuple[str, str],
        reference: ReferenceChoice | None = None) -> dict[str, Any]:  # fmt: skip
    from envex.installer.launch import load_launch

    out.mkdir(parents=True, exist_ok=True)
    config = load_launch(launch_path, require_gates=False)
    gates: dict[str, str] = {}
    details: dict[str, Any] = {}
    # 1. The packed formats' band gates first, each its own engines or HF model, one at a time: their measurements
    # against the model's unpacked self stand in for the suite's HF token and KL checks (verify.gates.BANDED).
    banded: list[tuple[str, str, dict[str, Any]]] = []
    if getattr(config, "weights", None) is not None:  # quantized at load: the policy must be inside its band
        banded.append((WEIGHTS_GATE, f"weights {config.weights}", weights_gate(config)))
    if getattr(config, "kv_cache_dtype", "bf16") != "bf16":  # a packed KV cache must be inside its band
        banded.append((KV_CACHE_GATE, f"kv_cache_dtype {config.kv_cache_dtype}", kv_cache_gate(config)))
    for name, _, result in banded:
        gates[name] = _gate_word(result)
        details[name] = result
    bands = packed_bands(banded)
    # 2. The release's own engine, exactly as it will serve (its kv_cache_dtype and weights): smoke, suite, bench.
    engine_gates, engine_details, numbers = engine_checks(config, out, suite, bench, smoke,
                                                          reference or ReferenceChoice(), bands)  # fmt: skip
    gates.update(engine_gates)
    details.update(engine_details)
    if config.tensor_parallel > 1:  # after the release's engine is gone: its GPUs are needed again
        result = tensor_parallel_gate(config, out)
        gates[TENSOR_PARALLEL_GATE] = _gate_word(result)
        details[TENSOR_PARALLEL_GATE] = result
    verdict = "pass" if gates and all(v in ("pass", "skip") for v in gates.values()) else "fail"
    return {"verdict": verdict, "suite": suite, "gates": gates, "bench": numbers, "details": details}


def packed_bands(banded: list[tuple[str, str, dict[str, Any]]]) -> list[Any]:
    """The band gates' results as the suite takes them (envex.verify.types.PackedBand); none in a release whose
    verify/ predates them (its suite then judges the packed engine against HF, and fails closed)."""
    try:
        from envex.verify.types import PackedBand
    except ImportError:
        return []
    return [PackedBand.from_gate(name, fmt, result) for name, fmt, result in banded]


def weights_gate(config: Any) -> dict[str, Any]:
    """A weights policy (launch.json engine.weights) measured on the release's model against its bf16 self and held
    to its band (envex.verify.weight_quality.band_gate); outside it the release is refused with the figure."""
    try:
        from envex.verify.weight_quality import band_gate

        return band_gate(config.model, config.weights)
    except Exception as exc:  # a gate that cannot run has failed
        return {"verdict": "fail", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def kv_cache_gate(config: Any) -> dict[str, Any]:
    """The release's packed KV cache (launch.json engine.kv_cache_dtype) measured against its bf16-KV self and held
    to the dtype's band (envex.verify.gate_kv_cache.kv_band_gate); outside it the release is refused with the
    figure. Runs after the release's engine is closed: one engine at a time."""
    try:
        from envex.verify.gate_kv_cache import kv_band_gate

        return kv_band_gate(config, config.kv_cache_dtype, prompt_tokens=min(KV_GATE_TOKENS, config.max_model_len),
                            prompts=KV_GATE_PROMPTS)  # fmt: skip
    except Exception as exc:  # a gate that cannot run has failed
        return {"verdict": "fail", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def tensor_parallel_gate(config: Any, out: Path) -> dict[str, Any]:
    """Greedy answers at the release's tensor_parallel N equal one GPU's (verify/gate_tensor_parallel.py): both on
    the model's architecture and widths cut to two layers with random weights, as the whole model needs N GPUs."""
    try:
        from envex.verify.gate_tensor_parallel import free_device_memory, run_tensor_parallel_gate

        free_device_memory()
        return as_json(run_tensor_parallel_gate(config, workdir=out))
    except Exception as exc:  # a gate that cannot run has failed
        return {"verdict": "fail", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def engine_checks(config: Any, out: Path, suite: str, bench: bool, smoke: tuple[str, str],
                  reference: ReferenceChoice | None = None, bands: list[Any] | None = None
                  ) -> tuple[dict[str, str], dict[str, Any], dict[str, float]]:  # fmt: skip
    """The gates and benchmark that run on the release's own engine, built from its launch.json settings as they
    are (a packed KV cache, low-bit weights included): (verdicts, details, figures). `bands`: the packed formats'
    band measurements, which the suite reports in place of its HF token and KL checks. The engine is closed (its
    tensor-parallel workers stopped) on return."""
    from envex.runtime.engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(config)
    try:
        return _engine_checks(engine, time.perf_counter() - start, config, out, suite, bench, smoke,
                              reference or ReferenceChoice(), bands or [])  # fmt: skip
    finally:
        engine.close()


def _engine_checks(engine: Any, load_s: float, config: Any, out: Path, suite: str, bench: bool,
                   smoke: tuple[str, str], reference: ReferenceChoice, bands: list[Any]
                   ) -> tuple[dict[str, str], dict[str, Any], dict[str, float]]:  # fmt: skip
    gates: dict[str, str] = {}
    details: dict[str, Any] = {}
    numbers: dict[str, float] = {"load_seconds": round(load_s, 3)}
    result = smoke_gate(engine, *smoke)
    gates[result["name"]] = result["verdict"]
    details[result["name"]] = result
    numbers.update({k: round(v, 3) for k, v in result["bench"].items()})
    try:
        from envex.verify.gates import run_gates
    except ImportError as exc:
        gates["verify.gates"] = "fail"
        details["verify.gates"] = {"error": f"envex.verify.gates is not in this release ({exc}); cannot gate"}
    else:
        try:
            from envex.verify.signed_reference import choose_reference

            ref, details["reference"] = choose_reference(engine, reference.choice, reference.references,
                                                         reference.need_bytes)  # fmt: skip
            report = as_json(_call(run_gates, engine, reference=ref, suite=suite, out_dir=out / "gates",
                                   bands=bands))  # fmt: skip
            details["verify.gates"] = report
            per_gate = gate_verdicts(report)
            gates.update({f"verify.{k}": v for k, v in per_gate.items()} or {"verify.gates": verdict_of(report)})
            if verdict_of(report) != "pass":
                gates.setdefault("verify.gates", "fail")
        except Exception as exc:
            gates["verify.gates"] = "fail"
            details["verify.gates"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    if bench:
        try:
            from envex.verify.bench import run_bench
        except ImportError:
            details["bench"] = {"note": "envex.verify.bench is not in this release; only the smoke figures"}
        else:
            # Quick: a sanity figure on a small workload; full: the methodology's 12 repeats.
            workload = "cpu-small" if config.device == "cpu" else "1k-256"
            repeats = 3 if suite == "quick" else 12
            try:
                report = as_json(run_bench(engine, workload_name=workload, repeats=repeats, out_dir=out / "bench"))
                details["bench"] = {"workload": workload, "repeats": repeats, "report": str(out / "bench"),
                                    "settings": bench_settings(engine)}  # fmt: skip
                numbers.update(_headline(report))
            except Exception as exc:  # the benchmark informs; it does not gate
                details["bench"] = {"error": f"{type(exc).__name__}: {exc}"}
    numbers.update(speculation_figures(engine))
    return gates, details, numbers


def bench_settings(engine: Any) -> dict[str, Any]:
    """The engine settings the benchmark timed, the packed formats among them: the release's own."""
    config = engine.config
    return {"device": config.device, "dtype": config.dtype, "backend": config.backend,
            "kv_cache_dtype": getattr(config, "kv_cache_dtype", "bf16"), "weights": getattr(config, "weights", None),
            "tensor_parallel": config.tensor_parallel, "max_num_seqs": config.max_num_seqs}  # fmt: skip


def speculation_figures(engine: Any) -> dict[str, float]:
    """What speculative decoding did over the gates and the benchmark (nothing when it is off): its most drafts a
    step, the share of drafted tokens accepted and the tokens a sequence gained per verify step. launch.json keeps
    them among the install's figures (`bench`), beside the drafter and depth in its engine settings."""
    spec = getattr(engine, "spec", None)
    if spec is None:
        return {}
    c = engine.steps.counters
    return {"speculative.max_drafts": float(spec.max_k),
            "speculative.acceptance": round(c.accepted_drafts / c.draft_tokens, 4) if c.draft_tokens else 0.0,
            "speculative.tokens_per_verify_step": round(c.spec_tokens / max(1, c.spec_sequence_steps), 3),
            "speculative.verify_steps": float(c.spec_steps)}  # fmt: skip


_HEADLINE_STATS = ("estimate", "low", "high", "p50", "p90", "p99")


def _headline(report: Any) -> dict[str, float]:
    """envex's row of a bench report as flat numbers (`<metric>.<stat>`), at most 40, to keep state.json small."""
    rows = report.get("rows", []) if isinstance(report, dict) else []
    row = next((r for r in rows if isinstance(r, dict) and r.get("included")), None)
    found: dict[str, float] = {}
    if row is None:
        return found
    for group in ("intervals", "percentiles"):
        for metric, stats in (row.get(group) or {}).items():
            for stat, value in (stats or {}).items():
                if stat in _HEADLINE_STATS and isinstance(value, int | float) and len(found) < 40:
                    found[f"bench.{metric}.{stat}"] = float(value)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envex.installer.gate_runner", description=__doc__)
    parser.add_argument("--launch", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--suite", default="quick", choices=("quick", "full"))
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--smoke-prompt", default=SMOKE_PROMPT)
    parser.add_argument("--smoke-expect", default=SMOKE_EXPECT)
    from envex.verify.references_file import REFERENCE_CHOICES

    parser.add_argument("--reference", default="auto", choices=REFERENCE_CHOICES)
    parser.add_argument("--references", type=Path, default=None, help="the model bundle's envex-references.json")
    parser.add_argument("--reference-bytes", type=int, default=None, help="the float32 reference's weight bytes")
    args = parser.parse_args(argv)
    choice = ReferenceChoice(args.reference, args.references, args.reference_bytes)
    try:
        report = run(args.launch, args.out, args.suite, not args.no_bench, (args.smoke_prompt, args.smoke_expect),
                     choice)  # fmt: skip
    except Exception as exc:
        report = {
            "verdict": "fail",
            "suite": args.suite,
            "gates": {"installer.load": "fail"},
            "bench": {},
            "details": {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()},
        }
        code = 2
    else:
        code = 0 if report["verdict"] == "pass" else 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gates.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
