"""The routing and importance reports from tiny cached runs: routing (the 2 x 2 with paired Δ and a verdict) and
importance (knockouts measured once from kept checkpoints, then from their cache alone); the knockout stream against
a float64 read written out; a spec that keeps checkpoints trains a config again instead of copying a run
that has none."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch
from reference import randomize

from attnres.experiments import load_spec, run_experiment, step_cost
from attnres.experiments.importance import KNOCKOUT_FILE, knockout_form, knockout_table
from attnres.experiments.reports import write_report
from attnres.residual import FullAttnRes
from attnres.train.trainer import Trainer

ROUTING = """
    [experiment]
    name = "routing"
    report = "routing"
    seeds = [0, 1]
    baseline = "prenorm"
    {base}
    [[axis.scheme]]
    label = "prenorm"
    residual = "prenorm"
    tags = {{ family = "prenorm", source = "-", routing = "-" }}
    [[axis.scheme]]
    label = "block"
    residual = "block"
    attnres_block_size = 2
    tags = {{ family = "block", source = "outputs", routing = "replacement" }}
    [[axis.scheme]]
    label = "block-additive"
    residual = "block"
    attnres_block_size = 2
    attnres_routing = "additive"
    tags = {{ family = "block", source = "outputs", routing = "additive" }}
    [[axis.backbone]]
    label = "llama"
"""

IMPORTANCE = """
    [experiment]
    name = "importance"
    report = "importance"
    seeds = [0]
    keep_checkpoint = true
    {base}
    [[axis.backbone]]
    label = "llama"
    [[axis.scheme]]
    label = "block"
    residual = "block"
    attnres_block_size = 2
    [[axis.scheme]]
    label = "full"
    residual = "full"
"""


KIMI_SCALING = """
    [experiment]
    name = "kimi-scaling"
    report = "kimi-scaling"
    seeds = [0, 1]
    baseline = "prenorm"
    {base}
    [[axis.size]]
    label = "k1"
    d_model = 24
    n_heads = 2
    [[axis.size]]
    label = "k2"
    d_model = 32
    n_heads = 2
    steps = 6
    eval_every = 3
    [[axis.scheme]]
    label = "prenorm"
    residual = "prenorm"
    [[axis.scheme]]
    label = "block"
    residual = "block"
"""


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def suite(tmp_path_factory, tiny_base):
    root = tmp_path_factory.mktemp("research")
    specs, runs = root / "specs", root / "runs"
    specs.mkdir()
    for name, body, base in (
        ("routing", ROUTING, tiny_base()),
        ("importance", IMPORTANCE, tiny_base()),
        ("kimi-scaling", KIMI_SCALING, tiny_base(threads=1)),
    ):
        (specs / f"{name}.toml").write_text(textwrap.dedent(body).format(base=base))
    run_experiment(load_spec("routing", specs), runs, progress=False, log=quiet)
    return specs, runs, root


def test_the_routing_report_pairs_each_cell_and_states_a_verdict(suite):
    specs, runs, root = suite
    text = write_report(load_spec("routing", specs), runs, root / "reports" / "routing").read_text()
    assert "**Status: complete.**" in text
    assert "| block-additive | outputs | additive | 2 |" in text
    assert "Δ vs the paper's cell of its family" in text
    assert "| block | outputs | -" in text  # the 2 x 2 grid row of Block's outputs source
    assert "Winner on llama:" in text
    assert "Holm-corrected verdict; on the whole validation split where a backbone's cells have it, among the " in text
    assert "cells scored there): llama: block additive" in text  # every run has the split: the report reads it
    assert "nothing here refutes it" in text and "refuted" not in text


def test_importance_trains_again_rather_than_copy_a_run_without_checkpoint(suite):
    specs, runs, root = suite
    logs: list[str] = []
    counts = run_experiment(load_spec("importance", specs), runs, progress=False, log=logs.append)
    # routing's block run has the same config but no checkpoint: trained again, with its checkpoint kept
    assert counts["trained"] == 2 and counts["reused"] == 0, counts
    assert any("has no checkpoint to keep" in line for line in logs)
    assert all((d / "checkpoint").is_dir() for d in (runs / "importance").iterdir() if d.is_dir())


def test_the_importance_report_measures_once_then_reads_its_cache(suite, monkeypatch):
    specs, runs, root = suite
    run_experiment(load_spec("importance", specs), runs, progress=False, log=quiet)
    spec = load_spec("importance", specs)
    text = write_report(spec, runs, root / "reports" / "importance").read_text()
    assert "ρ overall (zero)" in text and "importance.png" in text
    assert "Verdict (arXiv 2606.13168: routing mass is not causal importance):" in text
    caches = sorted((runs / "importance").glob(f"*/{KNOCKOUT_FILE}"))
    assert len(caches) == 2
    table = json.loads(caches[0].read_text())
    assert table["batches"] >= 1 and len(table["consumers"]) > 2
    # without checkpoints (a fresh clone) the same report comes from the caches alone
    for d in (runs / "importance").glob("*/checkpoint"):
        shutil.rmtree(d)

    def no_training(*args, **kwargs):
        raise AssertionError("the report must read the cache")

    monkeypatch.setattr(Trainer, "__init__", no_training)
    again = write_report(spec, runs, root / "reports" / "importance2").read_text()
    section = text.split("## Routing mass")[1].split("## All runs")[0]
    assert section.replace("importance2", "importance") in again


def test_a_knockout_removes_or_averages_one_source_of_one_read():
    torch.manual_seed(0)
    scheme = randomize(FullAttnRes(8, 5, attnres_impl="reference").double(), seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=g)
    fs = [torch.randn(2, 3, 8, dtype=torch.float64, generator=g) for _ in range(5)]

    def reads(form=None):
        if form is not None:
            scheme.stream_form = lambda e: form
        try:
            stream, out = scheme.begin(x), []
            for f in fs:
                out.append(stream.read())
                stream.write(None, f)
            return out
        finally:
            if form is not None:
                del scheme.stream_form

    def read_by_hand(read, values):
        q, w = scheme.queries[read], scheme.key_norm_weight[read]
        keys = [v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + scheme.eps) * w for v in values]
        logits = torch.stack([(k * q).sum(-1) for k in keys])
        alpha = torch.softmax(logits, 0)
        return sum(a[..., None] * v for a, v in zip(alpha, values, strict=True))

    plain = reads()
    values = [x, *fs[:3]]  # the sources read 3 reads: the embedding and outputs 0-2
    dropped = reads(knockout_form(3, 1, "zero"))
    torch.testing.assert_close(dropped[3], read_by_hand(3, [values[0], values[2], values[3]]), rtol=1e-12, atol=1e-12)
    averaged = reads(knockout_form(3, 2, "mean"))
    mean_source = values[2].mean(dim=(0, 1), keepdim=True).expand_as(values[2])
    torch.testing.assert_close(
        averaged[3], read_by_hand(3, [values[0], values[1], mean_source, values[3]]), rtol=1e-12, atol=1e-12
    )
    for read in (0, 1, 2):  # the reads before it are untouched
        torch.testing.assert_close(dropped[read], plain[read], rtol=0, atol=0)


def test_the_knockout_table_covers_every_read_with_more_than_one_source():
    from attnres import AttnResLM, ModelConfig

    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(vocab_size=31, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, residual="full"))
    randomize(model.residual, seed=1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 31, (2, 8), generator=g), torch.randint(0, 31, (2, 8), generator=g))]
    table = knockout_table(model, batches, log=quiet)
    rows = table["consumers"]
    assert [len(r["sources"]) for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["zero"] == [] and all(len(r["zero"]) == len(r["sources"]) == len(r["mean"]) for r in rows[1:])
    assert all(abs(sum(r["weight"]) - 1) < 1e-5 for r in rows)
    assert any(abs(d) > 0 for r in rows for d in r["zero"])


def test_the_kimi_scaling_report_fits_and_compares_at_equal_time(suite):
    specs, runs, root = suite
    run_experiment(load_spec("kimi-scaling", specs), runs, progress=False, log=quiet)
    # the report's process runs at another thread count than the runs trained with (1): the steps are
    # timed at the runs' count, and the process's own is left as it was
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        text = write_report(load_spec("kimi-scaling", specs), runs, root / "reports" / "kimi-scaling").read_text()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "## Power-law fits" in text and "## Beside the LLaMA backbone" in text
    assert "| Kimi Linear (this experiment) | block |" in text
    assert "## Equal wall-clock time (Kimi Linear)" in text and "| k2 | block |" in text
    assert "Verdict (does the Kimi-backbone advantage grow with scale?): block Δ" in text
    # the equal-time view reads step costs measured side by side, cached per size in the runs directory
    costs = json.loads((runs / "kimi-scaling" / step_cost.STEP_COST_FILE).read_text())
    assert set(costs) == {"k1", "k2"}
    for group in costs.values():
        assert group["schemes"]["prenorm"]["ratio"] == 1.0 and group["threads"] == 1
        block = group["schemes"]["block"]
        assert 0 < block["ratio_min"] <= block["ratio"] <= block["ratio_max"] and block["step_s"] > 0
    k2 = costs["k2"]["schemes"]["block"]
    assert f"| k2 | block | {k2['ratio']:.3f} ({k2['ratio_min']:.3f}-{k2['ratio_max']:.3f}) |" in text


def test_step_costs_are_measured_once_then_read_from_the_cache(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return {"schemes": {"prenorm": {"ratio": 1.0}}}

    first = step_cost.cached_step_costs(tmp_path, "k1", measure, log=quiet)
    again = step_cost.cached_step_costs(tmp_path, "k1", measure, log=quiet)
    assert first == again and calls == [1]
    step_cost.cached_step_costs(tmp_path, "k2", measure, log=quiet)
    assert calls == [1, 1] and set(json.loads((tmp_path / step_cost.STEP_COST_FILE).read_text())) == {"k1", "k2"}
    with pytest.raises(ValueError, match="baseline 'prenorm' is not among the schemes"):
        step_cost.measure_step_costs({}, "prenorm")


def test_the_routing_report_compares_the_cells_with_the_whole_split_there(suite, tmp_path, drop_split_eval):
    """A cell whose runs predate the whole-split evaluation makes the report read the slice; per backbone the
    cells whose every run has the split are compared there, against PreNorm and against the paper's cell
    of their family, inside the Holm family that the verdict table reads. The verdict says what the additive
    cells' logged gain did."""
    from attnres.experiments.reports.common import corrected
    from attnres.experiments.reports.routing import routing_report
    from attnres.experiments.reports.verdicts import split_pair
    from attnres.experiments.results import collect
    from attnres.experiments.stats import paired

    specs, runs, _ = suite
    copy, spec_dir = tmp_path / "runs", tmp_path / "specs"
    shutil.copytree(runs, copy)
    spec_dir.mkdir()
    (spec_dir / "routing.toml").write_text(  # block-states: Block's family (a tag), but not the headline row
        (specs / "routing.toml")
        .read_text()
        .replace('baseline = "prenorm"', 'baseline = "prenorm"\nheadline = ["block"]')
        + textwrap.dedent(
            """
            [[axis.scheme]]
            label = "block-states"
            seeds = [0]
            residual = "block"
            attnres_block_size = 2
            attnres_sources = "states"
            tags = { family = "block", source = "states", routing = "replacement" }
            """
        )
    )
    spec = load_spec("routing", spec_dir)
    run_experiment(spec, copy, progress=False, log=quiet)
    for r in collect(spec, copy).select(scheme="block-states"):
        drop_split_eval(r.dir)
    col = collect(spec, copy)
    assert col.scope == "slice" and col.split_losses(scheme="block-states") is None

    text = write_report(spec, copy, tmp_path / "out", command="x").read_text()
    assert "Headline rows block: 2 seeds: below the 5" in text  # its own runs, not its family's
    assert "2 seeds for prenorm/llama, block/llama, block-additive/llama; 1 seed for block-states/llama" in text
    section = text.split("## On the whole validation split, backbone: llama", 1)[1].split("\n## ", 1)[0]
    assert "Δ vs the paper's cell of its family, whole split (paired)" in section
    assert "| block-states |" not in section
    additive, block, prenorm = (col.split_losses(scheme=s) for s in ("block-additive", "block", "prenorm"))
    row = next(line for line in section.splitlines() if line.startswith("| block-additive |"))
    vs_base, vs_paper = row.split(" | ")[3:5]
    assert f"{paired(additive, prenorm).mean:+.4f}" in vs_base and f"{paired(additive, block).mean:+.4f}" in vs_paper
    assert next(line for line in section.splitlines() if line.startswith("| block |")).endswith("| — |")

    rep = corrected(col, routing_report)
    picked = split_pair({"scheme": "block-additive"}, {"scheme": "block"})(rep)
    assert picked.mean == pytest.approx(paired(additive, block).mean)
    assert picked.family == len(rep.comparisons.tests)
    # the verdict reads the split too, among the cells scored there (block-states, on the slice only, is out)
    verdict = text.split("## Verdict", 1)[1]
    assert f"llama (whole split): block additive {paired(additive, block).mean:+.3f}" in verdict
    best = min(("block", "block-additive"), key=lambda s: sum(col.split_losses(scheme=s).values()))
    assert f"best cell {best} {paired(col.split_losses(scheme=best), prenorm).mean:+.3f}" in verdict
    gains = [r for r in col.select(scheme="block-additive") if r.done and r.probes.get("routing_gain")]
    assert gains and f"{len(gains)} of their {len(gains)} runs record it" in text
