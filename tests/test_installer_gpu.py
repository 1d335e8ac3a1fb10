"""The hardware probe on a real GPU (skipped without CUDA): NVML and the torch smoke test agree on CUDA mode.

Imports only the probe (stdlib, psutil, nvidia-ml-py, torch), so it runs where the rest of envex is not installed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_probe_finds_the_gpu_and_passes_the_smoke_test(tmp_path):
    from envex.installer.probe import probe

    found = probe(tmp_path)
    assert found.mode == "cuda", found.notes
    assert found.cuda_smoke == "ok"
    gpu = found.gpus[0]
    major, minor = torch.cuda.get_device_capability(0)
    assert gpu.accelerator == f"sm_{major}{minor}" == found.accelerator
    assert gpu.name and gpu.memory_total > 1 << 30 and 0 < gpu.memory_free <= gpu.memory_total
    assert gpu.mig_mode in ("enabled", "disabled", "unsupported")
    assert found.driver_version and found.cuda_driver_version and found.torch_cuda
    assert len(found.gpus) == torch.cuda.device_count()
    print(found.summary(), found.as_dict()["gpus"][0])
    # CPU-only install on a GPU machine (--cpu) skips the GPU entirely
    assert probe(tmp_path, want_gpu=False).mode == "cpu"
