"""Model registry: `config.architectures` picks the file that wires the layers."""

from __future__ import annotations

from torch import nn

from envex.runtime.config import GPT_OSS, QWEN3_MOE, SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from envex.runtime.models.gpt_oss import GptOssForCausalLM
from envex.runtime.models.llama import LlamaForCausalLM
from envex.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

_OWN_FILE: dict[str, type[nn.Module]] = {GPT_OSS: GptOssForCausalLM, QWEN3_MOE: Qwen3MoeForCausalLM}
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    arch: _OWN_FILE.get(arch, LlamaForCausalLM) for arch in SUPPORTED_ARCHITECTURES
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {config.architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
