"""The command-line shell: the one --set parser, the shared run options, the verbs it composes."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import attnres.cli
from attnres.bench import BENCHES
from attnres.cli import build_parser, main
from attnres.cli.options import CLIError, parse_set, run_overrides, unescape


def test_set_values_are_literals_booleans_none_or_text():
    assert parse_set(
        [
            "d_model=256",
            "lr=3e-3",
            "blocks=none",
            "fsdp=True",
            "sources=[4, 8]",
            "name=x=y",
            "data=my texts/",
            "tie-embeddings=false",
            " n_heads = 4 ",
        ]
    ) == {
        "d_model": 256,
        "lr": 3e-3,
        "blocks": None,
        "fsdp": True,
        "sources": [4, 8],
        "name": "x=y",
        "data": "my texts/",
        "tie_embeddings": False,
        "n_heads": 4,
    }
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
    args = build_parser().parse_args(
        [
            "train",
            "--config",
            str(cfg),
            "--set",
            "steps=4",
            "--set",
            "lr=0.2",
            "--lr",
            "0.3",
            "--pp-schedule",
            "GPipe",
            "--no-pp-cache",
            "--threads",
            "2",
            "--warmup-steps",
            "1",
            "--eval-every",
            "2",
            "--lr-schedule",
            "cosine",
        ]
    )
    assert run_overrides(args) == {
        "preset": "tiny",
        "steps": 4,
        "lr": 0.3,
        "d_model": 48,
        "pp_schedule": "GPipe",
        "pp_cache": False,
        "threads": 2,
        "warmup_steps": 1,
        "eval_every": 2,
        "schedule": "cosine",
    }
    args = build_parser().parse_args(["demo", "--lr-schedule", "cosine", "--seed", "3"])
    assert run_overrides(args) == {"schedule": "cosine", "seed": 3}


@pytest.mark.parametrize("value, field", [("cosine", "schedule"), ("GPipe", "pp_schedule")])
def test_schedule_is_a_deprecated_alias_of_both_schedule_flags(value, field, capsys):
    args = build_parser().parse_args(["train", "--schedule", value])
    assert run_overrides(args) == {field: value}
    flag = "--lr-schedule" if field == "schedule" else "--pp-schedule"
    assert f"--schedule is deprecated; use {flag} {value}" in capsys.readouterr().err
    # the new flag wins over the old one
    assert run_overrides(build_parser().parse_args(["train", "--schedule", "wsd", "--lr-schedule", "constant"])) == {
        "schedule": "constant"
    }


def _parsers(parser, name="attnres"):
    """Every (command, parser) below ``parser``: the verbs and the bench subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, child in action.choices.items():
                yield f"{name} {verb}", child
                yield from _parsers(child, f"{name} {verb}")


def test_every_help_shows_defaults_and_an_example():
    commands = dict(_parsers(build_parser()))
    benches = {f"attnres bench {name}" for name in BENCHES}
    assert len(benches) >= 8 and benches <= set(commands)  # the walk reaches the nested bench parsers
    assert len(commands) == len(attnres.cli.VERBS) + len(benches)
    for command, parser in commands.items():
        text = " ".join(parser.format_help().split())
        assert "example" in text and f"{command} " in text.replace("-m attnres", "attnres"), command
        for action in parser._actions:
            shown = action.default is not None and action.default is not False and action.option_strings
            if shown and action.help != argparse.SUPPRESS and action.dest != "help":
                assert "default" in " ".join((parser._get_formatter()._expand_help(action)).split()), (
                    command,
                    action.dest,
                )
    sample = " ".join(commands["attnres sample"].format_help().split())
    assert "(default: ROMEO:\\n)" in sample and "(default: 200)" in sample and "(default: 0.8)" in sample


def test_the_package_docstring_lists_every_verb():
    verbs = list(_subcommands())
    assert len(verbs) == len(attnres.cli.VERBS) == 13
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
    done = subprocess.run(
        [sys.executable, "-m", "attnres", "--help"],
        capture_output=True,
        text=True,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        timeout=120,
    )
    assert done.returncode == 0 and "experiment" in done.stdout and "convert" in done.stdout


def test_text_flags_unescape_what_a_shell_passes_literally():
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\\n") == "a\tb\\n"
    assert unescape("café \\x ✓") == "café \\x ✓"  # nothing else changes
    args = build_parser().parse_args(["sample", "runs/x", "--stop", r"\n\n", "--prompt", r"ROMEO:\n"])
    assert (args.stop, args.prompt) == ("\n\n", "ROMEO:\n")


def test_resume_with_the_flags_that_started_a_capped_run(tmp_path, monkeypatch, capsys):
    """The tiny preset's warmup (3) is capped to a 2-step run when it starts: resuming with the same
    flags, or with more steps, caps it alike instead of calling the preset's 3 a changed option."""
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    flags = ["train", "--preset", "tiny", "--out", str(out), "--set", "threads=1", "--no-progress"]
    assert main([*flags, "--steps", "2"]) == 0
    assert "capped to 2" in capsys.readouterr().err
    assert main([*flags, "--steps", "2", "--resume"]) == 0  # the same command: the run is finished
    assert main([*flags, "--steps", "4", "--resume"]) == 0  # longer: the warmup stays the run's
    captured = capsys.readouterr()
    assert "resumed" in captured.out and "error" not in captured.err
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4 and state["train_config"]["warmup_steps"] == 2
    assert main([*flags, "--steps", "4", "--resume", "--warmup-steps", "3"]) == 2  # a given warmup still must match
    assert "warmup_steps=3 (given), but the run has warmup_steps=2" in capsys.readouterr().err


def test_compile_without_a_cpp_compiler_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """Inductor on the CPU builds C++ with the compiler torch looks for: without one on PATH, --compile is
    refused in one line naming the fix, before the run directory or the data are touched."""
    monkeypatch.setattr("attnres.model.compile.shutil.which", lambda name: None)
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "2", "--compile", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "(set ATTNRES_DEBUG=1 for the full traceback)"
    line = err.strip().splitlines()[-2]
    assert line.startswith("attnres train: error: TrainConfig.compile=True compiles with inductor, which on the CPU")
    assert "C++ compiler" in line and "install one" in line and "drop --compile" in line
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_compiled_decoding_without_a_cpp_compiler_is_a_clear_error(monkeypatch):
    from attnres import AttnResLM, ModelConfig
    from attnres.inference import CompiledDecoder

    monkeypatch.setattr("attnres.model.compile.shutil.which", lambda name: None)
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    model = AttnResLM(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    with pytest.raises(ValueError, match=r"compile=True compiles with inductor.*C\+\+ compiler"):
        CompiledDecoder(model, 1, setting=True)
    CompiledDecoder(model, 1, setting="aot_eager")  # a backend that generates no code needs none


def test_convert_names_the_missing_extra_and_keeps_a_fault_of_its_own(monkeypatch, tmp_path, capsys):
    """Without transformers, convert says which extra to install; an attnres module that fails to import is
    not called a missing extra: its own error comes through."""
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "out")]
    monkeypatch.delitem(sys.modules, "attnres.hf", raising=False)  # restored afterwards; imported anew below
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert main(argv) == 2
    assert "needs transformers: pip install 'attnres[hf]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "attnres.hf", None)  # attnres.hf itself broken
    with pytest.raises(ImportError, match="attnres.hf"):
        main(argv)
    assert "needs transformers" not in capsys.readouterr().err


def test_train_with_a_billion_positions_builds_no_billion_row_table(tmp_path):
    """`train --set max_seq_len=10**9` trains as written: the rotary table grows with the positions used, so
    the run allocates what its sequences need (a table of 10**9 rows would be about 128 GB)."""
    import resource

    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--steps", "1", "--set", "max_seq_len=1000000000", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["model"]["max_seq_len"] == 10**9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 8 * 2**20  # KiB on Linux: under 8 GiB
