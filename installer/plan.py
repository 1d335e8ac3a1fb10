"""Step 3: decide what to install on this machine, or say exactly what is missing. Nothing is written here.

Choices: the newest runtime and model bundles (or the model named with --model), the newest kernel bundle whose
keys all match (CUDA only: accelerator, driver floor, python, torch, triton, CUDA, the runtime's kernel-source
digest, and the model it was compiled for; each one refused is noted with the key that differs, and without one
the kernels compile at first start), engine settings that fit the memory (on CUDA the fewest GPUs of this host
whose memory holds the weights and one full-context sequence: the tensor-parallel degree, noted when above 1),
the deterministic mode as the admin chose it (off unless asked for; refused for a model without its kernels),
the gates' reference (--reference: a model bundle's signed answers, envex-references.json, must answer for the
weights beside them; `signed` is refused for a bundle without them), and a check that the disk has room for the
release beside the active one.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from envex.bundles import SemVer, VerificationError, VerifiedBundle
from envex.bundles.archive import BundleArchive
from envex.bundles.kernel_cache import MAX_WHEEL_BYTES, KernelCacheError, wheel_kernel_digest
from envex.bundles.verify import DISK_HEADROOM
from envex.installer.cards import (
    WHEELHOUSE,
    CardError,
    ModelCard,
    RuntimeCard,
    model_card,
    runtime_card,
    weights_problem,
)
from envex.installer.media import InstallError
from envex.installer.probe import Probe
from envex.installer.state import BundleRef
from envex.verify.references_file import MAX_BYTES as MAX_REFERENCES_BYTES
from envex.verify.references_file import (
    REFERENCE_CHOICES,
    REFERENCES_FILE,
    ReferencesError,
    check_digest,
    model_digest,
    parse_references,
)

GIB = 1 << 30
CPU_RAM_FRACTION = 0.8  # leave the rest to the OS and the serving process' own overhead
GPU_MEMORY_UTILIZATION = 0.85
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# A model card's quantization naming float weights (installer/model_card.py): the ones a weights policy can pack.
FLOAT_WEIGHTS = ("bfloat16", "float16", "float32", "float64")


@dataclass(frozen=True)
class Plan:
    mode: str  # "cuda" | "cpu"
    runtime: VerifiedBundle
    runtime_card: RuntimeCard
    model: VerifiedBundle
    model_card: ModelCard
    kernels: VerifiedBundle | None
    engine: dict[str, Any]  # EngineConfig settings except model / served_name
    weights_bytes: int
    kv_bytes: int
    memory_budget: int
    disk_needed: int
    disk_free: int
    notes: tuple[str, ...]
    probe: Probe | None = None  # what the plan was made for; recorded in launch.json (the admin page shows it)
    reference: str = "auto"  # the gates' reference: auto | local | signed (--reference)
    signed_references: bool = False  # the model bundle holds signed reference answers (checked here)
    # The KV cache's format (--kv-cache-dtype; engine["kv_cache_dtype"]) and what the plan counts in it: bytes of
    # one token over every layer and the tokens the KV memory holds (the GPU memory left by the weights, or the
    # CPU pool of kv_cache_memory_gb): a packed format holds more tokens in the same memory.
    kv_cache_dtype: str = "bf16"
    kv_bytes_per_token: int = 0
    kv_capacity_tokens: int = 0
    # The weights policy (--weights; engine["weights"], canonical): the projections quantized at load, held to the
    # policy's band by verify.weight_quality_band. None: the weights as the checkpoint stores them.
    weights_policy: str | None = None
    # A hybrid model's recurrent state (Qwen3-Next): the engine's state slots, allocated before the KV cache takes
    # its share (runtime/engine/caches/state_slots.py): reserved from the memory budget beside the weights.
    state_bytes: int = 0

    @property
    def bundles(self) -> list[VerifiedBundle]:
        return [b for b in (self.runtime, self.model, self.kernels) if b is not None]

    def summary(self) -> str:
        kernels = f", kernels {self.kernels.name} {self.kernels.version}" if self.kernels else ""
        tp = int(self.engine.get("tensor_parallel", 1))
        gpus = f" over {tp} GPUs (tensor parallel)" if tp > 1 else ""
        return (
            f"{self.mode}: {self.model.name} {self.model.version} on {self.runtime.name} {self.runtime.version}"
            f"{kernels}{gpus}; needs {(self.weights_bytes + self.kv_bytes + self.state_bytes) / GIB:.2f} of "
            f"{self.memory_budget / GIB:.1f} GiB memory, {self.disk_needed / GIB:.2f} of "
            f"{self.disk_free / GIB:.1f} GiB disk; KV cache {self.kv_cache_dtype}: {self.kv_capacity_tokens} tokens "
            f"({self.kv_bytes_per_token} bytes a token)"
            + (f"; weights {self.weights_policy} at load" if self.weights_policy is not None else "")
        )


def bundle_ref(bundle: VerifiedBundle) -> BundleRef:
    return BundleRef(
        name=bundle.name,
        kind=bundle.kind,  # type: ignore[arg-type]
        version=bundle.version,
        manifest_sha256=bundle.manifest_sha256,
        signer_keyids=list(bundle.signer_keyids),
    )


def _newest(bundles: list[VerifiedBundle]) -> VerifiedBundle:
    return max(bundles, key=lambda b: SemVer.parse(b.version))


def _release_version(text: str) -> tuple[int, ...]:
    # "2.5.1+cu121" -> (2, 5, 1): local labels do not take part in pin checks
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+", 1)[0])[:3])


def _spec_ok(spec: str | None, have: str | None) -> bool:
    if spec is None:
        return True
    if have is None:
        return False
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(".".join(str(p) for p in _release_version(have)), prereleases=True)


def target_problems(bundle: VerifiedBundle, probe: Probe, mode: str) -> list[str]:
    """Why `bundle` cannot run here ([] when it can), each as a phrase naming what is missing."""
    t = bundle.manifest.targets
    kind = "kernel" if bundle.kind == "kernels" else bundle.kind
    label = f"{kind} bundle {bundle.name} {bundle.version}"
    problems: list[str] = []
    accelerator = probe.accelerator if mode == "cuda" else "cpu"
    if t.accelerators and accelerator not in t.accelerators:
        problems.append(f"{label} is built for {', '.join(t.accelerators)}; this machine runs {accelerator}")
    if mode == "cuda" and t.min_driver is not None:
        if probe.driver_version is None or _release_version(probe.driver_version) < _release_version(t.min_driver):
            problems.append(f"{label} needs NVIDIA driver >= {t.min_driver}; found {probe.driver_version}")
    for what, spec, have in (("python", t.python, probe.python), ("torch", t.torch, probe.torch)):
        if not _spec_ok(spec, have):
            problems.append(f"{label} needs {what} {spec}; found {have or 'none'}")
    if t.triton is not None and mode == "cuda" and not _spec_ok(t.triton, probe.triton):
        problems.append(f"{label} needs triton {t.triton}; found {probe.triton or 'none'}")
    return problems


def runtime_kernel_digest(runtime: VerifiedBundle) -> str:
    """The kernel-source digest of the envex wheel in `runtime`'s wheelhouse (re-hashed against the verified
    manifest as it is read); InstallError when there is none or it cannot be read."""
    wheels = [f for f in runtime.manifest.files if re.fullmatch(rf"{WHEELHOUSE}/envex-[^/]+\.whl", f.path)]
    label = f"runtime bundle {runtime.name} {runtime.version}"
    if len(wheels) != 1:
        raise InstallError(f"{label} holds {len(wheels)} envex wheels; cannot tell which kernel sources it runs")
    entry = wheels[0]
    if entry.size > MAX_WHEEL_BYTES:
        raise InstallError(f"{label}: {entry.path} is larger than {MAX_WHEEL_BYTES >> 20} MiB; not an envex wheel")
    with BundleArchive.open(runtime.path) as archive:
        data = b"".join(bytes(chunk) for chunk in archive.stream(archive.payload_members()[entry.path]))
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise InstallError(f"{label}: {entry.path} changed since the bundle was verified; check the media")
    try:
        return wheel_kernel_digest(data)
    except KernelCacheError as exc:
        raise InstallError(f"{label}: {entry.path}: {exc}") from None


def kernel_problems(
    bundle: VerifiedBundle, probe: Probe, runtime_digest: str | None, model: VerifiedBundle
) -> list[str]:
    """Why the kernels `bundle` cannot serve here ([] when every key matches), each naming the key that differs."""
    t = bundle.manifest.targets
    label = f"kernel bundle {bundle.name} {bundle.version}"
    problems = target_problems(bundle, probe, "cuda")
    if not _spec_ok(t.cuda, probe.torch_cuda):
        problems.append(f"{label} is keyed to CUDA {t.cuda}; torch here is built for CUDA {probe.torch_cuda or 'none'}")
    if t.kernel_sources is not None and t.kernel_sources != runtime_digest:
        have = runtime_digest[:12] + "…" if runtime_digest else "unknown (no envex wheel in the runtime bundle)"
        problems.append(
            f"{label} was compiled from kernel sources {t.kernel_sources[:12]}…; the runtime being installed has {have}"
        )
    for req in bundle.manifest.requires:
        if req.kind == "model" and (req.name != model.name or not req.allows(model.version)):
            problems.append(f"{label} was compiled for model {req.name} {req.version}; installing {model.name} "
                            f"{model.version}")
    return problems


def make_plan(
    bundles: list[VerifiedBundle] | tuple[VerifiedBundle, ...],
    probe: Probe,
    *,
    model_name: str | None = None,
    max_model_len: int | None = None,
    deterministic: bool = False,
    reference: str = "auto",
    kv_cache_dtype: str = "bf16",
    weights_policy: str | None = None,
) -> Plan:
    by_kind: dict[str, list[VerifiedBundle]] = {"runtime": [], "model": [], "kernels": []}
    for bundle in bundles:
        by_kind[bundle.kind].append(bundle)
    mode = probe.mode
    notes: list[str] = []
    if not by_kind["runtime"]:
        raise InstallError("plan: the media has no runtime bundle (kind runtime); add envex-runtime-<version>.envex")
    model = chosen_model(bundles, model_name)
    if model is None:
        named = f" named {model_name!r}" if model_name else ""
        have = ", ".join(sorted({b.name for b in by_kind["model"]})) or "none"
        raise InstallError(f"plan: the media has no model bundle{named} (model bundles on the media: {have})")
    runtime = _newest(by_kind["runtime"])
    rcard, mcard = read_cards(runtime, model)
    if deterministic:
        refuse_deterministic(model, mcard)
    refuse_kv_cache_dtype(model, mcard, kv_cache_dtype, deterministic=deterministic)
    policy = None if weights_policy is None else \
        refuse_weights(model, mcard, weights_policy, mode=mode, deterministic=deterministic)  # canonical form
    signed = signed_references(model, reference)
    kernels = None
    if mode == "cuda":
        kernels = _choose_kernels(by_kind["kernels"], probe, runtime, model, notes)
    elif by_kind["kernels"]:
        notes.append("kernel bundles hold compiled GPU code: not used in CPU mode")
    problems = target_problems(runtime, probe, mode) + target_problems(model, probe, mode)
    chosen = [b for b in (runtime, model, kernels) if b is not None]
    for bundle in chosen:
        for req in bundle.manifest.requires:
            match = next((b for b in chosen if b.name == req.name and b.kind == req.kind), None)
            if match is None or not req.allows(match.version):
                found = f"{match.version}" if match else "none on the media"
                problems.append(
                    f"{bundle.name} {bundle.version} requires {req.kind} {req.name} {req.version}; found {found}"
                )
    if problems:
        raise InstallError("plan: " + "; ".join(problems))

    engine = engine_choices(mcard, mode, max_model_len, deterministic=deterministic, kv_cache_dtype=kv_cache_dtype)
    if policy is not None:
        engine["weights"] = policy
    if deterministic and kernels is not None:
        notes.append(
            f"deterministic: kernel bundle {kernels.name} {kernels.version} may not hold the batch-invariant kernels "
            "(a kernel bundle is compiled for the default mode): those compile at first start (that needs a C "
            "compiler on this host)"
        )
    dtype, context = str(engine["dtype"]), int(engine["max_model_len"])
    per_token = mcard.kv_bytes_per_token(DTYPE_BYTES[dtype], kv_cache_dtype)  # in the chosen format
    weights = mcard.weights_bytes(DTYPE_BYTES[dtype])  # packed weights (FP8 experts, ...) as stored
    state = mcard.state_bytes_per_sequence(DTYPE_BYTES[dtype]) * state_slots(engine)  # 0 but for a hybrid model
    if mode == "cuda":
        gpu = probe.gpus[0]
        budget = int(gpu.memory_total * GPU_MEMORY_UTILIZATION)
        kv = per_token * context  # at least one sequence at the full context; the pool takes what is left
        tp = tensor_parallel_degree(probe, weights=weights, kv=kv, budget=budget, kv_heads=mcard.num_kv_heads)
        if tp is None:
            usable = len(usable_gpus(probe))
            raise InstallError(
                f"plan: {model.name} needs {(weights + kv) / GIB:.2f} GiB ({weights / GIB:.2f} weights in {dtype} + "
                f"{kv / GIB:.2f} KV cache for {context} tokens) and {usable} x {gpu.name} allow "
                f"{usable * budget / GIB:.2f} GiB split over up to {min(usable, TP_DEGREES[-1])} of them; use a "
                "smaller model, a shorter --max-model-len or a host with more GPUs"
            )
        if tp > 1 and kv_cache_dtype != "bf16":
            raise InstallError(
                f"plan: --kv-cache-dtype {kv_cache_dtype}: {model.name} needs {tp} GPUs here (tensor parallel) and a "
                "packed KV cache has not been run under tensor parallelism yet; install with --kv-cache-dtype bf16"
            )
        if tp > 1 and policy is not None:
            raise InstallError(
                f"plan: --weights: {model.name} needs {tp} GPUs here (tensor parallel) and packed low-bit weights do "
                "not run under tensor parallelism yet; install without --weights"
            )
        if tp > 1:
            engine["tensor_parallel"] = tp
            notes.append(
                f"tensor parallel: {model.name} needs {(weights + kv) / GIB:.1f} GiB and one {gpu.name} allows "
                f"{budget / GIB:.1f} GiB; split over {tp} GPUs ({(weights + kv) / tp / GIB:.1f} GiB each)"
            )
            budget *= tp
        capacity = max(budget - weights - state, 0) // per_token  # the pool takes what weights and state leave
    else:
        budget = int(probe.ram_available * CPU_RAM_FRACTION)
        kv = int(float(engine["kv_cache_memory_gb"]) * GIB)  # the pool the engine allocates (engine_choices)
        capacity = kv // per_token
    if weights + kv + state > budget:
        where = "GPU memory" if mode == "cuda" else "available RAM"
        states = f" + {state / GIB:.2f} recurrent state" if state else ""
        raise InstallError(
            f"plan: {model.name} needs {(weights + kv + state) / GIB:.2f} GiB ({weights / GIB:.2f} weights in {dtype} "
            f"+ {kv / GIB:.2f} KV cache for {context} tokens{states}) but {where} allows {budget / GIB:.2f} GiB; "
            "use a smaller model or a shorter --max-model-len"
        )
    wheel_factor = 3 if rcard.wheelhouse == "complete" else 2  # installed venv ~ 2-3x the wheels
    disk_needed = (
        model.total_bytes + wheel_factor * runtime.total_bytes + (kernels.total_bytes if kernels else 0) + DISK_HEADROOM
    )
    if disk_needed > probe.disk_free:
        raise InstallError(
            f"plan: the release needs {disk_needed / GIB:.2f} GiB of disk (payloads plus "
            f"{DISK_HEADROOM / GIB:.2f} GiB headroom) and the prefix's disk has {probe.disk_free / GIB:.2f} GiB free; "
            "free space (envex status lists old releases) or use another --prefix"
        )
    return Plan(
        mode=mode,
        runtime=runtime,
        runtime_card=rcard,
        model=model,
        model_card=mcard,
        kernels=kernels,
        engine=engine,
        weights_bytes=weights,
        kv_bytes=kv,
        memory_budget=budget,
        disk_needed=disk_needed,
        disk_free=probe.disk_free,
        notes=tuple(notes),
        probe=probe,
        reference=reference,
        signed_references=signed,
        kv_cache_dtype=kv_cache_dtype,
        kv_bytes_per_token=per_token,
        kv_capacity_tokens=int(capacity),
        weights_policy=policy,
        state_bytes=state,
    )


TP_DEGREES = (1, 2, 4, 8)  # the tensor-parallel degrees a host's NVLink GPUs are split into


def usable_gpus(probe: Probe) -> list[Any]:
    """The GPUs a tensor-parallel engine may span: the same model as GPU 0, not partitioned by MIG."""
    first = probe.gpus[0]
    return [g for g in probe.gpus if g.name == first.name and g.mig_mode != "enabled"]


def tensor_parallel_degree(probe: Probe, *, weights: int, kv: int, budget: int, kv_heads: int) -> int | None:
    """The fewest GPUs (1, 2, 4 or 8 of this host's usable ones) that hold `weights` bytes and `kv` bytes of KV cache
    within `budget` bytes each, or None. Each GPU holds 1/t of the weights and of the KV heads (a KV head is
    replicated where there are fewer of them than GPUs). The attention heads must also divide by t: the engine
    checks that at start, and the gates run on the result before anything is activated."""
    available = len(usable_gpus(probe)) if probe.gpus else 0
    for t in TP_DEGREES:
        if t > max(available, 1):
            return None
        if t > 1 and kv_heads % t and t % kv_heads:
            continue
        kv_share = kv // min(t, kv_heads) if t > 1 else kv
        if weights // t + kv_share <= budget:
            return t
    return None


def checked_model_card(model: VerifiedBundle) -> ModelCard:
    """The model bundle's card, valid and its `weights` naming a file (GGUF) or directory (HF) of the verified
    payload; InstallError in one line otherwise, before any release slot is made (a wrong path used to build the
    whole release and fail only when the gates loaded it)."""
    label = f"model bundle {model.name} {model.version}"
    try:
        card = model_card(model)
    except CardError as exc:
        raise InstallError(f"plan: {label}: {exc}") from None
    problem = weights_problem(card, [f.path for f in model.manifest.files])
    if problem is not None:
        raise InstallError(f"plan: {label} ({model.path.name}): {problem}; the bundle's publisher must fix the card "
                           "and sign the bundle again")
    return card


def read_cards(runtime: VerifiedBundle, model: VerifiedBundle) -> tuple[RuntimeCard, ModelCard]:
    """Both cards of a plan, checked (checked_model_card); InstallError in one line when one is missing or bad."""
    try:
        rcard = runtime_card(runtime)
    except CardError as exc:
        raise InstallError(f"plan: runtime bundle {runtime.name} {runtime.version}: {exc}") from None
    return rcard, checked_model_card(model)


def check_cards(bundles: list[VerifiedBundle] | tuple[VerifiedBundle, ...],
                model_name: str | None) -> tuple[VerifiedBundle, ModelCard] | None:  # fmt: skip
    """read_cards for the runtime and model a plan would choose, where the media has both (make_plan says what is
    missing): the installer runs it before a first install creates the prefix, so a bad card leaves nothing.
    Returns the model bundle with its checked card, or None where the media lacks one of the two."""
    runtimes = [b for b in bundles if b.kind == "runtime"]
    model = chosen_model(bundles, model_name)
    if not runtimes or model is None:
        return None
    return model, read_cards(_newest(runtimes), model)[1]


def chosen_model(bundles: list[VerifiedBundle] | tuple[VerifiedBundle, ...], name: str | None) -> VerifiedBundle | None:
    """The model bundle a plan installs: the newest one (named `name`, when given), or None when there is none."""
    models = [b for b in bundles if b.kind == "model" and name in (None, b.name)]
    return _newest(models) if models else None


def refuse_deterministic(model: VerifiedBundle, card: ModelCard) -> None:
    """InstallError, in one line, when the deterministic mode (--deterministic) cannot run `model` (whose checked
    card is `card`): an architecture without batch-invariant kernels for every layer. On the CPU it runs (the torch
    backend's invariant forms)."""
    from envex.runtime.engine.config import has_invariant_kernels

    architecture = card.architecture
    if not has_invariant_kernels(architecture):
        raise InstallError(
            f"plan: --deterministic: {model.name} {model.version} ({architecture}) has no batch-invariant kernels "
            "yet (mixture-of-experts layers, attention sinks and windows); install it without --deterministic"
        )


def refuse_kv_cache_dtype(model: VerifiedBundle, card: ModelCard, kv_cache_dtype: str, *,
                          deterministic: bool = False) -> None:  # fmt: skip
    """InstallError, in one line, when `model` (whose checked card is `card`) cannot keep its KV cache in
    `kv_cache_dtype` (--kv-cache-dtype): an unknown dtype, a model with a cache layout of its own (MLA's latent
    rows), a head_dim the packed formats cannot take, or the deterministic mode (no batch-invariant packed kernel).
    The release's gates then hold a packed dtype to its quality band (verify/gate_kv_cache.py)."""
    from envex.kernels.kv_quant_format import KV_CACHE_DTYPES, format_for
    from envex.runtime.engine.config import check_kv_cache_dtype

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InstallError(f"plan: --kv-cache-dtype {kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "bf16":
        return
    label = f"{model.name} {model.version} ({card.architecture})"
    if card.kv_latent_width is not None:
        raise InstallError(f"plan: --kv-cache-dtype {kv_cache_dtype}: {label} keeps a latent KV cache (MLA), which "
                           "has no packed format yet; install with --kv-cache-dtype bf16")  # fmt: skip
    refusal = check_kv_cache_dtype(kv_cache_dtype, deterministic=deterministic, architecture=card.architecture,
                                   tensor_parallel=False)  # fmt: skip
    if refusal is not None:
        raise InstallError(f"plan: {label}: {refusal}")
    fmt = format_for(kv_cache_dtype, card.head_dim)
    assert fmt is not None
    try:
        fmt.check_head_dim(card.head_dim)
    except ValueError as exc:
        raise InstallError(f"plan: --kv-cache-dtype {kv_cache_dtype}: {label}: {exc}") from None


def refuse_weights(model: VerifiedBundle, card: ModelCard, weights: str, *, mode: str,
                   deterministic: bool = False) -> str:  # fmt: skip
    """The canonical form of the weights policy `weights` (--weights: a scheme name as given, a JSON policy as its
    compact JSON, as EngineConfig keeps it), or InstallError in one line where `model` (whose checked card is
    `card`) cannot be served by it: an invalid policy, an override past the model's layers, a checkpoint already
    quantized, what `envex serve --weights` refuses (runtime/engine/config.check_weights: the deterministic
    backends, architectures outside the Llama family). Tensor parallelism is refused where the plan splits the
    model. The release's gates then hold the policy to its band (verify.weight_quality_band)."""
    from envex.runtime.engine.config import check_weights
    from envex.runtime.weight_policy import PolicyError, policy_from_setting

    label = f"{model.name} {model.version} ({card.architecture})"
    try:
        policy = policy_from_setting(weights)
        policy.resolve(card.num_layers)
    except PolicyError as exc:
        raise InstallError(f"plan: --weights: {label}: {exc}") from None
    if card.format == "hf" and card.quantization not in FLOAT_WEIGHTS:
        raise InstallError(f"plan: --weights: {label} is already quantized ({card.quantization}); install it "
                           "without --weights")  # fmt: skip
    backend = "triton" if mode == "cuda" else "torch"
    refusal = check_weights(weights, backend, deterministic=deterministic, architecture=card.architecture,
                            tensor_parallel=False)  # fmt: skip
    if refusal is not None:
        raise InstallError(f"plan: {label}: {refusal}")
    return policy.label if weights.lstrip().startswith("{") else weights


def signed_references(model: VerifiedBundle, reference: str) -> bool:
    """Whether `model` holds signed reference answers, checked: readable, and computed for the weights its manifest
    signs. InstallError in one line for answers to other weights, or for --reference signed without any."""
    if reference not in REFERENCE_CHOICES:
        raise InstallError(f"plan: --reference {reference!r}: use one of {', '.join(REFERENCE_CHOICES)}")
    entry = next((f for f in model.manifest.files if f.path == REFERENCES_FILE), None)
    if entry is None:
        if reference == "signed":
            raise InstallError(
                f"plan: --reference signed: model bundle {model.name} {model.version} holds no signed reference "
                f"answers ({REFERENCES_FILE}); build its media with `envex media build`, which computes them, or "
                "install with --reference auto"
            )
        return False
    where = f"model bundle {model.name} {model.version}: {REFERENCES_FILE}"
    try:
        data = model.read_file(REFERENCES_FILE, max_bytes=MAX_REFERENCES_BYTES)  # re-checked against the manifest
        check_digest(parse_references(data, where), model_digest({f.path: f.sha256 for f in model.manifest.files}),
                     where)  # fmt: skip
    except VerificationError as exc:
        raise InstallError(f"plan: {where}: {exc.message}; check the media") from None
    except ReferencesError as exc:
        raise InstallError(f"plan: {exc}") from None
    return True


def engine_choices(
    card: ModelCard, mode: str, max_model_len: int | None = None, *, deterministic: bool = False,
    kv_cache_dtype: str = "bf16",
) -> dict[str, Any]:
    """The engine settings the plan chooses for `card` in `mode` (EngineConfig's defaults fill the rest), with the
    deterministic mode and the KV cache's format as the admin chose them. A kernel bundle is built with the same
    choices, so that its warm-up compiles the variants the release will run. The CPU's KV pool is sized for
    min(max_num_seqs, 4) full-context sequences in the activation dtype whatever the format: a packed format holds
    more tokens in that memory, as on a GPU (the plan's kv_capacity_tokens)."""
    dtype = "bfloat16" if mode == "cuda" else "float32"
    context = min(max_model_len or card.defaults.max_model_len, card.max_position_embeddings)
    seqs = card.defaults.max_num_seqs
    engine: dict[str, Any] = {
        "device": mode,
        "dtype": dtype,
        "backend": "triton" if mode == "cuda" else "torch",
        "max_model_len": context,
        "max_num_seqs": seqs,
        "deterministic": deterministic,
        "kv_cache_dtype": kv_cache_dtype,
    }
    if mode == "cuda":
        engine["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
    else:
        kv = card.kv_bytes_per_token(DTYPE_BYTES[dtype]) * context * min(seqs, 4)
        engine["kv_cache_memory_gb"] = round(max(kv / GIB, 0.0625), 4)
    return engine


def state_slots(engine: dict[str, Any]) -> int:
    """The state slots a hybrid model's engine allocates for these settings (StateSlots): a live slot per sequence
    (max_num_seqs), with the prefix cache on (EngineConfig's default) as many prefix snapshots, one scratch slot
    (the padding rows of a CUDA-graph decode step), and with speculative decoding its verify slots (K + 1 for each
    row of a verify batch: speculative_max_batch where set, else max_num_seqs, the most it can be)."""
    from envex.runtime.engine.caches.state_slots import verify_slots
    from envex.runtime.engine.config import EngineConfig

    default = EngineConfig.__dataclass_fields__["enable_prefix_caching"].default
    prefix_cache = engine.get("enable_prefix_caching", default)
    seqs = int(engine["max_num_seqs"])
    verify = verify_slots(int(engine.get("num_speculative_tokens") or 0),
                          int(engine.get("speculative_max_batch") or 0) or None, seqs)  # fmt: skip
    return seqs * (2 if prefix_cache else 1) + 1 + verify


def _choose_kernels(
    offered: list[VerifiedBundle], probe: Probe, runtime: VerifiedBundle, model: VerifiedBundle, notes: list[str]
) -> VerifiedBundle | None:
    """The newest kernel bundle whose keys all match this host, runtime and model; a note for each one refused."""
    fitting: list[VerifiedBundle] = []
    if offered:
        try:
            digest: str | None = runtime_kernel_digest(runtime)
        except InstallError as exc:
            digest = None
            notes.append(str(exc))
        for bundle in offered:
            problems = kernel_problems(bundle, probe, digest, model)
            if problems:
                notes.append(f"refused: {'; '.join(problems)}")
            else:
                fitting.append(bundle)
    if fitting:
        return _newest(fitting)
    notes.append(
        f"no kernel bundle for {probe.accelerator}, triton {probe.triton or 'none'} and this runtime: kernels will "
        "compile at first start (that needs a C compiler on this host)"
    )
    return None
