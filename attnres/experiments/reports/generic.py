"""The generic report (any axes): groups with mean ± std and paired Δ vs the baseline, loss curves."""

from __future__ import annotations

from attnres.experiments import figures
from attnres.experiments.reports.common import Report, group_label, md_table, mean_curve
from attnres.experiments.stats import fmt_mean_std


def generic_report(rep: Report) -> None:
    col = rep.col
    axes = [a for a, _ in col.spec.axes]
    groups: dict[tuple, dict[str, str]] = {}
    for r in col.results:
        groups.setdefault(tuple(r.run.labels.get(a) for a in axes), {a: r.run.labels[a] for a in axes})
    base = col.spec.baseline
    base_axis = next((a for a, pts in col.spec.axes if any(p.label == base for p in pts)), None)
    rows, curves = [], {}
    for labels in groups.values():
        losses = col.losses(**labels)
        row = [group_label(labels, axes), fmt_mean_std(list(losses.values()))]
        if base is not None and base_axis is not None:
            ref = col.losses(**{**labels, base_axis: base})
            row.append("—" if labels.get(base_axis) == base else rep.paired_cell(losses, ref))
        rows.append(row)
        c = mean_curve(col.select(**labels), "tokens")
        if c is not None:
            curves[group_label(labels, axes)] = c
    headers = ["group", "val loss"] + ([f"Δ vs {base}"] if base else [])
    rep.add("## Results", "", md_table(headers, rows), "")
    if curves:
        rep.figure(
            "loss_curves.png",
            "Validation loss against training tokens (mean over seeds).",
            lambda p: figures.curves_plot([("validation loss", "tokens", curves)], p, col.spec.name),
        )
