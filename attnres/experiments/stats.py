"""Seed statistics: mean ± std, and paired comparisons over seeds.

Runs of one experiment that share a seed share the data order (batches are drawn
from the seed and the step alone) and the initial weights of every sublayer
(the model is built under ``torch.manual_seed(seed)``, and residual-scheme
parameters are created after the blocks), so the seed-to-seed noise that two
schemes share cancels in the per-seed difference.

The rule (``NOISE_RULE``): for a variant against a baseline, d_s = loss(variant,
s) - loss(baseline, s) over the seeds both finished; mean d, its standard error
se = std(d) / sqrt(n) (n - 1 in the std) and t = mean / se. A difference *exceeds
seed noise* when |t| >= 2 and every seed agrees on its sign; otherwise it is
*within noise*. With one seed there is no noise estimate and nothing is claimed.
A two-sided paired t-test p-value is printed too: with 2-3 seeds the |t| >= 2
threshold is lenient (p is about 0.30 at n = 2 and 0.18 at n = 3), which is why
the rule also asks for a unanimous sign.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

T_THRESHOLD = 2.0
NOISE_RULE = (
    "a difference exceeds seed noise when the paired t-statistic over seeds satisfies |t| >= 2 "
    "and every seed agrees on its sign; otherwise it is reported as within noise "
    "(t = mean of the per-seed differences / its standard error; same seed = same data order "
    "and same sublayer initialisation)"
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


# ----------------------------------------------------------------------------- paired comparison


@dataclass
class Paired:
    n: int
    mean: float  # mean of variant - baseline (negative: the variant has lower loss)
    std: float
    se: float
    t: float
    p: float
    lower: int  # seeds where the variant is lower (better)
    higher: int
    verdict: str  # "better" | "worse" | "within noise" | "single seed" | "no common seeds"

    @property
    def exceeds_noise(self) -> bool:
        return self.verdict in ("better", "worse")

    def describe(self, digits: int = 4) -> str:
        if self.n == 0:
            return "no common seeds"
        if self.n == 1:
            return f"{self.mean:+.{digits}f} (1 seed: no noise estimate)"
        t = "inf" if math.isinf(self.t) else f"{self.t:+.1f}"
        return (
            f"{self.mean:+.{digits}f} ± {self.se:.{digits}f} (t = {t}, {self.lower}/{self.n} seeds lower): "
            f"{self.verdict}"
        )


def paired(
    variant: Mapping[int, float | None], baseline: Mapping[int, float | None], threshold: float = T_THRESHOLD
) -> Paired:
    """Paired comparison over the seeds with a value (not None, not NaN) in both (dicts seed -> loss);
    see NOISE_RULE."""
    diffs: list[float] = []
    for seed in sorted(variant):
        v, b = variant[seed], baseline.get(seed)
        if v is not None and b is not None and not math.isnan(v) and not math.isnan(b):
            diffs.append(v - b)
    n = len(diffs)
    if n == 0:
        nan = float("nan")
        return Paired(0, nan, nan, nan, nan, nan, 0, 0, "no common seeds")
    lower = sum(1 for d in diffs if d < 0)
    higher = sum(1 for d in diffs if d > 0)
    m, s, _ = mean_std(diffs)
    if n == 1:
        return Paired(1, m, float("nan"), float("nan"), float("nan"), float("nan"), lower, higher, "single seed")
    se = s / math.sqrt(n)
    t = m / se if se != 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
    p = t_pvalue(t, n - 1)
    unanimous = lower == n or higher == n
    verdict = ("better" if m < 0 else "worse") if abs(t) >= threshold and unanimous else "within noise"
    return Paired(n, m, s, se, t, p, lower, higher, verdict)


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
