"""Process-group workers for tests/parallel (importable by spawned children: tests/ is on sys.path).

Each worker joins a gloo group, runs its cases and writes its results with torch.save;
the test process compares them against a single-process float64 reference.
"""

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from reference import randomize

VOCAB, BATCH, SEQ = 50, 8, 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args) -> None:
    """Run fn(rank, world, *args) in ``world`` processes; a failing rank fails the call (and ends the
    others), and a 60-second collective timeout turns a hang into an error."""
    mp.start_processes(_entry, args=(fn, world, free_port(), args), nprocs=world, start_method="spawn")


def _entry(rank, fn, world, port, args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=60)
    )
    try:
        fn(rank, world, *args)
    finally:
        from attnres.parallel.runtime import leave_process_group

        leave_process_group()
    # The results are written. Skip interpreter shutdown: a background thread (gloo's, autograd's) that
    # drops a tensor while the interpreter finalizes takes the GIL and aborts the process with
    # "terminate called without an active exception" (pytorch/pytorch#190489), failing a passed test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def model_config(residual: str, n_layers: int, options=None):
    """``options``: ModelConfig fields beyond the residual (Block AttnRes defaults to S = 4)."""
    from attnres.model import ModelConfig

    if options is None:
        options = {"attnres_block_size": 4} if residual == "block" else {}
    return ModelConfig(
        vocab_size=VOCAB, d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=16, residual=residual, **options
    )


def reference_model(residual: str, n_layers: int, options=None):
    """float64, with random (non-zero) residual parameters so depth weights are not uniform."""
    from attnres.model import AttnResLM

    torch.manual_seed(0)
    model = AttnResLM(model_config(residual, n_layers, options)).double()
    randomize(model.residual, seed=2)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def pipeline_cases(rank, world, cases, out_dir):
    """cases: dicts with residual, n_layers, vpp, schedule, microbatches, cache, clip, and optionally
    options (ModelConfig fields)."""
    from attnres.parallel.pipeline import build_pipeline
    from attnres.parallel.report import gather_traffic

    results = []
    for case in cases:
        model = reference_model(case["residual"], case["n_layers"], case.get("options"))
        x, y = batch()
        pipe = build_pipeline(
            model,
            pp=world,
            vpp=case["vpp"],
            schedule=case["schedule"],
            microbatches=case["microbatches"],
            batch_size=BATCH,
            seq_len=SEQ,
            cache=case["cache"],
        )
        loss = pipe.train_step(x, y)
        pipe.reduce_shared_gradients()
        norm = pipe.clip_grad_norm_(case["clip"]) if case.get("clip") else None
        eval_loss = pipe.eval_loss(x, y)
        traffic = gather_traffic(pipe)
        results.append(
            {
                "loss": loss,
                "eval_loss": eval_loss,
                "norm": norm,
                "traffic": traffic,
                "layout": pipe.layout,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            }
        )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def trainer_run(rank, world, model_overrides, train_overrides, resume, out_file):
    """A Trainer run under a torchrun-like environment."""
    from attnres.train.config import build_configs
    from attnres.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    model_cfg, train_cfg = build_configs("tiny", {**model_overrides, **train_overrides})
    trainer = Trainer(model_cfg, train_cfg, resume=resume)
    result = trainer.run()
    if rank == 0:
        torch.save(result.__dict__, out_file)
