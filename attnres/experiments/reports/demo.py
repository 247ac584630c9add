"""``attnres demo``'s page of its own: one table row per scheme, loss curves, depth-weight heatmaps."""

from __future__ import annotations

from pathlib import Path

from attnres.experiments.env import machine
from attnres.experiments.reports.common import Report
from attnres.experiments.reports.sections import status
from attnres.experiments.results import Collected, Result, nan_matrix

# how the demo page names its schemes in titles
DEMO_NAMES = {"block": "Block AttnRes", "full": "Full AttnRes"}


def _demo_runs(col: Collected) -> dict[str, Result]:
    """scheme label -> its finished run (the demo trains one seed)."""
    runs = {}
    for label in col.points("scheme"):
        done = [r for r in col.select(scheme=label) if r.done]
        if done:
            runs[label] = done[0]
    return runs


def demo_table(col: Collected) -> str:
    """The demo's table: size, tokens, validation loss and speed per scheme; step time (the median
    optimizer step) relative to the baseline's."""
    base = col.spec.baseline or "prenorm"
    runs = _demo_runs(col)
    base_step = runs[base].summary["step_seconds"] if base in runs else None
    lines = [
        f"| scheme | params | tokens | val loss (nats/token) | bits/byte | tokens/s | step time vs {base} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in runs.items():
        s = r.summary
        ratio = f"{s['step_seconds'] / base_step:.2f}x" if base_step else "—"
        lines.append(
            f"| {label} | {s['params']:,} | {s['tokens']:,} | {s['val_loss']:.4f} | "
            f"{s['val_bpb']:.4f} | {s['tokens_per_second']:,.0f} | {ratio} |"
        )
    return "\n".join(lines)


def demo_page(rep: Report, command: str, wall_seconds: float | None) -> str:
    """The whole demo report: what was trained, the table, loss curves and depth-weight heatmaps."""
    from attnres.analysis.plots import plot_depth_heatmaps, plot_loss_curves
    from attnres.model import ModelConfig

    col, out = rep.col, rep.out
    runs = _demo_runs(col)
    machines = []
    for r in col.unique:
        for inv in (r.info or {}).get("invocations", []):
            if inv.get("machine") and inv["machine"] not in machines:
                machines.append(inv["machine"])
    if wall_seconds is not None:
        wall = f"Wall time (this invocation, including data preparation and reused runs): {wall_seconds / 60:.1f} min"
    else:
        spent = sum(r.wall_seconds for r in runs.values())
        wall = f"Wall time (training, evaluation and probes of the runs): {spent / 60:.1f} min"
    planned = col.results[0].run
    m, t = planned.model, planned.train
    block_size = ModelConfig(**{**m.to_dict(), "residual": "block"}).block_size
    lines = (
        ["# attnres demo", ""]
        + ([] if col.complete else status(col))
        + [
            f"Command: `{command}`  ",
            f"Machine: {'; '.join(machines) if machines else machine()}  ",
            wall,
            "",
            f"Model: {m.n_layers} Transformer blocks ({m.n_sublayers} sublayers), d_model={m.d_model}, "
            f"{m.n_heads} heads; Block AttnRes with S={block_size} sublayers per block. Training: {t.steps} steps x "
            f"{t.batch_size} x {t.seq_len} tokens, {t.optimizer}, {t.schedule} schedule, lr {t.lr}, seed "
            f"{planned.seed}; same data order for every scheme.",
            "",
            "Validation loss is measured on whole held-out works; one seed, so differences of a few "
            "hundredths may be noise (the experiments report several seeds). Step time is the median "
            "optimizer step (forward + backward + update) measured in the same process.",
            "",
            demo_table(col),
            "",
        ]
    )
    if runs:
        curves = plot_loss_curves(
            {label: str(r.dir) for label, r in runs.items()},
            str(out / "loss_curves.png"),
            " vs ".join(DEMO_NAMES.get(label, label) for label in runs),
        )
        lines += [f"![loss curves]({Path(curves).name})", ""]
    for label, r in runs.items():
        if not (r.probes and r.probes.get("depth_weights")):
            continue  # no depth weights: prenorm
        name = f"depth_weights_{label}.png"
        plot_depth_heatmaps(
            nan_matrix(r.probes["depth_weights"]),
            r.probes["depth_sources"],
            str(out / name),
            f"{label} AttnRes: mean depth weights on validation text",
        )
        lines += [f"### {label}: depth weights (pre-attention and pre-MLP inputs)", "", f"![{label}]({name})", ""]
    return "\n".join(lines)
