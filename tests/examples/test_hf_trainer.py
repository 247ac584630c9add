"""examples/hf_trainer.py: transformers' Trainer fine-tunes a retrofitted model with attnres' parameter
groups; a resumed run logs the losses of an uninterrupted one; accelerate launch with FSDP2 on 2 gloo
CPU processes logs the losses of one process (within 1e-5), and resumes from its own checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
ACCELERATE_CONFIG = ROOT / "examples" / "accelerate_fsdp2_cpu.yaml"


def load_example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def test_optimizer_gives_attnres_parameters_no_weight_decay_and_their_own_lr(tmp_path):
    example = load_example()
    model = example.build_model("qwen2", "block", vocab_size=256, seed=0)
    args = example.TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.1, report_to=[])
    trainer = example.AttnResTrainer(model=model, args=args, attnres_lr=3e-2)
    optimizer = trainer.create_optimizer()
    seen: dict[str, dict] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert names[id(p)] not in seen  # every parameter in one group
            seen[names[id(p)]] = group
    assert seen.keys() == set(names.values())
    scheme = [n for n, _ in model.depth_stream_scheme().named_parameters()]
    assert scheme  # pseudo-queries and key norms
    for n in scheme:
        group = seen[f"attnres.{n}"]
        assert (group["lr"], group["weight_decay"], group["name"]) == (3e-2, 0.0, "attnres")
    for name, group in seen.items():
        if not name.startswith("attnres."):
            assert group["lr"] == 1e-3, name
        if name.endswith("proj.weight"):  # hidden matrices: decayed
            assert group["weight_decay"] == 0.1, name
        if "norm" in name:
            assert group["weight_decay"] == 0.0, name


def test_resume_from_checkpoint_logs_the_losses_of_an_uninterrupted_run(tmp_path):
    example = load_example()
    args = ["--steps", "6", "--save-steps", "3", "--batch-size", "4", "--seq-len", "32"]
    whole = example.main(["--out", str(tmp_path / "whole"), *args])
    assert sorted(whole) == [1, 2, 3, 4, 5, 6]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = example.main(["--out", str(resumed_dir), *args, "--resume"])
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(whole[step], rel=0, abs=1e-6), step
    # the checkpoint holds the trained AttnRes parameters (moved off their zero initialisation)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "whole" / "checkpoint-3" / "model.safetensors")
    queries = [v for k, v in weights.items() if k.startswith("attnres.")]
    assert queries and any(v.abs().sum() > 0 and not torch.equal(v, torch.ones_like(v)) for v in queries)


def accelerate_launch(out: Path, *args: str) -> None:
    from distributed_workers import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG)]
    command += ["--main_process_port", str(free_port()), str(EXAMPLE), "--out", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    layout = json.loads((out / "layout.json").read_text())
    assert layout == {"distributed_type": "FSDP", "processes": 2}


ARGS = ["--steps", "4", "--save-steps", "2", "--batch-size", "4", "--seq-len", "32"]


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Path:
    """The example under accelerate launch with FSDP2 on 2 CPU processes (checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("fsdp2") / "two"
    accelerate_launch(out, *ARGS)
    return out


def test_accelerate_fsdp2_on_two_cpu_processes_equals_one_process(tmp_path, fsdp2_run):
    one = load_example().main(["--out", str(tmp_path / "one"), *ARGS])
    two = losses(fsdp2_run)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=0, abs=1e-5), step


def test_accelerate_fsdp2_run_resumes_from_its_checkpoint(tmp_path, fsdp2_run):
    shutil.copytree(fsdp2_run / "checkpoint-2", tmp_path / "checkpoint-2")
    accelerate_launch(tmp_path, *ARGS, "--resume")
    resumed, whole = losses(tmp_path), losses(fsdp2_run)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(whole[step], rel=0, abs=1e-6), step
