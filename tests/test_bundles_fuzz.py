"""Hypothesis fuzzing: whatever the manifest, archive, signatures, root or sigstore bundle, verification either
returns a VerifiedBundle or raises VerificationError; no other exception ever escapes.

Manifests are signed by the trusted key, so fuzzed manifests get past the signature check into parsing, where
a hostile-but-signed document would be interpreted.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from envex.bundles import (
    SigstoreIdentity,
    SigstorePolicy,
    VerificationError,
    VerifiedBundle,
    build_bundle,
    generate_key,
    load_root,
    make_root,
    sign_bundle,
    sign_root,
    verify_bundle,
)
from envex.bundles.archive import BundleArchive
from envex.bundles.canonical import canonical_bytes
from envex.bundles.keys import sign
from envex.tests.support.bundles import SyntheticSigstore, tar_bytes

NOW = datetime.now(UTC).replace(microsecond=0)
KEY = generate_key()
ROOT = sign_root(make_root(root_keys=[KEY], bundle_keys=[KEY], expires=NOW + timedelta(days=30)), [KEY])
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _clean_bundle() -> tuple[bytes, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        (src / "sub").mkdir(parents=True)
        (src / "a.txt").write_bytes(b"alpha\n")
        (src / "sub" / "b.bin").write_bytes(bytes(range(256)) * 5)
        path = build_bundle(src, kind="model", name="fuzz", version="1.0.0", out=Path(tmp) / "f.envex")
        sign_bundle(path, [KEY])
        with BundleArchive.open(path) as archive:
            manifest = archive.read_metadata("manifest.json")
        assert manifest is not None
        return path.read_bytes(), json.loads(manifest)


CLEAN, MANIFEST = _clean_bundle()


def verify_bytes(data: bytes, **kwargs: Any) -> VerifiedBundle | VerificationError:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.envex"
        path.write_bytes(data)
        try:
            return verify_bundle(path, root=kwargs.pop("root", ROOT), **kwargs)
        except VerificationError as exc:
            assert exc.check and exc.message
            return exc


def signed_bundle(manifest_bytes: bytes, payload: dict[str, bytes], *, extra: bytes | None = None) -> bytes:
    signatures = canonical_bytes({"signatures": [{"keyid": ROOT.signed.roles.bundles.keyids[0],
                                                  "sig": sign(KEY, manifest_bytes)}]})  # fmt: skip
    members = [(tarfile.TarInfo("payload/" + name), data) for name, data in payload.items()]
    members += [(tarfile.TarInfo("manifest.json"), manifest_bytes), (tarfile.TarInfo("signatures.json"), signatures)]
    if extra is not None:
        members.append((tarfile.TarInfo("manifest.json.sigstore.json"), extra))
    return tar_bytes(members)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)


def _mutate_manifest(draw: st.DrawFn) -> dict[str, Any]:
    manifest = json.loads(json.dumps(MANIFEST))
    for _ in range(draw(st.integers(1, 4))):
        target: Any = manifest
        path = draw(st.sampled_from([(), ("targets",), ("files", 0), ("files", 1)]))
        for step in path:  # an earlier mutation may have replaced the container; then mutate the top level
            inner = target[step] if isinstance(target, dict | list) and _has(target, step) else None
            target = inner if isinstance(inner, dict) else manifest
        key = draw(st.sampled_from(sorted(target) + ["unknown"]))
        if draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = draw(json_values)
    return manifest


def _has(container: dict[str, Any] | list[Any], step: Any) -> bool:
    return step in container if isinstance(container, dict) else isinstance(step, int) and step < len(container)


mutated_manifests = st.composite(_mutate_manifest)


@FUZZ
@given(value=json_values)
def test_arbitrary_signed_json_manifest(value: Any) -> None:
    result = verify_bytes(signed_bundle(canonical_bytes(value), {"a.txt": b"alpha\n"}))
    assert isinstance(result, VerificationError)


@FUZZ
@given(manifest=mutated_manifests())
def test_mutated_signed_manifest(manifest: dict[str, Any]) -> None:
    payload = {"a.txt": b"alpha\n", "sub/b.bin": bytes(range(256)) * 5}
    result = verify_bytes(signed_bundle(canonical_bytes(manifest), payload))
    assert isinstance(result, VerifiedBundle | VerificationError)


@FUZZ
@given(raw=st.binary(max_size=2000))
def test_arbitrary_signed_manifest_bytes(raw: bytes) -> None:
    assert isinstance(verify_bytes(signed_bundle(raw, {})), VerificationError)


@FUZZ
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "cut", "insert", "delete", "overwrite"]),
            st.integers(0, len(CLEAN) - 1),
            st.binary(min_size=1, max_size=64),
        ),  # fmt: skip
        min_size=1,
        max_size=4,
    )
)
def test_mutated_archive_bytes(edits: list[tuple[str, int, bytes]]) -> None:
    data = bytearray(CLEAN)
    for op, at, blob in edits:
        at %= max(len(data), 1)
        if op == "flip" and data:
            data[at] ^= blob[0] or 1
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = blob
        elif op == "delete":
            del data[at : at + len(blob)]
        else:
            data[at : at + len(blob)] = blob
    result = verify_bytes(bytes(data))
    if isinstance(result, VerifiedBundle):  # only edits in padding or after the end marker may leave it valid
        assert result.manifest.model_dump(mode="json") == MANIFEST


member_types = st.sampled_from(
    [
        tarfile.REGTYPE,
        tarfile.AREGTYPE,
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.BLKTYPE,
        tarfile.FIFOTYPE,
        tarfile.CONTTYPE,
    ]  # fmt: skip
)
member_names = st.one_of(
    st.sampled_from(["manifest.json", "signatures.json", "manifest.json.sigstore.json", "payload/a.txt",
                     "payload/sub/b.bin", "payload/../x", "/etc/passwd", "payload/", "payload//a", "payload/./a"]),
    st.text(min_size=1, max_size=30).map(lambda s: "payload/" + s),
    st.text(min_size=1, max_size=30),
)  # fmt: skip


@FUZZ
@given(
    members=st.lists(
        st.tuples(member_names, member_types, st.binary(max_size=64), st.text(max_size=20)), min_size=0, max_size=6
    )
)
def test_arbitrary_tar_structures(members: list[tuple[str, bytes, bytes, str]]) -> None:
    infos = []
    for name, kind, data, link in members:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = link
        infos.append((info, data if info.isreg() else b""))
    try:
        data = tar_bytes(infos)
    except (ValueError, UnicodeError):  # tarfile cannot write some names; nothing to verify then
        return
    assert isinstance(verify_bytes(data), VerificationError)


def raw_member(info: tarfile.TarInfo, data: bytes) -> bytes:
    info.size = len(data)
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape") + data + bytes(-len(data) % 512)


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


pax_records = st.lists(
    st.tuples(
        st.sampled_from(["path", "linkpath", "size", "mtime", "GNU.sparse.map", "comment", "x"]) | st.text(max_size=8),
        member_names | st.integers(-5, 2**40).map(str),
    ),
    max_size=4,
).map(lambda records: b"".join(_pax_record(k, v) for k, v in records))


@FUZZ
@given(pax=st.binary(max_size=400) | pax_records, name=member_names, kind=member_types)
@example(pax="11 size=\u00b2\n".encode(), name="manifest.json", kind=tarfile.REGTYPE)  # found by this test
def test_arbitrary_pax_extended_headers(pax: bytes, name: str, kind: bytes) -> None:
    # A raw pax `x` header with arbitrary records, applied to an arbitrary member, in front of the real bundle.
    extended = tarfile.TarInfo("PaxHeaders/x")
    extended.type = tarfile.XHDTYPE
    member = tarfile.TarInfo(name)
    member.type = kind
    try:
        head = raw_member(extended, pax) + raw_member(member, b"abc" if member.isreg() else b"")
    except (ValueError, UnicodeError):  # a name ustar cannot hold
        return
    result = verify_bytes(head + CLEAN)
    assert isinstance(result, VerificationError | VerifiedBundle)


@FUZZ
@given(signatures=json_values | st.binary(max_size=300).map(lambda b: {"raw": b.hex()}))
def test_arbitrary_signatures_json(signatures: Any) -> None:
    manifest = canonical_bytes(MANIFEST)
    members = [
        (tarfile.TarInfo("payload/a.txt"), b"alpha\n"),
        (tarfile.TarInfo("payload/sub/b.bin"), bytes(range(256)) * 5),
        (tarfile.TarInfo("manifest.json"), manifest),
        (tarfile.TarInfo("signatures.json"), canonical_bytes(signatures)),
    ]
    assert isinstance(verify_bytes(tar_bytes(members)), VerificationError)


@FUZZ
@given(root=json_values | st.binary(max_size=500))
def test_arbitrary_root_json(root: Any) -> None:
    data = root if isinstance(root, bytes) else canonical_bytes({"signed": root, "signatures": []})
    with pytest.raises(VerificationError):
        load_root(data)


SIGSTORE = SyntheticSigstore(now=NOW - timedelta(minutes=1))
SIGSTORE_ROOT = sign_root(
    make_root(
        root_keys=[KEY],
        bundle_keys=[KEY],
        expires=NOW + timedelta(days=30),
        sigstore=SigstorePolicy(
            identities=[SigstoreIdentity(issuer="https://i.invalid", subject="a@b.invalid")],
            required=True,
            trusted_root=SIGSTORE.trusted_root(),
        ),
    ),
    [KEY],
)
SIGSTORE_BUNDLE = json.loads(
    SIGSTORE.sign(canonical_bytes(MANIFEST), subject="a@b.invalid", issuer="https://i.invalid")
)


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))]
    return [path]


SIGSTORE_LEAVES = _leaves(SIGSTORE_BUNDLE)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(SIGSTORE_LEAVES), json_values), min_size=1, max_size=3))
def test_mutated_sigstore_bundle(edits: list[tuple[tuple[Any, ...], Any]]) -> None:
    bundle = json.loads(json.dumps(SIGSTORE_BUNDLE))
    for path, value in edits:
        target = bundle
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    data = signed_bundle(
        canonical_bytes(MANIFEST),
        {"a.txt": b"alpha\n", "sub/b.bin": bytes(range(256)) * 5},
        extra=json.dumps(bundle).encode(),
    )
    result = verify_bytes(data, root=SIGSTORE_ROOT)
    assert isinstance(result, VerificationError | VerifiedBundle)


def test_unmutated_sigstore_bundle_verifies() -> None:
    data = signed_bundle(
        canonical_bytes(MANIFEST),
        {"a.txt": b"alpha\n", "sub/b.bin": bytes(range(256)) * 5},
        extra=json.dumps(SIGSTORE_BUNDLE).encode(),
    )
    result = verify_bytes(data, root=SIGSTORE_ROOT)
    assert isinstance(result, VerifiedBundle), result
