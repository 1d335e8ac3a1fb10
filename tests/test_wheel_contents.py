"""The envex wheel ships the product and nothing else: no tests, no test support, no lab (device scripts, kernel
benches, raw results). pyproject.toml lists the product packages only: neither envex.tests (nor its folder) nor
envex.verify.lab. The lab comes with verify/ in the editable install; envex.tests is registered by tests/conftest.py
(and by the lab, for its tools that use the test support).

The wheel is built the way the installer's demo builds it (installer.demo.build_envex_wheel: pip wheel, offline, no
build isolation, from a fresh copy of the tree without build/), here from a checkout whose build/lib holds what an
older build left there.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from envex.installer.demo import build_envex_wheel, copy_source

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("runtime", "kernels", "bundles", "installer", "verify", "offline_docs")


@pytest.fixture(scope="module")
def names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    work = tmp_path_factory.mktemp("wheel")
    src = copy_source(ROOT, work / "src")
    # what a build made before the wheel left the tests out keeps in build/lib (the wheel takes all of build/lib)
    for stale in ("tests/conftest.py", "verify/lab/devcarry.py"):
        (src / "build" / "lib" / "envex" / stale).parent.mkdir(parents=True, exist_ok=True)
        (src / "build" / "lib" / "envex" / stale).write_text("")
    wheel = build_envex_wheel(work / "out", root=src)
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def product_files(pattern: str) -> set[str]:
    """The product's files matching `pattern` in the checkout, as wheel names (the lab left out)."""
    found = set()
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob(pattern):
            rel = path.relative_to(ROOT)
            if "__pycache__" not in rel.parts and rel.parts[:2] != ("verify", "lab"):
                found.add(f"envex/{rel.as_posix()}")
    return found


def test_the_wheel_ships_no_tests_and_no_lab(names: list[str]) -> None:
    assert [n for n in names if n.startswith("envex/tests/")] == []
    assert [n for n in names if n.startswith("envex/verify/lab/")] == []
    product = [n for n in names if not n.split("/")[0].endswith(".dist-info")]
    assert [n for n in product if n.endswith((".patch", ".txt", ".sh"))] == ["envex/installer/install.sh"]
    basenames = {n.rsplit("/", 1)[-1] for n in names}
    for lab in ("cuda_check.py", "devcarry.py", "device_install.py", "device_setup.sh", "bench_server.py",
                "_bench_lib.py", "perf_table.py", "admin_screenshot.py", "bench_install.py", "conftest.py",
                "browser.py"):
        assert lab not in basenames, lab
    # the raw results (verify/lab/results/*.json) are nowhere; the only JSON is the gates' own data
    assert sorted(n for n in names if n.endswith(".json")) == [
        "envex/verify/data_code_edit.json",
        "envex/verify/data_coding_tasks.json",
        "envex/verify/data_corpus.json",
        "envex/verify/data_needle.json",
        "envex/verify/data_prompts.json",
    ]
    tops = {n.split("/")[1] for n in names if n.startswith("envex/")}
    assert tops == set(PRODUCT)


def test_the_wheel_ships_the_whole_product(names: list[str]) -> None:
    for name in (
        "envex/runtime/engine/engine.py",
        "envex/runtime/parallel/__init__.py",
        "envex/runtime/server/app.py",
        "envex/kernels/reference.py",
        "envex/bundles/verify.py",
        "envex/installer/cli.py",
        "envex/installer/commands.py",
        "envex/installer/install.sh",
        "envex/installer/admin/__init__.py",
        "envex/installer/admin/base.html",
        "envex/installer/admin/admin.css",
        "envex/installer/admin/admin.js",
        "envex/offline_docs/index.md",
        "envex/offline_docs/admin-overview.png",
        "envex/verify/gates.py",
        "envex/verify/data.py",
        "envex/verify/data_prompts.json",
    ):
        assert name in names, name
    # every module, template and doc of the product folders, so a new subpackage missing from pyproject fails here
    shipped = set(names)
    for pattern in ("*.py", "*.html", "*.css", "*.js", "*.json", "*.md", "*.png"):
        missing = sorted(product_files(pattern) - shipped)
        assert missing == [], f"product files not in the wheel: {missing}"


def test_the_source_only_packages_stay_importable_from_the_checkout(tmp_path: Path) -> None:
    """The lab comes with verify/ in the editable install (pip install -e); envex.tests, which no install maps, is
    registered by tests/conftest.py for the tests and by the lab for its tools that import the test support."""
    import envex.tests.support.browser
    import envex.verify.lab
    import envex.verify.lab.kernel_bench

    assert Path(envex.verify.lab.__file__).parent == ROOT / "verify" / "lab"
    assert Path(envex.verify.lab.kernel_bench.__file__).parent == ROOT / "verify" / "lab" / "kernel_bench"
    assert Path(envex.tests.support.browser.__file__) == ROOT / "tests" / "support" / "browser.py"
    # The lab's tools that import envex.tests.support, as they are run: a process of their own, outside the checkout.
    code = ("import envex.verify.lab.admin_screenshot, envex.verify.lab.bench_install, envex.tests.support.browser\n"
            "print(envex.tests.support.browser.__file__)")
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip()).resolve() == ROOT / "tests" / "support" / "browser.py"
