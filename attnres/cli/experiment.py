"""attnres experiment: run (or list, or plan) a named experiment spec (attnres.experiments)."""

from __future__ import annotations

import shlex

from attnres.cli.options import CLIError, examples
from attnres.experiments import (
    DEFAULT_RUNS_ROOT,
    available,
    format_plan,
    load_spec,
    plan_status,
    run_experiment,
)
from attnres.experiments.runner import matches, planned_elsewhere
from attnres.experiments.spec import expand


def add_parser(sub) -> None:
    p = sub.add_parser(
        "experiment",
        help="run a named experiment (resumable; finished runs are skipped)",
        description=(
            "Expand experiments/NAME.toml into runs, hash each run's full config, and train the missing ones "
            "one after another into RUNS/NAME/<hash>/ (interrupted runs resume from their checkpoint). Without "
            "NAME, list the experiments."
        ),
        epilog=examples(
            "attnres experiment                              # the experiments there are",
            "attnres experiment ablations --dry-run          # its runs, their state and estimated CPU time",
            "attnres experiment ablations --max-runs 4 --threads 2",
        ),
    )
    p.add_argument("name", nargs="?", help="experiment name (a spec in experiments/) or a .toml path")
    p.add_argument("--dry-run", action="store_true", help="list the runs, their state and estimated CPU time")
    p.add_argument("--max-runs", dest="max_runs", type=int, default=None, help="train at most K runs")
    p.add_argument("--only", help="only runs whose name (e.g. scheme=full/seed=1) or hash matches this glob")
    p.add_argument(
        "--runs", default=None, help="runs directory (default experiments/runs, where the finished runs are committed)"
    )
    p.add_argument("--specs", default=None, help="spec directory (default ./experiments)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (not part of the run hash)")
    p.add_argument(
        "--retry-diverged", dest="retry_diverged", action="store_true", help="train diverged runs again from scratch"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.name:
        print("experiments: " + (", ".join(available(args.specs)) or "none found"))
        return 0
    spec = load_spec(args.name, args.specs)
    runs = args.runs or DEFAULT_RUNS_ROOT
    if args.max_runs is not None and args.max_runs < 0:
        raise CLIError(
            f"--max-runs {args.max_runs} is invalid: pass 0 or more runs to train (0: only reuse and plan), "
            "or leave it out for all"
        )
    if args.only:
        planned = expand(spec)
        if not any(matches(run, args.only) for run in planned):
            names = [run.name for run in planned]
            shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            raise CLIError(
                f"--only {args.only!r} matches none of the {len(names)} runs of {spec.name}: {shown}. "
                "Fix: pass a glob over these names (e.g. 'seed=1') or a run hash"
            )
    if args.dry_run:
        print(format_plan(spec, plan_status(spec, runs), args.only, planned_elsewhere(spec)))
        return 0
    # the command recorded with each run: the options that decide what runs, in a fixed order
    flags = [
        ("--max-runs", args.max_runs),
        ("--only", args.only),
        ("--threads", args.threads),
        ("--runs", args.runs),
        ("--specs", args.specs),
    ]
    command = shlex.join(
        ["attnres", "experiment", args.name]
        + [str(a) for k, v in flags if v is not None for a in (k, v)]
        + (["--retry-diverged"] if args.retry_diverged else [])
    )
    counts = run_experiment(
        spec,
        runs,
        max_runs=args.max_runs,
        only=args.only,
        retry_diverged=args.retry_diverged,
        progress=not args.no_progress,
        threads=args.threads,
        command=command,
        resume_with=command,
    )
    report = shlex.join(
        ["attnres", "report", args.name] + [str(a) for k, v in flags[3:] if v is not None for a in (k, v)]
    )
    print(f"{spec.name}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f"; report with `{report}`")
    return 0
