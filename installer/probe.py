"""Step 2: what this machine has. GPUs through nvidia-ml-py, CPU/RAM/disk through psutil, a torch CUDA smoke test.

No GPU, no driver, no NVML library: a valid result (CPU mode), never a crash. Every failure of a probe is
recorded as a note in the result rather than raised.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    compute_capability: str  # "9.0"
    accelerator: str  # "sm_90", as bundles' targets name it
    memory_total: int
    memory_free: int
    mig_mode: str  # "enabled" | "disabled" | "unsupported"
    ecc_uncorrected: int | None  # volatile uncorrected ECC errors; None where ECC is unsupported


@dataclass(frozen=True)
class Probe:
    mode: str  # "cuda" | "cpu"
    gpus: tuple[GPU, ...]
    driver_version: str | None
    cuda_driver_version: str | None  # the CUDA version the driver supports, e.g. "12.4"
    cpu_model: str
    cpu_count: int
    ram_total: int
    ram_available: int
    disk_free: int
    python: str
    torch: str | None
    torch_cuda: str | None
    triton: str | None
    cuda_smoke: str  # "ok" | "skipped: ..." | "failed: ..."
    notes: tuple[str, ...] = field(default=())

    @property
    def accelerator(self) -> str:
        return self.gpus[0].accelerator if self.gpus else "cpu"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Probe:
        """The probe `as_dict` recorded (launch.json's `hardware`); ValueError when it is not one."""
        try:
            values = dict(data)
            values["gpus"] = tuple(GPU(**g) for g in values.get("gpus", ()))
            values["notes"] = tuple(values.get("notes", ()))
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a recorded probe ({exc})") from None

    def summary(self) -> str:
        gib = 1 << 30
        if self.gpus:
            g = self.gpus[0]
            return (
                f"{len(self.gpus)}× {g.name} ({g.accelerator}, {g.memory_total / gib:.0f} GiB, driver "
                f"{self.driver_version}, CUDA {self.cuda_driver_version}, MIG {g.mig_mode}), "
                f"smoke test {self.cuda_smoke}"
            )
        return (
            f"CPU mode: {self.cpu_count} cores, {self.ram_total / gib:.1f} GiB RAM, "
            f"{self.disk_free / gib:.1f} GiB free disk"
        )


def _nvml(notes: list[str]) -> tuple[list[GPU], str | None, str | None]:
    try:
        import pynvml
    except ImportError:
        notes.append("nvidia-ml-py is not installed: no GPU probe")
        return [], None, None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no GPU here
        notes.append(f"NVML unavailable ({exc}): CPU mode")
        return [], None, None
    gpus: list[GPU] = []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        cuda_text = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GPU(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    compute_capability=f"{major}.{minor}",
                    accelerator=f"sm_{major}{minor}",
                    memory_total=int(memory.total),
                    memory_free=int(memory.free),
                    mig_mode=_mig(pynvml, handle),
                    ecc_uncorrected=_ecc(pynvml, handle),
                )
            )
    except Exception as exc:
        notes.append(f"NVML query failed ({exc}): CPU mode")
        return [], None, None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return gpus, driver, cuda_text


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _mig(pynvml: Any, handle: Any) -> str:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except Exception:
        return "unsupported"
    return "enabled" if current else "disabled"


def _ecc(pynvml: Any, handle: Any) -> int | None:
    try:
        return int(
            pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
    except Exception:
        return None


def _cuda_smoke(want_cuda: bool) -> tuple[str | None, str | None, str]:
    if not want_cuda:  # no GPU: the version is all we need, without the seconds torch takes to import
        return _dist_version("torch"), None, "skipped: no GPU"
    try:
        import torch
    except ImportError:
        return None, None, "skipped: torch is not installed"
    version = torch.__version__
    cuda_build = torch.version.cuda
    try:
        if not torch.cuda.is_available():
            return version, cuda_build, "failed: torch sees no CUDA device although NVML does"
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        expected = a @ a
        got = (a.cuda() @ a.cuda()).cpu()
        torch.cuda.synchronize()
        err = float((got - expected).abs().max() / expected.abs().max())
        if not err < 1e-2:
            return version, cuda_build, f"failed: a 256x256 matmul on the GPU differs from the CPU (rel. err {err:.2e})"
        return version, cuda_build, "ok"
    except Exception as exc:
        return version, cuda_build, f"failed: {type(exc).__name__}: {exc}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def probe(disk_path: Path, *, want_gpu: bool = True) -> Probe:
    """Probe this machine; `disk_path` is where the release will be written (its nearest existing parent counts)."""
    import psutil

    notes: list[str] = []
    gpus, driver, cuda = _nvml(notes) if want_gpu else ([], None, None)
    if not want_gpu:
        notes.append("GPU probe disabled (--cpu): CPU mode")
    torch_version, torch_cuda, smoke = _cuda_smoke(bool(gpus))
    if gpus and smoke != "ok":
        notes.append(f"CUDA smoke test {smoke}: CPU mode")
    mode = "cuda" if gpus and smoke == "ok" else "cpu"
    existing = Path(disk_path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    memory = psutil.virtual_memory()
    return Probe(
        mode=mode,
        gpus=tuple(gpus),
        driver_version=driver,
        cuda_driver_version=cuda,
        cpu_model=_cpu_model(),
        cpu_count=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        ram_total=int(memory.total),
        ram_available=int(memory.available),
        disk_free=int(shutil.disk_usage(existing).free),
        python=platform.python_version(),
        torch=torch_version,
        torch_cuda=torch_cuda,
        triton=_dist_version("triton"),
        cuda_smoke=smoke,
        notes=tuple(notes) + (() if sys.platform.startswith("linux") else (f"untested platform {sys.platform}",)),
    )
