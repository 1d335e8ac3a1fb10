"""Low-bit weights into a model, kept packed (issue 42; offline_docs/quantization.md).

Two ways in, one result: each linear projection of a Llama-family model that is low-bit becomes one
kernels.quant.PackedWeight in place of its float parameter (the fused ones, QKV and gate-up, their parts
concatenated along the outputs, quant.concat_outputs), and the backends' Ops dispatch on it (kernels/ops.py:
`Capabilities.packed_weights`).

- A checkpoint whose config.json carries a quantization_config (runtime/quant_config.py reads it; an unsupported
  scheme is its one-line ConfigError): each quantized layer's tensors are read into a PackedWeight as they are
  stored, never dequantized. The model's float parameter for it is replaced by a meta tensor before the load, so
  its float copy is never filled (the model's own load_weights still checks every name and shape).
- A quantized MoE checkpoint (Qwen3-MoE, DeepSeek; quantization_config "fp8"): the model file takes its FP8
  experts and their block scales by their own names, kept packed (MoEConfig.fp8_layers, kernels.ops.MoEWeights);
  INT4 experts (compressed-tensors pack-quantized, AWQ; MoEConfig.int4_layers) are read here expert by expert by
  their converter into the internal int4_group layout and handed over as `weight_packed`, `weight_scale` and
  `weight_zero` (models/decoder.py INT4_EXPERT_SUFFIXES), kept packed;
  Qwen3-Next's FP8 release keeps its other FP8 projections packed too, the model file taking them by name as
  stored (HybridConfig.fp8_layers: their `weight_scale_inv` expected) into kernels.quant.PackedWeight matrices of
  its own layout (models/qwen3_next.py); any other quantized projection (Qwen3-MoE's and DeepSeek's attention,
  dense MLPs, shared ones; Qwen3-Next's MTP fc) is dequantized here to the model's dtype as it streams in
  (`load_dequantized`). The multi-token-prediction layers go through the same stream when they draft
  (`load_mtp_weights`); the model's own load does not read their tensors (`unread`).
- A GGUF file whose linear projections are Q4_0 (runtime/gguf_loader.py PACKED_TYPES): the same path as a
  quantization_config, with gguf_loader handing each Q4_0 matrix over repacked, exactly, as compressed-tensors'
  symmetric pack-quantized tensors in groups of 32 (Q4_0_SCHEME). A fused matrix with a part of another type is
  dequantized whole; so is the whole file where packed weights cannot run (a weights policy, which quantizes the
  float model; --deterministic; tensor parallelism): dequantized at load as before, not refused (_gguf_packs).
- A float model and a weights policy (runtime/weight_policy.py, EngineConfig.weights): the model loads as usual,
  then each projection the policy names is quantized by kernels/quant.py's quantizers, part by part (q, k, v
  each, as verify/weight_quality.py measures them) and concatenated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from envex.kernels import quant
from envex.kernels.backends import Backend
from envex.runtime.config import ConfigError, ModelConfig, qwen3_next_projections
from envex.runtime.gguf_loader import Q4_0_SCHEME, packed_linears
from envex.runtime.gguf_loader import iter_weights as gguf_weights
from envex.runtime.loader import LoadedModel
from envex.runtime.models import dummy_weights, model_class
from envex.runtime.models.llama import LlamaForCausalLM
from envex.runtime.quant_config import QuantConfig, WeightScheme, load_packed, quant_config_from_hf
from envex.runtime.weight_policy import WeightPolicy, policy_from_setting

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@dataclass
class _Target:
    """One of the model's projection parameters and the checkpoint modules (HF names) stacked into it."""

    owner: nn.Module
    attr: str
    parts: dict[int, str] = field(default_factory=dict)  # shard index -> HF module name
    schemes: dict[str, WeightScheme | None] = field(default_factory=dict)


def _targets(model: LlamaForCausalLM) -> dict[str, _Target]:
    """Our projection parameters (by qualified name) -> their HF modules, from the model's own name mapping."""
    by_id = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    out: dict[str, _Target] = {}
    for hf_name in sorted(model.expected_weight_names()):
        module, _, kind = hf_name.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in LINEARS:
            continue
        found = model._target(hf_name)
        assert found is not None, hf_name
        param, shard = found
        qual = by_id[id(param)]
        owner_name, _, attr = qual.rpartition(".")
        t = out.setdefault(qual, _Target(model.get_submodule(owner_name) if owner_name else model, attr))
        t.parts[0 if shard is None else shard] = module
    return out


def packable(model: nn.Module, why: str) -> LlamaForCausalLM:
    """The model, if it can take packed weights; else one line saying why not (what asked for them: `why`)."""
    if not isinstance(model, LlamaForCausalLM):
        raise ConfigError(f"{why}: packed low-bit weights are served for the Llama family (Llama, Qwen2/3, Mistral, "
                          f"SmolLM2) only so far, not {type(model).__name__}; serve the float checkpoint")
    if model.parallel.world_size > 1:
        raise ConfigError(f"{why}: packed low-bit weights do not run under tensor parallelism yet; use "
                          "--tensor-parallel 1")  # fmt: skip
    return model


def _install(target: _Target, packed: quant.PackedWeight) -> None:
    """Put the PackedWeight where the float parameter was (the model reads it by the same attribute)."""
    if target.attr in target.owner._parameters:
        delattr(target.owner, target.attr)
    setattr(target.owner, target.attr, packed)


def load_quantized(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig,
                   device: torch.device) -> dict[str, str]:  # fmt: skip
    """Load a quantized checkpoint: its low-bit layers packed (module docstring), the rest through the model's
    load_weights. Returns our parameter name -> its scheme (kernels.quant), for what was packed."""
    model = packable(module, f"config.json quantization_config {qc.method}")
    targets = _targets(model)
    packed_at: dict[str, _Target] = {}  # HF module -> its target
    for t in targets.values():
        for hf_module in t.parts.values():
            t.schemes[hf_module] = qc.scheme_for(hf_module)
        kinds = {"float" if s is None else s.kind for s in t.schemes.values()}
        if kinds == {"float"}:
            continue
        if len(kinds) > 1:
            raise ConfigError(f"config.json quantization_config: {', '.join(sorted(t.parts.values()))} are one "
                              f"matrix in Envex but have different schemes ({', '.join(sorted(kinds))}); "
                              "quantize them alike")  # fmt: skip
        # Its float copy is never filled: the meta tensor keeps the model's name and shape checks, not the bytes.
        param = getattr(t.owner, t.attr)
        placeholder = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        placeholder._envex_packed_target = True  # type: ignore[attr-defined]  # _materialize leaves it
        setattr(t.owner, t.attr, placeholder)
        packed_at.update((m, t) for m in t.parts.values())
    tensors: dict[str, dict[str, torch.Tensor]] = {m: {} for m in packed_at}  # HF module -> suffix -> tensor
    parts: dict[str, quant.PackedWeight] = {}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            hf_module, _, suffix = name.rpartition(".")
            if hf_module in packed_at and suffix != "bias":  # a bias stays float, in the model's parameter
                # straight to the device: the host holds one tensor at a time, not the packed model
                tensors[hf_module][suffix] = tensor.to(device)
            else:
                yield name, tensor
        for hf_module, t in packed_at.items():
            if not tensors[hf_module]:
                continue  # load_weights names it as missing
            scheme = t.schemes[hf_module]
            assert scheme is not None
            parts[hf_module] = pw = load_packed(scheme, tensors.pop(hf_module), module=hf_module)
            yield f"{hf_module}.weight", torch.empty(pw.shape, device="meta")  # checked against the model's shape

    _materialize(model, device)  # a model built on the meta device (build_device): its float parameters
    model.load_weights(stream())
    done: dict[str, str] = {}
    for qual, t in targets.items():
        if t.parts and t.parts[min(t.parts)] in parts:
            pw = quant.concat_outputs([parts.pop(t.parts[i]) for i in sorted(t.parts)])
            _install(t, pw)
            done[qual] = pw.scheme
    return done


def load_dequantized(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig,
                     device: torch.device) -> dict[str, str]:  # fmt: skip
    """Load a quantized checkpoint into a model that takes some of its layers packed itself (their block scales are
    among its expected_weight_names: an MoE model's FP8 experts, Qwen3-Next's FP8 projections), through
    `dequantized_weights` (a multi-token-prediction layer is not among `weights`: `unread`). Returns our parameter
    name -> scheme for what stays packed."""
    expected = model.expected_weight_names()  # type: ignore[operator]
    dtype: torch.dtype = model.embed_tokens_weight.dtype  # type: ignore[assignment, union-attr]
    model.load_weights(dequantized_weights(weights, qc, expected, dtype, device))  # type: ignore[operator]
    return {name: quant.FP8_BLOCK if p.dtype == quant.FP8_DTYPE else quant.INT4_GROUP
            for name, p in model.named_parameters() if p.dtype in (quant.FP8_DTYPE, torch.int32)}  # fmt: skip


def load_mtp_weights(module: nn.Module, loaded: LoadedModel, device: torch.device) -> None:
    """Fill a multi-token-prediction module (DeepseekMTP, Qwen3NextMTP: their `weight_prefix`,
    `load_weights(weights, source)`) with its tensors only; a quantized checkpoint's through the model's stream
    (`dequantized_weights` with the module's expected_weight_names: its FP8 or INT4 experts as the model takes its
    own, MoEConfig.fp8_layers / int4_layers naming its index, every other quantized projection dequantized)."""
    weights = loaded.iter_weights(module.weight_prefix)  # type: ignore[operator]
    qc = quant_config_from_hf(loaded.hf_config)
    if qc is not None:
        expected = module.expected_weight_names()  # type: ignore[operator]
        dtype: torch.dtype = module.embed_tokens_weight.dtype  # type: ignore[assignment, union-attr]
        weights = dequantized_weights(weights, qc, expected, dtype, device)
    module.load_weights(weights, loaded.source.name)  # type: ignore[operator]


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig, expected: set[str],
                        dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """A quantized checkpoint's tensors as a model (or module) whose names are `expected` takes them: the layers it
    takes packed itself (their `weight_scale_inv` expected: FP8 experts, Qwen3-Next's FP8 projections) as they
    are; INT4 experts (their `weight_packed` expected) converted (_int4_expert); every other quantized layer's
    tensors (an FP8 weight, its scales) read (load_packed: each checked) and handed over as `<module>.weight`,
    dequantized to `dtype`; float tensors as they are."""
    own = {n.rpartition(".")[0] for n in expected if n.endswith(".weight_scale_inv")}  # modules taken as stored
    int4 = {n.rpartition(".")[0] for n in expected if n.endswith(".weight_packed")}  # INT4 experts, converted
    pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> suffix -> tensor, until its layer is whole
    done: set[str] = set()
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if module in own and suffix == "input_scale":
            continue  # a static activation scale: read and unused (activations stay in the model's dtype)
        scheme = None if module in own else qc.scheme_for(module)
        names = () if scheme is None else (*scheme.tensor_names(), *scheme.optional_tensor_names())
        # not a quantized layer's tensor, or a float weight ("Linear" targets embeddings and norms too)
        if scheme is None or suffix not in names or suffix == "weight" and tensor.dtype != quant.FP8_DTYPE:
            yield name, tensor
        elif module in int4 and module not in done:
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor.to(device)
            if all(n in parts for n in scheme.tensor_names()):
                done.add(module)
                yield from _int4_expert(load_packed(scheme, pending.pop(module), module=module), module,
                                        f"{module}.weight_zero" in expected)  # fmt: skip
        elif module in done:  # an optional tensor after the layer was read (input_scale: unused)
            if suffix not in scheme.optional_tensor_names():
                raise ConfigError(f"{module}: unexpected tensor {name} after its {scheme.kind} weight was read")
        else:
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor.to(device)
            if all(n in parts for n in scheme.tensor_names()):
                done.add(module)
                pw = load_packed(scheme, pending.pop(module), module=module)
                yield f"{module}.weight", quant.dequantize(pw, dtype)
    for module, parts in pending.items():  # a layer missing a tensor: load_packed names it
        load_packed(qc.scheme_for(module), parts, module=module)  # type: ignore[arg-type]


def _int4_expert(pw: quant.PackedWeight, module: str, zero: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """An INT4 expert's matrix, read by its checkpoint's converter into the internal int4_group layout, as the
    model takes it (models/decoder.py INT4_EXPERT_SUFFIXES): words, group scales and, for a layer with zero points,
    zeros (8 for a symmetric matrix)."""
    yield f"{module}.weight_packed", pw.data
    yield f"{module}.weight_scale", pw.scale
    if zero:
        yield f"{module}.weight_zero", pw.zero if pw.zero is not None else torch.full_like(
            pw.scale, quant.SYMMETRIC_ZERO, dtype=torch.uint8)  # fmt: skip


def stored_as_packed(config: ModelConfig, hf_config: Mapping[str, Any], names: Iterable[str]) -> set[str]:
    """Of a checkpoint's tensor names, those the engine holds in memory as they are stored (the rest it holds in
    the model's float dtype), for the install plan's byte count: a quantized Llama-family checkpoint's quantized
    projections (load_quantized), an MoE checkpoint's FP8 or INT4 experts and their scales and zeros
    (MoEConfig.fp8_layers, int4_layers; not weight_shape, nor float shared experts beside INT4 ones), a Qwen3-Next
    FP8 release's other FP8 projections and their block scales (HybridConfig.fp8_layers; the engine holds a
    gathered matrix's scales per row where its rows cross blocks: models/qwen3_next.py) and gpt-oss's MXFP4
    experts."""
    if config.quantization == "mxfp4":
        return {n for n in names if n.endswith(("_blocks", "_scales"))}
    qc = quant_config_from_hf(hf_config)
    if qc is None:
        return set()
    if config.moe is not None:
        fp8, int4 = set(config.moe.fp8_layers), set(config.moe.int4_layers)
        shared = config.moe.int4_shared

        def layer(m: re.Match[str]) -> int:  # Qwen3-Next's mtp.layers.j: index num_hidden_layers + j
            return int(m.group(1)) if m.group(1) is not None else config.num_hidden_layers + int(m.group(2))

        projections = set(config.hybrid.fp8_layers) if config.hybrid is not None else set()  # Qwen3-Next's

        def stored(n: str) -> bool:
            if (m := _EXPERT_TENSOR.match(n)) is not None:  # a routed (or shared) expert's tensor
                return layer(m) in fp8 or (layer(m) in int4 and (shared or ".shared_experts." not in n)
                                           and not n.endswith(".weight_shape"))  # fmt: skip
            m = _PROJECTION_TENSOR.fullmatch(n)  # a Qwen3-Next FP8 layer's projection, or its scales
            return m is not None and layer(m) in projections and m.group(3) in _QWEN3_NEXT_PROJECTIONS

        return {n for n in names if stored(n)}
    kept = set()
    for name in names:
        module, _, suffix = name.rpartition(".")
        scheme = qc.scheme_for(module) if module.rpartition(".")[2] in LINEARS else None
        if scheme is not None and suffix in (*scheme.tensor_names(), *scheme.optional_tensor_names()):
            kept.add(name)
    return kept


_EXPERT_TENSOR = re.compile(r"(?:model\.layers\.(\d+)|mtp\.layers\.(\d+))\.mlp\.(?:shared_)?experts\.")
_PROJECTION_TENSOR = re.compile(r"(?:model\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)\.(?:weight|weight_scale_inv)")
_QWEN3_NEXT_PROJECTIONS = {m for linear in (True, False) for sparse in (True, False)
                           for m in qwen3_next_projections(linear, sparse)}  # fmt: skip


def build_device(loaded: LoadedModel, load_format: str, device: torch.device, *, weights: str | None = None,
                 backend: Backend | None = None, world_size: int = 1) -> torch.device:  # fmt: skip
    """Where to build the model: the meta device for a quantized Llama-family checkpoint, or a GGUF with Q4_0
    projections it will serve packed (weights, backend, world_size: as load_model_weights will see them), so the
    float copies of the projections it brings packed are never allocated (load_quantized allocates the rest); else
    `device` (an MoE model builds its FP8 experts as such, MoEConfig.fp8_layers, and holds views of some
    parameters, which a meta build would leave behind)."""
    quantized = load_format != "dummy" and quant_config_from_hf(loaded.hf_config) is not None
    gguf = bool(_gguf_packs(loaded, load_format, weights, backend, world_size))
    return torch.device("meta") if quantized and loaded.config.moe is None or gguf else device


def _gguf_packs(loaded: LoadedModel, load_format: str, weights: str | None, backend: Backend | None,
                world_size: int) -> Mapping[str, int]:  # fmt: skip
    """The HF modules of a GGUF whose weights can be served packed (gguf_loader.packed_linears: Q4_0), or none where
    the file is dequantized at load as before: not a GGUF, dummy weights, a weights policy (it quantizes the float
    model), a backend without packed kernels (--deterministic), tensor parallelism, not the Llama family."""
    if (loaded.source.kind != "gguf" or load_format == "dummy" or weights is not None or backend is None
            or not backend.capabilities.packed_weights or world_size > 1
            or not issubclass(model_class(loaded.config), LlamaForCausalLM)):  # fmt: skip
        return {}
    return packed_linears(loaded.source.path)


def gguf_stored_as_packed(config: ModelConfig, path: Path) -> tuple[int, int]:
    """(elements, bytes) of a GGUF's projections the engine keeps packed when served (its default backend, one GPU),
    for the install plan's byte count: the Q4_0 ones whose whole matrix is Q4_0 (_gguf_quant_config), held as
    int4_group of 32 (half a byte a weight, a float16 scale per 32)."""
    if not issubclass(model_class(config), LlamaForCausalLM):
        return 0, 0
    sizes = packed_linears(path)
    qc = _gguf_quant_config(model_class(config)(config, dtype=torch.bfloat16, device=torch.device("meta")), sizes)
    elements = sum(sizes[m] for group, _ in (qc.groups if qc else ()) for m in group)
    return elements, elements // 2 + elements // 32 * 2


def _gguf_quant_config(model: LlamaForCausalLM, modules: Mapping[str, int]) -> QuantConfig | None:
    """Q4_0_SCHEME for the modules whose whole matrix in Envex (q/k/v and gate/up are one each) is in `modules`; a
    matrix with a part of another type is dequantized whole (one matrix, one scheme). None: nothing to pack."""
    keep = sorted(m for t in _targets(model).values() if set(t.parts.values()) <= modules.keys()
                  for m in t.parts.values())  # fmt: skip
    return QuantConfig(method="gguf", groups=((tuple(keep), Q4_0_SCHEME),)) if keep else None


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give every parameter still on the meta device but a packed target (already replaced) memory on `device`,
    in place (torch.utils.swap_tensors): the same Python objects, so references to them (AttentionLayer's q/k
    norms, a tied LM head) follow."""
    seen: set[int] = set()
    for _, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and id(p) not in seen and not getattr(p, "_envex_packed_target", False):
            seen.add(id(p))
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                     requires_grad=False))  # fmt: skip


def quantize_by_policy(module: nn.Module, policy: WeightPolicy) -> dict[str, str]:
    """Quantize a loaded float model's projections by `policy` (module docstring). Returns our parameter name ->
    its scheme, for what was packed."""
    model = packable(module, f"weights policy {policy.label}")
    schemes = policy.resolve(model.config.num_hidden_layers)  # PolicyError for a layer the model lacks
    done: dict[str, str] = {}
    for qual, t in _targets(model).items():
        modules = [t.parts[i] for i in sorted(t.parts)]
        scheme = schemes["lm_head" if modules == ["lm_head"] else modules[0]]
        if scheme.kind == "bf16":
            continue
        w = getattr(t.owner, t.attr).detach()
        sizes = [_rows(model, qual, i, w.shape[0]) for i in sorted(t.parts)]
        # fp8_block parts that are not whole 128-row blocks (a small model's q/k/v): the fused matrix's blocks
        whole = scheme.name == "fp8_block" and any(s % 128 for s in sizes[:-1])
        pieces = [scheme.pack(w)] if whole else [scheme.pack(p) for p in w.split(sizes)]
        pw = quant.concat_outputs([p for p in pieces if p is not None])
        _install(t, pw)
        done[qual] = pw.scheme
    if model.config.tie_word_embeddings and policy.lm_head.kind != "bf16":
        # the LM head of a tied model gets its own packed copy; the embedding lookup stays float
        pw = policy.lm_head.pack(model.embed_tokens_weight.detach())
        assert pw is not None
        if "lm_head_weight" in model._parameters:
            delattr(model, "lm_head_weight")
        model.lm_head_weight = pw  # type: ignore[assignment]
        done["lm_head_weight"] = pw.scheme
    return done


def unread(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes of a checkpoint's tensors the model never takes, left unread from the files: a multi-token-
    prediction layer (its drafter reads it when asked for, runtime/engine/spec/mtp.py)."""
    return tuple(getattr(model, "unread_prefixes", ()))


def load_model_weights(model: nn.Module, loaded: LoadedModel, *, load_format: str, seed: int, weights: str | None,
                       backend: Backend, device: torch.device) -> dict[str, str]:  # fmt: skip
    """Fill a freshly built model: random (load_format "dummy"), the checkpoint's float weights, or its packed
    low-bit ones (a quantization_config, a GGUF's Q4_0 projections: _gguf_packs); then quantize by the `weights`
    policy setting (EngineConfig.weights). Returns our parameter name -> scheme for every packed projection
    (empty: all float). A backend that cannot read packed weights (Capabilities.packed_weights) is refused in one
    line before anything is read (a GGUF is dequantized for it instead)."""
    qc = quant_config_from_hf(loaded.hf_config) if load_format != "dummy" else None
    policy = policy_from_setting(weights) if weights is not None else None
    if qc is not None and policy is not None:
        raise ConfigError(f"weights policy: {loaded.source.name} is already quantized (quantization_config "
                          f"{qc.method}); serve it without --weights (engine.weights)")  # fmt: skip
    what = f"quantization_config {qc.method}" if qc is not None else f"weights policy {weights}"
    if qc is not None and getattr(getattr(model, "config", None), "moe", None) is not None:
        # an MoE checkpoint (ModelConfig.from_hf refused any scheme its experts cannot be served in)
        return load_dequantized(model, loaded.iter_weights(skip=unread(model)), qc, device)
    if qc is not None or policy is not None:
        packable(model, what)  # before any weight is read
    if (qc is not None or policy is not None) and not backend.capabilities.packed_weights:
        raise ConfigError(f"{what}: {backend.label} cannot read packed low-bit weights; use the torch or triton "
                          "backend without --deterministic")  # fmt: skip
    if load_format == "dummy":
        dummy_weights(model, seed)
    elif qc is not None:
        return load_quantized(model, loaded.iter_weights(skip=unread(model)), qc, device)
    else:
        world = model.parallel.world_size if isinstance(model, LlamaForCausalLM) else 1
        gguf = _gguf_packs(loaded, load_format, weights, backend, world)
        gguf_qc = _gguf_quant_config(model, gguf) if gguf and isinstance(model, LlamaForCausalLM) else None
        if gguf_qc is not None:
            packed = gguf_weights(loaded.source.path, loaded.hf_config, packed=set(gguf_qc.groups[0][0]))
            return load_quantized(model, packed, gguf_qc, device)
        if gguf:
            _materialize(model, device)  # built on the meta device (build_device), yet every matrix mixes types
        model.load_weights(loaded.iter_weights(skip=unread(model)))  # type: ignore[operator]
    if policy is None:
        return {}
    return quantize_by_policy(model, policy)


def _rows(model: LlamaForCausalLM, qual: str, shard: int, total: int) -> int:
    """Rows of part `shard` in our parameter `qual` (the whole matrix for one that fuses nothing)."""
    attr = qual.rpartition(".")[2].removesuffix("_weight")
    if attr in ("qkv_proj", "gate_up_proj"):
        s = model.shard_slice(attr, shard)
        return s.stop - s.start
    return total
