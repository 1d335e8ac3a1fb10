"""How deep to speculate, per request: its running acceptance against the measured cost of a (batch, k) verify step.

From the request's decayed acceptance and proposal rate and the relative cost of a step (`StepCosts`, measured on
the captured graphs at start), `DepthController` picks the ladder k that maximises tokens per unit of step time,
or none when no k pays (with hysteresis, so a request does not flap).
"""

from __future__ import annotations

from dataclasses import dataclass

from envex.runtime.engine.spec.drafters import NgramIndex

K_LADDER = (1, 2, 4, 8, 16)


def k_ladder(max_k: int) -> tuple[int, ...]:
    """The draft depths verify graphs are captured for: powers of two below max_k, and max_k."""
    if max_k < 1:
        raise ValueError(f"num_speculative_tokens: must be >= 1 for a ladder, got {max_k}")
    return tuple(k for k in K_LADDER if k < max_k) + (max_k,)


@dataclass
class SpecState:
    """One sequence's speculative-decoding state (Sequence.spec)."""

    row: int | None = None  # its row of SpecDecoder.hist, while it holds one
    synced: int = 0  # leading tokens valid in that row
    draft_valid: int = 0  # leading positions whose draft-model K/V are valid
    pending_max: int = 0  # tokens the launched-but-unread verify steps may still append (1 + k each)
    on: bool = False  # speculating (hysteresis of DepthController)
    # Decayed sums: drafts accepted, drafts tried, steps with a proposal, steps; the prior is
    # DepthController.start's.
    hits: float = 1.0
    trials: float = 2.0
    proposed: float = 2.0
    steps: float = 2.0
    plain_steps: int = 0  # steps since it last speculated (probing, for drafters without a shadow)
    shadow: NgramIndex | None = None  # the host's n-gram index over its known tokens

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials

    @property
    def proposal_rate(self) -> float:
        return self.proposed / self.steps


class StepCosts:
    """Relative cost of a verify step: cost(batch, k) = time(batch, K) / time(batch, 0) at the ladder's K >= k.

    Measured on the captured graphs at start (graphs.SpecGraphs.measure_costs); without a measurement, a
    model where a draft row costs `per_row` of a step and k > 0 a fixed `switch` (the batch-1 GEMV gives way to
    GEMM when a sequence brings several rows), and `batch` rows saturate the device's compute."""

    def __init__(self, *, per_row: float = 0.02, switch: float = 0.1, saturate: int = 64) -> None:
        self.per_row, self.switch, self.saturate = per_row, switch, saturate
        self.table: dict[tuple[int, int], float] = {}

    def __call__(self, batch: int, k: int) -> float:
        if k == 0:
            return 1.0
        if self.table:
            sizes = sorted({b for b, _ in self.table})
            depths = sorted({kk for _, kk in self.table})
            b = next((s for s in sizes if s >= batch), sizes[-1])
            kk = next((d for d in depths if d >= k), depths[-1])
            return self.table[(b, kk)]
        rows, base = batch * (k + 1), max(1, batch)
        return (1.0 + self.switch + self.per_row * k * batch) * max(1.0, rows / self.saturate) / max(
            1.0, base / self.saturate)


class DepthController:
    """k per request: with per-draft acceptance a and proposal rate r (decayed averages), k drafts add
    r * (a + a^2 + ... + a^k) tokens per step at cost(batch, k); it picks the ladder k with the most tokens per
    unit of time, and none unless that beats plain decoding by `enter` (10%; staying on down to `stay`, 2%, so a
    request does not flap between the two: each switch costs the overlap one step, and an estimate near break-even
    gains nothing anyway)."""

    def __init__(self, ks: tuple[int, ...], costs: StepCosts, *, max_batch: int, decay: float = 0.9,
                 enter: float = 1.1, stay: float = 1.02, probe_every: int = 32, shadow: bool) -> None:  # fmt: skip
        self.ks, self.costs, self.max_batch = ks, costs, max_batch
        self.decay, self.enter, self.stay, self.probe_every, self.shadow = decay, enter, stay, probe_every, shadow

    @staticmethod
    def gain(state: SpecState, k: int) -> float:
        """Expected tokens a step with k drafts adds beyond the one plain decoding gives."""
        a = state.acceptance
        return state.proposal_rate * sum(a**i for i in range(1, k + 1))

    def value(self, state: SpecState, batch: int, k: int) -> float:
        """Tokens per unit of step time at depth k, relative to plain decoding."""
        return (1.0 + self.gain(state, k)) / self.costs(batch, k)

    def depth(self, state: SpecState, batch: int, cap: int) -> int:
        """The draft depth for this request in a step of `batch` sequences, at most `cap` (0: plain decoding)."""
        if batch > self.max_batch or cap < 1:
            return 0
        best_k, best = 0, 1.0
        for k in self.ks:
            if k <= cap and (v := self.value(state, batch, k)) > best:
                best_k, best = k, v
        if best < (self.stay if state.on else self.enter):
            state.on = False
            if not self.shadow and state.plain_steps >= self.probe_every:
                return min(self.ks[0], cap)  # no host-side estimate: try one short draft now and then
            return 0
        state.on = True
        return best_k

    def start(self) -> SpecState:
        """A new request's state. With a shadow (n-gram lookup), a request starts off and the host index turns it
        on once the answer repeats its context (a few tokens: chat answers never pay the wider steps); without
        one (a draft model, which usually agrees with the target), it starts on at a per-draft acceptance of 1/2."""
        if self.shadow:
            return SpecState(hits=0.8, trials=4.0, proposed=2.0, steps=4.0)  # a = 0.2, r = 0.5, as four steps
        return SpecState()

    def observe_step(self, state: SpecState, proposed: int, accepted: int) -> None:
        d = self.decay
        state.steps = d * state.steps + 1
        state.proposed = d * state.proposed + (proposed > 0)
        if proposed:
            state.hits = d * state.hits + accepted
            state.trials = d * state.trials + accepted + (accepted < proposed)
        state.plain_steps = 0

    def observe_shadow(self, state: SpecState, proposal: list[int], token: int) -> None:
        """A token decoded without speculation, and what the n-gram drafter would have proposed before it."""
        d = self.decay
        state.steps = d * state.steps + 1
        state.proposed = d * state.proposed + bool(proposal)
        if proposal:
            state.hits = d * state.hits + (proposal[0] == token)
            state.trials = d * state.trials + 1
