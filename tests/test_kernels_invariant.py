"""The deterministic mode's kernels (invariant_matmul, invariant_attention): within tolerance of float64, and every
row bit-identical however it is batched: M = 1 against M = 7, 33 and a prefill-sized M at any slot, split pieces
against one program, a query computed as a decode step against the same query in a prefill chunk, after a
cached prefix, in other batches and with any number of split programs.

On the CPU the kernels run under the Triton interpreter, whose dots are float64 rounded once per 16-wide k step
(the tensor cores' k step), so the schedules are checked here and the hardware's side on a GPU.
"""

import dataclasses

import pytest
import torch

from envex.kernels import invariant_attention as ia
from envex.kernels import invariant_matmul as im
from envex.kernels import norm
from envex.kernels import reference as ref
from envex.tests.support.kernels import assert_close, f64

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


# ---- matmul -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,chunk", [(1, 96, 200, None), (7, 130, 72, None), (5, 64, 300, 128),
                                         (70, 64, 300, 128)])  # odd sizes; split pieces (5) and walked (70)
def test_matmul_matches_float64(dtype: torch.dtype, m: int, n: int, k: int, chunk: int | None) -> None:
    x, w, b = _randn(m, k, dtype=dtype, seed=1), _randn(n, k, dtype=dtype, seed=2), _randn(n, dtype=dtype, seed=3)
    assert_close("matmul", im.matmul(x, w, chunk=chunk), ref.linear(*f64(x, w)), dtype)
    assert_close("matmul + bias", im.matmul(x, w, b, chunk=chunk), ref.linear(*f64(x, w, b)), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_silu_prologue_matches_float64(dtype: torch.dtype) -> None:
    gate_up, w = _randn(5, 2 * 80, dtype=dtype, seed=4), _randn(48, 80, dtype=dtype, seed=5)
    out = im.matmul(gate_up, w, prologue=im.PROLOGUE_SILU_MUL)
    assert_close("silu matmul", out, ref.silu_and_mul_linear(*f64(gate_up, w)), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    n, k, chunk = 72, 272, 128  # three K pieces: split programs for decode batches, one program walking them above
    x, w, b = _randn(70, k, dtype=dtype, seed=6), _randn(n, k, dtype=dtype, seed=7), _randn(n, dtype=dtype, seed=8)
    rows = [0, 5, 6, 32, 63, 64, 69]  # tile edges and the ends of the 64-row decode tile
    alone = torch.cat([im.matmul(x[i : i + 1], w, b, chunk=chunk) for i in rows])  # M = 1: every row at slot 0
    for m in (7, 33, 70):  # decode tile with split pieces, and (70) the prefill tile walking them
        got = im.matmul(x[:m], w, b, chunk=chunk)
        seen = [i for i in rows if i < m]
        assert torch.equal(got[seen], alone[: len(seen)]), f"M={m}: a row differs from the same row computed alone"
    one_program = im.matmul(x[:33], w, b, chunk=chunk, split=False)
    assert torch.equal(one_program[rows[:4]], alone[:4]), "split pieces and one program walking them differ"
    # A one-piece weight above 64 rows takes the 128 x 256 tile; its rows too are the rows computed alone.
    one_piece = im.matmul(x[:70], w, b, chunk=k)
    assert torch.equal(one_piece[rows], torch.cat([im.matmul(x[i : i + 1], w, b, chunk=k) for i in rows]))
    assert torch.equal(one_piece[:33], im.matmul(x[:33], w, b, chunk=k))  # the deep decode tile (17-64 rows)
    # The batch shifted by 3 puts every row at another place in its tile.
    shifted = im.matmul(torch.cat([_randn(3, k, dtype=dtype, seed=9), x[:67]]), w, b, chunk=chunk)[3:]
    assert torch.equal(shifted[rows[:5]], alone[:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_partials_are_the_pieces_the_reduce_adds(dtype: torch.dtype) -> None:
    """partials=True hands the split pieces on unreduced; the norm that takes them adds them in order and rounds
    once, which gives the reduce kernel's bits. No split (one piece, or the prefill tile) or a bias: the rows."""
    n, k, chunk = 72, 272, 128
    x, w, res = _randn(5, k, dtype=dtype, seed=6), _randn(n, k, dtype=dtype, seed=7), _randn(5, n, dtype=dtype, seed=8)
    nw = _randn(n, dtype=dtype, seed=9)
    parts = im.matmul(x, w, chunk=chunk, partials=True)
    assert parts.shape == (3, 5, n) and parts.dtype == torch.float32
    assert [t.equal(u) for t, u in zip(norm.add_rms_norm_partials(parts, res, nw, 1e-5),
                                       norm.add_rms_norm(im.matmul(x, w, chunk=chunk), res, nw, 1e-5), strict=True)
            ] == [True, True]  # fmt: skip
    assert im.matmul(x, w, chunk=chunk, partials=True, split=False).shape == (5, n)
    assert im.matmul(x, w, nw, chunk=chunk, partials=True).shape == (5, n)
    assert im.matmul(_randn(65, k, dtype=dtype, seed=1), w, chunk=chunk, partials=True).shape == (65, n)
    # The pieces summed outside a norm (Ops.materialize): the reduce kernel itself, so its bits.
    assert torch.equal(im.sum_pieces(parts, dtype), im.matmul(x, w, chunk=chunk))
    with pytest.raises(ValueError, match="pieces: dtype torch.bfloat16 not supported"):
        im.sum_pieces(parts.bfloat16(), dtype)
    with pytest.raises(ValueError, match="tile: block_k 256 must divide the piece length 128"):
        im.matmul(x, w, chunk=chunk, tile=im.Tile(64, 64, 256, 4, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_tiles_launch_order_does_not_change_a_bit(dtype: torch.dtype) -> None:
    """Above 64 rows one program a tile walks the pieces, its tiles launched in groups of row tiles (Tile.group_m),
    its operands read through TMA descriptors where aligned: schedule choices, so every order and either load
    gives the same rows (float32 too, where any change of arithmetic shows)."""
    n, k, chunk = 200, 400, 128  # four pieces (the last 16 long), two 128-wide column tiles, the second ragged
    x, w, b = _randn(130, k, dtype=dtype, seed=10), _randn(n, k, dtype=dtype, seed=11), _randn(n, dtype=dtype, seed=12)
    walked = im.matmul(x, w, b, chunk=chunk)
    for group in (1, 2):  # a column tile's row tiles last, and a group of both row tiles (the default: all)
        assert torch.equal(walked, im.matmul(x, w, b, chunk=chunk, tile=dataclasses.replace(im.PREFILL_TILE,
                                                                                          group_m=group)))
    assert torch.equal(walked[:5], im.matmul(x[:5], w, b, chunk=chunk))  # and the split pieces of a decode batch
    # Above 64 rows the operands come through TMA descriptors (zero fill past the edges); masked loads give the
    # same values, so the same rows, for a weight of several pieces and of one.
    assert im.use_tma(x, w, 130, im.PREFILL_TILE) == im.TMA_BOTH
    assert im.use_tma(x[:64], w, 64, im.DECODE_TILE) == im.TMA_BOTH  # decode: both above 16 rows, else the weight
    assert im.use_tma(x[:5], w, 5, im.SMALL_TILE) == im.TMA_WEIGHT
    assert im.use_tma(x[:5], w, 5, im.DEEP_SMALL_TILE) == im.TMA_NONE
    for tma in (im.TMA_NONE, im.TMA_BOTH, im.TMA_WEIGHT):  # the split pieces on the swapped and the 64-row tile
        assert torch.equal(walked[:5], im.matmul(x[:5], w, b, chunk=chunk, tma=tma))
        assert torch.equal(walked[:5], im.matmul(x[:5], w, b, chunk=chunk, tma=tma, tile=im.DECODE_TILE))
    assert torch.equal(walked, im.matmul(x, w, b, chunk=chunk, tma=im.TMA_WEIGHT))
    assert torch.equal(walked, im.matmul(x, w, b, chunk=chunk, tma=False))
    assert torch.equal(im.matmul(x, w, chunk=k), im.matmul(x, w, chunk=k, tma=False))
    odd = _randn(130, k + 4, dtype=dtype, seed=13)[:, 2 : k + 2]  # rows 4 bytes off 16: pointer loads instead
    assert im.use_tma(odd, w, 130, im.PREFILL_TILE) == im.TMA_NONE
    assert torch.equal(im.matmul(odd, w, chunk=chunk), im.matmul(odd.contiguous(), w, chunk=chunk))
    assert_close("walked", walked, ref.linear(*f64(x, w, b)), dtype)


def test_tile_for_keeps_float32_off_the_wide_tile() -> None:
    # The 128 x 256 tile's stages in float32 need 288 KB of shared memory, more than an H200 has.
    qkv, o, gate_up = 6144, 4096, 28672  # Llama-3.1-8B: 96, 64 and 448 column tiles of 64
    assert im.tile_for(4096, o, 1, 2) == im.WIDE_TILE and im.tile_for(4096, o, 1, 4) == im.PREFILL_TILE
    assert im.tile_for(100, o, 3) == im.PREFILL_TILE and im.tile_for(2048, o, 3) == im.WIDE_TILE
    assert im.tile_for(100, gate_up, 1) == im.WIDE_TILE and im.tile_for(100, qkv, 1) == im.PREFILL_TILE
    assert im.tile_for(1, o, 3) == im.SMALL_TILE and im.tile_for(1, gate_up, 1) == im.DECODE_TILE
    assert im.tile_for(64, o, 3) == im.DECODE_TILE == im.tile_for(64, qkv, 1, 4)
    assert im.tile_for(16, qkv, 1) == im.DEEP_SMALL_TILE and im.tile_for(17, qkv, 1) == im.DEEP_DECODE_TILE


def test_chunk_size_is_a_property_of_the_weight() -> None:
    # The Llama-3.1-8B projections at decode: enough (column tile, piece) programs for 132 SMs; a weight of 96
    # column tiles or more has them in one piece.
    for n, k, pieces in ((6144, 4096, 1), (4096, 4096, 4), (28672, 4096, 1), (4096, 14336, 4), (128256, 4096, 1),
                         (6080, 4096, 3)):  # fmt: skip
        chunk = im.chunk_size(n, k)
        assert chunk % im.K_ALIGN == 0 and -(-k // chunk) == pieces, (n, k, chunk)
    assert im.chunk_size(960, 576) == 576  # the embedded model: one piece


def test_matmul_rejects_bad_shapes() -> None:
    w = _randn(8, 16, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="last dim 15 != 16"):
        im.matmul(_randn(2, 15, dtype=torch.float32, seed=0), w)
    with pytest.raises(ValueError, match="last dim 16 != 32"):
        im.matmul(_randn(2, 16, dtype=torch.float32, seed=0), w, prologue=im.PROLOGUE_SILU_MUL)


# ---- attention ----------------------------------------------------------------------------------------------

PAGE, SPLIT = 8, 128  # a split of two key tiles, so a 300-token sequence has three splits


def _cache(lengths: list[int], n_kv: int, d: int, dtype: torch.dtype, seed: int):
    """Random paged caches and each sequence's shuffled block table [B, width] (unused entries arbitrary)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // PAGE) for n in lengths]
    num = sum(blocks) + 2
    kc = torch.randn(num, PAGE, n_kv, d, generator=g).to(dtype).to(DEV)
    vc = torch.randn(num, PAGE, n_kv, d, generator=g).to(dtype).to(DEV)
    perm = torch.randperm(num, generator=g)
    tables, used = [], 0
    for nb in blocks:
        tables.append(perm[used : used + nb].tolist())
        used += nb
    return kc, vc, tables


def _attend(q_rows: list[torch.Tensor], starts: list[int], tables: list[list[int]], kc, vc, *, programs=None,
            positions_only: bool = False, split: int = SPLIT) -> list[torch.Tensor]:  # fmt: skip
    """One step: sequence b's queries q_rows[b] [q_len, Hq, D] at positions starts[b].. -> outputs per sequence."""
    q = torch.cat(q_rows)
    q_lens = [len(r) for r in q_rows]
    seq_lens = [s + n for s, n in zip(starts, q_lens, strict=True)]
    width = max(len(t) for t in tables)
    cu = torch.tensor([0] + q_lens, device=DEV).cumsum(0).to(torch.int32)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    positions = torch.tensor([s for s, n in zip(starts, q_lens, strict=True) for s in range(s, s + n)], device=DEV)
    out = ia.paged_attention(q, kc, vc, cu, None if positions_only else lens, bt, 0.125, max_q_len=max(q_lens),
                             max_seq_len=max(seq_lens) + 37, positions=positions, num_programs=programs,
                             split_keys=split)  # fmt: skip
    return list(out.split(q_lens))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_attention_matches_float64(dtype: torch.dtype, n_q: int, n_kv: int) -> None:
    lengths = [40, 300, 7]
    kc, vc, tables = _cache(lengths, n_kv, 32, dtype, seed=n_q)
    q = [_randn(n, n_q, 32, dtype=dtype, seed=10 + i) for i, n in enumerate((40, 9, 1))]  # prefill, chunk, decode
    got = torch.cat(_attend(q, [0, 291, 6], tables, kc, vc))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 40, 49, 50], dtype=torch.int32, device=DEV)
    expect = ref.paged_attention(*f64(torch.cat(q), kc, vc), cu, torch.tensor(lengths, device=DEV), bt, 0.125)
    assert_close("invariant attention", got, expect, dtype)
    decode = [_randn(1, n_q, 32, dtype=dtype, seed=20 + i) for i in range(3)]
    got = torch.cat(_attend(decode, [39, 299, 6], tables, kc, vc))
    expect = ref.paged_attention(*f64(torch.cat(decode), kc, vc), torch.arange(4, dtype=torch.int32, device=DEV),
                                 torch.tensor(lengths, device=DEV), bt, 0.125)  # fmt: skip
    assert_close("invariant decode attention", got, expect, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_row_is_the_same_in_prefill_chunks_and_decode(dtype: torch.dtype) -> None:
    n_q, n_kv, d, length = 4, 2, 32, 260  # three splits, the last of 4 keys
    kc, vc, tables = _cache([length, 150, 20], n_kv, d, dtype, seed=3)
    seq, other, short = tables
    q = _randn(length, n_q, d, dtype=dtype, seed=4)  # the sequence's queries; its keys are in the cache already
    full = _attend([q], [0], [seq], kc, vc)[0]  # one prefill chunk of the whole prompt
    # After a cached prefix ending on a split boundary (128) and inside a split (77, next to another sequence's
    # chunk), and in chunks of 65.
    assert torch.equal(_attend([q[128:]], [128], [seq], kc, vc)[0], full[128:]), "chunk after 128 cached keys"
    chunk = _attend([_randn(5, n_q, d, dtype=dtype, seed=5), q[77:]], [10, 77], [other, seq], kc, vc)[1]
    assert torch.equal(chunk, full[77:]), "chunk after 77 cached keys next to another sequence"
    pieces = torch.cat([_attend([q[s : s + 65]], [s], [seq], kc, vc)[0] for s in range(0, length, 65)])
    assert torch.equal(pieces, full), "65-token chunks differ from one chunk"
    # Decode steps inside and at the edges of splits, alone and in batches, with 1, 2, 5 or chosen split programs.
    for pos, programs in ((0, 1), (127, 2), (128, 5), (259, None)):
        alone = _attend([q[pos : pos + 1]], [pos], [seq], kc, vc, programs=1)[0]
        assert torch.equal(alone, full[pos : pos + 1]), f"decode at {pos} differs from its prefill row"
        batch = [_randn(1, n_q, d, dtype=dtype, seed=6), q[pos : pos + 1], _randn(1, n_q, d, dtype=dtype, seed=7)]
        got = _attend(batch, [149, pos, 19], [other, seq, short], kc, vc, programs=programs,
                      positions_only=programs == 5)[1]  # fmt: skip
        assert torch.equal(got, alone), f"decode at {pos} in a batch with {programs} split programs differs"
    # A decode row next to a prefill chunk (a mixed step) takes the prefill schedule: still the same bits.
    mixed = _attend([_randn(7, n_q, d, dtype=dtype, seed=8), q[259:260]], [0, 259], [short, seq], kc, vc)[1]
    assert torch.equal(mixed, full[259:260])


def test_decode_merges_many_splits_as_the_prefill_tile_folds_them() -> None:
    """The merge kernel requests four splits' states at a time, then folds them in order: a decode row of 8, 9 and
    10 splits (whole groups of four, and one and two past them), merged after 3 split programs or folded by one,
    must equal its row of a prefill chunk, bit for bit (in float32: a bf16 output would hide a fold's last bits)."""
    n_q, n_kv, d, length = 4, 2, 32, 600
    kc, vc, tables = _cache([length, 40], n_kv, d, torch.float32, seed=31)
    q = _randn(length, n_q, d, dtype=torch.float32, seed=32)
    full = _attend([q[448:]], [448], [tables[0]], kc, vc, split=64)[0]  # a chunk after 448 cached keys
    other = _randn(1, n_q, d, dtype=torch.float32, seed=33)
    for pos in (511, 575, 599):
        for programs in (1, 3):
            got = _attend([other, q[pos : pos + 1]], [39, pos], [tables[1], tables[0]], kc, vc, programs=programs,
                          split=64)[1]  # fmt: skip
            assert torch.equal(got, full[pos - 448 : pos - 447]), f"decode at {pos}, {programs} split programs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_with_rotary_gives_the_rotary_launch_and_attention_bits(dtype: torch.dtype) -> None:
    """decode_attention_rotary (rotary and the K/V write inside the split launch) against rotary_and_store_kv and
    paged_attention: the same outputs and the same caches, bit for bit, at split edges, with 1-3 split programs
    and a padding token (slot -1: nothing written)."""
    from envex.kernels import rotary

    n_q, n_kv, d = 6, 2, 32
    lengths = [129, 300, 5]  # the new token opens a split, sits inside one, and in a short sequence
    kc, vc, tables = _cache(lengths, n_kv, d, dtype, seed=21)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    pos = torch.tensor([n - 1 for n in lengths], device=DEV)
    slots = torch.tensor([tables[b][p // PAGE] * PAGE + p % PAGE for b, p in enumerate(pos.tolist())], device=DEV)
    slots[2] = -1  # a padding row of a graph's batch
    g = torch.Generator().manual_seed(22)
    cos, sin = torch.randn(400, d // 2, generator=g).to(DEV), torch.randn(400, d // 2, generator=g).to(DEV)
    qkv = torch.randn(3, (n_q + 2 * n_kv) * d, generator=g).to(dtype).to(DEV)
    q, k, v = qkv.view(3, n_q + 2 * n_kv, d).split([n_q, n_kv, n_kv], dim=1)
    for programs in (1, 2, 3):
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q_rot, _ = rotary.rotary_and_store_kv(q, k, v, pos, cos, sin, kc1, vc1, slots)
        want = ia.paged_attention(q_rot, kc1, vc1, torch.arange(4, dtype=torch.int32, device=DEV), None, bt, 0.125,
                                  max_q_len=1, max_seq_len=320, positions=pos, num_programs=programs,
                                  split_keys=SPLIT)  # fmt: skip
        got = ia.decode_attention_rotary(q, k, v, pos, cos, sin, kc2, vc2, slots, bt, 0.125, max_seq_len=320,
                                         num_programs=programs, split_keys=SPLIT)  # fmt: skip
        assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1), f"caches differ with {programs} split programs"
        assert torch.equal(got[:2], want[:2]), f"outputs differ with {programs} split programs"
    assert not torch.equal(kc1, kc), "the new keys were written"


def test_decode_with_rotary_rejects_bad_inputs() -> None:
    kc, vc, tables = _cache([4], 1, 16, torch.float32, seed=0)
    q, k = torch.zeros(1, 2, 16, device=DEV), torch.zeros(1, 1, 16, device=DEV)
    cs = torch.zeros(8, 8, device=DEV)
    one = torch.zeros(1, dtype=torch.int64, device=DEV)
    bt = torch.tensor([tables[0]], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="v: "):
        ia.decode_attention_rotary(q, k, k[:, :, :8], one, cs, cs, kc, vc, one, bt, 0.25, max_seq_len=8)
    with pytest.raises(ValueError, match="cos: "):
        ia.decode_attention_rotary(q, k, k, one, cs[:, :4], cs, kc, vc, one, bt, 0.25, max_seq_len=8)
    with pytest.raises(ValueError, match="slot_mapping: 2 entries"):
        ia.decode_attention_rotary(q, k, k, one, cs, cs, kc, vc, one.repeat(2), bt, 0.25, max_seq_len=8)


def test_attention_rejects_a_decode_step_without_lengths() -> None:
    kc, vc, tables = _cache([4], 1, 16, torch.float32, seed=0)
    q = _randn(2, 1, 16, dtype=torch.float32, seed=0)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="seq_lens: required"):
        ia.paged_attention(q, kc, vc, cu, None, torch.tensor([tables[0]], dtype=torch.int32, device=DEV), 0.25,
                           max_q_len=2, max_seq_len=4)  # fmt: skip
