"""Model registry: `config.architectures` picks the file that wires the layers."""

from __future__ import annotations

import torch
from torch import nn

from envex.kernels import mxfp4, quant
from envex.runtime.config import (
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    GPT_OSS,
    QWEN3_MOE,
    QWEN3_NEXT,
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    ModelConfig,
)
from envex.runtime.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from envex.runtime.models.gpt_oss import GptOssForCausalLM
from envex.runtime.models.llama import LlamaForCausalLM
from envex.runtime.models.qwen3_moe import Qwen3MoeForCausalLM
from envex.runtime.models.qwen3_next import Qwen3NextForCausalLM

_OWN_FILE: dict[str, type[nn.Module]] = {GPT_OSS: GptOssForCausalLM, QWEN3_MOE: Qwen3MoeForCausalLM,
                                         DEEPSEEK_V3: DeepseekV3ForCausalLM, DEEPSEEK_V2: DeepseekV2ForCausalLM,
                                         QWEN3_NEXT: Qwen3NextForCausalLM}
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    arch: _OWN_FILE.get(arch, LlamaForCausalLM) for arch in SUPPORTED_ARCHITECTURES
}


def model_features(architecture: str) -> frozenset[str]:
    """What the model file of this architecture needs of a backend (kernels/ops.py FEATURES), as it states it;
    nothing for an architecture it does not know (model_class refuses that)."""
    cls = MODEL_REGISTRY.get(architecture)
    return getattr(cls, "features", frozenset()) if cls is not None else frozenset()


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {config.architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None


def _matrices(param: torch.Tensor) -> list[torch.Tensor]:
    """A stack of matrices (experts [E, N, K]) as its matrices, a matrix as itself: random codes are drawn a
    matrix at a time, so the float draw beside a stack is one expert's (Kimi K2's 385-expert stack drawn whole in
    float32 took 53 GiB beside the weights)."""
    return list(param.view(-1, *param.shape[-2:])) if param.dim() > 2 else [param]


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with realistic magnitudes, made on the model's device (vLLM's --load-format dummy): norm
    weights 1, biases small, matrices N(0, 1/sqrt(fan_in)) so activations keep their scale through the layers;
    MXFP4-packed matrices (`X_blocks` with `X_scales`), FP8 ones (`X` with `X_scale`) and INT4 ones (int32 `X` with
    `X_scale`, `X_zero`) random codes at that same magnitude."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith("_blocks") and param.dtype == torch.uint8:
            mxfp4.fill_random_(param, params[name.removesuffix("_blocks") + "_scales"], gen)
        elif name.endswith("_scales") and param.dtype == torch.uint8:
            continue  # filled with its blocks
        elif param.dtype == quant.FP8_DTYPE:  # FP8 experts: codes N(0, 1), their block scales 1/sqrt(fan_in)
            for part in _matrices(param):
                part.copy_(torch.randn(part.shape, generator=gen, device=param.device).to(param.dtype))
            params[f"{name}_scale"].fill_(param.shape[-1] ** -0.5)
        elif name.endswith("_scale") and params.get(name.removesuffix("_scale"), param).dtype == quant.FP8_DTYPE:
            continue  # filled with its codes
        elif param.dtype == torch.int32:  # INT4 experts: random codes (std ~4.6 about zero 8), scales to match
            for part in _matrices(param):
                part.copy_(torch.randint(-2**31, 2**31, part.shape, generator=gen, device=param.device,
                                         dtype=torch.int64).to(torch.int32))  # fmt: skip
            params[f"{name}_scale"].fill_((param.shape[-1] * 8) ** -0.5 / 4.6)
            if f"{name}_zero" in params:
                params[f"{name}_zero"].fill_(quant.SYMMETRIC_ZERO)
        elif name.endswith(("_scale", "_zero")) and params.get(name.rpartition("_")[0], param).dtype == torch.int32:
            continue  # filled with its words
        elif name.endswith("norm_weight"):
            param.fill_(1.0)
        elif param.dim() == 1:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
