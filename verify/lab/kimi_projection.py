"""Kimi K2 (61 layers) split over N GPUs at batch 1: the bytes a decode step reads on the busiest GPU, the weights a
GPU holds, and the tokens/s they allow. perf_table renders it beside the `kimi-k2-width` cell (the model's width at
KIMI_K2_WIDTH_LAYERS of its layers on one GPU), whose measured share of its byte roofline it carries over.

Envex splits neither attention nor experts of this architecture yet (offline_docs/mla.md, "Not yet"); the split
assumed is what vLLM and SGLang do for DeepSeek-V3 with tensor parallelism (TP) and expert parallelism (EP):

- attention: q_b_proj, kv_b_proj (by heads) and o_proj split 1/N; q_a_proj, kv_a_proj_with_mqa and the norms are
  replicated (every GPU's heads need their whole outputs);
- the latent cache is replicated: a token has one latent row shared by all heads, so a GPU's heads read all of it;
- the dense layers' MLP and the shared expert split 1/N; the router and its bias replicated (every GPU routes);
- the routed experts whole, n_routed_experts / N a GPU. A layer ends with a collective, so it waits for the GPU
  that runs the most of its top-k: the step's bytes count, in each MoE layer, the expected most (expected_busiest,
  under uniform routing; real routing's skew tends to raise it);
- the LM head split by vocabulary; the embedding row (on one GPU) and the final norm counted whole.

Bytes as the runtime holds the weights (bench_server.deepseek_step_bytes, which this equals at N = 1): routed and
shared experts FP8 in 128 x 128 blocks, the router float32, everything else bf16, the latent cache bf16.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from math import comb
from pathlib import Path
from typing import Any

from envex.verify.lab.kernel_bench.bench_server import CASES, SHAPES, _expert_bytes

# The published moonshotai/Kimi-K2-Instruct config.json: the width cell's shape (bench_server.SHAPES, which carries
# the published values: hidden 7168, first_k_dense_replace 1, 384 routed experts top-8 + 1 shared, MLA with q LoRA
# 1536, vocabulary 163840) at the published depth, 61 layers.
KIMI_K2: dict[str, Any] = {**SHAPES["kimi-k2-width"], "num_hidden_layers": 61}
GPU_COUNTS = (8, 16)
# The batch-1 1K case's mean context (1K prompt, 256 out), as gpu_matrix.timed_case counts its roofline.
CONTEXT = CASES["b1_1k"][1] + CASES["b1_1k"][2] // 2
# The product page's claim for Kimi K2 on GB200, as the issue quotes it; a claim, not a measurement of ours.
GB200_CLAIM_TOK_S = 335.0


def expected_busiest(experts: int, top_k: int, gpus: int) -> Fraction:
    """The expected largest number of a token's routed experts that one GPU runs, when `experts` are spread evenly
    over `gpus` and the top_k are distinct and uniformly random (real routing is skewed: this is the even case).
    Exact: the sum over k >= 1 of P(max >= k), where the choices with at most k on every GPU are the coefficient of
    x^top_k in (sum over j <= k of C(experts / gpus, j) x^j) ^ gpus."""
    per, total = experts // gpus, comb(experts, top_k)
    if per * gpus != experts:
        raise ValueError(f"expected_busiest: {experts} experts do not split evenly over {gpus} GPUs")

    def at_most(k: int) -> int:
        poly = [1] + [0] * top_k  # choices by how many experts so far
        for _ in range(gpus):
            poly = [sum(poly[i - j] * comb(per, j) for j in range(min(k, i) + 1)) for i in range(top_k + 1)]
        return poly[top_k]

    return sum((Fraction(total - at_most(k - 1), total) for k in range(1, top_k + 1)), Fraction(0))


def _gpu_bytes(shape: dict, gpus: int, routed: float, embedding_rows: float, context: int) -> float:
    """Bytes on one of `gpus` GPUs: `routed` experts a MoE layer, `embedding_rows` of the table, `context` tokens
    of latent cache (the module docstring says what is split and how)."""
    h, n, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    rank, rope, nope, v = (shape[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    q_lora = shape["q_lora_rank"]
    split = q_lora * heads * (nope + rope) + heads * (nope + v) * rank + heads * v * h  # q_b, kv_b, o
    whole = h * q_lora + q_lora + h * (rank + rope) + rank + 2 * h  # q_a and its norm, kv_a and its norm, 2 norms
    dense = shape["first_k_dense_replace"]
    fp8 = (shape.get("quantization_config") or {}).get("quant_method") == "fp8"
    inter = shape["moe_intermediate_size"]
    moe = (4.0 * shape["n_routed_experts"] * (h + 1) + routed * _expert_bytes(h, inter, fp8)
           + shape["n_shared_experts"] * _expert_bytes(h, inter // gpus, fp8))  # fmt: skip
    weights = 2.0 * (n * (split / gpus + whole) + dense * 3 * h * shape["intermediate_size"] / gpus
                     + shape["vocab_size"] * h / gpus + embedding_rows * h + h)  # fmt: skip
    return weights + (n - dense) * moe + 2.0 * n * (rank + rope) * context


def gpu_step_bytes(shape: dict, context: int, gpus: int) -> float:
    """Bytes one batch-1 decode step at `context` cached tokens reads on the busiest GPU of `gpus`: per MoE layer
    the expected busiest GPU's routed experts (expected_busiest), the rest as the module docstring splits it."""
    busiest = expected_busiest(shape["n_routed_experts"], shape["num_experts_per_tok"], gpus)
    return _gpu_bytes(shape, gpus, float(busiest), 1, context)


def gpu_weight_bytes(shape: dict, gpus: int) -> float:
    """The weights one of `gpus` GPUs holds: its n_routed_experts / gpus experts a layer, its share of the rest."""
    return _gpu_bytes(shape, gpus, shape["n_routed_experts"] / gpus, shape["vocab_size"] / gpus, 0)


def collectives(shape: dict) -> int:
    """Collectives a decode step waits on: two a layer (after attention's o_proj, and the MoE's or MLP's combine)
    and one for the LM head's vocabulary shards."""
    return 2 * shape["num_hidden_layers"] + 1


def projected_tok_s(step_bytes: float, read_TBps: float, share: float, waits: int = 0, wait_us: float = 0.0) -> float:
    """Tokens/s of a step that reads `step_bytes` at `share` of `read_TBps` and then waits `waits` x `wait_us`."""
    return 1.0 / (step_bytes / (read_TBps * 1e12 * share) + waits * wait_us * 1e-6)


def measured_allreduce(results: Path, nbytes: int) -> tuple[float, str] | None:
    """The one-shot all-reduce's latency in a CUDA graph (µs) at the smallest size of at least `nbytes`, from the
    newest tensor-parallel bench in `results` (`*-tp.json`, bench_tp: two GPUs), with its file name; None if none."""

    def by_date(path: Path) -> tuple[str, str]:
        date = re.search(r"\d{4}-\d\d-\d\d", path.name)
        return (date[0] if date else "", path.name)

    for path in sorted(results.glob("*-tp.json"), key=by_date, reverse=True):
        sizes = ((json.loads(path.read_text(encoding="utf-8")).get("ranks") or {}).get("ar") or {}).get("sizes")
        fits = [s for s in sizes or [] if s.get("bytes", 0) >= nbytes and s.get("custom_graph_us") is not None]
        if fits:
            return float(min(fits, key=lambda s: s["bytes"])["custom_graph_us"]), path.name
    return None
