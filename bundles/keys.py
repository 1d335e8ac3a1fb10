"""Ed25519 signing keys: generation, key ids, and the files they live in.

Key id: the sha256 (hex) of the public key's 32 raw bytes. Public keys are stored TUF-style as
`{"keytype": "ed25519", "scheme": "ed25519", "keyval": {"public": "<hex>"}}`; private keys as unencrypted PKCS#8
PEM, written with mode 0600 and never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


def generate_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 private key."""
    return Ed25519PrivateKey.generate()


def public_raw(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    """The 32 raw bytes of the public key."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """The key id: sha256 hex of the public key's raw bytes."""
    return hashlib.sha256(public_raw(key)).hexdigest()


def public_key_document(key: Ed25519PublicKey | Ed25519PrivateKey) -> dict[str, Any]:
    """The TUF-style JSON form of the public key, as it appears in root.json."""
    return {"keytype": "ed25519", "scheme": "ed25519", "keyval": {"public": public_raw(key).hex()}}


def public_key_from_hex(hex_public: str) -> Ed25519PublicKey:
    """Load a public key from 64 hex characters; ValueError if it is not one."""
    raw = bytes.fromhex(hex_public)
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def sign(key: Ed25519PrivateKey, data: bytes) -> str:
    """The hex Ed25519 signature of `data`."""
    return key.sign(data).hex()


def signature_valid(key: Ed25519PublicKey, signature_hex: str, data: bytes) -> bool:
    """Whether `signature_hex` is `key`'s valid Ed25519 signature over `data`; malformed hex is simply invalid."""
    try:
        signature = bytes.fromhex(signature_hex)
    except ValueError:
        return False
    if len(signature) != 64:
        return False
    try:
        key.verify(signature, data)
    except InvalidSignature:
        return False
    return True


def _write_new(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL: never overwrite a key; the mode is set at creation so the secret is never briefly world-readable.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)  # the umask may have narrowed it further than asked; make it exact


def write_key_files(key: Ed25519PrivateKey, directory: Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` (PEM, 0600) and `<name>.pub.json` under `directory`; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path = directory / f"{name}.key"
    public_path = directory / f"{name}.pub.json"
    for path in (private_path, public_path):
        if path.exists():
            raise FileExistsError(f"{path} already exists; keys are never overwritten")
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_new(private_path, pem, 0o600)
    document = json.dumps(public_key_document(key), indent=2, sort_keys=True) + "\n"
    _write_new(public_path, document.encode(), 0o644)
    return private_path, public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load a private key written by `write_key_files` (PKCS#8 PEM); ValueError if it is not an Ed25519 key."""
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Load a public key from its JSON document, a PEM public key, or a PEM private key (its public half)."""
    data = path.read_bytes()
    if data.lstrip().startswith(b"{"):
        document = json.loads(data)
        if not isinstance(document, dict) or document.get("keytype") != "ed25519":
            raise ValueError(f"{path} is not an ed25519 public key document")
        keyval = document.get("keyval")
        if not isinstance(keyval, dict) or not isinstance(keyval.get("public"), str):
            raise ValueError(f"{path} has no keyval.public")
        return public_key_from_hex(keyval["public"])
    if b"PRIVATE KEY" in data:
        return load_private_key(path).public_key()
    public = serialization.load_pem_public_key(data)
    if not isinstance(public, Ed25519PublicKey):
        raise ValueError(f"{path} is not an Ed25519 public key")
    return public
