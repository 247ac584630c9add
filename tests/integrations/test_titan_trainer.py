"""torchtitan's own Trainer on attnres' model spec, on the CPU (tests/integrations/titan_cpu_trainer.py
points torchtitan's CUDA device globals at the CPU): it trains Block AttnRes from torchtitan's
command line and data loader, resumes from its own (DCP) checkpoint to the same losses, compiles to
the same losses, runs FSDP2 on 2 gloo processes under torchrun, and tensor parallelism (TP=2) on 2
gloo processes to the losses of one process."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")  # the worker's tokenizer is attnres.hf's

from distributed_workers import free_port

WORKER = Path(__file__).with_name("titan_cpu_trainer.py")


def run(work: Path, steps: int, *flags: str, processes: int = 1) -> dict[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    if processes == 1:
        command = [sys.executable, str(WORKER)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"]
        command += [f"--master_port={env['MASTER_PORT']}", str(WORKER)]
    done = subprocess.run(
        [*command, str(work), str(steps), *flags], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("LOSSES "))
    return {int(k): v for k, v in json.loads(line.removeprefix("LOSSES ")).items()}


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """4 steps of block_debugmodel in one process, checkpoints at steps 2 and 4."""
    work = tmp_path_factory.mktemp("titan") / "whole"
    return work, run(work, 4, "--checkpoint.enable", "--checkpoint.interval", "2")


def test_trainer_trains_and_resumes_from_its_checkpoint_to_the_same_losses(tmp_path, eager_run):
    work, whole = eager_run
    assert sorted(whole) == [1, 2, 3, 4] and all(math.isfinite(v) for v in whole.values())
    assert whole[4] < whole[1] - 0.5  # it learns (byte-level Shakespeare from about ln 256)
    checkpoints = work / "out" / "checkpoint"
    assert {p.name for p in checkpoints.iterdir()} == {"step-2", "step-4"}
    resumed = tmp_path / "resumed"
    shutil.copytree(checkpoints / "step-2", resumed / "out" / "checkpoint" / "step-2")
    for assets in ("tokenizer", "data"):
        shutil.copytree(work / assets, resumed / assets)
    again = run(resumed, 4, "--checkpoint.enable", "--checkpoint.interval", "2")
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert again[step] == pytest.approx(whole[step], rel=0, abs=1e-6), step


def test_trainer_with_tensor_parallelism_on_two_processes_logs_the_losses_of_one(tmp_path, eager_run):
    """TP=2 (2 gloo processes, one data-parallel rank, so the same batches) resumed from the
    one-process step-2 checkpoint (DCP reshards it onto the tp mesh) logs that run's losses for steps 3
    and 4. Resumed rather than from scratch: on a CPU mesh DTensor's random initialisation of a
    sharded projection differs from the whole one's (torchtitan keeps them equal on CUDA only), so
    fresh TP and one-process runs start from different weights. Gradient clipping
    (training.max_norm 1) runs over every parameter, the tp-replicated ones included."""
    work, whole = eager_run
    resumed = tmp_path / "tp2"
    shutil.copytree(work / "out" / "checkpoint" / "step-2", resumed / "out" / "checkpoint" / "step-2")
    for assets in ("tokenizer", "data"):
        shutil.copytree(work / assets, resumed / assets)
    tp = ("--parallelism.tensor_parallel_degree", "2")  # the configs leave sequence parallelism off
    again = run(resumed, 4, "--checkpoint.enable", "--checkpoint.interval", "2", *tp, processes=2)
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert again[step] == pytest.approx(whole[step], rel=0, abs=1e-5), step


def test_trainer_with_compile_logs_the_eager_losses(tmp_path, eager_run):
    """--compile.enable (aot_eager: the tracing and autograd of a real compile without inductor's code
    generation) compiles every attention and MLP sublayer, and torchtitan's loss."""
    work, whole = eager_run
    for assets in ("tokenizer", "data"):
        shutil.copytree(work / assets, tmp_path / assets)
    compiled = run(tmp_path, 4, "--compile.enable", "--compile.backend", "aot_eager")
    for step, loss in whole.items():
        assert compiled[step] == pytest.approx(loss, rel=0, abs=1e-5), step


def test_trainer_runs_fsdp2_on_two_gloo_processes(tmp_path):
    losses = run(tmp_path, 3, "--training.local_batch_size", "1", processes=2)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    assert losses[3] < losses[1]
