"""The additive report on synthetic runs: which runs test additive routing (the gain rule), the Δ against the
baseline and against the replacement arm of the family in one Holm family, the gain curves; the report kind
leaves the run hashes alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnres.experiments import load_spec
from attnres.experiments.reports import write_report
from attnres.experiments.reports.additive import (
    MIN_GAIN_RMS,
    gain_curve,
    replacement_partner,
    run_counts,
)
from attnres.experiments.results import collect
from attnres.experiments.runner import PROBES_FILE, SPLIT_EVAL, plan_status
from attnres.experiments.spec import expand
from attnres.files import SUMMARY_FILE

SEEDS = [0, 1, 2]
# scheme -> mean loss; full (replacement) is the worst, the additive arms between it and prenorm
MEAN = {"prenorm": 5.20, "full": 5.25, "full-delta": 5.18, "full-gain1": 5.17, "full-gain0": 5.20, "full-mixed": 5.19}
# scheme -> the final gain RMS of each seed (None: no learned gain, or not logged)
GAIN = {
    "full-gain1": [1.01, 1.02, 1.00],
    "full-gain0": [0.0, 0.05, 0.02],  # a zero-started gain that never grew: PreNorm's read
    "full-mixed": [0.5, MIN_GAIN_RMS, None],  # one seed at the threshold, one without a logged gain
}
SPEC = """
    [experiment]
    name = "additive"
    report = "{report}"
    seeds = {seeds}
    baseline = "prenorm"
    {base}
    [[axis.backbone]]
    label = "llama"

    [[axis.backbone]]
    label = "kimi_linear"
    d_ff = 128

    [[axis.scheme]]
    label = "prenorm"
    residual = "prenorm"

    [[axis.scheme]]
    label = "full"
    residual = "full"

    [[axis.scheme]]
    label = "full-delta"
    residual = "full"
    attnres_routing = "additive"
    attnres_gain = "unit"

    [[axis.scheme]]
    label = "full-gain1"
    residual = "full"
    attnres_routing = "additive"
    attnres_gain_init = 1.0

    [[axis.scheme]]
    label = "full-gain0"
    residual = "full"
    attnres_routing = "additive"

    [[axis.scheme]]
    label = "full-mixed"
    residual = "full"
    attnres_routing = "additive"
    attnres_gain_lr = 10.0
"""


def _spec(tmp_path, tiny_base, write_spec, report="additive"):
    specs = tmp_path / f"specs-{report}"
    write_spec(specs, "additive", SPEC.format(report=report, seeds=SEEDS, base=tiny_base()))
    return load_spec("additive", specs)


@pytest.fixture
def suite(tmp_path, tiny_base, write_spec):
    """The llama half finished (the kimi_linear half not), with probes and gain rows as the trainer writes."""
    spec, runs = _spec(tmp_path, tiny_base, write_spec), tmp_path / "runs"
    for s in plan_status(spec, runs):
        labels, seed = s.run.labels, s.run.seed
        if labels["backbone"] != "llama":
            continue
        scheme = labels["scheme"]
        loss = MEAN[scheme] + 0.01 * seed + 0.001 * ((seed * 7 + len(scheme)) % 3 - 1)
        s.dir.mkdir(parents=True, exist_ok=True)
        split = {"val_loss": loss, "val_tokens": 4096, "split_tokens": 4096}
        summary = {"config_hash": s.run.hash, "val_loss": loss, SPLIT_EVAL: split, "params": 1000}
        (s.dir / SUMMARY_FILE).write_text(json.dumps(summary))
        gain = GAIN.get(scheme, [None] * len(SEEDS))[seed]
        init = 1.0 if scheme == "full-gain1" else 0.0
        probe = None if gain is None else {"gain_init": init, "gain_rms": gain, "gain_shift_rms": abs(gain - init)}
        (s.dir / PROBES_FILE).write_text(json.dumps({"routing_gain": probe}))
        if gain is not None:  # the gain's RMS on the train rows, which compacted runs keep at different steps
            steps = [1, 2 + seed, 5]
            rows = [{"kind": "train", "step": t, "gain_rms": gain * t / 5, "gain_shift_rms": 0.0} for t in steps]
            (s.dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return spec, runs


def _row(text: str, start: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert rows, f"no row starting {start!r}"
    return rows[0]


def test_the_gain_rule_marks_the_runs_that_test_additive_routing(suite, tmp_path):
    spec, runs = suite
    text = write_report(spec, runs, tmp_path / "out", figures=True).read_text()
    llama = text.split("## LLaMA")[1].split("\n## ")[0]
    # the zero-started gain that stayed near zero: its Δ shown, but marked, and the row says no run counts
    gain0 = _row(llama, "| full-gain0 |")
    assert gain0.endswith("| **no**: 0/3 |"), gain0
    assert gain0.count("not a test of additive routing") == 2, gain0  # Δ vs prenorm and vs full
    assert "| 0.023 [0.000–0.050] |" in gain0, gain0
    mixed = _row(llama, "| full-mixed |")
    assert mixed.endswith("| **no**: 2/3 (gain not logged in 1) |"), mixed  # 0.1 counts, a missing gain not
    assert "not a test of additive routing" in mixed
    assert _row(llama, "| full-delta |").endswith("| 1 (fixed) | — | yes: 3/3 (unit gain) |")
    gain1 = _row(llama, "| full-gain1 |")
    assert gain1.endswith("| yes: 3/3 |") and "not a test" not in gain1 and "| 1.010 [1.000–1.020] |" in gain1
    # replacement arms and the baseline have no gain and no Δ against a replacement arm
    assert _row(llama, "| full |").endswith("| — | — | — | — |")
    # every arm against prenorm (5) and every additive arm against full (4), corrected together
    assert "m = 9 paired comparisons" in text and "9 paired comparisons (9 over 3 seeds)" in text
    verdict = text.split("## Verdict")[1]
    assert "full-delta: vs prenorm" in verdict and "; vs full " in verdict
    assert "full-gain0:" not in verdict and "full-mixed:" not in verdict  # not tests: no verdict line
    assert "replacement arm full (+0.05" in text  # worse than prenorm: its deficit is said
    assert "No run has finished on this backbone yet." in text.split("## Kimi Linear")[1]
    assert (tmp_path / "out" / "gain_rms.png").is_file() and "(gain_rms.png)" in text


def test_the_rule_partner_and_gain_curve(suite):
    spec, runs = suite
    col = collect(spec, runs)
    assert replacement_partner(col, "full-gain0") == "full" and replacement_partner(col, "full-delta") == "full"
    assert replacement_partner(col, "full") is None  # already replacement
    done = {(r.run.labels["scheme"], r.run.seed): r for r in col.results if r.done}
    assert run_counts(col, "full-delta", done["full-delta", 0])  # unit gain: by construction
    assert not run_counts(col, "full-gain0", done["full-gain0", 1])  # 0.05 < 0.1
    assert run_counts(col, "full-mixed", done["full-mixed", 1])  # exactly 0.1
    assert not run_counts(col, "full-mixed", done["full-mixed", 2])  # no logged gain
    steps, mean = gain_curve([done["full-gain1", s] for s in SEEDS])
    assert steps.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # the union of the steps the runs kept
    assert np.allclose(mean, np.mean(GAIN["full-gain1"]) * steps / 5)  # each run interpolated in between


def test_the_report_kind_leaves_the_run_hashes_alone(tmp_path, tiny_base, write_spec):
    additive = _spec(tmp_path, tiny_base, write_spec)
    generic = _spec(tmp_path, tiny_base, write_spec, report="generic")
    assert additive.report == "additive" and generic.report == "generic"
    assert [r.hash for r in expand(additive)] == [r.hash for r in expand(generic)]
