"""Offline bundle verification: `verify_bundle` returns a `VerifiedBundle` or raises one `VerificationError`.

Steps, in order; the first that fails names the error's check:

0. The trust root is current (root_expired).
1. The archive is a plain tar whose every header is safe: regular files only, safe names, no duplicates, nothing
   past the end of the file, a proper end (malformed_archive, unsafe_path, link_member, special_member,
   duplicate_member, unknown_file).
2. manifest.json and signatures.json are present and small enough (missing_file, size).
3. A threshold of distinct keys of the root's `bundles` role signed manifest.json's exact bytes; nothing of the
   manifest is interpreted before this (signature, threshold, untrusted_key, revoked_key).
4. The manifest is valid and canonical (manifest).
5. It has not expired (expired) and is not older than the caller's high-water mark (rollback).
6. A sigstore bundle, where present or required, verifies offline against the pinned sigstore root and an
   accepted identity (missing_file, sigstore, identity).
7. The payload members are exactly the manifest's files, with the manifest's sizes (unknown_file, missing_file,
   size).
8. Each payload file's streamed sha256 equals the manifest's (digest).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from envex.bundles.archive import CHUNK, MANIFEST, SIGNATURES, SIGSTORE, BundleArchive, Member
from envex.bundles.build import SignaturesDocument
from envex.bundles.errors import Check, VerificationError
from envex.bundles.files import fsync_dir
from envex.bundles.manifest import FileEntry, Manifest, SemVer
from envex.bundles.trust import TrustRoot, check_signatures, load_root

# Extraction keeps this much free beyond the payload, so that filling the disk never breaks the running release.
DISK_HEADROOM = 256 * 1024 * 1024
_TOKEN = object()


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle that passed every check. Only `verify_bundle` makes one; only a VerifiedBundle is installed."""

    path: Path
    manifest: Manifest
    manifest_sha256: str
    signer_keyids: tuple[str, ...]
    sigstore_identity: tuple[str, str] | None  # (issuer, subject) when a sigstore bundle verified
    root_version: int
    root_fingerprint: str
    _token: object = field(repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self._token is not _TOKEN:
            raise TypeError("VerifiedBundle is made only by verify_bundle()")

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def kind(self) -> str:
        return self.manifest.kind

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def file_count(self) -> int:
        return len(self.manifest.files)

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_size

    def summary(self) -> dict[str, object]:
        """What was verified, as plain JSON-able data (the CLI prints it)."""
        return {
            "path": str(self.path),
            "name": self.name,
            "kind": self.kind,
            "version": self.version,
            "created": self.manifest.created,
            "expires": self.manifest.expires,
            "manifest_sha256": self.manifest_sha256,
            "signer_keyids": list(self.signer_keyids),
            "sigstore_identity": (
                None
                if self.sigstore_identity is None
                else {"issuer": self.sigstore_identity[0], "subject": self.sigstore_identity[1]}
            ),
            "file_count": self.file_count,
            "total_bytes": self.total_bytes,
            "root_version": self.root_version,
            "root_fingerprint": self.root_fingerprint,
        }

    def read_file(self, path: str, *, max_bytes: int = 16 * 1024 * 1024) -> bytes:
        """One small payload file (a config, a card), read into memory and re-checked against the manifest.

        Raises `VerificationError`: missing_file if the manifest does not list `path`, size if it is over
        `max_bytes` or its member changed size, digest if its bytes changed since verification.
        """
        entry = next((f for f in self.manifest.files if f.path == path), None)
        if entry is None:
            raise VerificationError(f"{self.path}: the manifest lists no payload/{path}", check=Check.MISSING_FILE)
        if entry.size > max_bytes:
            raise VerificationError(
                f"{self.path}: payload/{path} is {entry.size} bytes, over the {max_bytes} bytes read into memory",
                check=Check.SIZE,
            )
        with BundleArchive.open(self.path) as archive:
            member = _unchanged_member(self.path, archive.payload_members(), entry)
            data = b"".join(bytes(chunk) for chunk in archive.stream(member))
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise VerificationError(f"{self.path}: payload/{path} changed since verification", check=Check.DIGEST)
        return data

    def extract(self, dest: Path | str, *, durable: bool = True) -> Path:
        """Write the payload into `dest`, a directory that must not exist yet; returns `dest`.

        Free space is checked against the manifest before anything is written. Files go into a fresh sibling
        directory, each re-hashed as it is copied (the bundle file may have changed since it was verified), and
        the directory is renamed to `dest` only when all are complete (and, with `durable`, fsynced). On any
        failure nothing is left behind. Raises `VerificationError` (destination, disk_space, digest, ...).
        """
        dest = Path(dest)
        parent = dest.parent
        if dest.exists() or dest.is_symlink():
            raise VerificationError(f"{dest} already exists; extract into a new directory", check=Check.DESTINATION)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(parent).free
        except OSError as exc:
            raise VerificationError(f"{parent}: {exc.strerror}", check=Check.DESTINATION) from None
        need = self.total_bytes + DISK_HEADROOM
        if free < need:
            raise VerificationError(
                f"{parent} has {free} bytes free; the payload needs {self.total_bytes} plus {DISK_HEADROOM} headroom",
                check=Check.DISK_SPACE,
            )
        staging = parent / f".{dest.name}.partial-{secrets.token_hex(6)}"
        try:
            os.mkdir(staging, 0o755)
        except OSError as exc:
            raise VerificationError(f"{staging}: {exc.strerror}", check=Check.DESTINATION) from None
        try:
            with BundleArchive.open(self.path) as archive:
                members = archive.payload_members()
                buffer = bytearray(CHUNK)
                for entry in self.manifest.files:
                    member = _unchanged_member(self.path, members, entry)
                    _write_checked(archive, member, staging / entry.path, entry.sha256, buffer, durable)
            if durable:
                _fsync_tree(staging)
            os.rename(staging, dest)
            if durable:
                fsync_dir(parent)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return dest


def _unchanged_member(path: Path, members: dict[str, Member], entry: FileEntry) -> Member:
    """The member for a verified manifest entry, still there at the verified size (the media may have changed)."""
    member = members.get(entry.path)
    if member is None or member.size != entry.size:
        raise VerificationError(f"{path}: payload/{entry.path} changed since verification", check=Check.SIZE)
    return member


def _write_checked(
    archive: BundleArchive, member: Member, target: Path, sha256: str, buffer: bytearray, durable: bool
) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL | O_NOFOLLOW: the staging directory is ours and fresh; nothing in it may pre-exist or be a link.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    digest = hashlib.sha256()
    with os.fdopen(fd, "wb", buffering=0) as out:
        for chunk in archive.stream(member, buffer):
            digest.update(chunk)
            out.write(chunk)
        if durable:
            os.fsync(out.fileno())
    if digest.hexdigest() != sha256:
        raise VerificationError(
            f"{archive.path}: {member.name} changed since verification (sha256 differs)", check=Check.DIGEST
        )


def _fsync_tree(root: Path) -> None:
    for directory, _dirs, _files in os.walk(root):
        fsync_dir(Path(directory))


def verify_bundle(
    path: Path | str,
    *,
    root: TrustRoot | Path | str | bytes,
    high_water: str | SemVer | Mapping[str, str | SemVer] | None = None,
    now: datetime | None = None,
) -> VerifiedBundle:
    """Verify the bundle at `path` against the trust root, fully offline; see the module docstring for the steps.

    `root` is a loaded `TrustRoot` (or a root.json to load). `high_water` is the highest version of this bundle
    ever accepted (anti-rollback: a lower version fails; the same version passes, for reinstalls), or a mapping
    from bundle name to that version, looked up by the signed manifest's name (a name not in it has none). `now`
    defaults to the current time. Returns a `VerifiedBundle`; raises `VerificationError` naming the failed check
    (and ValueError only for a caller's mistake: a `high_water` that is not a semantic version, a naive `now`).
    """
    path = Path(path)
    now = now or datetime.now(UTC)
    if now.tzinfo is None:
        raise ValueError("verify_bundle: `now` must be timezone-aware (e.g. datetime.now(UTC))")
    trust = root if isinstance(root, TrustRoot) else load_root(root)
    # (0) the trust root in use must be current.
    trust.check_current(now)
    # (1) every header is safe, before any data is read.
    with BundleArchive.open(path) as archive:
        # (2) the metadata is present and bounded.
        manifest_bytes = archive.read_metadata(MANIFEST)
        if manifest_bytes is None:
            raise VerificationError(f"{path}: manifest.json is missing", check=Check.MISSING_FILE)
        signatures_bytes = archive.read_metadata(SIGNATURES)
        if signatures_bytes is None:
            raise VerificationError(f"{path}: signatures.json is missing", check=Check.MISSING_FILE)
        # (3) signatures over the exact bytes, before the manifest is interpreted.
        try:
            signatures = SignaturesDocument.from_bytes(signatures_bytes).signatures
        except ValueError as exc:
            raise VerificationError(f"{path}: {exc}", check=Check.SIGNATURE) from None
        signed = trust.signed
        signers = check_signatures(
            data=manifest_bytes,
            signatures=[(s.keyid, s.sig) for s in signatures],
            role=signed.roles.bundles,
            keys=signed.keys,
            revoked=signed.revoked_keyids,
            what=f"{path}: manifest.json",
        )
        # (4) only now parse what the signers vouched for.
        try:
            manifest = Manifest.from_bytes(manifest_bytes)
        except ValueError as exc:
            raise VerificationError(f"{path}: {exc}", check=Check.MANIFEST) from None
        label = f"{manifest.name} {manifest.version}"
        # (5) freshness and anti-rollback.
        if manifest.expires_at <= now:
            raise VerificationError(f"{label} expired at {manifest.expires}", check=Check.EXPIRED)
        mark = high_water.get(manifest.name) if isinstance(high_water, Mapping) else high_water
        if mark is not None:
            floor = mark if isinstance(mark, SemVer) else SemVer.parse(mark)
            if manifest.semver < floor:
                raise VerificationError(
                    f"{label} is older than version {floor}, the highest already accepted; downgrades are refused",
                    check=Check.ROLLBACK,
                )
        # (6) sigstore, offline against the pinned root.
        sigstore_identity = _check_sigstore(archive, path, manifest_bytes, trust)
        # (7) the members are exactly the manifest's files, at the manifest's sizes.
        members = archive.payload_members()
        listed = {f.path: f for f in manifest.files}
        for rel in members:
            if rel not in listed:
                raise VerificationError(
                    f"{path}: payload/{rel} is not listed in the manifest", check=Check.UNKNOWN_FILE
                )
        for entry in manifest.files:
            member = members.get(entry.path)
            if member is None:
                raise VerificationError(
                    f"{path}: payload/{entry.path} is listed in the manifest but missing", check=Check.MISSING_FILE
                )
            if member.size != entry.size:
                raise VerificationError(
                    f"{path}: payload/{entry.path} is {member.size} bytes; the manifest says {entry.size}",
                    check=Check.SIZE,
                )
        # (8) digests, streamed through one buffer.
        buffer = bytearray(CHUNK)
        for entry in manifest.files:
            if archive.sha256(members[entry.path], buffer) != entry.sha256:
                raise VerificationError(
                    f"{path}: digest of payload/{entry.path} does not match the manifest", check=Check.DIGEST
                )
    return VerifiedBundle(
        path=path,
        manifest=manifest,
        manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
        signer_keyids=tuple(signers),
        sigstore_identity=sigstore_identity,
        root_version=trust.version,
        root_fingerprint=trust.fingerprint,
        _token=_TOKEN,
    )


def _check_sigstore(
    archive: BundleArchive, path: Path, manifest_bytes: bytes, trust: TrustRoot
) -> tuple[str, str] | None:
    policy = trust.signed.sigstore
    sigstore_bytes = archive.read_metadata(SIGSTORE)
    if sigstore_bytes is None:
        if policy is not None and policy.required:
            raise VerificationError(
                f"{path}: the trust root requires a sigstore signature and {SIGSTORE} is missing",
                check=Check.MISSING_FILE,
            )
        return None
    if policy is None:
        # Fail closed: a signature we were asked to check but cannot is not silently ignored.
        raise VerificationError(
            f"{path}: carries {SIGSTORE} but the trust root pins no sigstore trusted root or identities",
            check=Check.SIGSTORE,
        )
    from envex.bundles.sigstore_check import verify_sigstore

    result = verify_sigstore(sigstore_bytes, manifest_bytes, policy)
    return (result.issuer, result.subject)
