"""The n-gram prompt-lookup kernel (kernels/ngram.py) against the torch ngram_propose and the reference rule
propose_ngram (kernels/reference.py): equal drafts (every element, including those past the count, which the
verify step feeds to the model) and counts, on the interpreter on CPU; and its sm_90 build."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from envex.kernels import ngram
from envex.kernels.reference import ngram_propose, propose_ngram
from envex.runtime.engine.spec.drafters import NgramDrafter, SpecInputs
from envex.tests.support.kernels import compile_for_hopper

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _history(seqs: list[list[int]], width: int, stale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hist [len(seqs) + 1, width] with each sequence in a row, stale tokens after it (what a row holds after
    rejected drafts) and a last, padding row; and each row's length (0 for the padding row)."""
    g = torch.Generator().manual_seed(stale)
    hist = torch.randint(0, 50, (len(seqs) + 1, width), generator=g, dtype=torch.int64)
    for i, s in enumerate(seqs):
        hist[i, :len(s)] = torch.tensor(s)
    lens = torch.tensor([len(s) for s in seqs] + [0])
    return hist.to(DEV), lens.to(DEV)


def _check(hist: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, k: int, *, max_ngram: int, window: int,
           block: int) -> None:  # fmt: skip
    drafts, count = ngram.ngram_propose(hist, rows, lens, k, max_ngram=max_ngram, window=window, block=block)
    want_drafts, want_count = ngram_propose(hist, rows, lens, k, max_ngram=max_ngram, window=window)
    assert drafts.dtype == count.dtype == torch.int64 and drafts.shape == (rows.shape[0], k)
    assert torch.equal(count, want_count), (count, want_count)
    assert torch.equal(drafts, want_drafts), (drafts, want_drafts)
    for b, row in enumerate(rows.tolist()):
        tokens = hist[row, :int(lens[b])].tolist()
        want = propose_ngram(tokens, k, max_ngram=max_ngram, window=window)
        assert drafts[b, :int(count[b])].tolist() == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=90), min_size=1, max_size=4),
       st.integers(1, 6), st.sampled_from([1, 2, 3, 4]), st.sampled_from([3, 16, 40, 2048]),
       st.sampled_from([4, 16, 1024]), st.integers(0, 2), st.randoms(use_true_random=False))  # fmt: skip
def test_equals_the_torch_drafter_and_the_reference(seqs: list[list[int]], k: int, max_ngram: int, window: int,
                                                   block: int, extra: int, rnd) -> None:  # fmt: skip
    """Small vocabulary so matches happen at every n; lengths below and above the window; several tiles (block <
    window); rows in any order, repeated, and the padding row; rows wider than the longest sequence by `extra`."""
    width = max(len(s) for s in seqs) + extra
    hist, lens = _history(seqs, width, stale=len(seqs) * 7 + k)
    rows = list(range(len(seqs) + 1)) + [rnd.randrange(len(seqs) + 1)]
    rnd.shuffle(rows)
    rows_t = torch.tensor(rows, device=DEV)
    _check(hist, rows_t, lens[rows_t], k, max_ngram=max_ngram, window=window, block=block)


@pytest.mark.parametrize("length", [1500, 2047, 2048, 2049, 3000])
def test_default_window_over_long_histories(length: int) -> None:
    """The shipped shape: window 2048 in two tiles of 1024, histories shorter and longer than it. Row 0's only
    earlier trigram of its last tokens starts at the window's first position; row 1's starts one before it (outside
    where the history is longer than the window), so the bigram in the middle wins there."""
    g = torch.Generator().manual_seed(length)
    seqs = []
    for shift in (0, 1):
        seq = torch.randint(10, 40_000, (length,), generator=g)
        seq[-3:] = torch.tensor([1, 2, 3])
        far = max(0, length - 2048 - shift)
        seq[far:far + 3] = torch.tensor([1, 2, 3])
        seq[length // 2:length // 2 + 2] = torch.tensor([2, 3])
        seqs.append(seq.tolist())
    hist, lens = _history([*seqs, seqs[0][:length // 3]], length + 8, stale=1)
    rows = torch.tensor([0, 1, 2, 3], device=DEV)
    _check(hist, rows, lens, 8, max_ngram=3, window=2048, block=ngram.BLOCK)
    _, count = ngram.ngram_propose(hist, rows, lens, 8, max_ngram=3, window=2048)
    assert count[:2].tolist() == [8, 8]  # each row found a match (the check above says which)


def test_the_drafter_writes_the_same_drafts_on_either_path() -> None:
    """NgramDrafter.propose (the kernel where the tensors are on a GPU, torch elsewhere) writes the rule's drafts,
    and counts capped by each row's k_limit (a padding row, -1, proposes nothing)."""
    hist, lens = _history([[5, 1, 2, 3, 9, 1, 2, 3], [4, 4, 4, 4], [7, 8]], 16, stale=4)
    rows = torch.tensor([0, 1, 2, 3], device=DEV)
    x = SpecInputs(hist=hist, lens=lens, rows=rows, k_limit=torch.tensor([4, 1, 4, -1], device=DEV),
                   block_tables=torch.zeros(4, 1, dtype=torch.int32, device=DEV),
                   drafts=torch.zeros(4, 4, dtype=torch.int64, device=DEV),
                   num_drafts=torch.zeros(4, dtype=torch.int64, device=DEV))  # fmt: skip
    x.seq_lens.copy_(lens[rows])
    NgramDrafter().propose(x)
    want, _ = ngram_propose(hist, rows, x.seq_lens, 4)
    assert torch.equal(x.drafts, want)
    assert x.num_drafts.tolist() == [4, 1, 0, 0] and x.drafts[0].tolist() == [9, 1, 2, 3]


def test_limit_and_out_buffers() -> None:
    """The verify graph's form: counts capped by max(limit, 0) inside the kernel, written into given buffers (the
    step's drafts and num_drafts) with nothing returned fresh."""
    hist, lens = _history([[5, 1, 2, 3, 9, 1, 2, 3], [4, 4, 4, 4, 4, 4], [7, 8]], 16, stale=5)
    rows = torch.tensor([0, 1, 2, 3, 1], device=DEV)
    limit = torch.tensor([2, 8, 3, -1, 0], device=DEV)
    drafts = torch.full((5, 4), -7, dtype=torch.int64, device=DEV)
    count = torch.full((5,), -7, dtype=torch.int64, device=DEV)
    got = ngram.ngram_propose(hist, rows, lens[rows], 4, max_ngram=3, window=16, limit=limit, out=(drafts, count))
    assert got[0].data_ptr() == drafts.data_ptr() and got[1].data_ptr() == count.data_ptr()
    want_drafts, want_count = ngram_propose(hist, rows, lens[rows], 4, max_ngram=3, window=16)
    assert torch.equal(drafts, want_drafts)
    assert torch.equal(count, torch.minimum(want_count, limit.clamp(min=0)))
    assert count.tolist()[:2] == [2, 1] and count.tolist()[3:] == [0, 0]  # row 1: only 4,4,4 at 2..4 precedes
    with pytest.raises(ValueError, match="out: drafts must be contiguous int64"):
        ngram.ngram_propose(hist, rows, lens[rows], 4, max_ngram=3, window=16, out=(drafts[:, :3], count))
    with pytest.raises(ValueError, match="limit: shape"):
        ngram.ngram_propose(hist, rows, lens[rows], 4, max_ngram=3, window=16, limit=limit[:2])


def test_int32_rows_and_lens_empty_batch_and_k0() -> None:
    hist, lens = _history([[1, 2, 1, 2, 1], [3, 3, 3]], 12, stale=2)
    rows = torch.tensor([1, 0, 2], dtype=torch.int32, device=DEV)
    _check(hist, rows, lens[rows.long()].to(torch.int32), 4, max_ngram=3, window=16, block=4)
    drafts, count = ngram.ngram_propose(hist, rows, lens[rows.long()], 0, max_ngram=3, window=16)
    assert drafts.shape == (3, 0) and count.tolist() == [0, 0, 0]
    drafts, count = ngram.ngram_propose(hist, rows[:0], lens[:0], 4, max_ngram=3, window=16)
    assert drafts.shape == (0, 4) and count.shape == (0,)


def test_rejects_bad_input() -> None:
    hist, lens = _history([[1, 2, 1]], 4, stale=3)
    rows = torch.tensor([0], device=DEV)
    with pytest.raises(ValueError, match="hist: dtype torch.int32"):
        ngram.ngram_propose(hist.int(), rows, lens[:1], 2, max_ngram=3, window=8)
    with pytest.raises(ValueError, match="lens: shape"):
        ngram.ngram_propose(hist, rows, lens, 2, max_ngram=3, window=8)
    with pytest.raises(ValueError, match="block: 12"):
        ngram.ngram_propose(hist, rows, lens[:1], 2, max_ngram=3, window=8, block=12)


# Compiles the shipped configuration for sm_90 without a GPU (Triton's bundled ptxas): two tiles of 1024 candidate
# ends over the 2048 window at 4 warps must not spill to local memory.
_AOT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import ngram

sig = dict(hist_ptr="*i64", rows_ptr="*i64", lens_ptr="*i64", drafts_ptr="*i64", count_ptr="*i64", limit_ptr="*i64",
           width="i32", stride_h="i32", window="i32", k="i32")
consts = dict(MAX_NGRAM=3, BLOCK=ngram.BLOCK, NUM_TILES=2, BLOCK_K=8, KEY_SHIFT=ngram._KEY_SHIFT, HAS_LIMIT=True)
sig.update({c: "constexpr" for c in consts})
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n.endswith("_ptr")}
k = triton.compile(ASTSource(fn=ngram._ngram_kernel, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = k.asm["ptx"]
print(json.dumps({"local": len(re.findall(r"(?:ld|st)\.local", ptx)), "cubin": len(k.asm["cubin"])}))
"""


def test_the_kernel_compiles_for_hopper_without_spills() -> None:
    got = compile_for_hopper(_AOT)
    assert got["cubin"] > 0 and got["local"] == 0, got
