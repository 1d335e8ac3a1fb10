"""Gated DeltaNet kernels (kernels/delta_rule.py): the float64 references against HF transformers' own Qwen3-Next
torch functions, then the Triton kernels (interpreter on CPU) against the float64 references: varlen batches,
state slots, a prefill split in two, decode after a prefill, snapshots restored as a prefix hit."""

from __future__ import annotations

import pytest
import torch

from envex.kernels import delta_rule as dr
from envex.kernels import reference as ref
from envex.kernels.accuracy import rel_err
from envex.tests.support.kernels import assert_close, compile_for_hopper, f64

DEV = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32


def _cu(lens: list[int], device: str = DEV) -> torch.Tensor:
    return torch.tensor([0] + lens, device=device).cumsum(0).to(I32)


def _delta_inputs(lens: list[int], n_k: int, n_v: int, d_k: int, d_v: int, dtype: torch.dtype, seed: int = 0,
                  device: str = DEV) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Packed q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay in [-1, 0)) and beta (0..1) [T, Hv]."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, n_k, d_k, generator=gen)
    k = torch.randn(t, n_k, d_k, generator=gen)
    v = torch.randn(t, n_v, d_v, generator=gen)
    g = -torch.rand(t, n_v, generator=gen)
    beta = torch.rand(t, n_v, generator=gen)
    return tuple(x.to(dtype).to(device) for x in (q, k, v, g, beta))


def _pool(n: int, *shape: int, seed: int = 1, device: str = DEV) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, *shape, generator=gen) * 0.5).to(device)


def _untouched(after: torch.Tensor, before: torch.Tensor, written: list[int]) -> None:
    keep = [i for i in range(before.shape[0]) if i not in written]
    assert torch.equal(after[keep], before[keep]), "a slot outside the batch changed"


# --- (a) the float64 references are HF's functions -------------------------------------------------------------


def _hf():
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next


@pytest.mark.parametrize("n_k,n_v", [(2, 2), (2, 4)])
def test_reference_delta_rule_is_hfs_chunked_and_recurrent_rule(n_k: int, n_v: int) -> None:
    hf = _hf()
    lens, d_k, d_v = [70, 9], 16, 8
    q, k, v, g, beta = _delta_inputs(lens, n_k, n_v, d_k, d_v, torch.float32, device="cpu")
    pool = _pool(2, n_v, d_k, d_v, device="cpu")
    pool64 = pool.double()
    out = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu(lens, "cpu"), pool64, torch.tensor([0, 1]))
    for b, (lo, hi) in enumerate([(0, 70), (70, 79)]):
        args = [x[lo:hi].unsqueeze(0) for x in (q, k, v, g, beta)]
        # HF's model repeats the key heads to the value heads before it calls these (transformers 5.17's functions
        # need it; 5.25's also take the grouped heads): the same grouping as the reference's, v head j on k head j // r
        args[0], args[1] = (x.repeat_interleave(n_v // n_k, dim=2) for x in args[:2])
        for fn, extra in ((hf.torch_chunk_gated_delta_rule, {"chunk_size": 64}), (hf.torch_recurrent_gated_delta_rule,
                                                                                  {})):  # fmt: skip
            o, state = fn(*args, initial_state=pool[b : b + 1].clone(), output_final_state=True,
                          use_qk_l2norm_in_kernel=True, **extra)  # fmt: skip
            assert rel_err(o[0], out[lo:hi]) < 1e-5, fn.__name__
            assert rel_err(state[0], pool64[b]) < 1e-5, fn.__name__


def test_reference_conv1d_is_hfs_conv_and_update() -> None:
    hf = _hf()
    gen = torch.Generator().manual_seed(2)
    dim, width, length = 12, 4, 7
    x = torch.randn(1, dim, length, generator=gen)  # HF's [batch, channels, tokens]
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    state = torch.randn(1, dim, width - 1, generator=gen)
    cu, slot = _cu([length], "cpu"), torch.tensor([0])
    packed = x[0].t().double()  # [tokens, channels]
    # From a zero state: HF's causal_conv1d_fn.
    pool = torch.randn(1, width - 1, dim, dtype=torch.float64)
    out = ref.causal_conv1d(packed, weight.double(), bias.double(), cu, pool, slot,
                            has_initial_state=torch.tensor([False]))  # fmt: skip
    want = hf.causal_conv1d_fn(x, weight, bias, activation="silu")
    assert rel_err(out, want[0].t()) < 1e-6
    # From a state, several tokens at once: HF's causal_conv1d_update, state updated in place.
    pool = state[0].t().double().unsqueeze(0).clone()
    out = ref.causal_conv1d(packed, weight.double(), None, cu, pool, slot)
    hf_state = state.clone()
    want = hf.causal_conv1d_update(x, hf_state, weight, None, activation="silu")
    assert rel_err(out, want[0].t()) < 1e-6
    assert rel_err(pool[0], hf_state[0].t()) < 1e-6
    # One token (decode), a state longer than the input.
    hf_state = state.clone()
    pool = state[0].t().double().unsqueeze(0).clone()
    out = ref.causal_conv1d(packed[:1], weight.double(), bias.double(), _cu([1], "cpu"), pool, slot)
    want = hf.causal_conv1d_update(x[:, :, :1], hf_state, weight, bias, activation="silu")
    assert rel_err(out, want[0].t()) < 1e-6 and rel_err(pool[0], hf_state[0].t()) < 1e-6


def test_reference_gated_norm_is_hfs() -> None:
    hf = _hf()
    gen = torch.Generator().manual_seed(3)
    x, z = torch.randn(5, 3, 32, generator=gen), torch.randn(5, 3, 32, generator=gen)
    norm = hf.Qwen3NextRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=gen))
        assert rel_err(ref.gated_rms_norm(*f64(x, z, norm.weight), 1e-6), norm(x, z)) < 1e-6
        # In bf16 the reference rounds where HF rounds: bit for bit.
        norm16 = norm.to(torch.bfloat16)
        x16, z16 = x.bfloat16(), z.bfloat16()
        assert torch.equal(ref.gated_rms_norm(x16, z16, norm16.weight, 1e-6), norm16(x16, z16))


def test_references_compose_to_hfs_gated_deltanet_layer() -> None:
    """HF's whole Qwen3NextGatedDeltaNet (no cache, 70 tokens: two chunks) in float32 against its projections
    around the float64 references: conv + SiLU, the gating from a and b, the delta rule, the gated norm."""
    hf = _hf()
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, num_hidden_layers=1, layer_types=["linear_attention"])  # fmt: skip
    torch.manual_seed(12)
    layer = hf.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in (layer.dt_bias, layer.norm.weight):
            p.copy_(torch.randn_like(p))
        x = torch.randn(1, 70, 32)
        want = layer(x)
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        mixed = torch.cat([t.reshape(70, -1) for t in (q, k, v)], dim=1).double()  # [T, conv_dim]
        cu, slot = _cu([70], "cpu"), torch.tensor([0])
        conv_pool = torch.full((1, 3, mixed.shape[1]), float("nan"), dtype=torch.float64)
        mixed = ref.causal_conv1d(mixed, layer.conv1d.weight[:, 0].double(), None, cu, conv_pool, slot,
                                  has_initial_state=torch.tensor([0]))  # fmt: skip
        q, k, v = mixed.split([32, 32, 32], dim=1)
        g, beta = ref.delta_gates(a[0].double(), b[0].double(), layer.A_log.double(), layer.dt_bias.double())
        state_pool = torch.full((1, 4, 16, 8), float("nan"), dtype=torch.float64)
        o = ref.gated_delta_rule(q.reshape(70, 2, 16), k.reshape(70, 2, 16), v.reshape(70, 4, 8), g, beta, cu,
                                 state_pool, slot, has_initial_state=torch.tensor([0]))  # fmt: skip
        o = ref.gated_rms_norm(o, z[0].double(), layer.norm.weight.double(), cfg.rms_norm_eps)
        got = o.reshape(70, 32) @ layer.out_proj.weight.double().t()
    assert rel_err(got, want[0]) < 1e-5


# --- (b) the Triton kernels against the float64 references -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_k,n_v,d_k,d_v", [(2, 4, 32, 48), (1, 2, 24, 16)])
def test_decode_step_updates_only_its_slots(dtype: torch.dtype, n_k: int, n_v: int, d_k: int, d_v: int) -> None:
    q, k, v, g, beta = _delta_inputs([1] * 4, n_k, n_v, d_k, d_v, dtype)
    pool = _pool(6, n_v, d_k, d_v)
    slots = torch.tensor([4, 1, -1, 2], dtype=I32, device=DEV)  # row 2: a padding row of a graph batch
    init = torch.tensor([1, 0, 1, 1], dtype=I32, device=DEV)
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu([1] * 4), want_pool, slots, has_initial_state=init)
    got_pool = pool.clone()
    out = dr.gated_delta_rule_decode(q, k, v, g, beta, got_pool, slots, has_initial_state=init)
    rows = [0, 1, 3]
    assert_close("decode.o", out[rows], want[rows], dtype)
    assert_close("decode.state", got_pool[[4, 1, 2]], want_pool[[4, 1, 2]], torch.float32)
    _untouched(got_pool, pool, [4, 1, 2])


def test_recurrent_kernel_runs_several_tokens_per_sequence() -> None:
    lens = [3, 1, 5]
    q, k, v, g, beta = _delta_inputs(lens, 1, 2, 16, 16, torch.float32)
    pool = _pool(4, 2, 16, 16)
    slots = torch.tensor([3, 0, 1], dtype=I32, device=DEV)
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu(lens), want_pool, slots)
    out = dr.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, cu_seqlens=_cu(lens))
    assert_close("recurrent.o", out, want, torch.float32)
    assert_close("recurrent.state", pool, want_pool, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_prefill_varlen_batch(dtype: torch.dtype) -> None:
    # A sequence over a chunk boundary, a one-token one, a short one from a zero state, and a padding row.
    lens = [70, 1, 9, 3]
    q, k, v, g, beta = _delta_inputs(lens, 2, 4, 16, 32, dtype, seed=4)
    pool = _pool(7, 4, 16, 32, seed=5)
    slots = torch.tensor([5, 0, 2, -1], dtype=I32, device=DEV)
    init = torch.tensor([1, 1, 0, 1], dtype=I32, device=DEV)
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu(lens), want_pool, slots, has_initial_state=init)
    got_pool = pool.clone()
    out = dr.gated_delta_rule_chunked(q, k, v, g, beta, _cu(lens), got_pool, slots, max_q_len=70,
                                      has_initial_state=init)  # fmt: skip
    assert_close("chunked.o", out[:80], want[:80], dtype)
    assert_close("chunked.state", got_pool[[5, 0, 2]], want_pool[[5, 0, 2]], torch.float32)
    _untouched(got_pool, pool, [5, 0, 2])


def test_chunked_prefill_snapshots_match_the_reference() -> None:
    # 70 tokens after 10 already in the state, a snapshot every 16: after 16, 32, 48, 64 and 80 tokens; the third
    # not wanted (-1). A second sequence takes none (all -1).
    lens, every = [70, 4], 16
    q, k, v, g, beta = _delta_inputs(lens, 1, 2, 16, 16, torch.float32, seed=6)
    pool = _pool(10, 2, 16, 16, seed=7)
    slots = torch.tensor([0, 1], dtype=I32, device=DEV)
    start = torch.tensor([10, 3], dtype=I32, device=DEV)
    snaps = torch.tensor([[4, 5, -1, 6, 7], [-1, -1, -1, -1, -1]], dtype=I32, device=DEV)
    kw = dict(start_pos=start, snapshot_slots=snaps, snapshot_every=every)
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu(lens), want_pool, slots, **kw)
    got_pool = pool.clone()
    out = dr.gated_delta_rule_chunked(q, k, v, g, beta, _cu(lens), got_pool, slots, max_q_len=70, **kw)
    assert_close("snapshots.o", out, want, torch.float32)
    assert_close("snapshots.states", got_pool[[0, 1, 4, 5, 6, 7]], want_pool[[0, 1, 4, 5, 6, 7]], torch.float32)
    _untouched(got_pool, pool, [0, 1, 4, 5, 6, 7])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_prefill_and_update(dtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    lens, dim, width = [20, 2, 1, 5], 80, 4
    x = torch.randn(sum(lens), dim, generator=gen).to(dtype).to(DEV)
    weight = torch.randn(dim, width, generator=gen).to(dtype).to(DEV)
    b = torch.randn(dim, generator=gen).to(dtype).to(DEV) if bias else None
    pool = torch.randn(6, width - 1, dim, generator=gen).to(dtype).to(DEV)
    slots = torch.tensor([3, 0, 5, -1], dtype=I32, device=DEV)
    init = torch.tensor([1, 1, 0, 1], dtype=I32, device=DEV)
    want_pool = pool.double()
    want = ref.causal_conv1d(*f64(x, weight), None if b is None else b.double(), _cu(lens), want_pool, slots,
                             has_initial_state=init)  # fmt: skip
    got_pool = pool.clone()
    out = dr.causal_conv1d_prefill(x, weight, b, _cu(lens), got_pool, slots, has_initial_state=init)
    assert_close("conv.prefill", out[:23], want[:23], dtype)
    assert torch.equal(got_pool.double(), want_pool), "the conv state is the last inputs, copied exactly"
    # Decode: one token per row, a padding row among them.
    xd = torch.randn(3, dim, generator=gen).to(dtype).to(DEV)
    dslots = torch.tensor([5, -1, 3], dtype=I32, device=DEV)
    want = ref.causal_conv1d(*f64(xd, weight), None if b is None else b.double(), _cu([1, 1, 1]), want_pool, dslots)
    before = got_pool.clone()
    out = dr.causal_conv1d_update(xd, weight, b, got_pool, dslots)
    assert_close("conv.update", out[[0, 2]], want[[0, 2]], dtype)
    assert torch.equal(got_pool.double(), want_pool)
    _untouched(got_pool, before, [5, 3])


def test_conv1d_snapshots_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(9)
    dim, width = 16, 4
    x = torch.randn(22, dim, generator=gen).to(DEV)
    weight = torch.randn(dim, width, generator=gen).to(DEV)
    pool = torch.randn(6, width - 1, dim, generator=gen).to(DEV)
    # 22 tokens after 2: snapshots after 4, 8, ..., 24; the one after 4 holds two inputs of the old state.
    kw = dict(start_pos=torch.tensor([2], dtype=I32, device=DEV), snapshot_every=4,
              snapshot_slots=torch.tensor([[1, 2, -1, 3, 4, 5]], dtype=I32, device=DEV))  # fmt: skip
    slots = torch.tensor([0], dtype=I32, device=DEV)
    want_pool = pool.double()
    want = ref.causal_conv1d(*f64(x, weight), None, _cu([22]), want_pool, slots, **kw)
    out = dr.causal_conv1d_prefill(x, weight, None, _cu([22]), pool, slots, **kw)
    assert_close("conv.snapshots.o", out, want, torch.float32)
    assert torch.equal(pool.double(), want_pool)


def test_a_verify_step_snapshots_the_state_after_every_token() -> None:
    """Speculative decoding's verify step (state_slots.py, gated_delta_net): 3 sequences x 4 tokens (the newest and
    3 drafts) from their live slots through the recurrent kernel, a snapshot after every token into verify slots
    (one entry -1: not kept); the states and outputs against the float64 reference, and bit for bit the outputs and
    states of four one-token decode steps (a verify step computes what decoding computes); the conv's snapshots
    likewise."""
    lens, dim, width = [4, 4, 4], 16, 4
    q, k, v, g, beta = _delta_inputs(lens, 1, 2, 16, 16, torch.float32, seed=11)
    slots = torch.tensor([0, 1, 2], dtype=I32, device=DEV)
    table = torch.arange(3, 15, dtype=I32, device=DEV).view(3, 4)
    table[1, 2] = -1
    pool = _pool(15, 2, 16, 16, seed=12)
    want_pool, stepped = pool.double(), pool.clone()
    kw = dict(start_pos=torch.tensor([9, 1, 0], dtype=I32, device=DEV), snapshot_slots=table, snapshot_every=1)
    want = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu(lens), want_pool, slots, **kw)
    out = dr.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, cu_seqlens=_cu(lens), snapshot_slots=table)
    assert_close("verify.o", out, want, torch.float32)
    assert_close("verify.states", pool, want_pool, torch.float32)
    rows = torch.arange(3, device=DEV) * 4
    for i in range(4):  # the same tokens as four decode steps
        one = [t[rows + i] for t in (q, k, v, g, beta)]
        assert torch.equal(dr.gated_delta_rule_decode(*one, stepped, slots), out[rows + i]), i
        kept = table[:, i][table[:, i] >= 0].long()
        assert torch.equal(pool[kept], stepped[slots[table[:, i] >= 0].long()]), i
    assert torch.equal(pool[:3], stepped[:3])
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(12, dim, generator=gen).to(DEV)
    weight = torch.randn(dim, width, generator=gen).to(DEV)
    conv = torch.randn(15, width - 1, dim, generator=gen).to(DEV)
    want_conv, conv_stepped = conv.double(), conv.clone()
    want = ref.causal_conv1d(*f64(x, weight), None, _cu(lens), want_conv, slots, **kw)
    out = dr.causal_conv1d_prefill(x, weight, None, _cu(lens), conv, slots, **kw)
    assert_close("verify.conv", out, want, torch.float32)
    assert torch.equal(conv.double(), want_conv)
    for i in range(4):
        assert torch.equal(dr.causal_conv1d_update(x[rows + i], weight, None, conv_stepped, slots), out[rows + i])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gated_rms_norm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(7, 3, 48, generator=gen).to(dtype).to(DEV)
    zw = torch.randn(7, 3, 96, generator=gen).to(dtype).to(DEV)
    z = zw[:, :, 48:]  # a strided view, as z comes out of the input projection
    w = torch.randn(48, generator=gen).to(dtype).to(DEV)
    assert_close("gated_rms_norm", dr.gated_rms_norm(x, z, w, 1e-6), ref.gated_rms_norm(*f64(x, z, w), 1e-6), dtype)


# --- the state's bookkeeping: one layer's Gated DeltaNet mixer through the kernels ------------------------------

N_K, N_V, D_K, D_V, WIDTH = 1, 2, 16, 16, 4
CONV_DIM = 2 * N_K * D_K + N_V * D_V


def _mixer(x: torch.Tensor, z: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, lens: list[int],
           pools: tuple[torch.Tensor, torch.Tensor], slots: list[int], weights: tuple[torch.Tensor, torch.Tensor], *,
           decode: bool = False, init: list[int] | None = None, **snap) -> torch.Tensor:  # fmt: skip
    """conv + SiLU -> q, k, v (views of the conv output) -> gated delta rule -> gated norm, through the kernels
    (decode: one token per sequence, the decode kernels), or through the float64 references when the pools are
    float64."""
    conv_pool, state_pool = pools
    conv_w, norm_w = weights
    s = torch.tensor(slots, dtype=I32, device=DEV)
    has = None if init is None else torch.tensor(init, dtype=I32, device=DEV)
    cu = _cu(lens)
    use_ref = state_pool.dtype == torch.float64
    if use_ref:
        mixed = ref.causal_conv1d(x, conv_w, None, cu, conv_pool, s, has_initial_state=has, **snap)
    elif decode:
        mixed = dr.causal_conv1d_update(x, conv_w, None, conv_pool, s)
    else:
        mixed = dr.causal_conv1d_prefill(x, conv_w, None, cu, conv_pool, s, has_initial_state=has, **snap)
    t = x.shape[0]
    q = mixed[:, : N_K * D_K].view(t, N_K, D_K)
    k = mixed[:, N_K * D_K : 2 * N_K * D_K].view(t, N_K, D_K)
    v = mixed[:, 2 * N_K * D_K :].view(t, N_V, D_V)
    if use_ref:
        o = ref.gated_delta_rule(q, k, v, g, beta, cu, state_pool, s, has_initial_state=has, **snap)
        return ref.gated_rms_norm(o, z, norm_w, 1e-6)
    if decode:
        o = dr.gated_delta_rule_decode(q, k, v, g, beta, state_pool, s)
    else:
        o = dr.gated_delta_rule_chunked(q, k, v, g, beta, cu, state_pool, s, max_q_len=max(lens),
                                        has_initial_state=has, **snap)  # fmt: skip
    return dr.gated_rms_norm(o, z, norm_w, 1e-6)


def _mixer_inputs(n: int, seed: int = 11):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, CONV_DIM, generator=gen).to(DEV)
    z = torch.randn(n, N_V, D_V, generator=gen).to(DEV)
    g = -torch.rand(n, N_V, generator=gen).to(DEV) * 0.3
    beta = torch.rand(n, N_V, generator=gen).to(DEV)
    weights = (torch.randn(CONV_DIM, WIDTH, generator=gen).to(DEV) * 0.5, torch.randn(D_V, generator=gen).to(DEV))
    return x, z, g, beta, weights


def _new_pools(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((slots, WIDTH - 1, CONV_DIM), float("nan"), device=DEV),
            torch.full((slots, N_V, D_K, D_V), float("nan"), device=DEV))  # fmt: skip


def test_chunk_boundary_decode_and_prefix_hit_give_the_uninterrupted_run() -> None:
    """The kernel-level form of 'a prefix hit, a preemption and a chunk boundary give the tokens of an uninterrupted
    run': one 80-token prefill (a fresh slot full of NaN, has_initial_state 0), against the same tokens as
    (1) two prefills, 37 + 43 (chunked prefill; a recompute after preemption replays the same calls),
    (2) a 77-token prefill and three decode steps,
    (3) a prefix hit: the first run's snapshot after 48 tokens copied into a new slot, then the last 32 tokens."""
    n = 80
    x, z, g, beta, weights = _mixer_inputs(n)
    rows = lambda lo, hi: (x[lo:hi], z[lo:hi], g[lo:hi], beta[lo:hi])  # noqa: E731
    # The uninterrupted run, with snapshots every 16 tokens into slots 3..7; slot 0 is the sequence's own.
    pools = _new_pools(8)
    snap = dict(start_pos=torch.tensor([0], dtype=I32, device=DEV), snapshot_every=16,
                snapshot_slots=torch.tensor([[3, 4, 5, 6, 7]], dtype=I32, device=DEV))  # fmt: skip
    full = _mixer(*rows(0, n), [n], pools, [0], weights, init=[0], **snap)
    pools64 = tuple(p.double() for p in _new_pools(8))
    want = _mixer(*f64(*rows(0, n)), [n], pools64, [0], [w.double() for w in weights], init=[0], **snap)
    assert_close("mixer.full", full, want, torch.float32)
    for p, p64 in zip(pools, pools64, strict=True):
        assert_close("mixer.states", p[[0, 3, 4, 5, 6, 7]], p64[[0, 3, 4, 5, 6, 7]], torch.float32)

    def same(name: str, got: torch.Tensor, lo: int, hi: int, got_pools: tuple[torch.Tensor, ...], slot: int) -> None:
        assert rel_err(got, full[lo:hi]) < 1e-5, f"{name}: outputs differ from the uninterrupted run"
        for p, p_full in zip(got_pools, pools, strict=True):
            assert rel_err(p[slot], p_full[0]) < 1e-5, f"{name}: final state differs"

    # (1) Two prefills, the second continuing from the first's state.
    split = _new_pools(2)
    first = _mixer(*rows(0, 37), [37], split, [1], weights, init=[0])
    second = _mixer(*rows(37, n), [n - 37], split, [1], weights)
    same("two prefills", torch.cat([first, second]), 0, n, split, 1)
    # (2) A prefill, then decode steps.
    dec = _new_pools(2)
    outs = [_mixer(*rows(0, 77), [77], dec, [1], weights, init=[0])]
    outs += [_mixer(*rows(t, t + 1), [1], dec, [1], weights, decode=True) for t in range(77, n)]
    same("prefill + decode", torch.cat(outs), 0, n, dec, 1)
    # (3) A prefix hit at 48 tokens: the snapshot (slot 5) restored into slot 1 of fresh pools.
    hit = _new_pools(2)
    for p, p_full in zip(hit, pools, strict=True):
        p[1] = p_full[5]
    same("prefix hit", _mixer(*rows(48, n), [n - 48], hit, [1], weights), 48, n, hit, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_compute_the_gates_from_a_and_b(dtype: torch.dtype) -> None:
    # a and b as strided views of one [T, 2·Hv] projection output, as in_proj_ba gives them; 70 tokens: the padded
    # rows of the second chunk must get g = 0 and beta = 0 from the gating too.
    gen = torch.Generator().manual_seed(13)
    lens = [70, 3]
    q, k, v, _, _ = _delta_inputs(lens, 1, 2, 16, 16, dtype, seed=14)
    ba = (torch.randn(73, 4, generator=gen) * 2).to(dtype).to(DEV)
    b, a = ba[:, :2], ba[:, 2:]
    a_log = torch.randn(2, generator=gen).to(DEV)
    dt_bias = torch.randn(2, generator=gen).to(dtype).to(DEV)
    pool = _pool(3, 2, 16, 16, seed=15)
    slots = torch.tensor([2, 0], dtype=I32, device=DEV)
    g, beta = ref.delta_gates(*f64(a, b, a_log, dt_bias))
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v), g, beta, _cu(lens), want_pool, slots)
    got_pool = pool.clone()
    out = dr.gated_delta_rule_chunked(q, k, v, a, b, _cu(lens), got_pool, slots, max_q_len=70, gating=(a_log, dt_bias))
    assert_close("gating.chunked.o", out, want, dtype)
    assert_close("gating.chunked.state", got_pool, want_pool, dtype)
    # Decode: the next token of each.
    want = ref.gated_delta_rule(*f64(q[:2], k[:2], v[:2]), g[:2], beta[:2], _cu([1, 1]), want_pool, slots)
    out = dr.gated_delta_rule_decode(q[:2], k[:2], v[:2], a[:2], b[:2], got_pool, slots, gating=(a_log, dt_bias))
    assert_close("gating.decode.o", out, want, dtype)
    assert_close("gating.decode.state", got_pool, want_pool, dtype)


def test_launchers_reject_bad_input() -> None:
    q, k, v, g, beta = _delta_inputs([2], 2, 4, 16, 16, torch.float32)
    pool = _pool(2, 4, 16, 16)
    slots = torch.tensor([0, 1], dtype=I32, device=DEV)
    with pytest.raises(ValueError, match=r"v: 3 value heads is not a multiple of the 2 q/k heads"):
        dr.gated_delta_rule_decode(q, k, v[:, :3], g[:, :3], beta[:, :3], pool[:, :3], slots)
    with pytest.raises(ValueError, match=r"state_pool: slot shape \(4, 16, 8\)"):
        dr.gated_delta_rule_decode(q, k, v, g, beta, pool[..., :8], slots)
    with pytest.raises(ValueError, match="slots: 1 entries for 2 sequences"):
        dr.gated_delta_rule_decode(q, k, v, g, beta, pool, slots[:1])
    with pytest.raises(ValueError, match="gating dt_bias: 2 entries for 4 value heads"):
        dr.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, gating=(torch.zeros(4), torch.zeros(2)))
    with pytest.raises(ValueError, match="snapshot_slots/start_pos: snapshot_every > 0 needs both"):
        dr.gated_delta_rule_chunked(q, k, v, g, beta, _cu([2]), pool, slots[:1], max_q_len=2, snapshot_every=16)
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="weight: kernel width 5 not supported"):
        dr.causal_conv1d_update(x, torch.randn(8, 5, device=DEV), None, torch.zeros(1, 4, 8, device=DEV), slots)
    with pytest.raises(ValueError, match=r"conv_pool: slot shape \(3, 4\) != \[K-1, D\] = \(3, 8\)"):
        dr.causal_conv1d_update(x, torch.randn(8, 4, device=DEV), None, torch.zeros(1, 3, 4, device=DEV), slots)


# --- the device code --------------------------------------------------------------------------------------------

_AOT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import delta_rule as dr

def compiled(fn, ptrs, floats, consts, warps, stages=3):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    return {"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.(\w+)\.(\w+)", ptx))),
            "shared": k.metadata.shared}

bf, f32, i32 = "*bf16", "*fp32", "*i32"
ptrs = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, g_ptr=bf, beta_ptr=bf, alog_ptr=f32, dtb_ptr=bf, o_ptr=bf, state_ptr=f32,
            slots_ptr=i32, cu_ptr=i32, init_ptr=i32, start_ptr=i32, snap_ptr=i32, chunk_ptr=i32, w_ptr=f32, u_ptr=f32,
            gc_ptr=f32, vn_ptr=f32, h_ptr=f32, kd_ptr=f32)
heads = dict(GROUP=2, DK=128, DV=128, BLOCK_K=128, C=64, PRECISION="tf32")
out = {
    "prep": compiled(dr._chunk_prep_kernel, ptrs, {"eps"}, dict(heads, BLOCK_DV=128, GATING=True), 8),
    "state": compiled(dr._chunk_state_kernel, ptrs, set(), dict(DK=128, DV=128, BLOCK_K=128, C=64, PRECISION="tf32",
                      BLOCK_V=32, HAS_INIT=True), 8, dr.STATE_STAGES),
    "output": compiled(dr._chunk_output_kernel, ptrs, {"scale", "eps"}, dict(heads, BLOCK_V=32, V_TILES=4,
                       SNAPSHOTS=True), 8),
}
print(json.dumps(out))
"""


def test_the_kernels_compile_for_hopper() -> None:
    """The chunked prefill's device code (not what the interpreter runs: the tensor-core products, the in-register
    substitution) compiles for sm_90 at Qwen3-Next-80B's head shapes, its products on TF32 tensor cores, within the
    H100's 227 KB of shared memory a block. (The decode, conv and norm kernels compile too; not re-checked here.)"""
    got = compile_for_hopper(_AOT)
    assert got["prep"]["wgmma"] == got["state"]["wgmma"] == got["output"]["wgmma"] == [["f32", "tf32"]], got
    assert max(v["shared"] for v in got.values()) <= 227 * 1024, got


# --- on a GPU: Qwen3-Next-80B-A3B's shapes (16 q/k heads, 32 v heads, head dim 128, conv dim 8192) -------------

QN = dict(n_k=16, n_v=32, d_k=128, d_v=128)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunked_prefill_and_decode_at_qwen3_next_shapes(state_dtype: torch.dtype) -> None:
    lens = [700, 300, 1, 64, 130]
    q, k, v, g, beta = _delta_inputs(lens, **QN, dtype=torch.bfloat16, seed=20)
    pool = _pool(8, 32, 128, 128, seed=21).to(state_dtype)
    slots = torch.tensor([6, 0, 3, 2, 5], dtype=I32, device=DEV)
    init = torch.tensor([0, 1, 1, 1, 0], dtype=I32, device=DEV)
    kw = dict(start_pos=torch.tensor([0, 5, 0, 64, 0], dtype=I32, device=DEV), snapshot_every=256,
              snapshot_slots=torch.tensor([[1, 4], [-1, -1], [-1, -1], [-1, -1], [-1, -1]], dtype=I32,
                                          device=DEV))  # fmt: skip
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu(lens), want_pool, slots, has_initial_state=init, **kw)
    got_pool = pool.clone()
    out = dr.gated_delta_rule_chunked(q, k, v, g, beta, _cu(lens), got_pool, slots, max_q_len=700,
                                      has_initial_state=init, **kw)  # fmt: skip
    assert_close("gpu.chunked.o", out, want, torch.bfloat16)
    written = [6, 0, 3, 2, 5, 1, 4]
    # bf16's bound for a float32 state too: the chunk products take TF32 operands for 16-bit inputs (dot_precision)
    assert_close("gpu.chunked.state", got_pool[written], want_pool[written], torch.bfloat16)
    _untouched(got_pool, pool, written)
    # Batch-invariant: sequence 1 alone gives its batched output and state bit for bit (each program reads one
    # sequence only, in a fixed order).
    alone_pool = pool.clone()
    alone = dr.gated_delta_rule_chunked(*(x[700:1000] for x in (q, k, v, g, beta)), _cu([300]), alone_pool,
                                        slots[1:2], max_q_len=300)  # fmt: skip
    assert torch.equal(alone, out[700:1000]) and torch.equal(alone_pool[0], got_pool[0])
    # Decode at batch 64 over 8 slots' worth of states (some rows padding).
    q, k, v, g, beta = _delta_inputs([1] * 64, **QN, dtype=torch.bfloat16, seed=22)
    pool = _pool(80, 32, 128, 128, seed=23).to(state_dtype)
    slots = torch.randperm(80, device=DEV)[:64].to(I32)
    slots[::9] = -1
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v, g, beta), _cu([1] * 64), want_pool, slots)
    got_pool = pool.clone()
    out = dr.gated_delta_rule_decode(q, k, v, g, beta, got_pool, slots)
    live = (slots >= 0).nonzero().flatten()
    assert_close("gpu.decode.o", out[live], want[live], torch.bfloat16)
    assert_close("gpu.decode.state", got_pool, want_pool, state_dtype)
    alone_pool = pool.clone()
    alone = dr.gated_delta_rule_decode(*(x[1:2] for x in (q, k, v, g, beta)), alone_pool, slots[1:2])
    assert torch.equal(alone[0], out[1]) and torch.equal(alone_pool[slots[1]], got_pool[slots[1]])
    # The gates from the projection's raw a and b (bf16, strided views of one [B, 2·Hv] output) inside the kernel.
    ba = torch.randn(64, 64, device=DEV).bfloat16() * 2
    a_log, dt_bias = torch.randn(32, device=DEV), torch.randn(32, device=DEV).bfloat16()
    g64, beta64 = ref.delta_gates(*f64(ba[:, 32:], ba[:, :32], a_log, dt_bias))
    want_pool = pool.double()
    want = ref.gated_delta_rule(*f64(q, k, v), g64, beta64, _cu([1] * 64), want_pool, slots)
    got_pool = pool.clone()
    out = dr.gated_delta_rule_decode(q, k, v, ba[:, 32:], ba[:, :32], got_pool, slots, gating=(a_log, dt_bias))
    assert_close("gpu.decode.gating.o", out[live], want[live], torch.bfloat16)
    assert_close("gpu.decode.gating.state", got_pool, want_pool, state_dtype)


@pytest.mark.gpu
@gpu
def test_gpu_conv1d_and_gated_norm_at_qwen3_next_shapes() -> None:
    gen = torch.Generator().manual_seed(24)
    lens, dim = [700, 1, 33], 8192
    x = torch.randn(sum(lens), dim, generator=gen).bfloat16().to(DEV)
    weight = torch.randn(dim, 4, generator=gen).bfloat16().to(DEV)
    pool = torch.randn(4, 3, dim, generator=gen).bfloat16().to(DEV)
    slots = torch.tensor([2, 0, 3], dtype=I32, device=DEV)
    want_pool = pool.double()
    want = ref.causal_conv1d(*f64(x, weight), None, _cu(lens), want_pool, slots)
    out = dr.causal_conv1d_prefill(x, weight, None, _cu(lens), pool, slots)
    assert_close("gpu.conv", out, want, torch.bfloat16)
    assert torch.equal(pool.double(), want_pool)
    xd = torch.randn(64, dim, generator=gen).bfloat16().to(DEV)
    pool = torch.randn(64, 3, dim, generator=gen).bfloat16().to(DEV)
    slots = torch.arange(64, dtype=I32, device=DEV).flip(0)
    want_pool = pool.double()
    want = ref.causal_conv1d(*f64(xd, weight), None, _cu([1] * 64), want_pool, slots)
    assert_close("gpu.conv.update", dr.causal_conv1d_update(xd, weight, None, pool, slots), want, torch.bfloat16)
    assert torch.equal(pool.double(), want_pool)
    o = torch.randn(734, 32, 128, generator=gen).bfloat16().to(DEV)
    z = torch.randn(734, 32, 128, generator=gen).bfloat16().to(DEV)
    w = torch.randn(128, generator=gen).bfloat16().to(DEV)
    assert_close("gpu.gated_norm", dr.gated_rms_norm(o, z, w, 1e-6), ref.gated_rms_norm(*f64(o, z, w), 1e-6),
                 torch.bfloat16)  # fmt: skip
