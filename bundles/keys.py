"""Ed25519 signing keys: generation, key ids, and the files they live in.

Key id: the sha256 (hex) of the public key's 32 raw bytes. Public keys are stored TUF-style as
`{"keytype": "ed25519", "scheme": "ed25519", "keyval": {"public": "<hex>"}}`; private keys as unencrypted PKCS#8
PEM, written with mode 0600 and never overwritten.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from envex.bundles.files import (
    from_os_error,
    one_line,
    read_regular_file,
    require_directory,
    show,
    stat_or_none,
    write_file,
)


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


# A key file's name stem: no path separators, no leading dot, nothing that could climb out of --out.
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The largest key file read: an Ed25519 PEM is 119 bytes and its JSON document about 150; a margin for comments.
MAX_KEY_BYTES = 64 * 1024


def check_key_name(name: str) -> str:
    """`name` if it is a safe file name stem for a key pair; ValueError saying why not."""
    if not _KEY_NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"key name {one_line(repr(name))} is not a plain file name stem: use 1-64 of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit (no '/' or '..'; the files go into --out)"
        )
    return name


def write_key_files(key: Ed25519PrivateKey, directory: Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` (PEM, 0600) and `<name>.pub.json` under `directory`; returns both paths.

    Keys are never overwritten: each file is written beside its name and linked into place, which fails if the
    name exists. `name` must be a plain stem (check_key_name), so nothing is written outside `directory`.
    """
    check_key_name(name)
    directory = Path(directory)
    if stat_or_none(directory, what="key directory") is None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise from_os_error("key directory", directory, exc) from None
    require_directory(directory, what="key directory")
    private_path = directory / f"{name}.key"
    public_path = directory / f"{name}.pub.json"
    for path in (private_path, public_path):
        if stat_or_none(path, what="key file", follow_symlinks=False) is not None:
            raise FileExistsError(errno.EEXIST, f"{show(path)} already exists; keys are never overwritten")
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    # The mode is set at creation, so the secret is never briefly world-readable.
    write_file(private_path, pem, what="private key", mode=0o600, replace=False)
    document = json.dumps(public_key_document(key), indent=2, sort_keys=True) + "\n"
    write_file(public_path, document.encode(), what="public key", mode=0o644, replace=False)
    return private_path, public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load a private key written by `write_key_files` (PKCS#8 PEM); ValueError if it is not an Ed25519 key."""
    data = read_regular_file(path, max_bytes=MAX_KEY_BYTES, what="private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):  # TypeError: an encrypted key, which we do not write
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(
            f"private key {show(path)}: not an unencrypted PEM Ed25519 private key; give the .key file that "
            "envex bundle keygen wrote"
        )
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Load a public key from its JSON document, a PEM public key, or a PEM private key (its public half)."""
    data = read_regular_file(path, max_bytes=MAX_KEY_BYTES, what="public key")
    where = f"public key {show(path)}"
    if data.lstrip().startswith(b"{"):
        try:
            document = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON ({one_line(str(exc))})") from None
        if not isinstance(document, dict) or document.get("keytype") != "ed25519":
            raise ValueError(f"{where}: not an ed25519 public key document")
        keyval = document.get("keyval")
        if not isinstance(keyval, dict) or not isinstance(keyval.get("public"), str):
            raise ValueError(f"{where}: has no keyval.public")
        try:
            return public_key_from_hex(keyval["public"])
        except ValueError as exc:
            raise ValueError(f"{where}: keyval.public: {one_line(str(exc))}") from None
    if b"PRIVATE KEY" in data:
        return load_private_key(path).public_key()
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        public = None
    if not isinstance(public, Ed25519PublicKey):
        raise ValueError(f"{where}: not an Ed25519 public key (JSON document or PEM)")
    return public
