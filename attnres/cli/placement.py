"""attnres placement: depth-block sizes learned from trained Full AttnRes runs (attnres.analysis.placement)."""

from __future__ import annotations

from attnres.analysis.placement import (
    OBJECTIVES,
    best_block_sizes,
    describe_placement,
    runs_depth_weights,
)
from attnres.cli.options import examples


def add_parser(sub) -> None:
    p = sub.add_parser(
        "placement",
        help="uneven depth blocks learned from trained Full AttnRes runs",
        description=(
            "Choose N depth-block sizes from the mean depth weights of finished Full AttnRes experiment runs, "
            "exactly (dynamic programming): by default those that keep the most attention mass inside blocks "
            "(bound the sizes with --max-size: unbounded, one large block and N-1 single sublayers win), or with "
            "--objective fit those whose Block AttnRes best approximates the weights. Prints "
            "`attnres_block_sizes = [...]` for an experiment spec or --set."
        ),
        epilog=examples("attnres placement experiments/runs/ablations/<hash> --blocks 8 --max-size 8"),
    )
    p.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="finished Full AttnRes runs (config.json, probes.json); several are averaged",
    )
    p.add_argument("--blocks", type=int, required=True, help="N, the number of depth blocks")
    p.add_argument("--min-size", type=int, default=1, help="smallest block, in sublayers")
    p.add_argument("--max-size", type=int, default=None, help="largest block, in sublayers")
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="mass",
        help="mass: attention mass kept inside blocks (default); fit: squared error of the best "
        "Block approximation of the weights",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    weights = runs_depth_weights(args.run_dirs)
    sizes = best_block_sizes(
        weights, args.blocks, objective=args.objective, min_size=args.min_size, max_size=args.max_size
    )
    print("\n".join(describe_placement(weights, sizes)))
    return 0
