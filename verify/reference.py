"""The reference engine: HF transformers on the same weights, driven token by token so every step's logits can
be kept (greedy argmax, exactly as `generate(do_sample=False)` picks).

The reference is float32 by default: it defines "the same answers". On a GPU it can run on the GPU in float32,
which keeps long needle prompts affordable.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from envex.runtime.loader import ModelSource, resolve_model

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(source: ModelSource, *, device: str = "cpu", dtype: str = "float32") -> Any:
    """AutoModelForCausalLM from local files only (a GGUF is de-quantized by transformers' own GGUF reader)."""
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype], "local_files_only": True, **_quantization(source)}
    if source.kind == "gguf":
        with _gguf_memoized():
            model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                         **kwargs)  # fmt: skip
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), **kwargs)
    cast_parameters(model, _DTYPES[dtype])
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to() narrowly


@contextmanager
def _gguf_memoized() -> Iterator[None]:
    """While transformers reads a GGUF, gguf's `get_tensor_name_map` answers each (architecture, layers) once and
    its `GGUFReader` parses each file once. transformers' GGUF loader imports both afresh where it uses them: it
    rebuilds the whole name map (every tensor name of the architecture at every layer) for each module it visits,
    397 times for the embedded model, and parses the file twice (once for the config, once for the weights; the
    49,152-token vocabulary element by element): 12 and 9 of the load's 29 s on one core. Both are pure functions
    of their arguments and the loader only reads what they return; the weights loaded are the same
    (tests/test_runtime_reference.py)."""
    try:
        import gguf
    except ImportError:  # transformers then says what to install
        yield
        return
    originals = {"get_tensor_name_map": gguf.get_tensor_name_map, "GGUFReader": gguf.GGUFReader}
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = originals["GGUFReader"](path, mode)
        return readers[key]

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(originals["get_tensor_name_map"])
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(gguf, name, value)


def _quantization(source: ModelSource) -> dict[str, Any]:
    """An MXFP4 checkpoint (gpt-oss) is dequantized by transformers' own code, always. Left to choose, transformers
    asks the hub for its MXFP4 kernels wherever a `kernels` package imports (transformers 5.25 depends on one):
    offline (HF_HUB_OFFLINE, above) that fails the load, online it would open a connection; a reference does
    neither."""
    if source.kind != "hf":
        return {}
    quant = json.loads((source.path / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
    if quant.get("quant_method") != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def cast_parameters(model: Any, dtype: torch.dtype) -> list[str]:
    """Widen every 16-bit float parameter of `model` narrower than `dtype` to it; returns their names. A reference
    in float32 must compute in float32: transformers 5.17 dequantizes MXFP4 experts to bf16 whatever dtype it was
    asked for (5.24 follows the parameter's), which made a "float32" gpt-oss run its experts in bf16. Nothing is
    narrowed (transformers keeps some modules in float32 on purpose, e.g. gpt-oss's norms in bf16), 8-bit floats
    are a quantized model's business, and buffers stay as they are (rotary frequencies are float32 on purpose)."""
    changed = []
    for name, param in model.named_parameters():
        if param.dtype in (torch.float16, torch.bfloat16) and torch.finfo(param.dtype).bits < torch.finfo(dtype).bits:
            param.data = param.data.to(dtype)
            changed.append(name)
    return changed


@dataclass(frozen=True)
class RefGeneration:
    """One greedy generation: the tokens (EOS included when it ended on one), the top-k of each step."""

    token_ids: list[int]
    top: list[dict[int, float]] = field(default_factory=list)  # per step: token id -> logprob
    finish_reason: str = "length"


class Reference(Protocol):
    """What a gate asks its reference: HFReference here, or the signed answers of the model bundle
    (verify/signed_reference.py). `origin`: "local" or "signed"."""

    origin: str

    @property
    def policy_name(self) -> str: ...

    def greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int = 5, ignore_eos: bool = False,
               stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None) -> RefGeneration: ...


class HFReference:
    """Greedy generation and full-sequence logits from HF transformers; the gates' yardstick."""

    origin = "local"

    def __init__(self, model: str | ModelSource, *, device: str = "cpu", dtype: str = "float32",
                 eos_token_ids: Sequence[int] | None = None) -> None:
        self.source = model if isinstance(model, ModelSource) else resolve_model(model)
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = load_hf_model(self.source, device=str(self.device), dtype=dtype)
        if eos_token_ids is None:
            eos = self.model.generation_config.eos_token_id
            eos_token_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        # The reference is deterministic: a gate run twice (or two gates on one prompt) reuses its answers.
        self._memo: dict[tuple[Any, ...], RefGeneration] = {}

    @property
    def policy_name(self) -> str:
        return f"{self.device.type}-{self.dtype}-torch"

    def describe(self) -> dict[str, Any]:
        return {"origin": self.origin, "reference_policy": self.policy_name, "model": str(self.source.path)}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int = 5, ignore_eos: bool = False,
               stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None) -> RefGeneration:
        """Greedy tokens until EOS or max_tokens (or, given `decode`, until the text holds a `stop` string)."""
        key = (tuple(prompt_ids), max_tokens, top_k, ignore_eos, tuple(stop) if decode is not None else ())
        if key not in self._memo:
            self._memo[key] = self._greedy(prompt_ids, max_tokens, top_k=top_k, ignore_eos=ignore_eos, stop=stop,
                                           decode=decode)
        return self._memo[key]

    def _greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int, ignore_eos: bool,
                stop: Sequence[str], decode: Callable[[list[int]], str] | None) -> RefGeneration:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        tokens: list[int] = []
        tops: list[dict[int, float]] = []
        reason = "length"
        for _ in range(max_tokens):
            logprobs = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(logits))
            if top_k:
                values, indices = torch.topk(logprobs, top_k)
                tops.append(dict(zip(indices.tolist(), values.tolist(), strict=True)))
            tokens.append(tok)
            if tok in self.eos_token_ids and not ignore_eos:
                reason = "stop"
                break
            if len(tokens) == max_tokens:
                break
            if stop and decode is not None and any(x in decode(tokens) for x in stop):
                reason = "stop"
                break
            step = torch.tensor([[tok]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
        return RefGeneration(tokens, tops, reason)

    @torch.inference_mode()
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len, V] float32 logits of one sequence, on the CPU."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu()
