"""`envex media build`: signed install media for a model, made on a connected build host with one command.

What it writes (offline_docs/install.md, "Making install media for your model"):

    MEDIA/install.sh                      the bootstrap the operator runs
    MEDIA/bundles/envex-runtime-V.envex   envex and every wheel it needs on the TARGET python and platform
    MEDIA/bundles/NAME-V.envex            the model's files, the card written here from them, and the gates'
                                          reference answers computed here (envex-references.json)
    MEDIA/bundles/*.envex                 kernel bundles given with --kernels (signed here too)
    MEDIA/trust/root.json                 the trust root whose fingerprint the operator confirms
    MEDIA/offline_docs/                   these docs

Steps, in order, so that nothing is signed for a model that cannot be installed: (1) the model's files are read
and checked and its card written (installer/model_card.py); (2) the keys are loaded and the trust root settled;
(3) the gates' reference answers are computed by HF transformers in float32 on this host (--reference-device), or
taken from a file computed elsewhere (--reference-from, checked against these files' digest), or left out
(--no-references; envex.verify.signed_reference); (4) the wheelhouse is resolved by pip for the target (`pip
download --only-binary=:all: --python-version X --platform P`), not for this host; (5) bundles are built and
signed; (6) the media, built in a hidden sibling of --out, is renamed into place. On any failure the sibling is
removed and --out is as it was.

Keys (KEYDIR, as `envex bundle keygen` writes them: NAME.key, NAME.pub.json): with a `root.json` in KEYDIR (made by
`envex bundle make-root`, thresholds as bundles.md describes) that root is the media's, and the bundles are signed
by every KEYDIR private key in its `bundles` role, which must reach its threshold. Without one, a root naming every
KEYDIR key in both roles, threshold 1, is made and written to KEYDIR/root.json, so the next build (and the
appliance that pinned it) meets the same root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from envex.bundles import (
    TrustRoot,
    VerificationError,
    build_bundle,
    key_id,
    load_private_key,
    load_public_key,
    load_root,
    make_root,
    sign_bundle,
    sign_root,
)
from envex.bundles.archive import MANIFEST, BundleArchive
from envex.bundles.files import show
from envex.bundles.manifest import Manifest
from envex.installer.cards import MODEL_CARD, RUNTIME_CARD, TORCH_VERSION, WHEELHOUSE, RuntimeCard
from envex.installer.demo import INSTALL_SH, RUNTIME_BUNDLE, build_envex_wheel
from envex.installer.media import BUNDLES_DIR, ROOT_FILE, TRUST_DIR, InstallError
from envex.installer.model_card import card_for_model
from envex.verify.references_file import (
    REFERENCES_FILE,
    ReferencesError,
    ReferencesFile,
    folder_digest,
    is_own_file,
    load_references,
    references_bytes,
)
from envex.verify.signed_reference import record_references

CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# What the appliance's gates need beyond envex's own dependencies: transformers loads the HF reference of a GGUF
# model only with accelerate (the first CPU install from a complete wheelhouse failed its gates without it).
GATE_REQUIREMENTS = ("accelerate>=0.30",)
TorchVariant = Literal["cpu", "cu130"]
ROOT_LIFETIME = timedelta(days=365)
_NAME = re.compile(r"[^a-z0-9._-]+")
_MANYLINUX = re.compile(r"manylinux_2_(\d+)_(\w+)")
Step = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """The machine the media installs on: its Python, its wheel platform, and which torch build it runs."""

    python: str = "3.12"
    platform: str = "manylinux_2_28_x86_64"
    torch: TorchVariant = "cu130"
    torch_version: str = TORCH_VERSION

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d{1,2}", self.python):
            raise InstallError(f"--target-python {self.python!r}: give MAJOR.MINOR, e.g. 3.12")
        if self.torch not in ("cpu", "cu130"):
            raise InstallError(f"--torch {self.torch!r}: give cpu or cu130")

    @property
    def torch_requirement(self) -> str:
        return f"torch=={self.torch_version}+cpu" if self.torch == "cpu" else f"torch=={self.torch_version}"

    @property
    def python_specifier(self) -> str:
        major, minor = self.python.split(".")
        return f">={major}.{minor},<{major}.{int(minor) + 1}"

    def platforms(self) -> list[str]:
        """The wheel platform tags a machine of `platform` accepts: pip takes only the tags it is given, so a
        manylinux_2_28 target lists every older glibc too (a manylinux2014 wheel installs on it)."""
        match = _MANYLINUX.fullmatch(self.platform)
        if match is None:
            return [self.platform]
        glibc, arch = int(match.group(1)), match.group(2)
        tags = [f"manylinux_2_{m}_{arch}" for m in range(glibc, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{arch}" for m, name in legacy.items() if m <= glibc]


@dataclass(frozen=True)
class PipSource:
    """Where pip finds wheels: an index (PyPI by default) and/or local folders; `no_index`: the folders only."""

    find_links: tuple[Path, ...] = ()
    no_index: bool = False
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()

    def args(self) -> list[str]:
        # --no-index: the folders given and nothing else, so pip's own configuration (a find-links or constraints
        # file in pip.conf or PIP_* variables) cannot add or hold back wheels either.
        out: list[str] = ["--isolated"] if self.no_index else []
        for folder in self.find_links:
            out += ["--find-links", str(folder)]
        if self.no_index:
            out.append("--no-index")
        if self.index_url:
            out += ["--index-url", self.index_url]
        for url in self.extra_index_urls:
            out += ["--extra-index-url", url]
        return out

    def describe(self) -> str:
        where = [show(f) for f in self.find_links]
        if not self.no_index:
            where += [self.index_url or "the configured index (PyPI)", *self.extra_index_urls]
        return ", ".join(where)


@dataclass(frozen=True)
class MediaRequest:
    model: Path
    out: Path
    keys: Path
    name: str | None = None
    version: str = "1.0.0"
    runtime_version: str = "0.1.0"
    target: Target = field(default_factory=Target)
    source: PipSource = field(default_factory=PipSource)
    kernels: tuple[Path, ...] = ()
    envex_wheel: Path | None = None  # default: built from this source tree
    force: bool = False
    references: bool = True  # the gates' reference answers in the model bundle (--no-references: False)
    reference_from: Path | None = None  # computed elsewhere (`envex media references`); default: computed here
    reference_suites: tuple[str, ...] = ("quick",)
    reference_device: str = "cpu"


@dataclass(frozen=True)
class BuiltMedia:
    media: Path
    fingerprint: str
    bundles: tuple[Path, ...]
    wheels: int
    root_written_to_keys: bool
    references: str | None = None  # "the quick suite (cpu-float32-torch)", or None: built without them


@dataclass(frozen=True)
class Signers:
    root: TrustRoot
    keys: tuple[Any, ...]  # Ed25519 private keys of the bundles role held in KEYDIR
    root_written: bool


def build_media(request: MediaRequest, step: Step | None = None) -> BuiltMedia:
    """Write signed install media for `request.model` at `request.out`; InstallError (one line) on any refusal."""
    step = step or (lambda _what: None)
    out = request.out
    _check_out(out, request.force)
    for kernel in request.kernels:
        _check_kernels(kernel)
    step("reading the model's files")
    name = request.name or default_name(request.model)
    card = card_for_model(request.model, name)
    step("loading the keys")
    signers = load_signers(request.keys)
    refs = reference_answers(request, card.defaults.max_model_len, card.max_position_embeddings, step)
    parent = out.absolute().parent
    if not parent.is_dir():
        raise InstallError(f"--out {show(out)}: its folder {show(parent)} does not exist; create it first")
    with _staging(parent, out.name) as stage:
        bundles_dir = stage / BUNDLES_DIR
        bundles_dir.mkdir()
        (stage / TRUST_DIR).mkdir()
        work = stage / ".work"
        step("building the runtime wheelhouse")
        runtime_src = work / "runtime"
        wheels = build_wheelhouse(runtime_src / WHEELHOUSE, request.target, request.source, request.envex_wheel,
                                  on_line=step)  # fmt: skip
        envex_version = next(w.name.split("-")[1] for w in wheels if w.name.startswith("envex-"))
        rcard = RuntimeCard(wheelhouse="complete", install=[f"envex=={envex_version}", *GATE_REQUIREMENTS],
                            envex_version=envex_version,
                            python=request.target.python_specifier)  # fmt: skip
        (runtime_src / RUNTIME_CARD).write_text(rcard.model_dump_json(indent=2) + "\n")
        step("bundling the runtime")
        runtime = build_bundle(
            runtime_src, kind="runtime", name=RUNTIME_BUNDLE, version=request.runtime_version, out=bundles_dir,
            targets={"accelerators": [], "min_driver": None, "python": request.target.python_specifier,
                     "torch": None, "triton": None},
        )  # fmt: skip
        step("bundling the model")
        model_src = work / "model"
        _stage_model(request.model, model_src)
        (model_src / MODEL_CARD).write_text(json.dumps(card.model_dump(), indent=2) + "\n")
        if refs is not None:
            (model_src / REFERENCES_FILE).write_bytes(references_bytes(refs))
        model = build_bundle(
            model_src, kind="model", name=name, version=request.version, out=bundles_dir,
            requires=[{"name": RUNTIME_BUNDLE, "kind": "runtime", "version": f">={request.runtime_version}"}],
        )  # fmt: skip
        shutil.rmtree(work)
        built = [runtime, model]
        for kernel in request.kernels:
            copy = bundles_dir / kernel.name
            shutil.copyfile(kernel, copy)
            built.append(copy)
        step("signing")
        for bundle in built:
            sign_bundle(bundle, list(signers.keys))
        (stage / TRUST_DIR / ROOT_FILE).write_bytes(signers.root.to_bytes())
        shutil.copyfile(INSTALL_SH, stage / "install.sh")
        (stage / "install.sh").chmod(0o755)
        docs = Path(__file__).resolve().parent.parent / "offline_docs"
        if docs.is_dir():
            shutil.copytree(docs, stage / "offline_docs", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        _commit(stage, out)
    return BuiltMedia(
        media=out,
        fingerprint=signers.root.fingerprint,
        bundles=tuple(out / BUNDLES_DIR / b.name for b in built),
        wheels=len(wheels),
        root_written_to_keys=signers.root_written,
        references=(f"the {'/'.join(refs.suites)} suite ({refs.reference_policy})" if refs is not None else None),
    )


def reference_answers(request: MediaRequest, max_model_len: int, window: int,
                      step: Step) -> ReferencesFile | None:  # fmt: skip
    """The gates' reference answers for the model bundle (module docstring, step 3), or None without them."""
    if not request.references:
        return None
    if request.reference_from is not None:
        try:
            return load_references(request.reference_from, digest=folder_digest(request.model))
        except ReferencesError as exc:
            raise InstallError(f"--reference-from {exc}") from None
    step("computing the reference answers")
    return compute_references(request.model, request.reference_suites, request.reference_device,
                              min(max_model_len, window), step)  # fmt: skip


def compute_references(model: Path, suites: Sequence[str], device: str, max_model_len: int,
                       step: Step | None = None) -> ReferencesFile:  # fmt: skip
    """HF transformers' answers to the gates of `suites` for the model at `model` (a .gguf file or an HF folder)."""
    from envex.runtime.loader import resolve_model

    unknown = [suite for suite in suites if suite not in ("quick", "full")]
    if unknown or not suites:
        raise InstallError(f"--reference-suite {unknown[0] if unknown else '(none)'}: use quick or full")
    if device not in ("cpu", "cuda"):
        raise InstallError(f"--reference-device {device!r}: use cpu or cuda")
    try:
        return record_references(resolve_model(str(model)), suites=suites, max_model_len=max_model_len,
                                 digest=folder_digest(model), device=device, progress=step)  # fmt: skip
    except Exception as exc:  # the reference cannot run here: say so, and how to go on
        raise InstallError(
            f"reference answers: HF transformers could not compute them on this host ({type(exc).__name__}: "
            f"{exc}); compute them where it can (`envex media references --model ... --out RUN.json`) and give "
            "--reference-from RUN.json, or build without them (--no-references)"
        ) from None


def default_name(model: Path) -> str:
    """A bundle name from the model's file or folder name (`SmolLM2-135M.Q4_1.gguf` -> `smollm2-135m.q4_1`)."""
    stem = model.name[: -len(".gguf")] if model.name.endswith(".gguf") else model.name
    name = _NAME.sub("-", stem.lower()).strip("-._")[:64]
    if not name:
        raise InstallError(f"--model {show(model)}: cannot make a bundle name from it; give --name")
    return name


def _check_out(out: Path, force: bool) -> None:
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise InstallError(f"--out {show(out)}: exists and is not a folder; give a new folder for the media")
    if any(out.iterdir()) and not force:
        raise InstallError(f"--out {show(out)}: already holds files; give --force to replace it, or another --out")


def _check_kernels(path: Path) -> None:
    try:
        with BundleArchive.open(path) as archive:
            manifest = Manifest.from_bytes(archive.read_metadata(MANIFEST) or b"")
    except (VerificationError, ValueError, OSError) as exc:
        raise InstallError(f"--kernels {show(path)}: not a readable bundle ({exc}); build it again") from None
    if manifest.kind != "kernels":
        raise InstallError(f"--kernels {show(path)}: a {manifest.kind} bundle, not a kernels bundle")


def load_signers(keys_dir: Path) -> Signers:
    """The root and the bundle-signing keys of KEYDIR (module docstring)."""
    if not keys_dir.is_dir():
        raise InstallError(f"--keys {show(keys_dir)}: not a folder; give the folder `envex bundle keygen --out` wrote")
    key_files = sorted(keys_dir.glob("*.key"))
    try:
        private = [load_private_key(p) for p in key_files]
    except (ValueError, OSError) as exc:
        raise InstallError(f"--keys {show(keys_dir)}: {exc}") from None
    if not private:
        raise InstallError(f"--keys {show(keys_dir)}: no *.key files; make one with `envex bundle keygen --out DIR`")
    root_path = keys_dir / ROOT_FILE
    if not root_path.is_file():
        publics = sorted({key_id(k): k for k in private}.items())
        unsigned = make_root(root_keys=[k.public_key() for _, k in publics],
                             bundle_keys=[k.public_key() for _, k in publics],
                             expires=datetime.now(UTC) + ROOT_LIFETIME)  # fmt: skip
        root = load_root(sign_root(unsigned, [k for _, k in publics]))
        root_path.write_bytes(root.to_bytes())
        return Signers(root=root, keys=tuple(k for _, k in publics), root_written=True)
    try:
        root = load_root(root_path)
    except VerificationError as exc:
        raise InstallError(f"{show(root_path)}: not a valid trust root: {exc.message}") from None
    if root.expires_at <= datetime.now(UTC):
        raise InstallError(f"{show(root_path)}: trust root version {root.version} expired at {root.signed.expires}; "
                           "make a newer one with `envex bundle make-root --version N+1`")  # fmt: skip
    role = root.signed.roles.bundles
    held = {key_id(k): k for k in private if key_id(k) in role.keyids}
    if len(held) < role.threshold:
        raise InstallError(
            f"{show(root_path)}: its bundles role needs {role.threshold} signatures but {show(keys_dir)} holds the "
            f"private keys of {len(held)} of its keys; add the holders' .key files (or sign later with `envex bundle "
            "sign`)"
        )
    for pub in sorted(keys_dir.glob("*.pub.json")):  # a stray public key is fine; a bad one is worth a word
        load_public_key(pub)
    return Signers(root=root, keys=tuple(held[k] for k in sorted(held)), root_written=False)


def pip_download_command(dest: Path, requirements: Sequence[str], target: Target, source: PipSource) -> list[str]:
    """pip's own resolver, for the target's python and platform (not this host's): wheels only."""
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", target.python, "--implementation", "cp", "-d", str(dest)]  # fmt: skip
    for tag in target.platforms():
        cmd += ["--platform", tag]
    return [*cmd, *source.args(), *requirements]


def build_wheelhouse(
    dest: Path,
    target: Target,
    source: PipSource,
    envex_wheel: Path | None = None,
    *,
    on_line: Step | None = None,
) -> list[Path]:
    """Every wheel envex needs on `target`, in `dest`: the envex wheel (built from this source tree unless given)
    and what pip resolves from its dependencies, the target's torch and what the gates need (GATE_REQUIREMENTS).
    A wheel missing for the target is named in one InstallError."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="envex-wheel-") as tmp:
        if envex_wheel is None:
            wheel = build_envex_wheel(Path(tmp))
        else:
            if not envex_wheel.is_file() or not envex_wheel.name.startswith("envex-"):
                raise InstallError(f"--envex-wheel {show(envex_wheel)}: not an envex-*.whl file")
            wheel = envex_wheel
        requirements = [str(wheel.resolve()), target.torch_requirement, *GATE_REQUIREMENTS]
        cmd = pip_download_command(dest, requirements, target, source)
        lines = _run_streaming(cmd, on_line)
    if lines[0] != 0:
        raise InstallError(_pip_failure(lines[1], target, source))
    wheels = sorted(dest.glob("*.whl"))
    if not any(w.name.startswith("envex-") for w in wheels):
        raise InstallError(f"pip download left no envex wheel in {show(dest)}; run again")
    _check_torch_variant(wheels, target)
    return wheels


def _check_torch_variant(wheels: list[Path], target: Target) -> None:
    """`torch==2.11.0` also matches `2.11.0+cpu` (PEP 440 ignores local labels), which pip prefers where an index
    holds both: the build chosen is checked by its wheel's name."""
    found = [w.name for w in wheels if w.name.startswith("torch-")]
    if not found:
        return  # a torch requirement pip resolved always leaves a wheel; nothing else to check
    cpu = "+cpu" in found[0].split("-")[1]
    if cpu != (target.torch == "cpu"):
        raise InstallError(
            f"--torch {target.torch}: pip resolved {found[0]}, "
            f"{'a CPU build' if cpu else 'not the CPU build'}; give an index or --find-links folder that holds the "
            f"{target.torch} build of torch {target.torch_version}"
        )


def _run_streaming(cmd: list[str], on_line: Step | None) -> tuple[int, list[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.strip()
        if line:
            seen.append(line)
            if on_line is not None and line.startswith(("Collecting", "Saved", "Downloading", "Processing")):
                on_line(line)
    return proc.wait(), seen


def _pip_failure(lines: list[str], target: Target, source: PipSource) -> str:
    where = f"python {target.python} on {target.platform}"
    missing = [m.group(1) for line in lines
               if (m := re.search(r"(?:No matching distribution found for|satisfies the requirement) (\S+)", line))]
    missing += [lines[i + 1].split()[0] for i, line in enumerate(lines[:-1])
                if "no matching distributions available for your environment" in line]  # fmt: skip
    if missing:
        name = target.torch_requirement if missing[0] == "torch" else missing[0]
        hint = (f" (the CPU torch lives on {CPU_TORCH_INDEX}: give --extra-index-url {CPU_TORCH_INDEX})"
                if name.startswith("torch") and target.torch == "cpu" else "")  # fmt: skip
        return (f"no wheel of {name} for {where} in {source.describe()}{hint}; put one in --find-links DIR, or "
                "pick another --target-python/--target-platform")  # fmt: skip
    errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["no output"]
    return f"pip could not resolve the wheelhouse for {where}: {errors[0]}"


def _stage_model(model: Path, dest: Path) -> None:
    """The model's files in `dest` as hard links where the filesystem allows (no copy of many GB), else copies."""
    dest.mkdir(parents=True)
    # Envex's own files (a card, reference answers) are written fresh, never linked: a write would reach the source.
    files = [model] if model.is_file() else sorted(p for p in model.iterdir()
                                                   if p.is_file() and not is_own_file(p.name))  # fmt: skip
    for path in files:
        try:  # resolved: an HF cache snapshot's files are symlinks to its blobs, and bundles hold regular files
            os.link(path.resolve(), dest / path.name)
        except OSError:
            shutil.copyfile(path.resolve(), dest / path.name)


@contextmanager
def _staging(parent: Path, name: str) -> Iterator[Path]:
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=parent))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _commit(stage: Path, out: Path) -> None:
    """Rename the finished media into place; an older media at `out` (--force) is moved aside first, then removed."""
    old = None
    if os.path.lexists(out):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.absolute().parent)) / "media"
        os.rename(out, old)
    stage.chmod(0o755)  # mkdtemp made it 0700: the media is read by whoever installs from it
    os.rename(stage, out)
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)
