"""What the gates take and return: the engine protocol they drive, the numeric policy, and the JSON reports."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import torch

from envex.runtime.engine import Completion, RequestOutput, SamplingParams

Verdict = Literal["pass", "fail"]


class GateEngine(Protocol):
    """The part of `LLMEngine` the gates use; tests pass wrappers with planted faults through the same door."""

    tokenizer: Any
    max_model_len: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def full_logits(self, token_ids: list[int]) -> torch.Tensor: ...


@dataclass(frozen=True)
class NumericPolicy:
    """How the engine computes: device type and weight/activation dtype (later: a low-bit weight format)."""

    device: str  # "cpu" | "cuda"
    dtype: str  # "float32" | "bfloat16" | "float16"
    backend: str = "torch"  # "torch" (the reference kernels) | "triton"
    weights: str = "dense"  # "dense" now; low-bit formats later

    @classmethod
    def of(cls, engine: object) -> NumericPolicy:
        """Read the policy from an LLMEngine (or anything that forwards `runner`), float32 CPU otherwise."""
        runner = getattr(engine, "runner", None)
        if runner is None:
            return cls("cpu", "float32")
        backend = type(getattr(runner, "ops", None)).__name__.removesuffix("Ops").lower() or "torch"
        return cls(torch.device(runner.device).type, str(runner.dtype).removeprefix("torch."), backend)

    @property
    def name(self) -> str:
        return f"{self.device}-{self.dtype}-{self.backend}" + ("" if self.weights == "dense" else f"-{self.weights}")

    def computes_like(self, reference_policy: str) -> bool:
        """Whether greedy tokens must be identical to the reference's: the same dtype through the same torch
        kernels on a CPU. On a GPU even float32 differs in summation order between cuBLAS shapes (envex packs
        q/k/v into one matmul), so there the top-k rule applies."""
        return self.device == "cpu" and self.name == reference_policy


@dataclass(frozen=True)
class GateResult:
    name: str
    verdict: Verdict
    thresholds: dict[str, Any]
    evidence: dict[str, Any]
    seconds: float
    summary: str  # one line for people: what was measured against what

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


@dataclass(frozen=True)
class GateReport:
    suite: str
    model: str
    engine_policy: str
    reference_policy: str
    verdict: Verdict
    gates: tuple[GateResult, ...]
    created: str
    seconds: float
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str)

    def gate(self, name: str) -> GateResult:
        for g in self.gates:
            if g.name == name:
                return g
        raise KeyError(f"gate {name!r} is not in this report; it has {', '.join(g.name for g in self.gates)}")
