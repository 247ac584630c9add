"""The kimi-scaling report (``experiments/kimi-scaling.toml``): the scaling report's
sections on the Kimi Linear backbone, the LLaMA-backbone fit of ``experiments/scaling.toml`` beside it,
and every comparison at equal wall-clock time as well as at equal tokens.

Equal wall-clock: per size, each scheme's step time against the baseline's, measured side by side
(``attnres.experiments.step_cost``: the runs rebuilt and their steps timed round-robin in one process,
cached in the runs directory; the runs' own logged times, taken hours apart, are shown beside it); at the baseline's
training time a scheme has made steps / r steps, and its validation loss there is read off its own
evaluation curve (linear in the step between evaluations; a scheme faster than the baseline keeps its
final loss, which understates it). The paired Δ against the baseline's final loss is then taken per seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnres.experiments.fit import compute_multiplier
from attnres.experiments.reports.common import Report, fmt, md_table
from attnres.experiments.reports.kimi_linear import _median_step_seconds
from attnres.experiments.reports.scaling import (
    _interval,
    bootstrap_laws,
    fitted_laws,
    leave_largest_out,
    scaling_report,
)
from attnres.experiments.results import Collected, Result, collect
from attnres.experiments.spec import ExperimentError, load_spec
from attnres.experiments.stats import Paired
from attnres.experiments.step_cost import (
    ROUNDS,
    STEP_COST_FILE,
    cached_step_costs,
    measure_step_costs,
)

LLAMA_SPEC = "scaling"  # the LLaMA-backbone scaling experiment, beside this one


def _loss_at_step(r: Result, step: float) -> float:
    curve = r.eval_curve()
    if not len(curve["step"]):
        return float("nan")
    return float(np.interp(step, curve["step"], curve["val_loss"]))


def _measured_costs(col: Collected, size: str, base: str) -> dict | None:
    """The side-by-side step costs of one size (``attnres.experiments.step_cost``), cached in the
    experiment's runs directory; None when its seed-0 runs are not all planned there."""
    runs = {}
    for s in col.points("scheme"):
        planned = [r for r in col.select(size=size, scheme=s) if r.run.seed == min(col.spec.seeds)]
        if not planned:
            return None
        runs[s] = planned[0].run
    done = [r for r in col.results if r.done]
    if not done:
        return None
    runs_dir = Path(done[0].dir).parent.parent / col.spec.name
    return cached_step_costs(runs_dir, size, lambda: measure_step_costs(runs, base, log=lambda _: None))


def _at_equal_time(rep: Report, col: Collected, size: str, scheme: str, ratio: float) -> Paired:
    """The paired Δ against the baseline's final loss of ``scheme``'s loss after the baseline's training time,
    for a step ``ratio`` times the baseline's (read off its evaluation curve)."""
    runs = [r for r in col.select(size=size, scheme=scheme) if r.done]
    steps = runs[0].run.train.steps
    at_time = {r.run.seed: _loss_at_step(r, min(steps, steps / ratio)) for r in runs}
    # the baseline's final loss on the same evaluation as the curve (the trainer's, not the whole split)
    base_runs = [r for r in col.select(size=size, scheme=col.spec.baseline or "prenorm") if r.done]
    return rep.paired(at_time, {r.run.seed: _loss_at_step(r, r.run.train.steps) for r in base_runs})


def equal_time_rows(rep: Report, col: Collected) -> list[list[str]]:
    """Per size and non-baseline scheme: the step-time ratio (side by side, ``_measured_costs``; from the
    runs' own logs where it cannot be measured) and the paired Δ at equal tokens and at the baseline's
    training time."""
    base = col.spec.baseline or "prenorm"
    rows = []
    for size in col.points("size"):
        base_runs = [r for r in col.select(size=size, scheme=base) if r.done]
        if not base_runs:
            continue
        costs = _measured_costs(col, size, base)
        base_step = float(np.median([_median_step_seconds(r) for r in base_runs]))
        ref = col.losses(size=size, scheme=base)
        for s in col.points("scheme"):
            runs = [r for r in col.select(size=size, scheme=s) if r.done]
            if s == base or not runs:
                continue
            logged = float(np.median([_median_step_seconds(r) for r in runs])) / base_step
            if costs is not None:
                c = costs["schemes"][s]
                ratio, shown = c["ratio"], f"{c['ratio']:.3f} ({c['ratio_min']:.3f}-{c['ratio_max']:.3f})"
            else:
                ratio, shown = logged, "-"
            steps = runs[0].run.train.steps
            rows.append(
                [
                    size,
                    s,
                    shown,
                    f"{logged:.2f}",
                    f"{min(steps, steps / ratio):.0f} of {steps}",
                    rep.paired(col.losses(size=size, scheme=s), ref).describe(),
                    _at_equal_time(rep, col, size, s, ratio).describe(),
                ]
            )
    return rows


def equal_time_section(rep: Report, col: Collected, title: str) -> None:
    base = col.spec.baseline or "prenorm"
    rows = equal_time_rows(rep, col)
    if not rows:
        return
    rep.add(
        title,
        "",
        f"Step-time ratio, side by side: each size's seed-0 runs rebuilt from their configs and their "
        f"training steps timed round-robin in one process on one thread of this machine "
        f"(`attnres.experiments.step_cost`: the median over {ROUNDS} rounds of each round's time over "
        f"{base}'s in the same round, min-max beside it; cached in the runs directory's {STEP_COST_FILE}). "
        f"The runs' own logged ratio is beside it: the runs trained at different times under different "
        f"loads, so it measures the machine more than the scheme. At equal time a scheme has made the steps "
        f"{base} made in its training time divided by the side-by-side ratio; its loss there is read off its "
        "own evaluation curve (the trainer's evaluations, also for the baseline's final loss), "
        "mid-schedule (its learning rate not yet decayed), where a run scheduled for "
        "that many steps would end lower: the Δ at equal time is an upper bound on the cost of the slower "
        "step (the arena experiment trains equal-time runs for real).",
        "",
        md_table(
            [
                "size",
                "scheme",
                f"step time / {base}, side by side",
                "logged by the runs",
                "steps at equal time",
                "Δ at equal tokens",
                "Δ at equal time (upper bound)",
            ],
            rows,
        ),
        "",
    )


def _laws_table(label: str, col: Collected) -> list[list[str]]:
    base = col.spec.baseline or "prenorm"
    fits, C_of = fitted_laws(col)
    if not C_of:
        return []
    C_max = max(C_of.values())
    boot = bootstrap_laws(col, C_of, C_max)
    lo_alpha, lo_mult = leave_largest_out(col, C_of, C_max)
    out = []
    for s, fit in fits.items():
        mult = f"{compute_multiplier(fits[base], fit, C_max):.2f}×" if base in fits and s != base else "—"
        m_iv = boot["multiplier"].get(s)
        out.append(
            [
                label,
                s,
                f"{fit.alpha:.4f}",
                _interval(boot["alpha"].get(s), ".4f"),
                fmt(lo_alpha.get(s), 4),
                f"{fit.r2:.3f}",
                str(fit.n),
                f"{C_max:.3g}",
                mult,
                _interval(m_iv, ".2f").replace("]", "]×") if m_iv and s != base else "—",
                f"{lo_mult[s]:.2f}×" if s in lo_mult else "—",
            ]
        )
    return out


def kimi_scaling_report(rep: Report) -> None:
    col = rep.col
    scaling_report(rep)
    runs_root = next((r.dir.parent.parent for r in col.results if r.done), None)
    llama: Collected | None = None
    if runs_root is not None:
        try:
            llama = collect(load_spec(LLAMA_SPEC, col.spec.path.parent), runs_root)
        except ExperimentError:
            llama = None
    rows = _laws_table("Kimi Linear (this experiment)", col)
    if llama is not None:
        rows += _laws_table(f"LLaMA ({LLAMA_SPEC}.toml)", llama)
    if rows:
        rep.add(
            "## Beside the LLaMA backbone",
            "",
            "α of L = A·C^-α per scheme and the compute multiplier at each experiment's largest budget (how "
            "much more compute the baseline needs on its fitted curve to reach the scheme's fitted loss). "
            "The two experiments differ in backbone, sizes, budgets and batch shape (LLaMA: 16 x 128 "
            "tokens, 1.5x more tokens per size; Kimi: 16 x 64, equal tokens per parameter), so compare "
            "the multipliers, not the losses. Intervals and the fits without the largest size as in the "
            "power-law section above. Does the Kimi advantage grow with scale? Read the Δ column "
            "of the per-size table from the smallest size to the largest.",
            "",
            md_table(
                [
                    "backbone",
                    "scheme",
                    "α",
                    "α, seed-bootstrap 95 %",
                    "α without the largest size",
                    "R²",
                    "sizes",
                    "largest C (PF-days)",
                    "compute multiplier",
                    "multiplier, seed-bootstrap 95 %",
                    "multiplier without the largest size, at the same C",
                ],
                rows,
            ),
            "",
        )
    equal_time_section(rep, col, "## Equal wall-clock time (Kimi Linear)")
    if llama is not None and llama.n_done:
        equal_time_section(rep, llama, f"## Equal wall-clock time (LLaMA, {LLAMA_SPEC}.toml)")
    rep.add("## Verdict", "", kimi_scaling_verdict(rep), "")


def kimi_scaling_verdict(rep: Report) -> str:
    """One line: the paired Δ of each scheme at the smallest and the largest size, and the multiplier."""
    col = rep.col
    base = col.spec.baseline or "prenorm"
    sizes = [s for s in col.points("size") if col.losses(size=s, scheme=base)]
    if len(sizes) < 2:
        return "Verdict: fewer than two sizes finished."
    fits, C_of = fitted_laws(col)
    parts = []
    for s in col.points("scheme"):
        if s == base:
            continue
        pairs = [(z, rep.paired(col.losses(size=z, scheme=s), col.losses(size=z, scheme=base))) for z in sizes]
        pairs = [(z, d) for z, d in pairs if d.n]
        if not pairs:
            continue
        if len(pairs) < 2:
            z, d = pairs[0]
            parts.append(f"{s} Δ {d.mean:+.3f} {d.interval(3)} at {z} only ({d.verdict_text()}): no trend yet")
            continue
        (first, _), (last, ds_last) = pairs[0], pairs[-1]
        trend = " → ".join(f"{d.mean:+.3f}" for _, d in pairs)
        mult = ""
        if base in fits and s in fits:
            C = max(C_of.values())
            lo, hi = bootstrap_laws(col, C_of, C)["multiplier"].get(s, (float("nan"), float("nan")))
            without = leave_largest_out(col, C_of, C)[1].get(s)
            mult = (
                f", {compute_multiplier(fits[base], fits[s], C):.2f}× compute (seed bootstrap [{lo:.2f}, {hi:.2f}]"
                + (f", {without:.2f}× fitted without {last}" if without is not None else "")
                + ")"
            )
        parts.append(
            f"{s} Δ {trend} from {first} to {last} ({ds_last.interval(3)}, {ds_last.verdict_text()} at {last}{mult}"
            f"{_at_time(rep, last, s)})"
        )
    return "Verdict (does the Kimi-backbone advantage grow with scale?): " + "; ".join(parts) + "."


def _at_time(rep: Report, size: str, scheme: str) -> str:
    """', at equal wall-clock Δ (verdict; step ratio)' at one size, from the side-by-side step costs."""
    col = rep.col
    base = col.spec.baseline or "prenorm"
    costs = _measured_costs(col, size, base)
    runs = [r for r in col.select(size=size, scheme=scheme) if r.done]
    if costs is None or not runs:
        return ""
    ratio = costs["schemes"][scheme]["ratio"]
    d = _at_equal_time(rep, col, size, scheme, ratio)
    return (
        f"; at equal wall-clock {d.mean:+.3f} {d.interval(3)}, {d.verdict_text()}, its step {ratio:.2f}× {base}'s"
        if d.n
        else ""
    )
