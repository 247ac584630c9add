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
    STATS_RULE,
    Comparisons,
    fmt_mean_std,
    fmt_p,
    holm,
    mean_std,
    paired,
    ranks,
    seed_shortfall,
    spearman,
    t_pvalue,
    t_quantile,
)
from attnres.model import AttnResLM, ModelConfig

# float64 references: scipy.stats.t.ppf(0.975, df) and 2 * scipy.stats.t.sf(|t|, df) (scipy 1.17), the
# textbook table's t_{0.975} to its 3 decimals
T975 = {
    1: 12.706204736174694,
    2: 4.302652729749462,
    3: 3.1824463052837078,
    4: 2.7764451051977934,
    5: 2.5705818356363146,
    9: 2.262157162798205,
    10: 2.228138851986274,
    30: 2.0422724563012378,
}
TWO_SIDED_P = [
    (2.0, 2, 0.18350341907227397),
    (2.0, 3, 0.13932596855884305),
    (3.5, 4, 0.024896163460222748),
    (-1.3, 7, 0.23476783539237725),
    (5.196152422706632, 2, 0.03509871864598465),
    (0.7, 1, 0.6111997755715705),
    (10.0, 29, 6.599862576433525e-11),
]


def test_mean_std_uses_n_minus_one():
    m, s, n = mean_std([1.0, 2.0, 3.0, 4.0])
    assert (m, n) == (2.5, 4) and s == pytest.approx(math.sqrt(5 / 3))
    assert math.isnan(mean_std([2.0])[1]) and mean_std([])[2] == 0
    assert fmt_mean_std([1.0, 3.0], 2) == "2.00 ± 1.41" and fmt_mean_std([]) == "—"
    assert "1 seed" in fmt_mean_std([1.5])


@pytest.mark.parametrize(("t", "df", "p"), TWO_SIDED_P)
def test_student_t_p_values_match_scipy(t, df, p):
    assert t_pvalue(t, df) == pytest.approx(p, rel=1e-10, abs=1e-15)


@pytest.mark.parametrize("df", sorted(T975))
def test_student_t_quantiles_match_scipy_and_the_table(df):
    q = t_quantile(0.975, df)
    assert q == pytest.approx(T975[df], rel=1e-12)
    assert t_quantile(0.025, df) == pytest.approx(-T975[df], rel=1e-12)
    assert t_pvalue(q, df) == pytest.approx(0.05, rel=1e-10)
    assert t_quantile(0.5, df) == 0.0


def test_student_t_closed_forms():
    assert t_pvalue(2.0, 1) == pytest.approx(1 - 2 / math.pi * math.atan(2.0), abs=1e-12)  # Cauchy
    assert t_pvalue(2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6), abs=1e-12)
    assert t_quantile(0.9, 1) == pytest.approx(math.tan(math.pi * 0.4), rel=1e-12)
    assert t_pvalue(1.959963984540054, 100_000) == pytest.approx(0.05, abs=1e-5)  # the normal limit
    assert t_pvalue(0.0, 5) == pytest.approx(1.0) and t_pvalue(math.inf, 3) == 0.0
    with pytest.raises(ValueError, match="q=1.0 is invalid"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df=0 is invalid"):
        t_quantile(0.9, 0)


def test_holm_step_down():
    # the textbook example: sorted 0.005 x 4, 0.01 x 3, 0.03 x 2, 0.04 x 1, made monotone
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    out = holm([0.02, float("nan"), 0.04])  # a comparison without a test does not count in m
    assert out[0] == pytest.approx(0.04) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)
    assert holm([]) == [] and holm([0.03]) == [0.03]


def test_paired_difference_interval_p_value_and_verdict():
    base = {0: 2.00, 1: 2.10, 2: 1.95}
    variant = {0: 1.97, 1: 2.06, 2: 1.93, 7: 0.0}  # seed 7 has no partner: ignored
    p = paired(variant, base)
    diffs = [-0.03, -0.04, -0.02]
    sd = math.sqrt(sum((d + 0.03) ** 2 for d in diffs) / 2)
    se = sd / math.sqrt(3)
    assert p.n == 3 and p.mean == pytest.approx(-0.03) and p.se == pytest.approx(se)
    assert p.t == pytest.approx(-0.03 / se) and p.p == pytest.approx(0.03509871864598465, rel=1e-9)
    assert (p.ci_low, p.ci_high) == pytest.approx((-0.03 - T975[2] * se, -0.03 + T975[2] * se), rel=1e-12)
    assert p.lower == 3 and p.p_holm == p.p and p.verdict == "better" and p.significant
    assert p.describe() == "-0.0300 [-0.0548, -0.0052] (3/3 seeds lower, p = 0.035): better (p_holm = 0.035)"

    # three seeds that agree in sign and |t| = 2.5 > 2: p = 0.13, so not distinguishable
    agree = paired({0: 1.0, 1: 1.0, 2: 1.0}, {0: 1.1, 1: 1.0 + 0.02, 2: 1.0 + 0.06})
    assert agree.lower == 3 and abs(agree.t) > 2 and agree.p > 0.05 and agree.verdict == "not distinguishable"
    worse = paired({0: 2.05, 1: 2.16, 2: 2.02}, base)
    assert worse.verdict == "worse" and worse.ci_low > 0


def test_single_seed_and_no_seed_claim_nothing():
    one = paired({0: 1.0}, {0: 2.0})
    assert one.verdict == "single seed" and not one.significant and "no interval, no test" in one.describe()
    assert paired({0: 1.0}, {1: 2.0}).verdict == "no common seeds"
    identical = paired({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})
    assert identical.t == 0 and identical.p == 1.0 and identical.verdict == "not distinguishable"
    assert "Holm" in STATS_RULE and "p_holm < 0.05" in STATS_RULE and "|t|" not in STATS_RULE


def test_a_report_family_is_holm_corrected_and_counts_a_comparison_once():
    base = {0: 2.00, 1: 2.10, 2: 1.95}
    strong = {0: 1.97, 1: 2.06, 2: 1.93}  # p = 0.035 alone
    weak = {0: 2.01, 1: 2.09, 2: 1.97}
    first = Comparisons()
    assert first.paired(strong, base).verdict == "better"  # the first pass: uncorrected
    first.paired(weak, base)
    first.paired(strong, base)  # asked again (a table and a verdict): the same hypothesis
    first.paired({0: 1.0}, {0: 2.0})  # one seed: no test, not in the family
    family = first.corrected()
    p = family.paired(strong, base)
    assert p.family == 2 and p.p_holm == pytest.approx(2 * p.p) and p.verdict == "not distinguishable"
    assert "(p_holm = 0.07)" in p.describe() and "p = 0.035" in p.describe()
    assert family.summary().startswith("2 paired comparisons (2 over 3 seeds), Holm-corrected together")
    with pytest.raises(RuntimeError, match="first pass did not ask"):
        family.paired(weak, {0: 2.0, 1: 2.0, 2: 2.0})


def test_p_value_formatting_never_rounds_across_the_threshold():
    assert fmt_p(0.0496) == "p = 0.0496" and fmt_p(0.3) == "p = 0.3" and fmt_p(0.021) == "p = 0.021"
    assert fmt_p(0.0004, "p_holm") == "p_holm < 0.001" and fmt_p(float("nan")) == "p = —"
    assert seed_shortfall(3) == "3 seeds: below the 5 the README requires" and seed_shortfall(5) == ""


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
