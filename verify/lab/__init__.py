"""The lab: source-only tools and evidence, importable from a checkout (editable install) and never in the wheel.

- device scripts (`device_*.sh`, sourced or run from the repo root on a GPU machine; `device_setup.sh` first) and
  their Python halves: `cuda_check` (gates and bench on the device), `devcarry` (split and join what a call
  carries), `device_install` (the installer's own steps, timed)
- `kernel_bench/`: the kernel, engine, server, MoE, speculation, invariance and tensor-parallel benches
- `bench_install` (the installer against a plain copy) and `admin_screenshot` (offline_docs/admin-overview.png)
- `airgap_install`: media built here, installed, gated, served and asked inside `unshare -n` (README.md)
- `results/`: the raw JSON and text those runs wrote

Nothing in a product package imports it (tests/test_layering.py); the wheel leaves it out (pyproject.toml does not
list it, tests/test_wheel_contents.py).

`bench_install` and `admin_screenshot` use the test support, envex.tests.support, which no install maps (pyproject
lists neither tests/ nor its package): importing the lab registers the checkout's tests/ as envex.tests where that
name is not importable already (a device tree that links tests/ into an envex namespace folder has it).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import envex


def _register_test_support() -> None:
    """envex.tests: this checkout's tests/, unless `envex.tests` is imported or importable already."""
    if "envex.tests" in sys.modules or importlib.util.find_spec("envex.tests") is not None:
        return
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "__init__.py").is_file():
        return
    spec = importlib.util.spec_from_file_location(
        "envex.tests", tests / "__init__.py", submodule_search_locations=[str(tests)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["envex.tests"] = module
    spec.loader.exec_module(module)
    envex.tests = module  # type: ignore[attr-defined]  # what the import system sets on the parent package


_register_test_support()
