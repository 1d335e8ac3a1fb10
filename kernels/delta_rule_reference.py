"""Pure-torch definitions of the Gated DeltaNet kernels (`delta_rule.py`): what each Triton kernel must compute.

Qwen3-Next's linear-attention layers (HF `Qwen3NextGatedDeltaNet`): a short causal depthwise convolution with SiLU
over the packed q/k/v channels, the gated delta rule, and RMSNorm(o) * silu(z). Each function here takes the
kernels' packed layout (tokens of all sequences one after another, `cu_seqlens` marking where each starts) and
their state pools (one slot per sequence, picked by `slots`), and updates the pools in place as the kernels do.
The delta rule is written as its token-by-token recurrence, which HF's chunked and recurrent functions both equal
(tests/test_kernels_delta_rule.py checks that in float32). Tests call these on float64 copies.

Will move into kernels/reference.py once the refactor of that file lands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from envex.kernels.ops import AttentionMetadata, LinearAttentionLayer

L2_EPS = 1e-6  # HF's l2norm (and FLA's): x * rsqrt(sum(x²) + eps), in float32 or wider


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _snapshot_counts(start: int, length: int, every: int) -> list[int]:
    """The token counts c in (start, start + length] that are multiples of `every`: where snapshots are taken."""
    if every <= 0:
        return []
    first = (start // every + 1) * every
    return list(range(first, start + length + 1, every))


def _sequences(cu_seqlens: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(b, slot, first row, end row) of each sequence whose slot is not negative (padding rows are skipped)."""
    bounds = cu_seqlens.tolist()
    return [(b, slot, bounds[b], bounds[b + 1]) for b, slot in enumerate(slots.tolist()) if slot >= 0]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, *,
                     has_initial_state: torch.Tensor | None = None, start_pos: torch.Tensor | None = None,
                     snapshot_slots: torch.Tensor | None = None, snapshot_every: int = 0) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over packed sequences: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, ≤ 0) and beta
    [T, Hv]; sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] and its state is state_pool[slots[b]] [Hv, Dk, Dv]
    (zeros instead where has_initial_state[b] is False). v head h reads q/k head h // (Hv / Hk). Per token, with
    q and k L2-normalised and q scaled by Dk^-0.5:  S ← S·exp(g);  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq.
    Returns o [T, Hv, Dv] in v's dtype; the final state goes to state_pool[slots[b]] (nothing where slots[b] < 0).
    Snapshots: with snapshot_every > 0, the state after c tokens of the sequence (counting start_pos[b] tokens
    before this call) for each multiple c of snapshot_every in (start_pos[b], start_pos[b] + len] is also written to
    state_pool[snapshot_slots[b, n]], n counting those c from 0 (nothing where the entry is negative)."""
    num_k, dk = q.shape[1], q.shape[2]
    group = v.shape[1] // num_k
    out = torch.zeros_like(v)
    for b, slot, lo, hi in _sequences(cu_seqlens, slots):
        state = state_pool[slot].to(v.dtype).clone()  # [Hv, Dk, Dv]
        if has_initial_state is not None and not bool(has_initial_state[b]):
            state.zero_()
        start = int(start_pos[b]) if start_pos is not None else 0
        snaps = _snapshot_counts(start, hi - lo, snapshot_every)
        for t in range(lo, hi):
            qt = l2_normalize(q[t].to(v.dtype)).repeat_interleave(group, 0) * dk**-0.5  # [Hv, Dk]
            kt = l2_normalize(k[t].to(v.dtype)).repeat_interleave(group, 0)
            state = state * g[t].to(v.dtype).exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", state, kt)
            delta = (v[t] - predicted) * beta[t].to(v.dtype)[:, None]
            state = state + kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qt)
            done = start + t - lo + 1
            if done in snaps and snapshot_slots is not None:
                target = int(snapshot_slots[b, snaps.index(done)])
                if target >= 0:
                    state_pool[target] = state.to(state_pool.dtype)
        state_pool[slot] = state.to(state_pool.dtype)
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                  conv_pool: torch.Tensor, slots: torch.Tensor, *, has_initial_state: torch.Tensor | None = None,
                  silu: bool = True, start_pos: torch.Tensor | None = None, snapshot_slots: torch.Tensor | None = None,
                  snapshot_every: int = 0) -> torch.Tensor:  # fmt: skip
    """Causal depthwise conv1d over packed sequences x [T, D] with weight [D, K] (HF's conv1d.weight[:, 0, :]),
    optional bias [D] and SiLU: out[t, d] = Σ_j weight[d, j] · x[t - (K-1) + j, d], where inputs before the
    sequence's first token come from its conv state conv_pool[slots[b]] [K-1, D] (row j holds the input K-1-j
    tokens back; zeros where has_initial_state[b] is False). The state then holds the sequence's last K-1 inputs
    (nothing written where slots[b] < 0). Snapshots as in `gated_delta_rule`: the conv state after c tokens goes to
    conv_pool[snapshot_slots[b, n]]. Returns out [T, D] in x's dtype."""
    width = weight.shape[1]
    out = torch.zeros_like(x)
    for b, slot, lo, hi in _sequences(cu_seqlens, slots):
        history = conv_pool[slot].to(x.dtype).clone()  # [K-1, D]
        if has_initial_state is not None and not bool(has_initial_state[b]):
            history.zero_()
        window = torch.cat([history, x[lo:hi]])  # [K-1 + L, D]
        for t in range(hi - lo):
            acc = (window[t : t + width] * weight.to(x.dtype).t()).sum(0)  # [D]
            if bias is not None:
                acc = acc + bias.to(x.dtype)
            out[lo + t] = torch.nn.functional.silu(acc) if silu else acc
        start = int(start_pos[b]) if start_pos is not None else 0
        for n, c in enumerate(_snapshot_counts(start, hi - lo, snapshot_every)):
            target = int(snapshot_slots[b, n]) if snapshot_slots is not None else -1
            if target >= 0:
                done = c - start  # tokens of this call in the snapshot: window rows done .. done + K-2
                conv_pool[target] = window[done : done + width - 1].to(conv_pool.dtype)
        conv_pool[slot] = window[window.shape[0] - (width - 1) :].to(conv_pool.dtype)
    return out


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """HF's gating of one layer from the projection's raw a, b [T, Hv] and the layer's A_log, dt_bias [Hv] -> (g, beta):
    g = -exp(A_log)·softplus(a + dt_bias) in float32 (or wider), beta = sigmoid(b) in b's dtype."""
    acc = torch.promote_types(a.dtype, torch.float32)
    g = -a_log.to(acc).exp() * torch.nn.functional.softplus(a.to(acc) + dt_bias.to(acc))
    return g, b.sigmoid()


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3NextRMSNormGated over the last dim: RMSNorm(x) in float32 (or wider), cast to x's dtype, times the
    weight, times silu(z) in float32 (or wider), cast to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).to(acc) * torch.nn.functional.silu(z.to(acc))).to(x.dtype)


def gated_delta_net(mixed: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, meta: AttentionMetadata,
                    layer: LinearAttentionLayer) -> torch.Tensor:  # fmt: skip
    """One Gated DeltaNet layer between its projections, as HF's Qwen3NextGatedDeltaNet computes it (the torch
    backend's Ops.linear_attention): mixed [T, ...] the input projection's row (LinearAttentionLayer.split) ->
    [T, Hv·Dv] in mixed's dtype. The convolution runs in the activation dtype, the delta rule in float32 (or wider),
    as HF's torch path; the pools are updated in place (meta.state_slots), with the step's snapshots
    (meta.state_snapshots) where it asks for them."""
    assert meta.state_slots is not None, "a model with linear-attention layers gets state slots (state_slots.py)"
    slots, cu = meta.state_slots, meta.cu_seqlens_q
    snaps: dict = {}
    if meta.state_snapshots is not None:
        assert meta.seq_lens is not None, "a step that snapshots states carries its sequences' lengths"
        snaps = dict(start_pos=meta.seq_lens - (cu[1:] - cu[:-1]), snapshot_slots=meta.state_snapshots,
                     snapshot_every=meta.state_snapshot_every)  # fmt: skip
    x, z, b, a = layer.split(mixed)
    conv = causal_conv1d(x, layer.conv_weight, None, cu, conv_pool, slots, has_initial_state=meta.state_initialized,
                         **snaps)  # fmt: skip
    q, k, v = layer.split_conv(conv)
    g, beta = gates(a, b, layer.a_log, layer.dt_bias)
    acc = torch.promote_types(mixed.dtype, torch.float32)
    o = gated_delta_rule(q.to(acc), k.to(acc), v.to(acc), g, beta.to(acc), cu, state_pool, slots,
                         has_initial_state=meta.state_initialized, **snaps)  # fmt: skip
    return gated_rms_norm(o.to(mixed.dtype), z, layer.norm_weight, layer.norm_eps).flatten(1)
