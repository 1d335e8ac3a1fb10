"""Gate: greedy answers under tensor parallelism equal one GPU's on the same weights.

The rule is gate_reference's (vLLM's `check_logprobs_close`): the sequences may diverge (a sharded projection sums
its partial products in another order), but at the first differing position each side's token must be among the
other side's top-5. The reference is the engine at tensor_parallel=1 on the same model directory, in place of HF
transformers (`EngineReference`), so the gate also runs where HF could not hold the model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from envex.runtime.engine import SamplingParams
from envex.verify.gate_reference import check_reference_equality
from envex.verify.reference import RefGeneration
from envex.verify.types import GateEngine, GateResult, NumericPolicy

NAME = "tensor_parallel_equality"
# A chat template for word-level test tokenizers (token i is "t{i}"): the user's text as it is.
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


class EngineReference:
    """An LLMEngine (tensor_parallel=1) answering as gate_reference's reference does: greedy tokens and top-k."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.policy_name = f"{NumericPolicy.of(engine).name}-tp1"

    def greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int = 5, **_: Any) -> RefGeneration:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_k)
        (done,) = self.engine.generate([prompt_ids], params)
        return RefGeneration(list(done.token_ids), [lp.top for lp in done.logprobs or []], done.finish_reason)


def check_tensor_parallel_equality(engine: GateEngine, single: Any, *, prompts: Sequence[str],
                                   max_tokens: int = 32) -> GateResult:  # fmt: skip
    """`engine` (tensor_parallel > 1) against `single` (the same model on one device), gate_reference's top-k rule."""
    result = check_reference_equality(engine, EngineReference(single), prompts=prompts, max_tokens=max_tokens,
                                      mode="topk")  # fmt: skip
    identical = result.evidence["identical"]
    return replace(result, name=NAME, summary=f"{identical}/{len(prompts)} prompts token-identical to one GPU's "
                   "answers (top-5 rule at the first difference)")  # fmt: skip


def write_random_checkpoint(path: Path, shape: dict[str, Any], *, seed: int = 0, device: str = "cpu") -> Path:
    """A Llama-family HF directory with random weights (N(0, 1/sqrt(fan_in)), norm weights near 1): config.json,
    model.safetensors, a word-level tokenizer (token i is "t{i}") with PLAIN_TEMPLATE. For gates and tests that
    need the same weights loaded twice (load_format dummy makes each rank's shard on its own)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape.get("num_key_value_heads") or shape["num_attention_heads"]
    d = shape.get("head_dim") or h // heads
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g, device=device) * dims[-1] ** -0.5).cpu()

    def norm() -> torch.Tensor:
        return (1 + 0.2 * torch.randn(h, generator=g, device=device)).cpu()

    tensors = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h), "model.norm.weight": norm()}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                    p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": norm(),
                    p + "post_attention_layernorm.weight": norm()}  # fmt: skip
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(shape.get("torch_dtype", ""), torch.float32)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**shape, "tie_word_embeddings": False}))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return path
