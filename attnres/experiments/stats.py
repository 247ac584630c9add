"""Seed statistics: mean ± std, paired comparisons over seeds, their Holm correction within a report.

Runs of one experiment that share a seed share the data order (batches are drawn
from the seed and the step alone) and the initial weights of every sublayer
(the model is built under ``torch.manual_seed(seed)``, and residual-scheme
parameters are created after the blocks), so the seed-to-seed noise that two
schemes share cancels in the per-seed difference.

The rule (``STATS_RULE``): for a variant against a baseline, d_s = loss(variant, s)
- loss(baseline, s) over the seeds both finished; mean d, its standard error
se = std(d) / sqrt(n) (n - 1 in the std), t = mean / se, the two-sided p-value of
Student's t with n - 1 degrees of freedom and the 95 % interval mean ± t_{0.975, n-1}·se.
Every comparison a report makes belongs to one family (``Comparisons``) whose
p-values are Holm-corrected together; a difference is *better* or *worse* only when
its corrected p_holm < 0.05, otherwise *not distinguishable*. With one seed there is
no noise estimate: no interval, no test, no verdict.

The Student t distribution is computed here (the regularised incomplete beta
function by its continued fraction) rather than taken from scipy, which the
package does not depend on; tests/experiments/test_experiment_stats.py checks it
against scipy's values in float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

ALPHA = 0.05  # family-wise error rate of a report's comparisons (Holm)
CONFIDENCE = 0.95
MIN_HEADLINE_SEEDS = 5  # a headline claim needs this many seeds per arm; rows with fewer say so
STATS_RULE = (
    "d_s = loss(variant, s) − loss(baseline, s) over the seeds both finished (same seed = same data order and "
    "same sublayer initialisation); a cell reads `mean Δ [95 % interval] (k/n seeds lower, p = …): verdict`, "
    "with the interval mean ± t_{0.975, n−1}·s.e. and p the two-sided paired t-test. The p-values of all the "
    "comparisons of this report are Holm-corrected together (p_holm); a difference is *better* or *worse* "
    "only when p_holm < 0.05, otherwise *not distinguishable*. One seed: no interval and no test"
)


def mean_std(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, sample std with n - 1, n); std is nan for n < 2, both nan for n = 0."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan"), 0
    m = sum(xs) / n
    if n < 2:
        return m, float("nan"), 1
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)), n


def fmt_mean_std(values: Sequence[float | None], digits: int = 4) -> str:
    m, s, n = mean_std(values)
    if n == 0:
        return "—"
    if n == 1:
        return f"{m:.{digits}f} (1 seed)"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def mean_interval(values: Iterable[float | None]) -> tuple[float, float, float, int]:
    """(mean, low, high, n): the 95 % interval of the mean over seeds, mean ± t_{0.975, n-1}·std/sqrt(n);
    low and high are nan for n < 2."""
    m, s, n = mean_std(values)
    if n < 2:
        return m, float("nan"), float("nan"), n
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * s / math.sqrt(n)
    return m, m - half, m + half, n


def fmt_mean_interval(values: Sequence[float | None], digits: int = 4) -> str:
    """'5.3758 [5.3701, 5.3815] (5 seeds)'; one seed: no interval."""
    m, lo, hi, n = mean_interval(values)
    if n == 0:
        return "—"
    if n == 1:
        return f"{m:.{digits}f} (1 seed)"
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] ({n} seeds)"


def percentile_interval(samples: Sequence[float]) -> tuple[float, float]:
    """The central 95 % of bootstrap samples (nan entries dropped): the percentile interval, with linear
    interpolation between order statistics; (nan, nan) without samples."""
    xs = sorted(x for x in samples if not math.isnan(x))
    if not xs:
        return float("nan"), float("nan")

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    tail = (1.0 - CONFIDENCE) / 2
    return at(tail), at(1.0 - tail)


# ----------------------------------------------------------------------------- Student t


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1 - x) / b


def t_pvalue(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with ``df`` degrees of freedom."""
    if df < 1 or math.isnan(t):
        return float("nan")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (0 < q < 1), by bisection on
    :func:`t_pvalue`, which is monotone in |t|: exact to float64 rounding, no table."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q!r} is invalid: a quantile needs 0 < q < 1")
    if df < 1:
        raise ValueError(f"df={df!r} is invalid: Student's t needs at least 1 degree of freedom")
    if q == 0.5:
        return 0.0
    tail = 2.0 * min(q, 1.0 - q)  # the two-sided p-value of the quantile's |t|
    lo, hi = 0.0, 1.0
    while t_pvalue(hi, df) > tail:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if t_pvalue(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    t = 0.5 * (lo + hi)
    return t if q > 0.5 else -t


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: the i-th smallest of m is multiplied by
    m - i + 1, then made monotone and capped at 1. NaN entries (no test) stay NaN and do not count in m."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(tested)
    out = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def fmt_p(p: float, name: str = "p") -> str:
    """'p = 0.021', 'p < 0.001': two significant digits, more where two would round across ALPHA (0.0496
    is not shown as 0.05)."""
    if math.isnan(p):
        return f"{name} = —"
    if p < 0.001:
        return f"{name} < 0.001"
    digits = 2
    while digits < 8 and (float(f"{p:.{digits}g}") < ALPHA) != (p < ALPHA):
        digits += 1
    return f"{name} = {p:.{digits}g}"


def seed_shortfall(n: int) -> str:
    """'3 seeds: below the 5 the README requires' for a headline row with too few seeds; '' otherwise."""
    if n >= MIN_HEADLINE_SEEDS:
        return ""
    return f"{n} seed{'s' if n != 1 else ''}: below the {MIN_HEADLINE_SEEDS} the README requires"


# ----------------------------------------------------------------------------- paired comparison


@dataclass(frozen=True)
class Paired:
    n: int
    mean: float  # mean of variant - baseline (negative: the variant has lower loss)
    std: float
    se: float
    t: float
    p: float  # two-sided paired t-test, uncorrected
    ci_low: float  # 95 % interval of the mean difference (t distribution)
    ci_high: float
    lower: int  # seeds where the variant is lower (better)
    higher: int
    p_holm: float  # p corrected across the report's comparisons (= p for a comparison made alone)
    family: int = 1  # how many comparisons the correction spans

    @property
    def verdict(self) -> str:
        """'better' | 'worse' (p_holm < ALPHA) | 'not distinguishable' | 'single seed' | 'no common seeds'."""
        if self.n == 0:
            return "no common seeds"
        if self.n == 1:
            return "single seed"
        if self.p_holm < ALPHA:
            return "better" if self.mean < 0 else "worse"
        return "not distinguishable"

    @property
    def significant(self) -> bool:
        return self.verdict in ("better", "worse")

    def verdict_text(self) -> str:
        """The verdict with the p-value it rests on: 'better (p_holm = 0.012)'."""
        if self.n < 2:
            return self.verdict
        return f"{self.verdict} ({fmt_p(self.p_holm, 'p_holm')})"

    def interval(self, digits: int = 4) -> str:
        return f"[{self.ci_low:+.{digits}f}, {self.ci_high:+.{digits}f}]"

    def describe(self, digits: int = 4) -> str:
        if self.n == 0:
            return "no common seeds"
        if self.n == 1:
            return f"{self.mean:+.{digits}f} (1 seed: no interval, no test)"
        return (
            f"{self.mean:+.{digits}f} {self.interval(digits)} ({self.lower}/{self.n} seeds lower, "
            f"{fmt_p(self.p)}): {self.verdict_text()}"
        )


def paired(variant: Mapping[int, float | None], baseline: Mapping[int, float | None]) -> Paired:
    """Paired comparison over the seeds with a value (not None, not NaN) in both (dicts seed -> loss), on
    its own (p_holm = p); a report's comparisons go through :class:`Comparisons`. See STATS_RULE."""
    diffs: list[float] = []
    for seed in sorted(variant):
        v, b = variant[seed], baseline.get(seed)
        if v is not None and b is not None and not math.isnan(v) and not math.isnan(b):
            diffs.append(v - b)
    n = len(diffs)
    nan = float("nan")
    if n == 0:
        return Paired(0, nan, nan, nan, nan, nan, nan, nan, 0, 0, nan)
    lower = sum(1 for d in diffs if d < 0)
    higher = sum(1 for d in diffs if d > 0)
    m, s, _ = mean_std(diffs)
    if n == 1:
        return Paired(1, m, nan, nan, nan, nan, nan, nan, lower, higher, nan)
    se = s / math.sqrt(n)
    t = m / se if se != 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
    p = t_pvalue(t, n - 1)
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * se
    return Paired(n, m, s, se, t, p, m - half, m + half, lower, higher, p)


def _key(variant: Mapping[int, float | None], baseline: Mapping[int, float | None]) -> tuple:
    return tuple(sorted(variant.items())), tuple(sorted(baseline.items()))


class Comparisons:
    """The paired comparisons of one report, Holm-corrected together.

    A report is built twice: the first pass asks every comparison it will print (``paired``) and gets
    uncorrected results; ``corrected()`` then returns the family whose ``paired`` gives each comparison
    with its p_holm over all of them. A comparison is identified by its two seed -> loss mappings, so
    the same pair shown in a table and in a verdict counts once. The second pass may ask only what the
    first asked: anything else would escape the correction, and raises."""

    def __init__(self) -> None:
        self._asked: dict[tuple, Paired] = {}
        self._final: dict[tuple, Paired] | None = None

    def paired(self, variant: Mapping[int, float | None], baseline: Mapping[int, float | None]) -> Paired:
        key = _key(variant, baseline)
        if self._final is None:
            return self._asked.setdefault(key, paired(variant, baseline))
        if key not in self._final:
            raise RuntimeError(
                "a comparison was asked after the Holm correction that the first pass did not ask: the report "
                "must make the same comparisons on both passes"
            )
        return self._final[key]

    def corrected(self) -> Comparisons:
        keys = list(self._asked)
        tests = [self._asked[k] for k in keys]
        adjusted = holm([p.p for p in tests])
        m = sum(1 for p in tests if p.n >= 2)
        out = Comparisons()
        out._asked = dict(self._asked)
        out._final = {k: replace(p, p_holm=a, family=m) for k, p, a in zip(keys, tests, adjusted, strict=True)}
        return out

    @property
    def tests(self) -> list[Paired]:
        """The comparisons with a test (two or more seeds), in the order first asked."""
        return [p for p in (self._final or self._asked).values() if p.n >= 2]

    def summary(self) -> str:
        """'12 comparisons (8 over 2 seeds, 4 over 3 seeds), Holm-corrected together; 3 better, 1 worse'."""
        tests = self.tests
        if not tests:
            return "no paired comparison with two or more seeds"
        by_n: dict[int, int] = {}
        for p in tests:
            by_n[p.n] = by_n.get(p.n, 0) + 1
        seeds = ", ".join(f"{c} over {n} seeds" for n, c in sorted(by_n.items()))
        better = sum(p.verdict == "better" for p in tests)
        worse = sum(p.verdict == "worse" for p in tests)
        plural = "s" if len(tests) != 1 else ""
        return (
            f"{len(tests)} paired comparison{plural} ({seeds}), Holm-corrected together at a family-wise "
            f"{ALPHA:g}: {better} better, {worse} worse, {len(tests) - better - worse} not distinguishable"
        )


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None with fewer than 3 pairs."""
    pairs = [
        (x, y)
        for x, y in zip(a, b, strict=True)
        if x is not None and y is not None and not math.isnan(x) and not math.isnan(y)
    ]
    if len(pairs) < 3:
        return None
    ra, rb = ranks([p[0] for p in pairs]), ranks([p[1] for p in pairs])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va > 0 and vb > 0 else None


def ranks(values: Sequence[float]) -> list:
    """1-based ranks, ties get their average rank (lowest value = rank 1)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out
