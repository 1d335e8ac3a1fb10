"""A low-bit weights policy (issue 42): which scheme each linear projection of a Llama-family model is served in.

    {"default": "int4_g128_sym", "lm_head": "bf16", "overrides": {"layers.0": "fp8_channel", "down_proj": "bf16"}}

or a bare scheme name (the default; LM head bf16). Schemes: "bf16" (kept), "fp8_block" (128 x 128 blocks),
"fp8_channel", "fp8_tensor", "int4_g<G>_sym" / "int4_g<G>_asym" (G inputs per scale, a multiple of 8; a G past the
row's inputs is one group per row, i.e. per-channel). The engine quantizes a float model's projections by it at load
(EngineConfig.weights, runtime/packed_load.py); verify/weight_quality.py measures its quality against the bf16
model and holds it to its band.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from envex.kernels import quant

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
# The runtime packs these into one matrix each (runtime/models/llama.py): one scheme for each group, per layer.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
POLICY_KEYS = ("default", "lm_head", "overrides")
_SCHEME = re.compile(r"bf16|fp8_(block|channel|tensor)|int4_g([1-9][0-9]{0,6})_(sym|asym)")
_PROJ = "|".join(PROJECTIONS)
_SELECTOR = re.compile(rf"layers\.(0|[1-9][0-9]{{0,5}})(?:\.({_PROJ}))?|({_PROJ})")  # layers.<i>[.<proj>] | <proj>


class PolicyError(ValueError):
    """A weights policy that cannot be used; the message is one line naming the key and what to write."""


@dataclass(frozen=True)
class Scheme:
    """One projection's weight format, by its policy name (see the module docstring)."""

    name: str

    @property
    def kind(self) -> str:
        """"bf16", "fp8" or "int4"."""
        return self.name.split("_")[0]

    def pack(self, w: torch.Tensor) -> quant.PackedWeight | None:
        """The PackedWeight of a float weight [N, K] (None for bf16)."""
        m = _SCHEME.fullmatch(self.name)
        assert m is not None, self.name  # parse_scheme made it
        if self.kind == "fp8":
            return quant.quantize_fp8(w, f"fp8_{m.group(1)}")
        if self.kind == "int4":  # past the row's inputs a group is the whole row: the same codes and scales
            group = min(int(m.group(2)), -(-w.shape[1] // quant.PACK) * quant.PACK)
            return quant.quantize_int4(w, group, symmetric=m.group(3) == "sym")
        return None


BF16 = Scheme("bf16")


def parse_scheme(value: Any, where: str) -> Scheme:
    if not isinstance(value, str) or not _SCHEME.fullmatch(value):
        raise PolicyError(f"weights policy {where}: {value!r} is not a scheme; use bf16, fp8_block, fp8_channel, "
                          "fp8_tensor, or int4_g<G>_sym / int4_g<G>_asym with G a multiple of 8 (e.g. int4_g128_sym)")
    m = _SCHEME.fullmatch(value)
    if m is not None and m.group(2) is not None and int(m.group(2)) % quant.PACK:
        raise PolicyError(f"weights policy {where}: {value!r}: the group must be a multiple of {quant.PACK} "
                          "(32, 64, 128, ...)")  # fmt: skip
    return Scheme(value)


@dataclass(frozen=True, kw_only=True)
class WeightPolicy:
    """A scheme per linear projection. overrides: (selector, scheme), selector "<proj>", "layers.<i>" or
    "layers.<i>.<proj>"; the most specific wins (layer and projection, then layer, then projection, then
    default). The LM head is its own key: a quantized LM head of a tied model gets its own copy (the embedding
    lookup stays bf16)."""

    default: Scheme
    lm_head: Scheme = BF16
    overrides: tuple[tuple[str, Scheme], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"default": self.default.name, "lm_head": self.lm_head.name}
        if self.overrides:
            out["overrides"] = {k: s.name for k, s in self.overrides}
        return out

    @property
    def label(self) -> str:
        """Compact JSON of the policy, for tables and messages."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def schemes(self) -> set[Scheme]:
        return {self.default, self.lm_head, *(s for _, s in self.overrides)}

    def scheme_for(self, layer: int, proj: str) -> Scheme:
        o = dict(self.overrides)
        for key in (f"layers.{layer}.{proj}", f"layers.{layer}", proj):
            if key in o:
                return o[key]
        return self.default

    def resolve(self, num_layers: int) -> dict[str, Scheme]:
        """HF module name -> scheme for a model of num_layers layers; PolicyError for an override past the last
        layer or for a fused group (q/k/v, gate/up) given two schemes in one layer."""
        for key, _ in self.overrides:
            m = _SELECTOR.fullmatch(key)
            if m is not None and m.group(1) is not None and int(m.group(1)) >= num_layers:
                raise PolicyError(f"weights policy overrides: {key!r} names a layer the model lacks (it has "
                                  f"{num_layers}: layers.0 to layers.{num_layers - 1})")  # fmt: skip
        out: dict[str, Scheme] = {}
        for i in range(num_layers):
            for group in FUSED:
                names = {self.scheme_for(i, p).name for p in group}
                if len(names) > 1:
                    raise PolicyError(f"weights policy: layer {i}'s {', '.join(group)} are one matrix in the runtime; "
                                      f"give them one scheme (got {', '.join(sorted(names))})")  # fmt: skip
            for p in PROJECTIONS:
                out[f"model.layers.{i}.{_PARENT[p]}.{p}"] = self.scheme_for(i, p)
        out["lm_head"] = self.lm_head
        return out


def parse_policy(data: Any) -> WeightPolicy:
    """A WeightPolicy from its JSON form {"default": ..., "lm_head": ..., "overrides": {selector: scheme}}, or
    from a bare scheme name (the default, LM head bf16); one-line PolicyError otherwise."""
    if isinstance(data, str):
        return WeightPolicy(default=parse_scheme(data, "default"))
    if not isinstance(data, Mapping):
        raise PolicyError(f"weights policy: expected an object or a scheme name, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in POLICY_KEYS)
    if unknown:
        raise PolicyError(f"weights policy: unknown key {unknown[0]!r}; known: {', '.join(POLICY_KEYS)}")
    if "default" not in data:
        raise PolicyError('weights policy: "default" is required (the scheme of every decoder projection)')
    raw = data.get("overrides", {})
    if not isinstance(raw, Mapping):
        raise PolicyError(f"weights policy overrides: expected an object of selector: scheme, got {type(raw).__name__}")
    overrides = []
    for key, value in raw.items():
        if not isinstance(key, str) or not _SELECTOR.fullmatch(key):
            raise PolicyError(f"weights policy overrides: selector {key!r} is not one of <proj>, layers.<i> or "
                              f"layers.<i>.<proj> (proj: {', '.join(PROJECTIONS)}; i without leading zeros); the "
                              "LM head has its own key lm_head")  # fmt: skip
        overrides.append((key, parse_scheme(value, f"overrides[{key!r}]")))
    return WeightPolicy(default=parse_scheme(data["default"], "default"),
                        lm_head=parse_scheme(data.get("lm_head", "bf16"), "lm_head"),
                        overrides=tuple(sorted(overrides)))  # fmt: skip


def policy_from_setting(value: str | Mapping[str, Any]) -> WeightPolicy:
    """The policy of a setting: a scheme name, the policy's JSON text (as launch.json and --weights carry it) or
    its object; one-line PolicyError otherwise."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise PolicyError(f"weights policy: not valid JSON ({e}); give a scheme name or a JSON object") from None
    return parse_policy(value)
