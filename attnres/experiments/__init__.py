"""The paper's experiments at CPU scale: specs, a resumable runner, statistics, fits and reports.

``attnres experiment NAME`` expands ``experiments/NAME.toml`` into run configs, hashes
each, and trains the missing ones into ``experiments/runs/NAME/<hash>/`` (finished
runs are skipped, interrupted ones resume from their checkpoint). ``attnres report
NAME`` turns the cached runs into ``reports/NAME/REPORT.md`` with figures.
"""

from attnres.experiments.runner import (
    DEFAULT_RUNS_ROOT,
    format_plan,
    plan_status,
    run_experiment,
)
from attnres.experiments.spec import (
    ExperimentError,
    ExperimentSpec,
    PlannedRun,
    available,
    config_hash,
    expand,
    find_spec,
    load_spec,
    parse_spec,
)
from attnres.experiments.stats import STATS_RULE, Comparisons, mean_std, paired

__all__ = [
    "DEFAULT_RUNS_ROOT",
    "Comparisons",
    "ExperimentError",
    "ExperimentSpec",
    "STATS_RULE",
    "PlannedRun",
    "available",
    "config_hash",
    "expand",
    "find_spec",
    "format_plan",
    "load_spec",
    "mean_std",
    "paired",
    "parse_spec",
    "plan_status",
    "run_experiment",
]
