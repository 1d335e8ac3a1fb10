"""End to end through the OpenAI server on one GPU: several envex trees and model shapes, side by side in one run.

    python3 -m envex.verify.lab.kernel_bench.bench_server --out $OUT --commit C \
        --runs new:llama8b=/tmp/ns,old:llama8b=/tmp/ns_old,new:qwen3-8b=/tmp/ns [--cases b1_1k,b1_10k,c64_1k] \
        [--engine det:deterministic=true,enable_prefix_caching=true]

Each run starts `envex.runtime.server.serve` in a child process whose PYTHONPATH is that tree (a folder holding
the namespace package envex, so an older commit can be measured beside this one), on 127.0.0.1, and drives it
with raw HTTP streaming requests (httpx): byte-identical token-id prompts, greedy, ignore_eos, so every request
emits exactly max_tokens tokens (checked). Random bf16 weights: a checkpoint on disk for trees that cannot build
dummy weights (the Llama shape only), `load_format=dummy` otherwise. Cases:

    b1_1k   batch 1, 1K-token prompt, 256 out: decode tok/s (after the first token) and TTFT; 1 warm-up + 3 runs
    b1_10k  batch 1, 10K prompt, 512 out; 1 warm-up + 2 runs
    c64_1k  64 concurrent 1K/256 streams: output tok/s over the whole wave; 1 warm-up + 2 runs
    c64_1k_x6  the same with 6 runs (one run of this case spreads by +-4%, H200, 2026-12-02)
    inv     batch invariance (bench_invariance.run_invariance): 64 prompts x 256 greedy tokens, each first seen
            cold at concurrency 1, 24 or 32, then with prefix hits at 64, 5 and 1; differing tokens (target 0).
            Needs the run's prefix cache on (--engine LABEL:enable_prefix_caching=true)

--engine LABEL:key=value,... adds EngineConfig settings to every run with that label (values are JSON: true,
8192, "x"; anything else is a string), e.g. det:deterministic=true for the deterministic mode.

The roofline is the bytes one decode step reads (weights except the embedding table, plus the KV cache at the
mean context) over the read bandwidth measured in the same run. Writes server.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from envex.kernels.kv_quant_format import kv_bytes_per_token

SHAPES = {
    "llama8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=128001),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, tie_word_embeddings=False, torch_dtype="bfloat16",
                     eos_token_id=151645),
    # The published openai/gpt-oss-120b config.json: MXFP4 experts (dummy weights build them packed on the GPU).
    "gpt-oss-120b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, eos_token_id=200002,
        experts_per_token=4, head_dim=64, hidden_size=2880, initial_context_length=4096, intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072,
        num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=36, num_key_value_heads=8,
        num_local_experts=128, pad_token_id=199999, rms_norm_eps=1e-05, rope_theta=150000, sliding_window=128,
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                      "rope_type": "yarn", "truncate": False},
        swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088, torch_dtype="bfloat16"),
    # The published Qwen/Qwen3-Next-80B-A3B-Instruct config.json at 24 of its 48 layers (the 3:1 pattern of Gated
    # DeltaNet to gated attention kept): 80B in bf16 does not fit one H200, the half does (about 78 GB).
    "qwen3-next": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", attention_bias=False, decoder_sparse_step=1,
        eos_token_id=151645, full_attention_interval=4, head_dim=256, hidden_act="silu", hidden_size=2048,
        intermediate_size=5120, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_value_head_dim=128, max_position_embeddings=262144, mlp_only_layers=[],
        moe_intermediate_size=512, norm_topk_prob=True, num_attention_heads=16, num_experts=512,
        num_experts_per_tok=10, num_hidden_layers=24, num_key_value_heads=2, partial_rotary_factor=0.25,
        rms_norm_eps=1e-06, rope_scaling=None, rope_theta=10000000, shared_expert_intermediate_size=512,
        tie_word_embeddings=False, vocab_size=151936, torch_dtype="bfloat16"),
}  # fmt: skip
# Qwen/Qwen3-Next-80B-A3B-Instruct-FP8 at all 48 layers (about 80 GB: it fits one H200): the routed experts FP8 in
# 128 x 128 blocks and every other projection FP8 too (dummy weights build them so, as the runtime loads a release);
# the release's small projections left in float (offline_docs/quantization.md: the routers, the shared-expert gates
# and in_proj_ba).
SHAPES["qwen3-next-fp8"] = {**SHAPES["qwen3-next"], "num_hidden_layers": 48, "quantization_config": {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", *(f"model.layers.{i}.{m}" for i in range(48) for m in (
        "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba"))]}}  # fmt: skip
# Issue 44's MoE models, as their published config.json files state them (written from knowledge of those files;
# the values marked "unsure" are the ones not re-checked against the file). Qwen/Qwen3-30B-A3B: GQA with q/k norm,
# 128 experts, top-8, every layer sparse; 30.5B in bf16 fits one H200.
SHAPES["qwen3-30b-a3b"] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, bos_token_id=151643,
    decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=2048,
    intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
    moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
    num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000.0,
    sliding_window=None, tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936,
    torch_dtype="bfloat16")  # fmt: skip
# moonshotai/Moonlight-16B-A3B (DeepseekV3ForCausalLM): MLA without a q LoRA, one dense first layer, 64 routed experts
# top-6 plus 2 shared, sigmoid routing with the correction bias in one group; an 8K window (no rope scaling), so no
# 10K or 32K case. Unsure: rope_theta 50000 and rms_norm_eps 1e-5 (HF DeepseekV3Config's defaults are 10000 and
# 1e-6), bos/eos 163584/163585 and num_nextn_predict_layers 0 (no MTP module; HF's default 1 would be wrong).
SHAPES["moonlight"] = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=False, bos_token_id=163584,
    eos_token_id=163585, first_k_dense_replace=1, hidden_act="silu", hidden_size=2048, intermediate_size=11264,
    kv_lora_rank=512, max_position_embeddings=8192, moe_intermediate_size=1408, moe_layer_freq=1, n_group=1,
    n_routed_experts=64, n_shared_experts=2, norm_topk_prob=True, num_attention_heads=16, num_experts_per_tok=6,
    num_hidden_layers=27, num_key_value_heads=16, num_nextn_predict_layers=0, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, rms_norm_eps=1e-05, rope_scaling=None, rope_theta=50000.0, routed_scaling_factor=2.446,
    scoring_func="sigmoid", tie_word_embeddings=False, topk_group=1, topk_method="noaux_tc", v_head_dim=128,
    vocab_size=163840, torch_dtype="bfloat16")  # fmt: skip
# moonshotai/Kimi-K2-Instruct's width (DeepseekV3ForCausalLM; model_type kimi_k2 as published): MLA with a q LoRA,
# 384 routed experts top-8 plus 1 shared, FP8 in 128 x 128 blocks (the experts, shared one included, kept FP8; its
# other FP8 projections are dequantized to bf16 at load), at KIMI_K2_WIDTH_LAYERS of its 61 layers. Unsure: eos
# 163585 (its generation_config stops at 163586 too), rope_theta 50000 and the yarn parameters.
KIMI_K2_WIDTH_LAYERS = 7  # tests/test_verify_gpu_matrix.py counts why: the weights, the cache, the reserve
SHAPES["kimi-k2-width"] = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", attention_bias=False, bos_token_id=163584,
    eos_token_id=163585, first_k_dense_replace=1, hidden_act="silu", hidden_size=7168, intermediate_size=18432,
    kv_lora_rank=512, max_position_embeddings=131072, moe_intermediate_size=2048, moe_layer_freq=1, n_group=1,
    n_routed_experts=384, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=64, num_experts_per_tok=8,
    num_hidden_layers=KIMI_K2_WIDTH_LAYERS, num_key_value_heads=64, num_nextn_predict_layers=0, q_lora_rank=1536,
    qk_nope_head_dim=128, qk_rope_head_dim=64,
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [128, 128]},
    rms_norm_eps=1e-06, rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    rope_theta=50000.0, routed_scaling_factor=2.827, scoring_func="sigmoid", tie_word_embeddings=False,
    topk_group=1, topk_method="noaux_tc", v_head_dim=128, vocab_size=163840, torch_dtype="bfloat16")  # fmt: skip
CASES = {"b1_1k": (1, 1024, 256, 3), "b1_10k": (1, 10240, 512, 2), "c64_1k": (64, 1024, 256, 2),
         "c64_1k_x6": (64, 1024, 256, 6)}


def projection_bytes(n: int, k: int, scheme: str = "bf16") -> float:
    """Bytes of an n x k projection in a weights-policy scheme the GPU matrix serves (runtime/weight_policy.py),
    as kernels/quant.py stores it: the codes plus fp8_block's float32 a 128 x 128 block (fp8_block_rows: a row's
    128 inputs, the block (1, 128) a model's matrix takes where it gathers a release's rows across blocks),
    fp8_channel's float32 a row, int4 g128 asymmetric's bf16 scale and uint8 zero a group of 128 inputs."""
    blocks = -(-n // 128) * -(-k // 128)
    per_scheme = {"bf16": 2 * n * k, "fp8_block": n * k + 4 * blocks, "fp8_block_rows": n * k + 4 * n * -(-k // 128),
                  "fp8_channel": n * k + 4 * n, "int4_g128_asym": n * k / 2 + 3 * n * -(-k // 128)}  # fmt: skip
    return float(per_scheme[scheme])


def step_bytes(shape: dict, context: int, weights: str = "bf16", kv_cache_dtype: str = "bf16") -> float:
    """Bytes one batch-1 decode step reads: every weight but the embedding table (one row of it), bf16, plus the
    K and V of `context` cached tokens in every layer. weights: the projections' scheme (projection_bytes; Llama
    family only), the LM head and norms staying bf16 as a weights policy leaves them; kv_cache_dtype: the cache's
    format (kernels.kv_quant_format.kv_bytes_per_token, Llama family and Qwen3-MoE). The MoE models have functions
    of their own (gpt-oss, Qwen3-Next, Qwen3-MoE, DeepSeek-V3), which count the experts a step routes to as stored."""
    if shape["model_type"] == "gpt_oss":  # MoE, MXFP4 experts, window layers
        from envex.verify.lab.kernel_bench.bench_gpt_oss import step_bytes as gpt_oss_step_bytes

        return gpt_oss_step_bytes(shape, context)
    if shape["model_type"] == "qwen3_next":
        fp8 = (shape.get("quantization_config") or {}).get("quant_method") == "fp8"
        return qwen3_next_step_bytes(shape, context, fp8=fp8)
    arch = (shape.get("architectures") or [""])[0]
    if arch in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM") and weights != "bf16":
        raise ValueError(f"step_bytes: weights {weights!r} has no roofline for {arch}; its experts are counted as "
                         "its config stores them (bf16, or FP8 by its quantization_config)")  # fmt: skip
    if arch == "Qwen3MoeForCausalLM":
        return qwen3_moe_step_bytes(shape, context, kv_cache_dtype)
    if arch == "DeepseekV3ForCausalLM":
        if kv_cache_dtype != "bf16":
            raise ValueError(f"step_bytes: kv_cache_dtype {kv_cache_dtype!r} has no roofline for {arch}; its latent "
                             "cache is held in the model dtype (bf16)")  # fmt: skip
        return deepseek_step_bytes(shape, context)
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    projections = sum(projection_bytes(rows, cols, weights) for rows, cols in ((q + 2 * kv, h), (h, q), (2 * i, h),
                                                                              (h, i)))  # fmt: skip
    per_layer = 2 * h + (2 * d if shape["model_type"] == "qwen3" else 0)
    floats = n * per_layer + shape["vocab_size"] * h + 2 * h
    kv_token = kv_bytes_per_token(kv_cache_dtype, shape["num_key_value_heads"], d)
    return n * projections + 2.0 * floats + n * kv_token * context


def qwen3_next_step_bytes(shape: dict, context: int, fp8: bool = False) -> float:
    """Bytes one batch-1 decode step of Qwen3-Next reads: the full-attention layers' projections (q with its gate)
    and the K/V of `context` tokens, the Gated DeltaNet layers' projections, conv weights and float32 states (read
    once; written back too, not counted), and per layer the router, the top-k experts and the shared expert with its
    gate; the LM head and one embedding row. bf16 weights; fp8: an FP8 release as the runtime holds it
    (models/qwen3_next.py): the routed experts (_expert_bytes) and every other projection but the router, in_proj_ba
    and the shared-expert gate FP8 with a float32 scale a 128 x 128 block, or a row's 128 inputs where the model
    gathers rows across blocks (q/k/v's rotary permutation; in_proj_qkvz's head groups, the shared gate/up, where
    not whole blocks)."""
    h, n, d = shape["hidden_size"], shape["num_hidden_layers"], shape["head_dim"]
    full = n // shape["full_attention_interval"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    nk, nv = shape["linear_num_key_heads"], shape["linear_num_value_heads"]
    dk, dv, width = shape["linear_key_head_dim"], shape["linear_value_head_dim"], shape["linear_conv_kernel_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    inter, shared = shape["moe_intermediate_size"], shape["shared_expert_intermediate_size"]

    def proj(rows: int, cols: int, per_row: bool = False) -> float:
        return projection_bytes(rows, cols, ("fp8_block_rows" if per_row else "fp8_block") if fp8 else "bf16")

    attention = proj(2 * q + 2 * kv, h, per_row=True) + proj(h, q)
    qkvz_rows = bool(dk % 128 or nv // nk * dv % 128)
    linear = (proj(2 * key_dim + 2 * value_dim, h, per_row=qkvz_rows) + 2.0 * 2 * nv * h + proj(h, value_dim)
              + 2.0 * (2 * key_dim + value_dim) * width)  # fmt: skip
    moe = 2.0 * h * shape["num_experts"] + proj(2 * shared, h, per_row=bool(shared % 128)) + 2.0 * h + proj(h, shared)
    weights = full * attention + (n - full) * linear + n * moe + 2.0 * (shape["vocab_size"] * h + h)
    state = (n - full) * nv * dk * dv * 4
    expert = _expert_bytes(h, inter, fp8)
    return weights + 2.0 * full * 2 * kv * context + n * shape["num_experts_per_tok"] * expert + state


def _expert_bytes(hidden: int, inter: int, fp8: bool) -> float:
    """One SwiGLU expert's gate, up and down matrices as the runtime holds them (models/decoder.expert_stacks): bf16,
    or FP8 codes with a float32 scale a 128 x 128 block (projection_bytes' fp8_block)."""
    scheme = "fp8_block" if fp8 else "bf16"
    return projection_bytes(2 * inter, hidden, scheme) + projection_bytes(hidden, inter, scheme)


def qwen3_moe_step_bytes(shape: dict, context: int, kv_cache_dtype: str = "bf16") -> float:
    """Bytes one batch-1 decode step of Qwen3-MoE reads (models/qwen3_moe.py, bf16): each layer's q/k/v and o
    projections, q/k norms, two norms and router (bf16, as the runtime holds it), the top-k routed experts of each
    sparse layer (a dense one's MLP: mlp_only_layers, decoder_sparse_step), the K/V of `context` tokens in
    kv_cache_dtype (kv_bytes_per_token); the final norm, the LM head and one embedding row."""
    h, n, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    d, kv_heads = shape.get("head_dim") or h // heads, shape["num_key_value_heads"]
    step = shape.get("decoder_sparse_step", 1)
    dense = sum(i in (shape.get("mlp_only_layers") or []) or (i + 1) % step > 0 for i in range(n))
    attention = h * (heads + 2 * kv_heads) * d + heads * d * h + 2 * d + 2 * h
    router = shape["num_experts"] * h
    weights = 2.0 * (n * attention + (n - dense) * router + dense * 3 * h * shape["intermediate_size"]
                     + shape["vocab_size"] * h + 2 * h)  # fmt: skip
    experts = (n - dense) * shape["num_experts_per_tok"] * _expert_bytes(h, shape["moe_intermediate_size"], False)
    return weights + experts + n * kv_bytes_per_token(kv_cache_dtype, kv_heads, d) * context


def deepseek_step_bytes(shape: dict, context: int) -> float:
    """Bytes one batch-1 decode step of a DeepSeek-V3-architecture model reads (models/deepseek.py): each layer's
    MLA projections (q_a_proj with its norm and q_b_proj, or q_proj; kv_a_proj_with_mqa with its norm; kv_b_proj,
    whose per-head halves decode absorbs; o_proj) and two norms in bf16; the first_k_dense_replace layers' dense MLP;
    each MoE layer's float32 router and correction bias, its top-k routed experts and its shared experts, bf16 or, where
    the config's quantization_config is "fp8", FP8 in 128 x 128 blocks (the runtime keeps experts so and dequantizes
    every other FP8 projection to bf16 at load: runtime/packed_load.py); the latent cache of `context` tokens, one row
    of kv_lora_rank + qk_rope_head_dim bf16 values a token and layer (DeepseekV3ForCausalLM.make_kv_caches); the
    final norm, the LM head and one embedding row."""
    h, n, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    rank, rope = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    nope, v = shape["qk_nope_head_dim"], shape["v_head_dim"]
    q_out, q_lora = heads * (nope + rope), shape.get("q_lora_rank")
    q = h * q_out if q_lora is None else h * q_lora + q_lora + q_lora * q_out  # q_proj, or q_a, its norm and q_b
    attention = q + h * (rank + rope) + rank + heads * (nope + v) * rank + heads * v * h + 2 * h
    dense = shape.get("first_k_dense_replace", 3)
    quant = shape.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8"
    if fp8 and quant.get("weight_block_size", [128, 128]) != [128, 128]:
        raise ValueError(f"step_bytes: FP8 blocks {quant['weight_block_size']} have no roofline; [128, 128] has")
    experts = shape["num_experts_per_tok"] + shape["n_shared_experts"]
    moe = 4.0 * shape["n_routed_experts"] * (h + 1) + experts * _expert_bytes(h, shape["moe_intermediate_size"], fp8)
    weights = 2.0 * (n * attention + dense * 3 * h * shape["intermediate_size"] + shape["vocab_size"] * h + 2 * h)
    return weights + (n - dense) * moe + 2.0 * n * (rank + rope) * context


def write_model_dir(path: Path, shape: dict, *, weights: bool) -> None:
    """config.json and a word-level tokenizer (token i is "t{i}"); with weights, a random bf16 checkpoint."""
    if (path / "config.json").is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    if weights:
        import torch
        import transformers

        cfg = {k: v for k, v in shape.items() if k not in ("architectures", "model_type", "torch_dtype")}
        config = transformers.LlamaConfig(**cfg)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = transformers.LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
        model.save_pretrained(path, safe_serialization=True, max_shard_size="4GB")
        del model
        torch.cuda.empty_cache()
    (path / "config.json").write_text(json.dumps(shape))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


LAUNCH = """
import json, sys
from envex.runtime.engine.config import EngineConfig
from envex.runtime.server.serve import serve
serve(EngineConfig(**json.loads(sys.argv[1])), host="127.0.0.1", port=int(sys.argv[2]))
"""


def start_server(tree: str, settings: dict, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"}
    out = log.open("w")
    return subprocess.Popen([sys.executable, "-c", LAUNCH, json.dumps(settings), str(port)], env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """End a start_server child and everything in its process group (tensor-parallel ranks too): SIGTERM, then
    SIGKILL if it has not exited within `timeout` seconds."""
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=timeout)
    except ProcessLookupError:  # already gone
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 400.0) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError("server not ready in time")


async def one_stream(client, base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = -1
    async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"start": t0, "end": end, "stamps": stamps, "tokens": tokens}


async def run_case(base: str, model: str, batch: int, prompt_len: int, out_len: int, seed: int) -> dict:
    import random

    import httpx

    rng = random.Random(seed)
    vocab = 30000  # ids every shape's vocabulary has
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=batch + 4)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, base, model, p, out_len) for p in prompts))
        wall = time.perf_counter() - t0
    counts = [r["tokens"] for r in results]
    usage = out_len if all(n == out_len for n in counts) else -1  # the served counts must hold (ignore_eos)
    first = results[0]
    ttft = first["stamps"][0] - first["start"] if first["stamps"] else float("nan")
    decode = (first["stamps"][-1] - first["stamps"][0]) if len(first["stamps"]) > 1 else float("nan")
    return {"wall_s": wall, "ttft_ms": ttft * 1e3, "decode_s": decode, "chunks": len(first["stamps"]),
            "completion_tokens": usage, "output_tok_s": batch * usage / wall,
            "decode_tok_s": (usage - 1) / decode if decode == decode and decode > 0 else float("nan")}  # fmt: skip


def engine_settings(specs: list[str]) -> dict[str, dict]:
    """--engine LABEL:key=value,... -> {label: {key: value}}; a value is JSON where it parses, else a string."""
    out: dict[str, dict] = {}
    for spec in specs:
        label, _, pairs = spec.partition(":")
        for pair in filter(None, pairs.split(",")):
            key, _, value = pair.partition("=")
            try:
                out.setdefault(label, {})[key] = json.loads(value)
            except json.JSONDecodeError:
                out.setdefault(label, {})[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--runs", required=True, help="label:shape=tree,... (tree: a folder holding envex/)")
    ap.add_argument("--cases", default="b1_1k,b1_10k,c64_1k")
    ap.add_argument("--models", type=Path, default=Path("/tmp/envex-models"))
    ap.add_argument("--checkpoint", default="old", help="labels whose tree needs weights on disk")
    ap.add_argument("--engine", action="append", default=[], help="LABEL:key=value,... EngineConfig settings")
    args = ap.parse_args()
    engine = engine_settings(args.engine)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from envex.verify.lab.kernel_bench import _bench_lib as B

    bw = B.measure_bandwidth()
    report: dict = {"env": {"device": torch.cuda.get_device_name(), "commit": args.commit, "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": " ".join(sys.argv)},
                    "bandwidth": bw, "runs": []}  # fmt: skip
    print(json.dumps(report["env"]), bw, flush=True)
    torch.cuda.empty_cache()
    needs_weights = set(args.checkpoint.split(","))
    for i, spec in enumerate(args.runs.split(",")):
        label_shape, tree = spec.split("=")
        label, shape_name = label_shape.split(":")
        shape = SHAPES[shape_name]
        weights = label in needs_weights
        model_dir = args.models / (shape_name + ("-ckpt" if weights else ""))
        t0 = time.monotonic()
        write_model_dir(model_dir, shape, weights=weights)
        settings = {"model": str(model_dir), "max_model_len": 12288, "enable_prefix_caching": False}
        if not weights:
            settings["load_format"] = "dummy"
        settings.update(engine.get(label, {}))
        run = {"label": label, "shape": shape_name, "tree": tree, "write_s": time.monotonic() - t0, "cases": {},
               "settings": settings}
        port = 18000 + i
        base = f"http://127.0.0.1:{port}"
        proc = start_server(tree, settings, port, args.out / f"server-{label}-{shape_name}.log")
        try:
            run["ready_s"] = wait_ready(base, proc)
            import httpx

            served = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
            for case in args.cases.split(","):
                if case == "inv":
                    from envex.verify.lab.kernel_bench.bench_invariance import run_invariance

                    run["invariance"] = asyncio.run(run_invariance(base, served))
                    inv = run["invariance"]
                    print(f"{label:>5} {shape_name:>9}     inv: {inv['differing_tokens']} of {inv['compared_tokens']} "
                          "tokens differ", flush=True)
                    continue
                batch, prompt_len, out_len, reps = CASES[case]
                rows = [asyncio.run(run_case(base, served, batch, prompt_len, out_len, seed=r))
                        for r in range(reps + 1)][1:]  # the first is the warm-up
                ok = [r for r in rows if r["completion_tokens"] == out_len]
                key = "decode_tok_s" if batch == 1 else "output_tok_s"
                context = prompt_len + out_len // 2
                roof = bw["read_TBps"] * 1e12 / step_bytes(shape, context)
                med = statistics.median(r[key] for r in ok) if ok else float("nan")
                run["cases"][case] = {"rows": rows, "median": med, "metric": key, "roofline_tok_s": roof,
                                      "share_of_roofline": med / roof if batch == 1 else None,
                                      "ttft_ms": statistics.median(r["ttft_ms"] for r in ok) if ok else None}
                print(f"{label:>5} {shape_name:>9} {case:>7}: {key} {med:8.1f}  (roofline {roof:.1f})", flush=True)
        except Exception as exc:  # one failed run must not lose the others
            run["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{label} {shape_name}: {run['error']}", flush=True)
        finally:
            stop_server(proc)
        report["runs"].append(run)
        (args.out / "server.json").write_text(json.dumps(report, indent=1))
    print(f"\nread bandwidth {bw['read_TBps']:.3f} TB/s (best of a Triton read sweep and torch sum)")
    for run in report["runs"]:
        if "invariance" in run:
            inv = run["invariance"]
            print(f"{run['label']:>5} {run['shape']:>9}     inv {inv['differing_tokens']:>6} of "
                  f"{inv['compared_tokens']} tokens differ from each prompt's first answer")
        for case, c in run["cases"].items():
            share = f"{100 * c['share_of_roofline']:.1f}%" if c["share_of_roofline"] else "-"
            print(f"{run['label']:>5} {run['shape']:>9} {case:>7} {c['metric']:>13} {c['median']:9.1f} "
                  f"roof {share:>6} ttft {c['ttft_ms'] or 0:8.1f} ms")


if __name__ == "__main__":
    main()
