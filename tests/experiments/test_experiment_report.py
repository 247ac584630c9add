"""Reports from cached runs: every report kind on tiny finished experiments, partial suites, the CLI."""

import fnmatch
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from attnres.cli import main
from attnres.experiments import load_spec, run_experiment
from attnres.experiments.reports import write_report
from attnres.train.trainer import Trainer

SPECS = {
    "scaling": """
        [experiment]
        name = "scaling"
        seeds = [0, 1]
        baseline = "prenorm"
        {base}
        [[axis.size]]
        label = "s1"
        n_layers = 1
        steps = 4
        [[axis.size]]
        label = "s2"
        n_layers = 2
        steps = 6
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "block"
        residual = "block"
    """,
    "dynamics": """
        [experiment]
        name = "dynamics"
        seeds = [0, 1]
        {base}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "block"
        residual = "block"
        attnres_block_size = 2
        [[axis.scheme]]
        label = "full"
        residual = "full"
        [[axis.scheme]]
        label = "highway"
        residual = "highway"
        seeds = [0]
        [[axis.scheme]]
        label = "full-states"
        residual = "full"
        attnres_sources = "states"
        seeds = [0]
        [[axis.scheme]]
        label = "gated"
        residual = "gated"
        seeds = [0]
    """,
    "block-size": """
        [experiment]
        name = "block-size"
        seeds = [0, 1]
        baseline = "prenorm"
        {base}
        [[axis.variant]]
        label = "prenorm"
        residual = "prenorm"
        paper_loss = 1.766
        [[axis.variant]]
        label = "S1"
        residual = "full"
        paper_loss = 1.737
        [[axis.variant]]
        label = "S2"
        residual = "block"
        attnres_block_size = 2
        paper_loss = 1.746
        [[axis.variant]]
        label = "S4"
        residual = "block"
        attnres_block_size = 4
        [[axis.variant]]
        label = "uneven"
        residual = "block"
        attnres_block_sizes = [1, 3]
    """,
    "arena": """
        [experiment]
        name = "arena"
        seeds = [0, 1]
        {base}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "mudd"
        residual = "mudd"
        [[axis.budget]]
        label = "equal-tokens"
        [[axis.budget]]
        label = "equal-time"
        tags = { note = "steps from speed" }
    """,
    "arch-sweep": """
        [experiment]
        name = "arch-sweep"
        seeds = [0, 1]
        {base}
        [[axis.shape]]
        label = "wide"
        d_model = 48
        n_layers = 1
        [[axis.shape]]
        label = "mid"
        d_model = 32
        n_layers = 2
        [[axis.shape]]
        label = "deep"
        d_model = 24
        n_heads = 2
        n_layers = 4
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "block"
        residual = "block"
    """,
    "demo": """
        [experiment]
        name = "demo"
        report = "demo"
        seeds = [5]
        baseline = "prenorm"
        {base}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "block"
        residual = "block"
        [[axis.scheme]]
        label = "full"
        residual = "full"
    """,
    "retrofit": """
        [experiment]
        name = "retrofit"
        seeds = [0, 1]
        baseline = "prenorm"
        {base}
        retrofit_step = 2

        [[axis.arm]]
        label = "prenorm"
        residual = "prenorm"

        [[axis.arm]]
        label = "block"
        residual = "block"
        attnres_block_size = 2
        attnres_scale_norm_eps = true
    """,
    "ablations": """
        [experiment]
        name = "ablations"
        description = "Table 4 rows, tiny"
        seeds = [0, 1]
        baseline = "prenorm"
        headline = ["prenorm", "full"]
        budget_cpu_hours = 0.01
        budget_note = "seconds"
        {base}
        [[axis.variant]]
        label = "prenorm"
        residual = "prenorm"
        paper_loss = 1.766
        seeds = [0, 1, 2]
        [[axis.variant]]
        label = "full"
        residual = "full"
        paper_loss = 1.737
        seeds = [0, 1, 2]
        [[axis.variant]]
        label = "sigmoid"
        residual = "full"
        attnres_kernel = "sigmoid"
        paper_loss = 1.741
    """,
}


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def suite(tmp_path_factory, tiny_base):
    """Every report kind's tiny experiment, finished (ablations only half: a partial suite)."""
    root = tmp_path_factory.mktemp("suite")
    specs, runs = root / "specs", root / "runs"
    specs.mkdir()
    import textwrap

    for name, body in SPECS.items():
        (specs / f"{name}.toml").write_text(textwrap.dedent(body).replace("{base}", tiny_base()))
    for name in SPECS:
        run_experiment(
            load_spec(name, specs), runs, progress=False, log=quiet, max_runs=1 if name == "ablations" else None
        )
    _as_committed(runs)
    return specs, runs, root


def _as_committed(runs: Path) -> None:
    """Delete what the repository's .gitignore keeps out of experiments/runs/: the reports must
    rebuild from the committed files alone, as they do in a fresh clone."""
    gitignore = Path(__file__).resolve().parents[2] / ".gitignore"
    prefix = "experiments/runs/"
    patterns = [
        line[len(prefix) :].rstrip("/").replace("**", "*")
        for line in gitignore.read_text().splitlines()
        if line.startswith(prefix)
    ]
    assert any("checkpoint" in p for p in patterns) and not any("summary" in p for p in patterns), patterns
    removed = 0
    for path in sorted(runs.rglob("*"), reverse=True):  # children before their folders
        if path.exists() and any(fnmatch.fnmatch(path.relative_to(runs).as_posix(), p) for p in patterns):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed += 1
    assert removed and not list(runs.rglob("tokenizer.json"))


def _report(suite, name, monkeypatch):
    specs, runs, root = suite

    def no_training(self):
        raise AssertionError("report must not train")

    monkeypatch.setattr(Trainer, "run", no_training)
    path = write_report(load_spec(name, specs), runs, root / "reports" / name, command=f"attnres report {name}")
    text = path.read_text()
    for png in re.findall(r"\]\(([^)]+\.png)\)", text):
        assert (path.parent / png).stat().st_size > 1000, png
    assert "could not be drawn" not in text
    return text, path.parent


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "scaling",
            [
                "## Power-law fits",
                "Compute multiplier at the largest budget",
                "scaling.png",
                "per-seed fits",
                "PF-days",
                "Δ block − prenorm",
            ],
        ),
        (
            "dynamics",
            [
                "Figure 5",
                "dynamics.png",
                "depth_weights_full.png",
                "depth_weights_block.png",
                "mixing_matrices.png",
                "| highway | 1 |",
                "best scalar fit",
                "Δ gradient CV",
            ],
        ),
        (
            "block-size",
            [
                "block_size.png",
                "| S2 | 2 | 2 | 3 |",
                "Δ vs S1 (paired)",
                "## Uneven depth blocks against equal ones",
                "| uneven | [1, 3] | 2 | S2 (2 each) |",
            ],
        ),
        ("arena", ["## budget: equal-tokens", "## budget: equal-time", "arena_curves.png", "tokens/s"]),
        (
            "retrofit",
            [
                "## Over time (means over seeds)",
                "| block | 2 |",
                "Δ vs prenorm continued (paired)",
                "## Verdict",
                "Verdict: retrofit-by-fine-tuning ends block",
                "largest logit change at the switch",
            ],
        ),
        ("arch-sweep", ["arch_sweep.png", "| wide | 48 | 1 | 48.0 |", "parabola vertex", "lower mean loss than"]),
    ],
)
def test_each_report_kind_from_cached_runs(suite, monkeypatch, name, expected):
    text, out = _report(suite, name, monkeypatch)
    assert "**Status: complete.**" in text
    if name == "arena":  # schemes build on a forked RNG: mudd's pairs share the sublayer init too
        assert re.search(r"\| mudd \|", text) and not re.search(r"\| mudd \|.*†", text)
    for piece in expected:
        assert piece in text, piece
    assert f"Report: `attnres report {name}`" in text
    assert re.search(r"Machine: .*cores visible", text)
    assert re.search(r"runs at commit `([0-9a-f]{40}(\+dirty)?|unknown)`", text)
    assert re.search(r"Wall time of the finished runs: \d+\.\d\d h", text)
    assert "Holm-corrected together" in text and "p_holm < 0.05" in text and "This report makes " in text
    assert "|t|" not in text and "Report generation" not in text and "report written at" not in text


def test_routing_sharpness_in_the_dynamics_report(suite, monkeypatch, tmp_path):
    """Measured rows beside the follow-up paper's values; runs that predate the probe and rows not yet run
    are marked as such, and the report still builds."""
    import json

    from attnres.experiments.results import collect

    text, _ = _report(suite, "dynamics", monkeypatch)
    assert "## Routing sharpness" in text
    specs, runs, _ = suite
    col = collect(load_spec("dynamics", specs), runs)
    for label, what, paper in (
        ("full", "full, outputs", "≈ 0.6"),
        ("full-states", "full, states", "≈ 0.2"),
        ("block", "block, outputs", "≈ 0.6"),
        ("gated", "gated, outputs", "—"),
    ):
        probes = [r.probes["routing"] for r in col.select(scheme=label) if r.done]
        keep = [[i for i, k in enumerate(p["n_sources"]) if k >= 2] for p in probes]
        pairs = zip(probes, keep, strict=True)
        mean_max = sum(sum(p["max_weight"][i] for i in k) / len(k) for p, k in pairs) / len(probes)
        row = [line for line in text.splitlines() if line.startswith(f"| {label} | {what} | ")]
        assert row and row[0].endswith(f" | {paper} |"), label
        assert f"{mean_max:.3f}" in row[0] and f" | {len(probes)} | " in row[0], (label, row[0])
    assert not any(line.startswith("| highway | ") and "≈" in line for line in text.splitlines())
    # runs that finished before the probe existed, and a planned row with no run yet
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    for probes_file in copy.rglob("probes.json"):
        data = json.loads(probes_file.read_text())
        if (probes_file.parent / "config.json").exists() and json.loads(
            (probes_file.parent / "config.json").read_text()
        )["model"]["residual"] == "block":
            data.pop("routing")
            probes_file.write_text(json.dumps(data))
    spec_dir = tmp_path / "specs"
    spec_dir.mkdir()
    (spec_dir / "dynamics.toml").write_text(
        (specs / "dynamics.toml").read_text()
        + textwrap.dedent("""
        [[axis.scheme]]
        label = "block-states"
        residual = "block"
        attnres_block_size = 2
        attnres_sources = "states"
        seeds = [0]
    """)
    )
    monkeypatch.setattr(Trainer, "run", lambda self: (_ for _ in ()).throw(AssertionError("must not train")))
    text = write_report(load_spec("dynamics", spec_dir), copy, tmp_path / "out", command="x").read_text()
    assert "PARTIAL REPORT" in text
    assert re.search(
        r"\| block \| block, outputs \| 0 \| not measured: its runs finished before the routing "
        r"probe existed \|",
        text,
    )
    assert re.search(r"\| block-states \| block, states \| 0 \| not yet run \|.*\| ≈ 0\.2 \|", text)


def test_the_demo_report_is_a_page_of_its_own(suite, monkeypatch):
    text, out = _report(suite, "demo", monkeypatch)
    lines = text.splitlines()
    assert lines[0] == "# attnres demo" and lines[2] == "Command: `attnres report demo`  "
    assert re.match(r"Machine: .*cores visible", lines[3])
    assert re.match(r"Wall time \(training, evaluation and probes of the runs\): \d+\.\d min$", lines[4])
    assert (
        "Block AttnRes with S=2 sublayers per block. Training: 4 steps x 4 x 32 tokens, muon, wsd schedule, "
        "lr 0.003, seed 5;" in text
    )
    table = [line for line in lines if line.startswith("|")]
    assert table[:2] == [
        "| scheme | params | tokens | val loss (nats/token) | bits/byte | tokens/s | step time vs prenorm |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    assert [row.split(" | ")[0] for row in table[2:]] == ["| prenorm", "| block", "| full"]
    assert " | 512 | " in table[2] and table[2].endswith(" | 1.00x |")
    for png in ("loss_curves.png", "depth_weights_block.png", "depth_weights_full.png"):
        assert f"]({png})" in text
    assert "depth_weights_prenorm" not in text and "## Provenance" not in text and "## All runs" not in text
    # the table's numbers are the runs' summaries
    from attnres.experiments.reports import demo_table
    from attnres.experiments.results import collect

    specs, runs, _ = suite
    col = collect(load_spec("demo", specs), runs)
    assert demo_table(col) == "\n".join(table)
    full = [r for r in col.results if r.run.labels["scheme"] == "full"][0]
    assert f"| {full.summary['val_loss']:.4f} | {full.summary['val_bpb']:.4f} |" in table[4]
    # the invocation's wall time replaces the runs' own when the demo passes it
    write_report(load_spec("demo", specs), runs, out, command="attnres demo", wall_seconds=90)
    assert (
        "Wall time (this invocation, including data preparation and reused runs): 1.5 min"
        in (out / "REPORT.md").read_text()
    )


def test_a_partial_suite_gives_a_marked_partial_report(suite, monkeypatch):
    text, out = _report(suite, "ablations", monkeypatch)
    assert "PARTIAL REPORT: 5 of 8 planned runs finished" in text
    assert "`variant=sigmoid/seed=1`" in text and "Planned budget: 0.01 CPU-hours (seconds)" in text
    assert re.search(r"\| prenorm \(headline; \d seeds?: below the 5 the README requires\) \| 1.766 \|", text)
    assert "3 seeds for prenorm, full; 2 seeds for sigmoid" in text


def test_rows_with_the_whole_split_are_compared_there_in_a_report_that_reads_the_slice(
    suite, monkeypatch, tmp_path, drop_split_eval
):
    """Runs that predate the whole-split evaluation make the report read every row's slice; the rows whose
    every run has the split are compared there as well, in their own table, inside the Holm family, and
    the verdict table's split comparisons read that table. A row without it raises, naming the fix."""
    from attnres.experiments.reports.ablations import ablations_report
    from attnres.experiments.reports.common import corrected
    from attnres.experiments.reports.verdicts import split_pair
    from attnres.experiments.results import collect
    from attnres.experiments.stats import paired

    specs, runs, _ = suite
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    spec = load_spec("ablations", specs)
    run_experiment(spec, copy, progress=False, log=quiet)  # the suite's ablations is partial: finish it
    before = collect(spec, copy)
    assert before.scope == "split" and before.complete
    for r in before.results:  # the sigmoid row's runs predate the whole-split evaluation
        if r.done and r.run.labels["variant"] == "sigmoid":
            drop_split_eval(r.dir)
    col = collect(spec, copy)
    assert col.scope == "slice" and col.split_losses(variant="sigmoid") is None
    split_full, split_pre = col.split_losses(variant="full"), col.split_losses(variant="prenorm")
    assert split_full and split_pre and split_full != col.losses(variant="full")

    monkeypatch.setattr(Trainer, "run", lambda self: (_ for _ in ()).throw(AssertionError("must not train")))
    text = write_report(spec, copy, tmp_path / "out", command="x").read_text()
    section = text.split("## On the whole validation split", 1)[1].split("\n## ", 1)[0]
    tokens = {r.split_tokens for r in col.results if r.done and r.has_split_eval}
    assert f"({' or '.join(f'{t:,}' for t in sorted(tokens))} tokens per run)" in section
    p = paired(split_full, split_pre)
    row = [line for line in section.splitlines() if line.startswith("| full |")]
    assert row and f"{p.mean:+.4f}" in row[0] and "p_holm" in row[0], section
    assert "| sigmoid |" not in section and "| prenorm |" in section
    with_split = sum(r.has_split_eval for r in col.unique if r.done)
    assert f"{with_split} of the {col.n_done} finished runs also have the whole-split evaluation" in text
    # the split comparison is one more of the report's family, and the verdict table reads it from there
    rep = corrected(col, ablations_report)
    picked = split_pair({"variant": "full"}, {"variant": "prenorm"})(rep)
    assert picked.mean == pytest.approx(p.mean) and picked.family == len(rep.comparisons.tests)
    with pytest.raises(ValueError, match="sigmoid.*whole-split evaluation"):
        split_pair({"variant": "sigmoid"}, {"variant": "prenorm"})(rep)


def test_the_arena_compares_the_rows_with_the_whole_split_there_per_budget(
    suite, monkeypatch, tmp_path, drop_split_eval
):
    """The arena's section per budget: only the runs of that budget, and only rows whose every run has it."""
    from attnres.experiments.results import collect
    from attnres.experiments.stats import paired

    specs, runs, _ = suite
    copy, spec_dir = tmp_path / "runs", tmp_path / "specs"
    shutil.copytree(runs, copy)
    spec_dir.mkdir()  # mudd's equal-time run its own (the suite's is its equal-token run): 3 steps, not 4
    (spec_dir / "arena.toml").write_text(
        (specs / "arena.toml").read_text() + "[axis.budget.by.scheme]\nmudd = { steps = 3 }\n"
    )
    spec = load_spec("arena", spec_dir)
    run_experiment(spec, copy, progress=False, log=quiet)
    col = collect(spec, copy)
    stripped = next(r for r in col.select(scheme="mudd", budget="equal-time") if r.done)
    assert stripped.run.train.steps == 3
    drop_split_eval(stripped.dir)
    col = collect(spec, copy)
    assert col.scope == "slice"
    monkeypatch.setattr(Trainer, "run", lambda self: (_ for _ in ()).throw(AssertionError("must not train")))
    text = write_report(spec, copy, tmp_path / "out", command="x").read_text()
    assert "## On the whole validation split, budget: equal-time" not in text  # mudd lacks it there
    section = text.split("## On the whole validation split, budget: equal-tokens", 1)[1].split("\n## ", 1)[0]
    split = {s: col.split_losses(scheme=s, budget="equal-tokens") for s in ("mudd", "prenorm")}
    assert split["mudd"] and split["prenorm"] and split["mudd"] != col.losses(scheme="mudd", budget="equal-tokens")
    row = [line for line in section.splitlines() if line.startswith("| mudd |")]
    assert row and f"{paired(split['mudd'], split['prenorm']).mean:+.4f}" in row[0], section


def test_cli_experiment_report_and_errors(tmp_path, write_spec, tiny_base, capsys):
    specs, runs = tmp_path / "specs", tmp_path / "runs"
    write_spec(
        specs,
        "cli",
        f"""
        [experiment]
        name = "cli"
        seeds = [0, 1]
        baseline = "prenorm"
        {tiny_base()}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "full"
        residual = "full"
    """,
    )
    common = ["--specs", str(specs), "--runs", str(runs)]
    assert main(["experiment", "cli", "--dry-run", *common]) == 0
    assert "4 missing" in capsys.readouterr().out
    assert main(["experiment", "cli", "--no-progress", "--max-runs", "2", *common]) == 0
    assert "2 trained" in capsys.readouterr().out
    assert main(["experiment", "cli", "--no-progress", *common]) == 0
    # the closing hint is the report command for these runs
    assert f"report with `attnres report cli --runs {runs} --specs {specs}`" in capsys.readouterr().out
    out_dir = tmp_path / "report"
    assert main(["report", "cli", *common, "--out", str(out_dir)]) == 0
    text = (out_dir / "REPORT.md").read_text()
    assert f"attnres report cli --runs {runs} --specs {specs} --out {out_dir}" in text
    assert f"`attnres experiment cli --max-runs 2 --runs {runs} --specs {specs}`" in text
    assert (out_dir / "loss_curves.png").exists() and "Δ vs prenorm" in text

    # where no runs directory is (attnres report outside a clone): say where runs are expected
    assert (
        main(
            [
                "report",
                "cli",
                "--specs",
                str(specs),
                "--runs",
                str(tmp_path / "elsewhere"),
                "--out",
                str(tmp_path / "r2"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"runs directory {tmp_path / 'elsewhere'} does not exist" in err and "--runs" in err
    assert not (tmp_path / "r2").exists()
    assert main(["experiment", *common]) == 0
    assert "experiments: cli" in capsys.readouterr().out
    assert main(["experiment", "nope", *common]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'nope'" in err and "cli" in err
    write_spec(specs, "broken", '[experiment]\nname = "broken"\n[base]\nlr = "fast"\n')
    assert main(["report", "broken", *common, "--out", str(tmp_path / "r3")]) == 2
    err = capsys.readouterr().err
    assert "broken.toml" in err and "lr" in err
    assert not (tmp_path / "r3").exists()  # a report that fails leaves no directory


def test_experiment_refuses_silent_no_ops_and_a_partial_report_names_a_command_that_works(
    tmp_path, write_spec, tiny_base, capsys
):
    import shlex

    spec = write_spec(
        tmp_path / "my specs",
        "solo",
        f"""
        [experiment]
        name = "solo"
        seeds = [0, 1]
        {tiny_base(steps=2)}
        [[axis.scheme]]
        label = "full"
        residual = "full"
    """,
    )
    runs = tmp_path / "my runs"
    common = ["--runs", str(runs), "--no-progress"]
    assert main(["experiment", str(spec), "--only", "scheme=block", *common]) == 2
    err = capsys.readouterr().err
    assert "--only 'scheme=block' matches none of the 2 runs of solo: scheme=full/seed=0, scheme=full/seed=1" in err
    assert main(["experiment", str(spec), "--max-runs", "-1", *common]) == 2
    assert "--max-runs -1 is invalid: pass 0 or more" in capsys.readouterr().err
    assert not runs.exists()

    assert main(["experiment", str(spec), "--max-runs", "1", *common]) == 0
    capsys.readouterr()
    assert main(["report", str(spec), "--runs", str(runs), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "REPORT.md").read_text()
    assert "PARTIAL REPORT: 1 of 2" in text
    command = text.split("Continue with `")[1].split("`")[0]
    assert command == shlex.join(["attnres", "experiment", str(spec), "--runs", str(runs)])
    assert main([*shlex.split(command)[1:], "--no-progress"]) == 0  # the printed command works
    assert "1 trained" in capsys.readouterr().out
