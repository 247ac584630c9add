"""attnres demo: prenorm vs Block vs Full AttnRes, trained by the experiment runner (experiments/demo.toml)
and written up as its report. By default at a quick size, a result within about two minutes on two
cores; ``--full`` at the spec's own size."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

from attnres.cli.options import (
    CLIError,
    add_run_options,
    command_line,
    examples,
    run_overrides,
)
from attnres.experiments import load_spec, run_experiment
from attnres.experiments.reports import demo_table, write_report
from attnres.experiments.results import collect
from attnres.experiments.runner import (
    RUN_FILE,
    LabelledRuns,
    RunStatus,
    plan_status,
    remove_runs,
)
from attnres.experiments.spec import CHECKOUT_SPECS_DIR, ExperimentSpec, with_overrides
from attnres.files import read_json

# The quick demo: experiments/demo.toml (the full-size comparison) at half the width and sequence and a
# quarter of the steps, with the learning rate doubled and a warmup of a tenth of the steps (also of
# --steps N) for the short run. 3 x 150 steps x 16 x 64 tokens:
# 1.6 min of `attnres demo` on the project's 2-core machine (docs/cli.md).
QUICK = {
    "d_model": 64,
    "seq_len": 64,
    "steps": 150,
    "lr": 6e-3,
    "eval_every": 50,
    "eval_batches": 8,
    "checkpoint_every": 50,
}
QUICK_TOKENS_PER_SECOND = 7000  # prenorm at the quick size, one thread, measured on 2 idle cores
FULL_MINUTES = 11  # the budget note of experiments/demo.toml: 10.5 min on 2 quiet cores
# what the demo writes, in the order the closing lines list it
FILES = {
    "REPORT.md": "the table above with the models, the training and the machine, and the figures",
    "loss_curves.png": "validation loss of the three models against tokens trained",
    "depth_weights_block.png": "Block AttnRes: the weight each sublayer gives each depth block",
    "depth_weights_full.png": "Full AttnRes: the weight each sublayer gives every earlier sublayer",
}


def default_threads() -> int:
    """Half the cores that are idle now, at least one. PyTorch's default (every core) stalls when another
    process holds one of them: at the quick size on 2 cores, 2 threads ran 1.5x faster than 1 on an idle
    machine, but 15x slower beside one busy process, which left 1 thread unaffected."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, int(max(0.0, cores - _load())) // 2)


def _load() -> float:
    """The 1-minute load average (0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: prenorm vs Block vs Full AttnRes (about 2 minutes)",
        description=(
            "Train prenorm, Block AttnRes and Full AttnRes with the same seed, data order and budget on the "
            "bundled Shakespeare corpus, print a table and write a report (loss curves, depth-weight "
            "heatmaps) beside the three runs (OUT/prenorm, OUT/block, OUT/full). By default a quick size "
            "(d_model 64, 150 steps x 16 x 64 tokens: about 2 minutes on 2 cores); --full runs "
            f"experiments/demo.toml as written (d_model 128, 600 steps x 16 x 128: about {FULL_MINUTES} "
            "minutes on 2 cores). Other flags apply on top. Finished runs are reused and interrupted ones "
            "resume; a run of another configuration in OUT is trained afresh.\n"
            "Threads: by default half the cores idle at the start, at least one. On a shared machine "
            "PyTorch's default (all cores) can stall: at the quick size on 2 cores, 2 threads ran 1.5x "
            "faster than 1 on an idle machine but 15x slower beside one busy process."
        ),
        epilog=examples(
            "attnres demo                              # quick: runs/demo/{prenorm,block,full}, about 2 min",
            "attnres demo --full                       # full size: runs/demo-full, about 11 min on 2 cores",
            "attnres demo --steps 60 --out runs/demo-60",
            "attnres demo --fresh --threads 1          # retrain, on one thread",
        ),
    )
    add_run_options(p, preset_default="demo")
    p.add_argument("--full", action="store_true", help="the full-size comparison (experiments/demo.toml as written)")
    p.add_argument("--out", default=None, help="runs and report directory (default: runs/demo, runs/demo-full)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: half the idle cores, at least 1)")
    p.add_argument("--fresh", action="store_true", help="retrain even if finished runs exist")
    p.set_defaults(func=run)


def demo_spec(full: bool, overrides: dict) -> ExperimentSpec:
    """experiments/demo.toml, at the quick size unless ``full`` or another preset, with ``overrides`` on top;
    the runs keep their checkpoints, so that `attnres sample` reads them."""
    spec = load_spec("demo", CHECKOUT_SPECS_DIR)
    # another --preset names its own sizes, which the quick ones must not overwrite
    own_preset = overrides.get("preset") not in (None, spec.base.get("preset"))
    if not full and not own_preset:
        steps = overrides.get("steps", QUICK["steps"])
        quick = {**QUICK, "warmup_steps": max(1, steps // 10) if isinstance(steps, int) else 1}
        # its table reads the trainer's last evaluation: no second pass over the whole validation split
        spec = dataclasses.replace(
            with_overrides(spec, quick), tokens_per_second=QUICK_TOKENS_PER_SECOND, eval_split=False
        )
    return dataclasses.replace(with_overrides(spec, overrides), keep_checkpoint=True)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run(args) -> int:
    started = time.time()
    threads = args.threads or default_threads()
    spec = demo_spec(args.full, run_overrides(args))
    out = args.out or ("runs/demo-full" if args.full else "runs/demo")
    runs = LabelledRuns(out)
    if args.fresh:
        remove_runs(spec, runs)
    command = command_line(args)
    todo = [s for s in plan_status(spec, runs) if s.state != "done"]
    for s in todo:
        if s.dir.is_dir() and any(s.dir.iterdir()) and not (s.dir / RUN_FILE).is_file():
            raise CLIError(
                f"--out {out}: {s.dir} is not a run of attnres demo (it has no {RUN_FILE}) and the demo would "
                "train into it; pass another --out"
            )
        held = (read_json(s.dir / RUN_FILE) or {}).get("config_hash")
        if held and held != s.run.hash:
            print(f"{s.dir} held a run of another configuration: removed, to train afresh (--out DIR keeps both)")
            shutil.rmtree(s.dir)
    size = "full size" if args.full else "quick size; --full for the full-size comparison"
    if todo:
        print(
            f"attnres demo ({size}): {len(todo)} model(s) to train, {todo[0].run.train.steps} steps each, "
            f"{threads} thread(s) ({os.cpu_count()} cores, load {_load():.1f}); "
            f"about {_minutes(sum(s.run.estimated_seconds(s.step) for s in todo))} -> {out}"
        )
    pace = 1.0  # measured over estimated wall time of the runs trained so far
    for i, s in enumerate(todo):
        left = sum(t.run.estimated_seconds(t.step) for t in todo[i:]) * pace
        label = "-".join(s.run.labels.values())
        print(f"\n[{i + 1}/{len(todo)}] {label}; about {_minutes(left)} left for the demo")
        began = time.time()
        run_experiment(
            spec,
            runs,
            only=s.run.name,
            progress=not args.no_progress,
            threads=threads,
            command=command,
            resume_with=command_line(args, drop=("--fresh",)),
        )
        pace = _pace(todo[: i + 1], time.time() - began, pace, i)
    reused = len(plan_status(spec, runs)) - len(todo)
    if reused:
        print(f"reusing {reused} finished run(s) in {out} (--fresh retrains)")
    report = write_report(spec, runs, out, command=command, wall_seconds=time.time() - started)
    print(f"\nprenorm vs Block vs Full AttnRes ({size}), {_minutes(time.time() - started)}:\n")
    print(demo_table(collect(spec, runs)))
    print(_closing(Path(out), report, args.full))
    return 0


def _pace(done: list[RunStatus], last_seconds: float, pace: float, i: int) -> float:
    """The running mean of measured over estimated seconds, after run ``i`` took ``last_seconds``."""
    estimated = done[-1].run.estimated_seconds(done[-1].step)
    ratio = last_seconds / estimated if estimated > 0 else 1.0
    return ratio if i == 0 else (pace * i + ratio) / (i + 1)


def _closing(out: Path, report: Path, full: bool) -> str:
    """What each file is and what to run next."""
    lines = ["", f"report: {report}", "", f"files in {out}/:"]
    listed = [(name, what) for name, what in FILES.items() if (out / name).is_file()]
    runs = [d for d in ("prenorm", "block", "full") if (out / d / RUN_FILE).is_file()]
    listed.append(
        (
            " ".join(f"{d}/" for d in runs),
            "the runs, each one of attnres train: config.json, metrics.jsonl, tokenizer.json, checkpoint/",
        )
    )
    width = max(len(name) for name, _ in listed)
    lines += [f"  {name:<{width}}  {what}" for name, what in listed]
    block = out / "block"
    lines += ["", "next:"]
    if (block / RUN_FILE).is_file():
        lines.append(f'  attnres sample {block} --prompt "ROMEO:"     # text from the Block AttnRes model')
    if not full:
        lines.append(f"  attnres demo --full     # the full-size comparison (runs/demo-full), about {FULL_MINUTES} min")
    lines.append("  attnres experiment ablations --dry-run     # the paper's experiments (docs/experiments.md)")
    return "\n".join(lines)
