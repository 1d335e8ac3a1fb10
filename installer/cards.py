"""What a model or runtime bundle says about itself: `envex-model.json` and `envex-runtime.json` in its payload.

Both files are covered by the bundle's signature (they are payload files), so the planner can trust them once
the bundle verified. Unknown keys are rejected.
"""

from __future__ import annotations

import difflib
import hashlib
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from envex.bundles import VerifiedBundle
from envex.bundles.archive import BundleArchive
from envex.bundles.files import read_regular_file, show
from envex.installer.state import validate_json

if TYPE_CHECKING:
    from envex.runtime.config import ModelConfig

MODEL_CARD = "envex-model.json"
RUNTIME_CARD = "envex-runtime.json"
WHEELHOUSE = "wheelhouse"
# torch of the runtime wheelhouse (installer/media_build.py). On PyPI, torch 2.11.0's linux x86_64 wheel is the CUDA
# 13.0 build (it requires nvidia-*-cu13 and triton 3.6.0): that is `cu130`. The CPU build is `2.11.0+cpu` on
# PyTorch's own index, https://download.pytorch.org/whl/cpu (give it as --extra-index-url, or its wheel in
# --find-links).
TORCH_VERSION = "2.11.0"
MAX_CARD_BYTES = 1 << 20
CARD_DOCS = "offline_docs/install.md"  # where the cards' fields are described


class CardError(ValueError):
    """A bundle's card is missing or invalid."""


class _Card(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelDefaults(_Card):
    """Launch defaults the model's publisher recommends; the planner may lower them to fit this machine."""

    max_model_len: int = Field(ge=2)
    max_num_seqs: int = Field(ge=1)


class SmokeTest(_Card):
    """A prompt the model must answer (case-insensitively containing `expect`) under greedy decoding."""

    prompt: str = Field(min_length=1, max_length=2000)
    expect: str = Field(min_length=1, max_length=200)


class HybridCard(_Card):
    """A hybrid model's layers (Qwen3-Next, ModelConfig.hybrid; offline_docs/hybrid.md): only the full-attention
    layers hold paged K/V; each linear-attention (Gated DeltaNet) layer keeps a fixed-size state per sequence
    instead, in slots the engine allocates before the KV cache (runtime/engine/caches/state_slots.py). HF's names."""

    full_attention_layers: int = Field(ge=1)
    linear_attention_layers: int = Field(ge=1)
    linear_num_key_heads: int = Field(ge=1)
    linear_num_value_heads: int = Field(ge=1)
    linear_key_head_dim: int = Field(ge=1)
    linear_value_head_dim: int = Field(ge=1)
    linear_conv_kernel_dim: int = Field(ge=2)

    @classmethod
    def of(cls, config: ModelConfig) -> HybridCard | None:
        """The card's hybrid section for a model's config (None for a model without linear-attention layers)."""
        hy = config.hybrid
        if hy is None:
            return None
        return cls(full_attention_layers=config.num_hidden_layers - len(hy.linear_layers),
                   linear_attention_layers=len(hy.linear_layers), linear_num_key_heads=hy.num_k_heads,
                   linear_num_value_heads=hy.num_v_heads, linear_key_head_dim=hy.head_k_dim,
                   linear_value_head_dim=hy.head_v_dim, linear_conv_kernel_dim=hy.conv_width)  # fmt: skip

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """One sequence's state slot over every linear layer, as the model allocates it (make_state_pools): the
        delta rule's state [Hv, Dk, Dv] in float32 and the convolution's last K-1 inputs of q, k and v in the
        activation dtype (`dtype_bytes` each element)."""
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim \
            + self.linear_num_value_heads * self.linear_value_head_dim
        recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return self.linear_attention_layers * (recurrent + (self.linear_conv_kernel_dim - 1) * conv_dim * dtype_bytes)


class ModelCard(_Card):
    """envex-model.json: how to load the weights in the payload and how big they are in memory."""

    served_name: str = Field(min_length=1, max_length=128)
    format: Literal["gguf", "hf"]
    weights: str  # payload path of the .gguf file, or of the HF directory ("." for the payload root)
    architecture: str
    parameters: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=2)
    quantization: str  # e.g. "Q4_1" (GGUF), "bfloat16" (safetensors)
    # Of `parameters`, those the engine holds as the checkpoint stores them (packed FP8 / INT4 / MXFP4 weights and
    # their scales: runtime.packed_load.stored_as_packed), and their bytes; the rest take the serving dtype's bytes.
    packed_parameters: int = Field(default=0, ge=0)
    packed_bytes: int = Field(default=0, ge=0)
    defaults: ModelDefaults
    smoke: SmokeTest | None = None
    # Multi-head latent attention (DeepSeek-V2/V3): one latent row a token and layer (kv_lora_rank +
    # qk_rope_head_dim elements) instead of K and V per KV head. Absent: a K/V cache.
    kv_latent_width: int | None = Field(default=None, ge=1)
    # A hybrid model (Qwen3-Next): which layers hold paged K/V, and the per-sequence state of the others. Absent:
    # every layer holds K/V.
    hybrid: HybridCard | None = None

    @model_validator(mode="after")
    def _hybrid_layers_add_up(self) -> ModelCard:
        hy = self.hybrid
        if hy is not None and hy.full_attention_layers + hy.linear_attention_layers != self.num_layers:
            raise ValueError(f"hybrid: {hy.full_attention_layers} full-attention + {hy.linear_attention_layers} "
                             f"linear-attention layers are not num_layers {self.num_layers}")  # fmt: skip
        return self

    def weights_bytes(self, dtype_bytes: int) -> int:
        """The weights' bytes in memory: the packed ones as stored, every other parameter in the serving dtype
        (`dtype_bytes` each)."""
        return (self.parameters - self.packed_parameters) * dtype_bytes + self.packed_bytes

    @property
    def kv_layers(self) -> int:
        """The layers holding paged K/V: every one, but a hybrid model's full-attention layers only."""
        return self.hybrid.full_attention_layers if self.hybrid is not None else self.num_layers

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """A hybrid model's per-sequence state over its linear layers (HybridCard); 0 for any other model."""
        return self.hybrid.state_bytes_per_sequence(dtype_bytes) if self.hybrid is not None else 0

    def kv_bytes_per_token(self, dtype_bytes: int, kv_cache_dtype: str = "bf16") -> int:
        """K and V bytes of one token over every layer that holds K/V (kv_layers): in the activation dtype
        (`dtype_bytes` each element) for the unpacked cache ("bf16"), else in the packed format the engine allocates
        for this head_dim (data + scales, kernels.kv_quant_format.format_for: what the model runner counts its
        blocks by)."""
        if self.kv_latent_width is not None:
            return self.num_layers * self.kv_latent_width * dtype_bytes
        from envex.kernels.kv_quant_format import kv_bytes_per_token

        return self.kv_layers * kv_bytes_per_token(kv_cache_dtype, self.num_kv_heads, self.head_dim,
                                                   dtype_bytes=dtype_bytes)  # fmt: skip


class RuntimeCard(_Card):
    """envex-runtime.json: the wheelhouse under `wheelhouse/` and what to install from it.

    `complete`: every dependency is in the wheelhouse (production). `demo`: only envex (and perhaps a few wheels)
    is; the rest comes from the installing Python environment, offline. See offline_docs/install.md.
    """

    wheelhouse: Literal["complete", "demo"]
    install: list[str] = Field(min_length=1, max_length=64)  # pip requirements, e.g. ["envex==0.1.0"]
    envex_version: str
    python: str = ">=3.11"


def _read_card(bundle: VerifiedBundle, name: str) -> bytes:
    entry = next((f for f in bundle.manifest.files if f.path == name), None)
    if entry is None:
        raise CardError(f"{bundle.path}: {bundle.kind} bundle has no {name}; rebuild it with envex demo or the docs")
    if entry.size > MAX_CARD_BYTES:
        raise CardError(f"{bundle.path}: {name} is larger than {MAX_CARD_BYTES} bytes")
    with BundleArchive.open(bundle.path) as archive:
        member = archive.payload_members()[name]
        data = b"".join(bytes(chunk) for chunk in archive.stream(member))
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise CardError(f"{bundle.path}: {name} changed since the bundle was verified; check the media")
    return data


def _parse(cls: type[_Card], data: bytes, where: str) -> _Card:
    try:
        return validate_json(cls, data)
    except ValueError as exc:  # validate_json's one line: "field: what is wrong" (or the JSON error)
        raise CardError(f"{where}: invalid ({exc}); fix the card (its fields: {CARD_DOCS}) and build the bundle "
                        "again") from None


def model_card(bundle: VerifiedBundle) -> ModelCard:
    card = _parse(ModelCard, _read_card(bundle, MODEL_CARD), f"{bundle.path}: {MODEL_CARD}")
    assert isinstance(card, ModelCard)
    return card


def runtime_card(bundle: VerifiedBundle) -> RuntimeCard:
    card = _parse(RuntimeCard, _read_card(bundle, RUNTIME_CARD), f"{bundle.path}: {RUNTIME_CARD}")
    assert isinstance(card, RuntimeCard)
    return card


def load_model_card(path: Path) -> ModelCard:
    data = read_regular_file(path, max_bytes=MAX_CARD_BYTES, what="model card")
    card = _parse(ModelCard, data, show(path))
    assert isinstance(card, ModelCard)
    return card


def weights_problem(card: ModelCard, files: Collection[str]) -> str | None:
    """Why the card's `weights` does not name what its format loads among the model payload's `files` (paths
    relative to the payload root), or None when it does: for `gguf` a .gguf file of the payload, for `hf` a
    directory of it ("." for the payload root) holding config.json. The phrase names the field, the path and the
    payload's paths that come closest."""
    paths = set(files)
    if card.format == "gguf":
        if card.weights in paths and card.weights.endswith(".gguf"):
            return None
        pool = sorted(f for f in paths if f.endswith(".gguf")) or sorted(paths)
        want = "a .gguf file of the payload"
    else:
        folder = card.weights.rstrip("/")
        if ("config.json" if folder == "." else f"{folder}/config.json") in paths:
            return None
        dirs = sorted({f.rpartition("/")[0] or "." for f in paths if f.rpartition("/")[2] == "config.json"})
        pool = dirs or sorted({f.rpartition("/")[0] or "." for f in paths})
        want = 'a directory of the payload holding config.json ("." for the payload root)'
    close = difflib.get_close_matches(card.weights, pool, n=3, cutoff=0.4) or pool[:3]
    return (f"{MODEL_CARD} field `weights` is {card.weights!r}, which is not {want}; the payload's closest: "
            f"{', '.join(close) or 'none (the payload is empty)'}")


def check_model_source(src: Path) -> ModelCard:
    """The card of a model bundle's source directory, checked before `envex bundle build --kind model` signs off on
    it: present, valid, and its `weights` naming a file (GGUF) or directory (HF) of `src`. CardError in one line
    naming the file, the field and what to do."""
    path = Path(src) / MODEL_CARD
    if not os.path.lexists(path):
        raise CardError(f"{show(path)}: missing; a model bundle needs its card {MODEL_CARD} in --src (its fields: "
                        f"{CARD_DOCS}); write it, then build again")
    try:
        card = load_model_card(path)
    except OSError as exc:
        raise CardError(str(exc)) from None
    files = [
        (Path(directory) / name).relative_to(src).as_posix()
        for directory, _, names in os.walk(src, followlinks=False)
        for name in names
    ]
    problem = weights_problem(card, files)
    if problem is not None:
        raise CardError(f"{show(path)}: {problem}; fix the card or the files in --src, then build again")
    return card
