"""attnres eval: the validation loss of a trained run."""

from __future__ import annotations

import json

from attnres.cli.options import add_compile_option, examples
from attnres.train.evaluation import evaluate_run


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss of a trained run",
        description=("Evaluate a run's checkpoint on its validation split (or on --data); prints JSON."),
        epilog=examples("attnres eval runs/block", "attnres eval runs/block --batches 8 --data my_texts/"),
    )
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument("--data", help="evaluate on this data's validation split instead")
    p.add_argument("--batches", type=int, default=None, help="number of validation batches (default: all)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    add_compile_option(p)
    p.set_defaults(func=run)


def run(args) -> int:
    print(
        json.dumps(
            evaluate_run(
                args.run,
                data=args.data,
                max_batches=args.batches,
                device=args.device,
                progress=True,
                compile=args.compile,
            )
        )
    )
    return 0
