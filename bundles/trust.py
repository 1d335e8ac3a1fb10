"""The trust root (`root.json`): TUF-shaped keys, roles and thresholds, rotation, revocation and fingerprint.

    {"signed": {"_type": "root", "spec_version": "1.0", "version": 1, "expires": "2027-01-01T00:00:00Z",
                "keys": {KEYID: {"keytype": "ed25519", "scheme": "ed25519", "keyval": {"public": HEX}}},
                "roles": {"root": {"keyids": [...], "threshold": 1}, "bundles": {"keyids": [...], "threshold": 1}},
                "revoked_keyids": [...],
                "sigstore": null | {"identities": [{"issuer": ..., "subject": ...}], "required": false,
                                    "trusted_root": {... sigstore trusted_root.json ...}}},
     "signatures": [{"keyid": KEYID, "sig": HEX}]}

Signatures cover the canonical JSON bytes of `signed`. A root is loaded only when a threshold of its own `root`
role has signed it; a new root replaces the current one only when it is the next version and a threshold of the
current root's `root` role has signed it too (TUF 5.3). The fingerprint the operator confirms on first install is
the sha256 of those canonical `signed` bytes, so re-signing never changes it and any change of meaning does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from envex.bundles.canonical import CanonicalJSONError, canonical_bytes, parse_json
from envex.bundles.errors import Check, VerificationError
from envex.bundles.files import read_regular_file, show, write_file
from envex.bundles.keys import key_id, public_key_from_hex, public_raw, sign, signature_valid
from envex.bundles.manifest import Timestamp, first_error, format_timestamp, parse_timestamp

MAX_ROOT_BYTES = 16 * 1024 * 1024
MAX_KEYS = 256

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")


def _hex(regex: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not regex.fullmatch(value):
            raise ValueError(f"{value[:80]!r} is not {what}")
        return value

    return AfterValidator(check)


KeyId = Annotated[str, _hex(_HEX64, "a key id (64 lowercase hex characters)")]
SignatureHex = Annotated[str, _hex(_HEX128, "an Ed25519 signature (128 lowercase hex characters)")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class KeyValue(_Strict):
    public: KeyId  # 32 bytes as hex: the same shape as a key id


class PublicKeyEntry(_Strict):
    keytype: Literal["ed25519"]
    scheme: Literal["ed25519"]
    keyval: KeyValue

    def public_key(self) -> Ed25519PublicKey:
        return public_key_from_hex(self.keyval.public)


class Role(_Strict):
    """Who may sign for a role: the key ids, and how many distinct ones must."""

    keyids: list[KeyId] = Field(min_length=1, max_length=MAX_KEYS)
    threshold: int = Field(ge=1, le=MAX_KEYS)

    @model_validator(mode="after")
    def _sane(self) -> Role:
        if len(set(self.keyids)) != len(self.keyids):
            raise ValueError("a role lists the same key id twice")
        if self.threshold > len(self.keyids):
            raise ValueError(f"threshold {self.threshold} is more than the role's {len(self.keyids)} keys")
        return self


class Roles(_Strict):
    root: Role
    bundles: Role


class SigstoreIdentity(_Strict):
    """One accepted signer: the OIDC issuer and the certificate subject (SAN: an email or a URI)."""

    issuer: str = Field(min_length=1, max_length=1024)
    subject: str = Field(min_length=1, max_length=1024)


class SigstorePolicy(_Strict):
    """Sigstore bundles accepted: the pinned trusted_root.json, the identities, and whether one is required."""

    identities: list[SigstoreIdentity] = Field(min_length=1, max_length=64)
    required: bool
    trusted_root: dict[str, Any]


class RootSigned(_Strict):
    """The signed part of root.json."""

    type: Literal["root"] = Field(alias="_type")
    spec_version: Literal["1.0"]
    version: int = Field(ge=1, le=2**53)
    expires: Timestamp
    keys: dict[KeyId, PublicKeyEntry] = Field(max_length=MAX_KEYS)
    roles: Roles
    revoked_keyids: list[KeyId] = Field(max_length=4096)
    sigstore: SigstorePolicy | None

    @model_validator(mode="after")
    def _consistent(self) -> RootSigned:
        for keyid, entry in self.keys.items():
            if key_id(entry.public_key()) != keyid:
                raise ValueError(f"key id {keyid[:16]}… is not the sha256 of its public key")
        revoked = set(self.revoked_keyids)
        for name, role in (("root", self.roles.root), ("bundles", self.roles.bundles)):
            for keyid in role.keyids:
                if keyid not in self.keys:
                    raise ValueError(f"role {name} names key {keyid[:16]}… that is not in keys")
                if keyid in revoked:
                    raise ValueError(f"role {name} names key {keyid[:16]}… that is revoked")
        return self

    def to_bytes(self) -> bytes:
        """The canonical bytes that root signatures cover."""
        return canonical_bytes(self.model_dump(mode="json", by_alias=True))


class Signature(_Strict):
    keyid: KeyId
    sig: SignatureHex


class RootDocument(_Strict):
    signed: RootSigned
    signatures: list[Signature] = Field(max_length=MAX_KEYS)


@dataclass(frozen=True)
class TrustRoot:
    """A parsed root.json that a threshold of its own root keys has signed. Build it with `load_root`."""

    document: RootDocument

    @property
    def signed(self) -> RootSigned:
        return self.document.signed

    @property
    def version(self) -> int:
        return self.document.signed.version

    @property
    def expires_at(self) -> datetime:
        return parse_timestamp(self.document.signed.expires)

    @property
    def fingerprint(self) -> str:
        return root_fingerprint(self)

    def to_bytes(self) -> bytes:
        """The whole document (signed part and signatures) as canonical JSON, as written to root.json."""
        return canonical_bytes(self.document.model_dump(mode="json", by_alias=True))

    def check_current(self, now: datetime) -> None:
        """Raise `root_expired` when the root's expiry has passed at `now`."""
        if self.expires_at <= now:
            raise VerificationError(
                f"trust root version {self.version} expired at {self.signed.expires}; install a newer root",
                check=Check.ROOT_EXPIRED,
            )


def root_fingerprint(root: TrustRoot | RootSigned) -> str:
    """The sha256 (hex) of the root's canonical signed bytes: what the operator confirms, as for an SSH host key."""
    signed = root.signed if isinstance(root, TrustRoot) else root
    return hashlib.sha256(signed.to_bytes()).hexdigest()


def normalize_fingerprint(text: str) -> str:
    """Accept a fingerprint typed with spaces, colons or an optional `sha256:` prefix; return 64 lowercase hex."""
    cleaned = text.strip().lower()
    if cleaned.startswith("sha256:"):
        cleaned = cleaned[len("sha256:") :]
    cleaned = re.sub(r"[\s:]", "", cleaned)
    if not _HEX64.fullmatch(cleaned):
        raise ValueError(f"{text!r} is not a sha256 fingerprint (64 hex characters)")
    return cleaned


def check_signatures(
    *,
    data: bytes,
    signatures: Iterable[tuple[str, str]],
    role: Role,
    keys: dict[str, PublicKeyEntry],
    revoked: Iterable[str],
    what: str,
) -> list[str]:
    """Count valid signatures over `data` by distinct keys of `role`; return their key ids or raise.

    TUF's rule: each key counts once, and signatures by keys outside the role are ignored when the threshold is
    met by the role's own keys. A signature by one of the role's keys that does not verify is never ignored:
    it means the data or the signature was altered.
    """
    revoked_set = set(revoked)
    role_keys = set(role.keyids)
    valid: list[str] = []
    invalid: list[str] = []
    revoked_seen: list[str] = []
    untrusted_seen: list[str] = []
    for keyid, sig in signatures:
        if keyid in revoked_set:
            revoked_seen.append(keyid)
        elif keyid not in role_keys:
            untrusted_seen.append(keyid)
        elif keyid in valid or keyid in invalid:
            continue  # the same key counts once
        elif signature_valid(keys[keyid].public_key(), sig, data):
            valid.append(keyid)
        else:
            invalid.append(keyid)
    if invalid:
        raise VerificationError(
            f"{what}: the signature by key {invalid[0][:16]}… does not verify; the signed bytes or the signature "
            "were altered",
            check=Check.SIGNATURE,
        )
    if len(valid) >= role.threshold:
        return sorted(valid)
    have = f"{len(valid)} of the {role.threshold} required signatures by distinct trusted keys"
    if revoked_seen:
        raise VerificationError(
            f"{what}: signed by revoked key {revoked_seen[0][:16]}…; {have}", check=Check.REVOKED_KEY
        )
    if untrusted_seen:
        raise VerificationError(
            f"{what}: signed by key {untrusted_seen[0][:16]}… that the trust root does not trust for this role; {have}",
            check=Check.UNTRUSTED_KEY,
        )
    raise VerificationError(f"{what}: threshold not met: {have}", check=Check.THRESHOLD)


def make_root(
    *,
    root_keys: Sequence[Ed25519PublicKey | Ed25519PrivateKey],
    bundle_keys: Sequence[Ed25519PublicKey | Ed25519PrivateKey],
    root_threshold: int = 1,
    bundle_threshold: int = 1,
    version: int = 1,
    expires: datetime,
    revoked_keyids: Iterable[str] = (),
    sigstore: SigstorePolicy | None = None,
) -> RootSigned:
    """The signed part of a new root. Sign it with `sign_root` (by the root keys; for a rotation, old ones too)."""
    entries: dict[str, Any] = {}
    for key in [*root_keys, *bundle_keys]:
        entries[key_id(key)] = {"keytype": "ed25519", "scheme": "ed25519", "keyval": {"public": public_raw(key).hex()}}
    value = {
        "_type": "root",
        "spec_version": "1.0",
        "version": version,
        "expires": format_timestamp(expires),
        "keys": dict(sorted(entries.items())),
        "roles": {
            "root": {"keyids": sorted({key_id(k) for k in root_keys}), "threshold": root_threshold},
            "bundles": {"keyids": sorted({key_id(k) for k in bundle_keys}), "threshold": bundle_threshold},
        },
        "revoked_keyids": sorted(set(revoked_keyids)),
        "sigstore": None if sigstore is None else sigstore.model_dump(mode="json"),
    }
    return RootSigned.model_validate(value)


def sign_root(root: RootSigned | TrustRoot, keys: Sequence[Ed25519PrivateKey]) -> TrustRoot:
    """Add signatures by `keys` to a root (unsigned, or partly signed by other holders); one per key id.

    The result is not checked against thresholds: several holders may sign in turn. `load_root` checks.
    """
    if isinstance(root, TrustRoot):
        signed, existing = root.signed, list(root.document.signatures)
    else:
        signed, existing = root, []
    data = signed.to_bytes()
    by_keyid = {s.keyid: s for s in existing}
    for key in keys:
        by_keyid[key_id(key)] = Signature(keyid=key_id(key), sig=sign(key, data))
    document = RootDocument(signed=signed, signatures=[by_keyid[k] for k in sorted(by_keyid)])
    return TrustRoot(document)


def _parse_root(data: bytes, where: str) -> RootDocument:
    if len(data) > MAX_ROOT_BYTES:
        raise VerificationError(f"{where}: larger than {MAX_ROOT_BYTES} bytes", check=Check.TRUST_ROOT)
    try:
        value = parse_json(data, require_canonical=False)
    except CanonicalJSONError as exc:
        raise VerificationError(f"{where}: {exc}", check=Check.TRUST_ROOT) from None
    try:
        return RootDocument.model_validate(value)
    except ValidationError as exc:
        raise VerificationError(f"{where}: {first_error(exc)}", check=Check.TRUST_ROOT) from None


def _self_check(document: RootDocument, where: str) -> TrustRoot:
    signed = document.signed
    check_signatures(
        data=signed.to_bytes(),
        signatures=[(s.keyid, s.sig) for s in document.signatures],
        role=signed.roles.root,
        keys=signed.keys,
        revoked=signed.revoked_keyids,
        what=f"{where} (root version {signed.version})",
    )
    return TrustRoot(document)


def load_root(source: Path | str | bytes | TrustRoot, *, fingerprint: str | None = None) -> TrustRoot:
    """Load root.json and check that a threshold of its own root keys signed it, and, if given, its fingerprint.

    This is how a root is first pinned: the operator compares `root_fingerprint` with the one published out of
    band. Expiry is checked when the root is used (`verify_bundle`), so that an expired root can still be rotated.
    Raises `VerificationError` (trust_root, signature, threshold, ..., root_fingerprint).
    """
    if isinstance(source, TrustRoot):
        root = _self_check(source.document, "trust root")
    else:
        if isinstance(source, bytes):
            where, data = "root.json", source
        else:
            where = show(source)
            try:
                data = read_regular_file(source, max_bytes=MAX_ROOT_BYTES, what="trust root")
            except OSError as exc:
                raise VerificationError(str(exc), check=Check.TRUST_ROOT) from None
        root = _self_check(_parse_root(data, where), where)
    if fingerprint is not None:
        want = normalize_fingerprint(fingerprint)
        if root.fingerprint != want:
            raise VerificationError(
                f"trust root fingerprint {root.fingerprint} is not the pinned {want}; do not trust this root",
                check=Check.ROOT_FINGERPRINT,
            )
    return root


def rotate_root(current: TrustRoot, new: Path | str | bytes | TrustRoot) -> TrustRoot:
    """Accept `new` in place of `current`: it must be version current+1 and signed by thresholds of both roots.

    Rotating through several versions means calling this once per version, in order (as TUF clients do). Expiry
    of the new root is not checked here: an intermediate root of a chain may have expired; `verify_bundle` checks
    the root in use. Keys the new root drops from its roles, or lists in `revoked_keyids`, stop verifying at once.
    """
    candidate = load_root(new)
    if candidate.version != current.version + 1:
        if candidate.version <= current.version:
            message = (
                f"root version {candidate.version} is not newer than the trusted version {current.version}; "
                "an old root is never accepted again"
            )
        else:
            message = (
                f"root version {candidate.version} skips versions after {current.version}; apply each root in order"
            )
        raise VerificationError(message, check=Check.ROOT_VERSION)
    check_signatures(
        data=candidate.signed.to_bytes(),
        signatures=[(s.keyid, s.sig) for s in candidate.document.signatures],
        role=current.signed.roles.root,
        keys=current.signed.keys,
        revoked=current.signed.revoked_keyids,
        what=f"root version {candidate.version}, by the keys of trusted root version {current.version}",
    )
    return candidate


@dataclass(frozen=True)
class DemoTrust:
    """What `make_demo_trust` wrote: the signed root, its fingerprint, and the one demo key that signs all."""

    root_path: Path
    key_path: Path
    public_key_path: Path
    fingerprint: str
    root: TrustRoot


def make_demo_trust(directory: Path | str, *, expires: datetime, name: str = "demo") -> DemoTrust:
    """Write a demo key (`<name>.key`, 0600) and a root.json whose root and bundles roles are that one key.

    For `envex demo` and tests: one key for everything is fine for a demo and wrong for production, where root
    keys stay offline and several holders form the thresholds.
    """
    from envex.bundles.keys import generate_key, write_key_files

    directory = Path(directory)
    key = generate_key()
    key_path, public_path = write_key_files(key, directory, name)
    root = sign_root(make_root(root_keys=[key], bundle_keys=[key], expires=expires), [key])
    root_path = write_file(directory / "root.json", root.to_bytes(), what="trust root", replace=False)
    return DemoTrust(root_path, key_path, public_path, root.fingerprint, root)
