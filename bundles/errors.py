"""The one error verification raises, and the names of the checks it can fail.

Verification fails closed: `verify_bundle` either returns a `VerifiedBundle` or raises `VerificationError`, whose
`check` names the first check that failed. Scripts and the installer branch on `check`; people read the message.
"""

from __future__ import annotations

from enum import StrEnum


class Check(StrEnum):
    """The checks a bundle (or a trust root) must pass, named as they appear in errors and on the CLI."""

    # The archive itself.
    MALFORMED_ARCHIVE = "malformed_archive"  # not a tar, truncated, corrupt headers, too many members
    UNSAFE_PATH = "unsafe_path"  # absolute path, `..`, empty or odd path component
    LINK_MEMBER = "link_member"  # symlink or hardlink member
    SPECIAL_MEMBER = "special_member"  # device, fifo, directory, sparse or other non-regular member
    DUPLICATE_MEMBER = "duplicate_member"  # the same name twice
    MISSING_FILE = "missing_file"  # a file the manifest lists, or a required metadata file, is absent
    UNKNOWN_FILE = "unknown_file"  # a member the manifest does not list
    SIZE = "size"  # a member's size differs from the manifest's, or a metadata file is too large
    DIGEST = "digest"  # a payload file's sha256 differs from the manifest's
    # The manifest and its signatures.
    MANIFEST = "manifest"  # manifest.json or signatures.json is not valid (schema, canonical form)
    SIGNATURE = "signature"  # a signature by a trusted key does not verify
    THRESHOLD = "threshold"  # fewer valid signatures by distinct trusted keys than the role's threshold
    UNTRUSTED_KEY = "untrusted_key"  # signed only by keys the trust root does not hold for this role
    REVOKED_KEY = "revoked_key"  # signed by a key the trust root has revoked
    EXPIRED = "expired"  # the manifest's `expires` is in the past
    ROLLBACK = "rollback"  # the bundle's version is lower than the caller's high-water mark
    # Sigstore.
    SIGSTORE = "sigstore"  # the sigstore bundle does not verify (certificate chain, SCT, log entry, signature)
    IDENTITY = "identity"  # the sigstore certificate's issuer/subject is not one the trust root accepts
    # The trust root.
    TRUST_ROOT = "trust_root"  # root.json is malformed, or not signed by a threshold of its root keys
    ROOT_EXPIRED = "root_expired"  # the trust root's `expires` is in the past
    ROOT_VERSION = "root_version"  # a rotation that does not move the root version forward by exactly one
    ROOT_FINGERPRINT = "root_fingerprint"  # the trust root is not the one the operator pinned
    # Extraction.
    DISK_SPACE = "disk_space"  # not enough free space at the destination for the payload
    DESTINATION = "destination"  # the extraction destination already exists or cannot be created


class VerificationError(Exception):
    """Verification failed; `check` names the failed check, the message says what and where, for people."""

    def __init__(self, message: str, *, check: Check) -> None:
        super().__init__(message)
        self.check = check
        self.message = message

    def __str__(self) -> str:
        return f"{self.check.value}: {self.message}"
