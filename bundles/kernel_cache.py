"""The payload of a kernels bundle: a compiled Triton cache, staged so that it can be read anywhere it is installed.

Triton's cache (`TRITON_CACHE_DIR`) holds one directory per compilation key: the kernel's cubin and metadata
json (and its IR stages), and the small C modules Triton builds with the host's C compiler (each kernel
signature's `__triton_launcher*.so`, the driver's `cuda_utils*.so`). A `__grp__<kernel>.json` file lists a
kernel's files by *absolute path* on the machine that compiled it, so a copied cache never hits with Triton's
own cache manager. Staging rewrites those lists to bare file names (the installed bundle is read through
`envex.kernels.bundle_cache`, which resolves them inside the key's directory), and leaves out Triton's
half-written `tmp.*` directories.

`kernel_sources_digest` keys a kernels bundle to the kernel code it was compiled from: the installer compares it
with the digest of the envex wheel in the runtime bundle being installed. Standard library only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

GROUP_PREFIX = "__grp__"
# The C modules Triton compiles with the host's C compiler, by file name: what an appliance without one needs.
C_MODULE_SUFFIX = ".so"
# Where the kernel sources live inside an envex wheel (pyproject maps the package envex.kernels onto kernels/).
WHEEL_KERNELS_DIR = "envex/kernels"
MAX_GROUP_BYTES = 1 << 20
MAX_WHEEL_BYTES = 256 << 20


class KernelCacheError(ValueError):
    """A directory is not a Triton cache that can be bundled; the message names the file and the problem."""


def kernel_sources_digest(files: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over (file name, sha256 of its bytes) of every kernels/*.py, sorted by name: one value per code base.

    Names, not paths, so the same sources give the same digest from a source tree, an installed package or a wheel.
    """
    digest = hashlib.sha256()
    for name, data in sorted(files):
        digest.update(f"{name}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return digest.hexdigest()


def directory_kernel_digest(kernels_dir: Path) -> str:
    """The kernel-source digest of a kernels/ package directory (its top-level *.py files)."""
    files = [(p.name, p.read_bytes()) for p in sorted(Path(kernels_dir).glob("*.py")) if p.is_file()]
    if not files:
        raise KernelCacheError(f"{kernels_dir}: no *.py files; is this the envex kernels package?")
    return kernel_sources_digest(files)


def wheel_kernel_digest(wheel: bytes) -> str:
    """The kernel-source digest of an envex wheel's envex/kernels/*.py (the same value as the source tree's)."""
    try:
        with zipfile.ZipFile(io.BytesIO(wheel)) as archive:
            files = []
            for info in archive.infolist():
                path = PurePosixPath(info.filename)
                if str(path.parent) == WHEEL_KERNELS_DIR and path.suffix == ".py":
                    files.append((path.name, archive.read(info)))
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise KernelCacheError(f"not a readable wheel ({exc})") from None
    if not files:
        raise KernelCacheError(f"the wheel holds no {WHEEL_KERNELS_DIR}/*.py; is it an envex wheel?")
    return kernel_sources_digest(files)


@dataclass(frozen=True)
class StagedCache:
    """What a staged Triton cache holds: kernel names (one per compiled variant), C modules, files, bytes."""

    kernels: tuple[str, ...]
    c_modules: tuple[str, ...]
    files: int
    bytes: int


def stage_triton_cache(cache: Path, dest: Path) -> StagedCache:
    """Copy the Triton cache `cache` into `dest` (created; must not exist) as a bundle payload: every key directory's
    regular files, group lists rewritten to bare names. Refuses links, special files and group lists that name
    files outside their key directory or missing from it."""
    cache, dest = Path(cache), Path(dest)
    if not cache.is_dir():
        raise KernelCacheError(f"{cache}: not a directory; give the TRITON_CACHE_DIR the warm-up filled")
    dest.mkdir(parents=True)
    kernels: list[str] = []
    c_modules: list[str] = []
    files = size = 0
    for key_dir in sorted(cache.iterdir()):
        mode = os.lstat(key_dir).st_mode
        if not stat.S_ISDIR(mode):
            raise KernelCacheError(f"{key_dir}: not a key directory (Triton's cache holds only directories)")
        names = sorted(p.name for p in key_dir.iterdir())
        plain = [n for n in names if not n.startswith("tmp.")]  # tmp.pid_*: a write Triton did not finish
        if not plain:
            continue
        (dest / key_dir.name).mkdir()
        for name in plain:
            source = key_dir / name
            if not stat.S_ISREG(os.lstat(source).st_mode):
                raise KernelCacheError(f"{source}: not a regular file; bundles hold regular files only")
            target = dest / key_dir.name / name
            if name.startswith(GROUP_PREFIX):
                children = _group_children(source, plain)
                target.write_text(json.dumps({"child_paths": children}, sort_keys=True))
                kernels.append(name[len(GROUP_PREFIX) :].removesuffix(".json"))
            else:
                shutil.copyfile(source, target)
                if name.endswith(C_MODULE_SUFFIX):
                    c_modules.append(f"{key_dir.name}/{name}")
            files += 1
            size += target.stat().st_size
    if not files:
        raise KernelCacheError(f"{cache}: holds no compiled kernels; did the warm-up run on a GPU with Triton?")
    return StagedCache(tuple(sorted(kernels)), tuple(sorted(c_modules)), files, size)


def _group_children(group: Path, present: list[str]) -> dict[str, str]:
    if group.stat().st_size > MAX_GROUP_BYTES:
        raise KernelCacheError(f"{group}: larger than {MAX_GROUP_BYTES} bytes; not a Triton group list")
    try:
        children = json.loads(group.read_text(encoding="utf-8"))["child_paths"]
        pairs = [(str(name), str(path)) for name, path in children.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KernelCacheError(f"{group}: not a Triton group list ({exc})") from None
    out: dict[str, str] = {}
    for name, path in pairs:
        base = PurePosixPath(path).name
        if name != base or base not in present:
            raise KernelCacheError(f"{group}: lists {path!r}, which is not the file {name!r} beside it")
        out[name] = base
    return out
