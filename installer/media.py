"""Step 1: read the media, settle the trust root (pin on first install, rotate later), verify every bundle.

Media layout (offline_docs/install.md): `install.sh`, `bundles/*.envex`, `trust/root.json` (the newest root;
older-to-newer rotation steps as `trust/root-<version>.json`), `offline_docs/`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from envex.bundles import Check, TrustRoot, VerificationError, VerifiedBundle, load_root, rotate_root, verify_bundle
from envex.bundles.archive import MANIFEST, BundleArchive
from envex.bundles.files import FileProblem, from_os_error, require_directory, show, stat_or_none
from envex.bundles.layout import BUNDLES_DIR, ROOT_FILE, TRUST_DIR  # the media layout, also imported from here
from envex.bundles.manifest import Manifest
from envex.installer.fsutil import atomic_write
from envex.installer.state import PinnedTrust, State, now_ts

_ROTATION_FILE = re.compile(r"root-(\d{1,9})\.json")
# Bundles read from one media: far more than any release needs (runtime, models, kernels per accelerator), few
# enough that a directory of junk cannot keep the installer verifying for hours.
MAX_MEDIA_BUNDLES = 1024


class InstallError(RuntimeError):
    """A step cannot go on; the message is one line for the operator (what, why, what to do)."""


@dataclass(frozen=True)
class TrustDecision:
    root: TrustRoot
    first_pin: bool
    rotated_from: int | None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class MediaScan:
    media: Path
    bundle_paths: tuple[Path, ...]
    root_path: Path


@dataclass(frozen=True)
class Downgrade:
    """A bundle on the media refused because it is older than the prefix's high-water mark for its name."""

    path: Path
    kind: str
    name: str
    version: str
    high_water: str

    def __str__(self) -> str:
        return (
            f"{self.path.name}: {self.kind} bundle {self.name} {self.version} is older than version "
            f"{self.high_water}, the highest already accepted; downgrades are refused"
        )


@dataclass(frozen=True)
class Verified:
    bundles: tuple[VerifiedBundle, ...]
    refused: tuple[Downgrade, ...] = field(default=())  # downgrades below the high-water mark, skipped

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(str(d) for d in self.refused)


def scan_media(media: Path) -> MediaScan:
    """The media's trust root and bundle files, after checking they are there; reads no bundle yet."""
    media = Path(media)
    try:
        require_directory(media, what="--media")
    except FileProblem as exc:
        raise InstallError(f"{exc}; mount the install media and give its path") from None
    root_path = media / TRUST_DIR / ROOT_FILE
    try:
        info = stat_or_none(root_path, what="trust root")
    except FileProblem as exc:
        raise InstallError(str(exc)) from None
    if info is None:
        raise InstallError(
            f"{show(root_path)}: missing; the media must carry the trust root (see offline_docs/install.md)"
        )
    bundle_dir = media / BUNDLES_DIR
    paths: list[Path] = []
    try:
        if stat_or_none(bundle_dir, what="bundle directory") is not None:
            require_directory(bundle_dir, what="bundle directory")
            with os.scandir(bundle_dir) as entries:
                for entry in entries:
                    if entry.name.endswith(".envex") and not entry.name.startswith("."):
                        paths.append(Path(entry.path))
                        if len(paths) > MAX_MEDIA_BUNDLES:
                            raise InstallError(
                                f"{show(bundle_dir)}: more than {MAX_MEDIA_BUNDLES} *.envex files; is this the "
                                "right media?"
                            )
    except OSError as exc:
        raise InstallError(str(from_os_error("bundle directory", bundle_dir, exc))) from None
    if not paths:
        raise InstallError(f"{show(bundle_dir)}: no *.envex bundles; is this the right media?")
    return MediaScan(media=media, bundle_paths=tuple(sorted(paths)), root_path=root_path)


def pinned_root_path(prefix: Path) -> Path:
    return Path(prefix) / TRUST_DIR / ROOT_FILE


def settle_trust(
    scan: MediaScan,
    state: State,
    prefix: Path,
    *,
    trust_fingerprint: str | None,
    confirm: Callable[[str], bool] | None,
) -> TrustDecision:
    """The root to verify with. First install: the media's root, once its fingerprint is confirmed. Later: the
    pinned root, moved forward through each rotation step the media carries (never backward)."""
    try:
        offered = load_root(scan.root_path)
    except VerificationError as exc:
        raise InstallError(f"trust root on the media is not valid: {exc}") from None
    if state.trust is None:
        if trust_fingerprint is not None:
            try:
                load_root(offered, fingerprint=trust_fingerprint)
            except (VerificationError, ValueError) as exc:
                raise InstallError(f"--trust-fingerprint: {exc}") from None
        elif confirm is None or not confirm(offered.fingerprint):
            raise InstallError(
                f"first install: the media's trust root has fingerprint {offered.fingerprint}; compare it with the "
                "one published to you out of band, then run again with --trust-fingerprint <that fingerprint>"
            )
        return TrustDecision(root=offered, first_pin=True, rotated_from=None)
    try:
        pinned = load_root(pinned_root_path(prefix), fingerprint=state.trust.root_fingerprint)
    except VerificationError as exc:
        raise InstallError(f"the pinned trust root no longer verifies: {exc}; restore {prefix}/trust") from None
    if offered.version < pinned.version:
        note = f"the media's root is version {offered.version}, older than the pinned {pinned.version}; kept the pinned"
        return TrustDecision(root=pinned, first_pin=False, rotated_from=None, notes=(note,))
    if offered.version == pinned.version:
        if offered.fingerprint != pinned.fingerprint:
            raise InstallError(
                f"the media's trust root version {offered.version} differs from the pinned root of the same version "
                f"({offered.fingerprint[:16]}… vs {pinned.fingerprint[:16]}…); refusing it: the media may be forged"
            )
        return TrustDecision(root=pinned, first_pin=False, rotated_from=None)
    steps = _rotation_steps(scan, offered)
    current = pinned
    for version in range(pinned.version + 1, offered.version + 1):
        step = steps.get(version)
        if step is None:
            raise InstallError(
                f"trust root rotation from version {pinned.version} to {offered.version}: the media lacks "
                f"{TRUST_DIR}/root-{version}.json; add every intermediate root"
            )
        try:
            current = rotate_root(current, step)
        except VerificationError as exc:
            raise InstallError(f"trust root rotation refused: {exc}") from None
    return TrustDecision(root=current, first_pin=False, rotated_from=pinned.version)


def _rotation_steps(scan: MediaScan, newest: TrustRoot) -> dict[int, TrustRoot]:
    steps: dict[int, TrustRoot] = {newest.version: newest}
    for path in scan.root_path.parent.iterdir():
        match = _ROTATION_FILE.fullmatch(path.name)
        if match is None:
            continue
        try:
            root = load_root(path)
        except VerificationError as exc:
            raise InstallError(f"{path}: not a valid trust root: {exc}") from None
        if root.version != int(match.group(1)):
            raise InstallError(f"{path}: holds root version {root.version}, not {match.group(1)}")
        steps.setdefault(root.version, root)
    return steps


def pin_trust(prefix: Path, state: State, decision: TrustDecision) -> State:
    """Write the root in use to `<prefix>/trust/root.json` and record it; unchanged roots are not rewritten."""
    root = decision.root
    if state.trust is not None and state.trust.root_fingerprint == root.fingerprint:
        return state
    trust_dir = Path(prefix) / TRUST_DIR
    trust_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(trust_dir / ROOT_FILE, root.to_bytes())
    event = "pin-root" if decision.first_pin else "rotate-root"
    pinned = PinnedTrust(root_version=root.version, root_fingerprint=root.fingerprint, pinned_at=now_ts())
    return state.model_copy(update={"trust": pinned}).with_event(event, detail=f"version {root.version}")


def verify_all(
    scan: MediaScan, root: TrustRoot, state: State, *, on_bundle: Callable[[Path], None] | None = None
) -> Verified:
    """Verify every bundle on the media. Any failure stops the install, except a downgrade below the high-water
    mark, which is refused and skipped (media may carry older versions beside the new)."""
    verified: list[VerifiedBundle] = []
    refused: list[Downgrade] = []
    for path in scan.bundle_paths:
        if on_bundle is not None:
            on_bundle(path)
        try:
            # The high-water mark is looked up by the signed manifest's name, never the file's.
            bundle = verify_bundle(path, root=root, high_water=state.high_water)
        except VerificationError as exc:
            if exc.check is Check.ROLLBACK:
                refused.append(_downgrade(path, state))
                continue
            raise InstallError(
                f"bundle {show(path)} failed verification [{exc.check.value}]: {exc.message}; nothing was installed"
            ) from None
        verified.append(bundle)
    return Verified(bundles=tuple(verified), refused=tuple(refused))


def _downgrade(path: Path, state: State) -> Downgrade:
    """What a bundle refused as a downgrade is. verify_bundle checked its signatures before the version, so its
    manifest is the signed one (read again here for the message only)."""
    try:
        with BundleArchive.open(path) as archive:
            data = archive.read_metadata(MANIFEST)
        manifest = Manifest.from_bytes(data or b"")
        mark = state.high_water[manifest.name]
    except (VerificationError, ValueError, KeyError):
        raise InstallError(f"bundle {show(path)} changed while it was being verified; check the media") from None
    return Downgrade(path, manifest.kind, manifest.name, manifest.version, mark)
