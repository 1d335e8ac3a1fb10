"""Kernel bundles: the engine's compiled Triton kernels for one model, GPU architecture and software stack.

`stage_kernels` runs the engine's warm-up for a model on this machine's GPU, in a child process whose Triton
cache (TRITON_CACHE_DIR) is a fresh directory: every kernel variant the engine compiles at start (the warm-up's
prefill, mixed and decode steps, the CUDA-graph ladder) and for a first chat answer lands there, with the C
launchers Triton builds around them. That cache is staged as the payload (`envex.bundles.kernel_cache`), with
`envex-kernels.json` saying what was built where, and the targets that key it: accelerator, driver floor,
python, torch, triton, the CUDA version torch was built for, and the digest of the kernel sources. The installer
installs the bundle only where every key matches (plan.kernel_problems); the server reads it read-only through
`envex.kernels.bundle_cache`.

    python -m envex.installer.kernel_bundle warm --model M --settings JSON --report FILE   (the child; internal)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from envex.bundles import Requirement, build_bundle
from envex.bundles.kernel_cache import stage_triton_cache
from envex.installer.cards import MODEL_CARD, ModelCard, load_model_card
from envex.installer.launch import OFFLINE_ENV
from envex.installer.media import InstallError
from envex.installer.plan import engine_choices

KERNELS_CARD = "envex-kernels.json"
WARM_TIMEOUT_S = 1800
SMOKE_PROMPT = "What is the capital of France?"
# Variables that would send the warm-up's Triton somewhere other than the fresh cache, or change its keys.
_TRITON_ENV_CLEARED = (
    "TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE_BACKEND", "TRITON_ALWAYS_COMPILE", "TRITON_KERNEL_OVERRIDE",
    "TRITON_KERNEL_DUMP", "ENVEX_KERNEL_BUNDLE", "ENVEX_KERNEL_BUNDLE_LABEL",
)


class KernelsCard(BaseModel):
    """envex-kernels.json: what the warm-up compiled, for which model and settings, on what machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str  # what the warm-up loaded (file or directory name, or the embedded model's name)
    architecture: str
    engine: dict[str, str | int | float | bool | None]  # the plan's choices the warm-up ran with
    built_on: dict[str, str | None]  # gpu, accelerator, driver, python, torch, torch_cuda, triton, envex
    kernels: list[str] = Field(max_length=100_000)  # one name per compiled variant (a kernel may have several)
    c_modules: int = Field(ge=0)  # launchers and driver modules: what a host without a C compiler cannot build
    warm_up_seconds: float


def model_for_kernels(model: str) -> tuple[str, ModelCard]:
    """(the engine's model spec, the card whose settings the release will run) for a model directory holding
    envex-model.json (a model bundle's source), a .gguf file, an HF directory, or the embedded model's name."""
    path = Path(model)
    if path.is_dir() and (path / MODEL_CARD).is_file():
        card = load_model_card(path / MODEL_CARD)
        weights = path if card.weights == "." else path / card.weights
        return str(weights), card
    from envex.installer.demo import model_card_for
    from envex.runtime.loader import EMBEDDED_MODEL, embedded_model_path

    source = embedded_model_path() if model == EMBEDDED_MODEL else path
    return model if model == EMBEDDED_MODEL else str(path), model_card_for(source, path.name or EMBEDDED_MODEL)


def _driver_floor(driver: str | None) -> str | None:
    # The build driver's branch (580.159.04 -> 580): cubins from one toolkit load on every driver of its branch
    # and later; the exact build would refuse hosts one patch release behind.
    return driver.split(".", 1)[0] if driver else None


def _release(version: str | None) -> str | None:
    return version.split("+", 1)[0] if version else None


def targets_from_report(report: dict[str, Any], *, min_driver: str | None = None) -> dict[str, Any]:
    """The manifest targets that key a kernels bundle, from the warm-up child's report."""
    b = report["built_on"]
    major, minor = (int(p) for p in str(b["python"]).split(".")[:2])
    cuda = b.get("torch_cuda")
    return {
        "accelerators": [b["accelerator"]],
        "min_driver": min_driver or _driver_floor(b.get("driver")),
        "python": f">={major}.{minor},<{major}.{minor + 1}",  # launchers are built for one CPython ABI
        "torch": f"=={_release(b['torch'])}",
        "triton": f"=={_release(b['triton'])}",
        "cuda": f"=={cuda}" if cuda else None,
        "kernel_sources": report["kernel_sources"],
    }


def warm_cache(model: str, settings: dict[str, Any], cache: Path, *, timeout: float = WARM_TIMEOUT_S) -> dict[str, Any]:
    """Run the engine's warm-up for `model` with `settings` in a child process whose Triton cache is `cache`
    (which must be empty); returns the child's report (versions, GPU, kernel-source digest, timings)."""
    cache.mkdir(parents=True, exist_ok=True)
    if any(cache.iterdir()):
        raise InstallError(f"{cache}: not empty; a kernel bundle is built from a fresh Triton cache")
    env = {k: v for k, v in os.environ.items() if k not in _TRITON_ENV_CLEARED}
    env.update(OFFLINE_ENV)
    env["TRITON_CACHE_DIR"] = str(cache)
    with tempfile.TemporaryDirectory(prefix="envex-warm-") as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "envex.installer.kernel_bundle", "warm", "--model", model,
               "--settings", json.dumps(settings), "--report", str(report_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise InstallError(f"kernels: the warm-up of {model} ran past {timeout:.0f} s; nothing was built") from None
        if proc.returncode != 0 or not report_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise InstallError(f"kernels: the warm-up of {model} failed (exit {proc.returncode}): {tail[0]}")
        return json.loads(report_path.read_text(encoding="utf-8"))


def stage_kernels(
    model: str, dest: Path, *, max_model_len: int | None = None, min_driver: str | None = None
) -> dict[str, Any]:
    """Fill `dest` (created) with the kernels payload for `model`; returns the manifest targets that key it."""
    spec, card = model_for_kernels(model)
    settings = engine_choices(card, "cuda", max_model_len)
    with tempfile.TemporaryDirectory(prefix="envex-triton-") as tmp:
        report = warm_cache(spec, settings, Path(tmp) / "cache")
        staged = stage_triton_cache(Path(tmp) / "cache", dest)
    kcard = KernelsCard(
        model=Path(spec).name or spec,
        architecture=card.architecture,
        engine=settings,
        built_on=report["built_on"],
        kernels=list(staged.kernels),
        c_modules=len(staged.c_modules),
        warm_up_seconds=round(float(report["seconds"]), 3),
    )
    (dest / KERNELS_CARD).write_text(kcard.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return targets_from_report(report, min_driver=min_driver)


def build_kernel_bundle(
    model: str,
    *,
    name: str,
    version: str,
    out: Path,
    requires: Iterable[Requirement | dict[str, Any]] = (),
    max_model_len: int | None = None,
    min_driver: str | None = None,
) -> Path:
    """Build an unsigned kernels bundle for `model` on this machine's GPU (sign it with bundles.sign_bundle).
    `requires` names the model bundle it was compiled for (kind model), so the planner pairs them."""
    with tempfile.TemporaryDirectory(prefix="envex-kernels-") as tmp:
        payload = Path(tmp) / "payload"
        targets = stage_kernels(model, payload, max_model_len=max_model_len, min_driver=min_driver)
        return build_bundle(payload, kind="kernels", name=name, version=version, out=out, targets=targets,
                            requires=requires)


# ---- the warm-up child -------------------------------------------------------------------------------------------


def _gpu_facts() -> dict[str, str | None]:
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability(0)
    driver = None
    try:
        import pynvml

        pynvml.nvmlInit()
        raw = pynvml.nvmlSystemGetDriverVersion()
        driver = raw.decode() if isinstance(raw, bytes) else str(raw)
        pynvml.nvmlShutdown()
    except Exception:  # no NVML: the floor must then be given (--min-driver)
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        envex_version: str | None = version("envex")
    except PackageNotFoundError:
        envex_version = None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "accelerator": f"sm_{major}{minor}",
        "driver": driver,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "envex": envex_version,
    }


def _warm(model: str, settings: dict[str, Any], report: Path) -> None:
    import envex.kernels
    from envex.bundles.kernel_cache import directory_kernel_digest
    from envex.runtime.engine import LLMEngine, SamplingParams
    from envex.runtime.engine.config import EngineConfig

    start = time.perf_counter()
    config = EngineConfig(model=model, **{**settings, "warm_up": True})
    if config.device != "cuda":
        raise SystemExit("kernels: a kernel bundle is built on a CUDA GPU (the plan's settings say device cuda)")
    engine = LLMEngine(config)  # the warm-up and the CUDA-graph captures run here, as at every start
    tok = engine.tokenizer
    chat = SMOKE_PROMPT if tok.chat_template is None else tok.apply_chat_template([{"role": "user",
                                                                                    "content": SMOKE_PROMPT}])
    answer = engine.generate([chat], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    result = {
        "built_on": _gpu_facts(),
        "kernel_sources": directory_kernel_digest(Path(envex.kernels.__file__).parent),
        "seconds": time.perf_counter() - start,
        "smoke_answer": answer,
    }
    report.write_text(json.dumps(result, indent=2), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envex.installer.kernel_bundle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    warm = sub.add_parser("warm", help="run the warm-up into TRITON_CACHE_DIR and write a report (internal)")
    warm.add_argument("--model", required=True)
    warm.add_argument("--settings", required=True, help="the engine settings, as JSON")
    warm.add_argument("--report", type=Path, required=True)
    args = parser.parse_args(argv)
    _warm(args.model, json.loads(args.settings), args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
