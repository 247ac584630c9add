"""attnres report: an experiment's REPORT.md and figures from its cached runs (no training)."""

from __future__ import annotations

from attnres.cli.options import examples
from attnres.experiments import DEFAULT_RUNS_ROOT, load_spec
from attnres.experiments.reports import write_report


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write an experiment's REPORT.md and figures from its cached runs",
        description=(
            "Read RUNS/NAME/<hash>/ of every planned run (no training) and write OUT/REPORT.md with tables, "
            "PNG figures, statistics over seeds, the commands, machine, wall time and git commit. A partial "
            "suite gives a report marked partial."
        ),
        epilog=examples(
            "attnres report ablations                        # reports/ablations/REPORT.md",
            "attnres report my.toml --runs runs/mine --out reports/mine",
        ),
    )
    p.add_argument("name", help="experiment name (a spec in experiments/) or a .toml path")
    p.add_argument(
        "--runs", default=None, help="runs directory (default experiments/runs, where the finished runs are committed)"
    )
    p.add_argument("--specs", default=None, help="spec directory (default ./experiments)")
    p.add_argument("--out", default=None, help="report directory (default reports/NAME)")
    p.set_defaults(func=run)


def run(args) -> int:
    spec = load_spec(args.name, args.specs)
    flags = [("--runs", args.runs), ("--specs", args.specs), ("--out", args.out)]
    command = " ".join(["attnres report", args.name] + [f"{k} {v}" for k, v in flags if v is not None])
    print(f"report: {write_report(spec, args.runs or DEFAULT_RUNS_ROOT, args.out, command=command)}")
    return 0
