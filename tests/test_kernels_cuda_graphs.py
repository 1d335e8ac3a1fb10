"""Decode graphs (runtime/engine/cuda_graphs.py): ladder choice, padding rows, and agreement with batch-1 steps.

On CPU the step runs eagerly under the Triton interpreter (capture=False); on a GPU it is captured and replayed.
"""

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit of envex.kernels

from envex.kernels.accuracy import rel_err  # noqa: E402
from envex.runtime.config import ModelConfig  # noqa: E402
from envex.runtime.engine.cuda_graphs import DecodeGraphs, graph_ladder  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip
PAGE = 8


def _setup(dtype: torch.dtype = torch.float32):
    config = ModelConfig.from_hf(HF_CONFIG)
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, std: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype).to(DEV)

    h, d = config.hidden_size, config.head_dim
    layers = [SimpleNamespace(
        input_layernorm_weight=1 + w(h), post_attention_layernorm_weight=1 + w(h),
        qkv_proj_weight=w((4 + 2 * 2) * d, h), o_proj_weight=w(h, 4 * d),
        gate_up_proj_weight=w(2 * 96, h), down_proj_weight=w(h, 96)) for _ in range(2)]  # fmt: skip
    model = SimpleNamespace(embed_tokens_weight=w(40, h, std=1.0), layers=layers, norm_weight=1 + w(h),
                            lm_head_weight=w(40, h))  # fmt: skip
    caches = [(w(12, PAGE, 2, d, std=1.0), w(12, PAGE, 2, d, std=1.0)) for _ in range(2)]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(128).float()[:, None] * inv[None, :]
    return config, model, caches, freqs.cos().to(DEV), freqs.sin().to(DEV)


def test_graph_ladder() -> None:
    assert graph_ladder(1) == (1,)
    assert graph_ladder(20) == (1, 2, 4, 8, 16, 20)
    assert graph_ladder(64)[-3:] == (32, 48, 64)
    with pytest.raises(ValueError, match="max_batch"):
        graph_ladder(0)


def test_padded_batch_matches_single_steps_and_writes_only_its_slots() -> None:
    config, model, caches, cos, sin = _setup()
    graphs = DecodeGraphs(model, config, caches, cos, sin, max_batch=4, max_model_len=64, capture=DEV.type == "cuda")
    assert graphs.sizes == (1, 2, 4)
    tables = [[3, 7], [1], [5, 2, 9]]
    positions = [10, 5, 17]  # each sequence's cached keys 0..pos-1 are the random cache contents
    ids = [4, 11, 29]
    before = [(k.clone(), v.clone()) for k, v in caches]
    batched = graphs.run(ids, positions, tables).clone()  # B=3 runs the B=4 graph with one padding row
    assert batched.shape == (3, 40)
    slots = {t[p // PAGE] * PAGE + p % PAGE for t, p in zip(tables, positions, strict=True)}
    for (k, _), (k0, _) in zip(caches, before, strict=True):
        rows = (k != k0).reshape(-1, k.shape[2] * k.shape[3]).any(1)  # [num_blocks * PAGE]: slot written?
        changed = set(rows.nonzero().flatten().tolist())
        assert changed == slots, "only the three real tokens' slots may be written"
    for row in range(3):  # each sequence alone through the batch-1 (GEMV) step sees the same cache
        single = graphs.run([ids[row]], [positions[row]], [tables[row]])
        assert rel_err(single, batched[row : row + 1]) < 1e-3


def test_run_chunks_takes_only_pure_decode_steps() -> None:
    config, model, caches, cos, sin = _setup()
    graphs = DecodeGraphs(model, config, caches, cos, sin, max_batch=2, max_model_len=64, capture=DEV.type == "cuda")

    def chunk(start: int, n: int, prompt_len: int) -> SimpleNamespace:
        seq = SimpleNamespace(prompt_token_ids=list(range(prompt_len)),
                              output_token_ids=list(range(prompt_len, start + n)), block_table=[0, 1, 2])  # fmt: skip
        return SimpleNamespace(seq=seq, start=start, num_tokens=n, completes=True)

    assert graphs.run_chunks([chunk(6, 1, 5)]).shape == (1, 40)
    assert graphs.run_chunks([chunk(0, 5, 5)]) is None  # prefill
    assert graphs.run_chunks([chunk(6, 1, 5)] * 3) is None  # more than the largest graph
    with pytest.raises(ValueError, match="largest captured decode graph takes 2"):
        graphs.run([1, 2, 3], [1, 1, 1], [[0]] * 3)
