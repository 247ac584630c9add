"""The scaling report's seed-bootstrap intervals, its fits without the largest size and its step-count
confound, on synthetic runs whose losses follow known power laws."""

from __future__ import annotations

import json
import math
import re

import pytest

from attnres.experiments import load_spec
from attnres.experiments.fit import PowerLaw, compute_multiplier
from attnres.experiments.reports import write_report
from attnres.experiments.reports.scaling import (
    bootstrap_laws,
    fitted_laws,
    leave_largest_out,
)
from attnres.experiments.results import collect
from attnres.experiments.runner import PROBES_FILE, plan_status
from attnres.files import SUMMARY_FILE

LAWS = {"prenorm": PowerLaw(A=2.0, alpha=0.05, r2=1.0, n=3), "block": PowerLaw(A=2.0, alpha=0.06, r2=1.0, n=3)}
SEEDS = [0, 1, 2]


@pytest.fixture
def scaling(tmp_path, tiny_base, write_spec):
    specs = tmp_path / "specs"
    sizes = "".join(
        f'\n        [[axis.size]]\n        label = "s{i}"\n        n_layers = {i}\n        steps = {2 + 2 * i}\n'
        for i in (1, 2, 3)
    )
    write_spec(
        specs,
        "scaling",
        f"""
        [experiment]
        name = "scaling"
        seeds = {SEEDS}
        baseline = "prenorm"
        {tiny_base()}{sizes}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"

        [[axis.scheme]]
        label = "block"
        residual = "block"
    """,
    )
    spec = load_spec("scaling", specs)
    runs = tmp_path / "runs"
    _, C_of = fitted_laws(collect(spec, runs))  # the compute of each size needs no finished run

    def finish(noise=lambda size, scheme, seed: 0.0):
        for s in plan_status(spec, runs):
            size, scheme, seed = s.run.labels["size"], s.run.labels["scheme"], s.run.seed
            loss = LAWS[scheme](C_of[size]) * math.exp(noise(size, scheme, seed))
            s.dir.mkdir(parents=True, exist_ok=True)
            (s.dir / SUMMARY_FILE).write_text(json.dumps({"config_hash": s.run.hash, "val_loss": loss, "params": 1}))
            (s.dir / PROBES_FILE).write_text("{}")
        return collect(spec, runs)

    return spec, runs, C_of, finish


def test_exact_power_laws_give_point_intervals_and_the_same_fit_without_the_largest_size(scaling):
    _, _, C_of, finish = scaling
    col = finish()
    C = max(C_of.values())
    boot = bootstrap_laws(col, C_of, C)
    lo, hi = boot["alpha"]["block"]
    assert lo == pytest.approx(0.06, abs=1e-9) and hi == pytest.approx(0.06, abs=1e-9)
    expected = compute_multiplier(LAWS["prenorm"], LAWS["block"], C)
    assert boot["multiplier"]["block"] == pytest.approx((expected, expected), rel=1e-9)
    alphas, mults = leave_largest_out(col, C_of, C)
    assert alphas["block"] == pytest.approx(0.06) and mults["block"] == pytest.approx(expected)


def test_seed_noise_widens_the_interval_and_a_bent_largest_point_moves_the_full_fit(scaling, tmp_path):
    spec, runs, C_of, finish = scaling
    # per-seed noise all schemes share at a size (the pairing keeps it), one scheme-specific part, and a
    # largest size bent down for Block alone
    col = finish(lambda size, scheme, seed: 0.01 * (seed - 1) + 0.003 * ((seed + len(scheme)) % 3 - 1))
    C = max(C_of.values())
    boot = bootstrap_laws(col, C_of, C)
    lo, hi = boot["alpha"]["block"]
    fits, _ = fitted_laws(col)
    assert lo < fits["block"].alpha < hi
    assert boot == bootstrap_laws(col, C_of, C)  # a fixed RNG seed: the report regenerates byte for byte

    bent = finish(lambda size, scheme, seed: -0.02 if (size, scheme) == ("s3", "block") else 0.0)
    alphas, _ = leave_largest_out(bent, C_of, C)
    assert alphas["block"] == pytest.approx(0.06) and fitted_laws(bent)[0]["block"].alpha > 0.061

    text = write_report(spec, runs, tmp_path / "out", figures=False).read_text()
    assert "**Size is confounded with step count**" in text and "s1 4, s2 6, s3 8 steps" in text
    # the fit row: A, α, the bootstrap interval (a point: the bent runs have no seed noise), α without s3
    assert re.search(r"\| block \| [\d.]+ \| [\d.]+ \| \[[\d.]+, [\d.]+\] \| 0\.0600 \|", text)
    assert "seed-bootstrap 95 % | fits without s3, at the same C |" in text
