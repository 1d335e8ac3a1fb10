"""Paged attention (decode, chunked prefill, prefix reuse, split-K) and rotary + KV write against torch references."""

import pytest
import torch

from envex.kernels import attention, decode_attention, rotary
from envex.kernels import reference as ref
from envex.kernels.accuracy import rel_err
from envex.tests.support.kernels import assert_close, f64

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


def _decode_step_inputs(positions: list[int], n_q: int, n_kv: int, head_dim: int, page: int, dtype: torch.dtype,
                        steps: int, seed: int = 0):  # fmt: skip
    """Random caches with shuffled block tables that hold each sequence's positions up to position + steps - 1,
    and rope tables. Slots are derived per step by _slots."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(p + steps - 1) // page + 1 for p in positions]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = torch.randn(num_blocks, page, n_kv, head_dim, generator=g).to(dtype).to(DEV)
    v_cache = torch.randn(num_blocks, page, n_kv, head_dim, generator=g).to(dtype).to(DEV)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(positions), max(blocks_per_seq) + 1), num_blocks - 1)  # unused entries arbitrary
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[used : used + nb]
        used += nb
    cos, sin = _rope(max(positions) + steps, head_dim)
    return k_cache, v_cache, tables.to(torch.int32).to(DEV), cos, sin


def _slots(tables: torch.Tensor, pos: torch.Tensor, page: int, padding: list[int]) -> torch.Tensor:
    slots = tables.gather(1, (pos // page)[:, None])[:, 0].long() * page + pos % page
    slots[padding] = -1  # padding rows of a graph batch: nothing may be written
    return slots


# Positions of the new token: length 1, a sequence ending exactly on a block boundary (after the first step),
# odd lengths, and a padding row (index 2) whose slot is -1.
DECODE_POSITIONS, DECODE_PADDING = [0, 15, 9, 22], [2]


@pytest.mark.parametrize("n_q,n_kv,page,num_splits,merge_in_kernel", [
    (2, 2, 8, 1, True), (8, 2, 16, 1, False),  # GQA 1 and 4, one split: no partials, no counters
    (4, 2, 16, 3, False), (4, 2, 8, 3, True),  # the merge as a second launch and in the last program
    (8, 2, 8, 5, True), (2, 2, 16, 8, True),  # more splits than a short sequence has keys: empty splits
])  # fmt: skip
def test_decode_attention_fused_matches_reference(n_q: int, n_kv: int, page: int, num_splits: int,
                                                  merge_in_kernel: bool) -> None:  # fmt: skip
    """Two decode steps reusing one counter buffer: outputs and cache writes against the float64 reference
    (rotary, store, attention), padding rows write nothing, counters are back at zero after every launch."""
    dtype, head_dim, steps = torch.bfloat16, 32, 2
    kc, vc, tables, cos, sin = _decode_step_inputs(DECODE_POSITIONS, n_q, n_kv, head_dim, page, dtype, steps)
    kc0, vc0 = kc.clone(), vc.clone()
    kc_ref, vc_ref = kc.double(), vc.double()
    batch = len(DECODE_POSITIONS)
    active = [b for b in range(batch) if b not in DECODE_PADDING]
    counters = decode_attention.new_split_counters(batch, n_kv, DEV)
    pos = torch.tensor(DECODE_POSITIONS, device=DEV)
    written = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        qkv = torch.randn(batch, (n_q + 2 * n_kv) * head_dim, generator=g).to(dtype).to(DEV)
        slots = _slots(tables, pos, page, DECODE_PADDING)
        written += slots[slots >= 0].tolist()
        out = torch.full((batch, n_q, head_dim), float("nan"), dtype=dtype, device=DEV)
        partials = (torch.full((num_splits, batch, n_q, head_dim), float("nan"), device=DEV),
                    torch.full((num_splits, batch, n_q), float("nan"), device=DEV))  # fmt: skip
        got = decode_attention.decode_attention_fused(
            qkv, pos, slots, cos, sin, kc, vc, tables, head_dim**-0.5, num_heads=n_q, num_kv_heads=n_kv,
            max_seq_len=int(pos.max()) + 1, num_splits=num_splits, merge_in_kernel=merge_in_kernel,
            counters=counters, out=out, partials=partials,
        )  # fmt: skip
        assert got.data_ptr() == out.data_ptr()
        want = ref.decode_attention_fused(*f64(qkv), pos, slots, *f64(cos, sin), kc_ref, vc_ref, tables,
                                          head_dim**-0.5, n_q, n_kv)  # fmt: skip
        assert_close(f"decode fused step {step}", out[active], want[active], dtype)
        assert (counters == 0).all(), "the merging program must leave every counter at zero"
        pos = pos + 1
    assert_close("k_cache", kc, kc_ref, dtype)
    assert_close("v_cache", vc, vc_ref, dtype)
    untouched = torch.ones(kc.shape[0] * page, dtype=torch.bool, device=DEV)
    untouched[written] = False
    for name, c, c0 in (("k_cache", kc, kc0), ("v_cache", vc, vc0)):
        flat, flat0 = c.view(-1, n_kv * head_dim), c0.view(-1, n_kv * head_dim)
        assert torch.equal(flat[untouched], flat0[untouched]), f"{name}: a slot outside the active rows' changed"
        assert not torch.equal(flat[~untouched], flat0[~untouched]), f"{name}: the active rows' slots not written"


# A verify step's first new positions (the sequence's newest token), and how many of its q_len tokens are real:
# all, a prefix (drafts past the row's limit: slot -1), a padding sequence (index 2: nothing real), and long
# sequences whose keys span several 64-key splits (position 64: the first new key opens a split of its own).
VERIFY_FIRST, VERIFY_REAL = [0, 15, 9, 21, 64, 130, 70], [5, 2, 0, 5, 1, 4, 3]


@pytest.mark.parametrize("q_len,n_q,n_kv,page,num_splits,window,sinks,qk_norm", [
    (5, 8, 2, 8, 1, None, False, False), (5, 8, 2, 16, 3, None, False, False),  # one split; three, each with keys
    (2, 4, 2, 8, 8, None, False, False),  # splits past a short sequence's keys (empty), a real prefix at q_len 2
    (5, 8, 2, 8, 2, 6, True, False), (5, 8, 2, 8, 4, 3, True, False),  # gpt-oss's window and sinks; window < q_len
    (5, 4, 2, 8, 2, None, False, True),  # Qwen3's q/k norm
])  # fmt: skip
def test_decode_attention_fused_verify_rows(q_len: int, n_q: int, n_kv: int, page: int, num_splits: int,
                                            window: int | None, sinks: bool, qk_norm: bool) -> None:  # fmt: skip
    """q_len new tokens a sequence (a speculative verify step) in the fused kernel: every real row equals the
    float64 composition (rotary + store, then causal paged attention), the real tokens' K/V are written and no
    other slot changes."""
    dtype, head_dim = torch.bfloat16, 32
    kc, vc, tables, cos, sin = _decode_step_inputs(VERIFY_FIRST, n_q, n_kv, head_dim, page, dtype, q_len, seed=11)
    kc0, vc0 = kc.clone(), vc.clone()
    kc_ref, vc_ref = kc.double(), vc.double()
    batch = len(VERIFY_FIRST)
    pos = (torch.tensor(VERIFY_FIRST)[:, None] + torch.arange(q_len)[None, :]).reshape(-1).to(DEV)
    real = (torch.arange(q_len)[None, :] < torch.tensor(VERIFY_REAL)[:, None].clamp(max=q_len)).reshape(-1).to(DEV)
    slots = tables.repeat_interleave(q_len, 0).gather(1, (pos // page)[:, None])[:, 0].long() * page + pos % page
    slots = torch.where(real, slots, -1)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(batch * q_len, (n_q + 2 * n_kv) * head_dim, generator=g).to(dtype).to(DEV)
    s = (torch.randn(n_q, generator=g) * 2).to(DEV) if sinks else None
    qn, kn = (1 + 0.5 * torch.randn(2, head_dim, generator=g)).to(dtype).to(DEV) if qk_norm else (None, None)
    got = decode_attention.decode_attention_fused(
        qkv, pos, slots, cos, sin, kc, vc, tables, head_dim**-0.5, num_heads=n_q, num_kv_heads=n_kv,
        max_seq_len=int(pos.max()) + 1, num_splits=num_splits, sinks=s, window=window, q_len=q_len, q_norm=qn,
        k_norm=kn,
    )  # fmt: skip
    want = ref.decode_attention_fused(*f64(qkv), pos, slots, *f64(cos, sin), kc_ref, vc_ref, tables,
                                      head_dim**-0.5, n_q, n_kv, sinks=None if s is None else s.double(),
                                      window=window, q_len=q_len, q_norm=None if qn is None else qn.double(),
                                      k_norm=None if kn is None else kn.double())  # fmt: skip
    assert_close(f"verify rows (q_len {q_len}, {num_splits} splits)", got[real], want[real], dtype)
    assert_close("k_cache", kc, kc_ref, dtype)
    assert_close("v_cache", vc, vc_ref, dtype)
    written = torch.zeros(kc.shape[0] * page, dtype=torch.bool, device=DEV)
    written[slots[real]] = True
    for name, c, c0 in (("k_cache", kc, kc0), ("v_cache", vc, vc0)):
        flat, flat0 = c.view(-1, n_kv * head_dim), c0.view(-1, n_kv * head_dim)
        assert torch.equal(flat[~written], flat0[~written]), f"{name}: a slot outside the real rows' changed"
        assert (flat[written] != flat0[written]).any(dim=1).all(), f"{name}: a real row's slot not written"
    with pytest.raises(ValueError, match="q_len: 3 must be an int ≥ 1 that divides qkv's"):
        decode_attention.decode_attention_fused(qkv[:-1], pos[:-1], slots[:-1], cos, sin, kc, vc, tables, 0.1,
                                                num_heads=n_q, num_kv_heads=n_kv, max_seq_len=32, q_len=3)  # fmt: skip
    big = decode_attention.MAX_QUERY_ROWS // (n_q // n_kv) + 1  # one token more than a program's tile holds
    with pytest.raises(ValueError, match="query rows per KV head > 64; run a step this long through"):
        decode_attention.decode_attention_fused(qkv[:1].expand(big, -1), torch.arange(big, device=DEV),
                                                torch.full((big,), -1, device=DEV), cos, sin, kc, vc, tables[:1], 0.1,
                                                num_heads=n_q, num_kv_heads=n_kv, max_seq_len=big,
                                                q_len=big)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_q,n_kv,num_splits", [(4, 2, 1), (8, 2, 3)])
def test_decode_attention_fused_with_qk_norm(dtype: torch.dtype, n_q: int, n_kv: int, num_splits: int) -> None:
    """Qwen3: each q and k head RMS-normed (its own weights) before the rotation, inside the fused kernel."""
    head_dim, page = 32, 8
    kc, vc, tables, cos, sin = _decode_step_inputs(DECODE_POSITIONS, n_q, n_kv, head_dim, page, dtype, 1, seed=3)
    kc_ref, vc_ref = kc.double(), vc.double()
    batch = len(DECODE_POSITIONS)
    active = [b for b in range(batch) if b not in DECODE_PADDING]
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(batch, (n_q + 2 * n_kv) * head_dim, generator=g) * 3).to(dtype).to(DEV)
    qn, kn = (1 + 0.5 * torch.randn(2, head_dim, generator=g)).to(dtype).to(DEV)
    pos = torch.tensor(DECODE_POSITIONS, device=DEV)
    slots = _slots(tables, pos, page, DECODE_PADDING)
    got = decode_attention.decode_attention_fused(
        qkv, pos, slots, cos, sin, kc, vc, tables, head_dim**-0.5, num_heads=n_q, num_kv_heads=n_kv,
        max_seq_len=int(pos.max()) + 1, num_splits=num_splits, merge_in_kernel=False, q_norm=qn, k_norm=kn,
        norm_eps=1e-6,
    )  # fmt: skip
    want = ref.decode_attention_fused(*f64(qkv), pos, slots, *f64(cos, sin), kc_ref, vc_ref, tables, head_dim**-0.5,
                                      n_q, n_kv, q_norm=qn.double(), k_norm=kn.double(), norm_eps=1e-6)  # fmt: skip
    assert_close("decode fused qk-norm", got[active], want[active], dtype)
    assert_close("k_cache qk-norm", kc, kc_ref, dtype)
    with pytest.raises(ValueError, match="q_norm/k_norm: pass both or neither"):
        decode_attention.decode_attention_fused(qkv, pos, slots, cos, sin, kc, vc, tables, 0.1, num_heads=n_q,
                                                num_kv_heads=n_kv, max_seq_len=32, q_norm=qn)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_fused_equals_unfused_path(dtype: torch.dtype) -> None:
    """The fused kernel against the kernels it replaces (rotary_and_store_kv, then paged_attention + merge) on the
    same inputs: identical cache contents, and outputs equal up to summation order."""
    n_q, n_kv, head_dim, page = 8, 2, 64, 16
    positions = [31, 4, 40]  # 32 keys end on a block boundary
    kc, vc, tables, cos, sin = _decode_step_inputs(positions, n_q, n_kv, head_dim, page, dtype, 1, seed=5)
    kc2, vc2 = kc.clone(), vc.clone()
    pos = torch.tensor(positions, device=DEV)
    slots = _slots(tables, pos, page, [])
    qkv = torch.randn(3, (n_q + 2 * n_kv) * head_dim, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEV)
    fused = decode_attention.decode_attention_fused(qkv, pos, slots, cos, sin, kc, vc, tables, 0.125, num_heads=n_q,
                                                    num_kv_heads=n_kv, max_seq_len=41, num_splits=2)  # fmt: skip
    q = qkv[:, : n_q * head_dim].view(3, n_q, head_dim)
    k = qkv[:, n_q * head_dim : (n_q + n_kv) * head_dim].view(3, n_kv, head_dim)
    v = qkv[:, (n_q + n_kv) * head_dim :].view(3, n_kv, head_dim)
    q_rot, _ = rotary.rotary_and_store_kv(q, k, v, pos, cos, sin, kc2, vc2, slots)
    cu = torch.arange(4, dtype=torch.int32, device=DEV)
    unfused = attention.paged_attention(q_rot, kc2, vc2, cu, (pos + 1).to(torch.int32), tables, 0.125, max_q_len=1,
                                        max_seq_len=41, num_splits=2)  # fmt: skip
    if dtype == torch.bfloat16 or DEV == "cpu":
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    else:  # float32 on a GPU: the two kernels' rotations may contract to FMAs differently (last-ulp differences)
        assert torch.equal(vc, vc2) and rel_err(kc, kc2) < 1e-6
    # float32 on a GPU: both kernels' tl.dot run in tf32, with different summation orders
    assert rel_err(fused, unfused) < (4e-3 if dtype == torch.bfloat16 else 1e-5 if DEV == "cpu" else 2e-3)


def test_decode_attention_fused_rejects_short_counters() -> None:
    kc, vc, tables, cos, sin = _decode_step_inputs([3, 5], 4, 2, 32, 8, torch.float32, 1)
    pos = torch.tensor([3, 5], device=DEV)
    with pytest.raises(ValueError, match="counters: 2 entries < batch·Hkv = 4"):
        decode_attention.decode_attention_fused(
            torch.zeros(2, 8 * 32, device=DEV), pos, _slots(tables, pos, 8, []), cos, sin, kc, vc, tables, 0.1,
            num_heads=4, num_kv_heads=2, max_seq_len=6, num_splits=2,
            counters=torch.zeros(2, dtype=torch.int32, device=DEV),
        )  # fmt: skip
