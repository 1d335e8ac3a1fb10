"""gpt-oss-120b on one GPU: correctness of a reduced-depth model of the exact width against HF transformers, the
profile of one layer, and speed and memory of the whole model through the OpenAI server on dummy weights.

    python3 -m envex.verify.lab.kernel_bench.bench_gpt_oss --out $OUT --commit C \\
        [--sections check,noise,check32,profile,chain,attn131k,server] [--cases b1_1k,c32_2k,b1_131k] [--check-layers 2]

Sections, in this order, each written to gpt_oss.json as soon as it is done:

- bandwidth: the read bandwidth of this GPU in the same run (bench_server's probe), for every roofline below;
- check: a `--check-layers`-layer model of gpt-oss-120b's width (all 128 experts) with random weights written in
  the published layout (bf16, experts as MXFP4 `*_blocks`/`*_scales`). Envex loads it with the experts packed;
  HF transformers loads the same files with Mxfp4Config(dequantize=True) in bf16. Greedy within vLLM's top-5
  logprob rule (verify/gate_reference.py), mean KL and top-1 agreement over every prompt position
  (verify/gate_semantic.py), and the MXFP4 MoE kernel against its float64 reference at full size (1 and 32 rows);
- noise: the bf16 noise floor of that random-weight model: HF in bf16 and Envex in bf16, each against HF in
  float32 (mean KL, top-1, greedy within the top-5 rule): whether a bf16 miss is bf16's or Envex's;
- check32: both gates again in float32 (Envex's torch backend and HF, both on the GPU), which bf16 routing flips
  cannot fail (check_float32; HF holds ~25 GB of dequantized experts: minutes);
- profile: the same model at batch 1 with 1K tokens of context, each Ops entry point of a window layer and of a
  full layer timed alone in a CUDA graph (inputs and weights rotated so they come from HBM, not L2) against the
  bytes it must read;
- attn131k: one full-attention layer's decode at batch 1 over 131,072 cached keys, over key-split counts and
  tiles, against the bytes of K and V (the 131K case's attention share);
- server: gpt-oss-120b (bench_server's "gpt-oss-120b" shape) on dummy weights (`load_format=dummy`: random packed
  experts made on the GPU, ~65 GB) behind `envex.runtime.server.serve`, driven by bench_server's streaming client:
  b1_1k (batch 1, 1K prompt, 256 out), c32_2k (32 concurrent 2K/256), b1_131k (batch 1, 130,560-token prompt, 512
  out: 131,072 in all; its TTFT is the 131K prefill). The memory the server holds (weights, KV, what is left) and
  the bytes HF transformers would need in bf16. On dummy weights only speed and memory mean anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from envex.kernels import mxfp4
from envex.verify.lab.kernel_bench.bench_server import SHAPES, start_server, stop_server, wait_ready, write_model_dir

CASES = {"b1_1k": (1, 1024, 256, 3), "c32_2k": (32, 2048, 256, 2), "b1_131k": (1, 130560, 512, 1)}
# A chat template for the word-level test tokenizer: the user's text as it is (the gates render chats).
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


# ---- bytes ----------------------------------------------------------------------------------------------------


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int, int, int, int]:
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    e = cfg.get("num_local_experts", 128)
    k = cfg.get("num_experts_per_tok", 4)
    return h, i, n, q, kv, e, k, cfg["vocab_size"], cfg["num_attention_heads"]


def expert_bytes(h: int, i: int) -> float:
    """One expert's packed weights (values and scales: 17/32 byte per weight) and its bf16 biases."""
    return 3 * h * i * (mxfp4.GROUP // 2 + 1) / mxfp4.GROUP + (2 * i + h) * 2


def model_bytes(cfg: dict[str, Any]) -> dict[str, float]:
    """What the weights take in memory as Envex holds them (experts packed, the rest bf16), and all in bf16."""
    h, i, n, q, kv, e, _, v, heads = _dims(cfg)
    attention = ((h + 1) * (q + 2 * kv) + (q + 1) * h + heads + 2 * h) * 2  # q/k/v/o with biases, sinks, norms
    router = (e * h + e) * 2
    experts = e * expert_bytes(h, i)
    per_layer = attention + router + experts
    embed_head = 2 * v * h * 2
    total = n * per_layer + embed_head + h * 2
    params = n * (attention / 2 + router / 2 + e * (3 * h * i + 2 * i + h)) + 2 * v * h + h
    return {"experts_packed": n * experts, "attention": n * attention, "router": n * router,
            "embed_and_lm_head": embed_head, "total": total, "params": params, "bf16_total": 2 * params}


def step_bytes(cfg: dict[str, Any], context: int, batch: int = 1) -> float:
    """Bytes one decode step of `batch` sequences reads: attention and router weights, the experts its tokens
    choose (at batch > 1 the expected number of distinct experts under uniform routing), the LM head, one
    embedding row per token, and the KV of `context` tokens per sequence (window layers: their window)."""
    h, i, n, q, kv, e, k, v, heads = _dims(cfg)
    mb = model_bytes(cfg)
    distinct = e * (1 - (1 - k / e) ** batch)
    windows = [w for w in (cfg.get("layer_types") or []) if w == "sliding_attention"]
    n_window = len(windows) if windows else n // 2
    window = cfg.get("sliding_window", 128)
    kv_per_token = 2 * kv * 2
    kv_bytes = batch * kv_per_token * ((n - n_window) * context + n_window * min(context, window))
    return (mb["attention"] + mb["router"] + n * distinct * expert_bytes(h, i) + v * h * 2 + batch * h * 2
            + kv_bytes)


# ---- the reduced model: written in the published layout ------------------------------------------------------


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """An Envex GptOssForCausalLM's weights under the published checkpoint's names (q/k/v unpacked, experts as
    the MXFP4 bytes), on the CPU."""
    c = model.config
    out = {"model.embed_tokens.weight": model.embed_tokens_weight, "model.norm.weight": model.norm_weight,
           "lm_head.weight": model.lm_head_weight}  # fmt: skip
    sizes = [c.q_size, c.kv_size, c.kv_size]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for name, w, b in zip("qkv", layer.qkv_proj_weight.split(sizes), layer.qkv_proj_bias.split(sizes),
                              strict=True):  # fmt: skip
            out[f"{p}self_attn.{name}_proj.weight"], out[f"{p}self_attn.{name}_proj.bias"] = w, b
        out.update({
            f"{p}self_attn.o_proj.weight": layer.o_proj_weight, f"{p}self_attn.o_proj.bias": layer.o_proj_bias,
            f"{p}self_attn.sinks": layer.sinks, f"{p}mlp.router.weight": layer.router_weight,
            f"{p}mlp.router.bias": layer.router_bias, f"{p}input_layernorm.weight": layer.input_layernorm_weight,
            f"{p}post_attention_layernorm.weight": layer.post_attention_layernorm_weight,
        })  # fmt: skip
        for name in ("gate_up_proj", "down_proj"):
            for kind in ("bias", "blocks", "scales"):
                out[f"{p}mlp.experts.{name}_{kind}"] = getattr(layer, f"{name}_{kind}")
    return {k: t.detach().contiguous().cpu() for k, t in out.items()}


def write_reduced_checkpoint(path: Path, cfg: dict[str, Any], layers: int, *, device: str, seed: int = 0,
                             router_bias_spacing: float | None = None, embed_scale: float = 1.0) -> None:
    """config.json, a word-level tokenizer with a chat template, and random weights of `layers` layers in the
    published layout: dummy weights (runtime/engine/model_runner.py) with sinks ~ N(0, 1) and an LM head scaled
    4x, so the logits are decisive (argmax not a coin flip between near-ties at bf16 precision).

    `router_bias_spacing` s: each layer's router biases a permutation of 0, -s, -2s, ...: with s well above the
    router's own logits (std ~1) every token takes the same experts, the first of them by far the heaviest, so no
    expert choice sits on a near-tie. A random router puts ~4% of tokens' choices within bf16 rounding of a tie in
    each layer, and each flip moves that token's MoE output by a quarter: HF's own bf16 model of a 2-layer,
    32-expert one is KL 0.18 nats from its float32 self, top-1 80% (no bf16 engine can pass a gate against that);
    at s = 8, KL 0.005-0.006 and top-1 93-97% (two checkpoints). Giving the chosen experts equal biases (weights
    among them following the token) left KL 0.013 and top-1 91%. `embed_scale` 50 makes the embeddings
    (N(0, 0.02)) as large as what the layers add, so the residual stream carries each token exactly and the
    layers' bf16 rounding is a smaller share of it: with s = 8, KL 0.0014, top-1 97% (the LM head's own bf16
    rounding alone: 98%; journal, 2026-12-07)."""
    from safetensors.torch import save_file

    from envex.runtime.config import ModelConfig
    from envex.runtime.models import dummy_weights
    from envex.runtime.models.gpt_oss import GptOssForCausalLM

    small = {**cfg, "num_hidden_layers": layers, "layer_types": cfg["layer_types"][:layers]}
    write_model_dir(path, small, weights=False)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    with torch.no_grad():
        model = GptOssForCausalLM(ModelConfig.from_hf(small), dtype=torch.bfloat16, device=torch.device(device))
        dummy_weights(model, seed)
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        for layer in model.layers:
            layer.sinks.normal_(0.0, 1.0, generator=gen)
            if router_bias_spacing is not None:  # the top biases near 0, where bf16 resolves them finely
                order = torch.randperm(layer.router_bias.numel(), generator=gen, device=device)
                layer.router_bias.copy_((order - (order.numel() - 1)).to(layer.router_bias.dtype) * router_bias_spacing)
        model.lm_head_weight.mul_(4.0)
        model.embed_tokens_weight.mul_(embed_scale)
    save_file(hf_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})


def hf_reference(path: Path, *, device: str, dtype: str) -> Any:
    """verify.reference.HFReference on transformers' GptOssForCausalLM of `path`, the MXFP4 experts dequantized
    (an explicit Mxfp4Config: otherwise transformers looks for its hub kernels)."""
    import importlib.util

    import transformers

    from envex.verify.reference import HFReference, cast_parameters

    # Dequantized where it will run when accelerate is there to place it (device_map), else on the CPU.
    placed = device != "cpu" and importlib.util.find_spec("accelerate") is not None
    want = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = transformers.GptOssForCausalLM.from_pretrained(
        str(path), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=want,
        local_files_only=True, **({"device_map": device} if placed else {}))  # fmt: skip
    # transformers 5.17 (the H200's) dequantizes the MXFP4 experts to bf16 whatever `dtype` asks, so a float32
    # reference would run its experts in bf16 (MXFP4 values are exact in bf16: casting up loses nothing).
    mixed = sorted({n.split(".")[-1] for n in cast_parameters(model, want)})
    if mixed:
        print(f"hf_reference: {', '.join(mixed)} loaded in a dtype other than {dtype}; cast to {dtype}", flush=True)
    ref = HFReference.__new__(HFReference)  # its constructor loads with AutoModel's defaults
    eos = model.generation_config.eos_token_id
    ref.source, ref.device, ref.dtype, ref.model, ref._memo = None, torch.device(device), dtype, model.to(device), {}
    ref.model.eval()
    ref.eos_token_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    return ref


def reduced_engine(path: Path, *, device: str, dtype: str, backend: str = "auto") -> Any:
    from envex.runtime.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype, backend=backend, max_model_len=2048,
                                    num_kv_blocks=1024, max_num_seqs=8, enable_prefix_caching=False))  # fmt: skip
    assert engine.runner.model.layers[0].gate_up_proj_blocks.dtype == torch.uint8, "experts must stay packed"
    return engine


def check(engine: Any, path: Path, *, prompts: int = 6, max_tokens: int = 32, texts: int = 4,
          text_len: int = 512) -> dict[str, Any]:  # fmt: skip
    """The reduced model through Envex against HF transformers on the same files: the reference-equality gate
    (top-5 rule unless both run float32 on a CPU) and the semantic gate (mean KL, top-1 agreement)."""
    from envex.verify.gate_reference import check_reference_equality
    from envex.verify.gate_semantic import check_semantic

    ref = hf_reference(path, device=str(engine.runner.device.type), dtype=engine.config.dtype)
    words, long_texts = _check_inputs(engine, prompts, texts, text_len)
    result = {
        "reference_equality": dataclasses.asdict(check_reference_equality(engine, ref, prompts=words,
                                                                          max_tokens=max_tokens)),
        "semantic": dataclasses.asdict(check_semantic(engine, ref, texts=long_texts, max_len=text_len)),
    }  # fmt: skip
    del ref
    gc.collect()
    return result


def _check_inputs(engine: Any, prompts: int, texts: int, text_len: int) -> tuple[list[str], list[str]]:
    """The gates' prompts and long texts: random words of the vocabulary's ordinary tokens, seeded."""
    rng = random.Random(0)
    vocab = min(199990, engine.model_config.vocab_size)  # below gpt-oss's special tokens (199998 and up)
    words = [" ".join(f"t{rng.randrange(1, vocab)}" for _ in range(rng.randrange(8, 64))) for _ in range(prompts)]
    long_texts = [" ".join(f"t{rng.randrange(1, vocab)}" for _ in range(text_len)) for _ in range(texts)]
    return words, long_texts


def noise_floor(engine: Any, path: Path, *, prompts: int = 6, max_tokens: int = 32, texts: int = 4,
                text_len: int = 512) -> dict[str, Any]:  # fmt: skip
    """How far bf16 alone moves this random-weight model: HF transformers in bf16 and Envex (`engine`, bf16 on the
    GPU), each against HF in float32 on the same files, on the check's prompts and texts. If Envex is as close to the
    float32 model as HF's own bf16 run is, the bf16 gates' misses are bf16's, not Envex's."""
    from envex.verify.gate_reference import chat_ids, check_reference_equality, crossed_top_k, first_difference
    from envex.verify.gate_semantic import kl_and_top1

    device = str(engine.runner.device.type)
    ref32, ref16 = hf_reference(path, device=device, dtype="float32"), hf_reference(path, device=device,
                                                                                      dtype="bfloat16")
    words, long_texts = _check_inputs(engine, prompts, texts, text_len)
    kl: dict[str, list[torch.Tensor]] = {"hf_bf16": [], "envex": []}
    top1: dict[str, list[torch.Tensor]] = {"hf_bf16": [], "envex": []}
    for text in long_texts:
        ids = engine.tokenizer.encode(text)[:text_len]
        want = ref32.full_logits(ids)
        for name, got in (("hf_bf16", ref16.full_logits(ids)), ("envex", engine.full_logits(ids).float().cpu())):
            k, t = kl_and_top1(want, got)
            kl[name].append(k)
            top1[name].append(t)
    greedy_hf = {"identical": 0, "top5_rule": 0}
    for p in words:
        ids = chat_ids(engine.tokenizer, p)
        a, b = ref16.greedy(ids, max_tokens), ref32.greedy(ids, max_tokens)
        d = first_difference(a.token_ids, b.token_ids)
        greedy_hf["identical"] += d is None
        greedy_hf["top5_rule"] += d is None or all(crossed_top_k(a.token_ids, a.top, b.token_ids, b.top, d))
    envex_vs_f32 = check_reference_equality(engine, ref32, prompts=words, max_tokens=max_tokens, mode="topk")
    out = {
        name: {"mean_kl": torch.cat(kl[name]).mean().item(), "top1": torch.cat(top1[name]).float().mean().item()}
        for name in kl
    }
    out["hf_bf16"]["greedy"] = {**greedy_hf, "prompts": len(words)}
    out["envex"]["greedy"] = {"identical": envex_vs_f32.evidence["identical"],
                              "top5_rule": sum(c["ok"] for c in envex_vs_f32.evidence["cases"]),
                              "verdict": envex_vs_f32.verdict, "prompts": len(words)}  # fmt: skip
    out["envex"]["dtype"] = engine.config.dtype
    del ref32, ref16
    gc.collect()
    return out


def moe_kernel_check(layer: Any) -> dict[str, Any]:
    """fused_moe (MXFP4, bf16 activations) against the float64 reference at full size: one layer's 128 experts."""
    from envex.kernels import moe_mxfp4, reference
    from envex.kernels.accuracy import TOLERANCE, rel_err

    ex = layer.experts
    dev = layer.gate_up_proj_blocks.device
    h, e = layer.router_weight.shape[1], layer.router_weight.shape[0]
    out: dict[str, Any] = {"tolerance": TOLERANCE[torch.bfloat16]}
    gen = torch.Generator(device=dev).manual_seed(3)
    for rows in (1, 32):
        x = torch.randn(rows, h, device=dev, generator=gen).to(torch.bfloat16)
        logits = torch.randn(rows, e, device=dev, generator=gen)  # float32: no ties between the routings
        got = moe_mxfp4.fused_moe(x, logits, layer.top_k, gate_up=ex.gate_up_matrix(), gate_up_bias=ex.gate_up_bias,
                                  down=ex.down_matrix(), down_bias=ex.down_bias, alpha=ex.alpha, limit=ex.limit)
        w, ids = reference.moe_route(logits.double(), layer.top_k)
        want = reference.moe_experts(x.double(), w, ids, ex.gate_up_matrix(), ex.gate_up_bias.double(),
                                     ex.down_matrix(), ex.down_bias.double(), ex.alpha, ex.limit)  # fmt: skip
        out[f"rows_{rows}_rel_err"] = rel_err(got, want)
    out["ok"] = all(v <= out["tolerance"] for k, v in out.items() if k.endswith("rel_err"))
    return out


# ---- profile of one layer ---------------------------------------------------------------------------------------


def profile_layers(engine: Any, *, context: int = 1024, rotations: int = 8) -> list[dict[str, Any]]:
    """Each Ops entry point of layer 0 (sliding window) and layer 1 (full) at batch 1, alone in a CUDA graph."""
    from envex.kernels.ops import AttentionMetadata
    from envex.verify.lab.kernel_bench import _bench_lib as B

    runner = engine.runner
    model, ops, dev, dt = runner.model, runner.ops, runner.device, runner.dtype
    c = model.config
    rows: list[dict[str, Any]] = []
    h, bs = c.hidden_size, runner.block_size
    gen = torch.Generator(device=dev).manual_seed(5)
    xs = [torch.randn(1, h, device=dev, dtype=dt, generator=gen) for _ in range(rotations)]
    res = [torch.randn(1, h, device=dev, dtype=dt, generator=gen) for _ in range(rotations)]
    blocks = -(-(context + 1) // bs)
    caches = (torch.randn(rotations * blocks, bs, c.num_key_value_heads, c.head_dim, device=dev, dtype=dt),
              torch.randn(rotations * blocks, bs, c.num_key_value_heads, c.head_dim, device=dev, dtype=dt))
    metas = []
    for r in range(rotations):  # each rotation its own sequence (its own blocks) at position `context`
        table = torch.arange(r * blocks, (r + 1) * blocks, device=dev, dtype=torch.int32)[None]
        pos = torch.tensor([context], device=dev)
        metas.append(AttentionMetadata(
            positions=pos, slot_mapping=(table[0, context // bs].long() * bs + context % bs)[None],
            cu_seqlens_q=torch.tensor([0, 1], device=dev, dtype=torch.int32), block_tables=table, cos=runner.cos,
            sin=runner.sin, max_q_len=1, max_seq_len=context + 1))  # fmt: skip

    def row(name: str, fn, nbytes: float) -> None:
        ms = B.graph_time_ms(lambda i: fn(i % rotations), n_inner=2 * rotations)
        rows.append({"entry": name, "us": ms * 1e3, "bytes": nbytes, "GBps": nbytes / ms / 1e6})
        print(f"  {name:<44} {ms * 1e3:8.2f} us  {nbytes / 1e6:9.2f} MB  {nbytes / ms / 1e6:8.1f} GB/s", flush=True)

    kv_token = 2 * c.kv_size * dt.itemsize

    def layer_rows(li: int) -> None:  # each row's graph is captured and timed before the next is built
        layer = model.layers[li]
        kind = "window" if layer.attn.sliding_window else "full"
        qkv_w = [layer.qkv_proj_weight.clone() for _ in range(rotations)]  # copies: each call reads HBM
        o_w = [layer.o_proj_weight.clone() for _ in range(rotations)]
        qkvs = [ops.norm_linear(xs[r], res[r], layer.input_layernorm_weight, layer.eps, qkv_w[r],
                                layer.qkv_proj_bias)[0] for r in range(rotations)]  # fmt: skip
        attn_out = torch.randn(1, c.q_size, device=dev, dtype=dt)
        keys = min(context + 1, layer.attn.sliding_window or context + 1)
        row(f"L{li} {kind}: input norm + QKV GEMV (+bias)", lambda r: ops.norm_linear(
            xs[r], res[r], layer.input_layernorm_weight, layer.eps, qkv_w[r], layer.qkv_proj_bias),
            qkv_w[0].nbytes + 4 * h * dt.itemsize)  # fmt: skip
        row(f"L{li} {kind}: attention decode, {keys} keys (+sinks)", lambda r: ops.attention(
            qkvs[r], *caches, metas[r], layer.attn), keys * kv_token + qkvs[0].nbytes)  # fmt: skip
        row(f"L{li} {kind}: O GEMV (+bias)", lambda r: ops.linear(attn_out, o_w[r], layer.o_proj_bias),
            o_w[0].nbytes)
        moe_bytes = layer.router_weight.nbytes + layer.top_k * expert_bytes(h, c.intermediate_size)
        row(f"L{li} {kind}: MoE (norm, router, top-4 MXFP4 experts)", lambda r: ops.moe(
            xs[r], res[r], layer.post_attention_layernorm_weight, layer.eps, layer.router_weight,
            layer.router_bias, layer.experts, layer.top_k), moe_bytes)  # fmt: skip

    layer_rows(0)
    layer_rows(1)
    row("final norm + LM head GEMV", lambda r: model.compute_logits(ops, xs[r], res[r]), model.lm_head_weight.nbytes)
    return rows


def chain_sweep(models: Path, *, layers: int = 4, context: int = 1024) -> dict[str, Any]:
    """The batch-1 decode chain as a served graph runs it (`layers` gpt-oss layers of the exact width, dummy
    weights, then the final norm and LM head; 1K keys in the 4K graph's attention launch), one CUDA graph with
    programmatic dependent launch between the kernels, timed with each GEMV config of QKV, O and the LM head in turn
    (the others at their defaults), and with the one-launch MoE's and norm_router's settings. A config is measured
    alone elsewhere (bench_h200); in the chain its ramp and tail overlap its neighbours', which is what a served
    step sees. The server has the last word (verify/lab/journal-kernels.md, "Settings picked in the decode chain")."""
    from envex.kernels import gemv, moe_mxfp4
    from envex.verify.lab.kernel_bench import _bench_lib as B

    chain = B.decode_chain(models, SHAPES["gpt-oss-120b"], layers=layers, context=context)
    step, c = chain.step, chain.engine.runner.model.config
    h, kq = c.hidden_size, c.q_size + 2 * c.kv_size

    timed = B.chain_timer(step)

    keys = {"qkv": (kq, h, gemv.PROLOGUE_ADD_RMS), "o": (h, c.q_size, gemv.PROLOGUE_NONE),
            "lm_head": (c.vocab_size, h, gemv.PROLOGUE_ADD_RMS)}  # fmt: skip
    candidates = {  # the earlier sweeps' leaders (d0d7626, 0964986) and their neighbours
        "qkv": [(2, 0, 8, 4), (2, 0, 4, 4), (2, 0, 4, 6), (2, 0, 4, 8), (2, 0, 8, 5), (4, 0, 8, 2), (4, 0, 8, 4)],
        "o": [(2, 0, 8, 4), (2, 2048, 8), (4, 512, 4), (1, 0, 8, 4), (2, 0, 4, 4), (2, 0, 4, 6), (2, 0, 8, 3)],
        "lm_head": [(2, 0, 8, 4), (4, 0, 8, 2), (2, 0, 4, 4), (4, 0, 8, 4), (2, 0, 8, 6)],
    }  # fmt: skip
    report: dict[str, Any] = {"layers": layers, "context": context, "rows": []}
    base = timed("defaults")
    report["defaults_us"] = base
    for name, cfgs in candidates.items():
        best = (base, gemv.tuned_config(*keys[name]))
        for cfg, us, err in B.sweep(timed, name, cfgs, gemv.H200_CONFIGS, keys[name]):
            report["rows"].append({"proj": name, "config": cfg, **({"error": err} if err else {"us": us})})
            if not err:
                best = min(best, (us, cfg))
        report[f"best_{name}"] = {"config": best[1], "us": best[0], "key": keys[name]}
    settings = (("moe_warm", "ONE_LAUNCH_WARM", (False, True)),
                ("moe_spin", "ONE_LAUNCH_SPIN_NS", (200, 400, 800, 1600)),
                ("norm_router_rows", "NORM_ROUTER_ROWS", (2, 4, 8)))  # fmt: skip
    for proj, attr, values in settings:
        for value, us, err in B.sweep(timed, attr, values, moe_mxfp4, attr):
            report["rows"].append({"proj": proj, "config": value, **({"error": err} if err else {"us": us})})
    report["defaults_again_us"] = timed("defaults again")
    return report


def long_decode_attention(bw: float, *, keys: int = 131072) -> dict[str, Any]:
    """A full-attention layer's decode at batch 1 over `keys` cached keys (gpt-oss's 8 KV heads of 64, 64 query
    heads, sinks): decode_attention_fused as the engine launches it (key splits merged by a second launch), over
    split counts and tiles, against the bytes of K and V."""
    from envex.kernels import attention, decode_attention
    from envex.verify.lab.kernel_bench import _bench_lib as B

    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, page = 64, 8, 64, 16
    blocks = -(-(keys + 1) // page)
    kc = torch.randn(blocks, page, hkv, d, device=dev, dtype=dt)
    vc = torch.randn(blocks, page, hkv, d, device=dev, dtype=dt)
    table = torch.randperm(blocks, device=dev).to(torch.int32)[None]
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    pos = torch.tensor([keys], device=dev)
    slot = (table[0, keys // page].long() * page + keys % page)[None]
    half = torch.arange(d // 2, device=dev) / (d // 2)
    ang = torch.arange(keys + 1, device=dev)[:, None].float() * 10000.0 ** -half[None]
    cos, sin = ang.cos(), ang.sin()
    sinks = torch.randn(hq, device=dev)
    nbytes = 2 * keys * hkv * d * 2
    default = attention.choose_num_splits(1, hkv, keys + 1, dev)
    rows: list[dict[str, Any]] = []

    def attend(_i: int, *, sp: int, bn: int, st: int, w: int) -> torch.Tensor:
        return decode_attention.decode_attention_fused(
            qkv, pos, slot, cos, sin, kc, vc, table, d**-0.5, num_heads=hq, num_kv_heads=hkv, max_seq_len=keys + 1,
            num_splits=sp, merge_in_kernel=False, block_n=bn, num_warps=w, num_stages=st, sinks=sinks)

    for splits in (default, 16, 32, 64):
        for block_n in (64, 128):
            for stages in (2, 3, 4):
                for warps in (4, 8):
                    if splits == default and (block_n, stages, warps) != (64, 2, 4) and rows:
                        continue  # the default's own tile once, the sweep's over the explicit split counts
                    fn = functools.partial(attend, sp=splits, bn=block_n, st=stages, w=warps)
                    try:
                        us = B.graph_time_ms(fn, 4) * 1e3
                    except Exception as exc:  # a tile that does not fit: record it, go on
                        rows.append({"splits": splits, "block_n": block_n, "stages": stages, "warps": warps,
                                     "error": str(exc)[:160]})  # fmt: skip
                        continue
                    rows.append({"splits": splits, "block_n": block_n, "stages": stages, "warps": warps, "us": us,
                                 "TBps": nbytes / us / 1e6, "floor_us": nbytes / bw / 1e6})  # fmt: skip
                    print(f"  attn {keys} keys splits={splits} block_n={block_n} stages={stages} warps={warps}: "
                          f"{us:7.1f} us ({nbytes / us / 1e6:.2f} TB/s, floor {nbytes / bw / 1e6:.1f})", flush=True)
    return {"keys": keys, "default_splits": default, "bytes": nbytes, "rows": rows}


# ---- the server: gpt-oss-120b on dummy weights --------------------------------------------------------------


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def server_runs(args: argparse.Namespace, bw: dict[str, float], report: dict[str, Any]) -> None:
    import asyncio

    import httpx

    from envex.runtime.config import ModelConfig
    from envex.runtime.engine.caches.window_kv import WindowBlocks
    from envex.runtime.engine.config import EngineConfig
    from envex.verify.lab.kernel_bench.bench_server import run_case

    shape = SHAPES["gpt-oss-120b"]
    model_dir = args.models / "gpt-oss-120b"
    write_model_dir(model_dir, shape, weights=False)
    cases = [c for c in args.cases.split(",") if c]
    max_len = 131072 if "b1_131k" in cases else 4096
    settings = {"model": str(model_dir), "load_format": "dummy", "max_model_len": max_len, "max_num_seqs": 32,
                "enable_prefix_caching": False}  # fmt: skip
    run: dict[str, Any] = {"settings": settings, "cases": {}}
    report["server"] = run
    free0, total = torch.cuda.mem_get_info()
    base = "http://127.0.0.1:18100"
    t0 = time.monotonic()
    proc = start_server(args.tree, settings, 18100, args.out / "server-gpt-oss-120b.log")
    try:
        run["ready_s"] = wait_ready(base, proc, timeout=600)
        served = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        free1, _ = torch.cuda.mem_get_info()
        blocks = _metric(metrics, "envex_kv_blocks_total") or 0
        cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=8192)  # as the server resolves them on CUDA
        mc = ModelConfig.from_hf(shape)
        full_layers = sum(w is None for w in mc.layer_windows)
        kv_full = blocks * 16 * full_layers * 2 * mc.kv_size * 2
        weights = model_bytes(shape)
        run["memory_GB"] = {
            "device_total": total / 1e9, "server_holds": (free0 - free1) / 1e9, "left_free": free1 / 1e9,
            "weights": weights["total"] / 1e9, "experts_packed": weights["experts_packed"] / 1e9,
            "kv_full_layers": kv_full / 1e9, "kv_window_pool": WindowBlocks.bytes_for(cfg, mc, torch.bfloat16) / 1e9,
            "kv_tokens": blocks * 16, "kv_at_131k_one_sequence": 131072 * full_layers * 2 * mc.kv_size * 2 / 1e9,
            "hf_transformers_bf16_weights": weights["bf16_total"] / 1e9,
            "hf_fits_this_gpu": weights["bf16_total"] < total,
        }  # fmt: skip
        print(json.dumps(run["memory_GB"]), flush=True)
        for case in cases:
            batch, prompt_len, out_len, reps = CASES[case]
            warm = 1 if case != "b1_131k" else 0  # the server's own warm-up has compiled the long-prefill kernels
            rows = [asyncio.run(run_case(base, served, batch, prompt_len, out_len, seed=r))
                    for r in range(reps + warm)][warm:]  # fmt: skip
            ok = [r for r in rows if r["completion_tokens"] == out_len]
            key = "decode_tok_s" if batch == 1 else "output_tok_s"
            context = prompt_len + out_len // 2
            floor = bw["read_TBps"] * 1e12 / step_bytes(shape, context, batch) * batch
            med = statistics.median(r[key] for r in ok) if ok else float("nan")
            run["cases"][case] = {"rows": rows, "metric": key, "median": med, "roofline_tok_s": floor,
                                  "share_of_roofline": med / floor,
                                  "ttft_ms": statistics.median(r["ttft_ms"] for r in ok) if ok else None}
            print(f"{case:>8}: {key} {med:8.1f} (roofline {floor:.1f}, {100 * med / floor:.1f}%), ttft "
                  f"{run['cases'][case]['ttft_ms'] or 0:.1f} ms", flush=True)
            (args.out / "gpt_oss.json").write_text(json.dumps(report, indent=1, default=str))
    except Exception as exc:  # keep what was measured
        run["error"] = f"{type(exc).__name__}: {exc}"
        print(run["error"], flush=True)
    finally:
        stop_server(proc, timeout=60)
        run["wall_s"] = time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--sections", default="check,check32,profile,server")
    ap.add_argument("--cases", default="b1_1k,c32_2k,b1_131k")
    ap.add_argument("--check-layers", type=int, default=2)
    ap.add_argument("--models", type=Path, default=Path("/tmp/envex-models"))
    ap.add_argument("--tree", default="/tmp/ns", help="a folder holding envex/ for the server child")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from envex.verify.lab.kernel_bench import _bench_lib as B

    sections = set(args.sections.split(","))
    report: dict[str, Any] = {"env": {"device": torch.cuda.get_device_name(), "commit": args.commit,
                                      "torch": torch.__version__, "argv": " ".join(sys.argv),
                                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}  # fmt: skip
    report["bandwidth"] = bw = B.measure_bandwidth()
    shape = SHAPES["gpt-oss-120b"]
    report["roofline"] = {"step_GB_1k": step_bytes(shape, 1024 + 128) / 1e9,
                          "step_GB_131k": step_bytes(shape, 131072) / 1e9, "weights": model_bytes(shape)}
    print(json.dumps(report["env"]), bw, json.dumps(report["roofline"]), flush=True)
    torch.cuda.empty_cache()
    save = lambda: (args.out / "gpt_oss.json").write_text(json.dumps(report, indent=1, default=str))  # noqa: E731
    if sections & {"check", "check32", "noise", "profile"}:
        path = args.models / f"gpt-oss-120b-{args.check_layers}l"
        t0 = time.monotonic()
        if not (path / "model.safetensors").is_file():
            write_reduced_checkpoint(path, shape, args.check_layers, device="cuda")
        report["check_write_s"] = time.monotonic() - t0
        engine = reduced_engine(path, device="cuda", dtype="bfloat16")
        if "check" in sections:
            report["check"] = result = check(engine, path)
            result["moe_kernel"] = moe_kernel_check(engine.runner.model.layers[1])
            for gate in ("reference_equality", "semantic"):
                print(f"{gate}: {result[gate]['verdict']} - {result[gate]['summary']}", flush=True)
            print(f"moe kernel at full size: {result['moe_kernel']}", flush=True)
            save()
        if "noise" in sections:
            report["noise_floor"] = noise = noise_floor(engine, path)
            print(f"against HF float32: {json.dumps(noise)}", flush=True)
            save()
        if "check32" in sections:
            # The same two gates in float32 (Envex's torch backend, HF, both on the GPU): with 128 random experts,
            # bf16 router logits that differ by one rounding pick another top-4 for a few tokens a layer, and on
            # random weights that moves the logits a lot (offline_docs/models.md, "gpt-oss"). float32 separates a
            # model bug (fails here too) from those flips (passes here).
            del engine
            gc.collect()
            torch.cuda.empty_cache()
            # float32 noise alone flips no routing (CPU, 128 experts: 0 flips, KL 2.5e-11 against float64), but
            # tf32 matrix products (10-bit inputs) give KL ~0.06: record what this process's float32 products are.
            report["check_float32_matmul"] = {
                "precision": torch.get_float32_matmul_precision(), "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "env": {k: os.environ.get(k) for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")},
            }  # fmt: skip
            engine32 = reduced_engine(path, device="cuda", dtype="float32", backend="torch")
            report["check_float32"] = result32 = check(engine32, path)
            for gate in ("reference_equality", "semantic"):
                print(f"float32 {gate}: {result32[gate]['verdict']} - {result32[gate]['summary']}", flush=True)
            del engine32
            gc.collect()
            torch.cuda.empty_cache()
            engine = reduced_engine(path, device="cuda", dtype="bfloat16")
        save()
        if "profile" in sections:
            print("profile, batch 1, 1K context:", flush=True)
            report["profile"] = profile_layers(engine)
            save()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    if "chain" in sections:
        report["chain"] = chain_sweep(args.models)
        save()
        gc.collect()
        torch.cuda.empty_cache()
    if "attn131k" in sections:
        report["attn131k"] = long_decode_attention(bw["read_TBps"])
        save()
    if "server" in sections:
        server_runs(args, bw, report)
    save()
    print(f"\nread bandwidth {bw['read_TBps']:.3f} TB/s; wrote {args.out / 'gpt_oss.json'}")


if __name__ == "__main__":
    main()
