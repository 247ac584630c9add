"""docs/experiments.md's verdict table is what ``attnres.experiments.reports.verdicts`` generates from the
committed runs, and the generator quotes only comparisons of a report's own Holm family."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnres.experiments.reports import verdicts

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_verdict_table_is_the_generated_one(monkeypatch):
    monkeypatch.chdir(ROOT)  # the generator reads experiments/ and experiments/runs like `attnres report`
    committed = verdicts.committed_table((ROOT / verdicts.DOC).read_text())
    generated = verdicts.verdict_table()
    if committed != generated:
        old, new = committed.splitlines(), generated.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
        pytest.fail(
            f"the verdict table of {verdicts.DOC} is not what the committed runs give; first difference at row "
            f"{first + 1}:\n- {old[first] if first < len(old) else '<end>'}\n+ "
            f"{new[first] if first < len(new) else '<end>'}\nregenerate it with "
            "`python -m attnres.experiments.reports.verdicts`"
        )


def test_a_comparison_outside_the_reports_family_is_refused(monkeypatch):
    monkeypatch.chdir(ROOT)
    rep = verdicts.corrected_report("ablations", "experiments/runs")
    p = verdicts.pair({"variant": "block-S4"}, {"variant": "prenorm"})(rep)
    assert p.family == len(rep.comparisons.tests) and p.p_holm >= p.p
    with pytest.raises(RuntimeError, match="first pass did not ask"):
        verdicts.pair({"variant": "block-S4"}, {"variant": "full"})(rep)  # the ablations report never asks it


def test_the_table_is_replaced_between_its_markers_only():
    text = f"intro\n{verdicts.BEGIN}\nold | table\n{verdicts.END}\nafter\n"
    out = verdicts.replace_table(text, "| new |")
    assert out == f"intro\n{verdicts.BEGIN}\n| new |\n{verdicts.END}\nafter\n"
    assert verdicts.committed_table(out) == "| new |"
    with pytest.raises(ValueError, match="no verdict-table markers"):
        verdicts.replace_table("no markers here", "| new |")


def test_a_row_whose_report_has_no_finished_pair_is_an_error(monkeypatch, tmp_path):
    """A claim whose runs are not there gives a clear error, not a row of nan: the equal-time rows read
    runs of their own, absent from an empty runs directory."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "runs").mkdir()
    row = next(r for r in verdicts.ROWS if r.report == "equal-time-kimi")
    rep = verdicts.corrected_report(row.report, tmp_path / "runs")
    with pytest.raises(ValueError, match="equal-time-kimi report has no finished pair for block"):
        verdicts._cells(row, rep)
