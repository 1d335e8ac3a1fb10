"""The bundles API end to end: build, sign (thresholds), verify, extract, rotate, fingerprints, models, keys."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from envex.bundles import (
    BuildError,
    Check,
    Manifest,
    Requirement,
    SemVer,
    SigstoreIdentity,
    SigstorePolicy,
    VerificationError,
    VerifiedBundle,
    build_bundle,
    generate_key,
    key_id,
    load_private_key,
    load_public_key,
    load_root,
    make_demo_trust,
    make_root,
    normalize_fingerprint,
    root_fingerprint,
    rotate_root,
    sign_bundle,
    sign_root,
    verify_bundle,
    write_key_files,
)
from envex.bundles.archive import BundleArchive
from envex.bundles.canonical import CanonicalJSONError, canonical_bytes, parse_json
from envex.tests.support.bundles import SyntheticSigstore, flip_byte, member_offsets

NOW = datetime.now(UTC).replace(microsecond=0)
LATER = NOW + timedelta(days=30)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    (root / "tokenizer").mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 64}\n')
    (root / "model.safetensors").write_bytes(os.urandom(300_000))
    (root / "tokenizer" / "tokenizer.json").write_text("{}\n")
    (root / "empty.txt").write_bytes(b"")
    return root


def one_key_root(key: Any, **kwargs: Any) -> Any:
    return sign_root(make_root(root_keys=[key], bundle_keys=[key], expires=LATER, **kwargs), [key])


def test_build_sign_verify_extract_roundtrip(src: Path, tmp_path: Path) -> None:
    key = generate_key()
    root = one_key_root(key)
    path = build_bundle(
        src,
        kind="model",
        name="smollm2-135m-instruct",
        version="1.2.3",
        out=tmp_path,
        targets={
            "accelerators": ["sm_90", "sm_80"],
            "min_driver": "535.104.05",
            "python": ">=3.11",
            "torch": "==2.5.1",
            "triton": "==3.1.0",
        },
        requires=[{"name": "envex-runtime", "kind": "runtime", "version": ">=0.1.0,<0.2.0"}],
    )
    assert path.name == "smollm2-135m-instruct-1.2.3.envex"
    sign_bundle(path, [key])
    verified = verify_bundle(path, root=root, high_water="1.2.3")  # the same version is a reinstall: allowed
    assert verify_bundle(path, root=root, high_water={"other": "9.9.9", "smollm2-135m-instruct": "1.0.0"})
    assert verified.file_count == 4
    assert verified.total_bytes == 300_000 + len('{"hidden_size": 64}\n') + 3
    assert verified.signer_keyids == (key_id(key),)
    assert verified.root_fingerprint == root.fingerprint
    assert verified.manifest.targets.accelerators == ["sm_90", "sm_80"]
    assert verified.manifest.requires[0].allows("0.1.5")
    dest = verified.extract(tmp_path / "release" / "model")
    for entry in verified.manifest.files:
        assert (dest / entry.path).read_bytes() == (src / entry.path).read_bytes()
        assert stat.S_IMODE((dest / entry.path).stat().st_mode) == 0o644
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no staging left behind
    summary = verified.summary()
    assert summary["name"] == "smollm2-135m-instruct" and summary["file_count"] == 4


def test_threshold_signers_sign_in_turn(src: Path, tmp_path: Path) -> None:
    k_root, k1, k2, k3 = (generate_key() for _ in range(4))
    root = sign_root(
        make_root(root_keys=[k_root], bundle_keys=[k1, k2, k3], bundle_threshold=2, expires=LATER), [k_root]
    )
    path = build_bundle(src, kind="runtime", name="envex-runtime", version="0.1.0", out=tmp_path)
    sign_bundle(path, [k1])
    with pytest.raises(VerificationError) as caught:
        verify_bundle(path, root=root)
    assert caught.value.check is Check.THRESHOLD
    sign_bundle(path, [k3])  # a second holder, later, elsewhere
    verified = verify_bundle(path, root=root)
    assert set(verified.signer_keyids) == {key_id(k1), key_id(k3)}


def test_extract_refuses_existing_destination_and_low_disk(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = generate_key()
    path = build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    sign_bundle(path, [key])
    verified = verify_bundle(path, root=one_key_root(key))
    (tmp_path / "taken").mkdir()
    with pytest.raises(VerificationError) as caught:
        verified.extract(tmp_path / "taken")
    assert caught.value.check is Check.DESTINATION

    class Usage:
        free = 10

    monkeypatch.setattr(shutil, "disk_usage", lambda _path: Usage())
    with pytest.raises(VerificationError) as caught:
        verified.extract(tmp_path / "out")
    assert caught.value.check is Check.DISK_SPACE
    assert not (tmp_path / "out").exists()


def test_extract_rehashes_a_bundle_changed_after_verification(src: Path, tmp_path: Path) -> None:
    key = generate_key()
    path = build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    sign_bundle(path, [key])
    verified = verify_bundle(path, root=one_key_root(key))
    _, data_offset, size = member_offsets(path)["payload/model.safetensors"]
    flip_byte(path, data_offset + size - 1)  # swapped media between verify and install
    with pytest.raises(VerificationError) as caught:
        verified.extract(tmp_path / "out")
    assert caught.value.check is Check.DIGEST
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_read_file_rechecks_the_manifest(src: Path, tmp_path: Path) -> None:
    key = generate_key()
    path = build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    sign_bundle(path, [key])
    verified = verify_bundle(path, root=one_key_root(key))
    assert verified.read_file("config.json") == (src / "config.json").read_bytes()
    for name, limit, check in [("nope.json", 1 << 20, Check.MISSING_FILE), ("model.safetensors", 1000, Check.SIZE)]:
        with pytest.raises(VerificationError) as caught:
            verified.read_file(name, max_bytes=limit)
        assert caught.value.check is check
    _, data_offset, _ = member_offsets(path)["payload/config.json"]
    flip_byte(path, data_offset)
    with pytest.raises(VerificationError) as caught:
        verified.read_file("config.json")
    assert caught.value.check is Check.DIGEST


def test_verified_bundle_cannot_be_forged() -> None:
    with pytest.raises(TypeError):
        VerifiedBundle(  # type: ignore[call-arg]
            path=Path("x"),
            manifest=None,  # type: ignore[arg-type]
            manifest_sha256="",
            signer_keyids=(),
            sigstore_identity=None,
            root_version=1,
            root_fingerprint="",
        )


def test_rotation_chain_new_keys_verify_old_stop(src: Path, tmp_path: Path) -> None:
    k_root1, k_root2, k_bundle1, k_bundle2 = (generate_key() for _ in range(4))
    v1 = sign_root(make_root(root_keys=[k_root1], bundle_keys=[k_bundle1], expires=LATER), [k_root1])
    # v2 hands the root role to a new key: signed by the old root key and the new one.
    v2_signed = make_root(
        root_keys=[k_root2], bundle_keys=[k_bundle2], version=2, expires=LATER, revoked_keyids=[key_id(k_bundle1)]
    )
    v2 = rotate_root(v1, sign_root(sign_root(v2_signed, [k_root1]), [k_root2]).to_bytes())
    assert v2.version == 2
    # v3 needs only v2's key now: v1's root key has no say any more.
    v3 = rotate_root(
        v2, sign_root(make_root(root_keys=[k_root2], bundle_keys=[k_bundle2], version=3, expires=LATER), [k_root2])
    )
    assert v3.version == 3
    new = build_bundle(src, kind="model", name="m", version="2.0.0", out=tmp_path / "new.envex")
    sign_bundle(new, [k_bundle2])
    old = build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path / "old.envex")
    sign_bundle(old, [k_bundle1])
    assert verify_bundle(new, root=v3).version == "2.0.0"
    assert verify_bundle(old, root=v1).version == "1.0.0"
    with pytest.raises(VerificationError) as caught:
        verify_bundle(old, root=v2)
    assert caught.value.check is Check.REVOKED_KEY
    with pytest.raises(VerificationError) as caught:
        verify_bundle(new, root=v1)
    assert caught.value.check is Check.UNTRUSTED_KEY


def test_rotation_through_an_expired_intermediate_root() -> None:
    key = generate_key()
    v1 = one_key_root(key)
    v2 = sign_root(make_root(root_keys=[key], bundle_keys=[key], version=2, expires=NOW - timedelta(days=1)), [key])
    v3 = sign_root(make_root(root_keys=[key], bundle_keys=[key], version=3, expires=LATER), [key])
    assert rotate_root(rotate_root(v1, v2), v3).version == 3


def test_root_threshold_of_two() -> None:
    k1, k2, k3 = generate_key(), generate_key(), generate_key()
    signed = make_root(root_keys=[k1, k2, k3], root_threshold=2, bundle_keys=[k1], expires=LATER)
    with pytest.raises(VerificationError) as caught:
        load_root(sign_root(signed, [k1]).to_bytes())
    assert caught.value.check is Check.THRESHOLD
    assert load_root(sign_root(signed, [k1, k3]).to_bytes()).version == 1


def test_fingerprint_is_stable_and_pins(tmp_path: Path) -> None:
    k1, k2 = generate_key(), generate_key()
    signed = make_root(root_keys=[k1, k2], bundle_keys=[k1], expires=LATER)
    once, twice = sign_root(signed, [k1]), sign_root(signed, [k1, k2])
    assert root_fingerprint(once) == root_fingerprint(twice) == root_fingerprint(signed)
    other = make_root(root_keys=[k1, k2], bundle_keys=[k2], expires=LATER)
    assert root_fingerprint(other) != root_fingerprint(signed)
    fp = once.fingerprint
    spaced = ":".join(fp[i : i + 4] for i in range(0, 64, 4)).upper()
    assert normalize_fingerprint("SHA256:" + spaced) == fp
    (tmp_path / "root.json").write_text(json.dumps(json.loads(once.to_bytes()), indent=2))  # pretty-printed is fine
    assert load_root(tmp_path / "root.json", fingerprint=spaced).fingerprint == fp


def test_root_models_reject_inconsistent_roots() -> None:
    k1, k2 = generate_key(), generate_key()
    with pytest.raises(ValidationError, match="threshold 2 is more than"):
        make_root(root_keys=[k1], root_threshold=2, bundle_keys=[k1], expires=LATER)
    with pytest.raises(ValidationError, match="revoked"):
        make_root(root_keys=[k1], bundle_keys=[k2], revoked_keyids=[key_id(k2)], expires=LATER)
    value = json.loads(one_key_root(k1).to_bytes())
    value["signed"]["surprise"] = 1
    with pytest.raises(VerificationError) as caught:
        load_root(json.dumps(value).encode())
    assert caught.value.check is Check.TRUST_ROOT
    value = json.loads(one_key_root(k1).to_bytes())
    entry = value["signed"]["keys"].pop(key_id(k1))
    value["signed"]["keys"][key_id(k2)] = entry  # a key id that is not its key's hash
    with pytest.raises(VerificationError) as caught:
        load_root(json.dumps(value).encode())
    assert caught.value.check is Check.TRUST_ROOT


def test_demo_trust(tmp_path: Path, src: Path) -> None:
    demo = make_demo_trust(tmp_path / "trust", expires=LATER)
    assert stat.S_IMODE(demo.key_path.stat().st_mode) == 0o600
    root = load_root(demo.root_path, fingerprint=demo.fingerprint)
    keyed = {"accelerators": ["sm_90"], "min_driver": "580", "python": ">=3.12,<3.13", "torch": "==2.11.0",
             "triton": "==3.6.0", "cuda": "==13.0", "kernel_sources": "0" * 64}  # a kernels bundle names them all
    path = build_bundle(src, kind="kernels", name="kernels-sm90", version="0.1.0", out=tmp_path, targets=keyed)
    sign_bundle(path, [load_private_key(demo.key_path)])
    assert verify_bundle(path, root=root).kind == "kernels"


def test_key_files(tmp_path: Path) -> None:
    key = generate_key()
    private, public = write_key_files(key, tmp_path, "release")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert key_id(load_private_key(private)) == key_id(key)
    assert key_id(load_public_key(public)) == key_id(key)
    assert key_id(load_public_key(private)) == key_id(key)
    with pytest.raises(FileExistsError):
        write_key_files(generate_key(), tmp_path, "release")
    assert key_id(load_private_key(private)) == key_id(key)  # never overwritten


def test_build_refuses_links_and_special_files(tmp_path: Path, src: Path) -> None:
    (src / "link").symlink_to(src / "config.json")
    with pytest.raises(BuildError, match="symlink"):
        build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    (src / "link").unlink()
    os.mkfifo(src / "pipe")
    with pytest.raises(BuildError, match="not a regular file"):
        build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    (src / "pipe").unlink()
    (src / "a name with spaces").write_text("x")
    with pytest.raises(BuildError, match="characters outside"):
        build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    assert not list(tmp_path.glob("*.envex")) and not list(tmp_path.glob(".*partial"))


def test_build_rejects_bad_metadata_before_reading(src: Path, tmp_path: Path) -> None:
    for bad in ({"version": "1.0"}, {"name": "Bad Name"}, {"kind": "firmware"}):
        options: dict[str, Any] = {"kind": "model", "name": "m", "version": "1.0.0"} | bad
        with pytest.raises(ValidationError):
            build_bundle(src, out=tmp_path, **options)
    with pytest.raises(ValidationError):
        build_bundle(
            src,
            kind="model",
            name="m",
            version="1.0.0",
            out=tmp_path,
            targets={
                "accelerators": ["sm_90"],
                "min_driver": None,
                "python": "3.11 or later",
                "torch": None,
                "triton": None,
            },
        )


def test_manifest_is_strict_and_canonical(src: Path, tmp_path: Path) -> None:
    path = build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    with BundleArchive.open(path) as archive:
        data = archive.read_metadata("manifest.json")
    assert data is not None
    manifest = Manifest.from_bytes(data)
    assert manifest.to_bytes() == data
    value = json.loads(data)
    for mutate, message in [
        (lambda v: v.update(extra=1), "Extra inputs"),
        (lambda v: v["targets"].pop("torch"), "torch"),
        (lambda v: v["files"].reverse(), "sorted"),
        (lambda v: v["files"][0].update(sha256="ABC"), "sha256"),
        (lambda v: v["files"][0].update(size=-1), "size"),
        (lambda v: v["files"][0].update(size="12"), "size"),
        (lambda v: v.update(expires=v["created"]), "not after"),
        (lambda v: v.update(created="2025-01-01 00:00:00"), "timestamp"),
        (lambda v: v["files"].append({**v["files"][-1], "path": v["files"][-1]["path"] + "/x"}), "both a file"),
    ]:
        changed = json.loads(data)
        mutate(changed)
        with pytest.raises(ValueError, match=message):
            Manifest.from_bytes(canonical_bytes(changed))
    with pytest.raises(ValueError, match="canonical"):
        Manifest.from_bytes(json.dumps(value, indent=1).encode())


def test_canonical_json() -> None:
    assert canonical_bytes({"b": [1, True, None], "a": "é\n"}) == b'{"a":"\xc3\xa9\\n","b":[1,true,null]}'
    with pytest.raises(CanonicalJSONError):
        canonical_bytes({"x": 1.5})
    with pytest.raises(CanonicalJSONError, match="duplicate"):
        parse_json(b'{"a":1,"a":2}', require_canonical=False)
    with pytest.raises(CanonicalJSONError):
        parse_json(b'{"a":NaN}', require_canonical=False)
    with pytest.raises(CanonicalJSONError):
        parse_json(b"[" * 100_000 + b"]" * 100_000, require_canonical=False)
    with pytest.raises(CanonicalJSONError, match="canonical"):
        parse_json(b'{"b":1, "a":2}', require_canonical=True)


def test_semver_order_and_requirements() -> None:
    order = [
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-alpha.beta",
        "1.0.0-beta",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0-rc.1",
        "1.0.0",
        "1.0.1",
        "1.10.0",
        "2.0.0",
    ]
    parsed = [SemVer.parse(v) for v in order]
    assert parsed == sorted(parsed) and len(set(parsed)) == len(parsed)
    assert SemVer.parse("1.0.0+build.5") == SemVer.parse("1.0.0")
    for bad in ("01.0.0", "1.0", "\u0661.\u0660.\u0660", "1.0.0-"):  # leading zero, short, Arabic-Indic digits
        with pytest.raises(ValueError):
            SemVer.parse(bad)
    req = Requirement(name="envex-runtime", kind="runtime", version=">=0.1.0,<0.2.0")
    assert req.allows("0.1.9") and not req.allows("0.2.0") and not req.allows("0.1.0-rc.1")
    with pytest.raises(ValidationError):
        Requirement(name="envex-runtime", kind="runtime", version="~=0.1")


def test_sigstore_verification_is_offline_and_writes_nothing(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = generate_key()
    instance = SyntheticSigstore(now=NOW - timedelta(minutes=1))
    policy = SigstorePolicy(
        identities=[SigstoreIdentity(issuer="https://issuer.invalid", subject="https://ci.invalid/release.yml")],
        required=True,
        trusted_root=instance.trusted_root(),
    )
    root = one_key_root(key, sigstore=policy)
    path = build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path)
    with BundleArchive.open(path) as archive:
        manifest = archive.read_metadata("manifest.json")
    assert manifest is not None
    sign_bundle(
        path,
        [key],
        sigstore_bundle=instance.sign(
            manifest, subject="https://ci.invalid/release.yml", issuer="https://issuer.invalid"
        ),
    )
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network use during verification: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    verified = verify_bundle(path, root=root)
    assert verified.sigstore_identity == ("https://issuer.invalid", "https://ci.invalid/release.yml")
    assert list(home.iterdir()) == []


def test_import_is_light() -> None:
    code = "import sys, envex.bundles; print(sorted(m for m in ('torch', 'sigstore', 'requests') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
