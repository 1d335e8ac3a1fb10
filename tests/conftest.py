"""Shared fixtures: the embedded model is loaded once per test session (about 15 s on two cores)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest

import envex

# The checkout's top-level folders are the subpackages envex.<folder> (pyproject's package-dir). With the checkout on
# sys.path they are also importable as top-level names, and `kernels/` then shadows the PyPI package `kernels`, which
# transformers >= 5.25 depends on and imports (`from kernels import CUDAProperties`: an ImportError in every test
# that loads a model). pytest imports the tests without it (--import-mode=importlib, pyproject), `python -m pytest`
# put it first as the working directory: taken out here, and kept out of the processes the tests start.
CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != CHECKOUT]
os.environ.setdefault("PYTHONSAFEPATH", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# This folder is envex.tests for the test modules (`from envex.tests.support import ...`). No install maps it (the
# wheel must not carry it, so pyproject lists neither the package nor its folder): registered here, before any test
# module is collected, from this file's own folder. The processes the tests start import it only through the lab
# (verify/lab/__init__.py registers it the same way for its tools).
if "envex.tests" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "envex.tests", CHECKOUT / "tests" / "__init__.py", submodule_search_locations=[str(CHECKOUT / "tests")]
    )
    assert _spec is not None and _spec.loader is not None
    _tests = importlib.util.module_from_spec(_spec)
    sys.modules["envex.tests"] = _tests
    _spec.loader.exec_module(_tests)
    envex.tests = _tests  # type: ignore[attr-defined]  # what the import system sets on the parent package

WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))  # one of pyproject's two workers: one core each, not two threads
if WORKER:
    # Also for every process a test starts (servers, installs, gate runners inherit the environment): a torch
    # process with two OpenMP threads, one on the core the other worker is using, ran ~3x slower than with one
    # (the embedded model's decode, 4 sequences x 32 tokens: 29.3 s against 10.6 s; 10.4 s with two idle cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS)

if WORKER:
    torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on a machine without a GPU. Set here, before any test module is
    # collected: a @triton.jit is bound to the interpreter or not when envex.kernels is first imported. (Each kernel
    # test module used to set it itself, which came too late when a module collected before it imported the
    # kernels first: `pytest tests/test_runtime*.py` gave 17 interpreter errors "Cannot call @triton.jit'd outside
    # of the scope of a kernel". GPU runs with --noconftest need no interpreter.)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def embedded_engine():
    """An LLMEngine on the embedded SmolLM2-135M-Instruct, float32 on CPU. Tests must leave it idle."""
    from envex.runtime.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(device="cpu"))


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers on the same GGUF weights, float32 on CPU: the reference the engine must match."""
    import torch
    from transformers import AutoModelForCausalLM

    from envex.runtime.loader import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


# Test files and tests that take minutes on a 2-core machine, longest first (seconds in the full run at 0b3f930).
# xdist's loadscope hands out whole files, by default those with the most tests first, which started the one-test
# e2e file (then 449 s) near the end: for most of its run the other worker had nothing left to do. A stale entry
# only costs time; a file not listed keeps xdist's order, after these.
LONGEST_FIRST = (
    "tests/test_airgap_install.py",  # 222 alone (-n 0); 649 s for the script on a loaded 2-core machine
    "tests/test_installer_e2e.py",  # 190
    "tests/test_lab_gpt_oss_install.py",  # ~120: a reduced gpt-oss's media built and installed with the real gates
    "tests/test_runtime_reference.py",  # 41 + 33 (the session engine and HF model) + 10 tests of seconds
    "tests/test_kernel_bundles_device_script.py",  # 80
)
# Files whose tests share no costly module fixture: each test is a unit of its own, so both workers can take some.
PER_TEST_FILES = ("tests/test_runtime_warm_up.py",)


def pytest_xdist_make_scheduler(config, log):
    """pyproject's `--dist loadscope`, with the units in LONGEST_FIRST's order and PER_TEST_FILES split by test."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.split("::", 1)[0] in PER_TEST_FILES:
                return nodeid
            return super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The first call comes after schedule() has filled the work queue: move the listed units to its front.
            # (workqueue is xdist's own, unpinned: where a release renames it, only the order is lost.)
            queue = getattr(self, "workqueue", None)
            if not getattr(self, "_ordered", False) and hasattr(queue, "move_to_end"):
                self._ordered = True
                rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
                for scope in sorted(queue, key=lambda s: rank.get(s, len(rank))):
                    queue.move_to_end(scope)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
