"""Figures: loss curves and depth-weight heatmaps (paper Figure 8). Matplotlib, Agg backend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from attnres.files import DEPTH_PLOT, LOSS_PLOT, METRICS_FILE


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display): every figure module draws with it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir: str) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {"train": [], "eval": []}
    path = Path(run_dir) / METRICS_FILE
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows.setdefault(row.get("kind", "train"), []).append(row)
    return rows


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window or window < 2:
        return values
    kernel = np.ones(window) / window
    head = np.array([values[: i + 1].mean() for i in range(window - 1)])
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot_loss_curves(runs: dict[str, str], path: str, title: str = "") -> str:
    """runs: label -> run directory. Training loss (smoothed) and validation loss vs tokens."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, run_dir in runs.items():
        m = read_metrics(run_dir)
        if m["train"]:
            tok = np.array([r["tokens"] for r in m["train"]], dtype=float)
            loss = np.array([r["loss"] for r in m["train"]], dtype=float)
            axes[0].plot(tok, _smooth(loss, max(1, len(loss) // 20)), label=label)
        if m["eval"]:
            tok = np.array([r["tokens"] for r in m["eval"]], dtype=float)
            axes[1].plot(tok, [r["val_loss"] for r in m["eval"]], marker="o", label=label)
    axes[0].set(xlabel="tokens", ylabel="train loss (nats/token, smoothed)", title="training")
    axes[1].set(xlabel="tokens", ylabel="validation loss (nats/token)", title="validation")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_depth_heatmaps(matrix: np.ndarray, labels: list[str], path: str, title: str) -> str:
    """Figure 8 style: pre-attention inputs (even sublayers) and pre-MLP inputs (odd) side by side,
    plus the final aggregation as the last row of both panels."""
    plt = pyplot()
    n_sub = matrix.shape[0] - 1
    attn_rows = list(range(0, n_sub, 2)) + [n_sub]
    mlp_rows = list(range(1, n_sub, 2)) + [n_sub]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(attn_rows) + 2.5))
    vmax = np.nanmax(matrix)
    for ax, rows, name in ((axes[0], attn_rows, "pre-attention"), (axes[1], mlp_rows, "pre-MLP")):
        data = np.ma.masked_invalid(matrix[rows])
        im = ax.imshow(data, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(
            [("final" if r == n_sub else f"l{r} ({'attn' if r % 2 == 0 else 'mlp'})") for r in rows], fontsize=7
        )
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=90, fontsize=7)
        ax.set_xlabel("source")
        ax.set_title(f"{name} inputs")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_run(run_dir) -> list[Path]:
    """Draw a run's figures into its directory: loss.png (train and validation curves from
    metrics.jsonl) and, when the run saved depth weights (depth-attention schemes), depth_weights.png.
    Returns the paths written; a run with no metrics yet gets none (FileNotFoundError for a directory
    that is not a run)."""
    from attnres.analysis.depth import read_depth_weights

    run = Path(run_dir)
    if not (run / METRICS_FILE).is_file():
        raise FileNotFoundError(f"{run} has no {METRICS_FILE}: pass a run directory of attnres train")
    written = [Path(plot_loss_curves({run.name: str(run)}, str(run / LOSS_PLOT), title=str(run)))]
    depth = read_depth_weights(run)
    if depth is not None:
        matrix, labels = depth
        written.append(
            Path(
                plot_depth_heatmaps(
                    matrix, labels, str(run / DEPTH_PLOT), f"{run}: mean depth weights on a validation batch"
                )
            )
        )
    return written
