"""`envex bundle ...` and `envex verify bundle`: thin typer commands over the bundles API.

Exit codes: 0 success (verified), 1 verification failed (one line on stderr naming the check), 2 usage or bad
input (a missing file, an invalid option value).
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, cast

import typer
from pydantic import ValidationError

from envex.bundles.archive import MAX_METADATA_BYTES, SIGSTORE
from envex.bundles.build import BuildError, build_bundle, sign_bundle
from envex.bundles.errors import VerificationError
from envex.bundles.files import (
    FileProblem,
    from_os_error,
    one_line,
    read_regular_file,
    require_directory,
    require_exists,
    show,
    write_file,
)
from envex.bundles.keys import generate_key, key_id, load_private_key, load_public_key, write_key_files
from envex.bundles.layout import BUNDLES_DIR, ROOT_FILE, TRUST_DIR
from envex.bundles.manifest import Kind, Requirement, Targets, first_error
from envex.bundles.trust import MAX_KEYS, load_root, make_root, sign_root
from envex.bundles.verify import verify_bundle

EXIT_FAILED = 1
EXIT_USAGE = 2

bundle_app = typer.Typer(help="Build, sign and inspect signed bundles.", no_args_is_help=True, add_completion=False)
verify_app = typer.Typer(help="Verify things offline.", no_args_is_help=True, add_completion=False)


class KindChoice(StrEnum):
    model = "model"
    runtime = "runtime"
    kernels = "kernels"


# The longest lifetime a bundle or a root may be given: far beyond any sane expiry, far below datetime's range.
MAX_EXPIRES_DAYS = 36500


def _usage(message: str) -> NoReturn:
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(EXIT_USAGE)


def _failed(exc: VerificationError) -> NoReturn:
    typer.echo(f"verification failed [{exc.check.value}]: {one_line(exc.message)}", err=True)
    raise typer.Exit(EXIT_FAILED)


def _existing(path: Path, what: str) -> Path:
    """`path` when something is there; else one line (missing, a symlink loop, a path too long, ...), exit 2."""
    try:
        return require_exists(path, what=what)
    except FileProblem as exc:
        _usage(str(exc))


@bundle_app.command("keygen")
def keygen(
    out: Annotated[Path, typer.Option("--out", help="Directory for NAME.key (0600) and NAME.pub.json.")],
    name: Annotated[str, typer.Option("--name", help="File name stem for the key pair.")] = "envex",
) -> None:
    """Generate an Ed25519 key pair; print its key id."""
    key = generate_key()
    try:
        private_path, public_path = write_key_files(key, out, name)
    except (ValueError, OSError) as exc:  # ValueError: a name that is not a plain file name stem
        _usage(str(exc))
    typer.echo(f"key id:  {key_id(key)}")
    typer.echo(f"private: {show(private_path)}  (mode 0600: keep it offline)")
    typer.echo(f"public:  {show(public_path)}")


def _parse_requirement(text: str) -> Requirement:
    parts = text.split(":", 2)
    if len(parts) != 3:
        _usage(f"--requires {text!r}: expected NAME:KIND:CONSTRAINTS, e.g. envex-runtime:runtime:>=0.1.0,<0.2.0")
    try:
        return Requirement(name=parts[0], kind=parts[1], version=parts[2])  # type: ignore[arg-type]
    except ValidationError as exc:
        _usage(f"--requires {text!r}: {first_error(exc)}")


@bundle_app.command("build")
def build(
    ctx: typer.Context,
    kind: Annotated[KindChoice, typer.Option("--kind", help="What the bundle holds.")],
    name: Annotated[str, typer.Option("--name", help="Bundle name, e.g. smollm2-135m-instruct.")],
    version: Annotated[str, typer.Option("--version", help="Semantic version, e.g. 1.0.0.")],
    out: Annotated[Path, typer.Option("--out", help="Bundle file, or a directory for NAME-VERSION.envex.")],
    accelerator: Annotated[
        list[str] | None, typer.Option("--accelerator", help="Target architecture (repeatable), e.g. sm_90.")
    ] = None,
    min_driver: Annotated[str | None, typer.Option("--min-driver", help="Minimum driver, e.g. 535.104.05.")] = None,
    python: Annotated[str | None, typer.Option("--python", help="Python specifier, e.g. '>=3.11,<3.13'.")] = None,
    torch: Annotated[str | None, typer.Option("--torch", help="torch specifier, e.g. '==2.5.1'.")] = None,
    triton: Annotated[str | None, typer.Option("--triton", help="triton specifier, e.g. '==3.1.0'.")] = None,
    src: Annotated[Path | None, typer.Option("--src", help="Directory whose files become the payload.")] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Kernels only, instead of --src: run the engine's warm-up for this model (a model bundle's source "
            "directory with envex-model.json, a .gguf file or an HF directory) on this machine's GPU and bundle the "
            "Triton cache it compiled, keyed to this GPU, driver, python, torch, triton, CUDA and kernel sources.",
        ),
    ] = None,
    cuda: Annotated[str | None, typer.Option("--cuda", help="CUDA specifier (kernels), e.g. '==13.0'.")] = None,
    kernel_sources: Annotated[
        str | None, typer.Option("--kernel-sources", help="Kernel-source digest (kernels), sha256 hex.")
    ] = None,
    requires: Annotated[
        list[str] | None, typer.Option("--requires", help="Needed bundle NAME:KIND:CONSTRAINTS (repeatable).")
    ] = None,
    expires_days: Annotated[
        int, typer.Option("--expires-days", min=1, max=MAX_EXPIRES_DAYS, help="Lifetime in days.")
    ] = 365,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing bundle file at --out.")] = False,
) -> None:
    """Build an unsigned bundle from a directory, or a kernels bundle from a model's warm-up (sign it next with
    `envex bundle sign`)."""
    if (src is None) == (model is None):
        _usage("give --src DIR, or --model M for a kernels bundle compiled on this GPU (not both)")
    given = {"accelerators": list(accelerator or []), "min_driver": min_driver, "python": python, "torch": torch,
             "triton": triton, "cuda": cuda, "kernel_sources": kernel_sources}
    with tempfile.TemporaryDirectory(prefix="envex-bundle-") as tmp:
        if model is not None:
            src, keyed = _kernels_from_model(ctx, kind, model, Path(tmp) / "payload", min_driver)
            given = {**keyed, **{k: v for k, v in given.items() if v not in (None, [])}}  # the options win
        assert src is not None
        if kind is KindChoice.model:
            _check_model_source(ctx, src)
        _build(src, kind, name, version, out, given, requires, expires_days, force)


KERNELS_FROM_MODEL = "kernels_from_model"  # key of the typer context object: (model, dest, min_driver) -> targets


def _kernels_from_model(
    ctx: typer.Context, kind: KindChoice, model: str, dest: Path, min_driver: str | None
) -> tuple[Path, dict[str, Any]]:
    # Compiling needs the engine, which this package may not import: the envex command passes the function in
    # (installer/commands.py), as the context object.
    if kind is not KindChoice.kernels:
        _usage(f"--model builds a kernels bundle, not a {kind.value} bundle; give --src for that")
    stage = (ctx.obj or {}).get(KERNELS_FROM_MODEL) if isinstance(ctx.obj, dict) else None
    if stage is None:
        _usage("--model needs the engine: run `envex bundle build` from a full envex install on the GPU machine")
    try:
        return dest, stage(model, dest, min_driver)
    except (ValueError, OSError, RuntimeError) as exc:
        typer.echo(f"error: --model {model}: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from None


MODEL_CARD_CHECK = "model_card_check"  # key of the typer context object: (src) -> None, ValueError when refused


def _check_model_source(ctx: typer.Context, src: Path) -> None:
    # The model card (envex-model.json) is the installer's format, which this package may not import: the envex
    # command passes its check in (installer/commands.py), as the context object. Without it (bundles used on its
    # own) the card is not checked here; the installer still refuses a bad one, at plan time.
    check = (ctx.obj or {}).get(MODEL_CARD_CHECK) if isinstance(ctx.obj, dict) else None
    if check is None:
        return
    try:
        require_directory(src, what="--src")
    except FileProblem as exc:
        _usage(str(exc))
    try:
        check(src)
    except ValueError as exc:
        _usage(str(exc))


def _build(
    src: Path,
    kind: KindChoice,
    name: str,
    version: str,
    out: Path,
    given: dict[str, Any],
    requires: list[str] | None,
    expires_days: int,
    force: bool,
) -> None:
    try:
        require_directory(src, what="--src")
    except FileProblem as exc:
        _usage(str(exc))
    reqs = [_parse_requirement(r) for r in requires or []]
    created = datetime.now(UTC)
    try:
        targets = Targets.model_validate(given)
        path = build_bundle(
            src,
            kind=cast(Kind, kind.value),
            name=name,
            version=version,
            out=out,
            targets=targets,
            requires=reqs,
            created=created,
            expires=created + timedelta(days=expires_days),
            force=force,
        )
    except ValidationError as exc:
        _usage(first_error(exc))
    except (BuildError, OSError) as exc:
        _usage(str(exc))
    typer.echo(f"built {show(path)} (unsigned)")


@bundle_app.command("sign")
def sign(
    file: Annotated[Path, typer.Argument(help="The bundle to sign.")],
    key: Annotated[list[Path], typer.Option("--key", help="Private key file (repeatable for several keys).")],
    sigstore_bundle: Annotated[
        Path | None, typer.Option("--sigstore-bundle", help="Attach this sigstore bundle over manifest.json.")
    ] = None,
) -> None:
    """Add Ed25519 signatures over the bundle's manifest (others' signatures are kept)."""
    _existing(file, "bundle")
    try:
        keys = [load_private_key(_existing(k, "key")) for k in key]
        sigstore = (
            read_regular_file(sigstore_bundle, max_bytes=MAX_METADATA_BYTES[SIGSTORE], what="sigstore bundle")
            if sigstore_bundle
            else None
        )
    except (ValueError, OSError) as exc:
        _usage(str(exc))
    try:
        keyids = sign_bundle(file, keys, sigstore_bundle=sigstore)
    except VerificationError as exc:
        _failed(exc)
    except OSError as exc:
        _usage(str(from_os_error("bundle", file, exc)))
    for k in keyids:
        typer.echo(f"signed {show(file)} with key {k}")


@bundle_app.command("make-root")
def make_root_command(
    out: Annotated[Path, typer.Option("--out", help="Where to write root.json.")],
    root_key: Annotated[list[Path], typer.Option("--root-key", help="Public (or private) key of the root role.")],
    bundle_key: Annotated[list[Path], typer.Option("--bundle-key", help="Public key of the bundles role.")],
    sign_key: Annotated[list[Path], typer.Option("--sign", help="Private key to sign the root with (repeatable).")],
    root_threshold: Annotated[int, typer.Option("--root-threshold", min=1, max=MAX_KEYS)] = 1,
    bundle_threshold: Annotated[int, typer.Option("--bundle-threshold", min=1, max=MAX_KEYS)] = 1,
    version: Annotated[int, typer.Option("--version", min=1, max=2**53)] = 1,
    expires_days: Annotated[int, typer.Option("--expires-days", min=1, max=MAX_EXPIRES_DAYS)] = 365,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file at --out.")] = False,
) -> None:
    """Write a signed trust root (no sigstore policy; use the Python API for that); print its fingerprint."""
    try:
        root_keys = [load_public_key(_existing(p, "key")) for p in root_key]
        bundle_keys = [load_public_key(_existing(p, "key")) for p in bundle_key]
        signers = [load_private_key(_existing(p, "key")) for p in sign_key]
        signed = make_root(
            root_keys=root_keys,
            bundle_keys=bundle_keys,
            root_threshold=root_threshold,
            bundle_threshold=bundle_threshold,
            version=version,
            expires=datetime.now(UTC) + timedelta(days=expires_days),
        )
    except ValidationError as exc:
        _usage(first_error(exc))
    except (ValueError, OSError) as exc:
        _usage(str(exc))
    root = sign_root(signed, signers)
    try:
        write_file(out, root.to_bytes(), what="trust root", replace=force)
    except OSError as exc:
        _usage(str(from_os_error("trust root", out, exc)))
    typer.echo(f"wrote {show(out)}: root version {version}, fingerprint {root.fingerprint}")
    try:
        load_root(root)
    except VerificationError as exc:  # allowed: other holders sign next (sign_root in Python)
        typer.echo(f"note: not yet a loadable root: {exc.message}", err=True)


def root_candidates(bundle: Path) -> list[Path]:
    """Where `envex verify bundle` looks for a trust root when --trust is not given, in order: root.json beside the
    bundle, then, for a bundle in a media's `bundles/` folder, the media's `trust/root.json` (bundles/layout.py)."""
    candidates = [bundle.parent / ROOT_FILE]
    if bundle.absolute().parent.name == BUNDLES_DIR:
        candidates.append(bundle.absolute().parent.parent / TRUST_DIR / ROOT_FILE)
    return candidates


def default_root(bundle: Path) -> Path:
    """The first of root_candidates(bundle) that exists; else one line naming where it looked, exit 2."""
    candidates = root_candidates(bundle)
    for path in candidates:
        if os.path.lexists(path):
            return path
    _usage(f"no trust root found for {show(bundle)}: looked for {' and '.join(show(p) for p in candidates)}; pass "
           "--trust ROOT (the media's trust/root.json, or the root published to you)")


@verify_app.command("bundle")
def verify_bundle_command(
    file: Annotated[Path, typer.Argument(help="The bundle (.envex) to verify.")],
    trust: Annotated[
        Path | None,
        typer.Option(
            "--trust",
            help="Trusted root.json (default: root.json beside the bundle, else the media's trust/root.json for a "
            "bundle in the media's bundles/ folder).",
        ),
    ] = None,
    fingerprint: Annotated[
        str | None, typer.Option("--fingerprint", help="Require the trust root to have this sha256 fingerprint.")
    ] = None,
    high_water: Annotated[
        str | None, typer.Option("--high-water", help="Refuse versions below this one (anti-rollback).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Verify a bundle offline; print what was verified, or the one check that failed (exit 1)."""
    _existing(file, "bundle")
    root_path = trust if trust is not None else default_root(file)
    _existing(root_path, "trust root")
    try:
        root = load_root(root_path, fingerprint=fingerprint)
    except ValueError as exc:  # a malformed --fingerprint
        _usage(str(exc))
    except VerificationError as exc:
        _failed(exc)
    try:
        verified = verify_bundle(file, root=root, high_water=high_water)
    except ValueError as exc:  # a malformed --high-water
        _usage(f"--high-water: {exc}")
    except VerificationError as exc:
        _failed(exc)
    if trust is None and fingerprint is None:  # after success, so that a failure stays one line on stderr
        typer.echo(
            f"warning: trust root {show(root_path)} was found beside the bundle or its media and is not pinned; "
            f"compare its fingerprint {root.fingerprint} with the published one, or pass --trust / --fingerprint",
            err=True,
        )
    summary = verified.summary()
    if as_json:
        typer.echo(json.dumps({"verified": True, **summary}, indent=2, sort_keys=True))
        return
    identity = verified.sigstore_identity
    lines = [
        f"verified {verified.name} {verified.version} ({verified.kind})",
        f"  files:      {verified.file_count} ({verified.total_bytes:,} bytes)",
        f"  manifest:   sha256 {verified.manifest_sha256}",
        f"  expires:    {verified.manifest.expires}",
        f"  signed by:  {', '.join(verified.signer_keyids)} (threshold {root.signed.roles.bundles.threshold})",
        f"  sigstore:   {f'{identity[1]} via {identity[0]}' if identity else 'none'}",
        f"  trust root: version {verified.root_version}, fingerprint {verified.root_fingerprint}",
    ]
    typer.echo("\n".join(lines))
