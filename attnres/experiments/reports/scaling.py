"""The scaling report (axes size, scheme): per-size losses, L = A·C^-α fits per scheme, the compute
multiplier at the largest budget, Figure 4.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnres.experiments import figures
from attnres.experiments.fit import (
    FLOPS_FORMULA,
    PFLOPS_DAY,
    PowerLaw,
    compute_multiplier,
    fit_power_law,
    flops_per_token,
    matmul_params,
    measured_multiplier,
)
from attnres.experiments.reports.common import (
    Report,
    fmt,
    md_table,
    model_of,
    shares_sublayer_init,
)
from attnres.experiments.results import Collected, finite
from attnres.experiments.stats import fmt_mean_std, mean_std, percentile_interval


def _fmt_multipliers(values: list[float]) -> str:
    """Per-seed compute multipliers as 'mean× ± std (n seeds)'."""
    m, sd, n = mean_std(values)
    if n == 0:
        return "—"
    return f"{m:.2f}× (1 seed)" if n == 1 else f"{m:.2f}× ± {sd:.2f} ({n} seeds)"


def fitted_laws(col: Collected) -> tuple[dict[str, PowerLaw], dict[str, float]]:
    """(scheme -> L = A·C^-α over the per-size mean losses, size -> C in PF-days) of a collection with
    axes size and scheme; a scheme with fewer than two sizes has no fit. What ``scaling_report`` fits,
    for a report that sets another experiment's fits beside its own."""
    base = col.spec.baseline or "prenorm"
    C_of: dict[str, float] = {}
    points: dict[str, tuple[list[float], list[float]]] = {}
    for size in col.points("size"):
        model = model_of(col, size=size, scheme=base) or model_of(col, size=size)
        runs = col.select(size=size)
        if model is None or not runs:
            continue
        C_of[size] = flops_per_token(model, runs[0].run.train.seq_len) * runs[0].run.tokens / PFLOPS_DAY
        for s in col.points("scheme"):
            m, _, n = mean_std(col.losses(size=size, scheme=s).values())
            if n:
                points.setdefault(s, ([], []))[0].append(C_of[size])
                points[s][1].append(m)
    fits = {}
    for s, (Cs, Ls) in points.items():
        try:
            fits[s] = fit_power_law(Cs, Ls)
        except ValueError:
            continue
    return fits, C_of


BOOTSTRAP_REPLICATES = 2000
BOOTSTRAP_SEED = 0  # fixed, so a report regenerates byte for byte


def _size_means(col: Collected, seeds_of: dict[str, list[int]] | None = None) -> dict[str, dict[str, float]]:
    """scheme -> size -> mean loss over the given seeds of each size (all finished seeds without
    ``seeds_of``; a seed drawn twice counts twice)."""
    out: dict[str, dict[str, float]] = {}
    for size in col.points("size"):
        for s in col.points("scheme"):
            losses = col.losses(size=size, scheme=s)
            vals = [losses[k] for k in (seeds_of[size] if seeds_of else sorted(losses)) if k in losses]
            vals = [v for v in vals if finite(v)]
            if vals:
                out.setdefault(s, {})[size] = sum(vals) / len(vals)
    return out


def _laws(means: dict[str, dict[str, float]], C_of: dict[str, float], sizes: list[str]) -> dict[str, PowerLaw]:
    fits = {}
    for s, by_size in means.items():
        pts = [(C_of[z], by_size[z]) for z in sizes if z in by_size and z in C_of]
        try:
            fits[s] = fit_power_law([c for c, _ in pts], [v for _, v in pts])
        except ValueError:
            continue
    return fits


def _alphas_and_multipliers(
    fits: dict[str, PowerLaw], base: str, C: float
) -> tuple[dict[str, float], dict[str, float]]:
    alphas = {s: f.alpha for s, f in fits.items()}
    mults = {s: compute_multiplier(fits[base], f, C) for s, f in fits.items() if s != base and base in fits}
    return alphas, mults


def bootstrap_laws(col: Collected, C_of: dict[str, float], C: float) -> dict[str, dict[str, tuple[float, float]]]:
    """Seed-bootstrap 95 % intervals: ``{"alpha": scheme -> (low, high), "multiplier": scheme -> (low, high)}``.

    Each replicate redraws, per size, the finished seeds with replacement (one draw per size for every
    scheme, so the pairing of schemes within a seed is kept), refits the per-size means and recomputes α
    and the multiplier at C. With three seeds, for example, a size has only ten distinct draws, and the bootstrap
    understates the spread of a mean by the factor sqrt((n - 1) / n): the interval is a lower bound on
    the seed uncertainty, and it leaves out the uncertainty of the power-law form itself."""
    base = col.spec.baseline or "prenorm"
    sizes = [z for z in col.points("size") if z in C_of]
    seeds = {z: sorted({r.run.seed for r in col.select(size=z) if r.done}) for z in sizes}
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws: dict[str, dict[str, list[float]]] = {"alpha": {}, "multiplier": {}}
    for _ in range(BOOTSTRAP_REPLICATES):
        pick = {z: [seeds[z][i] for i in rng.integers(0, len(seeds[z]), len(seeds[z]))] for z in sizes if seeds[z]}
        alphas, mults = _alphas_and_multipliers(_laws(_size_means(col, pick), C_of, list(pick)), base, C)
        for s, a in alphas.items():
            draws["alpha"].setdefault(s, []).append(a)
        for s, m in mults.items():
            draws["multiplier"].setdefault(s, []).append(m)
    return {k: {s: percentile_interval(v) for s, v in by.items()} for k, by in draws.items()}


def leave_largest_out(col: Collected, C_of: dict[str, float], C: float) -> tuple[dict[str, float], dict[str, float]]:
    """α and the compute multiplier at C from fits without the largest size (empty below three sizes):
    how much the headline numbers lean on one point."""
    base = col.spec.baseline or "prenorm"
    sizes = sorted(C_of, key=C_of.__getitem__)
    if len(sizes) < 3:
        return {}, {}
    return _alphas_and_multipliers(_laws(_size_means(col), C_of, sizes[:-1]), base, C)


def _interval(iv: tuple[float, float] | None, fmt_: str) -> str:
    if iv is None or not (finite(iv[0]) and finite(iv[1])):
        return "—"
    return f"[{iv[0]:{fmt_}}, {iv[1]:{fmt_}}]"


def _seeds_per_size(col: Collected) -> str:
    """'3' or '3-5': the finished seeds per size and scheme, as the bootstrap redraws them."""
    counts = {len(col.losses(size=z, scheme=s)) for z in col.points("size") for s in col.points("scheme")} - {0}
    if not counts:
        return "no"
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def step_confound(col: Collected) -> str:
    """A sentence when the sizes train for different numbers of steps: size and step count (and with it
    the length of the learning-rate schedule) move together, and the fits cannot separate them."""
    steps = {}
    for size in col.points("size"):
        runs = col.select(size=size)
        if runs:
            steps[size] = runs[0].run.train.steps
    if len(set(steps.values())) < 2:
        return ""
    listed = ", ".join(f"{z} {n:,}" for z, n in steps.items())
    return (
        f"**Size is confounded with step count**: with one batch shape, the token budget grows with the "
        f"model, so the sizes train for {listed} steps (each with its own warmup and decay schedule). A "
        "difference between sizes, and so the fitted exponents and multipliers, mixes the effect of the "
        "model's size with that of training longer."
    )


def scaling_report(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    sizes, schemes = col.points("size"), col.points("scheme")
    others = [s for s in schemes if s != base]
    rows = []
    # scheme -> {"C", "mean", "std": per-size lists, "fit": PowerLaw or None}, as figures.scaling_plot reads it
    series: dict[str, dict[str, Any]] = {s: {"C": [], "mean": [], "std": [], "fit": None} for s in schemes}
    per_seed: dict[str, dict[int, tuple[list[float], list[float]]]] = {s: {} for s in schemes}
    C_of: dict[str, float] = {}
    for size in sizes:
        model = model_of(col, size=size, scheme=base) or model_of(col, size=size)
        runs = col.select(size=size)
        if model is None or not runs:
            continue
        tokens = runs[0].run.tokens
        seq = runs[0].run.train.seq_len
        C = flops_per_token(model, seq) * tokens / PFLOPS_DAY
        C_of[size] = C
        ref = col.losses(size=size, scheme=base)
        blk = next((r.run.model for r in runs if r.run.model.residual == "block"), None)
        shape = f"d={model['d_model']}, L_b={model['n_layers']}"
        if blk is not None:
            shape += f" (block S={blk.block_size}, N={blk.num_blocks})"
        row = [size, shape, f"{matmul_params(model):,}", f"{tokens:,}", f"{C * PFLOPS_DAY:.3g}", f"{C:.3g}"]
        for s in schemes:
            losses = col.losses(size=size, scheme=s)
            row.append(fmt_mean_std(list(losses.values())))
            m, sd, n = mean_std(losses.values())
            if n:
                series[s]["C"].append(C)
                series[s]["mean"].append(m)
                series[s]["std"].append(sd)
            for seed, v in losses.items():
                per_seed[s].setdefault(seed, ([], []))
                per_seed[s][seed][0].append(C)
                per_seed[s][seed][1].append(v)
        for s in others:
            ok = shares_sublayer_init(model_of(col, size=size, scheme=s) or model, model)
            row.append(rep.paired_cell(col.losses(size=size, scheme=s), ref, ok))
        rows.append(row)
    headers = (
        ["size", "shape", "N_matmul", "tokens", "C (FLOPs)", "C (PF-days)"]
        + [f"{s} loss" for s in schemes]
        + [f"Δ {s} − {base}" for s in others]
    )
    rep.add("## Losses per size", "", f"Compute: {FLOPS_FORMULA}.", "", md_table(headers, rows), "")

    fits, _ = fitted_laws(col)
    C_max = max(C_of.values()) if C_of else float("nan")
    boot = bootstrap_laws(col, C_of, C_max) if fits else {"alpha": {}, "multiplier": {}}
    lo_alpha, lo_mult = leave_largest_out(col, C_of, C_max) if fits else ({}, {})
    largest = max(C_of, key=C_of.__getitem__) if C_of else "—"
    fit_rows = []
    for s in schemes:
        if s in fits:
            series[s]["fit"] = fits[s]
            fit_rows.append(
                [
                    s,
                    f"{fits[s].A:.4g}",
                    f"{fits[s].alpha:.4f}",
                    _interval(boot["alpha"].get(s), ".4f"),
                    fmt(lo_alpha.get(s), 4),
                    f"{fits[s].r2:.3f}",
                    str(fits[s].n),
                ]
            )
        else:
            fit_rows.append([s, "—", "—", "—", "—", "—", str(len(series[s]["C"]))])
    confound = step_confound(col)
    rep.add(
        "## Power-law fits",
        "",
        "L = A·C^-α fitted by least squares on log L vs log C over the per-size mean losses "
        "(C in PFLOP/s-days). Paper (MoE, 194M–528M): baseline 1.891·C^-0.057, Block 1.870·C^-0.058, "
        "Full 1.865·C^-0.057. A depends on the compute range and unit, so compare α and the "
        "compute multiplier rather than A. The interval is a seed bootstrap "
        f"({BOOTSTRAP_REPLICATES} replicates, fixed RNG seed {BOOTSTRAP_SEED}: per size the finished seeds "
        "redrawn with replacement, the same draw for every scheme, the fits redone): the central 95 % of "
        f"the replicates' α. With {_seeds_per_size(col)} seeds per size it understates the seed spread, and "
        f"it does not cover the choice of the power-law form; the fit without {largest} shows how much rests on the "
        "largest size.",
        "",
        md_table(
            [
                "scheme",
                "A",
                "α",
                "α, seed-bootstrap 95 %",
                f"α without {largest}",
                "R² (log space)",
                "sizes",
            ],
            fit_rows,
        ),
        "",
    )
    if confound:
        rep.add(confound, "")

    if C_of and base in fits:
        lines = [
            f"Compute multiplier at the largest budget (size {largest}, C = {C_max:.3g} PF-days): how much "
            f"more compute {base} needs, on its fitted curve, to reach each scheme's loss. The paper "
            "reports 1.25× for Block AttnRes.",
            "",
        ]
        mrows = []
        for s in others:
            if s not in fits:
                mrows.append([s, "—", "—", "—", "—", "—"])
                continue
            from_fit = compute_multiplier(fits[base], fits[s], C_max)
            obs, base_obs = col.losses(size=largest, scheme=s), col.losses(size=largest, scheme=base)
            from_point = [
                measured_multiplier(base_obs[k], obs[k], fits[base].alpha)
                for k in sorted(set(obs) & set(base_obs))
                if finite(obs[k]) and finite(base_obs[k])
            ]
            seeds_mult = []
            for seed, (Cs, Ls) in per_seed[s].items():
                bC, bL = per_seed[base].get(seed, ([], []))
                if len(Cs) >= 2 and len(bC) >= 2 and len(set(Cs)) >= 2 and len(set(bC)) >= 2:
                    seeds_mult.append(compute_multiplier(fit_power_law(bC, bL), fit_power_law(Cs, Ls), C_max))
            boot_iv = boot["multiplier"].get(s)
            mrows.append(
                [
                    s,
                    f"{from_fit:.2f}×",
                    _interval(boot_iv, ".2f").replace("]", "]×") if boot_iv else "—",
                    f"{lo_mult[s]:.2f}×" if s in lo_mult else "—",
                    _fmt_multipliers(from_point),
                    _fmt_multipliers(seeds_mult),
                ]
            )
        rep.add(
            *lines,
            md_table(
                [
                    "scheme",
                    "from the fits",
                    "seed-bootstrap 95 %",
                    f"fits without {largest}, at the same C",
                    f"from the losses measured at {largest}",
                    "per-seed fits (mean ± std)",
                ],
                mrows,
            ),
            "",
            f"From the losses measured at {largest}: each seed's loss ratio to the same seed's {base} "
            f"run, turned into compute through {base}'s fitted slope, (L_{base} / L)^(1/α), so the fitted "
            f"curves' residuals at {largest} do not enter. Per-seed fits pair each seed's curve of a "
            "scheme with the same seed's baseline curve. With a small compute range a small difference "
            f"in α moves the fitted multiplier a lot: the fits without {largest} extrapolate to {largest}'s "
            "compute from the smaller sizes alone, and where they disagree with the full fit the multiplier "
            "rests on one size.",
            "",
        )
    if any(series[s]["C"] for s in schemes):
        rep.figure(
            "scaling.png",
            "Figure 4 analogue: validation loss against training compute, "
            "mean ± std over seeds, with the fitted power laws.",
            lambda p: figures.scaling_plot(series, p, f"{col.spec.name}: loss vs compute"),
        )
