"""Test tools: a throwaway local sigstore instance, and tar surgery for tamper tests. Never for real signing.

Real sigstore signing needs the network (an OIDC token, Fulcio, Rekor). To test offline verification for real,
this module plays all three parts with keys made in memory, producing exactly what the public instance would:

* a CA certificate (Fulcio's root) and, per signature, an ephemeral P-256 leaf certificate with the code-signing
  EKU, the signer's identity as its SAN and the OIDC issuer in Fulcio's extension (1.3.6.1.4.1.57264.1.1 and .8);
* an embedded SCT from a CT log key over the precertificate (RFC 6962 3.2, the SCT list removed from the TBS);
* a Rekor v1 `hashedrekord` entry in a Merkle tree of several leaves, with its inclusion proof (RFC 6962 2.1.1),
  a signed checkpoint (a signed note) and a signed entry timestamp (the inclusion promise);
* the `trusted_root.json` that pins the CA, the CT log key and the Rekor key.

Nothing is mocked: sigstore-python's `Verifier` checks all of it. `SyntheticSigstore.sign` returns the bundle's
JSON bytes, for `sign_bundle(path, sigstore_bundle=...)`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import struct
import tarfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID

from envex.bundles.canonical import canonical_bytes

OIDC_ISSUER_V1 = x509.ObjectIdentifier("1.3.6.1.4.1.57264.1.1")
OIDC_ISSUER_V2 = x509.ObjectIdentifier("1.3.6.1.4.1.57264.1.8")
LOG_ORIGIN = "rekor.envex.invalid"  # a signed-note key name: no spaces


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _spki(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _der(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + _der_length(len(body)) + body


def _leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _merkle_root(leaves: list[bytes]) -> bytes:
    # RFC 6962 2.1: split at the largest power of two smaller than n.
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return _node_hash(_merkle_root(leaves[:k]), _merkle_root(leaves[k:]))


def _merkle_path(index: int, leaves: list[bytes]) -> list[bytes]:
    # RFC 6962 2.1.1: the audit path, from the leaf's sibling upwards.
    if len(leaves) == 1:
        return []
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    if index < k:
        return [*_merkle_path(index, leaves[:k]), _merkle_root(leaves[k:])]
    return [*_merkle_path(index - k, leaves[k:]), _merkle_root(leaves[:k])]


class SyntheticSigstore:
    """A local CA + CT log + Rekor log. `trusted_root()` pins them; `sign()` makes keyless bundles."""

    def __init__(self, *, now: datetime | None = None, tree_size: int = 5) -> None:
        self.now = (now or datetime.now(UTC)).replace(microsecond=0)
        self.tree_size = tree_size
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ct_key = ec.generate_private_key(ec.SECP256R1())
        self.log_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "envex synthetic"),
                x509.NameAttribute(NameOID.COMMON_NAME, "envex synthetic sigstore CA"),
            ]
        )
        self.ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - timedelta(days=30))
            .not_valid_after(self.now + timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.ca_key.public_key()), critical=False)
            .sign(self.ca_key, hashes.SHA256())
        )
        self.log_id = hashlib.sha256(_spki(self.log_key)).digest()

    def trusted_root(self) -> dict[str, Any]:
        """The sigstore `trusted_root.json` (as a JSON object) pinning this instance's CA, CT log and Rekor keys."""

        def log(key: ec.EllipticCurvePrivateKey, url: str) -> dict[str, Any]:
            return {
                "baseUrl": url,
                "hashAlgorithm": "SHA2_256",
                "publicKey": {
                    "rawBytes": _b64(_spki(key)),
                    "keyDetails": "PKIX_ECDSA_P256_SHA_256",
                    "validFor": {"start": (self.now - timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")},
                },
                "logId": {"keyId": _b64(hashlib.sha256(_spki(key)).digest())},
            }

        return {
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            # .invalid: a reserved name that can never resolve; the verifier never connects anyway.
            "tlogs": [log(self.log_key, "https://rekor.envex.invalid")],
            "ctlogs": [log(self.ct_key, "https://ctfe.envex.invalid")],
            "certificateAuthorities": [
                {
                    "subject": {"organization": "envex synthetic", "commonName": "envex synthetic sigstore CA"},
                    "uri": "https://fulcio.envex.invalid",
                    "certChain": {
                        "certificates": [{"rawBytes": _b64(self.ca_cert.public_bytes(serialization.Encoding.DER))}]
                    },
                    "validFor": {"start": (self.now - timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")},
                }
            ],
            "timestampAuthorities": [],
        }

    def _leaf_certificate(
        self, key: ec.EllipticCurvePrivateKey, subject: str, issuer: str, signed_at: datetime
    ) -> x509.Certificate:
        san: x509.GeneralName = (
            x509.UniformResourceIdentifier(subject) if "://" in subject else x509.RFC822Name(subject)
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(signed_at - timedelta(minutes=1))
            .not_valid_after(signed_at + timedelta(minutes=10))  # Fulcio certificates live ten minutes
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()), critical=False)
            .add_extension(x509.SubjectAlternativeName([san]), critical=True)
            .add_extension(x509.UnrecognizedExtension(OIDC_ISSUER_V1, issuer.encode()), critical=False)
            .add_extension(x509.UnrecognizedExtension(OIDC_ISSUER_V2, _der(0x0C, issuer.encode())), critical=False)
        )
        # RFC 6962 3.2: the CT log signs the precertificate's TBS, which is the final TBS without the SCT list.
        tbs = builder.sign(self.ca_key, hashes.SHA256()).tbs_certificate_bytes
        millis = int(signed_at.timestamp() * 1000)
        issuer_key_hash = hashlib.sha256(_spki(self.ca_key)).digest()
        signed = (
            struct.pack("!BBQH", 0, 0, millis, 1)  # v1, certificate_timestamp, timestamp, precert_entry
            + issuer_key_hash
            + len(tbs).to_bytes(3, "big")
            + tbs
            + struct.pack("!H", 0)  # no extensions
        )
        signature = self.ct_key.sign(signed, ec.ECDSA(hashes.SHA256()))
        ct_log_id = hashlib.sha256(_spki(self.ct_key)).digest()
        sct = (
            b"\x00"
            + ct_log_id
            + struct.pack("!QH", millis, 0)
            + struct.pack("!BBH", 4, 3, len(signature))  # sha256, ecdsa
            + signature
        )
        sct_list = struct.pack("!HH", len(sct) + 2, len(sct)) + sct
        cert = builder.add_extension(
            x509.UnrecognizedExtension(ExtensionOID.PRECERT_SIGNED_CERTIFICATE_TIMESTAMPS, _der(0x04, sct_list)),
            critical=False,
        ).sign(self.ca_key, hashes.SHA256())
        if cert.tbs_precertificate_bytes != tbs:  # the SCT would not verify; fail here, not in a test far away
            raise RuntimeError("precertificate TBS differs from the certificate's TBS without SCTs")
        return cert

    def sign(self, artifact: bytes, *, subject: str, issuer: str, signed_at: datetime | None = None) -> bytes:
        """A sigstore bundle (v0.3 JSON bytes) over `artifact` by `subject` as vouched for by `issuer`."""
        signed_at = (signed_at or self.now).replace(microsecond=0)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._leaf_certificate(key, subject, issuer, signed_at)
        signature = key.sign(artifact, ec.ECDSA(hashes.SHA256()))
        digest = hashlib.sha256(artifact).digest()
        body = canonical_bytes(
            {
                "apiVersion": "0.0.1",
                "kind": "hashedrekord",
                "spec": {
                    "data": {"hash": {"algorithm": "sha256", "value": digest.hex()}},
                    "signature": {
                        "content": _b64(signature),
                        "publicKey": {"content": _b64(cert.public_bytes(serialization.Encoding.PEM))},
                    },
                },
            }
        )
        # Our entry sits among other entries, so the inclusion proof has real sibling hashes to check.
        index = self.tree_size // 2
        leaves = [_leaf_hash(os.urandom(32)) for _ in range(self.tree_size)]
        leaves[index] = _leaf_hash(body)
        root_hash = _merkle_root(leaves)
        proof = _merkle_path(index, leaves)
        note = f"{LOG_ORIGIN}\n{self.tree_size}\n{_b64(root_hash)}\n"
        note_signature = self.log_key.sign(note.encode(), ec.ECDSA(hashes.SHA256()))
        checkpoint = f"{note}\n\u2014 {LOG_ORIGIN} {_b64(self.log_id[:4] + note_signature)}\n"
        integrated = int(signed_at.timestamp())
        promise = canonical_bytes(
            {"body": _b64(body), "integratedTime": integrated, "logID": self.log_id.hex(), "logIndex": index}
        )
        bundle = {
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {
                "certificate": {"rawBytes": _b64(cert.public_bytes(serialization.Encoding.DER))},
                "tlogEntries": [
                    {
                        "logIndex": str(index),
                        "logId": {"keyId": _b64(self.log_id)},
                        "kindVersion": {"kind": "hashedrekord", "version": "0.0.1"},
                        "integratedTime": str(integrated),
                        "inclusionPromise": {
                            "signedEntryTimestamp": _b64(self.log_key.sign(promise, ec.ECDSA(hashes.SHA256())))
                        },
                        "inclusionProof": {
                            "logIndex": str(index),
                            "rootHash": _b64(root_hash),
                            "treeSize": str(self.tree_size),
                            "hashes": [_b64(h) for h in proof],
                            "checkpoint": {"envelope": checkpoint},
                        },
                        "canonicalizedBody": _b64(body),
                    }
                ],
            },
            "messageSignature": {
                "messageDigest": {"algorithm": "SHA2_256", "digest": _b64(digest)},
                "signature": _b64(signature),
            },
        }
        return json.dumps(bundle, indent=2).encode()


# --- Tar surgery for the tamper tests: rewrite a bundle member by member, or patch bytes in place. ---


def read_members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    """Every member of a (trusted, test-made) tar with its data."""
    with tarfile.open(path, "r:") as archive:
        result = []
        for info in archive.getmembers():
            handle = archive.extractfile(info) if info.isreg() else None
            result.append((info, handle.read() if handle else b""))
        return result


def tar_bytes(
    members: list[tuple[tarfile.TarInfo, bytes]],
    *,
    format: int = tarfile.PAX_FORMAT,
    global_pax: dict[str, str] | None = None,
) -> bytes:
    """`members` as the bytes of a tar, header fields as given (sizes follow the data of regular files)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=format, pax_headers=global_pax) as archive:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
            else:
                archive.addfile(info)
    return out.getvalue()


def write_members(
    path: Path,
    members: list[tuple[tarfile.TarInfo, bytes]],
    *,
    format: int = tarfile.PAX_FORMAT,
    global_pax: dict[str, str] | None = None,
) -> None:
    """Write `members` as a tar at `path` (see tar_bytes)."""
    path.write_bytes(tar_bytes(members, format=format, global_pax=global_pax))


def member_offsets(path: Path) -> dict[str, tuple[int, int, int]]:
    """name -> (header offset, data offset, size) for each member."""
    with tarfile.open(path, "r:") as archive:
        return {i.name: (i.offset, i.offset_data, i.size) for i in archive.getmembers()}


def flip_byte(path: Path, offset: int) -> None:
    """XOR one byte of the file with 0x01 (a one-bit flip, as bad media or an attacker would make)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def set_header_size(path: Path, header_offset: int, size: int) -> None:
    """Rewrite the size field of the ustar header at `header_offset`, with a valid checksum: a size lie."""
    with open(path, "r+b") as handle:
        handle.seek(header_offset)
        header = bytearray(handle.read(tarfile.BLOCKSIZE))
        header[124:136] = f"{size:011o}\0".encode()
        header[148:156] = b" " * 8
        header[148:156] = f"{sum(header):06o}\0 ".encode()
        handle.seek(header_offset)
        handle.write(header)
