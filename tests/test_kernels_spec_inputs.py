"""The verify step's inputs in one kernel (kernels/spec_inputs.py) against the torch composition it replaces
(reference.verify_inputs): equal ids, positions, cache slots, lengths and capped draft counts, element for
element, on the interpreter on CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from envex.kernels import reference, spec_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _step(lens: list[int], k: int, limits: list[int], proposed: list[int], page: int, max_len: int, seed: int):
    """A history with one row per sequence plus a padding row (length 2), batch rows in shuffled order, random
    drafts, and block tables wide enough for every position below max_len."""
    g = torch.Generator().manual_seed(seed)
    width = max_len + k + 2
    hist = torch.randint(0, 1000, (len(lens) + 1, width), generator=g)
    all_lens = torch.tensor(lens + [2])
    rows = torch.randperm(len(lens) + 1, generator=g)
    batch = rows.shape[0]
    tables = torch.randint(0, 500, (batch, -(-(width) // page)), generator=g, dtype=torch.int32)
    drafts = torch.randint(0, 1000, (batch, k), generator=g)
    k_limit = torch.tensor(limits + [-1])[rows]  # the padding row has limit -1
    num_drafts = torch.minimum(torch.tensor(proposed + [0])[rows], k_limit.clamp(min=0))
    seq_lens = all_lens[rows]
    return [t.to(DEV) for t in (hist, rows, seq_lens, drafts, num_drafts, k_limit, tables)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 4, 16]), st.integers(8, 40), st.data())
def test_equals_the_torch_composition(k: int, page: int, max_len: int, data) -> None:
    """Lengths from 1 to max_len + 2 (drafts past the context are cut; a step chained past a finishing sequence's end
    writes nothing), limits -1..k, proposals 0..k."""
    n = data.draw(st.integers(1, 4))
    lens = data.draw(st.lists(st.integers(1, max_len + 2), min_size=n, max_size=n))
    limits = data.draw(st.lists(st.integers(-1, k), min_size=n, max_size=n))
    proposed = data.draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    args = _step(lens, k, limits, proposed, page, max_len, seed=sum(lens) + k)
    hist, rows, seq_lens, drafts, num_drafts, k_limit, tables = args
    want_nd = num_drafts.clone()
    want = reference.verify_inputs(hist, rows, seq_lens, drafts, want_nd, k_limit, tables, block_size=page,
                               max_model_len=max_len)  # fmt: skip
    got = spec_inputs.verify_inputs(hist, rows, seq_lens, drafts, num_drafts, k_limit, tables, block_size=page,
                                    max_model_len=max_len)  # fmt: skip
    for name, a, b in zip(("ids", "positions", "slots", "seq_lens_after"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
    assert torch.equal(num_drafts, want_nd)
    assert (num_drafts <= (max_len - seq_lens).clamp(min=0)).all()
    unclamped = (seq_lens[:, None] - 1 + torch.arange(k + 1, device=DEV)).reshape(-1)
    assert (got[2][unclamped >= max_len] == -1).all(), "no slot for a position past max_model_len"


def test_rejects_bad_input() -> None:
    hist, rows, seq_lens, drafts, num_drafts, k_limit, tables = _step([3, 5], 2, [2, 2], [1, 2], 4, 16, seed=1)
    with pytest.raises(ValueError, match="block_tables: dtype torch.int64"):
        spec_inputs.verify_inputs(hist, rows, seq_lens, drafts, num_drafts, k_limit, tables.long(), block_size=4,
                                  max_model_len=16)  # fmt: skip
    with pytest.raises(ValueError, match="block_tables: 2 blocks of 4 cannot hold max_model_len 16"):
        spec_inputs.verify_inputs(hist, rows, seq_lens, drafts, num_drafts, k_limit, tables[:, :2], block_size=4,
                                  max_model_len=16)  # fmt: skip
    with pytest.raises(ValueError, match="k_limit: must be contiguous"):
        spec_inputs.verify_inputs(hist, rows, seq_lens, drafts, num_drafts, k_limit[:2], tables, block_size=4,
                                  max_model_len=16)  # fmt: skip
