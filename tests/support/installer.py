"""Test tools for the installer: small signed media with a fake model, tiny wheels, and subprocess helpers.

Never used by the installer itself. The fake model bundles carry a real card and a few bytes of "weights": enough
for verify, plan and install; the gates are then injected (ENVEX_TEST_GATES_REPORT) since nothing can load them.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from envex.bundles import build_bundle, sign_bundle
from envex.installer.cards import MODEL_CARD, RUNTIME_CARD, WHEELHOUSE, ModelCard, ModelDefaults, RuntimeCard
from envex.installer.demo import pip_wheel_command
from envex.installer.media import BUNDLES_DIR, ROOT_FILE, TRUST_DIR

PASS_REPORT = {"verdict": "pass", "suite": "quick", "gates": {"injected": "pass"}, "bench": {"injected": 1.0}}
FAIL_REPORT = {"verdict": "fail", "suite": "quick", "gates": {"injected": "fail", "other": "pass"}, "bench": {}}


def fake_model_card(**overrides: Any) -> ModelCard:
    values: dict[str, Any] = {
        "served_name": "fake",
        "format": "gguf",
        "weights": "fake.gguf",
        "architecture": "LlamaForCausalLM",
        "parameters": 1000,
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "quantization": "F32",
        "defaults": ModelDefaults(max_model_len=128, max_num_seqs=2),
    }
    values.update(overrides)
    return ModelCard(**values)


def write_runtime_src(
    src: Path,
    wheels: Sequence[Path],
    *,
    complete: bool = False,
    install: Sequence[str] = ("envex",),
    envex_version: str = "0.1.0",
) -> Path:
    (src / WHEELHOUSE).mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        (src / WHEELHOUSE / wheel.name).write_bytes(wheel.read_bytes())
    card = RuntimeCard(
        wheelhouse="complete" if complete else "demo", install=list(install), envex_version=envex_version
    )
    (src / RUNTIME_CARD).write_text(card.model_dump_json())
    return src


def write_model_src(src: Path, card: ModelCard, weights: bytes = b"GGUF fake weights") -> Path:
    src.mkdir(parents=True, exist_ok=True)
    (src / card.weights).write_bytes(weights)
    (src / MODEL_CARD).write_text(card.model_dump_json())
    return src


def fake_media(
    media: Path,
    root_path: Path,
    key: Ed25519PrivateKey,
    work: Path,
    *,
    wheels: Sequence[Path],
    runtime_version: str = "0.1.0",
    model_version: str = "1.0.0",
    card: ModelCard | None = None,
    model_targets: dict[str, Any] | None = None,
    model_requires: Sequence[dict[str, Any]] = (),
    model_files: dict[str, bytes] | None = None,
) -> Path:
    """Signed media with a runtime bundle holding `wheels` and a fake model bundle (with `model_files` beside its
    card and weights); returns `media`."""
    (media / BUNDLES_DIR).mkdir(parents=True, exist_ok=True)
    (media / TRUST_DIR).mkdir(parents=True, exist_ok=True)
    (media / TRUST_DIR / ROOT_FILE).write_bytes(root_path.read_bytes())
    rsrc = write_runtime_src(work / f"runtime-{runtime_version}", wheels)
    runtime = build_bundle(rsrc, kind="runtime", name="envex-runtime", version=runtime_version, out=media / BUNDLES_DIR)
    sign_bundle(runtime, [key])
    card = card or fake_model_card()
    msrc = write_model_src(work / f"model-{model_version}", card)
    for name, data in (model_files or {}).items():
        (msrc / name).write_bytes(data)
    model = build_bundle(
        msrc,
        kind="model",
        name="fake-model",
        version=model_version,
        out=media / BUNDLES_DIR,
        targets=model_targets,
        requires=list(model_requires),
    )
    sign_bundle(model, [key])
    return media


def build_tiny_wheels(out: Path) -> list[Path]:
    """Two tiny pure-Python wheels, tinyapp (depends on tinydep) and tinydep, built offline with pip wheel."""
    out.mkdir(parents=True, exist_ok=True)
    for name, deps in (("tinydep", []), ("tinyapp", ["tinydep==1.0"])):
        src = out.parent / f"src-{name}"
        (src / name).mkdir(parents=True, exist_ok=True)
        (src / name / "__init__.py").write_text(f"NAME = {name!r}\n")
        (src / "pyproject.toml").write_text(
            textwrap.dedent(f"""\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{name}"
            version = "1.0"
            dependencies = {json.dumps(deps)}
            [tool.setuptools]
            packages = ["{name}"]
            """)
        )
        subprocess.run(pip_wheel_command(src, out), check=True, capture_output=True)
    return sorted(out.glob("*.whl"))


def guarded_env(tmp: Path, extra: dict[str, str] | None = None) -> tuple[dict[str, str], Path]:
    """Environment for child processes with the network guard in a sitecustomize.py; returns (env, record)."""
    from envex.installer.netguard import sitecustomize_source

    guard_dir = tmp / "netguard"
    guard_dir.mkdir(parents=True, exist_ok=True)
    record = guard_dir / "violations.jsonl"
    record.touch()
    (guard_dir / "sitecustomize.py").write_text(sitecustomize_source(record))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(guard_dir), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env, record


def violations(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
