"""Paged attention (decode, chunked prefill, prefix reuse, split-K) and rotary + KV write against torch references."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit of envex.kernels

from envex.kernels import attention, rotary  # noqa: E402
from envex.kernels import reference as ref  # noqa: E402
from envex.kernels.testing import assert_close, f64  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _paged_batch(seq_lens: list[int], q_lens: list[int], n_q: int, n_kv: int, head_dim: int, page: int,
                 dtype: torch.dtype, seed: int = 0):  # fmt: skip
    """A random paged cache whose sequences own shuffled blocks, plus packed queries for the last q_len tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // page) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, page, n_kv, head_dim, generator=g).to(dtype).to(DEV)
    v_cache = torch.randn(num_blocks, page, n_kv, head_dim, generator=g).to(dtype).to(DEV)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(blocks_per_seq) + 2
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g)  # unused entries arbitrary
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[used : used + nb]
        used += nb
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), n_q, head_dim, generator=g).to(dtype).to(DEV)
    return (q, k_cache, v_cache, cu.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
            tables.to(torch.int32).to(DEV))  # fmt: skip


CASES = {
    # name: (seq_lens, q_lens)
    "decode": ([1, 17, 40, 64], [1, 1, 1, 1]),
    "prefill": ([9, 33], [9, 33]),
    "chunk_after_prefix": ([50, 21], [13, 5]),  # chunked prefill / prefix reuse: keys before the chunk are cached
    "mixed": ([30, 1, 45], [30, 1, 1]),  # a prefill next to decodes, as continuous batching schedules them
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (6, 2), (8, 2), (8, 1)])  # GQA ratios 1, 3, 4, 8
@pytest.mark.parametrize("page", [8, 16])
def test_paged_attention_bf16(case: str, n_q: int, n_kv: int, page: int) -> None:
    seq_lens, q_lens = CASES[case]
    q, kc, vc, cu, sl, bt = _paged_batch(seq_lens, q_lens, n_q, n_kv, 64, page, torch.bfloat16)
    expect = ref.paged_attention(*f64(q, kc, vc), cu, sl, bt, 0.125)
    out = attention.paged_attention(q, kc, vc, cu, sl, bt, 0.125, max_q_len=max(q_lens), max_seq_len=max(seq_lens))
    assert out.shape == q.shape
    assert_close(f"attention[{case}]", out, expect, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_splits_dtypes(num_splits: int, dtype: torch.dtype, head_dim: int) -> None:
    seq_lens, q_lens = [3, 70, 129], [1, 1, 1]
    q, kc, vc, cu, sl, bt = _paged_batch(seq_lens, q_lens, 8, 2, head_dim, 32, dtype, seed=num_splits)
    scale = head_dim**-0.5
    out = attention.paged_attention(q, kc, vc, cu, sl, bt, scale, max_q_len=1, max_seq_len=129, num_splits=num_splits)
    assert_close("attention splits", out, ref.paged_attention(*f64(q, kc, vc), cu, sl, bt, scale), dtype)


def test_paged_attention_split_prefill_matches_unsplit() -> None:
    q, kc, vc, cu, sl, bt = _paged_batch([40, 23], [7, 23], 4, 2, 64, 8, torch.float32, seed=3)
    a = attention.paged_attention(q, kc, vc, cu, sl, bt, 0.125, max_q_len=23, max_seq_len=40, num_splits=1)
    b = attention.paged_attention(q, kc, vc, cu, sl, bt, 0.125, max_q_len=23, max_seq_len=40, num_splits=3,
                                  block_m=16, block_n=16)  # fmt: skip
    assert_close("split prefill", b, a, torch.float32)
    # block_n=16 puts whole unmasked tiles before the diagonal of the 7-token chunk after a 33-token prefix
    assert_close("prefill small tiles", b, ref.paged_attention(*f64(q, kc, vc), cu, sl, bt, 0.125), torch.float32)


def test_paged_attention_rejects_bad_gqa() -> None:
    q, kc, vc, cu, sl, bt = _paged_batch([4], [1], 6, 4, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="not a multiple of 4 KV heads"):
        attention.paged_attention(q, kc, vc, cu, sl, bt, 0.125, max_q_len=1, max_seq_len=4)


def _rope(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return freqs.cos().to(DEV), freqs.sin().to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_q,n_kv,head_dim", [(4, 4, 64), (6, 2, 64), (8, 1, 128), (3, 3, 32)])
@pytest.mark.parametrize("page", [8, 32])
def test_rotary_and_store_kv(dtype: torch.dtype, n_q: int, n_kv: int, head_dim: int, page: int) -> None:
    tokens = 7
    # q, k, v as views of one fused QKV output, the layout the model hands over.
    qkv = torch.randn(tokens, (n_q + 2 * n_kv) * head_dim, device=DEV).to(dtype)
    q = qkv[:, : n_q * head_dim].view(tokens, n_q, head_dim)
    k = qkv[:, n_q * head_dim : (n_q + n_kv) * head_dim].view(tokens, n_kv, head_dim)
    v = qkv[:, (n_q + n_kv) * head_dim :].view(tokens, n_kv, head_dim)
    cos, sin = _rope(300, head_dim)
    positions = torch.tensor([0, 5, 299, 17, 1, 128, 64], device=DEV)
    slots = torch.tensor([3, 2 * page + 1, -1, 4 * page - 1, 0, page, 3 * page + 2], device=DEV)  # -1: padding
    shape = (5, page, n_kv, head_dim)
    kc, vc = torch.full(shape, 7.0, device=DEV).to(dtype), torch.full(shape, 7.0, device=DEV).to(dtype)
    kc_ref, vc_ref = kc.double(), vc.double()
    q_rot, k_rot = rotary.rotary_and_store_kv(q, k, v, positions, cos, sin, kc, vc, slots)
    q_ref, k_ref = ref.rotary_and_store_kv(*f64(q, k, v), positions, *f64(cos, sin), kc_ref, vc_ref, slots)
    assert_close("q_rot", q_rot, q_ref, dtype)
    assert_close("k_rot", k_rot, k_ref, dtype)
    assert_close("k_cache", kc, kc_ref, dtype)
    assert_close("v_cache", vc, vc_ref, dtype)
    untouched = torch.ones(5 * page, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert (kc.view(5 * page, -1)[untouched.to(DEV)] == 7.0).all(), "only the mapped slots may be written"


def test_rotary_rejects_wrong_cos_width() -> None:
    q = torch.randn(2, 4, 64, device=DEV)
    k = v = torch.randn(2, 2, 64, device=DEV)
    cos, sin = _rope(10, 32)
    kc = vc = torch.zeros(2, 8, 2, 64, device=DEV)
    with pytest.raises(ValueError, match="cos: last dim 16 != head_dim/2 = 32"):
        rotary.rotary_and_store_kv(q, k, v, torch.zeros(2, dtype=torch.long, device=DEV), cos, sin, kc, vc,
                                   torch.zeros(2, dtype=torch.long, device=DEV))  # fmt: skip
