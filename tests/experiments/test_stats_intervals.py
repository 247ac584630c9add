"""The interval of a mean over seeds and the percentile interval of bootstrap replicates."""

import math

import pytest

from attnres.experiments.stats import (
    fmt_mean_interval,
    mean_interval,
    percentile_interval,
)

T_975_DF2 = 4.302652729911275  # scipy.stats.t.ppf(0.975, 2)


def test_the_interval_of_a_mean_uses_the_t_quantile():
    m, lo, hi, n = mean_interval([1.0, 2.0, 4.0, None, float("nan")])
    half = T_975_DF2 * math.sqrt(7 / 3) / math.sqrt(3)  # sample std sqrt(7/3), three seeds
    assert n == 3 and m == pytest.approx(7 / 3)
    assert (lo, hi) == pytest.approx((7 / 3 - half, 7 / 3 + half), rel=1e-9)
    assert fmt_mean_interval([1.0, 2.0, 4.0], 2) == f"2.33 [{7 / 3 - half:.2f}, {7 / 3 + half:.2f}] (3 seeds)"
    assert fmt_mean_interval([5.0]) == "5.0000 (1 seed)" and fmt_mean_interval([]) == "—"
    assert math.isnan(mean_interval([5.0])[1])


def test_the_percentile_interval_keeps_the_central_95_percent():
    assert percentile_interval([float(x) for x in range(101)]) == pytest.approx((2.5, 97.5))
    assert percentile_interval([3.0, float("nan"), 3.0]) == (3.0, 3.0)
    assert all(math.isnan(x) for x in percentile_interval([]))
