"""The command-line shell: the one --set parser, the shared run options, the verbs it composes."""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest

import attnres.cli
from attnres.cli import build_parser, main
from attnres.cli.options import CLIError, parse_set, run_overrides


def test_set_values_are_literals_booleans_none_or_text():
    assert parse_set(["d_model=256", "lr=3e-3", "blocks=none", "fsdp=True", "sources=[4, 8]", "name=x=y",
                      "data=my texts/", "tie-embeddings=false", " n_heads = 4 "]) == {
        "d_model": 256, "lr": 3e-3, "blocks": None, "fsdp": True, "sources": [4, 8], "name": "x=y",
        "data": "my texts/", "tie_embeddings": False, "n_heads": 4}
    assert parse_set(["steps=3", "steps=5"]) == {"steps": 5}  # the last one wins
    assert parse_set(None) == {}


def test_set_without_equals_is_a_one_line_error():
    with pytest.raises(CLIError, match=r"--set 'd_model': expected KEY=VALUE, e\.g\. --set d_model=256"):
        parse_set(["steps=3", "d_model"])


@pytest.mark.parametrize("verb", ["train", "demo", "schemes", "bench op"])
def test_every_verb_with_set_reports_the_same_error(verb, capsys):
    assert main([*verb.split(), "--set", "d_model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnres {verb.split()[0]}: error: --set 'd_model': expected KEY=VALUE")


def test_run_options_layer_config_file_then_set_then_flags(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('preset = "tiny"\n[train]\nsteps = 3\nlr = 0.1\n[model]\nd_model = 48\n')
    args = build_parser().parse_args(["train", "--config", str(cfg), "--set", "steps=4", "--set", "lr=0.2",
                                      "--lr", "0.3", "--schedule", "GPipe", "--no-pp-cache"])
    assert run_overrides(args) == {"preset": "tiny", "steps": 4, "lr": 0.3, "d_model": 48,
                                   "pp_schedule": "GPipe", "pp_cache": False}
    args = build_parser().parse_args(["demo", "--schedule", "cosine", "--seed", "3"])
    assert run_overrides(args) == {"schedule": "cosine", "seed": 3}


def test_the_package_docstring_lists_every_verb():
    verbs = list(_subcommands())
    assert len(verbs) == len(attnres.cli.VERBS) == 10
    for verb in verbs:
        assert f"attnres {verb} " in attnres.cli.__doc__, verb


def _subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_schemes_takes_a_preset_and_model_options(capsys):
    assert main(["schemes", "--preset", "tiny", "--set", "d_model=64"]) == 0
    assert "| block |" in capsys.readouterr().out
    assert main(["schemes", "--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err


def test_python_dash_m_attnres_is_the_command():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "attnres", "--help"], capture_output=True, text=True,
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, timeout=120)
    assert done.returncode == 0 and "experiment" in done.stdout and "convert" in done.stdout
