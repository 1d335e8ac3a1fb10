"""The benchmark statistics against known distributions: CI coverage by simulation, anchors, percentiles."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envex.verify.stats import (
    ANCHOR_DRIFT_LIMIT,
    Interval,
    anchor_drift,
    bootstrap_ci,
    percentiles,
    window_is_void,
)


def test_bootstrap_ci_of_the_median_covers_the_true_median_about_95_percent() -> None:
    # Log-normal latencies (skewed, like real TTFTs): the true median is exp(mu). 400 simulated benchmarks of
    # 12 rounds each; a 95% interval should contain the truth ~95% of the time (percentile bootstrap on small
    # samples runs a little narrow, hence the lower bound 0.90).
    rng = np.random.default_rng(7)
    mu, sigma, n, trials = math.log(0.05), 0.3, 12, 400
    covered = 0
    for t in range(trials):
        sample = rng.lognormal(mu, sigma, size=n)
        covered += bootstrap_ci(sample, "median", resamples=500, seed=t).contains(math.exp(mu))
    coverage = covered / trials
    assert 0.90 <= coverage <= 0.99, coverage


def test_bootstrap_ci_of_the_mean_covers_the_true_mean() -> None:
    rng = np.random.default_rng(11)
    covered = sum(bootstrap_ci(rng.normal(10.0, 2.0, size=30), "mean", resamples=500, seed=t).contains(10.0)
                  for t in range(400))
    assert 0.90 <= covered / 400 <= 0.99


def test_bootstrap_is_reproducible_and_validates_input() -> None:
    x = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert bootstrap_ci(x) == bootstrap_ci(x)
    iv = bootstrap_ci(x)
    assert iv.estimate == 3.0 and iv.low <= 3.0 <= iv.high and iv.n == 5
    with pytest.raises(ValueError, match="samples"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="statistic"):
        bootstrap_ci(x, "mode")
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci(x, confidence=1.5)


def test_a_drifting_anchor_voids_the_window() -> None:
    assert ANCHOR_DRIFT_LIMIT == 0.03
    assert not window_is_void(100.0, 102.9)
    assert not window_is_void(100.0, 97.1)
    assert window_is_void(100.0, 103.5)
    assert window_is_void(100.0, 96.0)
    assert anchor_drift(50.0, 55.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="opening anchor"):
        anchor_drift(0.0, 1.0)


def test_simulated_drift_is_caught_and_steady_machine_is_not() -> None:
    # A steady machine (1% noise) almost never voids; one that slows 6% over the window always does.
    rng = np.random.default_rng(3)
    steady = sum(window_is_void(*(100 * (1 + rng.normal(0, 0.005, 2)))) for _ in range(500))
    drifting = sum(window_is_void(100 * (1 + rng.normal(0, 0.005)), 94 * (1 + rng.normal(0, 0.005)))
                   for _ in range(500))
    assert steady == 0 and drifting == 500


def test_percentiles() -> None:
    p = percentiles(list(range(1, 101)))
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert math.isnan(percentiles([])["p50"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=40))
def test_interval_brackets_its_estimate_range(xs: list[float]) -> None:
    iv = bootstrap_ci(xs, "median", resamples=200)
    assert min(xs) <= iv.low <= iv.high <= max(xs)
    assert isinstance(iv, Interval) and iv.overlaps(iv)
