"""Gate: greedy answers under tensor parallelism equal one GPU's on the same weights.

The rule is gate_reference's (vLLM's `check_logprobs_close`): the sequences may diverge (a sharded projection sums
its partial products in another order), but at the first differing position each side's token must be among the
other side's top-5. The reference is the engine at tensor_parallel=1 on the same model directory, in place of HF
transformers (`EngineReference`), so the gate also runs where HF could not hold the model.

At install (`run_tensor_parallel_gate`, called by the installer's gate runner when launch.json's tensor_parallel
is above 1) the model is the release's own architecture and widths cut to two layers, with random weights: a model
that needs N GPUs does not fit one, but its cut does, and the same widths mean the same kernels, tiles and
all-reduce message sizes as the served model. One engine at a time: TP=1's answers are recorded
(`RecordedReference`) and that engine freed before TP=N loads.
"""

from __future__ import annotations

import gc
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from envex.runtime.config import ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.config import model_window
from envex.runtime.loader import load_model_info
from envex.verify.common import Timer, chat_ids
from envex.verify.gate_reference import check_reference_equality, crossed_top_k, first_difference
from envex.verify.reference import RefGeneration
from envex.verify.types import GateEngine, GateResult, NumericPolicy

NAME = "tensor_parallel_equality"
# A chat template for word-level test tokenizers (token i is "t{i}"): the user's text as it is.
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# The install-time gate: the model cut to this many layers (two: a layer's output feeds a sharded layer again),
# prompts of these lengths (a decode-sized prefill up to a few hundred tokens) and greedy tokens per prompt.
GATE_LAYERS = 2
GATE_PROMPT_LENGTHS = (7, 25, 64, 300)
GATE_MAX_TOKENS = 32
T = TypeVar("T")


class EngineReference:
    """An LLMEngine (tensor_parallel=1) answering as gate_reference's reference does: greedy tokens and top-k."""

    origin = "local"  # verify.reference.Reference: computed on this machine

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.policy_name = f"{NumericPolicy.of(engine).name}-tp1"

    def greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int = 5, **_: Any) -> RefGeneration:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_k)
        (done,) = self.engine.generate([prompt_ids], params)
        return RefGeneration(list(done.token_ids), [lp.top for lp in done.logprobs or []], done.finish_reason)


class RecordedReference:
    """An engine's greedy answers recorded ahead, so that engine can be freed before the one under test loads."""

    origin = "local"

    def __init__(self, engine: Any, prompts: Sequence[list[int]], max_tokens: int, *, top_k: int = 5) -> None:
        live = EngineReference(engine)
        self.policy_name = live.policy_name
        self.max_tokens, self.top_k = max_tokens, top_k
        self.answers = {tuple(ids): live.greedy(ids, max_tokens, top_k=top_k) for ids in prompts}

    def greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int = 5, **_: Any) -> RefGeneration:
        if (max_tokens, top_k) != (self.max_tokens, self.top_k) or tuple(prompt_ids) not in self.answers:
            raise KeyError(f"no recorded answer for this prompt of {len(prompt_ids)} tokens at max_tokens="
                           f"{max_tokens}, top_k={top_k}")  # fmt: skip
        return self.answers[tuple(prompt_ids)]


def check_tensor_parallel_equality(engine: GateEngine, single: Any, *, prompts: Sequence[str],
                                   max_tokens: int = 32) -> GateResult:  # fmt: skip
    """`engine` (tensor_parallel > 1) against `single` (the same model on one device, or its RecordedReference),
    gate_reference's top-k rule."""
    reference = single if isinstance(single, RecordedReference) else EngineReference(single)
    result = check_reference_equality(engine, reference, prompts=prompts, max_tokens=max_tokens,
                                      mode="topk")  # fmt: skip
    serving = serving_path_cases(engine, reference, prompts=prompts, max_tokens=max_tokens)
    identical = result.evidence["identical"]
    alone_ok = sum(c["ok"] for c in serving)
    ok = result.verdict == "pass" and alone_ok == len(serving)
    return replace(result, name=NAME, verdict="pass" if ok else "fail",
                   evidence={**result.evidence, "serving_path": serving},
                   summary=f"{identical}/{len(prompts)} prompts token-identical to one GPU's answers (top-5 rule at "
                   f"the first difference); served alone without logprobs: {alone_ok}/{len(serving)} within the "
                   "top-5 rule")  # fmt: skip


def serving_path_cases(engine: GateEngine, reference: Any, *, prompts: Sequence[str], max_tokens: int,
                       top_k: int = 5) -> list[dict[str, Any]]:  # fmt: skip
    """Each prompt alone, greedy, without logprobs: the path a chat request takes (batch-1 decode graphs, overlapped
    steps, the one-row all-reduce between the GEMVs), which the logprob comparison does not run (logprobs turn the
    overlap off). No logprobs here, so the rule is one-sided: at the first difference from one GPU's answer the
    token must be in that answer's top-k."""
    cases = []
    for ids in (chat_ids(engine.tokenizer, p) for p in prompts):
        (got,) = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        ref = reference.greedy(ids, max_tokens, top_k=top_k)
        d = first_difference(got.token_ids, ref.token_ids)
        case: dict[str, Any] = {"prompt_tokens": len(ids), "tokens": len(got.token_ids), "identical": d is None,
                                "divergence_index": d}  # fmt: skip
        if d is not None:
            case.update(engine_token=got.token_ids[d] if d < len(got.token_ids) else None,
                        engine_token_in_reference_topk=crossed_top_k(got.token_ids, [], ref.token_ids, ref.top, d)[0])
        case["ok"] = d is None or case["engine_token_in_reference_topk"]
        cases.append(case)
    return cases


def run_tensor_parallel_gate(config: EngineConfig, *, workdir: Path, layers: int = GATE_LAYERS,
                             prompt_lengths: Sequence[int] = GATE_PROMPT_LENGTHS,
                             max_tokens: int = GATE_MAX_TOKENS, seed: int = 0) -> GateResult:  # fmt: skip
    """The release's engine settings (`config`, tensor_parallel > 1) against the same settings on one device, on
    its model's architecture and widths cut to `layers` layers with random weights (written under `workdir`,
    removed after). Raises ValueError where there is nothing to compare; the caller fails the gate then."""
    timer = Timer()
    world = config.tensor_parallel
    if world < 2:
        raise ValueError(f"tensor_parallel: {world}; the gate compares N > 1 devices with one")
    info = load_model_info(config.model)
    # Dense weights in the checkpoint's dtype: a quantized release's cut is gated on its layout, not its format.
    shape = {k: v for k, v in info.hf_config.items() if k != "quantization_config"}
    shape["num_hidden_layers"] = min(layers, info.config.num_hidden_layers)
    if config.dtype != "auto":  # the file in the dtype the engines compute in: no bigger than it need be
        shape["torch_dtype"] = config.dtype
    window = model_window(info.config)
    limit = min(config.max_model_len or window, window)
    lengths = [n for n in prompt_lengths if n + max_tokens <= limit]
    if not lengths:
        raise ValueError(f"max_model_len: {limit} leaves no room for a prompt of {min(prompt_lengths)} tokens and "
                         f"{max_tokens} generated ones")  # fmt: skip
    vocab = info.config.vocab_size
    # Token ids spread over the whole vocabulary, so every rank's range of the embedding and LM head is read.
    prompts = [" ".join(f"t{(i * 7919 + j * 104729) % vocab}" for j in range(n)) for i, n in enumerate(lengths)]
    max_len = max(lengths) + max_tokens
    cuda = config.device != "cpu" and torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="tensor-parallel-gate-", dir=workdir) as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "model", shape, seed=seed, device="cuda" if cuda else "cpu")
        # The release's kernels, dtype, device and step budget; a KV cache of exactly the prompts (not a share of
        # free memory), no warm-up (it changes no answer).
        settings = replace(config, model=str(model_dir), served_name=None, load_format="auto", max_model_len=max_len,
                           max_num_seqs=len(prompts), warm_up=False,
                           num_kv_blocks=len(prompts) * -(-max_len // config.block_size))  # fmt: skip
        reference = _with_engine(replace(settings, tensor_parallel=1), lambda single: RecordedReference(
            single, [chat_ids(single.tokenizer, p) for p in prompts], max_tokens))  # fmt: skip
        result = _with_engine(settings, lambda engine: check_tensor_parallel_equality(
            engine, reference, prompts=prompts, max_tokens=max_tokens))  # fmt: skip
    c = ModelConfig.from_hf(shape)
    cut = {"layers": c.num_hidden_layers, "model_layers": info.config.num_hidden_layers, "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
           "weights": f"random, seed {seed}"}  # fmt: skip
    for case in result.evidence["cases"]:  # the prompts are id lists: keep their lengths and what happened
        case.pop("prompt"), case.pop("engine_text"), case.pop("reference_text")
    name = config.served_name or info.source.name
    return replace(result, thresholds={**result.thresholds, "tensor_parallel": world},
                   evidence={**result.evidence, "tensor_parallel": world, "model": cut}, seconds=timer.seconds,
                   summary=f"TP={world} against TP=1 on {name}'s widths cut to {c.num_hidden_layers} layers (random "
                   f"weights): {result.summary}")  # fmt: skip


def _with_engine(config: EngineConfig, use: Callable[[LLMEngine], T]) -> T:
    """use(engine), then the engine closed (its workers stopped) and its device memory returned: the next needs it."""
    engine = LLMEngine(config)
    try:
        return use(engine)
    finally:
        engine.close()
        del engine
        free_device_memory()


def free_device_memory() -> None:
    """Give back what dropped engines held: their reference cycles collected, then CUDA's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_random_checkpoint(path: Path, shape: dict[str, Any], *, seed: int = 0, device: str = "cpu") -> Path:
    """A Llama-family HF directory with random weights (N(0, 1/sqrt(fan_in)), norm weights near 1) holding every
    tensor its config asks for (Qwen2's q/k/v biases, Qwen3's q/k norms; no lm_head when tied): config.json,
    model.safetensors, a word-level tokenizer (token i is "t{i}") with PLAIN_TEMPLATE. For gates and tests that
    need the same weights loaded twice (load_format dummy makes each rank's shard on its own)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    shape = {"tie_word_embeddings": False, **shape}
    c = ModelConfig.from_hf(shape)
    h, inter, vocab, d = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    named = shape.get("torch_dtype") or shape.get("dtype") or ""  # transformers 5 writes "dtype"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(named, torch.float32)
    g = torch.Generator(device=device).manual_seed(seed)

    # Each tensor in the file's dtype as it is drawn: a 70B's widths cut to two layers are still ~4B parameters.
    def w(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g, device=device) * dims[-1] ** -0.5).to(dtype).cpu()

    def norm(n: int = h) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(n, generator=g, device=device)).to(dtype).cpu()

    def bias(n: int) -> torch.Tensor:
        return (0.1 * torch.randn(n, generator=g, device=device)).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": w(vocab, h)}
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = w(vocab, h)
    tensors["model.norm.weight"] = norm()
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                    p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": norm(),
                    p + "post_attention_layernorm.weight": norm()}  # fmt: skip
        if c.attention_bias:
            tensors |= {p + "self_attn.q_proj.bias": bias(heads * d), p + "self_attn.k_proj.bias": bias(kv * d),
                        p + "self_attn.v_proj.bias": bias(kv * d)}  # fmt: skip
        if c.qk_norm:
            tensors |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(shape))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return path
