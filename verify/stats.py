"""Statistics for the benchmark: percentiles, bootstrap confidence intervals, and the anchor-drift rule.

Bootstrap intervals are percentile intervals with a fixed seed, so the same samples always give the same
interval (a report can be re-derived from its raw samples). The coverage of these intervals is checked by
simulation in tests/test_verify_stats.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_SEED = 20251129
DEFAULT_RESAMPLES = 2000
ANCHOR_DRIFT_LIMIT = 0.03  # DESIGN.md: a window whose anchors drift more than 3% is void


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap confidence interval."""

    estimate: float
    low: float
    high: float
    confidence: float
    n: int

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def to_dict(self) -> dict[str, float | int]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "confidence": self.confidence,
                "n": self.n}


def bootstrap_ci(samples: Sequence[float], statistic: Callable[[np.ndarray], np.ndarray] | str = "median", *,
                 confidence: float = 0.95, resamples: int = DEFAULT_RESAMPLES,
                 seed: int = DEFAULT_SEED) -> Interval:
    """Percentile bootstrap interval of `statistic` ("median", "mean" or a function reducing axis=-1)."""
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"samples: need a non-empty 1-D sequence of numbers, got shape {x.shape}")
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0.5, 1), got {confidence}")
    if isinstance(statistic, str):
        if statistic not in ("median", "mean"):
            raise ValueError(f"statistic: {statistic!r} is not one of median, mean (or pass a function)")
        fn = np.median if statistic == "median" else np.mean

        def reduce(a: np.ndarray) -> np.ndarray:
            return np.asarray(fn(a, axis=-1))

        stat: Callable[[np.ndarray], np.ndarray] = reduce
    else:
        stat = statistic
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    dist = stat(x[idx])  # [resamples]
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(dist, [alpha, 1.0 - alpha])
    return Interval(float(stat(x[None, :])[0]), float(low), float(high), confidence, int(x.size))


def percentiles(samples: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} (linear interpolation); NaN for no samples."""
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(x, q)) for q in qs}


def anchor_drift(first: float, last: float) -> float:
    """Relative change between the opening and the closing anchor run: |last - first| / first."""
    if first <= 0:
        raise ValueError(f"first: the opening anchor must be positive, got {first}")
    return abs(last - first) / first


def window_is_void(first: float, last: float, limit: float = ANCHOR_DRIFT_LIMIT) -> bool:
    return anchor_drift(first, last) > limit
