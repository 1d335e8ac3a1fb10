"""GGUF files: config and tokenizer from the metadata, weights dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of attn_q / attn_k for its interleaved RoPE; we undo that so the
tensors are exactly HF's (the same reverse permutation transformers applies), and name them as HF does.

The header (metadata and tensor table) is read here, not by `gguf.GGUFReader`: that reader makes a numpy view
per array element, and a 49K-token vocabulary (tokens, scores, types, merges) took it about 6 s on one core for
each load; walking the same bytes with `struct` takes a fraction of a second. The values are the ones
`GGUFReader`'s `field.contents()` gives (tests/test_runtime_gguf.py compares the two).
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF's little-endian layout (the spec, and what gguf.GGUFReader reads): magic, version (2 or 3), tensor and
# key/value counts, the key/values, the tensor table, then the tensor data at the next multiple of
# general.alignment. Value types 0-12: the fixed-size ones below, 8 a string (u64 length, UTF-8), 9 an array
# (u32 element type, u64 count, the elements; an array of arrays is flattened, as GGUFReader does).
_MAGIC, _VERSIONS, _DEFAULT_ALIGNMENT = b"GGUF", (2, 3), 32
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 16  # arrays of arrays: GGUF's own files nest one level; a damaged file must not exhaust the stack
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Tensor types GGUFReader hands over as plain arrays (the rest are blocks of bytes, dequantized by `gguf`).
_PLAIN_TENSORS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFError(ValueError):
    """A GGUF file cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order: the fastest-moving dimension first
    ggml_type: int
    start: int  # byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's key/value metadata and tensor table; `buffer` maps the file (the tensors' bytes)."""

    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    buffer: mmap.mmap

    def array(self, tensor: TensorInfo) -> np.ndarray:
        """A tensor's stored data as GGUFReader gives it: values in numpy order, or block bytes by row."""
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(tensor.dims))
        if tensor.ggml_type in _PLAIN_TENSORS:
            dtype = np.dtype(_PLAIN_TENSORS[tensor.ggml_type])
            data = np.frombuffer(self.buffer, dtype, tensor.nbytes // dtype.itemsize, tensor.start)
            return data.reshape(shape)
        data = np.frombuffer(self.buffer, np.uint8, tensor.nbytes, tensor.start)
        return data.reshape(quant_shape_to_byte_shape(shape, _quant_type(tensor.ggml_type)))


def _quant_type(ggml_type: int) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type)


class _Cursor:
    """Reads GGUF's little-endian values from `buf`, moving forward; struct raises at the end of the file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFError(f"a string of {length} bytes runs past the end of the file at byte {self.pos}")
        text = self.buf[self.pos : end].decode("utf-8")
        self.pos = end
        return text

    def value(self, value_type: int, depth: int = 0) -> Any:
        if depth > _MAX_NESTING:
            raise GGUFError(f"metadata arrays nested more than {_MAX_NESTING} deep at byte {self.pos}")
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in _SCALARS:  # one read for the whole array
                dtype = np.dtype("<" + _SCALARS[item_type])
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return values
            items = [self.value(item_type, depth + 1) for _ in range(count)]
            return [v for item in items for v in item] if item_type == _ARRAY else items
        raise GGUFError(f"unknown metadata value type {value_type} at byte {self.pos}")


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file, checked: version, no duplicate keys or tensors, known tensor
    types, a power-of-two alignment, every tensor's bytes inside the file."""
    from gguf import GGML_QUANT_SIZES

    try:
        with open(path, "rb") as handle:
            buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(buf)
        if buf[:4] != _MAGIC:
            raise GGUFError("it does not start with the GGUF magic")
        version, tensor_count, kv_count = cur.unpack("4xIQQ")
        if version not in _VERSIONS:
            raise GGUFError(f"GGUF version {version} is not read here (versions 2 and 3, little-endian)")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            if key in metadata:
                raise GGUFError(f"the metadata key {key} appears twice")
            metadata[key] = cur.value(cur.unpack("I")[0])
        table = []
        for _ in range(tensor_count):
            name = cur.string()
            (n_dims,) = cur.unpack("I")
            dims = cur.unpack(f"{n_dims}Q")
            ggml_type, offset = cur.unpack("IQ")
            table.append((name, dims, ggml_type, offset))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        tensors, names = [], set()
        for name, dims, ggml_type, offset in table:
            if name in names:
                raise GGUFError(f"the tensor {name} appears twice")
            names.add(name)
            block, type_size = GGML_QUANT_SIZES[_quant_type(ggml_type)]
            if dims and dims[0] % block:
                raise GGUFError(f"the tensor {name}'s rows of {dims[0]} are not whole blocks of {block}")
            nbytes = math.prod(dims) * type_size // block
            start = data_start + offset
            if start + nbytes > len(buf):
                raise GGUFError(f"the tensor {name} runs past the end of the file")
            tensors.append(TensorInfo(name, tuple(int(d) for d in dims), ggml_type, start, nbytes))
    except GGUFError as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc}); check the file is complete") from None
    except (OSError, ValueError, KeyError, OverflowError, struct.error) as exc:  # truncated, garbled or missing
        raise GGUFError(f"{path}: not a readable GGUF file ({exc}); check the file is complete") from exc
    return GGUFHeader(version, metadata, tuple(tensors), buf)


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF key/value metadata, with the big tokenizer arrays included."""
    header = read_header(path)
    counts = {"GGUF.version": header.version, "GGUF.tensor_count": len(header.tensors),
              "GGUF.kv_count": len(header.metadata)}  # fmt: skip
    return {**counts, **header.metadata, "tensor_names": [t.name for t in header.tensors]}


def hf_config(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """Map GGUF metadata onto the fields of an HF config.json."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": int(get("vocab_size", len(tokens))),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        # llama.cpp drops the output matrix when it is the embedding's transpose: that is a tied model.
        "tie_word_embeddings": "output.weight" not in meta.get("tensor_names", []),
    }
    key_length = get("attention.key_length")
    if key_length:
        cfg["head_dim"] = int(key_length)
    return cfg


def _reverse_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    # [n_head * 2 * half, in] rows grouped (head, half, pair) by llama.cpp -> HF's (head, pair, half).
    half = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def iter_weights(path: Path, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor) for every tensor in the file."""
    from gguf.quants import dequantize

    header = read_header(path)
    permute_q = cfg["architectures"][0] == "LlamaForCausalLM"  # llama.cpp permutes q/k only for llama
    for tensor in header.tensors:
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", tensor.name)
        if match:
            layer, short, kind = match.groups()
            if short not in _LAYER_NAMES:
                raise GGUFError(f"{path}: unexpected tensor {tensor.name}; this GGUF layout is not supported")
            name = f"model.layers.{layer}.{_LAYER_NAMES[short]}.{kind}"
        else:
            base, _, kind = tensor.name.rpartition(".")
            if base not in _GLOBAL_NAMES:
                continue  # e.g. rope_freqs: recomputed from the config
            name = f"{_GLOBAL_NAMES[base]}.{kind}"
        # GGML shapes list the fastest dimension first; numpy's order is the reverse.
        shape = tuple(reversed(tensor.dims))
        data = dequantize(header.array(tensor), _quant_type(tensor.ggml_type))
        array = np.asarray(data, dtype=np.float32).reshape(shape)
        if permute_q and short_is(match, "attn_q"):
            array = _reverse_permute(array, cfg["num_attention_heads"])
        elif permute_q and short_is(match, "attn_k"):
            array = _reverse_permute(array, cfg["num_key_value_heads"])
        yield name, torch.from_numpy(np.array(array, copy=True, order="C"))


def short_is(match: re.Match[str] | None, short: str) -> bool:
    return match is not None and match.group(2) == short


def tokenizer_parts(path: Path) -> tuple[Any, dict[str, Any]]:
    """A `tokenizers.Tokenizer` and a tokenizer_config-like dict, both from the GGUF metadata.

    transformers' public GGUF path builds the fast tokenizer from the file's vocabulary and merges, so the
    reference and we tokenize identically; we keep only the Rust tokenizer and the plain settings.
    """
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    tok_config: dict[str, Any] = {
        "chat_template": hf.chat_template,
        "bos_token": hf.bos_token,
        "eos_token": hf.eos_token,
        "unk_token": hf.unk_token,
        "pad_token": hf.pad_token,
        "add_bos_token": bool(getattr(hf, "add_bos_token", False)),
    }
    return hf.backend_tokenizer, tok_config
