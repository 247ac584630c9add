"""Tensor parallelism (attnres.parallel.tensor, ``attnres train --tp``) against one process: the layout
itself in float64 (loss and gradients), then training, resuming across layouts and a (dp, tp) mesh
through the Trainer, on gloo."""

import json
import re

import pytest
import torch
from corpora import write_pseudo_english
from distributed_workers import batch, reference_model, spawn, trainer_run
from wrapper_workers import pipeline_tensor_parallel, tensor_parallel_strategy

from attnres.model.llama import lm_loss
from attnres.train.config import build_configs
from attnres.train.trainer import Trainer

# every residual-scheme family: PreNorm, Block and Full AttnRes, Hyper-Connections, DenseFormer; and a
# model whose head is tied to its embedding (both then stay whole)
CASES = [("prenorm", None), ("block", None), ("full", None), ("hyper", None), ("denseformer", None)]
CASES += [("block", {"attnres_block_size": 4, "tie_embeddings": True})]
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed", "lm_head")


def one_process(residual: str, options: dict | None, clip: float):
    model = reference_model(residual, 4, options)
    x, y = batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return loss.item(), grads, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dp, world, sequence_parallel", [(1, 2, False), (2, 4, False), (1, 2, True), (2, 4, True)])
def test_tensor_parallel_layout_equals_one_process_in_float64(dp, world, sequence_parallel, tmp_path):
    """The loss, every gradient (sharded ones gathered) and the clipped gradients of tp = world/dp
    ranks times dp replicas equal one float64 process; with sequence parallelism too (the depth state,
    the residual scheme and the norms on T/tp positions per rank)."""
    out = tmp_path / "tp.pt"
    cases = CASES[:-1] if sequence_parallel else CASES  # a tied head is refused under sequence parallelism
    cases = cases if dp == 1 else cases[1:3]
    spawn(tensor_parallel_strategy, world, cases, dp, str(out), sequence_parallel)
    for (residual, options), got in zip(cases, torch.load(out, weights_only=True), strict=True):
        case = f"{residual} {options or ''}"
        loss, grads, clipped = one_process(residual, options, 0.1)
        assert got["loss"] == pytest.approx(loss, abs=1e-10), case
        assert set(got["grads"]) == set(grads), case
        # heads, MLP units, embedding rows and head columns split (not a tied pair); the scheme and norms whole
        tied = bool(options and options.get("tie_embeddings"))
        split = {n for n in grads if n.rsplit(".", 2)[-2] in SPLIT and not (tied and n.startswith("embed"))}
        assert set(got["sharded"]) == split, case
        assert got["foreach"] is False, case  # AdamW steps DTensors and plain tensors one by one
        x, _ = batch()
        assert got["positions"] == [x.shape[1] // (world // dp if sequence_parallel else 1)], case
        for name, g in grads.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=1e-10, msg=f"{case} {name}")
            torch.testing.assert_close(got["clipped"][name], clipped[name], rtol=0, atol=1e-10, msg=f"{case} {name}")


@pytest.mark.parametrize("residual", ["block", "full"])
def test_tensor_parallel_inside_pipeline_stages_equals_one_process_in_float64(residual, tmp_path):
    """A (pp 2, tp 2) mesh: each pipeline stage's blocks (and the embedding or head) split over a tp
    pair; every rank's loss and gradients, gathered over tp, before and after clipping, equal one
    float64 process."""
    spawn(pipeline_tensor_parallel, 4, residual, str(tmp_path))
    loss, grads, clipped = one_process(residual, None, 0.1)
    seen = set()
    for rank in range(4):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["loss"] == pytest.approx(loss, abs=1e-10)
        assert {n for n in got["grads"] if n.rsplit(".", 2)[-2] in SPLIT} == set(got["sharded"]) != set()
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, grads[name], rtol=0, atol=1e-10, msg=f"rank {rank} {name}")
            torch.testing.assert_close(got["clipped"][name], clipped[name], rtol=0, atol=1e-10, msg=name)
        seen |= set(got["grads"])
    assert seen == set(grads)


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
    train_parallel(corpus, tmp_path / "tp-then-one", 2, tp=2, steps=2, activation_checkpointing="block")
    train_one(corpus, tmp_path / "tp-then-one", resume=True)
    train_one(corpus, tmp_path / "one-then-tp", steps=2)
    train_parallel(corpus, tmp_path / "one-then-tp", 2, resume=True, tp=2)
    want_train, want_val = losses(tmp_path / "one")
    for run in ("tp-then-one", "one-then-tp"):
        got_train, got_val = losses(tmp_path / run)
        assert got_train == pytest.approx(want_train, rel=1e-5), run
        assert got_val == pytest.approx(want_val, rel=1e-5), run


@pytest.mark.parametrize(
    "layout",
    [dict(), dict(fsdp=True), dict(fsdp=True, sequence_parallel=True, activation_checkpointing="sublayer")],
)
def test_tensor_parallel_times_data_parallel_on_four_ranks_equals_one_process(corpus, tmp_path, layout):
    """A (dp 2, tp 2) mesh: two replicas of a tp pair, each on half the batch, averaging gradients by
    all-reduce or sharding them with FSDP2 over dp, optionally with the depth state split by position
    (and each sublayer recomputed in backward); Muon (orthogonalising sharded matrices) included."""
    train_one(corpus, tmp_path / "one", optimizer="muon", steps=2)
    train_parallel(corpus, tmp_path / "2d", 4, optimizer="muon", steps=2, dp=2, tp=2, **layout)
    (want_train, want_val), (got_train, got_val) = losses(tmp_path / "one"), losses(tmp_path / "2d")
    assert got_train == pytest.approx(want_train, rel=1e-5)
    assert got_val == pytest.approx(want_val, rel=1e-5)


def test_tensor_parallel_inside_pipeline_stages_trains_and_resumes_like_one_process(corpus, tmp_path):
    """`--pp 2 --tp 2`: two pipeline stages, each split over a tp pair, through the Trainer; its
    checkpoint (gathered over tp and pp) continues in one process like a run that never left it."""
    model = {**MODEL, "n_layers": 4, "attnres_block_size": 2}
    train_one(corpus, tmp_path / "one", model=model)
    train_parallel(corpus, tmp_path / "3d", 4, model=model, steps=2, pp=2, tp=2, microbatches=2)
    train_one(corpus, tmp_path / "3d", model=model, resume=True)
    (want_train, want_val), (got_train, got_val) = losses(tmp_path / "one"), losses(tmp_path / "3d")
    assert got_train == pytest.approx(want_train, rel=1e-5)
    assert got_val == pytest.approx(want_val, rel=1e-5)


KIMI = {"backbone": "kimi_linear", "n_layers": 2, "kimi_layer_pattern": "KM", "moe_experts": 4, "moe_top_k": 2}


def test_kimi_linear_under_tensor_parallel_trains_like_one_process(corpus, tmp_path):
    """Kimi Linear's dense MLP and the MoE's shared experts split over 2 ranks (KDA, MLA and the routed
    experts replicated: attnres.parallel.tensor says why); losses and expert loads equal one process."""
    from attnres.model import AttnResLM
    from attnres.model.backbones import BACKBONES

    model_cfg, _ = build_configs("tiny", KIMI)
    present = {name for block in AttnResLM(model_cfg).blocks for name, _ in block.named_modules()}
    assert set(BACKBONES["kimi_linear"].tensor_plan.block) <= present  # every entry of the plan splits something
    train_one(corpus, tmp_path / "one", model=KIMI, optimizer="muon", steps=2)
    train_parallel(corpus, tmp_path / "tp", 2, model=KIMI, optimizer="muon", steps=2, tp=2)
    (want_train, want_val), (got_train, got_val) = losses(tmp_path / "one"), losses(tmp_path / "tp")
    assert got_train == pytest.approx(want_train, rel=1e-5)
    assert got_val == pytest.approx(want_val, rel=1e-5)
    rows = [json.loads(line) for line in (tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("moe_load.") for r in rows for k in r)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(tp=2, n_heads=3, d_model=48), r"ModelConfig.n_heads=3 is not divisible by tp=2.*Fix: set n_heads"),
        (dict(tp=2, n_kv_heads=1), r"ModelConfig.n_kv_heads=1 is not divisible by tp=2"),
        (dict(tp=2, d_ff=91), r"ModelConfig.d_ff=91 is not divisible by tp=2"),
        ({**KIMI, "tp": 2, "d_ff": 95}, r"ModelConfig.d_ff=95 is not divisible by tp=2"),
        ({**KIMI, "tp": 2, "moe_d_ff": 15}, r"ModelConfig.moe_d_ff=15 is not divisible by tp=2"),
        (dict(tp=2, pp=2, sequence_parallel=True), r"TrainConfig.sequence_parallel=True is invalid: with pp=2"),
        (dict(tp=2, dp=3, batch_size=4), r"TrainConfig.batch_size=4 is invalid: must be divisible by dp=3"),
        (dict(tp=0), r"TrainConfig.tp=0 is invalid: must be a positive integer"),
        (dict(sequence_parallel=True), r"TrainConfig.sequence_parallel=True is invalid: .*set tp >= 2"),
        (dict(tp=2, sequence_parallel=True, seq_len=31), r"TrainConfig.seq_len=31 is invalid: must be divisible by"),
        ({**KIMI, "tp": 2, "sequence_parallel": True}, r"sequence_parallel with backbone='kimi_linear' and tp=2"),
        (dict(tp=2, sequence_parallel=True, tie_embeddings=True), r"ModelConfig.tie_embeddings=True with sequence_par"),
        (dict(tp=2, retrofit_step=2), r"TrainConfig.retrofit_step=2 is invalid: needs a single-process run"),
    ],
)
def test_bad_tensor_parallel_settings_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        build_configs("tiny", options)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--tp", "2"], r"--tp 2 needs 2 processes: launch with `torchrun --nproc-per-node 2"),
        (["--dp", "2", "--tp", "2"], r"--dp 2 --tp 2 needs 4 processes: launch with `torchrun --nproc-per-node 4"),
    ],
)
def test_cli_tp_without_torchrun_names_the_launch(corpus, tmp_path, monkeypatch, capsys, argv, match):
    from attnres.cli import main

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    args = ["train", "--preset", "tiny", "--data", corpus, "--out", str(tmp_path / "run"), "--no-progress", *argv]
    assert main(args) != 0
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.compile_heavy
@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sequence_parallel=True)])
def test_compiled_tensor_parallel_equals_one_eager_process(corpus, tmp_path, layout):
    """torch.compile per attention/MLP sublayer, where the DTensors are (aot_eager: the tracing and
    autograd of a real compile without inductor's code generation)."""
    train_one(corpus, tmp_path / "one", steps=2)
    train_parallel(corpus, tmp_path / "compiled", 2, steps=2, compile="aot_eager", **layout)
    (want_train, want_val), (got_train, got_val) = losses(tmp_path / "one"), losses(tmp_path / "compiled")
    assert got_train == pytest.approx(want_train, rel=1e-5)
    assert got_val == pytest.approx(want_val, rel=1e-5)


@pytest.mark.parametrize(
    "options, line",
    [
        (dict(tp=2), "; tensor parallel tp=2"),
        (dict(tp=2, sequence_parallel=True), "; tensor parallel tp=2 (sequence parallel)"),
        (dict(tp=2, dp=2, fsdp=True), "; tensor parallel tp=2 x data parallel dp=2 (FSDP2)"),
        (dict(tp=2, dp=2), "; tensor parallel tp=2 x data parallel dp=2 (all-reduce)"),
    ],
)
def test_the_run_line_names_the_tensor_parallel_layout(options, line):
    from attnres.train.config import TrainConfig
    from attnres.train.layout import describe_layout

    assert describe_layout(TrainConfig(**options), None) == line
