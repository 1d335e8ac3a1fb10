"""The fused decode step (GEMV path and cuBLAS path) and Triton prefill against a dense float64 Llama forward."""

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit of envex.kernels

from envex.kernels import reference as ref  # noqa: E402
from envex.kernels.accuracy import rel_err  # noqa: E402
from envex.kernels.fused_decode import DecodeShape, DecodeState, FusedDecoder, prefill  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPE = DecodeShape(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, eps=1e-5)
INTER, VOCAB, LAYERS, PAGE = 96, 50, 2, 8


def _model(dtype: torch.dtype) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    s = SHAPE

    def w(*shape: int, std: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype).to(DEV)

    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    layers = [
        SimpleNamespace(
            input_layernorm_weight=1 + w(s.hidden_size), post_attention_layernorm_weight=1 + w(s.hidden_size),
            qkv_proj_weight=w(qkv, s.hidden_size), o_proj_weight=w(s.hidden_size, s.num_heads * s.head_dim),
            gate_up_proj_weight=w(2 * INTER, s.hidden_size), down_proj_weight=w(s.hidden_size, INTER),
        )  # fmt: skip
        for _ in range(LAYERS)
    ]
    return SimpleNamespace(embed_tokens_weight=w(VOCAB, s.hidden_size, std=1.0), layers=layers,
                           norm_weight=1 + w(s.hidden_size), lm_head_weight=w(VOCAB, s.hidden_size))  # fmt: skip


def _dense_logits(model: SimpleNamespace, ids: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain float64 Llama forward over the whole sequence -> logits of the last token."""
    s = SHAPE
    m = SimpleNamespace(**{k: v for k, v in vars(model).items()})
    t = len(ids)
    pos = torch.arange(t, device=DEV)
    x = m.embed_tokens_weight.double()[torch.tensor(ids, device=DEV)]
    group = s.num_heads // s.num_kv_heads
    q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for layer in m.layers:
        normed = ref.rms_norm(x, layer.input_layernorm_weight.double(), s.eps)
        qkv = normed @ layer.qkv_proj_weight.double().t()
        q = ref.rotary(qkv[:, :q_size].view(t, s.num_heads, s.head_dim), pos, cos.double(), sin.double())
        k = ref.rotary(qkv[:, q_size : q_size + kv_size].view(t, -1, s.head_dim), pos, cos.double(), sin.double())
        v = qkv[:, q_size + kv_size :].view(t, -1, s.head_dim)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * s.head_dim**-0.5
        scores = scores.masked_fill(torch.ones(t, t, device=DEV).triu(1).bool(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, q_size)
        x = x + attn @ layer.o_proj_weight.double().t()
        normed = ref.rms_norm(x, layer.post_attention_layernorm_weight.double(), s.eps)
        x = x + ref.silu_and_mul(normed @ layer.gate_up_proj_weight.double().t()) @ layer.down_proj_weight.double().t()
    return ref.rms_norm(x[-1:], m.norm_weight.double(), s.eps) @ m.lm_head_weight.double().t()


# The default (fused attention, merge kernel) runs in test_kernels_cuda_graphs.py.
@pytest.mark.parametrize("use_gemv,fuse,merge", [
    (True, False, False),  # the unfused chain: rotary + KV write, attention, merge kernel
    (True, True, True),  # everything in one attention launch, splits merged by the last program
    (False, True, True),  # the cuBLAS path with the fused attention
])  # fmt: skip
def test_prefill_then_graph_free_greedy_decode_matches_dense(use_gemv: bool, fuse: bool, merge: bool) -> None:
    dtype = torch.float32  # fp32 so greedy picks are stable and errors reflect the kernels, not rounding
    model = _model(dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, SHAPE.head_dim, 2).float() / SHAPE.head_dim))
    freqs = torch.arange(64).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    caches = [(torch.zeros(8, PAGE, 2, 16, dtype=dtype, device=DEV), torch.zeros(8, PAGE, 2, 16, dtype=dtype,
               device=DEV)) for _ in range(LAYERS)]  # fmt: skip
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9]  # 11 tokens: crosses a block boundary
    table = torch.tensor([[6, 2, 5, 0]], dtype=torch.int32, device=DEV)
    positions = torch.arange(len(prompt), device=DEV)
    slots = (table[0, positions // PAGE].long() * PAGE + positions % PAGE).to(DEV)
    n = len(prompt)
    logits = prefill(model, SHAPE, caches, cos, sin, torch.tensor(prompt, device=DEV), positions, slots,
                     torch.tensor([0, n], dtype=torch.int32, device=DEV),
                     torch.tensor([n], dtype=torch.int32, device=DEV), table, n, n)  # fmt: skip
    assert rel_err(logits, _dense_logits(model, prompt, cos, sin)) < 2e-3

    decoder = FusedDecoder(model, SHAPE, caches, cos, sin, use_gemv=use_gemv, fuse_rotary_attention=fuse,
                           merge_splits_in_kernel=merge)  # fmt: skip
    state = DecodeState(1, table.shape[1], DEV)
    state.block_tables.copy_(table)
    state.input_ids.fill_(int(logits.argmax()))
    state.positions.fill_(n)
    out = torch.zeros(1, 4, dtype=torch.int64, device=DEV)
    step = torch.zeros(1, dtype=torch.int64, device=DEV)
    seq = prompt + [int(logits.argmax())]
    for i in range(4):
        want = _dense_logits(model, seq, cos, sin)
        got = decoder.forward(state, num_splits=2, max_seq_len=32)
        assert rel_err(got, want) < 2e-3, f"step {i}"
        decoder.greedy_step(state, 2, 32, out, step)
        assert int(out[0, i]) == int(want.argmax())
        seq.append(int(out[0, i]))
    assert int(step) == 4 and int(state.positions) == n + 4
    if merge:  # one buffer for every layer and step, back at zero after each launch
        assert (decoder._split_counters[1] == 0).all()
