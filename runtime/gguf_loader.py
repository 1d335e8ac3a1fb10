"""GGUF files: config and tokenizer from the metadata, weights dequantized with the `gguf` package, or kept packed.

llama.cpp's converter permutes the rows of attn_q / attn_k for its interleaved RoPE; we undo that so the
tensors are exactly HF's (the same reverse permutation transformers applies), and name them as HF does.

Which tensor types stay packed is decided here, once (PACKED_TYPES; offline_docs/quantization.md has the table
and the reasons): a Q4_0 linear projection is handed over as the internal int4_group form, exactly (q4_0_weight),
when the caller asks for it (iter_weights' `packed`, runtime/packed_load.py); everything else is dequantized.

The header (metadata and tensor table) is read here, not by `gguf.GGUFReader`: that reader makes a numpy view
per array element, and a 49K-token vocabulary (tokens, scores, types, merges) took it about 6 s on one core for
each load; walking the same bytes with `struct` takes a fraction of a second. The values are the ones
`GGUFReader`'s `field.contents()` gives (tests/test_runtime_gguf.py compares the two).
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import re
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from envex.kernels import quant
from envex.runtime.quant_config import CT_PACK, WeightScheme

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
_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
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

# The GGML types a linear projection keeps packed (offline_docs/quantization.md, "GGUF files": why the others do
# not): Q4_0, blocks of 32 inputs, an fp16 scale d and 4-bit codes q, w = d·(q − 8), is int4_group with group 32,
# zero 8 and scale d, exactly. Q4_1's w = d·q + m needs a zero m/d that is rarely an integer; Q8_0 has no 8-bit
# integer scheme here; K-quants nest 6-bit sub-scales in super-blocks; F16/F32 are float already.
Q4_0, Q4_0_BLOCK, Q4_0_BYTES = 2, 32, 18
PACKED_TYPES = frozenset({Q4_0})
# How iter_weights hands a packed projection over: compressed-tensors' pack-quantized tensors (`weight_packed` in
# the internal layout, `weight_scale`, `weight_shape`), symmetric, groups of 32: what runtime/quant_config.py reads.
Q4_0_SCHEME = WeightScheme(kind=quant.INT4_GROUP, layout=CT_PACK, group_size=Q4_0_BLOCK, symmetric=True)


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
        "model_type": arch,  # the three architectures' GGUF names are their HF model types
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
    # [n_head * 2 * half, ...] rows grouped (head, half, pair) by llama.cpp -> HF's (head, pair, half). Rows only:
    # a float matrix, or a packed one's words and scales alike.
    half = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def q4_0_weight(blocks: np.ndarray) -> quant.PackedWeight:
    """A Q4_0 matrix as stored (uint8 [N, K/32 · 18]: per block of 32 inputs an fp16 d, then 16 bytes whose low
    nibbles are inputs 0..15 and high nibbles inputs 16..31, llama.cpp's block_q4_0) -> int4_group, group 32,
    symmetric (zero 8), scale float16 d: W = (q − 8)·d, bit for bit what gguf.quants.dequantize gives (both one
    float32 product of d and a small integer). Codes are moved into the internal order (input 8c + j in nibble j
    of word c), never rounded."""
    n, nbytes = blocks.shape
    if nbytes % Q4_0_BYTES:
        raise GGUFError(f"Q4_0 rows of {nbytes} bytes are not whole blocks of {Q4_0_BYTES}")
    b = blocks.reshape(n, -1, Q4_0_BYTES)  # [N, K/32, 18]
    scale = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]  # [N, K/32]
    qs = b[..., 2:]  # [N, K/32, 16]
    codes = np.stack([qs & 0xF, qs >> 4], axis=2).astype(np.uint32)  # [N, K/32, 2, 16]: inputs 0..15, 16..31
    nibbles = codes.reshape(n, -1, quant.PACK) << (4 * np.arange(quant.PACK, dtype=np.uint32))  # [N, K/8, 8]
    words = np.bitwise_or.reduce(nibbles, axis=-1)  # [N, K/8] uint32
    return quant.PackedWeight(scheme=quant.INT4_GROUP, shape=(n, b.shape[1] * Q4_0_BLOCK), group=Q4_0_BLOCK,
                              data=torch.from_numpy(words.view(np.int32)),
                              scale=torch.from_numpy(np.ascontiguousarray(scale)))  # fmt: skip


def _hf_name(tensor: TensorInfo, path: Path) -> tuple[str, str] | None:
    """(HF name, GGUF short name such as attn_q or output) of a tensor; None for one recomputed from the config."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", tensor.name)
    if match:
        layer, short, kind = match.groups()
        if short not in _LAYER_NAMES:
            raise GGUFError(f"{path}: unexpected tensor {tensor.name}; this GGUF layout is not supported")
        return f"model.layers.{layer}.{_LAYER_NAMES[short]}.{kind}", short
    base, _, kind = tensor.name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        return None  # e.g. rope_freqs: recomputed from the config
    return f"{_GLOBAL_NAMES[base]}.{kind}", base


def packed_linears(path: Path) -> dict[str, int]:
    """HF module names of the linear projections (q, k, v, o, gate, up, down, the LM head) whose GGUF weight is of
    a type kept packed (PACKED_TYPES): what iter_weights can hand over packed; each with its weight's elements."""
    stat = path.stat()
    return dict(_packed_linears(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _packed_linears(path: Path, mtime_ns: int, size: int) -> tuple[tuple[str, int], ...]:
    # Cached by the file's identity: the engine asks before building the model and again when loading it.
    found = []
    for tensor in read_header(path).tensors:
        named = _hf_name(tensor, path)
        if named and named[1] in _LINEARS and named[0].endswith(".weight") and tensor.ggml_type in PACKED_TYPES:
            found.append((named[0].removesuffix(".weight"), math.prod(tensor.dims)))
    return tuple(found)


def iter_weights(path: Path, cfg: dict[str, Any], packed: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor) for every tensor in the file; the weight of each HF module named in
    `packed` (a subset of packed_linears) as the pack-quantized tensors of Q4_0_SCHEME instead: `<module>.
    weight_packed` (int32 [N, K/8]), `.weight_scale` (float16 [N, K/32]) and `.weight_shape` ([N, K])."""
    from gguf.quants import dequantize

    header = read_header(path)
    permute_q = cfg["architectures"][0] == "LlamaForCausalLM"  # llama.cpp permutes q/k only for llama
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for tensor in header.tensors:
        named = _hf_name(tensor, path)
        if named is None:
            continue
        name, short = named
        n_head = heads.get(short) if permute_q else None
        module = name.removesuffix(".weight")
        if module in packed and name.endswith(".weight"):
            if tensor.ggml_type not in PACKED_TYPES:
                raise GGUFError(f"{path}: {tensor.name} is {_quant_type(tensor.ggml_type).name}, not a type kept "
                                "packed; load it dequantized")  # fmt: skip
            pw = q4_0_weight(header.array(tensor))
            words, scale = pw.data.numpy(), pw.scale.numpy()
            if n_head is not None:  # rows only: permuting a packed matrix's words and scales is exact
                words, scale = _reverse_permute(words, n_head), _reverse_permute(scale, n_head)
            yield f"{module}.weight_packed", torch.from_numpy(np.ascontiguousarray(words))
            yield f"{module}.weight_scale", torch.from_numpy(np.ascontiguousarray(scale))
            yield f"{module}.weight_shape", torch.tensor(pw.shape)
            continue
        # GGML shapes list the fastest dimension first; numpy's order is the reverse.
        shape = tuple(reversed(tensor.dims))
        data = dequantize(header.array(tensor), _quant_type(tensor.ggml_type))
        array = np.asarray(data, dtype=np.float32).reshape(shape)
        if n_head is not None:
            array = _reverse_permute(array, n_head)
        yield name, torch.from_numpy(np.array(array, copy=True, order="C"))


def tokenizer_parts(path: Path, model_type: str | None = None) -> tuple[Any, dict[str, Any]]:
    """A `tokenizers.Tokenizer` and a tokenizer_config-like dict, both from the GGUF metadata.

    transformers' public GGUF path builds the fast tokenizer from the file's vocabulary and merges, so the
    reference and we tokenize identically; we keep only the Rust tokenizer and the plain settings. model_type (the
    HF config's, from hf_config): given, transformers' choice of tokenizer class takes it from here (_config_only).
    """
    from transformers import AutoTokenizer

    with _config_only(model_type):
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


@contextlib.contextmanager
def _config_only(model_type: str | None) -> Iterator[None]:
    """While AutoTokenizer runs: its model config, which it reads only to choose the tokenizer class, is
    {"model_type": model_type} instead of transformers' legacy GGUF parse (gguf's GGUFReader over every field,
    the 49,152-token vocabulary included: 10 of the embedded model's 11 s on one core). Only where transformers
    builds the tokenizer itself with its own fast reader (integrations.gguf.get_gguf_tokenizer, transformers 5.2x),
    so the legacy parse's other results are never asked for; elsewhere nothing changes."""
    try:
        import transformers.modeling_gguf_pytorch_utils as legacy
        from transformers.integrations.gguf import get_gguf_tokenizer  # noqa: F401  (present: the fast tokenizer)
    except ImportError:
        model_type = None
    if model_type is None:
        yield
        return
    real = legacy.load_gguf_checkpoint

    def config_only(gguf_path: Any, return_tensors: bool = False, **kwargs: Any) -> dict[str, Any]:
        if return_tensors:
            return real(gguf_path, return_tensors=return_tensors, **kwargs)
        return {"config": {"model_type": model_type}}

    legacy.load_gguf_checkpoint = config_only
    try:
        yield
    finally:
        legacy.load_gguf_checkpoint = real
