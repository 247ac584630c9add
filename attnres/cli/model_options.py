"""attnres options: every ModelConfig field, its type, default, the scheme or backbone that reads it."""

from __future__ import annotations

from attnres.cli.options import examples


def add_parser(sub) -> None:
    p = sub.add_parser(
        "options",
        help="every model option: type, default, who reads it, meaning",
        description=(
            "Print every ModelConfig field as a markdown table: its type and default, the residual scheme or "
            "backbone that reads it (from their registries) and what it means. docs/options.md holds this output."
        ),
        epilog=examples("attnres options", "attnres options > docs/options.md"),
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from attnres.model.options_table import options_markdown

    print(options_markdown())
    return 0
