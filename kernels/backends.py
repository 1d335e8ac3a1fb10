"""The backends, what each supports, and the factory: the one place a backend is chosen by name.

A backend is a setting pair of the engine's config (`backend`, `deterministic`). Its capabilities are stated here,
beside its constructor, so the engine's config can check a model's needs against them without importing Triton
(EngineConfig.resolved); the classes live in their own files (torch_ops.py, triton_ops.py, invariant_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from envex.kernels.ops import LINEAR_ATTENTION, MLA, MOE, SINKS, SLIDING_WINDOW, Capabilities, Ops
from envex.kernels.torch_ops import InvariantTorchOps, TorchOps

NAMES = ("torch", "triton")


@dataclass(frozen=True)
class Backend:
    name: str  # "torch" | "triton"
    invariant: bool  # the batch-invariant (deterministic) form
    capabilities: Capabilities

    def make(self, device: torch.device, *, split_k: bool = True) -> Ops:
        """This backend's Ops on `device`. split_k: the Triton backends may hand O and down on as split-K partials
        to the next norm (off under tensor parallelism, where that norm all-reduces its input first)."""
        if device.type not in self.capabilities.devices:
            raise ValueError(f"{self.label}: runs on {', '.join(sorted(self.capabilities.devices))}, not "
                             f"{device.type}")  # fmt: skip
        if self.name == "torch":
            return InvariantTorchOps() if self.invariant else TorchOps()
        pdl = torch.cuda.get_device_capability(device) >= (9, 0)
        if self.invariant:  # Triton imports: only where the fast path runs
            from envex.kernels.invariant_ops import InvariantTritonOps

            return InvariantTritonOps(pdl=pdl, split_k=split_k)
        from envex.kernels.triton_ops import TritonOps

        return TritonOps(pdl=pdl, split_k=split_k)

    @property
    def label(self) -> str:
        return f"the {'batch-invariant ' if self.invariant else ''}{self.name} backend"


_ALL = frozenset({MOE, SINKS, SLIDING_WINDOW, MLA, LINEAR_ATTENTION})
BACKENDS: dict[tuple[str, bool], Backend] = {
    # kernels/reference.py: every feature, any device.
    ("torch", False): Backend("torch", False, Capabilities(devices=frozenset({"cpu", "cuda"}), features=_ALL,
                                                          packed_weights=True)),
    # Its invariant forms hold on the CPU only (cuBLAS picks kernels by shape); no invariant MoE, sinks, windows,
    # packed weights.
    ("torch", True): Backend("torch", True, Capabilities(devices=frozenset({"cpu"}), features=frozenset(),
                                                         batch_invariant=True, ordered_all_reduce=True)),
    # The CUDA fast path: every feature.
    ("triton", False): Backend("triton", False, Capabilities(devices=frozenset({"cuda"}), features=_ALL,
                                                            packed_weights=True)),
    # invariant_matmul and invariant_attention: dense layers only so far.
    ("triton", True): Backend("triton", True, Capabilities(devices=frozenset({"cuda"}), features=frozenset(),
                                                           batch_invariant=True, ordered_all_reduce=True)),
}


def backend(name: str, *, deterministic: bool = False) -> Backend:
    if name not in NAMES:
        raise ValueError(f"backend: {name!r} is not one of {', '.join(NAMES)}")
    return BACKENDS[(name, deterministic)]
