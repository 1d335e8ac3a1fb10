"""The tamper matrix: each attack on a signed bundle or its trust fails with the right named check.

Every case starts from a bundle that verifies (asserted once below), applies one attack, and expects
`VerificationError` with one specific `check`. Real keys, real signatures, real tar files, and a real (local,
synthetic) sigstore instance verified by sigstore-python: nothing is mocked.
"""

from __future__ import annotations

import base64
import gzip
import json
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from envex.bundles import (
    Check,
    SigstoreIdentity,
    SigstorePolicy,
    TrustRoot,
    VerificationError,
    build_bundle,
    generate_key,
    key_id,
    load_root,
    make_root,
    rotate_root,
    sign_bundle,
    sign_root,
    verify_bundle,
)
from envex.bundles.archive import BundleArchive
from envex.bundles.canonical import canonical_bytes
from envex.tests.support.bundles import (
    SyntheticSigstore,
    flip_byte,
    member_offsets,
    read_members,
    set_header_size,
    write_members,
)

NOW = datetime.now(UTC).replace(microsecond=0)
ISSUER = "https://accounts.envex.invalid"
SUBJECT = "release-team@envex.invalid"


@dataclass
class Ctx:
    """Keys, roots and a clean signed bundle; `fresh()` copies the bundle for one attack."""

    work: Path
    src: Path
    clean: Path
    root: TrustRoot
    k_root: Any
    k_bundle: Any
    k_other: Any
    sigstore: SyntheticSigstore
    sigstore_root: TrustRoot
    sigstore_clean: Path

    def fresh(self, tmp: Path, *, sigstore: bool = False) -> Path:
        target = tmp / "bundle.envex"
        shutil.copyfile(self.sigstore_clean if sigstore else self.clean, target)
        return target

    def build(self, tmp: Path, **kwargs: Any) -> Path:
        options: dict[str, Any] = {"kind": "model", "name": "demo", "version": "1.0.0", "out": tmp / "b.envex"}
        options.update(kwargs)
        return build_bundle(self.src, **options)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    work = tmp_path_factory.mktemp("tamper")
    src = work / "src"
    (src / "tokenizer").mkdir(parents=True)
    (src / "config.json").write_bytes(b'{"architectures": ["LlamaForCausalLM"]}\n')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (src / "tokenizer" / "tokenizer.json").write_bytes(b'{"version": "1.0"}\n')
    k_root, k_bundle, k_other = generate_key(), generate_key(), generate_key()
    root = sign_root(make_root(root_keys=[k_root], bundle_keys=[k_bundle], expires=NOW + timedelta(days=30)), [k_root])
    clean = build_bundle(src, kind="model", name="demo", version="1.0.0", out=work / "demo.envex")
    sign_bundle(clean, [k_bundle])

    sigstore = SyntheticSigstore(now=NOW - timedelta(minutes=5))
    identities = [SigstoreIdentity(issuer=ISSUER, subject=SUBJECT)]
    policy = SigstorePolicy(identities=identities, required=True, trusted_root=sigstore.trusted_root())
    sigstore_root = sign_root(
        make_root(root_keys=[k_root], bundle_keys=[k_bundle], expires=NOW + timedelta(days=30), sigstore=policy),
        [k_root],
    )
    sigstore_clean = work / "demo-sigstore.envex"
    shutil.copyfile(clean, sigstore_clean)
    sign_bundle(sigstore_clean, sigstore_bundle=sigstore.sign(manifest_of(clean), subject=SUBJECT, issuer=ISSUER))
    return Ctx(work, src, clean, root, k_root, k_bundle, k_other, sigstore, sigstore_root, sigstore_clean)


def manifest_of(path: Path) -> bytes:
    with BundleArchive.open(path) as archive:
        data = archive.read_metadata("manifest.json")
    assert data is not None
    return data


def sigstore_json(path: Path) -> dict[str, Any]:
    with BundleArchive.open(path) as archive:
        data = archive.read_metadata("manifest.json.sigstore.json")
    assert data is not None
    result: dict[str, Any] = json.loads(data)
    return result


def attach_sigstore(path: Path, bundle: dict[str, Any]) -> None:
    sign_bundle(path, sigstore_bundle=json.dumps(bundle).encode())


def flip_b64(value: str, index: int = -1) -> str:
    raw = bytearray(base64.b64decode(value))
    raw[index] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


def rewrite(path: Path, change: Callable[[list[tuple[tarfile.TarInfo, bytes]]], None], **options: Any) -> None:
    members = read_members(path)
    change(members)
    write_members(path, members, **options)


def with_pax(name: str, pax: dict[str, str]) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.pax_headers = pax
    return info


def find(members: list[tuple[tarfile.TarInfo, bytes]], name: str) -> int:
    return next(i for i, (info, _) in enumerate(members) if info.name == name)


def special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


# --- the attacks: each takes (ctx, tmp) and must raise VerificationError ---------------------------------------


def flipped_payload_byte(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    _, data_offset, size = member_offsets(path)["payload/model.safetensors"]
    flip_byte(path, data_offset + size // 2)
    verify_bundle(path, root=c.root)


def flipped_manifest_byte(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    _, data_offset, size = member_offsets(path)["manifest.json"]
    flip_byte(path, data_offset + size // 2)
    verify_bundle(path, root=c.root)


def flipped_signature_byte(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    _, data_offset, size = member_offsets(path)["signatures.json"]
    text = path.read_bytes()[data_offset : data_offset + size]
    at = data_offset + text.index(b'"sig":"') + 20
    with open(path, "r+b") as handle:  # change one hex digit of the signature to another hex digit
        handle.seek(at)
        digit = handle.read(1)
        handle.seek(at)
        handle.write(b"0" if digit != b"0" else b"1")
    verify_bundle(path, root=c.root)


def added_file(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (tarfile.TarInfo("payload/evil.py"), b"import os\n")))
    verify_bundle(path, root=c.root)


def added_top_level_file(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.append((tarfile.TarInfo("install.sh"), b"rm -rf /\n")))
    verify_bundle(path, root=c.root)


def removed_file(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.pop(find(m, "payload/config.json")))
    verify_bundle(path, root=c.root)


def renamed_file(c: Ctx, tmp: Path) -> None:
    def change(m: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        m[find(m, "payload/config.json")][0].name = "payload/config2.json"

    path = c.fresh(tmp)
    rewrite(path, change)
    verify_bundle(path, root=c.root)


def duplicated_file(c: Ctx, tmp: Path) -> None:
    def change(m: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        info = tarfile.TarInfo("payload/config.json")
        m.insert(find(m, "manifest.json"), (info, b'{"architectures": ["Evil"]}\n'))

    path = c.fresh(tmp)
    rewrite(path, change)
    verify_bundle(path, root=c.root)


def symlink_member(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (special("payload/passwd", tarfile.SYMTYPE, "/etc/passwd"), b"")))
    verify_bundle(path, root=c.root)


def hardlink_member(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (special("payload/shadow", tarfile.LNKTYPE, "/etc/shadow"), b"")))
    verify_bundle(path, root=c.root)


def symlink_replacing_listed_file(c: Ctx, tmp: Path) -> None:
    def change(m: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        m[find(m, "payload/config.json")] = (special("payload/config.json", tarfile.SYMTYPE, "../../x"), b"")

    path = c.fresh(tmp)
    rewrite(path, change)
    verify_bundle(path, root=c.root)


def device_member(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (special("payload/sda", tarfile.BLKTYPE), b"")))
    verify_bundle(path, root=c.root)


def directory_member(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (special("payload/tokenizer", tarfile.DIRTYPE), b"")))
    verify_bundle(path, root=c.root)


def path_traversal(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (tarfile.TarInfo("payload/../../etc/cron.d/evil"), b"* * * * * root x\n")))
    verify_bundle(path, root=c.root)


def absolute_path(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (tarfile.TarInfo("/etc/cron.d/evil"), b"* * * * * root x\n")))
    verify_bundle(path, root=c.root)


def pax_path_traversal(c: Ctx, tmp: Path) -> None:
    # The ustar name looks harmless; the pax `path` record, which wins, climbs out of the destination.
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (with_pax("payload/ok.txt", {"path": "payload/../../../root/.bashrc"}), b"x")))
    verify_bundle(path, root=c.root)


def oversized_pax_header(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (with_pax("payload/a", {"comment": "x" * 100_000}), b"x")))
    verify_bundle(path, root=c.root)


def gnu_sparse_member(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    sparse = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "payload/big"}
    rewrite(path, lambda m: m.insert(0, (with_pax("payload/big", sparse), b"1\n0\n0\n")))
    verify_bundle(path, root=c.root)


def pax_global_header(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: None, global_pax={"path": "../../evil"})
    verify_bundle(path, root=c.root)


def gnu_long_name(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.insert(0, (tarfile.TarInfo("payload/" + "a" * 120), b"x")), format=tarfile.GNU_FORMAT)
    verify_bundle(path, root=c.root)


def size_lie_consistent_header(c: Ctx, tmp: Path) -> None:
    def change(m: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        i = find(m, "payload/model.safetensors")
        m[i] = (m[i][0], m[i][1] + b"\0" * 4096)  # the header now honestly says a size the manifest does not

    path = c.fresh(tmp)
    rewrite(path, change)
    verify_bundle(path, root=c.root)


def size_lie_past_end_of_file(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    header, _, _ = member_offsets(path)["signatures.json"]
    set_header_size(path, header, (1 << 33) - 1)  # claims 8 GiB in a file of a few KB
    verify_bundle(path, root=c.root)


def size_lie_shrunk_header(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    header, _, size = member_offsets(path)["payload/model.safetensors"]
    set_header_size(path, header, size - 1024)  # the rest of the data now sits where a header should be
    verify_bundle(path, root=c.root)


def truncated_archive(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    verify_bundle(path, root=c.root)


def truncated_end_marker(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    _, data_offset, size = member_offsets(path)["signatures.json"]
    with open(path, "r+b") as handle:
        handle.truncate(data_offset + size + (-size % 512))  # every member intact, the end-of-archive gone
    verify_bundle(path, root=c.root)


def corrupt_header_checksum(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    header, _, _ = member_offsets(path)["payload/tokenizer/tokenizer.json"]
    flip_byte(path, header + 10)  # inside the name field: the header checksum no longer matches
    verify_bundle(path, root=c.root)


def not_a_tar(c: Ctx, tmp: Path) -> None:
    path = tmp / "garbage.envex"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    verify_bundle(path, root=c.root)


def compressed_tar(c: Ctx, tmp: Path) -> None:
    path = tmp / "bundle.envex"
    path.write_bytes(gzip.compress(c.clean.read_bytes()))
    verify_bundle(path, root=c.root)


def manifest_missing(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.pop(find(m, "manifest.json")))
    verify_bundle(path, root=c.root)


def signatures_missing(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp)
    rewrite(path, lambda m: m.pop(find(m, "signatures.json")))
    verify_bundle(path, root=c.root)


def oversized_signatures(c: Ctx, tmp: Path) -> None:
    def change(m: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        i = find(m, "signatures.json")
        m[i] = (m[i][0], m[i][1] + b" " * (2 * 1024 * 1024))

    path = c.fresh(tmp)
    rewrite(path, change)
    verify_bundle(path, root=c.root)


def unsigned(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.build(tmp), root=c.root)


def signed_invalid_manifest(c: Ctx, tmp: Path) -> None:
    # A trusted key signed nonsense (a vendor bug, not an attacker): still refused, by the manifest check.
    def change(m: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        i = find(m, "manifest.json")
        value = json.loads(m[i][1])
        value["files"][0]["path"] = "../escape"
        m[i] = (m[i][0], canonical_bytes(value))

    path = c.fresh(tmp)
    rewrite(path, change)
    sign_bundle(path, [c.k_bundle])
    verify_bundle(path, root=c.root)


def expired_manifest(c: Ctx, tmp: Path) -> None:
    path = c.build(tmp, created=NOW - timedelta(days=10), expires=NOW - timedelta(days=1))
    sign_bundle(path, [c.k_bundle])
    verify_bundle(path, root=c.root)


def expired_root(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.fresh(tmp), root=c.root, now=NOW + timedelta(days=31))


def wrong_key(c: Ctx, tmp: Path) -> None:
    path = c.build(tmp)
    sign_bundle(path, [c.k_other])
    verify_bundle(path, root=c.root)


def root_key_is_not_a_bundle_key(c: Ctx, tmp: Path) -> None:
    path = c.build(tmp)
    sign_bundle(path, [c.k_root])  # trusted, but for the root role only
    verify_bundle(path, root=c.root)


def one_signature_below_threshold(c: Ctx, tmp: Path) -> None:
    root = sign_root(
        make_root(
            root_keys=[c.k_root], bundle_keys=[c.k_bundle, c.k_other], bundle_threshold=2, expires=NOW + timedelta(1)
        ),
        [c.k_root],
    )
    verify_bundle(c.fresh(tmp), root=root)  # signed by k_bundle only


def duplicated_signature_for_threshold(c: Ctx, tmp: Path) -> None:
    root = sign_root(
        make_root(
            root_keys=[c.k_root], bundle_keys=[c.k_bundle, c.k_other], bundle_threshold=2, expires=NOW + timedelta(1)
        ),
        [c.k_root],
    )

    def change(m: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        i = find(m, "signatures.json")
        value = json.loads(m[i][1])
        value["signatures"] = value["signatures"] * 2  # the same key twice is still one key
        m[i] = (m[i][0], canonical_bytes(value))

    path = c.fresh(tmp)
    rewrite(path, change)
    verify_bundle(path, root=root)


def rotated(c: Ctx, *, revoke: bool) -> TrustRoot:
    k_new = generate_key()
    v2 = make_root(
        root_keys=[c.k_root],
        bundle_keys=[k_new],
        version=2,
        expires=NOW + timedelta(days=30),
        revoked_keyids=[key_id(c.k_bundle)] if revoke else [],
    )
    return rotate_root(c.root, sign_root(v2, [c.k_root]))


def revoked_key(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.fresh(tmp), root=rotated(c, revoke=True))


def key_dropped_by_rotation(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.fresh(tmp), root=rotated(c, revoke=False))


def old_root_after_rotation(c: Ctx, tmp: Path) -> None:
    v2 = rotated(c, revoke=True)
    rotate_root(v2, c.root.to_bytes())


def rotation_skipping_a_version(c: Ctx, tmp: Path) -> None:
    v3 = make_root(root_keys=[c.k_root], bundle_keys=[c.k_bundle], version=3, expires=NOW + timedelta(days=30))
    rotate_root(c.root, sign_root(v3, [c.k_root]))


def rotation_without_old_keys(c: Ctx, tmp: Path) -> None:
    # An attacker's root: their own keys sign it, so it is self-consistent; the current root keys did not.
    k_attacker = generate_key()
    v2 = make_root(root_keys=[k_attacker], bundle_keys=[k_attacker], version=2, expires=NOW + timedelta(days=30))
    rotate_root(c.root, sign_root(v2, [k_attacker]))


def rotation_without_new_keys(c: Ctx, tmp: Path) -> None:
    k_new_root = generate_key()
    v2 = make_root(root_keys=[k_new_root], bundle_keys=[c.k_bundle], version=2, expires=NOW + timedelta(days=30))
    rotate_root(c.root, sign_root(v2, [c.k_root]))  # the new root's own key never signed


def tampered_root_file(c: Ctx, tmp: Path) -> None:
    value = json.loads(c.root.to_bytes())
    value["signed"]["expires"] = "2099-01-01T00:00:00Z"  # extend its life without the root keys
    load_root(json.dumps(value).encode())


def root_fingerprint_mismatch(c: Ctx, tmp: Path) -> None:
    other = sign_root(
        make_root(root_keys=[c.k_other], bundle_keys=[c.k_other], expires=NOW + timedelta(days=30)), [c.k_other]
    )
    load_root(other.to_bytes(), fingerprint=c.root.fingerprint)


def downgrade(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.fresh(tmp), root=c.root, high_water="1.0.1")


def downgrade_by_name(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.fresh(tmp), root=c.root, high_water={"other": "9.0.0", "demo": "2.0.0"})


def downgrade_from_release_to_prerelease(c: Ctx, tmp: Path) -> None:
    path = c.build(tmp, version="1.0.0-rc.1")
    sign_bundle(path, [c.k_bundle])
    verify_bundle(path, root=c.root, high_water="1.0.0")


def sigstore_wrong_identity(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    sign_bundle(
        path, sigstore_bundle=c.sigstore.sign(manifest_of(path), subject="mallory@envex.invalid", issuer=ISSUER)
    )
    verify_bundle(path, root=c.sigstore_root)


def sigstore_wrong_issuer(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    sign_bundle(
        path, sigstore_bundle=c.sigstore.sign(manifest_of(path), subject=SUBJECT, issuer="https://evil.invalid")
    )
    verify_bundle(path, root=c.sigstore_root)


def sigstore_tampered_certificate(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    bundle = sigstore_json(path)
    cert = bundle["verificationMaterial"]["certificate"]
    cert["rawBytes"] = flip_b64(cert["rawBytes"])  # the CA's signature over the certificate
    attach_sigstore(path, bundle)
    verify_bundle(path, root=c.sigstore_root)


def sigstore_tampered_inclusion_proof(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    bundle = sigstore_json(path)
    proof = bundle["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]
    proof["hashes"][0] = flip_b64(proof["hashes"][0], 0)
    attach_sigstore(path, bundle)
    verify_bundle(path, root=c.sigstore_root)


def sigstore_tampered_checkpoint(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    bundle = sigstore_json(path)
    checkpoint = bundle["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["checkpoint"]
    note, signature_line = checkpoint["envelope"].split("\n\n")
    prefix, signature = signature_line.rstrip("\n").rsplit(" ", 1)
    checkpoint["envelope"] = f"{note}\n\n{prefix} {flip_b64(signature)}\n"
    attach_sigstore(path, bundle)
    verify_bundle(path, root=c.sigstore_root)


def sigstore_tampered_promise(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    bundle = sigstore_json(path)
    entry = bundle["verificationMaterial"]["tlogEntries"][0]
    entry["integratedTime"] = str(int(entry["integratedTime"]) + 60)  # the signed entry timestamp no longer fits
    attach_sigstore(path, bundle)
    verify_bundle(path, root=c.sigstore_root)


def sigstore_different_artifact(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    sign_bundle(path, sigstore_bundle=c.sigstore.sign(b"another manifest", subject=SUBJECT, issuer=ISSUER))
    verify_bundle(path, root=c.sigstore_root)


def sigstore_untrusted_instance(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    rogue = SyntheticSigstore(now=NOW - timedelta(minutes=5))  # same identity, a CA the root does not pin
    sign_bundle(path, sigstore_bundle=rogue.sign(manifest_of(path), subject=SUBJECT, issuer=ISSUER))
    verify_bundle(path, root=c.sigstore_root)


def sigstore_required_but_missing(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.fresh(tmp), root=c.sigstore_root)


def sigstore_without_pinned_root(c: Ctx, tmp: Path) -> None:
    verify_bundle(c.fresh(tmp, sigstore=True), root=c.root)


def sigstore_garbage(c: Ctx, tmp: Path) -> None:
    path = c.fresh(tmp, sigstore=True)
    sign_bundle(path, sigstore_bundle=b'{"mediaType": "nonsense"}')
    verify_bundle(path, root=c.sigstore_root)


ATTACKS: list[tuple[Callable[[Ctx, Path], None], Check, str]] = [
    (flipped_payload_byte, Check.DIGEST, "model.safetensors"),
    (flipped_manifest_byte, Check.SIGNATURE, "does not verify"),
    (flipped_signature_byte, Check.SIGNATURE, "does not verify"),
    (added_file, Check.UNKNOWN_FILE, "payload/evil.py"),
    (added_top_level_file, Check.UNKNOWN_FILE, "install.sh"),
    (removed_file, Check.MISSING_FILE, "payload/config.json"),
    (renamed_file, Check.UNKNOWN_FILE, "config2.json"),
    (duplicated_file, Check.DUPLICATE_MEMBER, "payload/config.json"),
    (symlink_member, Check.LINK_MEMBER, "symlink"),
    (hardlink_member, Check.LINK_MEMBER, "hardlink"),
    (symlink_replacing_listed_file, Check.LINK_MEMBER, "symlink"),
    (device_member, Check.SPECIAL_MEMBER, "block device"),
    (directory_member, Check.SPECIAL_MEMBER, "directory"),
    (path_traversal, Check.UNSAFE_PATH, "'..'"),
    (absolute_path, Check.UNSAFE_PATH, "absolute"),
    (pax_path_traversal, Check.UNSAFE_PATH, "'..'"),
    (oversized_pax_header, Check.MALFORMED_ARCHIVE, "over 65536"),
    (gnu_sparse_member, Check.SPECIAL_MEMBER, "sparse"),
    (pax_global_header, Check.MALFORMED_ARCHIVE, "global pax header"),
    (gnu_long_name, Check.MALFORMED_ARCHIVE, "GNU long name"),
    (size_lie_consistent_header, Check.SIZE, "the manifest says"),
    (size_lie_past_end_of_file, Check.MALFORMED_ARCHIVE, "past the end"),
    (size_lie_shrunk_header, Check.MALFORMED_ARCHIVE, "corrupt"),
    (truncated_archive, Check.MALFORMED_ARCHIVE, "truncated"),
    (truncated_end_marker, Check.MALFORMED_ARCHIVE, "end-of-archive"),
    (corrupt_header_checksum, Check.MALFORMED_ARCHIVE, "corrupt"),
    (not_a_tar, Check.MALFORMED_ARCHIVE, "not a tar"),
    (compressed_tar, Check.MALFORMED_ARCHIVE, "not a tar"),
    (manifest_missing, Check.MISSING_FILE, "manifest.json"),
    (signatures_missing, Check.MISSING_FILE, "signatures.json"),
    (oversized_signatures, Check.SIZE, "limit"),
    (unsigned, Check.THRESHOLD, "0 of the 1"),
    (signed_invalid_manifest, Check.MANIFEST, "'..'"),
    (expired_manifest, Check.EXPIRED, "expired"),
    (expired_root, Check.ROOT_EXPIRED, "expired"),
    (wrong_key, Check.UNTRUSTED_KEY, "does not trust"),
    (root_key_is_not_a_bundle_key, Check.UNTRUSTED_KEY, "does not trust"),
    (one_signature_below_threshold, Check.THRESHOLD, "1 of the 2"),
    (duplicated_signature_for_threshold, Check.THRESHOLD, "1 of the 2"),
    (revoked_key, Check.REVOKED_KEY, "revoked"),
    (key_dropped_by_rotation, Check.UNTRUSTED_KEY, "does not trust"),
    (old_root_after_rotation, Check.ROOT_VERSION, "not newer"),
    (rotation_skipping_a_version, Check.ROOT_VERSION, "skips"),
    (rotation_without_old_keys, Check.UNTRUSTED_KEY, "trusted root version 1"),
    (rotation_without_new_keys, Check.UNTRUSTED_KEY, "root version 2"),
    (tampered_root_file, Check.SIGNATURE, "does not verify"),
    (root_fingerprint_mismatch, Check.ROOT_FINGERPRINT, "pinned"),
    (downgrade, Check.ROLLBACK, "1.0.1"),
    (downgrade_by_name, Check.ROLLBACK, "2.0.0"),
    (downgrade_from_release_to_prerelease, Check.ROLLBACK, "1.0.0-rc.1"),
    (sigstore_wrong_identity, Check.IDENTITY, "mallory@envex.invalid"),
    (sigstore_wrong_issuer, Check.IDENTITY, "evil.invalid"),
    (sigstore_tampered_certificate, Check.SIGSTORE, "certificate chain"),
    (sigstore_tampered_inclusion_proof, Check.SIGSTORE, "inclusion proof"),
    (sigstore_tampered_checkpoint, Check.SIGSTORE, "checkpoint"),
    (sigstore_tampered_promise, Check.SIGSTORE, "inclusion promise"),
    (sigstore_different_artifact, Check.SIGSTORE, "digest mismatch"),
    (sigstore_untrusted_instance, Check.SIGSTORE, "certificate chain"),
    (sigstore_required_but_missing, Check.MISSING_FILE, "requires a sigstore"),
    (sigstore_without_pinned_root, Check.SIGSTORE, "pins no sigstore"),
    (sigstore_garbage, Check.SIGSTORE, "not a valid sigstore bundle"),
]


def test_matrix_is_large_enough() -> None:
    assert len(ATTACKS) >= 25
    assert len({attack.__name__ for attack, _, _ in ATTACKS}) == len(ATTACKS)


def test_untampered_bundles_pass(ctx: Ctx, tmp_path: Path) -> None:
    verified = verify_bundle(ctx.fresh(tmp_path), root=ctx.root, high_water="1.0.0")
    assert (verified.name, verified.kind, verified.version, verified.file_count) == ("demo", "model", "1.0.0", 3)
    with_sigstore = verify_bundle(ctx.fresh(tmp_path, sigstore=True), root=ctx.sigstore_root)
    assert with_sigstore.sigstore_identity == (ISSUER, SUBJECT)


@pytest.mark.parametrize(("attack", "check", "detail"), ATTACKS, ids=[a.__name__ for a, _, _ in ATTACKS])
def test_attack_fails_with_named_check(
    ctx: Ctx, tmp_path: Path, attack: Callable[[Ctx, Path], None], check: Check, detail: str
) -> None:
    with pytest.raises(VerificationError) as caught:
        attack(ctx, tmp_path)
    assert caught.value.check is check, str(caught.value)
    assert detail in caught.value.message
