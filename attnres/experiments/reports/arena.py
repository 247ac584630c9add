"""The arena report (axes scheme, budget): equal tokens and equal wall-clock; loss against tokens
and time.
"""

from __future__ import annotations

import numpy as np

from attnres.experiments import figures
from attnres.experiments.reports.common import (
    Report,
    fmt,
    md_table,
    mean_curve,
    same_init_as,
)
from attnres.experiments.reports.sections import split_section
from attnres.experiments.results import finite
from attnres.experiments.stats import fmt_mean_std, mean_std


def arena_report(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    schemes = col.points("scheme")
    budgets: list[str | None] = list(col.points("budget")) or [None]  # None: no budget axis, one panel
    panels = []
    for budget in budgets:
        sel = {"budget": budget} if budget else {}
        ref = col.losses(scheme=base, **sel)
        base_runs = [r for r in col.select(scheme=base, **sel) if r.done]
        base_params = base_runs[0].summary["params"] if base_runs else None
        base_secs = mean_std([r.train_seconds for r in base_runs])[0]
        same_init = same_init_as(col, "scheme", base, **sel)

        rows = []
        curves_tok: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # scheme -> (x, mean loss)
        curves_time: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for s in schemes:
            runs = list(col.select(scheme=s, **sel))
            done = [r for r in runs if r.done]
            losses = col.losses(scheme=s, **sel)
            secs = mean_std([r.train_seconds for r in done])[0]
            tps = mean_std([r.summary["tokens_per_second"] for r in done])[0]
            params = done[0].summary["params"] if done else None
            rows.append(
                [
                    s,
                    "—" if params is None or base_params is None else f"{params - base_params:+,}",
                    f"{runs[0].run.train.steps:,}" if runs else "—",
                    f"{runs[0].run.tokens:,}" if runs else "—",
                    fmt(secs, 0),
                    "—" if not finite(secs) or not finite(base_secs) else f"{secs / base_secs:.2f}",
                    fmt(tps, 0),
                    fmt_mean_std(list(losses.values())),
                    "—" if s == base else rep.paired_cell(losses, ref, same_init(s)),
                ]
            )
            for store, x in ((curves_tok, "tokens"), (curves_time, "seconds")):
                c = mean_curve(done, x)
                if c is not None:
                    store[s] = c
        title = f"budget: {budget}" if budget else "results"
        rep.add(
            f"## {title}",
            "",
            md_table(
                [
                    "scheme",
                    "params vs " + base,
                    "steps",
                    "tokens",
                    "train s (mean)",
                    f"time / {base}",
                    "tokens/s",
                    "val loss",
                    f"Δ vs {base} (paired)",
                ],
                rows,
                "lrrrrrrrl",
            ),
            "",
        )
        rep.add(*split_section(rep, base, same_init, within=sel))
        if budget and "time" in budget:
            rep.add(
                "Equal wall-clock: each scheme's step count was set in the spec from its measured "
                "throughput relative to the baseline; the `time / baseline` column shows how well the "
                "actual optimizer-step time matched on the machine that ran it.",
                "",
            )
        if budget is None or "time" not in budget:
            panels.append((f"{budget or 'all runs'}: loss vs tokens", "training tokens", curves_tok))
        if budget is None or "time" in budget:
            panels.append((f"{budget or 'all runs'}: loss vs time", "training seconds (optimizer steps)", curves_time))
    if any(p[2] for p in panels):
        rep.figure(
            "arena_curves.png",
            "Validation loss (mean over seeds) against training tokens at equal "
            "tokens, and against optimizer-step time at equal wall-clock.",
            lambda p: figures.curves_plot(panels, p, col.spec.name),
        )
