"""attnres schemes: the residual schemes of the registry, their classification and cost."""

from __future__ import annotations

from attnres.cli.options import add_set_option, examples, parse_set
from attnres.model.schemes_table import schemes_table
from attnres.train.config import preset_model


def add_parser(sub) -> None:
    p = sub.add_parser(
        "schemes",
        help="the residual schemes: classification and cost",
        description=(
            "Print every residual scheme in the registry with its Table-5 classification (weight type, "
            "source), the parameters it adds to a model, and the depth state it keeps per token."
        ),
        epilog=examples("attnres schemes", "attnres schemes --preset tiny --set d_model=1024"),
    )
    p.add_argument("--preset", default=None, help="model size to count for (default: demo)")
    add_set_option(p, "model option, e.g. d_model=1024")
    p.set_defaults(func=run)


def run(args) -> int:
    # every scheme is evaluated on this config; its own residual value plays no part
    print(schemes_table(preset_model(args.preset, {**parse_set(args.set), "residual": "prenorm"})))
    return 0
