"""attnres.train.metrics: the metrics logger's files, resume and formats."""

from __future__ import annotations

import csv
import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from attnres.train import MetricsLogger


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_logger_files_and_resume(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=False) as log:
        for step in range(1, 6):
            log.log({"loss": torch.tensor(5.0 - step), "lr": np.float32(0.5)}, step=step)
            if step % 2 == 0:
                extra = {"acc": 0.5} if step == 4 else {}
                log.log({"val_loss": 4.0 - step / 10, **extra}, step=step, kind="eval")
        log.log({"loss": float("nan")}, step=6)

    rows = read_jsonl(run / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows][:3] == [("train", 1), ("train", 2), ("eval", 2)]
    assert rows[0]["loss"] == 4.0 and rows[0]["lr"] == 0.5
    assert rows[-1]["loss"] == "nan" and math.isnan(float(rows[-1]["loss"]))

    train_csv = read_csv(run / "metrics_train.csv")
    assert [int(r["step"]) for r in train_csv] == [1, 2, 3, 4, 5, 6]
    assert float(train_csv[2]["loss"]) == 2.0
    eval_csv = read_csv(run / "metrics_eval.csv")
    assert list(eval_csv[0]) == ["step", "time", "val_loss", "acc"]  # header widened at step 4
    assert eval_csv[0]["acc"] == "" and eval_csv[1]["acc"] == "0.5"

    # a crash mid-line, then resume from a checkpoint at step 3
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    with MetricsLogger(run, resume_step=3, tensorboard=False) as log:
        assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 2, 3]
        assert [int(r["step"]) for r in read_csv(run / "metrics_train.csv")] == [1, 2, 3]
        assert [int(r["step"]) for r in read_csv(run / "metrics_eval.csv")] == [2]
        for step in range(4, 6):
            log.log({"loss": 1.0, "grad_norm": 0.1}, step=step)

    train_csv = read_csv(run / "metrics_train.csv")
    assert [int(r["step"]) for r in train_csv] == [1, 2, 3, 4, 5]
    assert train_csv[0]["grad_norm"] == "" and train_csv[-1]["grad_norm"] == "0.1"
    steps = [(r["kind"], r["step"]) for r in read_jsonl(run / "metrics.jsonl")]
    assert len(steps) == len(set(steps))

    # reopening without resume appends and cuts a torn tail
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "tr')
    with MetricsLogger(run, tensorboard=False) as log:
        log.log({"loss": 0.5}, step=6)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in read_csv(run / "metrics_train.csv")] == [1, 2, 3, 4, 5, 6]

    with MetricsLogger(run, tensorboard=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log({"step": 1}, step=1)
        with pytest.raises(ValueError, match="kind"):
            log.log({"x": 1}, step=1, kind="../evil")


def test_trackers_that_are_not_installed_are_one_clear_error(monkeypatch, capsys):
    from attnres.cli import main
    from attnres.train.metrics import check_trackers

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, installed or not
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match=r"--log wandb: wandb is not installed; pip install wandb \(WANDB_MODE"):
        check_trackers(["wandb"])
    with pytest.raises(ValueError, match=r"pip install 'attnres\[tb\]'"):
        check_trackers(["tensorboard"])
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        check_trackers(["mlflow"])
    assert main(["train", "--preset", "tiny", "--log", "wandb", "--out", "unused"]) == 2
    assert "attnres train: error: --log wandb: wandb is not installed" in capsys.readouterr().err


def test_wandb_gets_every_numeric_metric_by_kind(tmp_path, monkeypatch):
    """The wiring to a Weights & Biases run, through a stand-in module with wandb's calls."""
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(tmp_path / "run", tensorboard=False, wandb_config={"train": {"lr": 0.1}}) as m:
        m.log({"loss": 2.5, "note": "text", "flag": True}, step=3)
        m.log({"val_loss": 2.25}, step=3, kind="eval")
    assert calls[0] == (
        "init",
        {"project": "attnres", "name": "run", "dir": str(tmp_path / "run"), "config": {"train": {"lr": 0.1}}},
    )
    assert calls[1:] == [("log", {"train/loss": 2.5}, 3), ("log", {"eval/val_loss": 2.25}, 3), ("finish",)]
