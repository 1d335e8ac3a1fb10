"""What the admin page can change, through the installer's own functions (the ones `envex activate|rollback` run).

Activation and rollback call `installer.activate.change_release`, the function `envex rollback|activate` run.
Re-verification runs `bundles.verify_bundle` against the pinned trust root.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from envex.bundles import VerificationError, load_root, verify_bundle
from envex.installer.activate import change_release as installer_change_release
from envex.installer.fsutil import LockHeldError
from envex.installer.launch import KERNEL_CACHE
from envex.installer.media import InstallError, pinned_root_path
from envex.installer.release import release_dir
from envex.installer.state import BundleRef, StateError, load_state, now_ts

# Where an installed bundle's payload lives inside a release slot (installer/release.py build_release).
SLOT_DIRS = {"model": "model", "runtime": "runtime", "kernels": KERNEL_CACHE}


class ActionError(RuntimeError):
    """An action was refused or failed; the message is one line for the operator."""


@dataclass(frozen=True)
class ChangeResult:
    active: str
    message: str


def change_release(
    prefix: Path, change: Literal["activate", "rollback"], release_id: str | None = None
) -> ChangeResult:
    """Activate `release_id`, or roll back to the release before the active one; the CLI's own steps.

    For a rollback, `release_id` (when given) is the target the operator confirmed: if the releases changed
    since, and the rollback would now go elsewhere, nothing is changed.
    """
    if change == "activate" and not release_id:
        raise ActionError("activate: no release was chosen; pick one on the releases page")
    try:
        state = installer_change_release(prefix, change, release_id)
    except (LockHeldError, InstallError, StateError) as exc:
        raise ActionError(str(exc)) from None
    assert state.active is not None
    return ChangeResult(
        active=state.active,
        message=f"{state.active} is active; restart the server to serve it (systemctl restart envex)",
    )


@dataclass(frozen=True)
class Verification:
    """The outcome of one re-verification of an installed bundle."""

    name: str
    manifest_sha256: str
    ok: bool
    at: str
    detail: str  # for people: what was checked, or the one check that failed
    path: str | None = None
    signer_keyids: tuple[str, ...] = ()
    sigstore_identity: str | None = None


def _candidates(ref: BundleRef, bundle_dirs: tuple[Path, ...]) -> list[Path]:
    # <prefix>/bundles keeps each installed bundle under its manifest digest (pipeline.keep_bundle_files): the
    # very file installed, first; then the media's <name>-<version>.envex; then anything else.
    named = [d / f"{ref.manifest_sha256}.envex" for d in bundle_dirs]
    named += [d / f"{ref.name}-{ref.version}.envex" for d in bundle_dirs]
    others = [p for d in bundle_dirs if d.is_dir() for p in sorted(d.glob("*.envex")) if p not in named]
    return [p for p in named if p.is_file()] + others


def _installed_copy_problems(prefix: Path, ref: BundleRef, files: list[tuple[str, int, str]]) -> list[str]:
    """Each release slot holding this bundle, re-hashed against the verified manifest's files."""
    problems: list[str] = []
    state = load_state(prefix)
    sub = SLOT_DIRS[ref.kind]
    for release in state.releases:
        if not any(b.manifest_sha256 == ref.manifest_sha256 for b in release.bundles):
            continue
        slot = release_dir(prefix, release.id) / sub
        if not slot.is_dir():
            continue  # pruned or failed slots hold nothing to check
        for rel, size, sha in files:
            path = slot / rel
            try:
                digest = hashlib.sha256()
                with open(path, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        digest.update(chunk)
            except OSError as exc:
                problems.append(f"{release.id}/{sub}/{rel}: {exc.strerror}")
                continue
            if path.stat().st_size != size or digest.hexdigest() != sha:
                problems.append(f"{release.id}/{sub}/{rel} differs from the signed manifest")
    return problems


def reverify_bundle(prefix: Path, ref: BundleRef, bundle_dirs: tuple[Path, ...]) -> Verification:
    """Run verify_bundle on the bundle file of `ref` against the pinned root, then re-hash the installed copies.

    The file is looked for in `bundle_dirs` (the media, or wherever the operator keeps the bundles); it must be
    the very manifest that was installed (same sha256). Never raises for a verification failure: the result
    says which check failed.
    """

    def result(ok: bool, detail: str, **extra: object) -> Verification:
        return Verification(
            name=ref.name,
            manifest_sha256=ref.manifest_sha256,
            ok=ok,
            at=now_ts(),
            detail=detail,
            **extra,  # type: ignore[arg-type]
        )

    state = load_state(prefix)
    if state.trust is None:
        return result(False, "no trust root is pinned in this prefix; nothing can be verified")
    try:
        root = load_root(pinned_root_path(prefix), fingerprint=state.trust.root_fingerprint)
    except (VerificationError, ValueError) as exc:
        return result(False, f"the pinned trust root no longer verifies: {exc}")
    candidates = _candidates(ref, bundle_dirs)
    if not candidates:
        where = ", ".join(str(d) for d in bundle_dirs) or "no bundle directory configured"
        return result(
            False,
            f"bundle file {ref.name}-{ref.version}.envex not found ({where}); start the admin "
            "page with --bundles DIR pointing at the install media's bundles/",
        )
    last_error = None
    own = {f"{ref.manifest_sha256}.envex", f"{ref.name}-{ref.version}.envex"}  # the names this bundle is kept under
    for path in candidates:
        try:
            verified = verify_bundle(path, root=root)
        except VerificationError as exc:
            if path.name in own:
                last_error = f"{path}: [{exc.check.value}] {exc.message}"
            continue
        if verified.manifest_sha256 != ref.manifest_sha256:
            if path.name in own:
                last_error = (
                    f"{path}: verifies, but is not the installed manifest (sha256 {verified.manifest_sha256[:16]}…)"
                )
            continue
        files = [(f.path, f.size, f.sha256) for f in verified.manifest.files]
        problems = _installed_copy_problems(prefix, ref, files)
        identity = None
        if verified.sigstore_identity is not None:
            identity = f"{verified.sigstore_identity[1]} ({verified.sigstore_identity[0]})"
        extra = {"path": str(path), "signer_keyids": verified.signer_keyids, "sigstore_identity": identity}
        if problems:
            return result(False, f"signature ok, but the installed copy changed: {'; '.join(problems[:3])}", **extra)
        return result(
            True,
            f"signatures, manifest and {len(files)} payload digests verified against root v{verified.root_version}; "
            "installed copies match",
            **extra,
        )
    return result(False, last_error or f"no bundle file found holds the installed manifest {ref.manifest_sha256[:16]}…")
