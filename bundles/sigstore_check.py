"""Offline verification of `manifest.json.sigstore.json` with sigstore-python.

Only what the trust root pins is used: its embedded sigstore `trusted_root.json` (CA chain, CT log keys, Rekor
keys, timestamp authorities) and its accepted identities. No TUF refresh, no network, nothing written anywhere:
`Verifier(trusted_root=...)` is built directly, never `Verifier.production()`. sigstore-python verifies
certificate-based (keyless) bundles: certificate chain at the log's integrated time or a signed timestamp, the
embedded SCT, the Fulcio profile, the Rekor inclusion proof, checkpoint and promise, and the signature over the
manifest's exact bytes.

sigstore is imported here only, and this module only when a bundle carries a sigstore bundle, so importing
`envex.bundles` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from envex.bundles.canonical import canonical_bytes
from envex.bundles.errors import Check, VerificationError
from envex.bundles.trust import SigstoreIdentity, SigstorePolicy

if TYPE_CHECKING:
    from cryptography.x509 import Certificate


@dataclass(frozen=True)
class SigstoreResult:
    """Who signed, as the certificate says and the policy accepted."""

    issuer: str
    subject: str


def verify_sigstore(bundle_json: bytes, manifest_bytes: bytes, policy: SigstorePolicy) -> SigstoreResult:
    """Verify a sigstore bundle over `manifest_bytes` against the pinned trusted root and identities, offline.

    Raises `VerificationError` with check `identity` when everything verifies but the signer is not an accepted
    identity, and `sigstore` for every other failure (the message carries sigstore's reason).
    """
    import sigstore.errors
    from sigstore.models import Bundle, TrustedRoot
    from sigstore.verify import Verifier
    from sigstore.verify.policy import Identity
    from sigstore_models.trustroot import v1 as trustroot_v1

    class IdentityMismatch(sigstore.errors.VerificationError):
        pass

    class AcceptedIdentities:
        """A sigstore VerificationPolicy: any one of the trust root's (issuer, subject) pairs."""

        matched: SigstoreIdentity | None = None

        def verify(self, cert: Certificate) -> None:
            reasons = []
            for identity in policy.identities:
                try:
                    Identity(identity=identity.subject, issuer=identity.issuer).verify(cert)
                except sigstore.errors.VerificationError as exc:
                    reasons.append(str(exc))
                    continue
                self.matched = identity
                return
            raise IdentityMismatch("; ".join(reasons))

    try:
        trusted_root = TrustedRoot(trustroot_v1.TrustedRoot.from_json(canonical_bytes(policy.trusted_root)))
        verifier = Verifier(trusted_root=trusted_root)
    except Exception as exc:  # a pinned root sigstore cannot use is a broken trust root, not a bad bundle
        raise VerificationError(
            f"the pinned sigstore trusted_root is not usable: {exc}", check=Check.TRUST_ROOT
        ) from None
    try:
        bundle = Bundle.from_json(bundle_json)
    except Exception as exc:
        raise VerificationError(
            f"manifest.json.sigstore.json is not a valid sigstore bundle: {exc}", check=Check.SIGSTORE
        ) from None
    accepted = AcceptedIdentities()
    try:
        verifier.verify_artifact(manifest_bytes, bundle, accepted)
    except IdentityMismatch as exc:
        raise VerificationError(f"sigstore signer is not an accepted identity: {exc}", check=Check.IDENTITY) from None
    except Exception as exc:  # sigstore's own VerificationError, and anything a hostile bundle provokes
        raise VerificationError(f"sigstore bundle does not verify: {exc}", check=Check.SIGSTORE) from None
    if accepted.matched is None:  # unreachable: sigstore always applies the policy before succeeding
        raise VerificationError("sigstore policy was not applied", check=Check.SIGSTORE)
    return SigstoreResult(issuer=accepted.matched.issuer, subject=accepted.matched.subject)
