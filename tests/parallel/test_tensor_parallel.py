"""Tensor parallelism (attnres.parallel.tensor, ``attnres train --tp``) against one process: the layout
itself in float64 (loss and gradients), then training, resuming across layouts and a (dp, tp) mesh
through the Trainer, on gloo."""

import json

import pytest
import torch
from corpora import write_pseudo_english
from distributed_workers import batch, reference_model, spawn, trainer_run
from wrapper_workers import tensor_parallel_strategy

from attnres.model.llama import lm_loss
from attnres.train.config import build_configs
from attnres.train.trainer import Trainer

SCHEMES = ["prenorm", "block", "full", "hyper", "denseformer"]
SHARDED = tuple(f"{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
SHARDED += ("embed.weight", "lm_head.weight")


def one_process(residual: str, clip: float):
    model = reference_model(residual, 4)
    x, y = batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return loss.item(), grads, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dp, world", [(1, 2), (2, 4)])
def test_tensor_parallel_layout_equals_one_process_in_float64(dp, world, tmp_path):
    """Every scheme family: the loss, every gradient (sharded ones gathered) and the clipped gradients
    of tp = world/dp ranks times dp replicas equal one float64 process."""
    out = tmp_path / "tp.pt"
    schemes = SCHEMES if dp == 1 else ["block", "full"]
    spawn(tensor_parallel_strategy, world, schemes, dp, str(out))
    got = torch.load(out, weights_only=True)
    for residual in schemes:
        loss, grads, clipped = one_process(residual, 0.5)
        assert got[residual]["loss"] == pytest.approx(loss, abs=1e-10), residual
        assert set(got[residual]["grads"]) == set(grads)
        # heads, MLP units, embedding rows and head columns split; the residual scheme and norms whole
        sharded = set(got[residual]["sharded"])
        assert {n for n in grads if n.endswith(SHARDED)} == sharded, residual
        for name, g in grads.items():
            torch.testing.assert_close(got[residual]["grads"][name], g, rtol=0, atol=1e-10, msg=f"{residual} {name}")
            torch.testing.assert_close(
                got[residual]["clipped"][name], clipped[name], rtol=0, atol=1e-10, msg=f"{residual} {name}"
            )


# ----------------------------------------------------------------------------- through the Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_pseudo_english(tmp_path_factory.mktemp("corpus"), works=12, words_per_work=1500)


MODEL = {"n_layers": 2, "residual": "block", "attnres_block_size": 1}


def run_settings(corpus, out, **extra):
    settings = dict(
        data=corpus,
        out_dir=str(out),
        optimizer="adamw",
        steps=4,
        warmup_steps=1,
        eval_every=2,
        eval_batches=1,
        checkpoint_every=2,
        progress=False,
        cache_dir=str(out) + "-cache",
    )
    return {**settings, **extra}


def train_one(corpus, out, model=MODEL, resume=False, **extra):
    model_cfg, train_cfg = build_configs("tiny", {**model, **run_settings(corpus, out, **extra)})
    return Trainer(model_cfg, train_cfg, resume=resume).run()


def train_parallel(corpus, out, world, model=MODEL, resume=False, **extra):
    spawn(trainer_run, world, model, run_settings(corpus, out, **extra), resume, str(out) + ".pt")


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], [r["val_loss"] for r in rows if r["kind"] == "eval"]


def test_checkpoints_move_between_tensor_parallel_and_one_process(corpus, tmp_path):
    """`attnres train --tp 2` trains like one process; a checkpoint written under tp=2 continues in one
    process, and one written by one process continues under tp=2, with the same next losses."""
    train_one(corpus, tmp_path / "one")
    train_parallel(corpus, tmp_path / "tp-then-one", 2, tp=2, steps=2)
    train_one(corpus, tmp_path / "tp-then-one", resume=True)
    train_one(corpus, tmp_path / "one-then-tp", steps=2)
    train_parallel(corpus, tmp_path / "one-then-tp", 2, resume=True, tp=2)
    want_train, want_val = losses(tmp_path / "one")
    for run in ("tp-then-one", "one-then-tp"):
        got_train, got_val = losses(tmp_path / run)
        assert got_train == pytest.approx(want_train, rel=1e-5), run
        assert got_val == pytest.approx(want_val, rel=1e-5), run


@pytest.mark.parametrize("fsdp", [False, True])
def test_tensor_parallel_times_data_parallel_on_four_ranks_equals_one_process(corpus, tmp_path, fsdp):
    """A (dp 2, tp 2) mesh: two replicas of a tp pair, each on half the batch, averaging gradients by
    all-reduce or sharding them with FSDP2 over dp; Muon (orthogonalising sharded matrices) included."""
    train_one(corpus, tmp_path / "one", optimizer="muon", steps=2)
    train_parallel(corpus, tmp_path / "2d", 4, optimizer="muon", steps=2, dp=2, tp=2, fsdp=fsdp)
    (want_train, want_val), (got_train, got_val) = losses(tmp_path / "one"), losses(tmp_path / "2d")
    assert got_train == pytest.approx(want_train, rel=1e-5)
    assert got_val == pytest.approx(want_val, rel=1e-5)
