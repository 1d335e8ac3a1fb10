"""`envex gates run` and `envex bench`: thin typer entry points over run_gates and run_bench.

Registered in installer/commands.py: `app.add_typer(gates_app, name="gates")`, `app.command("bench")(bench)`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

gates_app = typer.Typer(help="Quality gates: same answers as HF transformers, measured on this machine.",
                        no_args_is_help=True)

ENGINE_NAMES = ("envex", "hf-stock", "hf-tuned")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


@gates_app.command("run")
def gates_run(
    model: Annotated[str, typer.Option(help="HF model directory, .gguf file, or smollm2-135m-instruct")]
    = "smollm2-135m-instruct",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    suite: Annotated[str, typer.Option(help="quick (a minute or two on a CPU) | full (before activation)")] = "quick",
    gate: Annotated[list[str] | None, typer.Option(help="run only this gate (repeatable)")] = None,
    out: Annotated[Path | None, typer.Option(help="directory for gates.json")] = None,
) -> None:
    """Run the quality gates against the engine; exit 0 when every gate passes, 1 when one fails."""
    from envex.verify.gates import GATE_NAMES, SUITES, run_gates

    if suite not in SUITES:
        raise _fail(f"--suite: {suite!r} is not one of {', '.join(SUITES)}")
    for g in gate or []:
        if g not in GATE_NAMES:
            raise _fail(f"--gate: {g!r} is not one of {', '.join(GATE_NAMES)}")
    engine = _load_engine(model, device, dtype)
    report = run_gates(engine, suite=suite, out_dir=out, gates=gate or None,
                       progress=lambda name: typer.echo(f"running gate {name} ...", err=True))
    for g in report.gates:
        typer.echo(f"{g.verdict.upper():4}  {g.name:20}  {g.summary}  ({g.seconds:.1f} s)")
    typer.echo(f"overall: {report.verdict.upper()} ({report.suite} suite, {report.engine_policy} vs reference "
               f"{report.reference_policy}, {report.seconds:.0f} s)" + (f"; report in {out / 'gates.json'}" if out
                                                                          else ""))
    raise typer.Exit(0 if report.passed else 1)


@gates_app.command("list")
def gates_list() -> None:
    """List the gates and what each suite runs."""
    from envex.verify.gates import GATE_NAMES, SUITES

    typer.echo("gates: " + ", ".join(GATE_NAMES))
    for name, s in SUITES.items():
        typer.echo(f"suite {name}: {s.reference_prompts} reference prompts x {s.reference_max_tokens} tokens; needle "
                   f"lengths {list(s.needle_lengths)} x depths {list(s.needle_depths)}; "
                   f"{'all' if s.coding_tasks is None else len(s.coding_tasks)} coding tasks; "
                   f"{s.semantic_texts} corpus texts x {s.semantic_max_len} tokens; batch invariance "
                   f"{s.invariance_prompts} prompts x {s.invariance_max_tokens} tokens among {s.invariance_others}")


def bench(
    model: Annotated[str, typer.Option(help="HF model directory, .gguf file, or smollm2-135m-instruct")]
    = "smollm2-135m-instruct",
    engines: Annotated[str, typer.Option(help=f"comma-separated: {', '.join(ENGINE_NAMES)} (empty: only --url)")]
    = "envex",
    url: Annotated[str | None, typer.Option(help="also benchmark this OpenAI-compatible server (base URL)")] = None,
    served_model: Annotated[str | None, typer.Option(help="model name to send to --url (default: from --model)")]
    = None,
    api_key: Annotated[str | None, typer.Option(help="bearer token for --url")] = None,
    workload: Annotated[str, typer.Option(help="cpu-small | 1k-256 | 10k-512 | chat")] = "cpu-small",
    concurrency: Annotated[int | None, typer.Option(help="requests in flight (1-256); default: the workload's")]
    = None,
    repeats: Annotated[int, typer.Option(help="interleaved measured rounds")] = 12,
    warmups: Annotated[int, typer.Option(help="discarded warm-up runs per engine")] = 1,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    out: Annotated[Path | None, typer.Option(help="directory for bench.json, bench.md and bench.png")] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Benchmark engines on one workload: interleaved rounds between anchor runs, bootstrap 95% CIs."""
    from envex.verify.bench import run_bench
    from envex.verify.bench_engines import BenchEngine, EnvexInProcess, HFTransformers, OpenAICompatible
    from envex.verify.workloads import WORKLOADS

    names = [n.strip() for n in engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINE_NAMES]
    if unknown:
        raise _fail(f"--engines: {', '.join(unknown)} not known; choose from {', '.join(ENGINE_NAMES)}")
    if not names and not url:
        raise _fail("--engines is empty and no --url was given: nothing to benchmark")
    if workload not in WORKLOADS:
        raise _fail(f"--workload: {workload!r} is not one of {', '.join(WORKLOADS)}")
    if concurrency is not None and not 1 <= concurrency <= 256:
        raise _fail(f"--concurrency: must be in 1..256, got {concurrency}")
    if repeats < 2:
        raise _fail(f"--repeats: need at least 2 rounds for an interval, got {repeats}")
    chosen: list[BenchEngine] = []
    tokenizer = None
    if "envex" in names:
        engine = _load_engine(model, device, dtype)
        tokenizer = engine.tokenizer
        chosen.append(EnvexInProcess(engine))
    if "hf-stock" in names or "hf-tuned" in names:
        from envex.runtime.loader import resolve_model
        from envex.verify.reference import load_hf_model

        hf_device = "cuda" if device == "auto" and _cuda() else ("cpu" if device == "auto" else device)
        hf_dtype = ("bfloat16" if hf_device == "cuda" else "float32") if dtype == "auto" else dtype
        source = resolve_model(model)
        if "hf-stock" in names:
            chosen.append(HFTransformers(load_hf_model(source, device=hf_device, dtype=hf_dtype)))
        if "hf-tuned" in names:
            chosen.append(HFTransformers(load_hf_model(source, device=hf_device, dtype=hf_dtype), tuned=True))
    if url:
        from envex.runtime.loader import load_model_info

        info = load_model_info(model)
        tokenizer = tokenizer or info.tokenizer
        chosen.append(OpenAICompatible(url, model=served_model or info.source.name, api_key=api_key))
    if tokenizer is None:
        from envex.runtime.loader import load_model_info

        tokenizer = load_model_info(model).tokenizer
    report = run_bench(chosen, tokenizer=tokenizer, workload_name=workload, concurrency=concurrency, repeats=repeats,
                       warmups=warmups, out_dir=out, show_progress=progress and sys.stderr.isatty())
    typer.echo(report.to_markdown())
    if out is not None:
        typer.echo(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _load_engine(model: str, device: str, dtype: str):  # -> LLMEngine
    from envex.runtime.engine import EngineConfig, LLMEngine
    from envex.runtime.loader import ModelNotFoundError

    try:
        return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype))
    except (ModelNotFoundError, ValueError) as exc:
        raise _fail(str(exc)) from exc


def main() -> None:
    """`python -m envex.verify.cli gates run ...` / `... bench ...` until installer/commands.py registers both."""
    app = typer.Typer(no_args_is_help=True)
    app.add_typer(gates_app, name="gates")
    app.command("bench")(bench)
    app()


if __name__ == "__main__":
    main()
