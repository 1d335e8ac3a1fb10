"""Kernel bundles on the CPU: staging a Triton cache, the kernel-source digest, keyed and signed manifests, the
planner installing a matching bundle and refusing each mismatched key by name, the install into a release
(read-only, launch.json pointing Triton's cache manager at it, the probe recorded), the read-only cache manager's
hits, misses and one-line refusals, and `envex bundle build --kind kernels`. Real keys and signatures throughout;
what needs a GPU (compiling, serving without a C compiler) is marked gpu; verify/lab/device_install.sh runs it there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import stat
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from envex.bundles import build_bundle, load_private_key, make_demo_trust, sign_bundle, verify_bundle
from envex.bundles.archive import BundleArchive
from envex.bundles.kernel_cache import (
    KernelCacheError,
    directory_kernel_digest,
    kernel_sources_digest,
    stage_triton_cache,
    wheel_kernel_digest,
)
from envex.bundles.manifest import Manifest
from envex.installer.media import InstallError
from envex.installer.plan import kernel_problems, make_plan, runtime_kernel_digest
from envex.installer.probe import GPU, Probe
from envex.tests.support import installer as itest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
EXPIRES = datetime.now(UTC) + timedelta(days=30)
# The kernel sources, read once: other work may edit kernels/ while the tests run, and the digest must not move.
SOURCES = {p.name: p.read_bytes() for p in sorted(KERNELS.glob("*.py"))}
DIGEST = kernel_sources_digest(SOURCES.items())
LAUNCHER = "__triton_launcher.cpython-312-x86_64-linux-gnu.so"
UTILS = "cuda_utils.cpython-312-x86_64-linux-gnu.so"


# ---- fixtures ------------------------------------------------------------------------------------------------------


def triton_cache(root: Path) -> Path:
    """A Triton cache as a warm-up leaves it: a kernel's key directory (IR stages, cubin, metadata, the group list
    naming them by absolute path), a launcher's, the driver module's, and a write Triton never finished."""
    cache = root / "triton-cache"
    kernel = cache / "KERNELKEYAAAA"
    kernel.mkdir(parents=True)
    files = {"_rms_norm.cubin": b"\x7fELF cubin", "_rms_norm.ptx": b"// ptx", "_rms_norm.json": b'{"name": "x"}'}
    for name, data in files.items():
        (kernel / name).write_bytes(data)
    group = {"child_paths": {name: str(kernel / name) for name in files}}
    (kernel / "__grp___rms_norm.json").write_text(json.dumps(group))
    (kernel / "tmp.pid_12_abc").mkdir()
    (kernel / "tmp.pid_12_abc" / "_rms_norm.cubin").write_bytes(b"half written")
    for key, name in (("LAUNCHERKEYBBBB", LAUNCHER), ("UTILSKEYCCCC", UTILS)):
        (cache / key).mkdir()
        (cache / key / name).write_bytes(b"\x7fELF module")
    return cache


def envex_wheel(out: Path, version: str = "0.1.0") -> Path:
    """A minimal installable envex wheel holding the kernel sources (what the digest reads)."""
    files = {f"envex/kernels/{name}": data for name, data in SOURCES.items()}
    info = f"envex-{version}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: envex\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"envex-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def cuda_probe(**overrides: Any) -> Probe:
    gpu = GPU(index=0, name="NVIDIA H200", compute_capability="9.0", accelerator="sm_90", memory_total=141 << 30,
              memory_free=140 << 30, mig_mode="disabled", ecc_uncorrected=0)
    values: dict[str, Any] = dict(
        mode="cuda", gpus=(gpu,), driver_version="580.159.04", cuda_driver_version="13.0", cpu_model="test",
        cpu_count=16, ram_total=128 << 30, ram_available=120 << 30, disk_free=60 << 30, python="3.12.3",
        torch="2.11.0+cu130", torch_cuda="13.0", triton="3.6.0", cuda_smoke="ok",
    )
    values.update(overrides)
    return Probe(**values)


def keys(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "accelerators": ["sm_90"], "min_driver": "580", "python": ">=3.12,<3.13", "torch": "==2.11.0",
        "triton": "==3.6.0", "cuda": "==13.0", "kernel_sources": DIGEST,
    }
    values.update(overrides)
    return values


@pytest.fixture
def trust(tmp_path: Path) -> Any:
    return make_demo_trust(tmp_path / "keys", expires=EXPIRES)


def media(tmp_path: Path, trust: Any, wheel: Path | None = None) -> Path:
    return itest.fake_media(tmp_path / "media", trust.root_path, load_private_key(trust.key_path), tmp_path / "src",
                            wheels=[wheel or envex_wheel(tmp_path / "wheels")])


def add_kernels(media_dir: Path, tmp_path: Path, trust: Any, *, name: str = "fake-kernels", version: str = "1.0.0",
                targets: dict[str, Any] | None = None, model: str = "fake-model") -> Path:
    src = tmp_path / f"staged-{name}-{version}"
    if not src.exists():
        stage_triton_cache(triton_cache(tmp_path / f"cache-{name}-{version}"), src)
    path = build_bundle(src, kind="kernels", name=name, version=version, out=media_dir / "bundles",
                        targets=targets or keys(), requires=[{"name": model, "kind": "model", "version": ">=1.0.0"}])
    sign_bundle(path, [load_private_key(trust.key_path)])
    return path


def verified(media_dir: Path, trust: Any) -> list[Any]:
    return [verify_bundle(p, root=trust.root) for p in sorted((media_dir / "bundles").glob("*.envex"))]


# ---- staging and digests -------------------------------------------------------------------------------------------


def test_staging_rewrites_group_lists_to_names_and_leaves_unfinished_writes_out(tmp_path: Path) -> None:
    staged = stage_triton_cache(triton_cache(tmp_path), tmp_path / "payload")
    assert staged.kernels == ("_rms_norm",)
    assert staged.c_modules == (f"LAUNCHERKEYBBBB/{LAUNCHER}", f"UTILSKEYCCCC/{UTILS}")
    assert staged.files == 6
    group = json.loads((tmp_path / "payload" / "KERNELKEYAAAA" / "__grp___rms_norm.json").read_text())
    assert group == {"child_paths": {n: n for n in ("_rms_norm.cubin", "_rms_norm.json", "_rms_norm.ptx")}}
    assert not list((tmp_path / "payload").rglob("tmp.*"))
    assert str(tmp_path) not in "".join(p.read_text(errors="replace") for p in (tmp_path / "payload").rglob("*.json"))


def test_staging_refuses_links_foreign_group_paths_and_empty_caches(tmp_path: Path) -> None:
    cache = triton_cache(tmp_path / "a")
    (cache / "KERNELKEYAAAA" / "evil.so").symlink_to("/etc/passwd")
    with pytest.raises(KernelCacheError, match="not a regular file"):
        stage_triton_cache(cache, tmp_path / "out-a")
    cache = triton_cache(tmp_path / "b")
    group = cache / "KERNELKEYAAAA" / "__grp___rms_norm.json"
    group.write_text(json.dumps({"child_paths": {"_rms_norm.cubin": "/elsewhere/other.cubin"}}))
    with pytest.raises(KernelCacheError, match="not the file '_rms_norm.cubin' beside it"):
        stage_triton_cache(cache, tmp_path / "out-b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KernelCacheError, match="no compiled kernels"):
        stage_triton_cache(tmp_path / "empty", tmp_path / "out-c")


def test_kernel_source_digest_is_one_value_from_the_tree_and_the_wheel(tmp_path: Path) -> None:
    tree_dir = tmp_path / "kernels"
    tree_dir.mkdir()
    for name, data in SOURCES.items():
        (tree_dir / name).write_bytes(data)
    (tree_dir / "NOTES.md").write_text("not a source")
    tree = directory_kernel_digest(tree_dir)
    assert tree == DIGEST
    assert wheel_kernel_digest(envex_wheel(tmp_path).read_bytes()) == tree
    files = list(SOURCES.items())
    assert kernel_sources_digest(reversed(files)) == tree  # order does not matter
    changed = [(n, d + b"\n# edited") if n == "norm.py" else (n, d) for n, d in files]
    assert kernel_sources_digest(changed) != tree
    with pytest.raises(KernelCacheError, match="not a readable wheel"):
        wheel_kernel_digest(b"not a zip")


# ---- manifests -----------------------------------------------------------------------------------------------------


def test_a_kernels_manifest_must_be_keyed_and_older_manifests_keep_their_bytes(tmp_path: Path) -> None:
    src = tmp_path / "payload"
    stage_triton_cache(triton_cache(tmp_path), src)
    partial = keys(cuda=None, kernel_sources=None)
    with pytest.raises(ValidationError, match="targets.cuda, targets.kernel_sources not set"):
        build_bundle(src, kind="kernels", name="k", version="1.0.0", out=tmp_path, targets=partial)
    path = build_bundle(src, kind="kernels", name="k", version="1.0.0", out=tmp_path, targets=keys())
    with BundleArchive.open(path) as archive:
        data = archive.read_metadata("manifest.json")
    assert data is not None and Manifest.from_bytes(data).targets.cuda == "==13.0"
    # A model manifest written before the kernel keys existed: the keys stay out of its canonical bytes.
    model = build_bundle(src, kind="model", name="m", version="1.0.0", out=tmp_path / "m.envex")
    with BundleArchive.open(model) as archive:
        data = archive.read_metadata("manifest.json")
    assert data is not None and b"kernel_sources" not in data and b'"cuda"' not in data
    value = json.loads(data)
    value["targets"]["cuda"] = None  # spelling the absent key out is another byte form of the same meaning
    with pytest.raises(ValueError, match="canonical"):
        Manifest.from_bytes(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


# ---- the plan ------------------------------------------------------------------------------------------------------


def test_the_plan_installs_the_kernel_bundle_whose_keys_all_match(tmp_path: Path, trust: Any) -> None:
    m = media(tmp_path, trust)
    add_kernels(m, tmp_path, trust, version="1.0.0")
    add_kernels(m, tmp_path, trust, version="1.1.0")
    add_kernels(m, tmp_path, trust, version="2.0.0", targets=keys(triton="==3.7.0"))
    plan = make_plan(verified(m, trust), cuda_probe())
    assert plan.kernels is not None and plan.kernels.version == "1.1.0"
    assert any("2.0.0" in n and "needs triton ==3.7.0; found 3.6.0" in n for n in plan.notes)
    assert plan.probe is not None and plan.probe.gpus[0].name == "NVIDIA H200"
    assert plan.engine["dtype"] == "bfloat16" and plan.engine["gpu_memory_utilization"] == 0.85
    # a bundle is compiled for the default mode: with --deterministic the plan says what it may lack
    assert plan.engine["deterministic"] is False and not any(n.startswith("deterministic") for n in plan.notes)
    det = make_plan(verified(m, trust), cuda_probe(), deterministic=True)
    assert det.kernels is not None and det.kernels.version == "1.1.0" and det.engine["deterministic"] is True
    assert any(n.startswith("deterministic: kernel bundle ") and "1.1.0 may not hold the batch-invariant" in n
               for n in det.notes), det.notes  # fmt: skip


MISMATCHES = {
    "accelerators": ({"gpus": (GPU(0, "A100", "8.0", "sm_80", 80 << 30, 80 << 30, "disabled", 0),)}, {},
                     "is built for sm_90; this machine runs sm_80"),
    "min_driver": ({"driver_version": "575.51.03"}, {}, "needs NVIDIA driver >= 580; found 575.51.03"),
    "python": ({"python": "3.11.9"}, {}, "needs python >=3.12,<3.13; found 3.11.9"),
    "torch": ({"torch": "2.10.0+cu130"}, {}, "needs torch ==2.11.0; found 2.10.0+cu130"),
    "triton": ({"triton": "3.5.1"}, {}, "needs triton ==3.6.0; found 3.5.1"),
    "cuda": ({"torch_cuda": "12.8"}, {}, "is keyed to CUDA ==13.0; torch here is built for CUDA 12.8"),
    "kernel_sources": ({}, {"kernel_sources": "0" * 64}, "was compiled from kernel sources 000000000000…"),
}


@pytest.mark.parametrize("key", sorted(MISMATCHES))
def test_the_plan_refuses_a_kernel_bundle_naming_the_key_that_differs(key: str, tmp_path: Path, trust: Any) -> None:
    host, bundle_keys, reason = MISMATCHES[key]
    m = media(tmp_path, trust)
    add_kernels(m, tmp_path, trust, targets=keys(**bundle_keys))
    plan = make_plan(verified(m, trust), cuda_probe(**host))
    assert plan.kernels is None
    refused = [n for n in plan.notes if n.startswith("refused: kernel bundle fake-kernels 1.0.0")]
    assert len(refused) == 1 and reason in refused[0], plan.notes
    assert plan.notes[-1].endswith("kernels will compile at first start (that needs a C compiler on this host)")


def test_the_plan_refuses_kernels_compiled_for_another_model_and_ignores_kernels_on_cpu(
    tmp_path: Path, trust: Any
) -> None:
    m = media(tmp_path, trust)
    add_kernels(m, tmp_path, trust, model="other-model")
    bundles = verified(m, trust)
    plan = make_plan(bundles, cuda_probe())
    assert plan.kernels is None and any("compiled for model other-model >=1.0.0" in n for n in plan.notes)
    cpu = cuda_probe(mode="cpu", gpus=(), driver_version=None, torch_cuda=None, cuda_smoke="skipped: no GPU")
    plan = make_plan(bundles, cpu)
    assert plan.kernels is None and plan.notes == ("kernel bundles hold compiled GPU code: not used in CPU mode",)


def test_the_runtime_digest_comes_from_the_signed_wheel_and_fails_closed(tmp_path: Path, trust: Any) -> None:
    m = media(tmp_path, trust)
    runtime = next(b for b in verified(m, trust) if b.kind == "runtime")
    assert runtime_kernel_digest(runtime) == DIGEST
    other = tmp_path / "no-envex"
    fake = other / "w" / "fake-0.1-py3-none-any.whl"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"not a wheel")
    m2 = media(other, trust, wheel=fake)
    add_kernels(m2, other, trust)
    runtime2 = next(b for b in verified(m2, trust) if b.kind == "runtime")
    with pytest.raises(InstallError, match="holds 0 envex wheels"):
        runtime_kernel_digest(runtime2)
    plan = make_plan(verified(m2, trust), cuda_probe())
    assert plan.kernels is None and any("runtime being installed has unknown" in n for n in plan.notes)
    kernels = next(b for b in verified(m2, trust) if b.kind == "kernels")
    assert kernel_problems(kernels, cuda_probe(), DIGEST, runtime2) != []  # not a model


# ---- the install ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_install_puts_the_bundle_into_the_release_read_only_and_launch_reads_it_through_the_manager(
    tmp_path: Path, trust: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from envex.installer import pipeline
    from envex.installer.activate import status_lines
    from envex.installer.launch import load_launch, read_launch
    from envex.installer.state import load_state
    from envex.installer.ui import InstallUI

    m = media(tmp_path, trust)
    kernels = add_kernels(m, tmp_path, trust)
    report = tmp_path / "pass.json"
    report.write_text(json.dumps(itest.PASS_REPORT))
    monkeypatch.setattr(pipeline, "probe", lambda prefix, want_gpu=True: cuda_probe())
    prefix = tmp_path / "prefix"
    options = pipeline.InstallOptions(media=m, prefix=prefix, trust_fingerprint=trust.fingerprint,
                                      test_gates_report=report)
    outcome = pipeline.install(options, InstallUI())
    assert outcome.ok, outcome.message
    slot = prefix / "current"
    cache = slot / "kernels"
    assert (cache / "KERNELKEYAAAA" / "_rms_norm.cubin").read_bytes() == b"\x7fELF cubin"
    assert all(not p.stat().st_mode & 0o222 for p in cache.rglob("*") if p.is_file())  # nothing writable
    launch, _ = read_launch(slot / "launch.json")
    sha = verify_bundle(kernels, root=trust.root).manifest_sha256
    assert launch.kernels is not None and launch.kernels.bundle.manifest_sha256 == sha
    assert launch.kernels.accelerator == "sm_90" and launch.kernels.keys == keys()
    assert launch.hardware is not None and launch.hardware["gpus"][0]["name"] == "NVIDIA H200"
    state = load_state(prefix)
    assert any(b.kind == "kernels" and b.manifest_sha256 == sha for b in state.bundles)
    lines = "\n".join(status_lines(prefix, state))
    assert f"kernels: bundle fake-kernels 1.0.0 (sm_90, triton {launch.kernels.triton}; digest {sha[:16]}…)" in lines
    assert "hardware (recorded by the install of release 0001-fake-model-1.0.0" in lines
    assert "1× NVIDIA H200 (sm_90, 141 GiB, driver 580.159.04, CUDA 13.0" in lines
    for key in ("TRITON_CACHE_MANAGER", "ENVEX_KERNEL_BUNDLE", "ENVEX_KERNEL_BUNDLE_LABEL", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(key, raising=False)
    for key in itest_offline_keys():
        monkeypatch.delenv(key, raising=False)
    load_launch(slot / "launch.json")
    assert os.environ["TRITON_CACHE_MANAGER"] == "envex.kernels.bundle_cache:BundleCacheManager"
    assert os.environ["ENVEX_KERNEL_BUNDLE"] == str(cache.resolve())
    assert os.environ["ENVEX_KERNEL_BUNDLE_LABEL"] == "fake-kernels 1.0.0"
    assert "TRITON_CACHE_DIR" not in os.environ  # misses go to Triton's own cache, never into the release


def itest_offline_keys() -> list[str]:
    from envex.installer.launch import OFFLINE_ENV

    return list(OFFLINE_ENV)


def test_launch_without_a_kernel_bundle_still_sets_the_manager_and_clears_another_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from envex.installer.launch import LaunchError, LaunchKernels, LaunchManifest, load_launch
    from envex.installer.state import BundleRef

    ref = BundleRef(name="m", kind="model", version="1.0.0", manifest_sha256="a" * 64)
    release = tmp_path / "releases" / "0001"
    (release / "model").mkdir(parents=True)
    (release / "model" / "m.gguf").write_bytes(b"gguf")
    launch = LaunchManifest(
        release="0001", created="2026-01-01T00:00:00Z", mode="cuda",
        model={"path": "model/m.gguf", "served_name": "m", "format": "gguf", "architecture": "LlamaForCausalLM",
               "quantization": "Q4_1", "sha256": "b" * 64, "bundle": ref},
        engine={"device": "cuda"}, numeric_policy="x", kv_cache={}, kernels=None,
        runtime={"envex_version": "0.1.0", "python": "3.12", "torch": None, "triton": None, "venv": "venv",
                 "bundle": ref.model_copy(update={"kind": "runtime"})},
    )
    (release / "launch.json").write_bytes(launch.to_bytes())
    monkeypatch.setenv("ENVEX_KERNEL_BUNDLE", "/somewhere/else")
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    load_launch(release / "launch.json", require_gates=False)
    assert os.environ["TRITON_CACHE_MANAGER"].endswith(":BundleCacheManager")
    assert "ENVEX_KERNEL_BUNDLE" not in os.environ
    # A release whose kernel cache went missing is refused at start, with what to do.
    kernels = LaunchKernels(cache_dir="kernels", accelerator="sm_90", triton="3.6.0", bundle=ref)
    (release / "launch.json").write_bytes(launch.model_copy(update={"kernels": kernels}).to_bytes())

    with pytest.raises(LaunchError, match="kernel bundle's cache .* is missing; reinstall the release or roll back"):
        load_launch(release / "launch.json", require_gates=False)


# ---- the read-only cache manager (Triton's interface, no GPU needed) -----------------------------------------------


@pytest.fixture
def manager_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    pytest.importorskip("triton")
    bundle = tmp_path / "bundle"
    stage_triton_cache(triton_cache(tmp_path), bundle)
    for path in bundle.rglob("*"):
        if path.is_file():
            path.chmod(0o444)
    overlay = tmp_path / "overlay"
    monkeypatch.setenv("ENVEX_KERNEL_BUNDLE", str(bundle))
    monkeypatch.setenv("ENVEX_KERNEL_BUNDLE_LABEL", "fake-kernels 1.0.0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(overlay))
    return bundle, overlay


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_the_manager_hits_the_bundle_and_never_writes_there(manager_env: tuple[Path, Path]) -> None:
    from envex.kernels.bundle_cache import BundleCacheManager

    bundle, overlay = manager_env
    before = snapshot(bundle)
    group = BundleCacheManager("KERNELKEYAAAA").get_group("_rms_norm.json")
    assert group == {n: str(bundle / "KERNELKEYAAAA" / n) for n in ("_rms_norm.cubin", "_rms_norm.json",
                                                                     "_rms_norm.ptx")}
    assert BundleCacheManager("LAUNCHERKEYBBBB").get_file(LAUNCHER) == str(bundle / "LAUNCHERKEYBBBB" / LAUNCHER)
    # A kernel the bundle lacks compiles into the overlay (Triton's own cache), and is found there next time.
    miss = BundleCacheManager("NEWKEY")
    assert miss.get_group("_new.json") is None
    cubin = miss.put(b"\x7fELF new", "_new.cubin")
    miss.put_group("_new.json", {"_new.cubin": cubin})
    assert Path(cubin).parent == overlay / "NEWKEY"
    assert BundleCacheManager("NEWKEY").get_group("_new.json") == {"_new.cubin": cubin}
    assert snapshot(bundle) == before
    assert not (overlay / "KERNELKEYAAAA").exists()  # a hit creates nothing anywhere


def test_a_missing_launcher_without_a_c_compiler_is_one_line_naming_the_kernel(
    manager_env: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from envex.kernels.bundle_cache import BundleCacheManager, KernelCacheMiss, c_compiler

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert c_compiler() is None
    BundleCacheManager("OTHERKERNEL").get_group("_fused_decode.json")  # the kernel whose launcher is built next
    with pytest.raises(KernelCacheMiss) as info:
        BundleCacheManager("MISSINGLAUNCHER").get_file(LAUNCHER)
    message = str(info.value)
    assert "\n" not in message
    assert f"the C launcher {LAUNCHER} (Triton cache key MISSINGLAUNCHER) for kernel _fused_decode" in message
    assert "not in the kernel bundle fake-kernels 1.0.0" in message and "no C compiler" in message
    # Present in the bundle: no compiler needed. A compiler present: Triton builds it (the manager says "miss").
    assert BundleCacheManager("UTILSKEYCCCC").get_file(UTILS) is not None
    monkeypatch.setenv("CC", "/usr/bin/cc")
    assert BundleCacheManager("MISSINGLAUNCHER").get_file(LAUNCHER) is None


def test_a_miss_with_an_unwritable_cache_names_the_kernel(
    manager_env: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from envex.kernels.bundle_cache import BundleCacheManager, KernelCacheMiss

    monkeypatch.setenv("TRITON_CACHE_DIR", "/proc/envex-no-cache")  # not writable, not even by root
    manager = BundleCacheManager("NEWKEY")
    assert manager.get_group("_new_kernel.json") is None
    with pytest.raises(KernelCacheMiss, match=r"Triton kernel _new_kernel is not in the kernel bundle fake-kernels "
                                              r"1.0.0 and Triton's cache /proc/envex-no-cache is not writable"):
        manager.put(b"x", "_new_kernel.cubin")
    assert BundleCacheManager("KERNELKEYAAAA").get_group("_rms_norm.json") is not None  # hits need no write


def test_triton_accepts_the_manager_by_name(manager_env: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.cache import get_cache_manager

    from envex.kernels.bundle_cache import BundleCacheManager

    monkeypatch.setenv("TRITON_CACHE_MANAGER", "envex.kernels.bundle_cache:BundleCacheManager")
    key_hex = hashlib.sha256(b"k").hexdigest()
    manager = get_cache_manager(key_hex)
    assert isinstance(manager, BundleCacheManager)
    assert manager.key == base64.b32encode(bytes.fromhex(key_hex)).decode().rstrip("=")


# ---- the command ---------------------------------------------------------------------------------------------------


def test_bundle_build_kind_kernels_from_a_staged_cache_or_a_model(tmp_path: Path) -> None:
    from envex.bundles.cli import KERNELS_FROM_MODEL, bundle_app

    runner = CliRunner()
    src = tmp_path / "payload"
    stage_triton_cache(triton_cache(tmp_path), src)
    common = ["build", "--kind", "kernels", "--name", "k", "--version", "1.0.0", "--out", str(tmp_path)]
    result = runner.invoke(bundle_app, [*common, "--src", str(src), "--accelerator", "sm_90"])
    assert result.exit_code == 2 and "targets.min_driver" in result.output and "not set" in result.output
    flags = ["--min-driver", "580", "--python", ">=3.12,<3.13", "--torch", "==2.11.0", "--triton", "==3.6.0",
             "--cuda", "==13.0", "--kernel-sources", keys()["kernel_sources"]]
    result = runner.invoke(bundle_app, [*common, "--src", str(src), "--accelerator", "sm_90", *flags])
    assert result.exit_code == 0, result.output
    calls: list[tuple[str, Path, str | None]] = []

    def stage(model: str, dest: Path, min_driver: str | None) -> dict[str, Any]:
        calls.append((model, dest, min_driver))
        stage_triton_cache(triton_cache(tmp_path / "warm"), dest)
        return keys()

    out = tmp_path / "from-model"
    out.mkdir()
    args = ["build", "--kind", "kernels", "--name", "k", "--version", "1.0.0", "--out", str(out), "--model", "m.gguf",
            "--min-driver", "575"]
    result = runner.invoke(bundle_app, args, obj={KERNELS_FROM_MODEL: stage})
    assert result.exit_code == 0, result.output
    assert calls[0][0] == "m.gguf" and calls[0][2] == "575"
    with BundleArchive.open(out / "k-1.0.0.envex") as archive:
        data = archive.read_metadata("manifest.json")
    assert data is not None
    targets = Manifest.from_bytes(data).targets
    assert targets.min_driver == "575" and targets.triton == "==3.6.0"  # an option given wins over the warm-up's
    result = runner.invoke(bundle_app, args)
    assert result.exit_code == 2 and "--model needs the engine" in result.output
    result = runner.invoke(bundle_app, [*args[:2], "model", *args[3:]], obj={KERNELS_FROM_MODEL: stage})
    assert result.exit_code == 2 and "--model builds a kernels bundle, not a model bundle" in result.output


def test_the_envex_command_passes_the_warm_up_to_bundle_build() -> None:
    from envex.bundles.cli import KERNELS_FROM_MODEL
    from envex.installer.commands import app

    assert KERNELS_FROM_MODEL in (app.info.context_settings or {}).get("obj", {})


def test_the_c_modules_key_does_not_depend_on_the_file_tool(tmp_path: Path) -> None:
    """Triton keys the driver's cuda_utils and each launcher by platform.architecture(), which asks `file`; with
    envex's kernels imported the key is the same with PATH holding python alone (no `file`, no compiler: how the
    GPU test below starts a fresh engine) as with the full PATH, so a kernel bundle's C modules are found there."""
    import subprocess
    import sys

    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(sys.executable, bare / "python")

    def key(path: str, *, envex: bool) -> str:
        code = ("import envex.kernels._common\n" if envex else "") + \
            "import triton.runtime.build as b\nprint(b.platform_key())"
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PATH": path}, capture_output=True,
                              text=True, timeout=120, check=True)  # fmt: skip
        return done.stdout.strip()

    full = os.environ.get("PATH", "")
    pinned = key(str(bare), envex=True)
    assert pinned == key(full, envex=True) and pinned.endswith(",64bit,ELF")
    if shutil.which("file") is not None:  # the fault it pins: Triton's own key without `file` differs
        assert key(str(bare), envex=False) != key(full, envex=False) == pinned


# ---- on a GPU ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_kernel_bundle_built_here_hits_every_kernel_of_a_fresh_engine(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import subprocess
    import sys

    from envex.installer.kernel_bundle import stage_kernels
    from envex.runtime.loader import EMBEDDED_MODEL

    payload = tmp_path / "payload"
    targets = stage_kernels(EMBEDDED_MODEL, payload)
    assert targets["accelerators"][0].startswith("sm_")
    assert targets["kernel_sources"] == directory_kernel_digest(KERNELS)
    for path in payload.rglob("*"):
        if path.is_file():
            path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    os.symlink(sys.executable, empty_bin / "python")
    env = {**os.environ, "PATH": str(empty_bin), "TRITON_CACHE_DIR": "/proc/envex-no-cache",
           "TRITON_CACHE_MANAGER": "envex.kernels.bundle_cache:BundleCacheManager",
           "ENVEX_KERNEL_BUNDLE": str(payload), "ENVEX_KERNEL_BUNDLE_LABEL": "test"}
    env.pop("CC", None)
    code = ("from envex.runtime.engine import LLMEngine, SamplingParams, EngineConfig\n"
            f"e = LLMEngine(EngineConfig(model={EMBEDDED_MODEL!r}, device='cuda', max_model_len=2048,"
            " max_num_seqs=8))\n"
            "c = e.tokenizer.apply_chat_template([{'role': 'user', 'content': 'What is the capital of France?'}])\n"
            "print(e.generate([c], SamplingParams(max_tokens=12, temperature=0.0))[0].text)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Paris" in proc.stdout, proc.stderr[-3000:]
