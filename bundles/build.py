"""Building and signing bundles.

`build_bundle` writes the payload, manifest and an empty signatures.json in one pass over the source directory
(hashing while copying, so a many-GB model is read once). `sign_bundle` adds Ed25519 signatures (several holders
may sign in turn, up to the trust root's threshold) and optionally attaches a sigstore bundle; it rewrites only
the trailing metadata members.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envex.bundles.archive import (
    CHUNK,
    MANIFEST,
    PAYLOAD_PREFIX,
    SIGNATURES,
    SIGSTORE,
    BundleArchive,
    end_of_archive,
    header_bytes,
    member_info,
    padding,
    rewrite_trailing,
    write_member,
)
from envex.bundles.canonical import CanonicalJSONError, canonical_bytes, parse_json
from envex.bundles.errors import Check, VerificationError
from envex.bundles.files import (
    FileProblem,
    check_target,
    commit_file,
    from_os_error,
    kind_of,
    one_line,
    require_directory,
    show,
    stat_or_none,
    temp_beside,
)
from envex.bundles.keys import key_id, sign
from envex.bundles.manifest import (
    MAX_FILES,
    SCHEMA_VERSION,
    FileEntry,
    Kind,
    Manifest,
    Requirement,
    Targets,
    first_error,
    format_timestamp,
    unsafe_path_reason,
)
from envex.bundles.trust import Signature

DEFAULT_LIFETIME = timedelta(days=365)


class BuildError(ValueError):
    """The source cannot become a bundle (a link, a special file, an unsafe name, a file changing under us)."""


class SignaturesDocument(BaseModel):
    """signatures.json: Ed25519 signatures over manifest.json's exact bytes, one per key id."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    signatures: list[Signature] = Field(max_length=1024)

    def to_bytes(self) -> bytes:
        return canonical_bytes(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, data: bytes) -> SignaturesDocument:
        """Parse signatures.json; ValueError when it is not a valid signatures document."""
        try:
            return cls.model_validate(parse_json(data, require_canonical=False))
        except CanonicalJSONError as exc:
            raise ValueError(f"signatures.json: {exc}") from None
        except ValidationError as exc:
            raise ValueError(f"signatures.json: {first_error(exc)}") from None


def bundle_file_name(name: str, version: str) -> str:
    return f"{name}-{version}.envex"


def _source_files(src: Path) -> list[tuple[str, Path]]:
    """Every regular file under `src` as (posix relative path, path), sorted; anything else is refused."""
    try:
        require_directory(src, what="source directory")
    except FileProblem as exc:
        raise BuildError(str(exc)) from None

    def unreadable(exc: OSError) -> None:  # os.walk would skip an unreadable directory silently
        raise BuildError(str(from_os_error("source directory", exc.filename or src, exc)))

    found: list[tuple[str, Path]] = []
    for directory, dirnames, filenames in os.walk(src, onerror=unreadable, followlinks=False):
        for entry in [*dirnames, *filenames]:
            path = Path(directory) / entry
            rel = path.relative_to(src).as_posix()
            try:
                mode = os.lstat(path).st_mode
            except OSError as exc:
                raise BuildError(str(from_os_error("source file", path, exc))) from None
            if stat.S_ISLNK(mode):
                raise BuildError(f"{show(path)} is a symlink; bundles hold regular files only (copy its target in)")
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise BuildError(f"{show(path)} is {kind_of(mode)}, not a regular file; bundles hold only those")
            reason = unsafe_path_reason(rel)
            if reason is not None:
                raise BuildError(f"{show(path)}: cannot be a bundle path: {one_line(reason)}")
            found.append((rel, path))
    if len(found) > MAX_FILES:
        raise BuildError(f"{show(src)} holds {len(found)} files, more than the {MAX_FILES} a bundle may")
    return sorted(found)


def _copy_hashing(source: Path, out: BinaryIO, buffer: bytearray) -> tuple[int, str]:
    digest = hashlib.sha256()
    view = memoryview(buffer)
    total = 0
    # O_NONBLOCK | O_NOFOLLOW and a fresh fstat: a file swapped for a FIFO or a link since the walk is refused.
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BuildError(f"{show(source)} stopped being a regular file while it was being bundled")
    with os.fdopen(fd, "rb", buffering=0) as handle:
        while True:
            got = handle.readinto(buffer)
            if not got:
                break
            chunk = view[:got]
            digest.update(chunk)
            out.write(chunk)
            total += got
    return total, digest.hexdigest()


def build_bundle(
    src: Path | str,
    *,
    kind: Kind,
    name: str,
    version: str,
    out: Path | str,
    targets: Targets | dict[str, Any] | None = None,
    requires: Iterable[Requirement | dict[str, Any]] = (),
    created: datetime | None = None,
    expires: datetime | None = None,
    force: bool = False,
) -> Path:
    """Build an unsigned bundle of every file under `src`; returns the bundle's path.

    `out` is the bundle file, or a directory to hold `<name>-<version>.envex`. The file appears only when
    complete (written beside it, then renamed). An existing bundle is replaced only with `force`; a device, FIFO,
    socket or symlink at `out` never is. Raises `BuildError` for sources that cannot be bundled and targets that
    cannot be written, and `pydantic.ValidationError` for invalid metadata (name, version, targets, requirements).
    """
    src = Path(src)
    created = (created or datetime.now(UTC)).replace(microsecond=0)
    expires = expires or created + DEFAULT_LIFETIME
    if targets is None:
        targets = Targets(accelerators=[], min_driver=None, python=None, torch=None, triton=None)
    elif isinstance(targets, dict):
        targets = Targets.model_validate(targets)
    reqs = [r if isinstance(r, Requirement) else Requirement.model_validate(r) for r in requires]

    def manifest_of(files: list[FileEntry]) -> Manifest:
        return Manifest(
            schema_version=SCHEMA_VERSION,
            name=name,
            kind=kind,
            version=version,
            created=format_timestamp(created),
            expires=format_timestamp(expires),
            targets=targets,
            requires=reqs,
            files=files,
        )

    # Validate the metadata before reading gigabytes: a manifest with no files yet must already be valid.
    manifest_of([])
    out = Path(out)
    try:
        info = stat_or_none(out, what="--out")
        if info is not None and stat.S_ISDIR(info.st_mode):
            out = out / bundle_file_name(name, version)
        check_target(out, what="bundle", replace=force)  # before reading gigabytes
        files = _source_files(src)
        fd, tmp = temp_beside(out, what="bundle")
    except FileProblem as exc:
        raise BuildError(str(exc)) from None
    mtime = int(created.timestamp())
    entries: list[FileEntry] = []
    buffer = bytearray(CHUNK)
    try:
        with os.fdopen(fd, "wb") as handle:
            for rel, path in files:
                size = os.stat(path).st_size
                handle.write(header_bytes(member_info(PAYLOAD_PREFIX + rel, size, mtime)))
                written, sha = _copy_hashing(path, handle, buffer)
                if written != size:
                    raise BuildError(
                        f"{show(path)} changed size while it was being bundled ({size} then {written} bytes)"
                    )
                handle.write(padding(size))
                entries.append(FileEntry(path=rel, size=size, sha256=sha))
            manifest = manifest_of(entries)
            write_member(handle, MANIFEST, manifest.to_bytes(), mtime)
            write_member(handle, SIGNATURES, SignaturesDocument(signatures=[]).to_bytes(), mtime)
            handle.write(end_of_archive())
            handle.flush()
            os.fchmod(handle.fileno(), 0o644)
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        commit_file(tmp, out, what="bundle", replace=force)
    except FileProblem as exc:
        raise BuildError(str(exc)) from None
    return out


def sign_bundle(
    path: Path | str,
    keys: Sequence[Ed25519PrivateKey] = (),
    *,
    sigstore_bundle: bytes | None = None,
) -> list[str]:
    """Add each key's signature over manifest.json (and optionally attach a sigstore bundle); returns key ids.

    Signatures already present from other keys are kept, so holders of a threshold of keys can sign in turn.
    The manifest must be a valid manifest: nothing else is ever signed.
    """
    path = Path(path)
    with BundleArchive.open(path) as archive:
        manifest_bytes = archive.read_metadata(MANIFEST)
        signatures_bytes = archive.read_metadata(SIGNATURES)
        existing_sigstore = archive.read_metadata(SIGSTORE)
    if manifest_bytes is None:
        raise VerificationError(f"{path}: no manifest.json", check=Check.MISSING_FILE)
    try:
        manifest = Manifest.from_bytes(manifest_bytes)
    except ValueError as exc:
        raise VerificationError(f"{path}: {exc}", check=Check.MANIFEST) from None
    try:
        existing = SignaturesDocument.from_bytes(signatures_bytes).signatures if signatures_bytes else []
    except ValueError as exc:
        raise VerificationError(f"{path}: {exc}", check=Check.SIGNATURE) from None
    by_keyid = {s.keyid: s for s in existing}
    for key in keys:
        by_keyid[key_id(key)] = Signature(keyid=key_id(key), sig=sign(key, manifest_bytes))
    trailing = {SIGNATURES: SignaturesDocument(signatures=[by_keyid[k] for k in sorted(by_keyid)]).to_bytes()}
    sigstore = sigstore_bundle if sigstore_bundle is not None else existing_sigstore
    if sigstore is not None:
        trailing[SIGSTORE] = sigstore
    rewrite_trailing(path, trailing, int(manifest.created_at.timestamp()))
    return [key_id(k) for k in keys]
