"""Side-by-side step cost of an experiment's schemes, for its comparisons at equal wall-clock time.

A run's own step times (``metrics.jsonl``) say how fast it trained on a shared machine at the hour it ran:
runs trained hours apart under different loads give step-time ratios that measure the machine, not the
scheme (0.78 to 1.37 for the same code in the kimi-scaling experiment). Here the runs of one group (one
size of a scaling experiment) are rebuilt from their configs, seed 0, as the trainer builds them (model,
optimizer, data, schedule), and their ``Trainer.train_step`` timed in the same process, at the thread count
the runs trained with (the process's own when their configs leave it unset), round-robin: each
round runs every scheme's steps in turn, the order rotated from round to round, and a scheme's ratio is
the median over rounds of its round time over the baseline's in the same round, so that drifts of the
machine hit all alike. The result is cached as JSON in the experiment's runs directory
(``STEP_COST_FILE``), with the machine, the threads and the load it was measured under; the reports read
the cache and measure only what it lacks.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from attnres.experiments.spec import PlannedRun
from attnres.files import atomic_write_json, read_json

STEP_COST_FILE = "step_costs.json"
ROUNDS = 5
STEPS_PER_ROUND = 2
WARMUP_STEPS = 2


def measure_step_costs(
    runs: Mapping[str, PlannedRun],
    baseline: str,
    *,
    rounds: int = ROUNDS,
    steps_per_round: int = STEPS_PER_ROUND,
    warmup: int = WARMUP_STEPS,
    log: Callable[[str], None] = print,
) -> dict:
    """{scheme: {"ratio", "ratio_min", "ratio_max", "step_s"}} for the planned runs ``runs`` (scheme ->
    ``PlannedRun``, one group), timed side by side as the module docstring says; ``baseline`` is one of them."""
    from attnres.train.trainer import Trainer

    if baseline not in runs:
        raise ValueError(f"measure_step_costs: baseline {baseline!r} is not among the schemes {sorted(runs)}")
    # time the steps at the thread count the runs trained with: the schemes' ops need not gain alike from
    # more threads, so a ratio timed at another count is not the runs' ratio
    trained = {run.train.threads for run in runs.values()}
    threads = trained.pop() if len(trained) == 1 and None not in trained else torch.get_num_threads()
    previous = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory(prefix="attnres-step-cost-") as tmp:
        trainers = {}
        try:
            for label, run in runs.items():
                cfg = copy.deepcopy(run.train)
                cfg.out_dir, cfg.progress, cfg.threads = str(Path(tmp) / label), False, threads
                trainers[label] = Trainer(copy.deepcopy(run.model), cfg, log=lambda _: None, name=label)
            for t in trainers.values():
                for _ in range(warmup):
                    t.train_step()
            labels = list(trainers)
            seconds: dict[str, list[float]] = {label: [] for label in labels}
            for k in range(rounds):
                for label in labels[k % len(labels) :] + labels[: k % len(labels)]:
                    t0 = time.perf_counter()
                    for _ in range(steps_per_round):
                        trainers[label].train_step()
                    seconds[label].append((time.perf_counter() - t0) / steps_per_round)
                log(f"step cost: round {k + 1} of {rounds}")
        finally:
            for t in trainers.values():
                t.close()
            torch.set_num_threads(previous)
    out = {}
    for label, times in seconds.items():
        ratios = [a / b for a, b in zip(times, seconds[baseline], strict=True)]
        out[label] = {
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "step_s": statistics.median(times),
        }
    return {
        "schemes": out,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "threads": threads,
        "load_before": load,
        "torch": torch.__version__,
    }


def cached_step_costs(
    runs_dir: Path, group: str, measure: Callable[[], dict], log: Callable[[str], None] = print
) -> dict:
    """The step costs of ``group`` from ``runs_dir / STEP_COST_FILE``, measured with ``measure()`` and
    written there (atomically) when the file lacks them."""
    path = runs_dir / STEP_COST_FILE
    table = read_json(path) or {}
    if group not in table:
        log(f"step cost: measuring {group} side by side (cached in {path})")
        table[group] = measure()
        atomic_write_json(path, table)
    return table[group]
