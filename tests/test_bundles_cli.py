"""`envex bundle ...` and `envex verify bundle` through typer's runner: output and exit codes scripts rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from envex.bundles.cli import bundle_app, verify_app
from envex.tests.support.bundles import flip_byte, member_offsets

app = typer.Typer()
app.add_typer(bundle_app, name="bundle")
app.add_typer(verify_app, name="verify")
runner = CliRunner()


def run(*args: str | Path) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(bundle, root.json, private key), made through the CLI alone."""
    src = tmp_path / "src"
    (src / "wheels").mkdir(parents=True)
    (src / "wheels" / "envex-0.1.0-py3-none-any.whl").write_bytes(b"PK" + bytes(1000))
    code, out, _ = run("bundle", "keygen", "--out", tmp_path / "keys", "--name", "release")
    assert code == 0 and "key id:" in out
    key = tmp_path / "keys" / "release.key"
    code, out, err = run(
        "bundle", "build", "--kind", "runtime", "--src", src, "--name", "envex-runtime", "--version", "0.1.0",
        "--out", tmp_path, "--python", ">=3.11", "--accelerator", "sm_90",
    )  # fmt: skip
    assert code == 0, err
    bundle = tmp_path / "envex-runtime-0.1.0.envex"
    assert bundle.exists()
    code, out, err = run(
        "bundle", "make-root", "--out", tmp_path / "root.json", "--root-key", tmp_path / "keys" / "release.pub.json",
        "--bundle-key", tmp_path / "keys" / "release.pub.json", "--sign", key,
    )  # fmt: skip
    assert code == 0 and "fingerprint" in out, err
    code, out, err = run("bundle", "sign", bundle, "--key", key)
    assert code == 0 and "signed" in out, err
    return bundle, tmp_path / "root.json", key


def test_verify_prints_what_was_verified(signed: tuple[Path, Path, Path]) -> None:
    bundle, root, _ = signed
    code, out, err = run("verify", "bundle", bundle, "--trust", root)
    assert code == 0, err
    assert "verified envex-runtime 0.1.0 (runtime)" in out
    assert "files:      1 (1,002 bytes)" in out
    assert "signed by:" in out and "fingerprint" in out
    assert err == ""


def test_verify_json(signed: tuple[Path, Path, Path]) -> None:
    bundle, root, _ = signed
    code, out, _ = run("verify", "bundle", bundle, "--trust", root, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["verified"] is True and result["file_count"] == 1 and result["kind"] == "runtime"
    assert len(result["signer_keyids"]) == 1


def test_verify_failure_is_one_line_naming_the_check(signed: tuple[Path, Path, Path]) -> None:
    bundle, root, _ = signed
    _, data_offset, _ = member_offsets(bundle)["payload/wheels/envex-0.1.0-py3-none-any.whl"]
    flip_byte(bundle, data_offset + 500)
    code, out, err = run("verify", "bundle", bundle, "--trust", root)
    assert code == 1
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("verification failed [digest]:")
    assert "envex-0.1.0-py3-none-any.whl" in err


def test_rollback_and_fingerprint_pins(signed: tuple[Path, Path, Path]) -> None:
    bundle, root, _ = signed
    code, _, err = run("verify", "bundle", bundle, "--trust", root, "--high-water", "0.2.0")
    assert code == 1 and "[rollback]" in err
    code, _, err = run("verify", "bundle", bundle, "--trust", root, "--fingerprint", "0" * 64)
    assert code == 1 and "[root_fingerprint]" in err


def test_root_beside_the_bundle_warns_unless_pinned(signed: tuple[Path, Path, Path]) -> None:
    bundle, root, _ = signed  # root.json sits beside the bundle
    code, out, err = run("verify", "bundle", bundle)
    assert code == 0 and "verified" in out and "not pinned" in err
    fingerprint = json.loads(run("verify", "bundle", bundle, "--json")[1])["root_fingerprint"]
    code, out, err = run("verify", "bundle", bundle, "--fingerprint", fingerprint)
    assert code == 0 and err == ""


def test_without_trust_the_media_root_is_found(signed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    bundle, root, _ = signed
    media = tmp_path / "media"  # the documented media: MEDIA/bundles/*.envex and MEDIA/trust/root.json
    (media / "bundles").mkdir(parents=True)
    (media / "trust").mkdir()
    placed = media / "bundles" / bundle.name
    placed.write_bytes(bundle.read_bytes())
    (media / "trust" / "root.json").write_bytes(root.read_bytes())
    code, out, err = run("verify", "bundle", placed)
    assert code == 0, err
    assert "verified envex-runtime 0.1.0" in out
    assert "media/trust/root.json" in err and "not pinned" in err  # the root used is named, and unpinned
    (media / "trust" / "root.json").unlink()
    code, out, err = run("verify", "bundle", placed)
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    assert "no trust root found" in err and "media/bundles/root.json" in err and "media/trust/root.json" in err
    assert "--trust" in err


def test_usage_errors_exit_2(signed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    bundle, root, key = signed
    assert run("verify", "bundle", tmp_path / "missing.envex", "--trust", root)[0] == 2
    assert run("verify", "bundle", bundle, "--trust", tmp_path / "missing.json")[0] == 2
    assert run("verify", "bundle", bundle, "--trust", root, "--high-water", "one")[0] == 2
    assert run("verify", "bundle", bundle, "--trust", root, "--fingerprint", "xyz")[0] == 2
    assert run("bundle", "build", "--kind", "firmware", "--src", tmp_path, "--name", "n", "--version", "1.0.0",
               "--out", tmp_path)[0] == 2  # fmt: skip
    assert run("bundle", "build", "--kind", "model", "--src", tmp_path, "--name", "n", "--version", "1.0",
               "--out", tmp_path)[0] == 2  # fmt: skip
    assert run("bundle", "sign", bundle, "--key", tmp_path / "nokey")[0] == 2
    assert run("bundle", "keygen", "--out", key.parent, "--name", "release")[0] == 2  # never overwrites a key
    assert run("verify")[0] == 2


def test_envex_bundle_build_refuses_a_model_without_a_valid_card(tmp_path: Path) -> None:
    # Through the envex command, which passes the installer's card check in (bundles cannot import the installer).
    from envex.installer.commands import app as envex_app
    from envex.tests.support import installer as itest

    def build(src: Path) -> tuple[int, str, str]:
        result = runner.invoke(envex_app, ["bundle", "build", "--kind", "model", "--src", str(src), "--name", "m",
                                           "--version", "1.0.0", "--out", str(tmp_path / "out")])
        return result.exit_code, result.stdout, result.stderr

    card = itest.fake_model_card()
    src = itest.write_model_src(tmp_path / "src", card)
    (src / "envex-model.json").unlink()
    missing = {}
    bad = card.model_dump(mode="json")
    del bad["quantization"]
    cases = {
        "missing": (lambda: None, ["envex-model.json: missing", "write it"]),
        "invalid": (lambda: (src / "envex-model.json").write_text(json.dumps(bad)),
                    ["envex-model.json: invalid (quantization: Field required)", "offline_docs/install.md"]),
        "weights": (lambda: (src / "envex-model.json").write_text(card.model_copy(update={"weights": "fak.gguf"})
                                                                   .model_dump_json()),
                    ["field `weights` is 'fak.gguf'", "closest: fake.gguf"]),
        "hf dir": (lambda: (src / "envex-model.json").write_text(card.model_copy(update={"format": "hf",
                                                                                          "weights": "."})
                                                                  .model_dump_json()),
                   ["field `weights` is '.'", "config.json"]),
    }
    for what, (prepare, needles) in cases.items():
        prepare()
        code, out, err = build(src)
        missing[what] = [n for n in needles if n not in err]
        assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), (what, err)
        assert "Traceback" not in err
    assert missing == dict.fromkeys(cases, []), missing
    assert not (tmp_path / "out").exists(), "a refused card still wrote a bundle"
    (src / "envex-model.json").write_text(card.model_dump_json())
    code, out, err = build(src)
    assert code == 0 and "built" in out, err


def test_unsigned_bundle_fails_threshold(tmp_path: Path, signed: tuple[Path, Path, Path]) -> None:
    _, root, _ = signed
    src = tmp_path / "m"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"\1" * 64)
    assert run("bundle", "build", "--kind", "model", "--src", src, "--name", "m", "--version", "1.0.0",
               "--out", tmp_path / "m.envex")[0] == 0  # fmt: skip
    code, _, err = run("verify", "bundle", tmp_path / "m.envex", "--trust", root)
    assert code == 1 and "[threshold]" in err
