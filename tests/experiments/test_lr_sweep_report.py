"""The lr-sweep report on synthetic runs: each arm's best rate, the comparisons at each arm's own best rate,
their Holm family, the load balance and the dense-against-MoE share; partial sweeps still render."""

from __future__ import annotations

import json

import pytest

from attnres.experiments import load_spec
from attnres.experiments.reports import write_report
from attnres.experiments.runner import PROBES_FILE, SPLIT_EVAL, plan_status
from attnres.files import SUMMARY_FILE

# backbone -> scheme -> lr -> mean loss; prenorm is best at 0.003, Block at 0.006 and Full at 0.001, so a
# comparison at one shared rate and one at each arm's own best rate differ
PRENORM = {"0.001": 5.30, "0.003": 5.20, "0.006": 5.25}
GAINS = {"llama": 1.0, "kimi_linear": 1.0, "kimi_dense": 0.5}  # dense keeps half of Kimi's gain
OFFSET = {"llama": 0.0, "kimi_linear": 0.1, "kimi_dense": 0.2}  # distinct losses: distinct comparisons
SEEDS = [0, 1, 2]
IMBALANCE = {"prenorm": 0.8, "block": 0.4, "full": 0.6}
SCHEME_AXES = "\n".join(f'[[axis.scheme]]\nlabel = "{s}"\nresidual = "{s}"' for s in IMBALANCE)


def _mean(backbone: str, scheme: str, lr: str) -> float:
    g = GAINS[backbone]
    if scheme == "prenorm":
        return PRENORM[lr]
    if scheme == "block":  # best 5.15 at 0.006: 0.05 below prenorm's best, times the backbone's gain
        return {"0.001": 5.25, "0.003": 5.22, "0.006": 5.20 - 0.05 * g}[lr]
    return {"0.001": 5.20 - 0.02 * g, "0.003": 5.24, "0.006": 5.30}[lr]  # full


def _loss(backbone: str, scheme: str, lr: str, seed: int) -> float:
    # a seed effect all arms share (cancels in the pairing) and a small arm-specific one
    return (
        _mean(backbone, scheme, lr)
        + OFFSET[backbone]
        + 0.01 * seed
        + 0.001 * ((seed * 7 + len(scheme) + len(lr)) % 3 - 1)
    )


@pytest.fixture
def sweep(tmp_path, tiny_base, write_spec):
    specs, runs = tmp_path / "specs", tmp_path / "runs"
    write_spec(
        specs,
        "lr-sweep",
        f"""
        [experiment]
        name = "lr-sweep"
        report = "lr-sweep"
        seeds = {SEEDS}
        baseline = "prenorm"
        {tiny_base()}
        [grid]
        lr = [0.001, 0.003, 0.006]

        [[axis.backbone]]
        label = "llama"
        d_ff = 64

        [[axis.backbone]]
        label = "kimi_linear"
        d_ff = 96

        [[axis.backbone]]
        label = "kimi_dense"
        d_ff = 128

        {SCHEME_AXES}
    """,
    )
    spec = load_spec("lr-sweep", specs)
    return spec, runs


def _finish(statuses, keep=lambda labels, seed: True, loss=_loss) -> None:
    """Write the files a finished run leaves (summary with its whole-split loss, probes, metrics)."""
    for s in statuses:
        labels, seed = s.run.labels, s.run.seed
        if not keep(labels, seed):
            continue
        value = loss(labels["backbone"], labels["scheme"], labels.get("lr", "0.003"), seed)
        s.dir.mkdir(parents=True, exist_ok=True)
        split = {"val_loss": value, "val_tokens": 4096, "split_tokens": 4096}
        summary = {"config_hash": s.run.hash, "val_loss": value, SPLIT_EVAL: split, "params": 1000}
        (s.dir / SUMMARY_FILE).write_text(json.dumps(summary))
        (s.dir / PROBES_FILE).write_text("{}")
        if labels["backbone"] == "kimi_linear":  # the routers' balance at the last step
            v = IMBALANCE[labels["scheme"]] + 0.01 * seed
            rows = [{"kind": "train", "step": 4, "moe_maxvio.1": v, "moe_maxvio.2": v}]
            (s.dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _row(text: str, start: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert rows, f"no row starting {start!r}"
    return rows[0]


def test_each_arm_is_compared_at_its_own_best_rate(sweep, tmp_path):
    spec, runs = sweep
    _finish(plan_status(spec, runs))
    text = write_report(spec, runs, tmp_path / "out", figures=False).read_text()
    assert "PARTIAL" not in text
    per_lr = text.split("### LLaMA")[1].split("###")[0]
    assert _row(per_lr, "| prenorm |").endswith("| 0.003 |")
    assert _row(per_lr, "| block |").endswith("| 0.006 (edge of the grid) |")
    assert _row(per_lr, "| full |").endswith("| 0.001 (edge of the grid) |")
    # Block at 0.006 against prenorm at 0.003: -0.05 plus the arm-specific noise, not the +0.02 at 0.003
    block = _row(text, "| LLaMA (GQA + RoPE, SwiGLU MLPs) | block |")
    assert "| -0.0500 [" in block and "better (p_holm" in block, block
    # 2 comparisons per backbone and one dense-against-MoE per AttnRes scheme, corrected together
    assert "m = 8." in text and "8 paired comparisons (8 over 3 seeds)" in text
    balance = text.split("## Expert-load balance")[1].split("##")[0]
    moe = _row(balance, "| Kimi Linear (KDA + MLA 3:1, mixture of experts) | block |")
    assert moe.endswith("| 0.410 ± 0.010 |"), moe  # the balance at the arm's best rate
    assert "| LLaMA" not in balance and "| Kimi Linear with dense MLPs" not in balance  # no experts there
    dense = _row(text.split("## How much of the Kimi Linear gain")[1], "| block |")
    assert dense.endswith("| 50% |"), dense


def test_a_partial_sweep_renders_and_an_unfinished_rate_does_not_win(sweep, tmp_path):
    spec, runs = sweep

    def keep(labels, seed):
        if labels["backbone"] == "kimi_dense":
            return False
        # Block finished at 0.006 on Kimi Linear, prenorm and Full not: Block must not pick from a wider grid
        if labels["backbone"] == "kimi_linear" and labels["lr"] == "0.006" and labels["scheme"] != "block":
            return False
        # one seed of prenorm at 0.006 with a loss far below the rest: an unfinished rate must not win
        return not (labels["backbone"] == "llama" and labels["lr"] == "0.006" and seed > 0)

    def loss(bb, scheme, lr, seed):
        return 4.0 if (bb, scheme, lr) == ("llama", "prenorm", "0.006") else _loss(bb, scheme, lr, seed)

    _finish(plan_status(spec, runs), keep, loss)
    text = write_report(spec, runs, tmp_path / "out", figures=False).read_text()
    assert "PARTIAL REPORT" in text and "no finished run yet:** Kimi Linear with dense MLPs" in text
    per_lr = text.split("### LLaMA")[1].split("###")[0]
    assert "4.0000 (1 seed)" in _row(per_lr, "| prenorm |")
    assert _row(per_lr, "| prenorm |").endswith("| 0.003 (of 0.001, 0.003 only: the other rates are unfinished) |")
    kimi = text.split("### Kimi Linear (KDA")[1].split("##")[0]
    assert _row(kimi, "| block |").endswith("| 0.003 (of 0.001, 0.003 only: the other rates are unfinished) |")
    assert "m = 4." in text and "## How much of the Kimi Linear gain" not in text


def test_arms_choose_their_best_rates_from_one_grid_while_seeds_are_missing(sweep, tmp_path):
    """Seed 2 of Kimi Linear is unfinished in a different place at every rate (prenorm has it at 0.001 and
    0.003, Block at 0.001, Full at none), as while a sweep's last seed trains: no rate is complete, and
    every arm still picks from one grid, the rates where they share the most seeds (here all three, on
    seeds 0 and 1), never each arm from the rates where it alone has the most."""
    spec, runs = sweep
    extra = {("prenorm", "0.001"), ("prenorm", "0.003"), ("block", "0.001")}

    def keep(labels, seed):
        if labels["backbone"] == "kimi_dense":
            return False
        return labels["backbone"] != "kimi_linear" or seed < 2 or (labels["scheme"], labels["lr"]) in extra

    _finish(plan_status(spec, runs), keep)
    text = write_report(spec, runs, tmp_path / "out", figures=False).read_text()
    kimi = text.split("### Kimi Linear (KDA")[1].split("##")[0]
    assert _row(kimi, "| prenorm |").endswith("| 0.003 |")
    assert _row(kimi, "| block |").endswith("| 0.006 (edge of the grid) |")
    assert _row(kimi, "| full |").endswith("| 0.001 (edge of the grid) |")
    assert "provisional" not in text.split("## Verdict")[1]


def test_a_last_seed_finished_at_one_rate_does_not_shrink_the_grid(sweep, tmp_path):
    """Seed 2 of Kimi Linear has finished at 0.001 for every scheme and nowhere else, as when a sweep trains
    its last seed rate by rate: the grid stays all three rates on seeds 0 and 1, rather than shrinking to the
    one rate where every seed has finished."""
    spec, runs = sweep

    def keep(labels, seed):
        if labels["backbone"] == "kimi_dense":
            return False
        return labels["backbone"] != "kimi_linear" or seed < 2 or labels["lr"] == "0.001"

    _finish(plan_status(spec, runs), keep)
    text = write_report(spec, runs, tmp_path / "out", figures=False).read_text()
    kimi = text.split("### Kimi Linear (KDA")[1].split("##")[0]
    assert "only: the other rates are unfinished" not in kimi
    assert _row(kimi, "| prenorm |").endswith("| 0.003 |")
    assert _row(kimi, "| block |").endswith("| 0.006 (edge of the grid) |")
    assert "provisional" not in text.split("## Verdict")[1]


def test_the_kimi_linear_report_quotes_the_sweep_beside_it(sweep, tmp_path, tiny_base, write_spec):
    """The untuned kimi-linear experiment's page carries the tuned comparison: every arm's best rate and
    Δ with the lr-sweep's own Holm verdict, and the expert balance, the same cells as the sweep's page."""
    spec, runs = sweep
    specs = spec.path.parent
    write_spec(
        specs,
        "kimi-linear",
        f"""
        [experiment]
        name = "kimi-linear"
        report = "kimi-linear"
        seeds = [0, 1]
        baseline = "prenorm"
        {tiny_base(lr=0.002)}
        [[axis.backbone]]
        label = "kimi_linear"
        d_ff = 96

        {SCHEME_AXES}
    """,
    )
    kimi = load_spec("kimi-linear", specs)
    _finish(plan_status(kimi, runs))  # at one shared rate (the sweep's losses at 0.003)
    before = write_report(kimi, runs, tmp_path / "kimi-before", figures=False).read_text()
    assert "No lr-sweep run has finished beside these runs yet." in before

    _finish(plan_status(spec, runs))
    sweep_text = write_report(spec, runs, tmp_path / "sweep", figures=False).read_text()
    text = write_report(kimi, runs, tmp_path / "kimi", figures=False).read_text()
    tuned = text.split("## Tuned learning rates and dense MLPs")[1].split("\n## ")[0]
    assert "untuned, over 2 seeds" in tuned and "m = 8;" in tuned
    for backbone in ("Kimi Linear (KDA + MLA 3:1, mixture of experts)", "Kimi Linear with dense MLPs (no experts)"):
        for scheme in ("prenorm", "block", "full"):
            start = f"| {backbone} | {scheme} |"
            assert _row(tuned, start).startswith(_row(sweep_text, start)[:-1]), start  # the sweep's cells
    assert _row(tuned, "| Kimi Linear (KDA + MLA 3:1, mixture of experts) | block |").endswith("| 0.410 ± 0.010 |")
    assert "| LLaMA" not in tuned
    assert "- block: Δ -0.050 with experts, -0.025 with dense MLPs" in tuned


def test_a_diverged_rate_stays_in_the_grid_but_cannot_be_an_arms_best(sweep, tmp_path):
    """Block diverges at 0.006 on every seed, Full on one: the rate is finished, not missing, so the grid
    keeps all three rates; Block's best falls back to 0.003 and Full's 0.006 is out of its running."""
    from attnres.experiments.runner import DIVERGED_FILE

    spec, runs = sweep
    statuses = plan_status(spec, runs)

    def diverges(labels, seed):
        return labels["lr"] == "0.006" and (labels["scheme"] == "block" or (labels["scheme"] == "full" and seed == 1))

    _finish(statuses, keep=lambda labels, seed: not diverges(labels, seed))
    for s in statuses:
        if diverges(s.run.labels, s.run.seed):
            s.dir.mkdir(parents=True, exist_ok=True)
            (s.dir / DIVERGED_FILE).write_text(json.dumps({"config_hash": s.run.hash, "step": 3, "error": "nan"}))
    text = write_report(spec, runs, tmp_path / "out", figures=False).read_text()
    assert "PARTIAL" not in text and "unfinished" not in text
    per_lr = text.split("### LLaMA")[1].split("###")[0]
    block = _row(per_lr, "| block |")
    assert "| diverged (3 of 3 seeds) |" in block and block.endswith("| 0.003 |"), block
    full = _row(per_lr, "| full |")
    assert "(2 seeds); 1 diverged |" in full and full.endswith("| 0.001 (edge of the grid) |"), full
    # Block now at 0.003 against prenorm at 0.003: +0.02, not the -0.05 it had at 0.006
    assert "| +0.0200 [" in _row(text, "| LLaMA (GQA + RoPE, SwiGLU MLPs) | block |")
