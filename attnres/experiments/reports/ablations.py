"""The ablations report (axis variant): Table 4 beside the paper, Δ vs the baseline and ranks."""

from __future__ import annotations

from attnres.experiments import figures
from attnres.experiments.reports.common import (
    Report,
    fmt,
    md_table,
    same_init_as,
    variant_rows,
)
from attnres.experiments.reports.sections import split_section
from attnres.experiments.results import finite
from attnres.experiments.stats import (
    fmt_mean_std,
    mean_std,
    ranks,
    seed_shortfall,
    spearman,
)


def ablations_report(rep: Report) -> None:
    col = rep.col
    axis, labels = variant_rows(col)
    base = col.spec.baseline or labels[0]
    ref = col.losses(**{axis: base})
    paper_base = col.point(axis, base).paper_loss
    means = {label: mean_std(col.losses(**{axis: label}).values())[0] for label in labels}
    paper = {label: col.point(axis, label).paper_loss for label in labels}
    ours_rank = dict(
        zip(
            [label for label in labels if finite(means[label])],
            ranks([means[label] for label in labels if finite(means[label])]),
            strict=True,
        )
    )
    paper_rank = dict(
        zip(
            [label for label in labels if paper[label] is not None],
            ranks([paper[label] for label in labels if paper[label] is not None]),
            strict=True,
        )
    )
    same_init = same_init_as(col, axis, base)

    rows, bars = [], []
    for label in labels:
        losses = col.losses(**{axis: label})
        div = [r for r in col.select(**{axis: label}) if r.state == "diverged"]
        p = rep.paired(losses, ref)
        pd = None if paper[label] is None or paper_base is None else paper[label] - paper_base
        rows.append(
            [
                label + _headline_mark(label in col.spec.headline, len(losses)),
                fmt(paper[label], 3),
                fmt(pd, 3, sign=True) if label != base else "—",
                f"{paper_rank[label]:g}" if label in paper_rank else "—",
                fmt_mean_std(list(losses.values())) + (f" ({len(div)} diverged)" if div else ""),
                "—" if label == base else rep.paired_cell(losses, ref, same_init(label)),
                f"{ours_rank[label]:g}" if label in ours_rank else "—",
            ]
        )
        if label != base:
            bars.append((label, p.mean, p.se, pd))
    rep.add(
        "## Results beside the paper",
        "",
        "The paper's absolute losses come from a 16-layer MoE model trained on far more tokens; compare "
        "the deltas to the baseline and the ranks, not the absolute values. Rank 1 = lowest loss.",
        "",
        md_table(
            ["variant", "paper loss", "paper Δ", "paper rank", "our loss", f"our Δ vs {base} (paired)", "our rank"],
            rows,
            "lrrrrlr",
        ),
        "",
    )
    both = [label for label in labels if label in ours_rank and label in paper_rank]
    rho = spearman([means[label] for label in both], [paper[label] for label in both])
    agree = [
        label
        for label in labels
        if label != base
        and label in ours_rank
        and paper[label] is not None
        and paper_base is not None
        and finite(means[label])
        and finite(means.get(base, float("nan")))
        and (means[label] < means[base]) == (paper[label] < paper_base)
    ]
    n_cmp = sum(1 for label in labels if label != base and label in ours_rank and paper[label] is not None)
    rep.add(
        f"Rank agreement with the paper over {len(both)} rows: Spearman ρ = "
        f"{'—' if rho is None else f'{rho:+.2f}'}. Sign of Δ vs {base} agrees with the paper for "
        f"{len(agree)} of {n_cmp} variants (by mean; see the verdicts for which differences are "
        "distinguishable after the Holm correction).",
        "",
    )
    rep.add(*split_section(rep, base, same_init))
    if bars:
        rep.figure(
            "ablations.png",
            f"Δ validation loss vs {base}: this run (left, ± s.e. over seeds) and the paper's Table 4 (right).",
            lambda pth: figures.delta_bars(bars, pth, col.spec.name, base),
        )


def _headline_mark(headline: bool, seeds: int) -> str:
    if not headline:
        return ""
    short = seed_shortfall(seeds)
    return f" (headline; {short})" if short else " (headline)"
