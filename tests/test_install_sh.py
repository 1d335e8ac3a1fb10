"""The media's `install.sh` (issue 40): it says what it is doing before each long step, with the count of wheels, and
lets pip print its own progress; demo media run with a python3 that lacks envex's dependencies stop in one line
naming them, not in envex-install's ModuleNotFoundError.

install.sh verifies nothing itself (envex-install does, first), so the runtime bundle here is an unsigned tar of the
payload it reads: `envex-runtime.json` and `wheelhouse/`. The demo cases carry the real envex wheel; `--help` stands
for envex-install's arguments, so the bootstrap runs whole in seconds.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from envex.installer.demo import INSTALL_SH, build_envex_wheel, source_root


def make_media(media: Path, wheels: list[Path], wheelhouse: str) -> Path:
    (media / "bundles").mkdir(parents=True)
    (media / "install.sh").write_bytes(INSTALL_SH.read_bytes())
    with tarfile.open(media / "bundles" / "envex-runtime-0.1.0.envex", "w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(f"payload/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("envex-runtime.json", json.dumps({"wheelhouse": wheelhouse, "install": ["envex"]}).encode())
        for wheel in wheels:
            add(f"wheelhouse/{wheel.name}", wheel.read_bytes())
    return media


def tiny_envex_wheel(out: Path) -> Path:
    """An `envex` wheel with no dependencies whose envex-install prints its arguments: a complete wheelhouse of one."""
    path = out / "envex-0.1.0-py3-none-any.whl"
    info = "envex-0.1.0.dist-info"
    files = {
        "envex_tiny.py": (
            "import pathlib, sys\ndef main():\n    print('envex-install', *sys.argv[1:])\n"
            "    pyc = sorted(pathlib.Path(__file__).parent.glob('__pycache__/envex_unused*.pyc'))\n"
            "    print('byte-compiled ahead:', bool(pyc))\n"
        ),
        "envex_unused.py": "X = 1\n",  # never imported: a .pyc of it comes only from pip's compile step
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: envex\nVersion: 0.1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\nenvex-install = envex_tiny:main\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    return path


def run_install_sh(media: Path, python: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHON": python, "HOME": str(media.parent)}
    cmd = ["sh", str(media / "install.sh"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


def says(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("install.sh: ")]


@pytest.fixture(scope="module")
def envex_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if source_root() is None:
        pytest.skip("needs the envex source tree to build the wheel")
    return build_envex_wheel(tmp_path_factory.mktemp("wheel"))


def test_each_step_is_announced_with_the_wheel_count_demo(tmp_path: Path, envex_wheel: Path) -> None:
    media = make_media(tmp_path / "media", [envex_wheel], "demo")
    done = run_install_sh(media, sys.executable, "--help")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = says(done.stdout)
    assert [line.split("]")[0] for line in lines if "[" in line] == [f"install.sh: [{i}/4" for i in range(1, 5)]
    assert lines[0].startswith("install.sh: Python 3.") and str(media) in lines[0]
    assert "envex-runtime-0.1.0.envex: 1 wheel, demo wheelhouse" in done.stdout
    assert "[3/4] installing the 1 wheel of the demo wheelhouse (pip --no-index: nothing is downloaded)" in done.stdout
    # pip's own lines, between step 3 and step 4, then envex-install itself (its --help)
    out = done.stdout
    assert out.index("[3/4]") < out.index("Successfully installed envex-0.1.0") < out.index("[4/4]")
    assert out.index("[4/4]") < out.index("envex-install")


def test_each_step_is_announced_with_the_wheel_count_complete(tmp_path: Path) -> None:
    media = make_media(tmp_path / "media", [tiny_envex_wheel(tmp_path / "wheels")], "complete")
    done = run_install_sh(media, sys.executable, "--prefix", "/nowhere")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "envex-runtime-0.1.0.envex: 1 wheel, complete wheelhouse" in out
    assert "[3/4] installing envex and its dependencies from the 1 wheel (pip --no-index" in out
    assert out.index("[3/4]") < out.index("Successfully installed envex-0.1.0") < out.index("[4/4]")
    assert f"envex-install --media {media} --prefix /nowhere" in out
    # The temporary venv is not byte-compiled ahead (pip --no-compile): compiling a full wheelhouse took 4x as long
    # as installing it; Python compiles what envex-install imports as it imports it.
    assert "byte-compiled ahead: False" in out


def test_demo_media_with_a_python_lacking_the_dependencies_fail_in_one_line(tmp_path: Path, envex_wheel: Path) -> None:
    # A python3 without site-packages (-S): what a plain system python3 is to envex, whatever this host has installed.
    bare = tmp_path / "python3-bare"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    media = make_media(tmp_path / "media", [envex_wheel], "demo")
    done = run_install_sh(media, str(bare), "--prefix", str(tmp_path / "prefix"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"error: {bare} lacks envex's dependencies ")
    listed = errors[0].split(" lacks envex's dependencies ")[1].split(" (demo media")[0].split()
    assert "typer>=0.12" in listed and "torch>=2.4" in listed and not any("pytest" in d for d in listed)  # no extras
    assert "PYTHON=" in errors[0] and "complete wheelhouse" in errors[0]
    assert "[4/4]" not in done.stdout and not (tmp_path / "prefix").exists()
