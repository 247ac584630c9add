"""Figures: loss curves and depth-weight heatmaps (paper Figure 8). Matplotlib, Agg backend."""

from __future__ import annotations

import io
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


def save_png(fig, path: str, dpi: int) -> str:
    """Write ``fig`` as a palette PNG and close it: matplotlib's RGBA output quantised to 256 colours
    (maximum coverage, no dithering: deterministic, same figure -> same bytes; every pixel within about
    15 of 255 of matplotlib's in each channel, where median cut moves some heatmap cells and line edges
    by 40-80) and compressed with ``optimize``: a quarter to a third of the RGBA file's size with no
    visible change. The figures are opaque (white background), so the alpha channel carries nothing."""
    from PIL import Image

    fig.tight_layout()
    rgba = io.BytesIO()
    fig.savefig(rgba, format="png", dpi=dpi)
    pyplot().close(fig)
    rgba.seek(0)
    with Image.open(rgba) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MAXCOVERAGE, dither=Image.Dither.NONE)
    palette.save(path, format="PNG", optimize=True)
    return path


def read_metrics(run_dir: str, notes: list[str] | None = None) -> dict[str, list[dict]]:
    """The rows of a run's metrics.jsonl by kind. A torn last line (a run killed mid-write; ``--resume``
    drops it too) is skipped, with a line in ``notes``; any other unreadable content is a ValueError
    naming the file and the line."""
    rows: dict[str, list[dict]] = {"train": [], "eval": []}
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return rows
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e}); it is not a metrics file of attnres train") from e
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    for i, line in numbered:
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a {type(row).__name__}, not a record")
        except ValueError as e:
            if i == numbered[-1][0] and not line.rstrip().endswith("}"):
                if notes is not None:
                    notes.append(f"{path}: skipped the torn last line {i} (a run stopped mid-write)")
                continue
            raise ValueError(f"{path} line {i} is not a JSON record ({e}); restore the file or delete that line") from e
        rows.setdefault(str(row.get("kind", "train")), []).append(row)
    return rows


def _x_axis(rows: list[dict]) -> tuple[str, np.ndarray]:
    """Tokens seen when every row records them, else the step."""
    for key in ("tokens", "step"):
        if all(isinstance(r.get(key), (int, float)) for r in rows):
            return key, np.array([r[key] for r in rows], dtype=float)
    return "row", np.arange(1, len(rows) + 1, dtype=float)


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window or window < 2:
        return values
    kernel = np.ones(window) / window
    head = np.array([values[: i + 1].mean() for i in range(window - 1)])
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot_loss_curves(runs: dict[str, str], path: str, title: str = "", notes: list[str] | None = None) -> str:
    """runs: label -> run directory. Training loss (smoothed) and validation loss vs tokens (vs the
    step for records without tokens). ``notes``: what was skipped (see :func:`read_metrics`)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xlabels = ["tokens", "tokens"]
    for label, run_dir in runs.items():
        m = read_metrics(run_dir, notes)
        train = [r for r in m["train"] if isinstance(r.get("loss"), (int, float))]
        evals = [r for r in m["eval"] if isinstance(r.get("val_loss"), (int, float))]
        if train:
            xlabels[0], x = _x_axis(train)
            loss = np.array([r["loss"] for r in train], dtype=float)
            axes[0].plot(x, _smooth(loss, max(1, len(loss) // 20)), label=label)
        if evals:
            xlabels[1], x = _x_axis(evals)
            axes[1].plot(x, [r["val_loss"] for r in evals], marker="o", label=label)
    axes[0].set(xlabel=xlabels[0], ylabel="train loss (nats/token, smoothed)", title="training")
    axes[1].set(xlabel=xlabels[1], ylabel="validation loss (nats/token)", title="validation")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run with no validation yet: no empty legend
            ax.legend()
    if title:
        fig.suptitle(title)
    return save_png(fig, path, dpi=120)


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
    return save_png(fig, path, dpi=120)


def plot_run(run_dir, notes: list[str] | None = None) -> list[Path]:
    """Draw a run's figures into its directory: loss.png (train and validation curves from
    metrics.jsonl) and, when the run saved depth weights (depth-attention schemes), depth_weights.png.
    Returns the paths written (FileNotFoundError for a directory that is not a run, ValueError for a
    metrics file without a single loss); ``notes`` collects what was skipped (a torn last line)."""
    from attnres.analysis.depth import read_depth_weights

    run = Path(run_dir)
    if not (run / METRICS_FILE).is_file():
        raise FileNotFoundError(f"{run} has no {METRICS_FILE}: pass a run directory of attnres train")
    rows = read_metrics(str(run))
    if not any(isinstance(r.get("loss"), (int, float)) for r in rows["train"]) and not any(
        isinstance(r.get("val_loss"), (int, float)) for r in rows["eval"]
    ):
        raise ValueError(
            f"{run / METRICS_FILE} holds no loss yet (no training or validation record): nothing to draw; "
            "plot again once the run has logged a step"
        )
    written = [Path(plot_loss_curves({run.name: str(run)}, str(run / LOSS_PLOT), title=str(run), notes=notes))]
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
