"""The model card (`envex-model.json`) of a model's own files, and the checks that its files agree.

`envex media build` writes the card itself from config.json / GGUF metadata and the weights' headers, so nobody
writes one by hand; and it refuses, before anything is signed, a folder whose weights, index and tokenizer
disagree: each refusal one line naming the file and what to do.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envex.bundles.files import read_regular_file, show
from envex.installer.cards import HybridCard, ModelCard, ModelDefaults, SmokeTest
from envex.installer.media import InstallError

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own cap on a header
# config.json's vocab_size may exceed the tokenizer's by padding (rows no token reaches: Qwen pads 151,665 to
# 151,936). More than this is another vocabulary, not padding.
MAX_VOCAB_PADDING = 1024
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = 8
SMOKE = SmokeTest(prompt="What is the capital of France?", expect="Paris")
# A base model (no chat template) is asked to complete a sentence instead of a question.
BASE_SMOKE = SmokeTest(prompt="The capital of France is", expect="Paris")
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "fp8_e4m3",
                       "F8_E5M2": "fp8_e5m2", "I8": "int8", "U8": "uint8"}  # fmt: skip


_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "F8_E8M0": 1, "I8": 1, "U8": 1}  # fmt: skip


class ModelFilesError(InstallError):
    """A model's files cannot become a model bundle; the message names the file and what to do."""


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def safetensors_header(path: Path) -> dict[str, TensorHeader]:
    """The tensors named in one .safetensors file's header (its data is not read)."""
    try:
        with open(path, "rb") as handle:
            size_bytes = handle.read(8)
            if len(size_bytes) != 8:
                raise ValueError("shorter than a header")
            (size,) = struct.unpack("<Q", size_bytes)
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(handle.read(size))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        tensors = {
            name: TensorHeader(dtype=str(info["dtype"]), shape=tuple(int(d) for d in info["shape"]))
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFilesError(f"{show(path)}: not a readable safetensors file ({exc}); copy the file again") from None
    return tensors


def card_for_model(path: Path, served_name: str) -> ModelCard:
    """The card of a .gguf file or an HF model directory, after checking its files agree; ModelFilesError else."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_card(path, served_name)
    if path.is_dir():
        return _hf_card(path, served_name)
    raise ModelFilesError(f"--model {show(path)}: not a .gguf file or a model directory; give one of them")


def _config(spec: Path) -> Any:  # -> ModelConfig
    from envex.runtime.config import ConfigError
    from envex.runtime.gguf_loader import GGUFError
    from envex.runtime.loader import ModelNotFoundError, load_model_config

    try:
        return load_model_config(str(spec))
    except (ConfigError, GGUFError, ModelNotFoundError) as exc:
        raise ModelFilesError(f"{show(spec)}: {exc}") from None


def _has_chat_template(spec: Path) -> bool:
    """Whether the model's tokenizer renders chats (tokenizer_config.json, chat_template.jinja, or the GGUF's
    tokenizer.chat_template): its smoke test is then a question, else a sentence to complete."""
    from envex.runtime.loader import load_model_info

    return load_model_info(str(spec)).tokenizer.chat_template is not None


def _card(path_in_payload: str, fmt: str, served_name: str, c: Any, parameters: int, quantization: str,
          chat: bool = True, packed: tuple[int, int] = (0, 0)) -> ModelCard:  # fmt: skip
    return ModelCard(
        served_name=served_name,
        format=fmt,  # type: ignore[arg-type]
        weights=path_in_payload,
        architecture=c.architecture,
        parameters=parameters,
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        quantization=quantization,
        packed_parameters=packed[0],
        packed_bytes=packed[1],
        defaults=ModelDefaults(
            max_model_len=min(DEFAULT_MAX_MODEL_LEN, c.max_position_embeddings), max_num_seqs=DEFAULT_MAX_NUM_SEQS
        ),
        smoke=SMOKE if chat else BASE_SMOKE,
        kv_latent_width=None if c.mla is None else c.mla.kv_lora_rank + c.mla.qk_rope_head_dim,
        hybrid=HybridCard.of(c),
    )


def _gguf_card(path: Path, served_name: str) -> ModelCard:
    from envex.runtime.gguf_loader import read_header

    c = _config(path)
    header = read_header(path)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list | tuple) and len(tokens) > c.vocab_size:
        raise ModelFilesError(
            f"{show(path)}: its tokenizer has {len(tokens)} tokens but the model only {c.vocab_size} embedding rows; "
            "convert the model again from one checkpoint"
        )
    parameters = sum(math.prod(t.dims) for t in header.tensors)
    file_type = header.metadata.get("general.file_type")
    try:
        import gguf

        quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError, ImportError):
        quantization = Counter(str(t.ggml_type) for t in header.tensors).most_common(1)[0][0] if header.tensors \
            else "gguf"  # fmt: skip
    from envex.runtime.packed_load import gguf_stored_as_packed

    return _card(path.name, "gguf", served_name, c, parameters, quantization, _has_chat_template(path),
                 gguf_stored_as_packed(c, path))  # fmt: skip


def _hf_card(folder: Path, served_name: str) -> ModelCard:
    c = _config(folder)
    tensors = _hf_tensors(folder)
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and embed.shape and embed.shape[0] != c.vocab_size:
        raise ModelFilesError(
            f"{show(folder / 'config.json')}: vocab_size is {c.vocab_size} but the weights' embedding has "
            f"{embed.shape[0]} rows; config.json and the weights come from different models"
        )
    _check_tokenizer(folder, c.vocab_size)
    dtypes = Counter[str]()
    for t in tensors.values():
        dtypes[t.dtype] += t.elements
    hf = json.loads(read_regular_file(folder / "config.json", max_bytes=16 << 20, what="model config"))
    quantization = _hf_quantization(hf) or _SAFETENSORS_DTYPES.get(dtypes.most_common(1)[0][0], "unknown")
    return _card(".", "hf", served_name, c, sum(t.elements for t in tensors.values()), quantization,
                 _has_chat_template(folder), _packed(hf, c, tensors))


def _packed(hf: dict[str, Any], c: Any, tensors: dict[str, TensorHeader]) -> tuple[int, int]:
    """(elements, bytes) of the tensors the engine keeps as stored (runtime.packed_load.stored_as_packed)."""
    from envex.runtime.packed_load import stored_as_packed

    kept = [tensors[n] for n in stored_as_packed(c, hf, tensors)]
    return sum(t.elements for t in kept), sum(t.elements * _DTYPE_BYTES.get(t.dtype, 4) for t in kept)


def _hf_quantization(hf: dict[str, Any]) -> str | None:
    q = hf.get("quantization_config")
    return str(q["quant_method"]) if isinstance(q, dict) and q.get("quant_method") else None


def _hf_tensors(folder: Path) -> dict[str, TensorHeader]:
    """Every tensor of the directory's weights, after checking the index and the shards agree."""
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        if not shards:
            raise ModelFilesError(f"{show(folder)}: no *.safetensors weights; copy the model's weights in")
        if len(shards) > 1:
            raise ModelFilesError(
                f"{show(folder)}: {len(shards)} safetensors shards but no {INDEX_FILE}; copy the index in too"
            )
        return safetensors_header(folder / shards[0])
    try:
        index = json.loads(read_regular_file(index_path, max_bytes=MAX_INDEX_BYTES, what="weights index"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not an object of file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFilesError(f"{show(index_path)}: not a valid weights index ({exc}); copy it again") from None
    named = sorted(set(weight_map.values()))
    missing = [s for s in named if s not in shards]
    if missing:
        raise ModelFilesError(
            f"{show(folder / missing[0])}: named by {INDEX_FILE} but missing ({len(missing)} of {len(named)} shards "
            "missing); copy every shard of the model in"
        )
    extra = [s for s in shards if s not in named]
    if extra:
        raise ModelFilesError(
            f"{show(folder / extra[0])}: not named by {INDEX_FILE}; remove it or copy the matching index"
        )
    tensors: dict[str, TensorHeader] = {}
    for shard in named:
        found = safetensors_header(folder / shard)
        absent = [name for name, where in weight_map.items() if where == shard and name not in found]
        if absent:
            raise ModelFilesError(
                f"{show(folder / shard)}: lacks {absent[0]!r} that {INDEX_FILE} places there; the shard and the index "
                "come from different copies: copy both again"
            )
        tensors.update(found)
    return tensors


def _check_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer as RustTokenizer

    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise ModelFilesError(f"{show(path)}: missing; copy the model's tokenizer.json in")
    try:
        tokens = RustTokenizer.from_str(read_regular_file(path, max_bytes=256 << 20, what="tokenizer").decode())
    except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception subclass
        raise ModelFilesError(f"{show(path)}: not a readable tokenizer ({exc}); copy it again") from None
    size = tokens.get_vocab_size(with_added_tokens=True)
    if size > vocab_size or vocab_size - size > MAX_VOCAB_PADDING:
        raise ModelFilesError(
            f"{show(path)}: a vocabulary of {size} tokens, but config.json's vocab_size is {vocab_size}; the tokenizer "
            "is another model's: copy the tokenizer that came with these weights"
        )
