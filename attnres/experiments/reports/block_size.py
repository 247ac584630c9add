"""The block-size report (axis variant): Figure 6, loss against the block size S; uneven depth blocks
against equal ones with the same N.
"""

from __future__ import annotations

import numpy as np

from attnres.experiments import figures
from attnres.experiments.reports.common import (
    Report,
    fmt,
    md_table,
    model_of,
    planned_model,
    variant_rows,
)
from attnres.experiments.stats import fmt_mean_std, mean_std


def block_size_report(rep: Report) -> None:
    col = rep.col
    axis, labels = variant_rows(col)
    base = col.spec.baseline or next(
        (label for label in labels if (model_of(col, **{axis: label}) or {}).get("residual") == "prenorm"), labels[0]
    )
    ref = col.losses(**{axis: base})
    full = next(
        (label for label in labels if col.point(axis, label) and planned_model(col, axis, label).residual == "full"),
        None,
    )
    ref_full = col.losses(**{axis: full}) if full else {}
    rows, S_pts, means, stds, paper = [], [], [], [], {}
    uneven = [label for label in labels if planned_model(col, axis, label).attnres_block_sizes is not None]
    for label in labels:
        m = planned_model(col, axis, label)
        losses = col.losses(**{axis: label})
        if label in uneven:
            continue  # not one S: compared with the uniform row of the same N below
        if m.residual in ("block", "full"):
            S, N = m.block_size, m.num_blocks
            pt = col.point(axis, label)
            if pt.paper_loss is not None:
                paper[S] = pt.paper_loss
            mm, sd, n = mean_std(losses.values())
            if n:
                S_pts.append(S)
                means.append(mm)
                stds.append(sd)
        else:
            S, N = None, None
        rows.append(
            [
                label,
                "—" if S is None else str(S),
                "—" if N is None else str(N),
                "—" if N is None else str(N + 1),
                fmt(col.point(axis, label).paper_loss, 3),
                fmt_mean_std(list(losses.values())),
                "—" if label == base else rep.paired_cell(losses, ref),
                "—" if full is None or label in (full, base) else rep.paired_cell(losses, ref_full),
            ]
        )
    rep.add(
        "## Loss against block size",
        "",
        "S = sublayers per depth block, N = depth blocks; a sublayer reads at most N + 1 sources "
        "(the embedding, the completed blocks and the running partial sum). S = 1 is Full AttnRes; "
        "S = L is one block (a standard residual with the embedding kept as a separate source). "
        "Paper (Figure 6): S = 1 1.737; S = 2, 4, 8 ≈ 1.746; S = 16, 32 drift back toward the "
        "baseline 1.766.",
        "",
        md_table(
            [
                "variant",
                "S",
                "N",
                "max sources",
                "paper loss",
                "our loss",
                f"Δ vs {base} (paired)",
                f"Δ vs {full} (paired)",
            ],
            rows,
            "lrrrrrll",
        ),
        "",
    )
    if uneven:
        _uneven_blocks(rep, axis, labels, uneven, base)
    base_mean = mean_std(ref.values())[0]
    paper_base = col.point(axis, base).paper_loss if col.point(axis, base) else None
    if S_pts:
        order = np.argsort(S_pts)
        rep.figure(
            "block_size.png",
            "Figure 6 analogue: validation loss against block size (mean ± std over "
            "seeds), the baseline as a dashed line; the paper's curve on the right.",
            lambda p: figures.block_size_plot(
                np.array(S_pts)[order],
                np.array(means)[order],
                np.array(stds)[order],
                base_mean,
                paper,
                paper_base,
                p,
                col.spec.name,
            ),
        )


def _uneven_blocks(rep: Report, axis: str, labels: list[str], uneven: list[str], base: str) -> None:
    """Uneven (e.g. learned) depth blocks against the equal blocks with the same N."""
    col = rep.col
    uniform: dict[int, str] = {}  # N -> the label of a Block row with equal blocks and N blocks
    for label in labels:
        m = planned_model(col, axis, label)
        if label not in uneven and m.residual == "block":
            uniform.setdefault(m.num_blocks, label)
    ref = col.losses(**{axis: base})
    rows = []
    for label in uneven:
        m = planned_model(col, axis, label)
        losses = col.losses(**{axis: label})
        same_n = uniform.get(m.num_blocks)
        rows.append(
            [
                label,
                str(list(m.attnres_block_sizes)),
                str(m.num_blocks),
                "—" if same_n is None else f"{same_n} ({planned_model(col, axis, same_n).block_size} each)",
                fmt_mean_std(list(losses.values())),
                "—" if same_n is None else rep.paired_cell(losses, col.losses(**{axis: same_n})),
                rep.paired_cell(losses, ref),
            ]
        )
    rep.add(
        "## Uneven depth blocks against equal ones",
        "",
        "Block AttnRes with the depth-block sizes given (`attnres_block_sizes`, in sublayers; the "
        "learned rows come from `attnres placement` on the Full AttnRes runs, command in the spec) "
        "against the equal blocks with the same N, paired over seeds.",
        "",
        md_table(
            [
                "variant",
                "block sizes",
                "N",
                "equal blocks, same N",
                "our loss",
                "Δ vs equal blocks (paired)",
                f"Δ vs {base} (paired)",
            ],
            rows,
            "lllllll",
        ),
        "",
    )
