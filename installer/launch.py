"""launch.json: every load-bearing setting of one release, and how `envex serve --launch` starts from it.

Paths inside are relative to the release directory that holds the file, so `<prefix>/current/launch.json`
resolves through the `current` link once, at start: a later switch of `current` does not move a running server.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from envex.bundles.files import one_line, read_regular_file, show
from envex.installer.state import BundleRef, CheckSummary, validate_json

LAUNCH_FILE = "launch.json"
# launch.json is a few KB (settings, bundle refs, gate verdicts, at most 40 headline numbers).
MAX_LAUNCH_BYTES = 4 * 1024 * 1024
KERNEL_CACHE = "kernels"

# Set before anything that could look for a hub or phone home is imported (transformers, huggingface_hub, pip).
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    "DO_NOT_TRACK": "1",
    "PIP_NO_INDEX": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_INPUT": "1",
    # Not a network switch, but every child envex starts runs with these: no working directory on sys.path. Started
    # in a source checkout's root, `python -m` would put its top-level folders there as top-level names, and
    # kernels/ shadows the PyPI package `kernels` that transformers >= 5.25 imports (offline_docs/layout.md).
    "PYTHONSAFEPATH": "1",
}


class LaunchError(ValueError):
    """launch.json is missing, invalid, or names a release that may not be served."""


def set_offline_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the offline switches of every library that could look for a hub (in os.environ unless given)."""
    target: Any = os.environ if environ is None else environ
    for key, value in OFFLINE_ENV.items():
        target[key] = value
    return target


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LaunchModel(_Model):
    path: str  # relative to the release directory
    served_name: str
    format: Literal["gguf", "hf"]
    architecture: str
    quantization: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # of the weights file (GGUF) or the model bundle's manifest (HF)
    bundle: BundleRef


class LaunchKernels(_Model):
    """The release's kernel bundle: its compiled Triton cache, read-only, and the keys it was installed for."""

    cache_dir: str  # relative to the release directory; read through envex.kernels.bundle_cache, never written
    accelerator: str
    triton: str | None
    bundle: BundleRef  # its manifest_sha256 is the kernel bundle's digest
    keys: dict[str, Any] | None = None  # the bundle's targets as installed (accelerators, driver, ..., kernel_sources)


class LaunchRuntime(_Model):
    envex_version: str
    python: str
    torch: str | None
    triton: str | None
    venv: str  # relative to the release directory
    bundle: BundleRef


def _engine_fields() -> dict[str, Any]:
    from envex.runtime.engine.config import EngineConfig

    return {f.name: f for f in dataclasses.fields(EngineConfig)}


class LaunchManifest(_Model):
    schema_version: Literal[1] = 1
    release: str
    created: str
    mode: Literal["cpu", "cuda"]
    model: LaunchModel
    engine: dict[str, str | int | float | bool | None]  # EngineConfig fields except `model` and `served_name`
    numeric_policy: str
    kv_cache: dict[str, str | int]
    kernels: LaunchKernels | None
    runtime: LaunchRuntime
    gates: CheckSummary | None = None
    bench: dict[str, float] = Field(default_factory=dict)
    # The install's probe of this machine (installer.probe.Probe.as_dict): what status and the admin page show,
    # rather than probing again.
    hardware: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _engine_settings_known(self) -> LaunchManifest:
        known = _engine_fields()
        for key in self.engine:
            if key not in known or key in ("model", "served_name"):
                raise ValueError(f"engine.{key} is not an engine setting")
        return self

    def engine_config(self, release_dir: Path) -> Any:
        from envex.runtime.engine.config import EngineConfig

        return EngineConfig(model=str(release_dir / self.model.path), served_name=self.model.served_name, **self.engine)

    def to_bytes(self) -> bytes:
        return (self.model_dump_json(indent=2) + "\n").encode()


def read_launch(path: Path | str) -> tuple[LaunchManifest, Path]:
    """Parse launch.json; returns it and the real release directory (links resolved once, now)."""
    path = Path(path)
    try:
        real = Path(os.path.realpath(path))
        data = read_regular_file(real, max_bytes=MAX_LAUNCH_BYTES, what="launch manifest")
    except OSError as exc:
        # Name the path as given, not the resolved one: `current/launch.json` is what the operator typed.
        detail = str(exc).replace(show(real), show(path), 1)
        raise LaunchError(f"{detail}; is the prefix installed (envex status)?") from None
    try:
        manifest = validate_json(LaunchManifest, data)
    except ValueError as exc:
        raise LaunchError(f"{show(path)}: invalid launch manifest ({one_line(str(exc))})") from None
    return manifest, real.parent


def load_launch(path: Path | str, *, require_gates: bool = True) -> Any:
    """The EngineConfig that launch.json describes; refuses a release whose gates did not pass on this machine.

    Also sets the offline switches and, on CUDA, Triton's cache manager (`kernel_env`), before the engine imports.
    """
    manifest, release_dir = read_launch(path)
    if require_gates and (manifest.gates is None or manifest.gates.verdict != "pass"):
        raise LaunchError(
            f"{path}: release {manifest.release} has not passed its gates on this machine; "
            "run envex-install (or envex activate a release that passed)"
        )
    weights = release_dir / manifest.model.path
    if not weights.exists():
        raise LaunchError(f"{path}: the model {weights} is missing; reinstall the release or roll back")
    if manifest.kernels is not None and not (release_dir / manifest.kernels.cache_dir).is_dir():
        raise LaunchError(
            f"{path}: the kernel bundle's cache {release_dir / manifest.kernels.cache_dir} is missing; reinstall "
            "the release or roll back"
        )
    set_offline_env()
    if manifest.mode == "cuda":
        for key in (BUNDLE_ENV, LABEL_ENV):  # another release's bundle must not leak in through the environment
            os.environ.pop(key, None)
        os.environ.update(kernel_env(manifest, release_dir))
    return manifest.engine_config(release_dir)


# Names shared with envex.kernels.bundle_cache (which imports triton, so it is not imported here).
CACHE_MANAGER = "envex.kernels.bundle_cache:BundleCacheManager"
BUNDLE_ENV = "ENVEX_KERNEL_BUNDLE"
LABEL_ENV = "ENVEX_KERNEL_BUNDLE_LABEL"


def kernel_env(manifest: LaunchManifest, release_dir: Path) -> dict[str, str]:
    """The environment that makes Triton read the release's kernel bundle read-only (and name what is missing when a
    kernel must be built on a host without a C compiler). Misses go to Triton's usual cache (TRITON_CACHE_DIR,
    left as the operator set it), never into the release. Without a kernel bundle only the manager is set, so a
    missing C compiler is still named at start."""
    env = {"TRITON_CACHE_MANAGER": CACHE_MANAGER}
    if manifest.kernels is not None:
        env[BUNDLE_ENV] = str(release_dir / manifest.kernels.cache_dir)
        env[LABEL_ENV] = f"{manifest.kernels.bundle.name} {manifest.kernels.bundle.version}"
    return env


def recorded_probe(prefix: Path) -> tuple[Any, str] | None:
    """(the Probe the install of the active release recorded, where it came from), or None when there is none."""
    from envex.installer.probe import Probe

    try:
        manifest, _ = read_launch(Path(prefix) / "current" / LAUNCH_FILE)
    except LaunchError:
        return None
    if manifest.hardware is None:
        return None
    try:
        return Probe.from_dict(manifest.hardware), f"recorded by the install of release {manifest.release} at " \
            f"{manifest.created}"
    except ValueError:
        return None
