"""The trainer and the CLI end to end, on tiny models and small local corpora."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from corpora import write_pseudo_english

from attnres.cli import main
from attnres.train.config import build_configs
from attnres.train.trainer import Trainer, TrainingDiverged, TrainingInterrupted


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Eight small 'works' of pseudo-English text, deterministic."""
    return write_pseudo_english(tmp_path_factory.mktemp("corpus"), works=8, words_per_work=3000)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))


def configs(corpus, out, **overrides):
    return build_configs("tiny", {"data": corpus, "out_dir": str(out), "progress": False, **overrides})


def losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


def test_thirty_steps_lower_the_loss(corpus, tmp_path):
    result = Trainer(*configs(corpus, tmp_path / "run", residual="block")).run()
    seen = losses(tmp_path / "run")
    assert result.steps == 30 and len(seen) == 30
    assert sum(seen[-5:]) / 5 < sum(seen[:5]) / 5 - 0.3
    assert result.val_loss < 5.0 and result.val_bpb > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(result.val_loss)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_ctrl_c_then_resume_reproduces_an_uninterrupted_run(corpus, tmp_path, monkeypatch, optimizer):
    full = tmp_path / "full"
    Trainer(*configs(corpus, full, residual="full", optimizer=optimizer)).run()

    part = tmp_path / "part"
    original = Trainer.train_step

    def interrupting(self):
        loss = original(self)
        if self.step == 13:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, handled between steps
        return loss

    monkeypatch.setattr(Trainer, "train_step", interrupting)
    with pytest.raises(TrainingInterrupted, match="step 13"):
        Trainer(*configs(corpus, part, residual="full", optimizer=optimizer)).run()
    monkeypatch.setattr(Trainer, "train_step", original)
    assert len(losses(part)) == 13

    Trainer(*configs(corpus, part, residual="full", optimizer=optimizer), resume=True).run()
    assert losses(part) == losses(full)  # bitwise: same data, same optimizer and RNG state
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, part))
    assert a["val_loss"] == b["val_loss"]


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(corpus, tmp_path, monkeypatch):
    import attnres.parallel.runtime as runtime_mod

    real = runtime_mod.lm_loss
    calls = {"n": 0}

    def poisoned(logits, targets):
        calls["n"] += torch.is_grad_enabled()  # training steps only, not the checks before a checkpoint
        loss = real(logits, targets)
        return loss * float("nan") if calls["n"] == 25 and torch.is_grad_enabled() else loss

    monkeypatch.setattr(runtime_mod, "lm_loss", poisoned)
    model_cfg, train_cfg = configs(corpus, tmp_path / "run", eval_every=100)
    with pytest.raises(TrainingDiverged, match="at step 24"):
        Trainer(model_cfg, train_cfg).run()
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 20


def test_resume_with_different_options_is_a_clear_error(corpus, tmp_path):
    Trainer(*configs(corpus, tmp_path / "run", steps=10, warmup_steps=2)).run()
    with pytest.raises(ValueError, match="lr: checkpoint=0.003, now=0.01"):
        Trainer(*configs(corpus, tmp_path / "run", steps=10, warmup_steps=2, lr=0.01), resume=True)
    with pytest.raises(ValueError, match="d_model"):
        Trainer(*configs(corpus, tmp_path / "run", steps=10, warmup_steps=2, d_model=64), resume=True)


# ----------------------------------------------------------------------------- CLI


def run_cli(*argv):
    return main([str(a) for a in argv])


def test_cli_train_eval_sample(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        run_cli(
            "train",
            "--preset",
            "tiny",
            "--data",
            corpus,
            "--out",
            out,
            "--steps",
            12,
            "--warmup-steps",
            2,
            "--eval-every",
            6,
            "--residual",
            "full",
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "val loss" in printed and f"attnres plot {out}" in printed
    # stdout is no terminal here: plain lines, no bar
    assert "step 6/12  loss" in printed and "  val " in printed and "\r" not in printed
    # the run's figures, and the depth weights they draw: one row per sublayer and the output
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["warmup_steps"] == 2 and config["train"]["eval_every"] == 6
    depth = json.loads((out / "depth_weights.json").read_text())
    assert len(depth["weights"]) == 2 * config["model"]["n_layers"] + 1 and depth["sources"][0] == "emb"
    for png in ("loss.png", "depth_weights.png"):
        assert (out / png).stat().st_size > 1000
        (out / png).unlink()
    assert run_cli("plot", out) == 0 and (out / "loss.png").is_file() and (out / "depth_weights.png").is_file()
    assert "written:" in capsys.readouterr().out
    assert run_cli("eval", out, "--batches", 2) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["step"] == 12 and ev["val_loss"] > 0 and ev["val_bpb"] > 0
    assert run_cli("sample", out, "--prompt", "the quick", "--max-new-tokens", 20, "--seed", 1) == 0
    first = capsys.readouterr().out
    assert first.startswith("the quick") and len(first) > len("the quick")
    assert (
        run_cli(
            "sample", out, "--prompt", "the quick", "--max-new-tokens", 20, "--seed", 1, "--top-k", 5, "--top-p", 0.9
        )
        == 0
    )
    assert run_cli("sample", out, "--prompt", "the quick", "--max-new-tokens", 20, "--seed", 1) == 0
    assert capsys.readouterr().out.endswith(first)  # same seed, same text


def test_cli_demo_trains_the_demo_spec_reuses_its_runs_and_writes_its_report(corpus, tmp_path, capsys):
    out = tmp_path / "demo"
    flags = ["--preset", "tiny", "--data", corpus, "--steps", 6, "--set", "warmup_steps=1", "--no-progress"]
    argv = ["demo", *flags, "--out", out]
    assert run_cli(*argv) == 0
    text = capsys.readouterr().out
    for scheme in ("prenorm", "block", "full"):
        assert f"| {scheme} |" in text
    # it ends by naming its files and what to run next, with paths that exist
    closing = text[text.index(f"report: {out / 'REPORT.md'}") :]
    assert "loss_curves.png" in closing and "prenorm/ block/ full/" in closing
    assert f"next:\n  attnres sample {out / 'block'} --prompt" in closing and "attnres demo --full" in closing
    report = (out / "REPORT.md").read_text()
    assert report.startswith("# attnres demo\n") and f"Command: `attnres demo --preset tiny --data {corpus}" in report
    assert "Wall time (this invocation" in report and "Training: 6 steps x 4 x 32 tokens" in report
    for name in ("loss_curves.png", "depth_weights_block.png", "depth_weights_full.png"):
        assert f"]({name})" in report and (out / name).stat().st_size > 0
    runs = {
        json.loads((d / "config.json").read_text())["model"]["residual"]: d
        for d in out.iterdir()  # the runs are named by what they are: OUT/prenorm, OUT/block, OUT/full
        if (d / "summary.json").is_file()
    }
    assert set(runs) == {"prenorm", "block", "full"}

    # what the demo trains is a plain run of the same preset and flags: the same losses, bit for bit
    model_cfg, train_cfg = build_configs(
        "demo",
        {
            "preset": "tiny",
            "data": corpus,
            "steps": 6,
            "warmup_steps": 1,
            "residual": "block",
            "out_dir": str(tmp_path / "plain"),
            "progress": False,
        },
    )
    Trainer(model_cfg, train_cfg).run()
    assert losses(tmp_path / "plain") == losses(runs["block"])

    # a second invocation trains nothing: the finished runs are reused, the report is rewritten
    trained = {d: (d / "metrics.jsonl").stat().st_mtime_ns for d in runs.values()}
    assert run_cli(*argv) == 0
    assert "reusing 3 finished run(s)" in capsys.readouterr().out
    assert trained == {d: (d / "metrics.jsonl").stat().st_mtime_ns for d in runs.values()}
    # --fresh retrains the same configs into the same directories, with the same losses
    before = {d: losses(d) for d in runs.values()}
    assert run_cli(*argv, "--fresh") == 0
    assert "reusing" not in capsys.readouterr().out
    assert all(losses(d) == before[d] and (d / "metrics.jsonl").stat().st_mtime_ns != trained[d] for d in runs.values())


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "--preset", "huge"], "unknown preset 'huge'"),
        (["train", "--preset", "tiny", "--set", "depth=3"], "unknown option 'depth'"),
        (["train", "--preset", "tiny", "--set", "d_model"], "expected KEY=VALUE"),
        (["train", "--preset", "tiny", "--set", "n_heads=3"], "ModelConfig.n_heads=3"),
        (["train", "--preset", "tiny", "--data", "/nonexistent/data.txt"], "/nonexistent/data.txt"),
        (["train", "--preset", "tiny", "--config", "/nonexistent.toml"], "/nonexistent.toml"),
        (["eval", "/nonexistent/run"], "no checkpoint found"),
    ],
)
def test_cli_bad_input_is_one_clear_line(argv, message, capsys, tmp_path):
    assert run_cli(*argv, *([] if argv[0] == "eval" else ["--out", tmp_path / "x"])) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_data_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 20)
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.txt").write_text("to be or not to be\n")
    (short / "b.txt").write_text("to be\n")
    for path in (empty, binary, short):
        assert run_cli("train", "--preset", "tiny", "--data", path, "--out", tmp_path / "x") == 2
        err = capsys.readouterr().err
        assert str(path) in err or "short" in err, err
        assert "Traceback" not in err


def test_truncated_checkpoint_is_a_clear_error(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        run_cli(
            "train",
            "--preset",
            "tiny",
            "--data",
            corpus,
            "--out",
            out,
            "--steps",
            4,
            "--set",
            "warmup_steps=1",
            "--no-progress",
        )
        == 0
    )
    weights = out / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    assert (
        run_cli(
            "train",
            "--preset",
            "tiny",
            "--data",
            corpus,
            "--out",
            out,
            "--steps",
            8,
            "--set",
            "warmup_steps=1",
            "--resume",
            "--no-progress",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err
    assert run_cli("eval", out) == 2
    assert "model.safetensors" in capsys.readouterr().err


def test_toml_config(corpus, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'preset = "tiny"\n[model]\nresidual = "block"\nattnres_blocks = 2\n'
        f'[train]\nsteps = 3\nwarmup_steps = 1\ndata = "{corpus}"\nprogress = false\n'
    )
    assert run_cli("train", "--config", cfg, "--out", tmp_path / "run") == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["attnres_blocks"] == 2 and saved["train"]["steps"] == 3


def test_bf16_autocast_training_runs(corpus, tmp_path):
    result = Trainer(
        *configs(corpus, tmp_path / "run", residual="block", precision="bf16", steps=4, warmup_steps=1)
    ).run()
    assert result.steps == 4 and math.isfinite(result.val_loss)


@pytest.mark.parametrize("optimizer,precision", [("muon", "fp32"), ("adamw", "bf16")])
def test_eager_checkpoint_resumes_compiled_and_back(corpus, tmp_path, optimizer, precision):
    """compile is a speed setting: a run may change it at resume, the checkpoint names stay eager's,
    and the compiled steps follow the eager run (fp32: to rounding; bf16 autocast: loosely)."""
    import torch
    from safetensors import safe_open

    common = dict(
        residual="block",
        optimizer=optimizer,
        precision=precision,
        steps=9,
        eval_every=3,
        checkpoint_every=3,
        warmup_steps=1,
        threads=1,
    )
    Trainer(*configs(corpus, tmp_path / "eager", **common)).run()
    run = tmp_path / "mixed"
    Trainer(*configs(corpus, run, **{**common, "steps": 3})).run()
    names = set(safe_open(str(run / "checkpoint" / "model.safetensors"), "pt").keys())
    torch._dynamo.reset()
    compiled = Trainer(
        *configs(corpus, run, **{**common, "steps": 6, "compile": "aot_eager", "activation_checkpointing": "block"}),
        resume=True,
    )
    assert "torch.compile aot_eager (whole model)" in compiled.describe()
    compiled.run()
    assert set(safe_open(str(run / "checkpoint" / "model.safetensors"), "pt").keys()) == names
    Trainer(*configs(corpus, run, **common), resume=True).run()  # and back to eager
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert losses(run) == pytest.approx(losses(tmp_path / "eager"), rel=tol, abs=tol)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"compile": "nope"}, r"TrainConfig.compile='nope' is not a torch.compile backend"),
        ({"activation_checkpointing": "all"}, r"TrainConfig.activation_checkpointing='all' is invalid: choose one"),
    ],
)
def test_compile_and_checkpointing_options_are_checked(corpus, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        configs(corpus, tmp_path / "run", **overrides)


def test_cli_train_takes_compile(corpus, tmp_path, capsys):
    import torch

    torch._dynamo.reset()
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--data",
                corpus,
                "--out",
                str(tmp_path / "run"),
                "--steps",
                "2",
                "--compile",
                "--set",
                "compile=aot_eager",
                "--set",
                "eval_every=2",
                "--set",
                "warmup_steps=1",
                "--set",
                "activation_checkpointing=sublayer",
                "--no-progress",
            ]
        )
        == 0
    )
    assert configs(corpus, tmp_path / "x", activation_checkpointing=None)[1].activation_checkpointing == "none"
    out = capsys.readouterr().out
    assert "torch.compile aot_eager (whole model)" in out and "activation checkpointing: sublayer" in out


def test_schemes_without_depth_weights_get_the_loss_figure_only(tmp_path, make, tokens, capsys):
    from attnres.analysis.depth import write_depth_weights
    from attnres.analysis.plots import plot_run

    assert write_depth_weights(make("prenorm"), tokens(), tmp_path) is None
    assert not (tmp_path / "depth_weights.json").exists()
    assert run_cli("plot", tmp_path) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "tokens": 8, "loss": 4.0}) + "\n")
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png"]
