"""The importance report (``experiments/importance.toml``): routing mass against causal
importance. For each trained model, every source of every read is knocked out (``attnres.experiments.
importance``); the loss increase is set against the source's mean depth weight: Spearman over all
(read, source) pairs, per read (reads with 3 or more sources), and how often the most weighted source
of a read is also the one whose loss hurts most. Knockouts are cached in each run directory
(``knockout.json``): the first report needs the kept checkpoints, later ones only the cache.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from attnres.experiments.importance import (
    KNOCKOUT_FILE,
    MODES,
    cached_knockouts,
    knockouts_of_run,
)
from attnres.experiments.reports.common import Report, fmt, md_table
from attnres.experiments.results import Result
from attnres.experiments.stats import mean_std, spearman
from attnres.files import CHECKPOINT_DIR

KNOCKOUT_BATCHES = 4  # validation batches every knockout is measured on (the run's batch size)
MIN_SOURCES_PER_READ = 3  # a per-read rank correlation needs at least 3 sources


def _table(rep: Report, r: Result) -> dict | None:
    """The run's knockouts: the cache in its directory (or in this experiment's copy of it), else
    measured from its kept checkpoint and cached; None when neither exists."""
    planned = r.dir.parent.parent / rep.col.spec.name / r.run.hash  # <runs>/<experiment>/<hash>
    for d in (r.dir, planned):
        if (d / KNOCKOUT_FILE).is_file():
            return cached_knockouts(d, dict)
    if not (r.dir / CHECKPOINT_DIR).is_dir():
        return None
    return cached_knockouts(r.dir, lambda: knockouts_of_run(r.run, r.dir, KNOCKOUT_BATCHES, log=lambda _: None))


def _pairs(table: dict, mode: str) -> tuple[list[float], list[float]]:
    weights, deltas = [], []
    for row in table["consumers"]:
        if row[mode]:
            weights += row["weight"]
            deltas += row[mode]
    return weights, deltas


def model_stats(table: dict) -> dict[str, float]:
    """Per mode: Spearman over all pairs, the mean per-read Spearman, and the share of reads whose most
    weighted source is also the most important one."""
    out: dict[str, float] = {}
    for mode in MODES:
        w, d = _pairs(table, mode)
        rho = spearman(w, d)
        out[f"{mode}_rho"] = float("nan") if rho is None else rho
        per_read, agree, reads = [], 0, 0
        for row in table["consumers"]:
            if not row[mode]:
                continue
            reads += 1
            agree += int(np.argmax(row["weight"]) == np.argmax(row[mode]))
            if len(row["weight"]) >= MIN_SOURCES_PER_READ:
                r = spearman(row["weight"], row[mode])
                if r is not None:
                    per_read.append(r)
        out[f"{mode}_rho_read"] = mean_std(per_read)[0]
        out[f"{mode}_reads_positive"] = sum(r > 0 for r in per_read) / len(per_read) if per_read else float("nan")
        out[f"{mode}_top_agree"] = agree / reads if reads else float("nan")
        out[f"{mode}_max_delta"] = max(d) if d else float("nan")
    return out


def importance_verdict(stats: dict[tuple[str, str], list[dict[str, float]]]) -> str:
    """One line: is routing mass a proxy for causal importance (overall Spearman of the zero knockout)?"""
    parts = []
    for (bb, scheme), runs in stats.items():
        m, s, n = mean_std([r["zero_rho"] for r in runs])
        top = mean_std([r["zero_top_agree"] for r in runs])[0]
        spread = f" ± {s:.2f}" if n > 1 else ""
        parts.append(f"{bb}/{scheme} ρ = {m:+.2f}{spread}, top source agrees {top:.0%}")
    if not parts:
        return "Verdict: no knockouts measured yet."
    rhos = [r["zero_rho"] for runs in stats.values() for r in runs if not math.isnan(r["zero_rho"])]
    tops = [r["zero_top_agree"] for runs in stats.values() for r in runs if not math.isnan(r["zero_top_agree"])]
    strong = rhos and min(rhos) >= 0.7
    weak = rhos and max(rhos) < 0.4 and tops and max(tops) < 0.7
    summary = (
        "routing mass tracks causal importance closely"
        if strong
        else "routing mass is a weak proxy for causal importance"
        if weak
        else "routing mass tracks causal importance only partly"
    )
    return (
        f"Verdict (arXiv 2606.13168: routing mass is not causal importance): {summary} (Spearman ρ of the "
        "zero knockout over all (read, source) pairs; the share of reads whose most weighted source costs "
        "most) — " + "; ".join(parts) + "."
    )


def _plot(tables: dict[str, dict], path: str) -> str:
    from attnres.analysis.plots import pyplot, save_png
    from attnres.experiments.figures import PNG_DPI

    plt = pyplot()
    fig, axes = plt.subplots(1, len(tables), figsize=(3.6 * len(tables), 3.4), squeeze=False)
    for ax, (name, table) in zip(axes[0], tables.items(), strict=True):
        for mode, marker in zip(MODES, ("o", "x"), strict=True):
            w, d = _pairs(table, mode)
            ax.scatter(w, d, s=9, marker=marker, alpha=0.6, label=f"{mode} knockout")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("mean depth weight α")
        ax.set_title(name, fontsize=9)
    axes[0][0].set_ylabel("loss increase (nats/token)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, path, dpi=PNG_DPI)


def importance_report(rep: Report) -> None:
    col = rep.col
    stats: dict[tuple[str, str], list[dict[str, float]]] = {}
    figure_tables: dict[str, dict] = {}
    rows, missing = [], []
    for bb in col.points("backbone"):
        for scheme in col.points("scheme"):
            for r in col.select(backbone=bb, scheme=scheme):
                if not r.done:
                    continue
                table = _table(rep, r)
                if table is None:
                    missing.append(r.run.name)
                    continue
                st = model_stats(table)
                stats.setdefault((bb, scheme), []).append(st)
                figure_tables.setdefault(f"{bb}, {scheme} (seed {r.run.seed})", table)
                pairs = len(_pairs(table, "zero")[0])
                rows.append(
                    [
                        bb,
                        scheme,
                        str(r.run.seed),
                        fmt(table["base_loss"]),
                        str(pairs),
                        fmt(st["zero_rho"], 2, sign=True),
                        fmt(st["mean_rho"], 2, sign=True),
                        fmt(st["zero_rho_read"], 2, sign=True),
                        f"{st['zero_reads_positive']:.0%}" if not math.isnan(st["zero_reads_positive"]) else "—",
                        f"{st['zero_top_agree']:.0%}",
                        f"{st['mean_top_agree']:.0%}",
                        fmt(st["zero_max_delta"], 3),
                    ]
                )
    rep.add(
        "## Routing mass against knockout loss",
        "",
        f"Each knockout is measured on the first {KNOCKOUT_BATCHES} validation batches (the run's batch "
        "size and sequence length); the loss increase is against the intact model on the same batches. "
        "ρ: Spearman rank correlation between the mean depth weight of a (read, source) pair and its "
        "loss increase, over all pairs of the model (reads with one source have none), and averaged "
        f"over the reads with at least {MIN_SOURCES_PER_READ} sources. Top agrees: share of reads whose "
        "most weighted source is also the one whose removal costs most.",
        "",
        md_table(
            [
                "backbone",
                "scheme",
                "seed",
                "loss (4 batches)",
                "pairs",
                "ρ overall (zero)",
                "ρ overall (mean)",
                "ρ per read (zero)",
                "reads with ρ > 0 (zero)",
                "top agrees (zero)",
                "top agrees (mean)",
                "largest increase (zero)",
            ],
            rows,
            "lllrrrrrrrrr",
        ),
        "",
    )
    if missing:
        rep.add(
            "Without knockouts (no cache and no kept checkpoint: train them with `attnres experiment importance`): "
            + ", ".join(f"`{n}`" for n in missing),
            "",
        )
    if figure_tables:
        rep.figure(
            "importance.png",
            "Loss increase of each knockout against the source's mean depth weight, one panel per model "
            "(the first seed of each); symmetric-log y axis.",
            partial(_plot, figure_tables),
        )
    rep.add("## Verdict", "", importance_verdict(stats), "")
