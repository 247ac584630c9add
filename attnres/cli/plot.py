"""attnres plot: redraw a run's figures (loss.png, depth_weights.png) from the files it wrote."""

from __future__ import annotations

import sys

from attnres.analysis.plots import plot_run
from attnres.cli.options import examples


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="redraw a run's loss.png and depth_weights.png",
        description=(
            "Draw loss.png (training and validation loss from metrics.jsonl) and, for depth-attention "
            "schemes, depth_weights.png (the depth_weights.json attnres train saved) into the run directory. "
            "attnres train draws them at the end of a run; this redraws them, also while a run is going."
        ),
        epilog=examples("attnres plot runs/block"),
    )
    p.add_argument("run", help="run directory of attnres train")
    p.set_defaults(func=run)


def run(args) -> int:
    notes: list[str] = []
    written = plot_run(args.run, notes)
    for note in notes:
        print(f"attnres plot: {note}", file=sys.stderr)
    for path in written:
        print(f"written: {path}")
    return 0
