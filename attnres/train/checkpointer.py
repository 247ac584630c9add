"""The run's checkpoint, as the trainer uses it: a ``--resume`` checked against it before anything
costly, loaded into whatever layout the run has (single process, DDP/FSDP2, tensor parallel, pipeline),
and written in the single-process format whatever the layout (rank 0 writes, every rank takes part)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from attnres.checkpoint import (
    find_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
)
from attnres.files import CHECKPOINT_DIR
from attnres.model import AttnResLM, ModelConfig
from attnres.parallel.state import (
    load_full_model_state,
    load_named_optimizer_state,
    named_optimizer_state,
)
from attnres.train.config import RESUMABLE_CHANGES, TrainConfig


def check_resume(out_dir: Path, train_config: TrainConfig) -> dict:
    """The checkpoint's state.json, checked against this run's options (before anything costly)."""
    path = find_checkpoint(out_dir)
    if path is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out_dir}; start over with --force (deletes what is there) "
            "or pass the --out of the run to continue"
        )
    saved = read_checkpoint_state(path)
    diffs = [
        f"{k}: checkpoint={v!r}, now={getattr(train_config, k)!r}"
        for k, v in saved.get("train_config", {}).items()
        if k not in RESUMABLE_CHANGES and getattr(train_config, k, v) != v
    ]
    if diffs:
        raise ValueError(
            f"--resume: the training options differ from the checkpoint in {path}: "
            + "; ".join(diffs)
            + ". Fix: resume with the run's original options, or start a new run"
        )
    if saved["step"] > train_config.steps:
        raise ValueError(
            f"--resume: the run in {out_dir} is already at step {saved['step']}, past steps="
            f"{train_config.steps}; pass --steps above {saved['step']} to train it further"
        )
    return saved


class Checkpointer:
    """Loads and writes ``<out_dir>/checkpoint`` for a run laid out by ``strategy`` (an
    ``attnres.parallel.runtime`` layout); ``make_optimizer(model)`` builds the run's optimizer, for
    the full single-process copy a distributed run loads into and writes from."""

    def __init__(
        self,
        out_dir: Path,
        train_config: TrainConfig,
        model_config: ModelConfig,
        strategy,
        optimizer: torch.optim.Optimizer,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        is_main: bool,
    ):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / CHECKPOINT_DIR
        self.cfg, self.model_config, self.strategy = train_config, model_config, strategy
        self.optimizer, self.make_optimizer, self.is_main = optimizer, make_optimizer, is_main
        self.saved_step: int | None = None  # the step of the checkpoint on disk, if any

    def full_copy(self):
        """A single-process model and optimizer on CPU: what a checkpoint holds, whatever the layout."""
        with torch.random.fork_rng(devices=[]):
            model = AttnResLM(self.model_config)
        return model, self.make_optimizer(model)

    def load(self) -> dict:
        """Load the checkpoint into this rank's model and optimizer (and the RNGs); its state.json."""
        path = find_checkpoint(self.out_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.out_dir}")
        if self.strategy.distributed:  # load the full checkpoint, keep this rank's part
            model, optimizer = self.full_copy()
            state = load_checkpoint(path, model=model, optimizer=optimizer)
            self.strategy.scatter(model.state_dict(), named_optimizer_state(optimizer), self.optimizer)
        else:
            state = load_checkpoint(path, model=self.strategy.model, optimizer=self.optimizer)
        self.saved_step = state["step"]
        return state

    def save(self, step: int, train_state: dict) -> Path:
        """Write the checkpoint of ``step`` (collective: every rank calls it)."""
        model, optimizer = self.strategy.model, self.optimizer
        if self.strategy.distributed:
            gathered = self.strategy.gather(self.optimizer)
            if gathered is not None:
                model, optimizer = self.full_copy()
                load_full_model_state(model, gathered[0])
                load_named_optimizer_state(optimizer, gathered[1], model)
        if self.is_main:
            save_checkpoint(
                self.path,
                model=model,
                optimizer=optimizer,
                step=step,
                train_state=train_state,
                model_config=self.model_config.to_dict(),
                train_config=self.cfg.to_dict(),
            )
        self.strategy.barrier()
        self.saved_step = step
        return self.path

    def kept(self) -> str:
        """What a diverged run keeps: its last good checkpoint, or none."""
        if self.saved_step is None:
            return f"no checkpoint was written to {self.path}"
        return f"the last good checkpoint, step {self.saved_step}, is kept in {self.path}"


@torch.no_grad()
def unfit_to_save(model: nn.Module, strategy, tokens, cfg: TrainConfig, step: int, device: torch.device) -> str | None:
    """None when the state may be checkpointed, else what is wrong with it: a non-finite parameter (on
    any rank), or a non-finite loss of the next step's first batch (collective)."""
    from attnres.data import batch_seed, sample_batch

    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if strategy.any_rank(bool(bad)):
        more = ", ..." if len(bad) > 3 else ""
        return f"non-finite parameters ({', '.join(bad[:3]) or 'on another rank'}{more})"
    x, y = sample_batch(tokens, cfg.batch_size, cfg.seq_len, seed=batch_seed(cfg.seed, step, 0))
    was_training = model.training
    model.eval()
    try:
        loss = strategy.eval_loss(x.to(device), y.to(device))
    finally:
        model.train(was_training)
    if not math.isfinite(loss):
        return f"the loss of the next batch is {loss}"
    return None
