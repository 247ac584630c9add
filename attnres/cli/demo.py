"""attnres demo: the experiment experiments/demo.toml (prenorm vs Block vs Full AttnRes) with the
flags applied on top of its base, trained by the experiment runner and written up as its report."""

from __future__ import annotations

import time

from attnres.cli.options import add_run_options, command_line, examples, run_overrides
from attnres.experiments import load_spec, run_experiment
from attnres.experiments.reports import demo_table, write_report
from attnres.experiments.results import collect
from attnres.experiments.runner import experiment_dir, remove_runs
from attnres.experiments.spec import CHECKOUT_SPECS_DIR, with_overrides


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: prenorm vs Block vs Full AttnRes",
        description=(
            "Train prenorm, Block AttnRes and Full AttnRes with the same seed, data order and budget on the "
            "bundled Shakespeare corpus (the experiment experiments/demo.toml; flags apply on top of it), "
            "print a table and write a report (loss curves, depth-weight heatmaps). Finished runs are reused; "
            "interrupted ones resume."
        ),
        epilog=examples("attnres demo", "attnres demo --steps 100 --out runs/demo-short", "attnres demo --fresh"),
    )
    add_run_options(p, preset_default="demo")
    p.add_argument("--out", default="runs/demo", help="runs and report directory")
    p.add_argument("--fresh", action="store_true", help="retrain even if finished runs exist")
    p.set_defaults(func=run)


def run(args) -> int:
    started = time.time()
    spec = with_overrides(load_spec("demo", CHECKOUT_SPECS_DIR), run_overrides(args))
    if args.fresh:
        remove_runs(spec, args.out)
    command = command_line(args)
    counts = run_experiment(
        spec,
        args.out,
        progress=not args.no_progress,
        command=command,
        resume_with=command_line(args, drop=("--fresh",)),
    )
    if counts["skipped"]:
        print(
            f"reusing {counts['skipped']} finished run(s) in {experiment_dir(args.out, spec.name)} (--fresh retrains)"
        )
    report = write_report(spec, args.out, args.out, command=command, wall_seconds=time.time() - started)
    print()
    print(demo_table(collect(spec, args.out)))
    print(f"\nreport: {report}")
    return 0
