"""The quality of a low-bit weights policy (issue 42), measured llama.cpp-KL style against the model's bf16 self.

    python -P -m envex.verify.weight_quality --policy int4_g128_sym [--policy ...] [--tokens 4096] [--json OUT]

A policy (`parse_policy`) gives a scheme per linear projection: a default for the decoder's projections, the LM
head's own (bf16 unless named) and overrides by projection, layer or both. Schemes: "bf16" (kept), "fp8_block"
(128 x 128 blocks), "fp8_channel", "fp8_tensor", "int4_g<G>_sym" / "int4_g<G>_asym" (G inputs per scale, a
multiple of 8; a G past the row's inputs is one group per row, i.e. per-channel).

The measurement (`QualityBench`): every float weight of the model as the runtime loads it
(runtime/loader.py, HF names) is rounded to bf16: that is the reference, "the bf16 model". Each projection the
policy quantizes is quantized from those bf16 values by kernels/quant.py's own quantizers and dequantized back to
float32, so each matmul equals what the packed kernels (kernels/quant_gemv.py) compute with that PackedWeight, up
to accumulation order and where the scale is applied (both in float32). Both models run in float32 on the CPU in
HF transformers' class for the architecture (the class the gates' reference uses), over a fixed local text
(`text_tokens`: verify/data_corpus.json, then offline_docs/*.md; nothing downloaded) cut into windows; as
llama.cpp's KL-divergence tool does, only the second half of each window is scored, so every scored position has
at least half a window of context. Reported per scored position: KL(bf16 || quant) in nats (mean, p99, max) and
top-1 agreement, each policy against the same bf16 logits (the policy "bf16" gives exactly 0 and 100%: the sanity
check). The activations stay float32 here: this isolates the weights' error from the serving dtype's.

`check_band(result)` holds a result against its band (`BANDS`, the issue's figures: the INT4 band if any
projection is INT4, else the FP8 band) and returns a verdict with one line naming the figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from envex.kernels import quant

# The policy (its format, parser and resolution) lives in the runtime, which quantizes by it at load.
from envex.runtime.weight_policy import (  # noqa: F401  (re-exported)
    BF16,
    FUSED,
    POLICY_KEYS,
    PROJECTIONS,
    PolicyError,
    Scheme,
    WeightPolicy,
    parse_policy,
    parse_scheme,
)

_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")  # one HF class each, same names

# ---- the bands ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityBand:
    name: str
    max_mean_kld: float
    min_top1: float


# Issue 42, against the model's bf16 self (llama.cpp's anchors: Q8_0 0.00024 / 99.2%, Q5_K_M 0.0047 / 96.5%).
BANDS = {"fp8": QualityBand("fp8", 0.002, 0.98), "int4": QualityBand("int4", 0.02, 0.93)}


def band_for(policy: WeightPolicy) -> QualityBand:
    """The band a policy is held to: its lowest precision's (INT4 if any projection is INT4, else FP8)."""
    return BANDS["int4"] if any(s.kind == "int4" for s in policy.schemes()) else BANDS["fp8"]


@dataclass(frozen=True)
class QualityResult:
    policy: dict[str, Any]
    positions: int
    mean_kld: float
    p99_kld: float
    max_kld: float
    top1: float
    quantized: int  # projections quantized
    linear_bytes: int  # the linear projections' bytes as stored (packed, or bf16), LM head included
    bf16_linear_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BandVerdict:
    passed: bool
    band: str
    reason: str  # one line naming the figure


def check_band(result: QualityResult, band: QualityBand | None = None) -> BandVerdict:
    """Pass or refuse `result` against `band` (by default its policy's, band_for); the reason names the figures."""
    b = band or band_for(parse_policy(result.policy))
    label = json.dumps(result.policy, separators=(",", ":"))
    kld_ok, top1_ok = result.mean_kld <= b.max_mean_kld, result.top1 >= b.min_top1
    figures = (f"mean KLD {result.mean_kld:.5f} {'<=' if kld_ok else '>'} {b.max_mean_kld} and top-1 "
               f"{result.top1:.2%} {'>=' if top1_ok else '<'} {b.min_top1:.0%} over {result.positions} positions")
    if kld_ok and top1_ok:
        return BandVerdict(True, b.name, f"weights policy {label} is inside the {b.name} band: {figures}")
    return BandVerdict(False, b.name, f"weights policy {label} refused: outside the {b.name} band: {figures}; "
                                      "keep more projections in bf16 or use a finer scheme")  # fmt: skip


# ---- the measurement ----------------------------------------------------------------------------------------------


def text_tokens(tokenizer: Any, n_tokens: int) -> list[int]:
    """The first n_tokens of the fixed local text: verify/data_corpus.json's texts, then offline_docs/*.md by name
    (less quantization.md, which holds this measurement's table, and performance.md, generated), each encoded
    without special tokens and joined by a blank line's tokens."""
    from envex import offline_docs
    from envex.verify.data import corpus_texts

    docs = sorted(p for p in Path(offline_docs.__file__).parent.glob("*.md")
                  if p.name not in ("quantization.md", "performance.md"))  # fmt: skip
    ids: list[int] = []
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    for text in [*corpus_texts(), *(p.read_text(encoding="utf-8") for p in docs)]:
        if len(ids) >= n_tokens:
            break
        ids += [*tokenizer.encode(text, add_special_tokens=False), *sep]
    if len(ids) < n_tokens:
        raise ValueError(f"tokens: the local text holds {len(ids)} tokens; ask for at most that many")
    return ids[:n_tokens]


def _hf_model(hf_config: Mapping[str, Any]) -> Any:
    import transformers
    from transformers.initialization import no_init_weights

    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in _ARCHITECTURES:
        raise ValueError(f"weight quality: architecture {arch!r} is not measured here; supported: "
                         f"{', '.join(_ARCHITECTURES)}")  # fmt: skip
    cls = getattr(transformers, arch)
    config = cls.config_class(**{k: v for k, v in hf_config.items() if k != "architectures"})
    with no_init_weights():  # every parameter is written below
        model = cls(config)
    return model.to(torch.float32).eval()


class QualityBench:
    """One model, one text, its bf16 logits computed once; measure(policy) for each policy."""

    def __init__(self, weights: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], token_ids: Sequence[int],
                 *, window: int = 512) -> None:  # fmt: skip
        if window < 2 or len(token_ids) < window:
            raise ValueError(f"window: {window} must be >= 2 and at most the {len(token_ids)} tokens given")
        self.model = _hf_model(hf_config)
        self.num_layers = int(hf_config["num_hidden_layers"])
        # The bf16 model, kept in float32 (exact): the reference and what every quantizer starts from.
        self.weights = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in weights.items()}
        self.tied = "lm_head.weight" not in self.weights
        whole = len(token_ids) // window
        self.windows = torch.tensor(list(token_ids[: whole * window]), dtype=torch.long).view(whole, window)
        self.keep = window - window // 2  # scored positions per window: its second half
        self.reference = self._logits(self.weights, self.weights["lm_head.weight" if not self.tied
                                                                  else "model.embed_tokens.weight"])  # fmt: skip

    @torch.inference_mode()
    def _logits(self, state: Mapping[str, torch.Tensor], lm_head: torch.Tensor) -> torch.Tensor:
        """[windows, keep, V] float32 logits of the scored positions."""
        m = self.model
        for name, param in m.named_parameters():
            if name != "lm_head.weight":
                param.copy_(state[name])
        m.lm_head.weight = torch.nn.Parameter(lm_head, requires_grad=False)  # unties a tied head: its own copy
        return torch.stack([m(input_ids=w[None], use_cache=False, logits_to_keep=self.keep).logits[0].float()
                            for w in self.windows])  # fmt: skip

    def measure(self, policy: WeightPolicy) -> QualityResult:
        from envex.verify.gate_semantic import kl_and_top1

        state = dict(self.weights)
        head = self.weights["model.embed_tokens.weight" if self.tied else "lm_head.weight"]
        nbytes = bf16_bytes = quantized = 0
        for module, scheme in policy.resolve(self.num_layers).items():
            w = head if module == "lm_head" else state[f"{module}.weight"]
            packed = scheme.pack(w)
            bf16_bytes += w.numel() * 2
            nbytes += w.numel() * 2 if packed is None else packed.nbytes
            if packed is not None:
                quantized += 1
                w = quant.dequantize(packed, torch.float32)
            if module == "lm_head":
                head = w
            else:
                state[f"{module}.weight"] = w
        logits = self._logits(state, head)
        pairs = [kl_and_top1(r, q) for r, q in zip(self.reference, logits, strict=True)]
        kl = torch.cat([p[0] for p in pairs])
        top1 = torch.cat([p[1] for p in pairs]).double()
        return QualityResult(policy=policy.to_dict(), positions=int(kl.numel()), mean_kld=float(kl.mean()),
                             p99_kld=float(torch.quantile(kl, 0.99)), max_kld=float(kl.max()),
                             top1=float(top1.mean()), quantized=quantized, linear_bytes=nbytes,
                             bf16_linear_bytes=bf16_bytes)  # fmt: skip


def embedded_bench(n_tokens: int, *, window: int = 512, model: str = "smollm2-135m-instruct") -> QualityBench:
    """A QualityBench on a model as the runtime loads it (the embedded one by default), over text_tokens."""
    from envex.runtime.loader import load_model_info

    info = load_model_info(model)
    return QualityBench(dict(info.iter_weights()), info.hf_config, text_tokens(info.tokenizer, n_tokens),
                        window=window)  # fmt: skip


def band_gate(model: str, weights: str, *, n_tokens: int = 1024, window: int = 512) -> dict[str, Any]:
    """The install's gate for a release that quantizes at load (launch.json engine.weights): the policy measured on
    the release's own model against its bf16 self (QualityBench over n_tokens of the local text) and held to its
    band (check_band). A gate's JSON: verdict "pass" or "fail", the one-line reason naming the figures, the
    result."""
    from envex.runtime.weight_policy import policy_from_setting

    policy = policy_from_setting(weights)
    result = embedded_bench(n_tokens, window=window, model=model).measure(policy)
    verdict = check_band(result)
    return {"verdict": "pass" if verdict.passed else "fail", "band": verdict.band, "reason": verdict.reason,
            "result": result.to_dict()}


# ---- the report and its table -------------------------------------------------------------------------------------


@dataclass
class Report:
    model: str
    tokens: int
    window: int
    text_digest: str  # sha256 of the token ids (little-endian int64), first 16 hex digits
    results: list[dict[str, Any]] = field(default_factory=list)  # QualityResult.to_dict() + band, passed, reason

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "envex-weight-quality/1", **self.__dict__}


def run(policies: Sequence[WeightPolicy], *, n_tokens: int, window: int, model: str) -> Report:
    bench = embedded_bench(n_tokens, window=window, model=model)
    digest = hashlib.sha256(bench.windows.flatten().numpy().astype("<i8").tobytes()).hexdigest()[:16]
    report = Report(model=model, tokens=int(bench.windows.numel()), window=window, text_digest=digest)
    for policy in [parse_policy("bf16"), *policies]:
        result = bench.measure(policy)
        verdict = check_band(result)
        report.results.append({**result.to_dict(), "band": verdict.band, "passed": verdict.passed,
                               "reason": verdict.reason})  # fmt: skip
    return report


def markdown_table(report: Mapping[str, Any]) -> str:
    """The Markdown table of a report's JSON form (what offline_docs/quantization.md shows)."""
    rows = ["| policy | band | mean KLD | p99 KLD | max KLD | top-1 | linear bytes vs bf16 | verdict |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["results"]:
        policy = json.dumps(r["policy"], separators=(",", ":"))
        rows.append(f"| `{policy}` | {r['band']} | {r['mean_kld']:.5f} | {r['p99_kld']:.4f} | {r['max_kld']:.3f} | "
                    f"{r['top1']:.2%} | {r['linear_bytes'] / r['bf16_linear_bytes']:.3f} | "
                    f"{'pass' if r['passed'] else 'refused'} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -P -m envex.verify.weight_quality", description=__doc__.split("\n")[0])
    ap.add_argument("--policy", action="append", default=[],
                    help="a scheme name or a JSON policy object; repeat for several (bf16 is always measured first)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of local text (default 4096)")
    ap.add_argument("--window", type=int, default=512, help="tokens per window; its second half is scored")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--table-from", type=Path, help="print the Markdown table of a report written by --json; no run")
    args = ap.parse_args(argv)
    if args.table_from is not None:
        sys.stdout.write(markdown_table(json.loads(args.table_from.read_text(encoding="utf-8"))))
        return 0
    try:
        policies = [parse_policy(json.loads(p) if p.lstrip().startswith("{") else p) for p in args.policy]
    except (PolicyError, json.JSONDecodeError) as exc:
        print(f"--policy: {exc}", file=sys.stderr)
        return 2
    try:
        report = run(policies, n_tokens=args.tokens, window=args.window, model=args.model)
    except ValueError as exc:  # PolicyError (a layer the model lacks), ModelNotFoundError, too many tokens
        print(f"weight quality: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report.to_dict(), indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n", encoding="utf-8")
    sys.stdout.write(markdown_table(report.to_dict()))
    return 0 if all(r["passed"] for r in report.results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
