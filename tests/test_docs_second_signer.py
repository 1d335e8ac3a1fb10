"""bundles.md, "A customer's own model under a vendor's root": the commands it gives do what it says. The vendor's
next root adds the customer's key to `bundles`; the pinned root accepts it as a rotation; the customer's bundle
verifies under it and not under the old root; and that key signs any bundle (no delegations), runtime included."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from envex.bundles import Check, VerificationError, load_root, rotate_root, verify_bundle
from envex.bundles.cli import bundle_app, verify_app

app = typer.Typer()
app.add_typer(bundle_app, name="bundle")
app.add_typer(verify_app, name="verify")
runner = CliRunner()


def run(*args: str | Path) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stdout + result.stderr
    return result.stdout


def test_a_second_signer_added_to_the_bundles_role(tmp_path: Path) -> None:
    vendor, customer = tmp_path / "vendor", tmp_path / "customer-keys"
    run("bundle", "keygen", "--out", vendor, "--name", "root")
    run("bundle", "keygen", "--out", vendor, "--name", "bundles")
    customer_id = run("bundle", "keygen", "--out", customer, "--name", "customer").split()[2]
    common = ["--root-key", vendor / "root.pub.json", "--bundle-key", vendor / "bundles.pub.json"]
    run("bundle", "make-root", "--out", tmp_path / "root-1.json", *common, "--sign", vendor / "root.key")
    # as bundles.md gives it: the next version, the customer's public key beside the vendor's, signed by the vendor
    run(
        "bundle", "make-root", "--out", tmp_path / "root.json", "--version", "2", *common,
        "--bundle-key", customer / "customer.pub.json", "--sign", vendor / "root.key",
    )  # fmt: skip
    old = load_root(tmp_path / "root-1.json")
    new = rotate_root(old, tmp_path / "root.json")  # what the installer does with a pinned v1
    assert customer_id in new.signed.roles.bundles.keyids and new.signed.roles.bundles.threshold == 1

    src = tmp_path / "my-model"
    src.mkdir()
    (src / "weights.bin").write_bytes(bytes(64))
    for kind, name in (("model", "my-model"), ("runtime", "envex-runtime")):
        run("bundle", "build", "--kind", kind, "--src", src, "--name", name, "--version", "1.0.0", "--out", tmp_path)
        bundle = tmp_path / f"{name}-1.0.0.envex"
        run("bundle", "sign", bundle, "--key", customer / "customer.key")
        out = run("verify", "bundle", bundle, "--trust", tmp_path / "root.json")
        assert f"signed by:  {customer_id}" in out  # what the admin reads
        assert verify_bundle(bundle, root=new).signer_keyids == (customer_id,)
        with pytest.raises(VerificationError) as refused:
            verify_bundle(bundle, root=old)
        assert refused.value.check is Check.UNTRUSTED_KEY
