"""GGUF files: config and tokenizer from the metadata, weights dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of attn_q / attn_k for its interleaved RoPE; we undo that so the
tensors are exactly HF's (the same reverse permutation transformers applies), and name them as HF does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
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


class GGUFError(ValueError):
    """A GGUF file cannot be used; the message names the file and the problem."""


def _reader(path: Path) -> Any:
    import gguf  # imported here: only GGUF users need the package

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises many types on malformed input
        raise GGUFError(f"{path}: not a readable GGUF file ({exc}); check the file is complete") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF key/value metadata, with the big tokenizer arrays included."""
    reader = _reader(path)
    meta = {key: _field(reader, key) for key in reader.fields}
    meta["tensor_names"] = [t.name for t in reader.tensors]
    return meta


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

    reader = _reader(path)
    permute_q = cfg["architectures"][0] == "LlamaForCausalLM"  # llama.cpp permutes q/k only for llama
    for tensor in reader.tensors:
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
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
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
