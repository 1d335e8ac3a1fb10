"""`envex demo`: signed demo media built on the fly from the embedded model, for the whole install chain.

Demo trust: one Ed25519 key holds every role (fine for a demo, wrong for production; see offline_docs/bundles.md).
The key and root live in `<workdir>/keys` and are reused, so a second `envex demo` meets the root it pinned.

Demo kernels: on a CUDA host (`envex demo --device cuda`, or auto where a GPU is seen) the media also carries a
kernel bundle for the embedded model, compiled here by the engine's warm-up (installer/kernel_bundle.py).

Demo wheelhouse: the runtime bundle holds the envex wheel only (built offline from the source tree with
`pip wheel --no-deps --no-build-isolation`); the release venv takes torch and the other dependencies from the
environment that runs the installer (see release.create_venv). Production runtime bundles carry every wheel.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from envex.bundles import (
    TrustRoot,
    VerificationError,
    build_bundle,
    load_private_key,
    load_root,
    make_demo_trust,
    sign_bundle,
    verify_bundle,
)
from envex.installer.cards import MODEL_CARD, RUNTIME_CARD, WHEELHOUSE, ModelCard, RuntimeCard
from envex.installer.media import BUNDLES_DIR, ROOT_FILE, TRUST_DIR, InstallError

RUNTIME_BUNDLE = "envex-runtime"
KERNELS_SUFFIX = "-kernels"  # the demo's kernel bundle is <model>-kernels-<model version>
DEMO_LIFETIME = timedelta(days=365)
INSTALL_SH = Path(__file__).with_name("install.sh")


@dataclass(frozen=True)
class DemoMedia:
    media: Path
    fingerprint: str
    key_path: Path
    runtime_version: str
    model_version: str
    kernels: Path | None = None


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False where torch is absent)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def source_root() -> Path | None:
    """The source tree this envex runs from (editable installs), or None for an installed wheel."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").is_file() and (here / "installer").is_dir() else None


def pip_wheel_command(src: Path, out: Path) -> list[str]:
    """`pip wheel` of one source tree into `out`, offline: no index, no dependencies, no build isolation."""
    return [sys.executable, "-m", "pip", "--isolated", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
            "--disable-pip-version-check", "-q", "-w", str(out), str(src)]


def copy_source(root: Path, dest: Path) -> Path:
    """A copy of the source tree `root` at `dest` without its build outputs, caches and dot-folders."""

    def ignore(folder: str, names: list[str]) -> set[str]:
        out = {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
        if Path(folder) == root:
            out |= {n for n in names if n.startswith(".") or n in ("build", "dist", "demo-prefix")
                    or n.endswith(".egg-info")}  # fmt: skip
        return out

    shutil.copytree(root, dest, ignore=ignore)
    return dest


def build_envex_wheel(out_dir: Path, root: Path | None = None) -> Path:
    """Build the envex wheel offline from the source tree (no build isolation, no index, no dependencies).

    pip builds in the tree it is given, and setuptools' wheel takes all of build/lib, which keeps what earlier builds
    put there (test packages among it, from before pyproject left them out): the wheel is built from a fresh copy of
    the tree, without build/, so it holds what pyproject lists and nothing a checkout kept. Concurrent builds of one
    checkout so share no build folder either."""
    root = root or source_root()
    if root is None:
        raise InstallError("demo: envex is not running from its source tree; give --wheel with an envex wheel")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="envex-wheel-") as tmp:
        src = copy_source(root.resolve(), Path(tmp) / "src")
        cmd = pip_wheel_command(src, Path(tmp))
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(Path(tmp).glob("envex-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise InstallError(f"demo: building the envex wheel from {root} failed: {tail[0]}")
        target = out_dir / wheels[0].name
        shutil.copyfile(wheels[0], target)
    return target


def model_card_for(path: Path, served_name: str) -> ModelCard:
    """The card of a .gguf file or an HF directory, from its metadata and weights (installer/model_card.py, which
    `envex media build` uses too: one definition of the card's fields and defaults)."""
    from envex.installer.model_card import card_for_model

    return card_for_model(path, served_name)


def demo_trust(keys_dir: Path) -> tuple[Path, Path, str]:
    """(root.json, key, fingerprint) of the demo trust in `keys_dir`, made on first use and reused after."""
    root_path, key_path = keys_dir / ROOT_FILE, keys_dir / "demo.key"
    if root_path.is_file() and key_path.is_file():
        return root_path, key_path, load_root(root_path).fingerprint
    keys_dir.mkdir(parents=True, exist_ok=True)
    trust = make_demo_trust(keys_dir, expires=datetime.now(UTC) + DEMO_LIFETIME)
    return trust.root_path, trust.key_path, trust.fingerprint


def build_demo_media(
    media: Path,
    keys_dir: Path,
    *,
    runtime_version: str = "0.1.0",
    model_version: str = "1.0.0",
    wheel: Path | None = None,
    model_path: Path | None = None,
    kernels: bool = False,
) -> DemoMedia:
    """Write signed demo media into `media` (created). A runtime or model bundle already there that still verifies
    is kept, each on its own: a second run of `envex demo` finds the release it installed and does not install it
    again, and a run with a new --model-version reuses the runtime bundle instead of rebuilding it with other bytes
    under the same name and version. `kernels`: also a kernel bundle, compiled by the engine's warm-up on this
    machine's GPU (CUDA only)."""
    from envex.runtime.loader import EMBEDDED_MODEL, embedded_model_path

    root_path, key_path, fingerprint = demo_trust(keys_dir)
    key = load_private_key(key_path)
    (media / TRUST_DIR).mkdir(parents=True, exist_ok=True)
    (media / BUNDLES_DIR).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(root_path, media / TRUST_DIR / ROOT_FILE)
    shutil.copyfile(INSTALL_SH, media / "install.sh")
    (media / "install.sh").chmod(0o755)
    docs = Path(__file__).resolve().parent.parent / "offline_docs"
    if docs.is_dir():
        shutil.copytree(
            docs, media / "offline_docs", ignore=shutil.ignore_patterns("*.py", "__pycache__"), dirs_exist_ok=True
        )
    gguf = model_path or embedded_model_path()
    runtime_file = media / BUNDLES_DIR / f"{RUNTIME_BUNDLE}-{runtime_version}.envex"
    model_file = media / BUNDLES_DIR / f"{EMBEDDED_MODEL}-{model_version}.envex"
    kernels_file = media / BUNDLES_DIR / f"{EMBEDDED_MODEL}{KERNELS_SUFFIX}-{model_version}.envex"
    root = load_root(root_path)
    runtime_ok, model_ok = _reusable(runtime_file, root), _reusable(model_file, root)  # built by an earlier run
    have_base = runtime_ok and model_ok
    if have_base and (not kernels or kernels_file.is_file()):
        return DemoMedia(media, fingerprint, key_path, runtime_version, model_version, _existing(kernels_file))
    with tempfile.TemporaryDirectory(prefix="envex-demo-") as tmp:
        model_src = Path(tmp) / "model"
        model_src.mkdir()
        shutil.copyfile(gguf, model_src / gguf.name)
        mcard = model_card_for(gguf, EMBEDDED_MODEL)
        (model_src / MODEL_CARD).write_text(json.dumps(mcard.model_dump(), indent=2) + "\n")
        if not have_base:
            _build_runtime_and_model(
                media, key, model_src, runtime_version, model_version, wheel, runtime=not runtime_ok, model=not model_ok
            )
        if kernels and not kernels_file.is_file():
            # Compiled by the engine's warm-up on this GPU, for the model bundle above and the kernel sources of
            # the runtime above (built from this same source tree).
            from envex.installer.kernel_bundle import build_kernel_bundle

            built = build_kernel_bundle(
                str(model_src),
                name=f"{EMBEDDED_MODEL}{KERNELS_SUFFIX}",
                version=model_version,
                out=media / BUNDLES_DIR,
                requires=[{"name": EMBEDDED_MODEL, "kind": "model", "version": f"=={model_version}"}],
            )
            sign_bundle(built, [key])
    return DemoMedia(media, fingerprint, key_path, runtime_version, model_version, _existing(kernels_file))


def _existing(path: Path) -> Path | None:
    return path if path.is_file() else None


def _reusable(path: Path, root: TrustRoot) -> bool:
    """Whether an earlier run's bundle is there and still verifies (else it is rebuilt in its place)."""
    if not path.is_file():
        return False
    try:
        verify_bundle(path, root=root)
    except VerificationError:
        return False
    return True


def _build_runtime_and_model(
    media: Path,
    key: Any,
    model_src: Path,
    runtime_version: str,
    model_version: str,
    wheel: Path | None,
    *,
    runtime: bool,
    model: bool,
) -> None:
    from envex.runtime.loader import EMBEDDED_MODEL

    if runtime:
        build_demo_runtime(media, key, runtime_version, wheel)
    if model:
        built = build_bundle(
            model_src,
            kind="model",
            name=EMBEDDED_MODEL,
            version=model_version,
            out=media / BUNDLES_DIR,
            requires=[{"name": RUNTIME_BUNDLE, "kind": "runtime", "version": ">=0.1.0"}],
            force=True,  # replaces only a bundle that no longer verifies (_reusable)
        )
        sign_bundle(built, [key])


def build_demo_runtime(media: Path, key: Any, runtime_version: str, wheel: Path | None) -> None:
    """The demo runtime bundle (the envex wheel alone, `wheelhouse: demo`), signed with `key`, into media/bundles/;
    also what the lab's GPU installs of other models put beside their model bundles."""
    with tempfile.TemporaryDirectory(prefix="envex-demo-") as tmp:
        runtime_src = Path(tmp) / "runtime"
        wheelhouse = runtime_src / WHEELHOUSE
        wheelhouse.mkdir(parents=True)
        if wheel is not None:
            shutil.copyfile(wheel, wheelhouse / wheel.name)
            built = wheelhouse / wheel.name
        else:
            built = build_envex_wheel(wheelhouse)
        envex_version = built.name.split("-")[1]
        card = RuntimeCard(wheelhouse="demo", install=["envex"], envex_version=envex_version)
        (runtime_src / RUNTIME_CARD).write_text(card.model_dump_json(indent=2) + "\n")
        runtime = build_bundle(
            runtime_src,
            kind="runtime",
            name=RUNTIME_BUNDLE,
            version=runtime_version,
            out=media / BUNDLES_DIR,
            targets={"accelerators": [], "min_driver": None, "python": ">=3.11", "torch": None, "triton": None},
            force=True,  # replaces only a bundle that no longer verifies (_reusable)
        )
        sign_bundle(runtime, [key])
