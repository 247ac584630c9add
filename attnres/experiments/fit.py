"""Compute counting and power-law fits for the scaling experiment.

FLOP counting (``FLOPS_FORMULA``), per training token of a LLaMA-style decoder
with d = d_model, L_b Transformer blocks, context T, vocabulary V:

    N_matmul = L_b (2 d^2 + 2 d d_kv + 3 d d_ff) + d V     (every weight used in a matmul:
                                                              attention, SwiGLU, LM head;
                                                              not the embedding lookup or norms)
    C/token  = 6 N_matmul + 6 L_b T d                        (forward 2 N + 2 L_b T d for QK^T and AV
                                                              over the full context, Kaplan et al.;
                                                              backward twice the forward)
    C        = C/token x training tokens

The residual scheme's own arithmetic (depth attention: O(L d) per sublayer and
token, under 1 % of C here) is not counted: every scheme of one size gets the
prenorm model's C, as in the paper's comparison at equal compute. C is reported
in FLOPs and in PFLOP/s-days (8.64e19 FLOPs), the unit of the paper's fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PFLOPS_DAY = 1e15 * 86400
FLOPS_FORMULA = (
    "C = (6 N_matmul + 6 L_b T d) x tokens, with N_matmul = L_b (2 d^2 + 2 d d_kv + 3 d d_ff) "
    "+ d V (attention projections, SwiGLU, LM head; the embedding lookup, norms and the "
    "residual scheme's own O(L d) arithmetic are not counted)"
)


def matmul_params(model) -> int:
    """N_matmul of a ModelConfig (or a dict of its fields)."""
    g = (lambda k: model[k]) if isinstance(model, dict) else (lambda k: getattr(model, k))
    d, V, L = g("d_model"), g("vocab_size"), g("n_layers")
    d_kv = g("n_kv_heads") * (d // g("n_heads"))
    return L * (2 * d * d + 2 * d * d_kv + 3 * d * g("d_ff")) + d * V


def flops_per_token(model, seq_len: int) -> float:
    g = (lambda k: model[k]) if isinstance(model, dict) else (lambda k: getattr(model, k))
    return 6.0 * matmul_params(model) + 6.0 * g("n_layers") * seq_len * g("d_model")


@dataclass
class PowerLaw:
    """L = A * C^-alpha, fitted by least squares on log L against log C."""

    A: float
    alpha: float
    r2: float
    n: int

    def __call__(self, C):
        return self.A * C ** (-self.alpha)

    def inverse(self, loss: float) -> float:
        """The compute at which this curve reaches ``loss``."""
        return (loss / self.A) ** (-1.0 / self.alpha)

    def __str__(self) -> str:
        return f"L = {self.A:.4g} * C^-{self.alpha:.4f}"


def fit_power_law(C: Sequence[float], L: Sequence[float]) -> PowerLaw:
    pairs = [
        (c, loss)
        for c, loss in zip(C, L, strict=True)
        if c > 0 and loss > 0 and math.isfinite(c) and math.isfinite(loss)
    ]
    if len(pairs) < 2 or len({c for c, _ in pairs}) < 2:
        raise ValueError("a power-law fit needs at least two distinct compute values")
    xs = [math.log(c) for c, _ in pairs]
    ys = [math.log(loss) for _, loss in pairs]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return PowerLaw(A=math.exp(intercept), alpha=-slope, r2=r2, n=n)


def compute_multiplier(baseline: PowerLaw, variant: PowerLaw, C: float) -> float:
    """How much more compute the baseline needs to match the variant's fitted loss at C
    (the paper: Block AttnRes matches a baseline trained with 1.25x compute)."""
    return baseline.inverse(variant(C)) / C


def measured_multiplier(baseline_loss: float, variant_loss: float, alpha: float) -> float:
    """The compute multiplier of two losses measured at the same compute, through the baseline's
    fitted slope: on L = A C^-alpha, going from baseline_loss down to variant_loss takes
    (baseline_loss / variant_loss)^(1/alpha) times the compute. Unlike reading a measured loss off the
    baseline's fitted curve, the baseline's own residual at that compute does not enter."""
    return (baseline_loss / variant_loss) ** (1.0 / alpha)
