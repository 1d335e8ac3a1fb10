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
    """How the engine computes: device type, activation dtype, kernels, and the packed formats it serves (a low-bit
    KV cache, low-bit weights), which the suite's reference checks take into account (`packed_formats`)."""

    device: str  # "cpu" | "cuda"
    dtype: str  # "float32" | "bfloat16" | "float16"
    backend: str = "torch"  # "torch" (the reference kernels) | "triton"
    weights: str = "dense"  # "dense", or the weights policy quantized at load (EngineConfig.weights)
    kv_cache: str = "bf16"  # EngineConfig.kv_cache_dtype: "bf16" (unpacked, the activation dtype) | "fp8" | "int4"

    @classmethod
    def of(cls, engine: object) -> NumericPolicy:
        """Read the policy from an LLMEngine (or anything that forwards `runner` and `config`), float32 CPU
        otherwise."""
        runner = getattr(engine, "runner", None)
        if runner is None:
            return cls("cpu", "float32")
        backend = type(getattr(runner, "ops", None)).__name__.removesuffix("Ops").lower() or "torch"
        config = getattr(engine, "config", None)
        return cls(torch.device(runner.device).type, str(runner.dtype).removeprefix("torch."), backend,
                   _packed_weights(getattr(config, "weights", None)), getattr(config, "kv_cache_dtype", "bf16"))

    @property
    def name(self) -> str:
        return (f"{self.device}-{self.dtype}-{self.backend}" + ("" if self.weights == "dense" else f"-{self.weights}")
                + ("" if self.kv_cache == "bf16" else f"-kv-{self.kv_cache}"))  # fmt: skip

    @property
    def packed_formats(self) -> tuple[str, ...]:
        """The packed formats this policy serves, each as the band gate that holds it names it (PackedBand.format):
        empty for a dense model with the unpacked cache."""
        return ((() if self.weights == "dense" else (f"weights {self.weights}",))
                + (() if self.kv_cache == "bf16" else (f"kv_cache_dtype {self.kv_cache}",)))  # fmt: skip

    def computes_like(self, reference_policy: str) -> bool:
        """Whether greedy tokens must be identical to the reference's: the same dtype through the same torch
        kernels on a CPU. On a GPU even float32 differs in summation order between cuBLAS shapes (envex packs
        q/k/v into one matmul), so there the top-k rule applies."""
        return self.device == "cpu" and self.name == reference_policy


def _packed_weights(setting: str | None) -> str:
    """EngineConfig.weights as the policy names it: "dense" where no projection is quantized (None, "bf16")."""
    from envex.runtime.weight_policy import policy_from_setting

    if setting is None or all(s.kind == "bf16" for s in policy_from_setting(setting).schemes()):
        return "dense"
    return setting


@dataclass(frozen=True)
class PackedBand:
    """What a packed format's band gate measured against the model's own unpacked self (verify.kv_cache_band:
    the packed KV cache against the bf16-KV engine; verify.weight_quality_band: the weights policy against the
    bf16 model): the suite's stand-in for its HF token and KL checks where the engine serves that format."""

    gate: str  # the band gate's name
    format: str  # "kv_cache_dtype fp8", "weights int4_g128_sym": as NumericPolicy.packed_formats names it
    band: str  # the band's name: "fp8" | "int4"
    passed: bool
    mean_kld: float
    top1: float
    reason: str  # the band gate's one line

    @classmethod
    def from_gate(cls, gate: str, fmt: str, report: dict[str, Any]) -> PackedBand:
        """From a band gate's JSON (gate_kv_cache.kv_band_gate, weight_quality.band_gate); a gate that could not
        run (no result) counts as outside its band, with its error as the reason."""
        result = report.get("result") or {}
        band = report.get("band")
        return cls(gate=gate, format=fmt, band=str(band.get("name") if isinstance(band, dict) else band),
                   passed=report.get("verdict") == "pass" and bool(result),
                   mean_kld=float(result.get("mean_kld", float("nan"))), top1=float(result.get("top1", float("nan"))),
                   reason=str(report.get("reason") or report.get("error") or "no reason given"))  # fmt: skip

    @property
    def line(self) -> str:
        return f"judged against the {self.band} band: KLD {self.mean_kld:.5f} / top-1 {self.top1:.1%}"


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
