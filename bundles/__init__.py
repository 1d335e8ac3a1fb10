"""Signed bundles and their fully offline verification.

The installer's whole trust in what reaches the appliance rests on this package. The flow:

    key = generate_key()                                          # Ed25519; write_key_files() stores it (0600)
    root = sign_root(make_root(root_keys=[key], bundle_keys=[key], expires=...), [key])
    Path("root.json").write_bytes(root.to_bytes())                # show root_fingerprint(root) to the operator
    path = build_bundle(src_dir, kind="model", name="smollm2", version="1.0.0", out=media_dir)
    sign_bundle(path, [key])                                      # several holders may sign in turn
    verified = verify_bundle(path, root=load_root("root.json", fingerprint=pinned), high_water="0.9.0")
    verified.extract(release_dir / "model")                       # re-hashes while it copies

`verify_bundle` returns a `VerifiedBundle` or raises `VerificationError`, whose `check` (a `Check`) names the one
check that failed. `rotate_root(current, new)` accepts a new root only when it is the next version and signed by
a threshold of the current root keys and of its own. Nothing here opens a network connection or writes outside
the paths it is given. The format and trust model are documented in offline_docs/bundles.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The public names, each from its module, imported on first use (PEP 562): the runtime reads files through the
# standard-library-only `envex.bundles.files`, and importing this package must not pull pydantic and
# cryptography into the engine (which runs where the server's packages are absent).
_EXPORTS = {
    "build": ("BuildError", "build_bundle", "sign_bundle"),
    "errors": ("Check", "VerificationError"),
    "keys": ("generate_key", "key_id", "load_private_key", "load_public_key", "write_key_files"),
    "manifest": ("FileEntry", "Manifest", "Requirement", "SemVer", "Targets"),
    "trust": ("DemoTrust", "SigstoreIdentity", "SigstorePolicy", "TrustRoot", "load_root", "make_demo_trust",
              "make_root", "normalize_fingerprint", "root_fingerprint", "rotate_root", "sign_root"),
    "verify": ("VerifiedBundle", "verify_bundle"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # the names as they are, for type checkers
    from envex.bundles.build import BuildError, build_bundle, sign_bundle
    from envex.bundles.errors import Check, VerificationError
    from envex.bundles.keys import generate_key, key_id, load_private_key, load_public_key, write_key_files
    from envex.bundles.manifest import FileEntry, Manifest, Requirement, SemVer, Targets
    from envex.bundles.trust import (
        DemoTrust,
        SigstoreIdentity,
        SigstorePolicy,
        TrustRoot,
        load_root,
        make_demo_trust,
        make_root,
        normalize_fingerprint,
        root_fingerprint,
        rotate_root,
        sign_root,
    )
    from envex.bundles.verify import VerifiedBundle, verify_bundle


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BuildError",
    "Check",
    "DemoTrust",
    "FileEntry",
    "Manifest",
    "Requirement",
    "SemVer",
    "SigstoreIdentity",
    "SigstorePolicy",
    "Targets",
    "TrustRoot",
    "VerificationError",
    "VerifiedBundle",
    "build_bundle",
    "generate_key",
    "key_id",
    "load_private_key",
    "load_public_key",
    "load_root",
    "make_demo_trust",
    "make_root",
    "normalize_fingerprint",
    "root_fingerprint",
    "rotate_root",
    "sign_bundle",
    "sign_root",
    "verify_bundle",
    "write_key_files",
]
