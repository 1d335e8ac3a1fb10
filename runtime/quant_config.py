"""A checkpoint's own `quantization_config` (config.json) read into the scheme of each linear layer's weight, and
the tensors each scheme brings per layer, read into a kernels.quant.PackedWeight.

Read (each is how its producer writes it; offline_docs/quantization.md has the table):
  quant_method "fp8"                 DeepSeek-V3 / Kimi K2 / Qwen3-FP8 (transformers' FineGrainedFP8Config):
                                     `weight_block_size` [128, 128] (also when left out, as transformers reads
                                     it) -> fp8_block (`weight`, `weight_scale_inv`, float32 or ue8m0 scales).
  quant_method "compressed-tensors"  config_groups whose weights are 8-bit float ("float-quantized" or
                                     "naive-quantized"; strategy tensor, channel or block) or 4-bit int
                                     ("pack-quantized" or "naive-quantized"; strategy group or channel,
                                     symmetric or with zero points).
  quant_method "awq"                 AutoAWQ's GEMM packing, 4 bits, zero points (`qweight`, `qzeros`, `scales`).
  quant_method "gptq"                AutoGPTQ / GPTQModel, 4 bits, checkpoint_format "gptq" (v1) or "gptq_v2".
Anything else, or an option these readers would get wrong (act-order groups, asymmetric FP8, bits other than
8-bit float and 4-bit int, quantized activations the kernels would not apply for an INT4 weight, a quantized KV
cache, sparsity), is one ConfigError naming it. The compressed-tensors and fp8 sections are closed models in
their producers (pydantic, extra="forbid"), so an unknown key there is refused too: it means a version of the
format this reader does not know. AWQ and GPTQ configs carry their quantizers' and kernels' own settings
(damp_percent, true_sequential, backend, ...), which do not change the stored layout; only the keys that do are read.

Activations: a checkpoint that quantizes activations too (FP8 "dynamic" per token, or "static" with an
`input_scale`) is served with its weights read packed and its activations kept in the model's float dtype; the
scheme records what the checkpoint intended (`activations`) and lists `input_scale` as read-and-unused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from envex.kernels import quant
from envex.runtime.errors import ConfigError

FP8, COMPRESSED_TENSORS, AWQ, GPTQ = "fp8", "compressed-tensors", "awq", "gptq"
SUPPORTED_METHODS = (FP8, COMPRESSED_TENSORS, AWQ, GPTQ)
# Layouts: which tensors a layer brings and how they are packed.
FP8_DEEPSEEK, CT_FLOAT, CT_PACK, CT_NAIVE_INT, AWQ_GEMM, GPTQ_LAYOUT = (
    "fp8", "ct-float", "ct-pack", "ct-naive-int", "awq-gemm", "gptq")  # fmt: skip
_CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
            "global_compression_ratio", "sparsity_config", "transform_config", "version"}  # fmt: skip
_CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
_CT_ARGS_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
                 "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}  # fmt: skip
# transformers' FineGrainedFP8Config (and MiniMax's alias ignored_layers for modules_to_not_convert).
_FP8_KEYS = {"quant_method", "activation_scheme", "fmt", "weight_block_size", "modules_to_not_convert",
             "ignored_layers", "modules_to_convert", "dequantize", "scale_fmt", "expert_dtype"}  # fmt: skip
_WHERE = "config.json quantization_config"


def _fail(message: str) -> ConfigError:
    return ConfigError(f"{_WHERE}: {message}")


@dataclass(frozen=True, kw_only=True)
class WeightScheme:
    """How one linear layer's weight is stored. kind: the kernels.quant scheme it is read into; layout: the
    checkpoint's packing; group_size: INT4 inputs per scale (None: one group per row); block: fp8_block's (rows,
    cols); zero_plus_one: GPTQ v1's stored zero - 1; activations: what the checkpoint does to activations
    ("none", "dynamic", "static"), which Envex does not (activations stay in the model's float dtype)."""

    kind: str
    layout: str
    group_size: int | None = None
    block: tuple[int, int] = (0, 0)
    symmetric: bool = True
    zero_plus_one: bool = False
    activations: str = "none"

    def tensor_names(self) -> tuple[str, ...]:
        """The tensors a layer `<module>.` must bring, by suffix."""
        if self.layout in (AWQ_GEMM, GPTQ_LAYOUT):
            return ("qweight", "qzeros", "scales")
        if self.layout == CT_PACK:
            names = ("weight_packed", "weight_scale", "weight_shape")
        else:
            names = ("weight", "weight_scale_inv" if self.kind == quant.FP8_BLOCK and self.layout == FP8_DEEPSEEK
                     else "weight_scale")  # fmt: skip
        return names if self.symmetric else (*names, "weight_zero_point")

    def optional_tensor_names(self) -> tuple[str, ...]:
        """Tensors a layer may also bring: GPTQ's g_idx (checked to be trivial), an activation `input_scale`
        (unused, see the module docstring), a symmetric compressed-tensors zero point (checked to be zero)."""
        if self.layout == GPTQ_LAYOUT:
            return ("g_idx",)
        if self.layout == AWQ_GEMM:
            return ()
        extra = ("input_scale",) if self.kind != quant.INT4_GROUP else ()
        return (*extra, "weight_zero_point") if self.symmetric and self.layout != FP8_DEEPSEEK else extra


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """The parsed quantization_config: method, (targets, scheme) groups in config order, and the modules left in
    float (`ignore`: exact names, or "re:" regular expressions matched from the start of the name, as
    compressed-tensors matches them). A target is "Linear" (every linear layer) or a module name or "re:" pattern."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of the linear layer named `module` (HF name, e.g. "model.layers.0.mlp.down_proj"), or None
        where it stays in float. The loader should still check the layer's tensors (`load_packed` does)."""
        if any(_matches(p, module) for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return scheme
        return None


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _substring_pattern(key: str) -> str:
    """HF's modules_to_not_convert (a substring of the module name) as an ignore pattern."""
    return "re:.*" + re.escape(key)


# ---- the parser ---------------------------------------------------------------------------------------------------


def quant_config_from_hf(cfg: Mapping[str, Any]) -> QuantConfig | None:
    """The quantization of a checkpoint from its config.json dict: None for a float checkpoint (and for gpt-oss's
    "mxfp4", which runtime/config.py reads for the experts), else a QuantConfig; ConfigError (one line) otherwise."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config.json: expected a JSON object, got {type(cfg).__name__}")
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise _fail(f"expected an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if not isinstance(method, str):
        raise _fail(f"quant_method must be a string, got {method!r}")
    method = method.lower()
    if method == "mxfp4":
        return None
    if method == FP8:
        return _parse_fp8(q)
    if method == COMPRESSED_TENSORS:
        return _parse_compressed_tensors(q)
    if method == AWQ:
        return _parse_awq(q)
    if method == GPTQ:
        return _parse_gptq(q)
    raise _fail(f"quant_method {method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)} "
                "(or a float checkpoint)")  # fmt: skip


def _unknown_keys(section: Mapping[str, Any], known: set[str], where: str) -> None:
    extra = sorted(str(k) for k in section if k not in known)
    if extra:
        raise _fail(f"{where}: unknown key {extra[0]!r} (a format version this reader does not know); known: "
                    f"{', '.join(sorted(known))}")  # fmt: skip


def _names(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(f"{where} must be a list of strings, got {value!r}")
    return tuple(value)


def _int4_group(value: Any, where: str) -> int | None:
    """A 4-bit group size: a positive multiple of 8, or -1 / None for one group per row."""
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % quant.PACK:
        raise _fail(f"{where} {value!r} is not supported; use a positive multiple of 8 (32, 64, 128) or -1")
    return value


def _four_bits(value: Any, where: str) -> None:
    if value != 4 or isinstance(value, bool):
        raise _fail(f"{where} {value!r} is not supported; only 4-bit integer weights are read")


def _parse_fp8(q: Mapping[str, Any]) -> QuantConfig:
    _unknown_keys(q, _FP8_KEYS, "fp8")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _fail(f"fp8 fmt {fmt!r} is not supported; only e4m3 weights are read")
    acts = q.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        raise _fail(f"fp8 activation_scheme {acts!r} must be 'dynamic' or 'static'")
    if q.get("scale_fmt", "float") not in ("float", "ue8m0"):  # ue8m0: power-of-two scales, widened exactly
        raise _fail(f"fp8 scale_fmt {q.get('scale_fmt')!r} is not supported; read: 'float', 'ue8m0'")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise _fail(f"fp8 expert_dtype {q.get('expert_dtype')!r} is not supported; only FP8 experts are read")
    if q.get("modules_to_convert"):
        raise _fail("fp8 modules_to_convert (FP8 embedding tables) is not supported")
    skip = q.get("modules_to_not_convert", q.get("ignored_layers"))
    # transformers keeps the output embedding in float whatever the list says (get_keys_to_not_convert): lm_head
    ignore = (*(_substring_pattern(k) for k in _names(skip, "fp8 modules_to_not_convert")), "lm_head")
    # transformers reads a missing weight_block_size as its default [128, 128]; null is per-tensor there.
    block = q.get("weight_block_size", [128, 128])
    if block is None:
        raise _fail("fp8 weight_block_size null (one scale per matrix) is not supported; block-scaled FP8 and "
                    "compressed-tensors per-tensor FP8 are")  # fmt: skip
    scheme = WeightScheme(kind=quant.FP8_BLOCK, layout=FP8_DEEPSEEK, block=_block(block, "fp8 weight_block_size"),
                          activations=acts)  # fmt: skip
    return QuantConfig(method=FP8, groups=((("Linear",), scheme),), ignore=ignore)


def _block(value: Any, where: str) -> tuple[int, int]:
    """A weight block [rows, cols]; cols a power of two (a GEMV tile lies inside one block's columns)."""
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value):  # compressed-tensors' older "128x128"
        value = [int(v) for v in value.split("x")]
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):  # fmt: skip
        raise _fail(f"{where} must be [rows, cols] of two positive integers, got {value!r}")
    if value[1] & (value[1] - 1) or value[1] < 8:
        raise _fail(f"{where} {list(value)}: the block's columns must be a power of two >= 8")
    return (value[0], value[1])


def _parse_awq(q: Mapping[str, Any]) -> QuantConfig:
    _four_bits(q.get("bits", q.get("w_bit")), "awq bits")
    group = _int4_group(q.get("group_size", q.get("q_group_size")), "awq group_size")
    if q.get("zero_point", True) is not True:
        raise _fail("awq zero_point false is not supported; AWQ's GEMM layout is read with zero points only")
    version = q.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise _fail(f"awq version {version!r} is not supported; only the 'gemm' packing is read")
    skip = _names(q.get("modules_to_not_convert"), "awq modules_to_not_convert")
    ignore = (*(_substring_pattern(k) for k in skip), "lm_head")  # AutoAWQ never quantizes the LM head
    scheme = WeightScheme(kind=quant.INT4_GROUP, layout=AWQ_GEMM, group_size=group, symmetric=False)
    return QuantConfig(method=AWQ, groups=((("Linear",), scheme),), ignore=ignore)


def _parse_gptq(q: Mapping[str, Any]) -> QuantConfig:
    _four_bits(q.get("bits"), "gptq bits")
    group = _int4_group(q.get("group_size", 128), "gptq group_size")
    sym = q.get("sym", True)
    if not isinstance(sym, bool):
        raise _fail(f"gptq sym must be true or false, got {sym!r}")
    if q.get("desc_act", False) and not q.get("static_groups", False):
        raise _fail("gptq desc_act true (act-order groups, a g_idx that is not k // group_size) is not supported; "
                    "use a checkpoint quantized with desc_act false or static_groups true")  # fmt: skip
    fmt = q.get("checkpoint_format", q.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(f"gptq checkpoint_format {fmt!r} is not supported; read: 'gptq' (v1) and 'gptq_v2'")
    if q.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise _fail(f"gptq pack_dtype {q.get('pack_dtype')!r} is not supported; only int32 packing is read")
    for key in ("dynamic", "modules_in_block_to_quantize"):
        if q.get(key):
            raise _fail(f"gptq {key} (per-module overrides) is not supported yet")
    lm_head = q.get("lm_head", False)
    if not isinstance(lm_head, bool):
        raise _fail(f"gptq lm_head must be true or false, got {lm_head!r}")
    scheme = WeightScheme(kind=quant.INT4_GROUP, layout=GPTQ_LAYOUT, group_size=group, symmetric=sym,
                          zero_plus_one=fmt == "gptq")  # fmt: skip
    # GPTQ quantizes the decoder's linear layers; the LM head only where the config says so.
    return QuantConfig(method=GPTQ, groups=((("Linear",), scheme),), ignore=() if lm_head else ("lm_head",))


def _parse_compressed_tensors(q: Mapping[str, Any]) -> QuantConfig:
    _unknown_keys(q, _CT_KEYS, "compressed-tensors")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail(f"quantization_status {status!r}: only 'compressed' checkpoints store packed weights")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            raise _fail(f"compressed-tensors {key} is not supported yet (a quantized KV cache, sparsity or "
                        "transforms); use a checkpoint without it")  # fmt: skip
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _fail(f"compressed-tensors config_groups must be a non-empty object, got {groups!r}")
    top_format = q.get("format")
    parsed = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, Mapping):
            raise _fail(f"{where} must be an object, got {group!r}")
        _unknown_keys(group, _CT_GROUP_KEYS, where)
        targets = _names(group.get("targets"), f"{where}.targets")
        if not targets:
            raise _fail(f"{where}.targets must name at least one module")
        for t in targets:
            if t != "Linear" and not t.startswith("re:") and t[:1].isupper():
                raise _fail(f"{where}.targets: class {t!r} is not supported; use Linear, module names or re: patterns")
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise _fail(f"{where}.targets: {t!r} is not a valid regular expression ({e})") from None
        fmt = group.get("format") or top_format
        if not isinstance(fmt, str):
            raise _fail(f"{where}: format must be a string (pack-quantized, float-quantized, ...), got {fmt!r}")
        parsed.append((targets, _ct_scheme(group, fmt, where)))
    ignore = _names(q.get("ignore"), "compressed-tensors ignore")
    for p in ignore:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise _fail(f"ignore: {p!r} is not a valid regular expression ({e})") from None
    return QuantConfig(method=COMPRESSED_TENSORS, groups=tuple(parsed), ignore=ignore)


def _ct_scheme(group: Mapping[str, Any], fmt: str, where: str) -> WeightScheme:
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise _fail(f"{where}.weights must be an object (weight quantization), got {w!r}")
    _unknown_keys(w, _CT_ARGS_KEYS, f"{where}.weights")
    if group.get("output_activations") is not None:
        raise _fail(f"{where}.output_activations is not supported")
    bits, kind, sym = w.get("num_bits", 8), w.get("type", "int"), w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise _fail(f"{where}.weights.symmetric must be true or false, got {sym!r}")
    if w.get("dynamic", False) is not False:
        raise _fail(f"{where}.weights.dynamic {w.get('dynamic')!r}: only static (stored) weight scales are read")
    strategy = w.get("strategy")
    group_size = w.get("group_size")
    if strategy is None:  # compressed-tensors infers it from group_size
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    strategy = str(strategy).lower()
    acts = _ct_activations(group.get("input_activations"), where)
    if kind == "float":
        if bits != 8 or isinstance(bits, bool):
            raise _fail(f"{where}.weights: float with num_bits {bits!r} is not supported; only 8-bit float (FP8)")
        if not sym:
            raise _fail(f"{where}.weights: asymmetric FP8 is not supported")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _fail(f"{where}: format {fmt!r} is not supported for FP8 weights; read: float-quantized")
        if w.get("actorder") not in (None, False):
            raise _fail(f"{where}.weights.actorder is not supported for FP8 weights")
        if strategy == "block":
            block = _block(w.get("block_structure"), f"{where}.weights.block_structure")
            return WeightScheme(kind=quant.FP8_BLOCK, layout=CT_FLOAT, block=block, activations=acts)
        if strategy in ("channel", "tensor"):
            return WeightScheme(kind=quant.FP8_CHANNEL if strategy == "channel" else quant.FP8_TENSOR,
                                layout=CT_FLOAT, activations=acts)  # fmt: skip
        raise _fail(f"{where}.weights: FP8 strategy {strategy!r} is not supported; read: tensor, channel, block")
    if kind != "int":
        raise _fail(f"{where}.weights.type {kind!r} is not supported; use 'int' or 'float'")
    _four_bits(bits, f"{where}.weights.num_bits")
    if acts != "none":
        raise _fail(f"{where}.input_activations: quantized activations with INT4 weights (W4A8) are not supported")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise _fail(f"{where}.weights.actorder {w.get('actorder')!r} (act-order groups with a g_idx) is not "
                    "supported; 'weight' act-order and none are")  # fmt: skip
    if strategy == "group":
        size = _int4_group(group_size, f"{where}.weights.group_size")
        if size is None:
            raise _fail(f"{where}.weights: strategy group needs a positive group_size")
    elif strategy == "channel":
        size = None
    else:
        raise _fail(f"{where}.weights: INT4 strategy {strategy!r} is not supported; read: group, channel")
    layouts = {"pack-quantized": CT_PACK, "naive-quantized": CT_NAIVE_INT}
    if fmt not in layouts:
        raise _fail(f"{where}: format {fmt!r} is not supported for INT4 weights; read: {', '.join(layouts)}")
    return WeightScheme(kind=quant.INT4_GROUP, layout=layouts[fmt], group_size=size, symmetric=sym)


def _ct_activations(acts: Any, where: str) -> str:
    """What a group does to its inputs: "none", or FP8 "dynamic" / "static" (not applied by Envex)."""
    if acts is None:
        return "none"
    if not isinstance(acts, Mapping):
        raise _fail(f"{where}.input_activations must be an object or null, got {acts!r}")
    _unknown_keys(acts, _CT_ARGS_KEYS, f"{where}.input_activations")
    if acts.get("type", "int") != "float" or acts.get("num_bits", 8) != 8:
        raise _fail(f"{where}.input_activations: only FP8 activations are recognised (served unquantized)")
    return "static" if acts.get("dynamic", False) is False else "dynamic"


# ---- MoE experts -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertQuant:
    """An MoE checkpoint's quantized experts (moe_experts): their scheme, the sparse layers whose routed experts are
    stored so, and whether the shared experts (DeepSeek's) are stored so too (else float: Kimi K2's INT4 release)."""

    scheme: WeightScheme | None = None
    layers: tuple[int, ...] = ()
    shared_packed: bool = True


# INT4 expert layouts the loader converts into kernels.quant.Int4GroupStack's
INT4_EXPERT_LAYOUTS = (CT_PACK, AWQ_GEMM)


def moe_experts(cfg: Mapping[str, Any], layers: Mapping[int, list[str]],
                shared: Mapping[int, list[str]] | None = None) -> ExpertQuant:  # fmt: skip
    """An MoE checkpoint's experts: layers maps each sparse layer to its routed experts' HF module names, shared to
    its shared experts' (DeepSeek). The expert kernels read FP8 block-scaled experts (quant_method "fp8") and INT4
    group-quantized ones (compressed-tensors pack-quantized, AWQ GEMM; groups a power of two >= 16); any other
    scheme, one that differs between layers, a layer whose routed experts are partly left in float, or shared
    experts left in float beside FP8 routed ones, is one ConfigError."""
    qc = quant_config_from_hf(cfg)
    if qc is None:
        return ExpertQuant()
    found: WeightScheme | None = None
    packed_layers, shared_kinds = [], set()
    for i, modules in layers.items():
        schemes = _layer_schemes(qc, modules)
        side = _layer_schemes(qc, shared[i]) if shared else set()
        if schemes == {None}:
            if side - {None}:
                raise _fail(f"layer {i}'s shared experts are quantized and its routed experts left in float; "
                            "quantize a layer's experts alike")  # fmt: skip
            continue  # the checkpoint keeps this layer's experts in float
        if None in schemes or len(side) > 1:
            raise _fail(f"layer {i}'s experts are partly quantized, partly left in float (modules_to_not_convert / "
                        "ignore); quantize a layer's experts alike")  # fmt: skip
        scheme = schemes.pop()
        fp8 = scheme.kind == quant.FP8_BLOCK and scheme.layout == FP8_DEEPSEEK
        int4 = scheme.kind == quant.INT4_GROUP and scheme.layout in INT4_EXPERT_LAYOUTS
        if schemes or not (fp8 or int4):
            raise _fail(f"{qc.method} {scheme.kind} MoE experts are not supported; the expert kernels read FP8 "
                        "block-scaled experts (quant_method fp8, weight_block_size [128, 128]) and INT4 ones "
                        "(compressed-tensors pack-quantized, AWQ GEMM)")  # fmt: skip
        if fp8 and scheme.block[1] < 16 or found is not None and found.block != scheme.block:
            raise _fail(f"fp8 weight_block_size {list(scheme.block)} is not supported for MoE experts; use blocks "
                        "of 16 or more columns, one size for every layer")  # fmt: skip
        g = scheme.group_size
        if int4 and (g is None or g < 16 or g & (g - 1)):
            raise _fail(f"INT4 MoE experts with group_size {g} are not supported; the expert kernels read groups "
                        "of a power of two >= 16 inputs (32 and 128 in the published releases)")  # fmt: skip
        if found is not None and found != scheme:
            raise _fail(f"MoE experts in two schemes ({found.kind} and {scheme.kind}, or other groups); quantize "
                        "every layer's experts alike")  # fmt: skip
        if side and side != {scheme} and not (int4 and side == {None}):
            raise _fail(f"layer {i}'s shared experts are stored in another scheme than its routed experts; FP8 "
                        "experts need both alike, INT4 ones the shared experts alike or float")  # fmt: skip
        shared_kinds.update(side)
        found = scheme
        packed_layers.append(i)
    if len(shared_kinds) > 1:
        raise _fail("the shared experts are quantized in some layers and float in others; quantize them alike")
    return ExpertQuant(scheme=found, layers=tuple(packed_layers), shared_packed=None not in shared_kinds)


def _layer_schemes(qc: QuantConfig, modules: list[str]) -> set[WeightScheme | None]:
    """{qc.scheme_for(m) for m in modules}, fast where no ignore pattern can match any of them (DeepSeek-V3 has
    44,544 expert modules, checked against each of its ignore patterns in 3 s one by one): an exact name or a
    substring pattern (fp8's modules_to_not_convert) that is in none of the names matches none of them."""
    joined = "\n".join(modules)
    if len(qc.groups) == 1 and qc.groups[0][0] == ("Linear",) and all(
            (lit := _literal(p)) is not None and lit not in joined for p in qc.ignore):  # fmt: skip
        return {qc.groups[0][1]}
    return {qc.scheme_for(m) for m in modules}


def _literal(pattern: str) -> str | None:
    """The text every name an ignore pattern matches contains: an exact name, or the literal of a substring
    pattern ("re:.*" and an escaped literal, _substring_pattern); None for any other regular expression."""
    if not pattern.startswith("re:"):
        return pattern
    rest = pattern[len("re:.*") :] if pattern.startswith("re:.*") else None
    if rest is None:
        return None
    lit = re.sub(r"\\(.)", r"\1", rest)
    return lit if "\n" not in lit and re.escape(lit) == rest else None


# ---- reading one layer's tensors -------------------------------------------------------------------------------


def load_packed(scheme: WeightScheme, tensors: Mapping[str, torch.Tensor], *, module: str) -> quant.PackedWeight:
    """One linear layer's PackedWeight from its checkpoint tensors, by suffix (`tensors["weight_scale"]` is
    `<module>.weight_scale`; a "bias" is the caller's). A missing or unexpected tensor, or one of the wrong shape
    or dtype, is one ConfigError naming the layer."""
    required, optional = scheme.tensor_names(), scheme.optional_tensor_names()
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ConfigError(f"{module}: missing tensor {module}.{missing[0]} for the {scheme.layout} {scheme.kind} "
                          f"weight (expected {', '.join(required)})")  # fmt: skip
    extra = sorted(n for n in tensors if n not in (*required, *optional, "bias"))
    if extra:
        raise ConfigError(f"{module}: unexpected tensor {module}.{extra[0]} for the {scheme.layout} {scheme.kind} "
                          "weight the config declares")  # fmt: skip
    t = tensors.get
    zp = t("weight_zero_point")
    if scheme.symmetric and zp is not None and bool(zp.ne(0).any()):
        raise ConfigError(f"{module}: weight_zero_point is not zero in a layer the config declares symmetric")
    try:
        return _read(scheme, t)
    except ConfigError:
        raise
    except (ValueError, RuntimeError, IndexError) as e:
        raise ConfigError(f"{module}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _read(scheme: WeightScheme, t: Callable[[str], torch.Tensor | None]) -> quant.PackedWeight:
    def need(name: str) -> torch.Tensor:
        v = t(name)
        assert v is not None  # load_packed checked the required names
        return v

    if scheme.layout == AWQ_GEMM:
        return quant.from_awq(need("qweight"), need("qzeros"), need("scales"), scheme.group_size)
    if scheme.layout == GPTQ_LAYOUT:
        return quant.from_gptq(need("qweight"), need("qzeros"), need("scales"), scheme.group_size, t("g_idx"),
                               zero_plus_one=scheme.zero_plus_one)  # fmt: skip
    zero = None if scheme.symmetric else need("weight_zero_point")
    if scheme.layout == CT_PACK:
        return quant.from_pack_quantized(need("weight_packed"), need("weight_scale"), need("weight_shape"),
                                         scheme.group_size, zero)  # fmt: skip
    if scheme.layout == CT_NAIVE_INT:
        return quant.from_naive_int4(need("weight"), need("weight_scale"), scheme.group_size, zero)
    weight = need("weight")
    if weight.dtype != quant.FP8_DTYPE:
        raise ValueError(f"weight: dtype {weight.dtype}, expected float8_e4m3fn for an FP8 layer")
    if scheme.kind == quant.FP8_BLOCK:
        scale = need("weight_scale_inv" if scheme.layout == FP8_DEEPSEEK else "weight_scale")
        return quant.fp8_block(weight, scale, scheme.block)
    if scheme.kind == quant.FP8_CHANNEL:
        return quant.fp8_channel(weight, need("weight_scale"))
    return quant.fp8_tensor(weight, need("weight_scale"))
