"""Paired statistics over seeds, the t distribution, ranks, FLOP counting and power-law fits."""

import math
import random

import pytest

from attnres.experiments.fit import (
    PFLOPS_DAY,
    PowerLaw,
    compute_multiplier,
    fit_power_law,
    flops_per_token,
    matmul_params,
    measured_multiplier,
)
from attnres.experiments.stats import (
    NOISE_RULE,
    fmt_mean_std,
    mean_std,
    paired,
    ranks,
    spearman,
    t_pvalue,
)
from attnres.model import AttnResLM, ModelConfig


def test_mean_std_uses_n_minus_one():
    m, s, n = mean_std([1.0, 2.0, 3.0, 4.0])
    assert (m, n) == (2.5, 4) and s == pytest.approx(math.sqrt(5 / 3))
    assert math.isnan(mean_std([2.0])[1]) and mean_std([])[2] == 0
    assert fmt_mean_std([1.0, 3.0], 2) == "2.00 ± 1.41" and fmt_mean_std([]) == "—"
    assert "1 seed" in fmt_mean_std([1.5])


def test_paired_difference_t_statistic_and_verdict():
    base = {0: 2.00, 1: 2.10, 2: 1.95}
    variant = {0: 1.97, 1: 2.06, 2: 1.93, 7: 0.0}  # seed 7 has no partner: ignored
    p = paired(variant, base)
    diffs = [-0.03, -0.04, -0.02]
    sd = math.sqrt(sum((d + 0.03) ** 2 for d in diffs) / 2)
    assert p.n == 3 and p.mean == pytest.approx(-0.03)
    assert p.se == pytest.approx(sd / math.sqrt(3)) and p.t == pytest.approx(-0.03 / (sd / math.sqrt(3)))
    assert p.t == pytest.approx(-5.196, abs=1e-3)
    assert p.lower == 3 and p.verdict == "better" and p.exceeds_noise
    assert "t = -5.2, 3/3 seeds lower): better" in p.describe()

    # a small difference that changes sign between seeds: within noise
    wide = paired({0: 1.51, 1: 2.52, 2: 3.49}, {0: 1.50, 1: 2.50, 2: 3.50})
    assert wide.verdict == "within noise" and abs(wide.t) < 2 and "within noise" in wide.describe()
    worse = paired({0: 2.05, 1: 2.16, 2: 2.02}, base)
    assert worse.verdict == "worse" and worse.t > 2


def test_large_t_with_a_dissenting_seed_is_within_noise():
    base = dict.fromkeys(range(6), 2.0)
    variant = {0: 1.90, 1: 1.91, 2: 1.90, 3: 1.89, 4: 1.90, 5: 2.01}
    p = paired(variant, base)
    assert abs(p.t) >= 2 and p.lower == 5 and p.verdict == "within noise"


def test_single_seed_and_no_seed_claim_nothing():
    assert paired({0: 1.0}, {0: 2.0}).verdict == "single seed"
    assert "no noise estimate" in paired({0: 1.0}, {0: 2.0}).describe()
    assert paired({0: 1.0}, {1: 2.0}).verdict == "no common seeds"
    identical = paired({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})
    assert identical.t == 0 and identical.verdict == "within noise"
    assert "|t| >= 2" in NOISE_RULE and "sign" in NOISE_RULE


def test_student_t_p_values():
    assert t_pvalue(2.0, 1) == pytest.approx(1 - 2 / math.pi * math.atan(2.0), abs=1e-9)  # Cauchy
    assert t_pvalue(2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6), abs=1e-9)
    assert t_pvalue(1.959964, 10_000) == pytest.approx(0.05, abs=2e-4)  # the normal limit
    assert t_pvalue(0.0, 5) == pytest.approx(1.0) and t_pvalue(math.inf, 3) == 0.0


def test_ranks_and_spearman():
    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None


def test_power_law_fit_recovers_A_and_alpha():
    A, alpha = 1.891, 0.057
    Cs = [10**e for e in (-3, -2.5, -2, -1.5, -1)]
    fit = fit_power_law(Cs, [A * c**-alpha for c in Cs])
    assert pytest.approx(A, rel=1e-9) == fit.A and fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.n == 5
    rng = random.Random(0)
    noisy = fit_power_law(Cs * 4, [A * c**-alpha * math.exp(rng.gauss(0, 0.002)) for c in Cs * 4])
    assert noisy.alpha == pytest.approx(alpha, abs=0.004) and pytest.approx(A, rel=0.02) == noisy.A
    assert fit.inverse(fit(0.02)) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="two distinct"):
        fit_power_law([1.0, 1.0], [2.0, 2.1])


def test_compute_multiplier():
    base = PowerLaw(A=1.891, alpha=0.057, r2=1, n=5)
    # same exponent: the multiplier is (A_base / A_variant)^(1/alpha) at every budget
    variant = PowerLaw(A=1.891 * 1.25**-0.057, alpha=0.057, r2=1, n=5)
    for C in (1e-4, 1.0):
        assert compute_multiplier(base, variant, C) == pytest.approx(1.25)
    assert compute_multiplier(base, base, 3.0) == pytest.approx(1.0)


def test_measured_multiplier_ignores_the_baseline_fit_residual():
    base = PowerLaw(A=2.3, alpha=0.042, r2=1, n=4)
    C = 3.1e-7
    # a variant that reaches, at C, the loss the baseline curve reaches at 1.2 C
    assert measured_multiplier(base(C), base(1.2 * C), base.alpha) == pytest.approx(1.2)
    # the same loss ratio, with the baseline's measured point 1% above its fitted curve: still 1.2x,
    # while reading the variant's loss off the baseline's fitted curve would give far less
    off = 1.01
    assert measured_multiplier(off * base(C), off * base(1.2 * C), base.alpha) == pytest.approx(1.2)
    assert base.inverse(off * base(1.2 * C)) / C < 1.0
    assert measured_multiplier(4.3, 4.3, base.alpha) == 1.0


def test_flop_count_matches_the_model():
    cfg = ModelConfig(vocab_size=4096, d_model=128, n_layers=8, n_heads=4, residual="prenorm")
    model = AttnResLM(cfg)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert matmul_params(cfg) == model.num_params() - model.embed.weight.numel() - norms
    assert matmul_params(cfg.to_dict()) == matmul_params(cfg)
    assert flops_per_token(cfg, 128) == 6 * matmul_params(cfg) + 6 * 8 * 128 * 128
    assert PFLOPS_DAY == 8.64e19
