"""``write_report``: REPORT.md and PNG figures of one experiment, the sections its report kind picks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from attnres.experiments.reports.ablations import ablations_report
from attnres.experiments.reports.additive import additive_report
from attnres.experiments.reports.arch_sweep import arch_sweep_report
from attnres.experiments.reports.arena import arena_report
from attnres.experiments.reports.block_size import block_size_report
from attnres.experiments.reports.common import Report, corrected
from attnres.experiments.reports.demo import demo_page
from attnres.experiments.reports.dynamics import dynamics_report
from attnres.experiments.reports.generic import generic_report
from attnres.experiments.reports.importance import importance_report
from attnres.experiments.reports.kimi_linear import kimi_linear_report
from attnres.experiments.reports.kimi_scaling import kimi_scaling_report
from attnres.experiments.reports.lr_sweep import lr_sweep_report
from attnres.experiments.reports.retrofit import retrofit_report
from attnres.experiments.reports.routing import routing_report
from attnres.experiments.reports.scaling import scaling_report
from attnres.experiments.reports.sections import (
    provenance,
    runs_table,
    stats_rule,
    status,
)
from attnres.experiments.results import collect
from attnres.experiments.spec import ExperimentSpec, experiment_command, load_spec
from attnres.files import atomic_write_text

REPORT_FILE = "REPORT.md"
DEFAULT_REPORTS_ROOT = "reports"


BUILDERS: dict[str, Callable[[Report], None]] = {
    "scaling": scaling_report,
    "ablations": ablations_report,
    "block-size": block_size_report,
    "arena": arena_report,
    "dynamics": dynamics_report,
    "arch-sweep": arch_sweep_report,
    "kimi-linear": kimi_linear_report,
    "kimi-scaling": kimi_scaling_report,
    "lr-sweep": lr_sweep_report,
    "retrofit": retrofit_report,
    "routing": routing_report,
    "importance": importance_report,
    "additive": additive_report,
    "generic": generic_report,
}


def corrected_report(name: str, runs_root, specs_dir=None) -> Report:
    """The report NAME as ``write_report`` builds it on its second pass: its comparisons Holm-corrected
    over everything the report asks, for another page to quote. Nothing is drawn or written."""
    spec = load_spec(name, specs_dir)
    return corrected(collect(spec, runs_root), BUILDERS.get(spec.report, generic_report))


def write_report(
    spec: ExperimentSpec,
    runs_root,
    out_dir=None,
    command: str | None = None,
    wall_seconds: float | None = None,
    figures: bool = True,
) -> Path:
    """Build ``<out_dir>/REPORT.md`` (default ``reports/NAME/``) and its PNGs; returns the path.
    ``wall_seconds``: the demo page states the wall time of the invocation that trained the runs and
    wrote it (``attnres demo``); without it, the runs' own. ``figures=False`` writes the same REPORT.md
    without drawing the PNGs.

    The page is a function of the spec, the runs and this code alone (no clock, no commit of the
    writer), so a committed REPORT.md regenerates byte for byte. It is built twice: the first pass
    collects every paired comparison, which are then Holm-corrected together for the second."""
    if not Path(runs_root).is_dir():
        raise FileNotFoundError(
            f"runs directory {runs_root} does not exist; a report reads finished runs from there "
            f"(experiments/runs in a clone of the repository): pass --runs DIR, or run "
            f"`{experiment_command(spec, runs_root)}` first"
        )
    out = Path(out_dir) if out_dir is not None else Path(DEFAULT_REPORTS_ROOT) / spec.name
    col = collect(spec, runs_root)  # first: a spec or run that cannot be read leaves no directory behind
    out.mkdir(parents=True, exist_ok=True)
    command = command or f"attnres report {spec.name}"
    if spec.report == "demo":
        (out / REPORT_FILE).write_text(demo_page(Report(col, out, draw=figures), command, wall_seconds))
        return out / REPORT_FILE
    builder = BUILDERS.get(spec.report, generic_report)
    axes = [a for a, _ in spec.axes if a not in ("budget",)]
    first = Report(col, out, draw=False)
    if col.n_done:
        builder(first)
    rep = Report(col, out, first.comparisons.corrected(), draw=figures)
    if col.n_done:
        builder(rep)
    else:
        rep.add("## Results", "", "No run has finished yet: nothing to report.", "")
    head = (
        [f"# Experiment `{spec.name}`", ""]
        + ([spec.description, ""] if spec.description else [])
        + status(col)
        + provenance(col, command)
        + stats_rule(col, axes, rep.comparisons)
    )
    atomic_write_text(out / REPORT_FILE, "\n".join(head + rep.lines + runs_table(col)) + "\n")
    return out / REPORT_FILE
