"""attnres demo: its runs named by label, a label's directory of another configuration trained afresh
(never resumed), its thread count, and the forms its --help shows."""

from __future__ import annotations

import shlex

import pytest
import torch
from corpora import write_pseudo_english

from attnres.cli import build_parser, demo
from attnres.experiments import load_spec, run_experiment
from attnres.experiments.runner import LabelledRuns, plan_status
from attnres.experiments.spec import expand, with_overrides


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    (tmp_path / "corpus").mkdir()
    corpus = write_pseudo_english(tmp_path / "corpus", works=4, words_per_work=400)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "demo.toml").write_text(
        '[experiment]\nname = "demo"\nreport = "demo"\nseeds = [1]\nkeep_checkpoint = true\n'
        f'[base]\npreset = "tiny"\ndata = "{corpus}"\nsteps = 2\nwarmup_steps = 1\neval_batches = 1\n'
        "checkpoint_every = 1\n"
        '[[axis.scheme]]\nlabel = "prenorm"\nresidual = "prenorm"\n'
        '[[axis.scheme]]\nlabel = "block"\nresidual = "block"\n'
    )
    yield load_spec("demo", tmp_path / "specs")
    torch.set_num_threads(before)


def test_labelled_runs_live_under_their_labels_and_another_config_is_not_resumed(spec, tmp_path):
    runs = LabelledRuns(tmp_path / "runs" / "demo")
    logged: list[str] = []
    run_experiment(spec, runs, progress=False, log=logged.append)
    assert {s.dir.name: s.state for s in plan_status(spec, runs)} == {"prenorm": "done", "block": "done"}
    assert (tmp_path / "runs" / "demo" / "block" / "checkpoint").is_dir()
    # three steps are another configuration: its checkpoint at step 2 is not continued from
    longer = with_overrides(spec, {"steps": 3})
    assert [s.state for s in plan_status(longer, runs)] == ["missing", "missing"]
    logged.clear()
    run_experiment(longer, runs, progress=False, log=logged.append)
    assert not [line for line in logged if "resuming" in line], logged
    assert [s.state for s in plan_status(longer, runs)] == ["done", "done"]


@pytest.mark.parametrize(
    "cores, load, threads", [(2, 0.0, 1), (2, 1.6, 1), (2, 7.5, 1), (16, 0.2, 7), (16, 10.0, 3), (1, 0.0, 1)]
)
def test_the_demo_uses_half_the_idle_cores(monkeypatch, cores, load, threads):
    monkeypatch.setattr(demo.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (load, load, load))
    assert demo.default_threads() == threads


def test_every_example_of_the_demo_help_is_a_form_that_parses_and_stays_small():
    parser = build_parser()
    epilog = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" demo")).epilog
    forms = [line.split("#")[0].strip() for line in epilog.splitlines()[1:]]
    assert forms and all(form.startswith("attnres demo") for form in forms)
    for form in forms:
        args = parser.parse_args(shlex.split(form)[1:])
        spec = demo.demo_spec(args.full, {"steps": args.steps} if args.steps else {})
        steps = {r.train.steps for r in expand(spec)}
        assert steps <= {150, 600, args.steps}, form  # the quick size, the full one or what it asks for


def test_the_demo_refuses_to_train_into_a_directory_it_did_not_make(tmp_path, monkeypatch, capsys):
    """`attnres demo --out runs` beside the README's runs/block (a run of attnres train): that run is
    left alone, with one line saying why."""
    from attnres.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "block").mkdir(parents=True)
    (tmp_path / "runs" / "block" / "config.json").write_text("{}")
    assert main(["demo", "--out", "runs", "--steps", "2"]) == 2
    assert "runs/block is not a run of attnres demo" in capsys.readouterr().err
    assert (tmp_path / "runs" / "block" / "config.json").read_text() == "{}"
