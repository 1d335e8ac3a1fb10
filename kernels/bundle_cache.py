"""Triton's cache manager for a served release: the installed kernel bundle, read-only, over a writable overlay.

Why not Triton's own FileCacheManager pointed at the bundle (checked against triton 3.6 and 3.9):
- its group lists (`__grp__<kernel>.json`) name each kernel's files by absolute path on the machine that compiled
  them, so a cache copied anywhere else never hits (3.9 drops the group, 3.6 drops the files: both recompile);
- its constructor creates the key's directory and every miss writes into the cache, so a read-only bundle turns the
  first missing kernel into an OSError from deep inside a kernel launch.

This manager (selected with TRITON_CACHE_MANAGER=envex.kernels.bundle_cache:BundleCacheManager) reads a key from
the bundle directory first (`ENVEX_KERNEL_BUNDLE`; group lists resolved inside the key's directory, never through
the paths they hold) and never writes there. A miss falls through to Triton's usual cache directory
(TRITON_CACHE_DIR, default ~/.triton/cache): read if present, written only when Triton compiles. When a C module
(a kernel's launcher, or the driver's cuda_utils) is missing everywhere and the host has no C compiler, it raises
`KernelCacheMiss`, one line naming the kernel and what to do, at the first launch of that kernel: the engine's
warm-up at start, not a request. Triton passes a manager nothing but the key, so its settings come from the
environment, which `envex serve --launch` sets before the engine starts.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import ClassVar

from triton.runtime.cache import CacheManager, FileCacheManager

MANAGER = "envex.kernels.bundle_cache:BundleCacheManager"
BUNDLE_ENV = "ENVEX_KERNEL_BUNDLE"  # the installed bundle's Triton cache directory; unset: the release has none
LABEL_ENV = "ENVEX_KERNEL_BUNDLE_LABEL"  # "name version" of that bundle, for messages
GROUP_PREFIX = "__grp__"
C_MODULE_SUFFIX = ".so"
_MAX_GROUP_BYTES = 1 << 20


class KernelCacheMiss(OSError):
    """A compiled kernel piece is in neither the kernel bundle nor Triton's cache, and it cannot be built here."""


def c_compiler() -> str | None:
    """The C compiler Triton would use to build a launcher: $CC, else gcc, else clang on PATH (triton.runtime.build)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def _overlay_dir() -> str | None:
    from triton import knobs

    return knobs.cache.dir or None


class BundleCacheManager(CacheManager):
    # The last kernel looked up, so that a missing launcher (looked up by a hash of its C source) can be named.
    last_kernel: ClassVar[str | None] = None

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.key = key
        self._debug = override or dump  # TRITON_KERNEL_OVERRIDE / TRITON_KERNEL_DUMP: Triton's own debug paths
        bundle = os.environ.get(BUNDLE_ENV)
        self.bundle_dir = os.path.join(bundle, key) if bundle and not self._debug else None
        overlay = _overlay_dir()
        self.overlay_dir = os.path.join(overlay, key) if overlay else None
        self._writer: FileCacheManager | None = FileCacheManager(key, override, dump) if self._debug else None

    # ---- reads: the bundle first, then the overlay ---------------------------------------------------------

    def _find(self, filename: str) -> str | None:
        for base in (self.bundle_dir, self.overlay_dir):
            if base is not None:
                path = os.path.join(base, filename)
                if os.path.isfile(path):
                    return path
        return None

    def get_file(self, filename: str) -> str | None:
        if self._writer is not None and self._debug:
            return self._writer.get_file(filename)
        found = self._find(filename)
        if found is None and filename.endswith(C_MODULE_SUFFIX) and c_compiler() is None:
            raise KernelCacheMiss(self._miss_message(filename))
        return found

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._writer is not None and self._debug:
            return self._writer.get_group(filename)
        BundleCacheManager.last_kernel = filename.removesuffix(".json")
        for base in (self.bundle_dir, self.overlay_dir):
            if base is None:
                continue
            group = _read_group(os.path.join(base, GROUP_PREFIX + filename), base)
            if group is not None:
                return group
        return None

    # ---- writes: the overlay only ----------------------------------------------------------------------------

    def _overlay(self) -> FileCacheManager:
        if self._writer is None:
            try:
                self._writer = FileCacheManager(self.key)  # creates <TRITON_CACHE_DIR>/<key>
            except OSError as exc:
                raise KernelCacheMiss(
                    f"Triton kernel {BundleCacheManager.last_kernel or '?'} is not in {self._label()} and Triton's "
                    f"cache {_overlay_dir()} is not writable ({exc.strerror or exc}) to compile it; rebuild the "
                    "kernel bundle for this release (envex bundle build --kind kernels) or make TRITON_CACHE_DIR "
                    "writable"
                ) from None
        return self._writer

    def put(self, data: bytes | str, filename: str, binary: bool = True) -> str:
        return self._overlay().put(data, filename, binary)

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        return self._overlay().put_group(filename, group)

    # ---- messages --------------------------------------------------------------------------------------------

    @staticmethod
    def _label() -> str:
        label = os.environ.get(LABEL_ENV)
        if os.environ.get(BUNDLE_ENV):
            return f"the kernel bundle {label}" if label else "the kernel bundle"
        return "a kernel bundle (this release has none)"

    def _miss_message(self, filename: str) -> str:
        what = "the CUDA driver module" if filename.startswith("cuda_utils") else "the C launcher"
        kernel = BundleCacheManager.last_kernel or "?"
        return (
            f"{what} {filename} (Triton cache key {self.key}) for kernel {kernel} is not in {self._label()} nor in "
            f"Triton's cache, and this host has no C compiler to build it (CC unset, no gcc or clang on PATH); "
            "install a kernel bundle built for this GPU, driver, torch, triton and engine settings "
            "(envex bundle build --kind kernels), or install a C compiler"
        )


def _read_group(path: str, base: str) -> dict[str, str] | None:
    """A group list's files, each resolved by name inside `base`; None when the list or any file is missing."""
    try:
        if os.path.getsize(path) > _MAX_GROUP_BYTES:
            return None
        with open(path, encoding="utf-8") as handle:
            children = json.load(handle)["child_paths"]
        names = [(str(name), os.path.basename(str(p))) for name, p in children.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    group: dict[str, str] = {}
    for name, base_name in names:
        if name != base_name:
            return None
        child = os.path.join(base, base_name)
        if not os.path.isfile(child):
            return None
        group[name] = child
    return group or None
