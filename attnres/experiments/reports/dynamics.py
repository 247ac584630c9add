"""The dynamics report (axis scheme): Figure 5 b/c (output and gradient magnitude per block),
Figure 8 heatmaps and their structure, routing sharpness, Figure 9 mixing matrices.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from attnres.experiments import figures
from attnres.experiments.reports.common import (
    DEPTH_WEIGHT_COLUMNS,
    Report,
    depth_weight_stats,
    md_table,
    model_of,
)
from attnres.experiments.results import mean_matrix, nan_matrix
from attnres.experiments.stats import fmt_mean_std, spearman


def _per_block(values: list[float]) -> np.ndarray:
    """Per Transformer block: RMS over its two sublayers (attention, MLP)."""
    v = np.asarray(values, dtype=float)
    return np.sqrt((v[0::2] ** 2 + v[1::2] ** 2) / 2)


def _spearman_depth(v: np.ndarray) -> float | None:
    return spearman(list(range(len(v))), list(v))


def dynamics_report(rep: Report) -> None:
    col = rep.col
    schemes = col.points("scheme")
    base = col.spec.baseline or "prenorm"
    focus = [s for s in schemes if s in (base, "block", "full")] or schemes[:3]
    # quantity -> scheme -> (mean, std) over seeds per Transformer block
    profiles: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {"out": {}, "in": {}, "grad": {}}
    stat_rows = []
    cv: dict[str, dict[int, float]] = {}
    mono: dict[str, dict[int, float | None]] = {}  # None: too few blocks for a rank correlation
    for s in schemes:
        done = [r for r in col.select(scheme=s) if r.done and r.probes]
        if not done:
            continue
        out = np.stack([_per_block(r.probes["output_rms"]) for r in done])
        inp = np.stack([np.asarray(r.probes["input_rms"], dtype=float)[0::2] for r in done])
        grad = np.stack([np.asarray(r.probes["block_grad_norm"], dtype=float) for r in done])
        if s in focus:
            for key, arr in (("out", out), ("in", inp), ("grad", grad)):
                sd = arr.std(0, ddof=1) if len(arr) > 1 else np.zeros(arr.shape[1])
                profiles[key][s] = (arr.mean(0), sd)
        cv[s] = {r.run.seed: float(g.std() / g.mean()) for r, g in zip(done, grad, strict=True)}
        mono[s] = {r.run.seed: _spearman_depth(o) for r, o in zip(done, out, strict=True)}
        stat_rows.append(
            [
                s,
                str(len(done)),
                fmt_mean_std(list(mono[s].values()), 2),
                fmt_mean_std([o[-1] / o[0] for o in out], 2),
                fmt_mean_std([i[-1] / i[0] for i in inp], 2),
                fmt_mean_std(list(cv[s].values()), 3),
                fmt_mean_std([g.max() / g.min() for g in grad], 2),
            ]
        )
    rep.add(
        "## Training dynamics (Figure 5 b, c)",
        "",
        "Measured once at the end of training on one validation batch: *output magnitude* of "
        "Transformer block i = RMS of its attention and MLP outputs f (over batch, tokens, channels); "
        "*input magnitude* = RMS of the hidden state h read by its attention sublayer; *gradient "
        "magnitude* = L2 norm of the loss gradient over the block's parameters (one backward pass). "
        "Paper: the baseline's output magnitude grows monotonically with depth, Block AttnRes stays "
        "bounded and periodic, and its gradient magnitude is more uniform.",
        "",
        md_table(
            [
                "scheme",
                "seeds",
                "Spearman(depth, output)",
                "output last/first",
                "input last/first",
                "gradient CV across blocks",
                "gradient max/min",
            ],
            stat_rows,
        ),
        "",
    )
    if base in cv:
        cmp_rows = []
        for s in schemes:
            if s != base and s in cv:
                cmp_rows.append([s, rep.paired_cell(cv[s], cv[base]), rep.paired_cell(mono[s], mono[base])])
        if cmp_rows:
            rep.add(
                f"Paired over seeds against {base} (negative = more uniform gradients / less monotone growth):",
                "",
                md_table(["scheme", "Δ gradient CV", "Δ Spearman(depth, output)"], cmp_rows, "lll"),
                "",
            )
    if profiles["out"]:
        rep.figure(
            "dynamics.png",
            "Figure 5 analogue: per-block output magnitude, input (hidden-state) "
            "magnitude and gradient magnitude at the end of training (mean ± std over seeds).",
            lambda p: figures.depth_profile_plot(
                [
                    ("output magnitude (RMS of f)", "RMS", profiles["out"]),
                    ("input magnitude (RMS of h)", "RMS", profiles["in"]),
                    ("gradient magnitude", "‖∇ block params‖", profiles["grad"]),
                ],
                p,
                col.spec.name,
                log=True,
            ),
        )

    heat_rows = []
    for s in schemes:
        done = [r for r in col.select(scheme=s) if r.done and r.probes and r.probes.get("depth_weights")]
        if not done:
            continue
        M = mean_matrix([nan_matrix(r.probes["depth_weights"]) for r in done])
        assert M is not None  # done is not empty
        labels = done[0].probes["depth_sources"]
        heat_rows.append(depth_weight_stats(s, M, len(done)))
        if s in ("full", "block"):
            from attnres.analysis.plots import plot_depth_heatmaps

            rep.figure(
                f"depth_weights_{s}.png",
                f"Figure 8 analogue, {s}: mean depth weights (over {len(done)} seeds, one validation "
                "batch) of the pre-attention and pre-MLP inputs; the last row is the final "
                "aggregation.",
                partial(plot_depth_heatmaps, M, labels, title=f"{s}: mean depth weights"),
            )
    if heat_rows:
        rep.add(
            "Depth-weight structure (Figure 8; rows = consumers reading more than one source): weight "
            "on the embedding, on the most recent source, and how often the most recent source gets the "
            "largest weight, against uniform weights over the same sources; *width* = entropy of a row / "
            "log(sources), 1 for uniform weights, 0 for a single source, for pre-attention and pre-MLP "
            "inputs (paper: pre-attention inputs wider, pre-MLP inputs more local).",
            "",
            md_table(
                DEPTH_WEIGHT_COLUMNS,
                heat_rows,
            ),
            "",
        )

    _routing_sharpness(rep, schemes)

    mats, notes, r2_rows = {}, {}, []
    for s in schemes:
        done = [r for r in col.select(scheme=s) if r.done and r.probes and r.probes.get("mixing")]
        if not done:
            continue
        M = mean_matrix([nan_matrix(r.probes["mixing"]) for r in done])
        assert M is not None  # done is not empty
        r2 = min(min(x for x in r.probes["mixing_r2"] if x is not None) for r in done)
        mats[s] = M
        notes[s] = f"min R² {r2:.3f}"
        r2_rows.append([s, str(len(done)), f"{r2:.4f}", "exact" if r2 > 0.9999 else "best scalar fit"])
    if mats:
        rep.add(
            "## Depth mixing matrices (Figure 9)",
            "",
            "M[l, i] = the coefficient of source i (0 = embedding, i = output of sublayer i − 1) in the "
            "input of consumer l (sublayer l, last row = the input of the final norm), by per-token least "
            "squares, averaged over tokens and seeds. Every scheme has one: for prenorm it is 1 on and "
            "below the diagonal by construction; AttnRes rows are its depth weights (Block: each "
            "block's weight repeated over its sublayers); for per-channel schemes (LayerScale, "
            "Highway) it is the best scalar description and R² says how much it explains.",
            "",
            md_table(["scheme", "seeds", "min R² over rows", "M is"], r2_rows),
            "",
        )
        rep.figure(
            "mixing_matrices.png",
            "Figure 9 analogue: depth mixing matrix M of each scheme (own colour scale per panel).",
            lambda p: figures.matrices_plot(mats, p, col.spec.name, notes),
        )


# Schemes whose streams report depth weights (the routing probe reads them); every other scheme's
# mixing is in the Figure 9 matrices.
DEPTH_ROUTED = ("full", "block", "gated")

# "Delta Attention Residuals" (2026), at 1B parameters, as summarised in arXiv 2605.18855's abstract: the largest depth
# weight is about 0.6 when the sources are sublayer outputs ("deltas", the paper's sources) and about
# 0.2 when they are accumulated hidden states.
FOLLOW_UP_MAX_WEIGHT = {"outputs": "≈ 0.6", "states": "≈ 0.2"}


def _routing_sharpness(rep: Report, schemes: list[str]) -> None:
    """Routing sharpness: per scheme, the mean over consumers reading >= 2 sources of the
    largest depth weight and of the entropy / log K (the ``routing`` probe), beside uniform routing and
    the follow-up paper's values."""
    col = rep.col
    rows = []
    for s in schemes:
        runs = col.select(scheme=s)
        model = model_of(col, scheme=s)
        if not runs or model is None or model.get("residual") not in DEPTH_ROUTED:
            continue
        sources = model.get("attnres_sources", "outputs") if model["residual"] != "gated" else "outputs"
        paper = FOLLOW_UP_MAX_WEIGHT[sources] if model["residual"] != "gated" else "—"
        what = f"{model['residual']}, {sources}"
        done = [r for r in runs if r.done and r.probes]
        measured = [r.probes["routing"] for r in done if r.probes.get("routing")]
        if not measured:
            state = "not yet run" if not done else "not measured: its runs finished before the routing probe existed"
            rows.append([s, what, "0", state, "", "", "", paper])
            continue
        maxes, widths, uniform = [], [], []
        for probe in measured:
            keep = [j for j, k in enumerate(probe["n_sources"]) if k >= 2]
            maxes.append(float(np.mean([probe["max_weight"][j] for j in keep])))
            widths.append(float(np.mean([probe["entropy"][j] / math.log(probe["n_sources"][j]) for j in keep])))
            uniform.append(float(np.mean([1 / probe["n_sources"][j] for j in keep])))
        rows.append(
            [
                s,
                what,
                str(len(measured)),
                fmt_mean_std(maxes, 3),
                f"{np.mean(uniform):.3f}",
                f"{np.mean(maxes) / np.mean(uniform):.2f}",
                fmt_mean_std(widths, 3),
                paper,
            ]
        )
    if not rows:
        return
    rep.add(
        "## Routing sharpness",
        "",
        "Per consumer (every sublayer and the final aggregation that reads at least 2 sources), on one "
        "validation batch of the final model: the largest depth weight of a token (of a token and head "
        "for multi-head schemes), averaged over tokens, then over consumers; *width* = the weights' "
        "entropy / log K (1 = uniform over the K sources, 0 = one source). Uniform routing would give "
        'the mean of 1/K shown beside it. The follow-up paper ("Delta Attention Residuals", 2026, '
        "1B parameters, as summarised in arXiv 2605.18855's abstract) reports a largest weight of about "
        "0.6 with output sources and about 0.2 with state sources; its models are larger and deeper, so compare "
        "the ratio between our output- and state-sourced rows rather than the absolute values.",
        "",
        md_table(
            [
                "scheme",
                "residual, sources",
                "seeds",
                "mean largest weight",
                "uniform would give",
                "largest / uniform",
                "width",
                "follow-up paper, largest weight",
            ],
            rows,
            "llrlrrll",
        ),
        "",
    )
