"""The experiment reports' figures (matplotlib, Agg backend). Every function writes one PNG."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike

from attnres.analysis.plots import pyplot, save_png

PNG_DPI = 110


def _save(fig, path: str) -> str:
    """Write ``fig`` as a palette PNG at the reports' resolution (see :func:`save_png`)."""
    return save_png(fig, path, dpi=PNG_DPI)


def scaling_plot(series: dict[str, dict], path: str, title: str) -> str:
    """Figure 4: loss against compute (log-log), mean ± std over seeds, fitted power laws.
    series: scheme -> {"C": [...], "mean": [...], "std": [...], "fit": PowerLaw or None}."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, s) in enumerate(series.items()):
        color = f"C{i}"
        C = np.asarray(s["C"], dtype=float)
        std = np.nan_to_num(np.asarray(s["std"], dtype=float))
        ax.errorbar(C, s["mean"], yerr=std, fmt="o", color=color, capsize=3, label=f"{name} (runs)")
        fit = s.get("fit")
        if fit is not None and len(C):
            xs = np.geomspace(C.min() / 1.3, C.max() * 1.3, 50)
            ax.plot(xs, fit(xs), "-", color=color, alpha=0.8, label=f"{name}: {fit.A:.3g}·C^-{fit.alpha:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    # losses span less than a decade: plain numbers, not 4.2 x 10^0
    from matplotlib.ticker import ScalarFormatter

    for axis_ticks in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_ticks(ScalarFormatter())
    ax.set_xlabel("training compute C (PFLOP/s-days)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def delta_bars(rows: list[tuple[str, float, float, float | None]], path: str, title: str, baseline: str) -> str:
    """Ablation-style chart: per row our paired Δ vs the baseline (± s.e.) and the paper's Δ.
    rows: (label, our delta, our se, paper delta or None)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.42 * len(rows) + 1.8), sharey=True)
    y = np.arange(len(rows))
    ours = np.array([r[1] for r in rows], dtype=float)
    se = np.nan_to_num(np.array([r[2] for r in rows], dtype=float))
    paper = np.array([np.nan if r[3] is None else r[3] for r in rows], dtype=float)
    axes[0].barh(
        y, np.nan_to_num(ours), xerr=se, color=["C2" if v < 0 else "C3" for v in np.nan_to_num(ours)], capsize=3
    )
    axes[0].set_title(f"this run: Δ loss vs {baseline} (mean over seeds ± s.e.)", fontsize=9)
    axes[1].barh(y, np.nan_to_num(paper), color=["C2" if v < 0 else "C3" for v in np.nan_to_num(paper)])
    axes[1].set_title(f"paper: Δ loss vs {baseline}", fontsize=9)
    for ax in axes:
        ax.axvline(0, color="k", lw=0.8)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y)
    axes[0].set_yticklabels([r[0] for r in rows], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title)
    return _save(fig, path)


def block_size_plot(
    S: ArrayLike,
    mean: ArrayLike,
    std: ArrayLike,
    baseline: float | None,
    paper: dict[float, float],
    paper_baseline: float | None,
    path: str,
    title: str,
) -> str:
    """Figure 6: loss against block size S (log2 axis), with the baseline as a line; paper beside."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].errorbar(
        S, mean, yerr=np.nan_to_num(np.asarray(std, dtype=float)), fmt="o-", capsize=3, label="Block AttnRes (this run)"
    )
    if baseline is not None and math.isfinite(baseline):
        axes[0].axhline(baseline, color="C3", ls="--", label="prenorm")
    axes[0].set_title("this run (mean ± std over seeds)")
    if paper:
        ps = sorted(paper)
        axes[1].plot(ps, [paper[s] for s in ps], "o-", color="C1", label="Block AttnRes (paper)")
    if paper_baseline is not None:
        axes[1].axhline(paper_baseline, color="C3", ls="--", label="baseline (paper)")
    axes[1].set_title("paper (Figure 6)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size S (sublayers per depth block)")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def curves_plot(
    panels: list[tuple[str, str, dict[str, tuple[np.ndarray, np.ndarray]]]],
    path: str,
    title: str,
    ylabel: str = "validation loss (nats/token)",
    logy: bool = False,
) -> str:
    """Side-by-side line plots. panels: (title, xlabel, {label: (x, y)}); ``logy``: a log y axis."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    for ax, (ptitle, xlabel, lines) in zip(axes[0], panels, strict=True):
        for i, (label, (x, y)) in enumerate(lines.items()):
            ax.plot(x, y, marker="o", ms=3, color=f"C{i % 10}", ls="-" if i < 10 else "--", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.set_title(ptitle, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)


def depth_profile_plot(
    panels: list[tuple[str, str, dict[str, tuple[np.ndarray, np.ndarray]]]], path: str, title: str, log: bool = False
) -> str:
    """Figure 5 b/c: a quantity per Transformer block, mean ± std over seeds per scheme.
    panels: (title, ylabel, {scheme: (mean [L_b], std [L_b])})."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (ptitle, ylabel, lines) in zip(axes[0], panels, strict=True):
        for i, (label, (m, s)) in enumerate(lines.items()):
            x = np.arange(1, len(m) + 1)
            ax.plot(x, m, marker="o", ms=3, color=f"C{i}", label=label)
            ax.fill_between(x, m - np.nan_to_num(s), m + np.nan_to_num(s), color=f"C{i}", alpha=0.2)
        ax.set_xlabel("Transformer block")
        ax.set_ylabel(ylabel)
        ax.set_title(ptitle, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def matrices_plot(mats: dict[str, np.ndarray], path: str, title: str, notes: dict[str, str] | None = None) -> str:
    """Figure 9: one heatmap per scheme of its depth mixing matrix M (rows: consumers l and the final
    output; columns: sources, 0 = embedding). Each panel has its own colour scale."""
    plt = pyplot()
    n = len(mats)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.3 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (name, m) in zip(axes.flat, mats.items(), strict=False):  # the last grid row may have spare cells
        ax.axis("on")
        lo, hi = np.nanmin(m), np.nanmax(m)
        lo = min(lo, 0.0)
        if hi - lo < 1e-6:  # a constant matrix (prenorm: all ones) gets a readable scale
            lo, hi = lo - 0.5, hi + 0.5
        im = ax.imshow(np.ma.masked_invalid(m), cmap="viridis", aspect="auto", vmin=lo, vmax=hi)
        ax.set_title(name + (f"\n{notes[name]}" if notes and name in notes else ""), fontsize=8)
        ax.set_xlabel("source (0 = embedding)", fontsize=7)
        ax.set_ylabel("consumer (last = output)", fontsize=7)
        ax.tick_params(labelsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    return _save(fig, path)


def sweep_plot(
    series: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    path: str,
    title: str,
    optima: Mapping[str, float | None] | None = None,
) -> str:
    """Architecture sweep: loss against d_model / L_b (log axis) per scheme, ± std; optima marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, (x, m, s)) in enumerate(series.items()):
        ax.errorbar(x, m, yerr=np.nan_to_num(s), fmt="o-", capsize=3, color=f"C{i}", label=name)
        if optima and name in optima and optima[name] is not None:
            ax.axvline(optima[name], color=f"C{i}", ls=":", alpha=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("d_model / L_b (width per Transformer block)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)
