"""Step 4: build a new release slot, `<prefix>/releases/<id>/`: the model, the kernel cache, a venv, launch.json.

The slot is new every time and never shared, so nothing the active release uses is touched. Each payload is
extracted by the verified bundle itself (re-hashed as it is copied: media pulled out or changed after verification
fails the copy). A slot is recorded in state.json as `installing` before it is created, so a crash leaves a slot
that the next run recognises and removes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from envex.bundles import VerificationError
from envex.installer.cards import WHEELHOUSE
from envex.installer.children import run_tied
from envex.installer.fsutil import atomic_write
from envex.installer.launch import (
    KERNEL_CACHE,
    LAUNCH_FILE,
    OFFLINE_ENV,
    LaunchKernels,
    LaunchManifest,
    LaunchModel,
    LaunchRuntime,
)
from envex.installer.media import InstallError
from envex.installer.plan import DTYPE_BYTES, Plan, bundle_ref
from envex.installer.state import now_ts

RELEASES_DIR = "releases"
DEMO_DEPS_PTH = "_envex_demo_deps.pth"


def release_dir(prefix: Path, release_id: str) -> Path:
    return Path(prefix) / RELEASES_DIR / release_id


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], what: str, env: dict[str, str], prefix: Path | None = None) -> str:
    # Tied to the installer (children.py): pip does not go on writing into a slot after the installer died.
    code, out, err = run_tied(cmd, what=what, env=env, prefix=prefix)
    if code != 0:
        tail = (err or out).strip().splitlines()[-1:] or ["(no output)"]
        raise InstallError(f"install: {what} failed (exit {code}): {tail[0]}")
    return out


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_INDEX_URL", None)
    env.pop("PIP_EXTRA_INDEX_URL", None)
    return env


def installer_site_dirs() -> list[str]:
    """The site-packages directories the installer itself imports from, in order (a bootstrap venv's own, then
    whatever it reaches through its .pth lines): what a demo release borrows its dependencies from."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and Path(d).is_dir()]


def create_venv(
    venv: Path, wheelhouse: Path, *, complete: bool, install: list[str], prefix: Path | None = None
) -> None:
    """A venv holding the wheelhouse, installed with pip --no-index: nothing is fetched from anywhere.

    `complete` (production): a plain venv and `pip install --find-links wheelhouse <install>`; every dependency
    must be in the wheelhouse. Demo: the wheelhouse's wheels are installed without their dependencies, which come
    from the installing environment through a .pth line (its site-packages appended to sys.path, after the venv's).
    """
    env = _child_env()
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "creating the venv", env, prefix)
    python = venv_python(venv)
    if not complete:
        site = Path(
            _run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                "reading the venv's site-packages",
                env,
                prefix,
            ).strip()
        )
        (site / DEMO_DEPS_PTH).write_text("".join(f"{p}\n" for p in installer_site_dirs()))
    pip = [
        sys.executable,
        "-m",
        "pip",
        "--isolated",
        "--python",
        str(python),
        "install",
        "--no-index",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--no-input",
    ]
    if complete:
        cmd = [*pip, "--find-links", str(wheelhouse), *install]
    else:
        wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
        if not wheels:
            raise InstallError(f"install: the runtime bundle's wheelhouse {wheelhouse} holds no wheels")
        cmd = [*pip, "--no-deps", "--ignore-installed", *wheels]
    _run(cmd, "pip install --no-index from the wheelhouse", env, prefix)


def venv_versions(venv: Path) -> dict[str, str | None]:
    script = (
        "import json, platform\nfrom importlib.metadata import version, PackageNotFoundError\n"
        "def v(n):\n    try: return version(n)\n    except PackageNotFoundError: return None\n"
        "print(json.dumps({'python': platform.python_version(), 'envex': v('envex'), 'torch': v('torch'),"
        " 'triton': v('triton')}))"
    )
    out = _run([str(venv_python(venv)), "-c", script], "reading the release's versions", _child_env())
    return json.loads(out)


def build_release(
    prefix: Path, release_id: str, plan: Plan, *, on_progress: Callable[[str, int], None] | None = None
) -> LaunchManifest:
    """Fill `releases/<release_id>/` (which must not exist) and write its launch.json (gates still empty)."""
    slot = release_dir(prefix, release_id)
    if slot.exists():
        raise InstallError(f"install: {slot} already exists; remove it or run envex-install again")
    slot.mkdir(parents=True)
    step = on_progress or (lambda _what, _n: None)
    try:
        step("model", plan.model.total_bytes)
        plan.model.extract(slot / "model")
        step("runtime", plan.runtime.total_bytes)
        plan.runtime.extract(slot / "runtime")
        if plan.kernels is not None:
            step("kernels", plan.kernels.total_bytes)
            read_only_files(plan.kernels.extract(slot / KERNEL_CACHE))
        step("venv", 0)
        card = plan.runtime_card
        create_venv(
            slot / "venv",
            slot / "runtime" / WHEELHOUSE,
            complete=card.wheelhouse == "complete",
            install=card.install,
            prefix=prefix,
        )
    except VerificationError as exc:
        raise InstallError(f"install: copying from the media failed [{exc.check.value}]: {exc.message}") from None
    except OSError as exc:
        raise InstallError(f"install: writing {slot} failed: {exc.strerror or exc}; check the disk and media") from None
    versions = venv_versions(slot / "venv")
    launch = make_launch(release_id, plan, versions, slot)
    atomic_write(slot / LAUNCH_FILE, launch.to_bytes())
    return launch


def engine_settings(plan: Plan, model_path: Path) -> dict[str, Any]:
    """Every EngineConfig setting as the engine will run it: the plan's choices over EngineConfig's defaults,
    resolved for this host's mode and the model card's window (EngineConfig.resolved, the one place defaults are
    decided), so launch.json records concrete values, not "auto"."""
    from envex.runtime.engine.config import EngineConfig

    config = EngineConfig(model=str(model_path), **plan.engine)
    config = config.resolved(window=plan.model_card.max_position_embeddings, cuda_available=plan.mode == "cuda",
                             architecture=plan.model_card.architecture)  # fmt: skip
    return {f.name: getattr(config, f.name) for f in fields(EngineConfig) if f.name not in ("model", "served_name")}


def model_path(slot: Path, plan: Plan) -> Path:
    """The installed model inside a release slot: the weights file (GGUF) or the model directory (HF)."""
    weights = plan.model_card.weights
    return slot / "model" / weights if weights != "." else slot / "model"


def make_launch(release_id: str, plan: Plan, versions: dict[str, str | None], slot: Path) -> LaunchManifest:
    mcard = plan.model_card
    weights_entry = next((f for f in plan.model.manifest.files if f.path == mcard.weights), None)
    engine = engine_settings(plan, model_path(slot, plan))
    dtype = str(engine["dtype"])
    kernels = None
    if plan.kernels is not None:
        targets = plan.kernels.manifest.targets
        kernels = LaunchKernels(
            cache_dir=KERNEL_CACHE,
            accelerator=targets.accelerators[0] if targets.accelerators else "any",
            triton=versions.get("triton"),
            bundle=bundle_ref(plan.kernels),
            keys=targets.model_dump(mode="json"),
        )
    return LaunchManifest(
        release=release_id,
        created=now_ts(),
        mode=plan.mode,  # type: ignore[arg-type]
        model=LaunchModel(
            path=f"model/{mcard.weights}" if mcard.weights != "." else "model",
            served_name=mcard.served_name,
            format=mcard.format,
            architecture=mcard.architecture,
            quantization=mcard.quantization,
            sha256=weights_entry.sha256 if weights_entry is not None else plan.model.manifest_sha256,
            bundle=bundle_ref(plan.model),
        ),
        engine=engine,
        numeric_policy=f"weights {mcard.quantization}"
        + (f" quantized at load by {engine['weights']}" if engine.get("weights") else "") + f" computed in {dtype}",
        kv_cache={  # bytes_per_token and capacity_tokens: over every layer, in kv_cache_dtype (the plan's count)
            "dtype": dtype,
            "kv_cache_dtype": str(engine.get("kv_cache_dtype", "bf16")),
            "block_size": int(engine["block_size"]),
            "bytes_per_token": mcard.kv_bytes_per_token(DTYPE_BYTES[dtype], str(engine.get("kv_cache_dtype", "bf16"))),
            "capacity_tokens": plan.kv_capacity_tokens,
        },
        kernels=kernels,
        runtime=LaunchRuntime(
            envex_version=versions.get("envex") or plan.runtime_card.envex_version,
            python=versions.get("python") or "",
            torch=versions.get("torch"),
            triton=versions.get("triton"),
            venv="venv",
            bundle=bundle_ref(plan.runtime),
        ),
        hardware=plan.probe.as_dict() if plan.probe is not None else None,
    )


def read_only_files(root: Path) -> Path:
    """Take the write bits off every file under `root` (the kernel cache is read, never written, once installed).
    Directories keep theirs, so that removing an old release needs no chmod."""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode & ~0o222)
    return root


def remove_release(prefix: Path, release_id: str) -> None:
    shutil.rmtree(release_dir(prefix, release_id), ignore_errors=True)
