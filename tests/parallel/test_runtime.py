"""Data parallel (DDP, FSDP2) and pipeline training through the Trainer, against one process."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from corpora import write_pseudo_english
from distributed_workers import spawn, trainer_run

from attnres.train.config import build_configs
from attnres.train.trainer import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_pseudo_english(tmp_path_factory.mktemp("corpus"), works=12, words_per_work=1500)


def overrides(corpus, out, **extra):
    train = dict(
        data=corpus,
        out_dir=str(out),
        optimizer="adamw",
        steps=6,
        warmup_steps=1,
        eval_every=3,
        eval_batches=2,
        checkpoint_every=3,
        progress=False,
        cache_dir=str(out) + "-cache",
    )
    train.update(extra)
    return train


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], [r["val_loss"] for r in rows if r["kind"] == "eval"]


def single(corpus, out, model, **extra):
    model_cfg, train_cfg = build_configs("tiny", {**model, **overrides(corpus, out, **extra)})
    return Trainer(model_cfg, train_cfg).run()


def parallel(corpus, out, model, world, resume=False, **extra):
    spawn(trainer_run, world, model, overrides(corpus, out, **extra), resume, str(out) + ".pt")
    return torch.load(str(out) + ".pt", weights_only=False)


def assert_same_run(a, b, rel):
    (ta, va), (tb, vb) = losses(a), losses(b)
    assert len(ta) == len(tb) and len(va) == len(vb)
    assert ta == pytest.approx(tb, rel=rel)
    assert va == pytest.approx(vb, rel=rel)


MODEL = {"n_layers": 4, "residual": "block", "attnres_block_size": 2}


def test_ddp_and_fsdp_equal_one_process_at_the_same_global_batch(corpus, tmp_path):
    single(corpus, tmp_path / "one", MODEL)
    parallel(corpus, tmp_path / "ddp", MODEL, 2, dp=2)
    assert_same_run(tmp_path / "one", tmp_path / "ddp", rel=1e-5)
    parallel(corpus, tmp_path / "fsdp", MODEL, 2, dp=2, fsdp=True, steps=3)
    one = losses(tmp_path / "one")[0]
    assert losses(tmp_path / "fsdp")[0] == pytest.approx(one[:3], rel=1e-5)
    # resume the sharded run from its (gathered, single-process format) checkpoint: the optimizer
    # moments are re-sharded like their parameters
    parallel(corpus, tmp_path / "fsdp", MODEL, 2, resume=True, dp=2, fsdp=True)
    assert_same_run(tmp_path / "one", tmp_path / "fsdp", rel=1e-5)


def test_pipeline_training_equals_one_process_and_resumes_in_another_layout(corpus, tmp_path):
    single(corpus, tmp_path / "one", MODEL, steps=8)
    result = parallel(corpus, tmp_path / "pp", MODEL, 2, pp=2, vpp=2, pp_schedule="Interleaved1F1B")
    assert result["steps"] == 6
    one_train, one_val = losses(tmp_path / "one")
    pp_train, pp_val = losses(tmp_path / "pp")
    assert pp_train == pytest.approx(one_train[:6], rel=1e-5)
    assert pp_val == pytest.approx(one_val[:2], rel=1e-5)
    # the checkpoint is in the single-process format: continue the pipeline run in one process
    model_cfg, train_cfg = build_configs("tiny", {**MODEL, **overrides(corpus, tmp_path / "pp", steps=8)})
    Trainer(model_cfg, train_cfg, resume=True).run()
    assert losses(tmp_path / "pp")[0] == pytest.approx(one_train, rel=1e-5)


def test_pipeline_replicated_over_data_parallel_equals_one_process(corpus, tmp_path):
    """A (dp=2, pp=2) mesh: two pipeline replicas of two ranks, each replica on half the batch."""
    single(corpus, tmp_path / "one", MODEL, steps=4)
    parallel(
        corpus, tmp_path / "2d", MODEL, 4, dp=2, pp=2, vpp=2, pp_schedule="Interleaved1F1B", microbatches=2, steps=4
    )
    assert_same_run(tmp_path / "one", tmp_path / "2d", rel=1e-5)


def test_torchrun_job_fails_fast_and_names_the_problem(corpus, tmp_path):
    """Rank 0 rejects --out (a file); rank 1 is already waiting in a collective: torchrun ends both."""
    out = tmp_path / "not-a-directory"
    out.write_text("x")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "attnres",
        "train",
        "--preset",
        "tiny",
        "--data",
        corpus,
        "--out",
        str(out),
        "--dp",
        "2",
        "--steps",
        "2",
        "--no-progress",
        "--set",
        "warmup_steps=1",
        "--set",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "is a file, not a run directory" in proc.stdout + proc.stderr
    assert time.perf_counter() - start < 200


def test_cli_leaves_the_process_group_it_ran_under(tmp_path):
    """Under torchrun a command joins a process group; the CLI leaves it before the interpreter shuts
    down, so the backend's threads are not torn down by static destructors."""
    import torch.distributed as dist

    from attnres.cli import main

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        assert main(["schemes"]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "extra, match",
    [
        (dict(dp=2), "torchrun --nproc-per-node 2"),
        (dict(pp=2), "torchrun --nproc-per-node 2"),
        (dict(dp=2, pp=2), "torchrun --nproc-per-node 4"),
        (dict(dp=2, pp=2, fsdp=True), "drop fsdp"),
        (dict(dp=3, pp=2), "divisible by dp=3"),
        (dict(fsdp=True), "set dp >= 2"),
        (dict(vpp=2), "set pp >= 2"),
        (dict(pp=2, pp_schedule="ZBVZeroBubble"), "split-backward"),
        (dict(pp=2, microbatches=3), "must divide the batch size"),
    ],
)
def test_parallel_options_without_a_fitting_launch_are_clear_errors(corpus, tmp_path, monkeypatch, extra, match):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match=match):
        model_cfg, train_cfg = build_configs("tiny", {**MODEL, **overrides(corpus, tmp_path / "x", **extra)})
        Trainer(model_cfg, train_cfg)


@pytest.mark.compile_heavy
@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, fsdp=True), dict(pp=2)])
def test_compiled_parallel_layouts_equal_one_eager_process(corpus, tmp_path, layout):
    """DDP compiles the whole model, FSDP2 and pipeline stages compile per sublayer (aot_eager: the
    tracing and autograd of a real compile without inductor's code generation)."""
    single(corpus, tmp_path / "one", MODEL, steps=4)
    parallel(corpus, tmp_path / "compiled", MODEL, 2, steps=4, compile="aot_eager", **layout)
    assert losses(tmp_path / "compiled")[0] == pytest.approx(losses(tmp_path / "one")[0], rel=1e-5)
