"""Every committed reports/NAME/REPORT.md is what `attnres report NAME` writes from the committed runs,
byte for byte (figures are not drawn: the page's text does not depend on them), and the runs behind the
README's headline rows trained at one clean commit on one machine class, as the README says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnres.experiments import load_spec
from attnres.experiments.reports import REPORT_FILE, write_report
from attnres.experiments.runner import trained_invocations

ROOT = Path(__file__).resolve().parents[2]
RUNS = Path("experiments") / "runs"
# the demo page is written by `attnres demo`, which trains its own runs (not committed)
COMMITTED = sorted(p.parent.name for p in (ROOT / "reports").glob(f"*/{REPORT_FILE}") if p.parent.name != "demo")
# the experiments behind the README's headline rows, which it says trained at one commit on one machine class
HEADLINE = ("lr-sweep", "equal-time", "equal-time-kimi", "additive", "scaling", "kimi-scaling")
# experiments of which only the runs of the spec's headline rows are the README's (the other rows are older)
HEADLINE_ROWS = ("ablations", "arena", "routing")


def test_the_committed_reports_are_found():
    assert len(COMMITTED) >= 11 and "ablations" in COMMITTED and "kimi-scaling" in COMMITTED
    for name in COMMITTED:
        assert (ROOT / RUNS / name).is_dir(), f"reports/{name} has no committed runs in {RUNS}/{name}"


@pytest.mark.parametrize("name", COMMITTED)
def test_a_committed_report_regenerates_byte_for_byte(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the page names its spec and runs by the paths `attnres report` uses
    written = write_report(load_spec(name), RUNS, tmp_path / name, figures=False)
    committed = (ROOT / "reports" / name / REPORT_FILE).read_text()
    regenerated = written.read_text()
    if regenerated != committed:
        old, new = committed.splitlines(), regenerated.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
        pytest.fail(
            f"reports/{name}/{REPORT_FILE} is not what `attnres report {name}` writes from {RUNS}; first "
            f"difference at line {first + 1}:\n- {old[first] if first < len(old) else '<end>'}\n"
            f"+ {new[first] if first < len(new) else '<end>'}\nregenerate it with `attnres report {name}`"
        )


def _where_trained(run_dir: Path) -> set[tuple[str, str]]:
    """(commit, machine class) of every invocation that trained the run, or that trained the run it copies."""
    info = json.loads((run_dir / "run.json").read_text())
    trained = trained_invocations(info)
    assert trained, f"{run_dir}: run.json records no training invocation"
    return {(i["commit"], i["machine"].split(",")[0]) for i in trained}


def _headline_run_dirs(name: str) -> list[Path]:
    """The committed run directories of ``name`` behind the README's headline rows."""
    dirs = [d for d in sorted((ROOT / RUNS / name).iterdir()) if (d / "run.json").is_file()]
    if name not in HEADLINE_ROWS:
        return dirs
    spec = load_spec(name)
    assert spec.headline, f"{name}: the spec names no headline rows"
    # a headline row is a point of an axis: a tag with the same value (routing's family = "block") is not
    rows = {(axis, p.label) for axis, points in spec.axes for p in points if p.label in spec.headline}
    labels = {d: json.loads((d / "run.json").read_text())["labels"] for d in dirs}
    return [d for d in dirs if any(labels[d].get(axis) == label for axis, label in rows)]


def test_the_headline_runs_trained_at_one_clean_commit_on_one_machine_class():
    seen: dict[tuple[str, str], list[str]] = {}
    for name in HEADLINE + HEADLINE_ROWS:
        for run_dir in _headline_run_dirs(name):
            for where in _where_trained(run_dir):
                seen.setdefault(where, []).append(f"{name}/{run_dir.name}")
    assert len(seen) == 1, {where: f"{len(runs)} runs, e.g. {runs[0]}" for where, runs in seen.items()}
    ((commit, _machine),) = seen
    assert not commit.endswith("+dirty"), f"the headline runs trained at an uncommitted tree ({commit})"
