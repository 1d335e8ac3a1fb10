"""gpt-oss attention: per-head sinks and a sliding window in the paged attention kernels (prefill, chunked prefill,
decode, key splits) and in the fused decode kernel, against the float64 reference; the reference itself against
HF's eager definition (a dense mask plus a concatenated sink column)."""

import pytest
import torch

from envex.kernels import attention, decode_attention
from envex.kernels import reference as ref
from envex.tests.support.kernels import assert_close, f64
from envex.tests.test_kernels_attention import _decode_step_inputs, _paged_batch, _slots

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {  # (seq_lens, q_lens): decode, prefill, a chunk after cached keys, a prefill beside decodes
    "decode": ([1, 17, 40, 64], [1, 1, 1, 1]),
    "prefill": ([9, 33], [9, 33]),
    "chunk_after_prefix": ([50, 21], [13, 5]),
    "mixed": ([30, 1, 45], [30, 1, 1]),
}


def _sinks(n_q: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n_q, generator=torch.Generator().manual_seed(seed)) * 2).to(DEV)


def test_reference_equals_hf_eager_definition() -> None:
    """HF GptOssAttention (eager): scores + mask (causal, and kv > q - window), a sink column concatenated per head,
    softmax, the sink dropped. One dense sequence of 11 tokens whose cache spans three blocks of 4."""
    n_q, n_kv, d, window = 4, 2, 16, 5
    q, kc, vc, cu, sl, bt = _paged_batch([11], [11], n_q, n_kv, d, 4, torch.float64, seed=2)
    sinks = _sinks(n_q).double()
    got = ref.paged_attention(q, kc, vc, cu, sl, bt, 0.25, sinks=sinks, window=window)
    keys = kc[bt[0, :3].long()].reshape(-1, n_kv, d)[:11].repeat_interleave(n_q // n_kv, 1)  # [11, Hq, D]
    vals = vc[bt[0, :3].long()].reshape(-1, n_kv, d)[:11].repeat_interleave(n_q // n_kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.25
    qi, ki = torch.arange(11, device=DEV)[:, None], torch.arange(11, device=DEV)[None, :]
    scores = scores.masked_fill((ki > qi) | (ki <= qi - window), float("-inf"))
    combined = torch.cat([scores, sinks[:, None, None].expand(n_q, 11, 1)], dim=-1)
    probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
    want = torch.einsum("hqk,khd->qhd", probs, vals)
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window,sinks", [(None, True), (6, False), (6, True), (20, True)])
def test_paged_attention_sinks_window(case: str, window: int | None, sinks: bool) -> None:
    seq_lens, q_lens = CASES[case]
    n_q, n_kv = 8, 2
    q, kc, vc, cu, sl, bt = _paged_batch(seq_lens, q_lens, n_q, n_kv, 64, 8, torch.bfloat16)
    s = _sinks(n_q) if sinks else None
    want = ref.paged_attention(*f64(q, kc, vc), cu, sl, bt, 0.125, sinks=None if s is None else s.double(),
                               window=window)  # fmt: skip
    out = attention.paged_attention(q, kc, vc, cu, sl, bt, 0.125, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
                                    sinks=s, window=window)  # fmt: skip
    assert_close(f"attention[{case}, window {window}, sinks {sinks}]", out, want, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_paged_attention_sinks_window_split(num_splits: int) -> None:
    """Key splits: the sink joins split 0 only; with a window the splits share the window's keys, not the whole
    sequence's (a split may then hold no visible key)."""
    seq_lens, q_lens = [3, 70, 129], [1, 1, 2]
    q, kc, vc, cu, sl, bt = _paged_batch(seq_lens, q_lens, 8, 2, 64, 16, torch.float32, seed=num_splits)
    s = _sinks(8, seed=1)
    for window in (None, 24):
        want = ref.paged_attention(*f64(q, kc, vc), cu, sl, bt, 0.125, sinks=s.double(), window=window)
        out = attention.paged_attention(q, kc, vc, cu, sl, bt, 0.125, max_q_len=2, max_seq_len=129,
                                        num_splits=num_splits, sinks=s, window=window)  # fmt: skip
        assert_close(f"split attention window {window}", out, want, torch.float32)


def _fused_against_float64(label: str, positions: list[int], n_q: int, n_kv: int, head_dim: int, page: int, *,
                           seed: int, sinks: torch.Tensor, window: int | None = None, **launch) -> None:
    """The fused decode kernel on random bf16 caches and QKV rows (one new token a sequence at `positions`) against
    the float64 reference: the outputs and the written caches. launch: decode_attention_fused's launch arguments."""
    kc, vc, tables, cos, sin = _decode_step_inputs(positions, n_q, n_kv, head_dim, page, torch.bfloat16, 1, seed=seed)
    kc_ref, vc_ref = kc.double(), vc.double()
    pos = torch.tensor(positions, device=DEV)
    slots = _slots(tables, pos, page, [])
    qkv = torch.randn(len(positions), (n_q + 2 * n_kv) * head_dim, generator=torch.Generator().manual_seed(seed + 1))
    qkv = qkv.to(torch.bfloat16).to(DEV)
    got = decode_attention.decode_attention_fused(
        qkv, pos, slots, cos, sin, kc, vc, tables, head_dim**-0.5, num_heads=n_q, num_kv_heads=n_kv, sinks=sinks,
        window=window, **launch,
    )  # fmt: skip
    want = ref.decode_attention_fused(*f64(qkv), pos, slots, *f64(cos, sin), kc_ref, vc_ref, tables, head_dim**-0.5,
                                      n_q, n_kv, sinks=sinks.double(), window=window)  # fmt: skip
    assert_close(label, got, want, torch.bfloat16)
    assert_close(f"{label}: k_cache", kc, kc_ref, torch.bfloat16)


@pytest.mark.parametrize("window", [None, 4, 16])
@pytest.mark.parametrize("num_splits,merge_in_kernel", [(1, False), (3, True)])
def test_decode_attention_fused_sinks_window(window: int | None, num_splits: int, merge_in_kernel: bool) -> None:
    _fused_against_float64(f"decode fused window {window}", [0, 15, 9, 22, 40], 8, 2, 32, 8, seed=4,
                           sinks=_sinks(8, seed=3), window=window, max_seq_len=41, num_splits=num_splits,
                           merge_in_kernel=merge_in_kernel)  # fmt: skip


def test_attention_rejects_bad_sinks_and_window() -> None:
    q, kc, vc, cu, sl, bt = _paged_batch([5], [5], 4, 2, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="sinks: 3 entries for 4 query heads"):
        attention.paged_attention(q, kc, vc, cu, sl, bt, 0.1, max_q_len=5, max_seq_len=5,
                                  sinks=torch.zeros(3, device=DEV))  # fmt: skip
    with pytest.raises(ValueError, match="window: 0 must be a positive number"):
        attention.paged_attention(q, kc, vc, cu, sl, bt, 0.1, max_q_len=5, max_seq_len=5, window=0)


@pytest.mark.parametrize("window", [None, 128])
def test_attention_at_gpt_oss_120b_dims(window: int | None) -> None:
    """gpt-oss-120b's exact heads (64 q, 8 kv, head_dim 64), its window 128 and sinks, pages of 16: the fused decode
    kernel at positions past the window (its own split count, as TritonOps passes for window layers) and the paged
    kernel on a prefill chunk that starts past the window, against float64."""
    n_q, n_kv, head_dim, page = 64, 8, 64, 16
    s = _sinks(n_q, seed=7)
    _fused_against_float64(f"decode fused 120b dims, window {window}", [130, 300], n_q, n_kv, head_dim, page, seed=8,
                           sinks=s, window=window, max_seq_len=301, num_splits=None, merge_in_kernel=False)  # fmt: skip

    seq_lens, q_lens = [170], [24]
    q, kc, vc, cu, sl, bt = _paged_batch(seq_lens, q_lens, n_q, n_kv, head_dim, page, torch.bfloat16, seed=10)
    want = ref.paged_attention(*f64(q, kc, vc), cu, sl, bt, head_dim**-0.5, sinks=s.double(), window=window)
    out = attention.paged_attention(q, kc, vc, cu, sl, bt, head_dim**-0.5, max_q_len=24, max_seq_len=170, sinks=s,
                                    window=window)  # fmt: skip
    assert_close(f"paged attention 120b dims, window {window}", out, want, torch.bfloat16)


def test_decode_splits_of_64_keys_with_128_key_tiles() -> None:
    """A graph captured for long sequences takes 128-key tiles (decode_attention_fused: splits of 2K keys or more
    on 64-wide heads); a short sequence still splits its keys in multiples of 64, so half-masked tiles must give
    the 64-key tiles' answer: 300 keys over 8 splits, sinks on."""
    g = torch.Generator().manual_seed(12)
    hq, hkv, d, page, keys = 8, 2, 64, 16, 300
    blocks = -(-(keys + 1) // page)
    kc = torch.randn(blocks, page, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    vc = torch.randn(blocks, page, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    table = torch.randperm(blocks, generator=g).to(torch.int32)[None].to(DEV)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16).to(DEV)
    pos = torch.tensor([keys], device=DEV)
    slot = (table[0, keys // page].long() * page + keys % page)[None]
    ang = torch.arange(keys + 1)[:, None].float() * 10000.0 ** -(torch.arange(d // 2) / (d // 2))[None]
    sinks = torch.randn(hq, generator=g).to(DEV)
    outs = []
    for block_n in (64, 128):
        k2, v2 = kc.clone(), vc.clone()
        outs.append(decode_attention.decode_attention_fused(
            qkv, pos, slot, ang.cos().to(DEV), ang.sin().to(DEV), k2, v2, table, d**-0.5, num_heads=hq,
            num_kv_heads=hkv, max_seq_len=keys + 1, num_splits=8, merge_in_kernel=False, block_n=block_n,
            sinks=sinks))  # fmt: skip
    assert_close("128-key tiles on 64-key splits", outs[1], outs[0].double(), torch.bfloat16)


def test_decode_attention_fused_long_tile_chooses_per_split() -> None:
    """A launch built with 128-key tiles (splits of ≥ LONG_SPLIT_KEYS keys on 64-wide heads, as a graph captured for
    131K takes) runs a split of SHORT_SPLIT_KEYS keys or more with the 128-key loop and a shorter one with the
    64-key loop. Both loops give the same values, so this checks that each is right inside one launch, not which
    one ran: one sequence whose first split holds 1,088 keys (128-key loop) and second 1,012 plus the new key (64),
    two short ones, with sinks, against float64."""
    # keys / splits = LONG_SPLIT_KEYS: a long launch
    _fused_against_float64("decode fused, per-split tile", [2100, 70, 5], 4, 2, 64, 16, seed=12,
                           sinks=_sinks(4, seed=14), max_seq_len=2 * attention.LONG_SPLIT_KEYS, num_splits=2)
