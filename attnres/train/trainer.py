"""A thin trainer that composes the pieces: data, model, optimizer, schedule, checkpoints, metrics.

Resuming reproduces an uninterrupted run exactly on CPU: batches are drawn
from a generator seeded by (seed, step, micro-step) alone, the learning rate
is a pure function of the step, and the checkpoint carries optimizer and RNG
states. The first Ctrl-C finishes the current step, writes a checkpoint and
exits; a second one stops at once.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from attnres.model import AttnResLM, ModelConfig
from attnres.train.checkpoint import load_checkpoint, read_checkpoint_state, save_checkpoint
from attnres.train.config import RESUMABLE_CHANGES, TrainConfig
from attnres.train.metrics import MetricsLogger
from attnres.train.optim import build_optimizer
from attnres.train.schedule import make_schedule, set_lr

CHECKPOINT_DIR = "checkpoint"
SUMMARY_FILE = "summary.json"


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C: a checkpoint was written before stopping."""


@dataclass
class TrainResult:
    steps: int
    tokens: int
    val_loss: float
    val_bpb: float
    train_loss: float
    params: int
    wall_seconds: float
    step_seconds: float  # median optimizer-step time (forward, backward, update)
    tokens_per_second: float
    out_dir: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device={name!r} but no CUDA device is available; use --device cpu")
    return torch.device(name)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate(model, split, *, batch_size: int, seq_len: int, max_batches: Optional[int] = None,
             autocast=nullcontext) -> dict:
    """Validation loss (nats/token) and bits per byte over the split's first windows."""
    from attnres.data import bits_per_byte, eval_batches

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for x, y in eval_batches(split.tokens, batch_size, seq_len, max_batches=max_batches):
        x, y = x.to(device), y.to(device)
        with autocast():
            total += lm_loss(model(x), y).item() * x.numel()
        n += x.numel()
    model.train(was_training)
    loss = total / n
    return {"val_loss": loss, "val_bpb": bits_per_byte(loss, split.bytes_per_token)}


class _GracefulInterrupt:
    """First SIGINT sets a flag (checked between steps); the second raises at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: finishing this step and writing a checkpoint (press again to stop at once)",
              flush=True)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


class Trainer:
    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, *, resume: bool = False,
                 log: Callable[[str], None] = print):
        self.cfg = train_config
        self.resume = resume
        self.log = log
        self.out_dir = Path(train_config.out_dir)
        if train_config.threads:
            torch.set_num_threads(train_config.threads)
        self.device = resolve_device(train_config.device)

        from attnres.data import check_length, prepare_data

        self.data = prepare_data(
            data=train_config.data, tokenizer=train_config.tokenizer,
            vocab_size=train_config.vocab_size, val_fraction=train_config.val_fraction,
            cache_dir=train_config.cache_dir,
        )
        check_length(self.data.train, train_config.seq_len)
        check_length(self.data.val, train_config.seq_len)
        model_config.vocab_size = self.data.tokenizer.vocab_size
        model_config.validate()
        self.model_config = model_config

        torch.manual_seed(train_config.seed)
        self.model = AttnResLM(model_config).to(self.device)
        c = train_config
        self.optimizer = build_optimizer(self.model, c.optimizer, lr=c.lr, weight_decay=c.weight_decay,
                                         betas=(c.beta1, c.beta2), muon_lr=c.muon_lr)
        options = {"decay_fraction": c.decay_fraction} if c.schedule == "wsd" else {}
        self.schedule = make_schedule(c.schedule, total_steps=c.steps, warmup_steps=c.warmup_steps,
                                      **options)
        self.step = 0
        self.state = {"tokens": 0, "elapsed": 0.0, "train_loss": float("nan")}
        if resume:
            self._resume()

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT_DIR

    def _resume(self) -> None:
        path = self.checkpoint_path
        if not (path / "state.json").exists():
            raise FileNotFoundError(
                f"--resume: no checkpoint at {path}; start without --resume or point --out at the run"
            )
        saved = read_checkpoint_state(path)
        diffs = [
            f"{k}: checkpoint={v!r}, now={getattr(self.cfg, k)!r}"
            for k, v in saved.get("train_config", {}).items()
            if k not in RESUMABLE_CHANGES and getattr(self.cfg, k, v) != v
        ]
        if diffs:
            raise ValueError(
                f"--resume: the training options differ from the checkpoint in {path}: "
                + "; ".join(diffs) + ". Fix: resume with the run's original options, or start a new run"
            )
        state = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.step = state["step"]
        self.state.update(state["train_state"])
        self.log(f"resumed {self.out_dir} at step {self.step}")

    def save(self) -> Path:
        return save_checkpoint(
            self.checkpoint_path, model=self.model, optimizer=self.optimizer, step=self.step,
            train_state=self.state, model_config=self.model_config.to_dict(),
            train_config=self.cfg.to_dict(),
        )

    # ------------------------------------------------------------------ evaluation
    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def evaluate(self) -> dict:
        return evaluate(self.model, self.data.val, batch_size=self.cfg.batch_size,
                        seq_len=self.cfg.seq_len, max_batches=self.cfg.eval_batches,
                        autocast=self._autocast)

    # ------------------------------------------------------------------ training
    def train_step(self) -> float:
        from attnres.data import batch_seed, sample_batch

        c = self.cfg
        lr = set_lr(self.optimizer, self.schedule(self.step))
        loss_sum = 0.0
        for micro in range(c.grad_accum):
            x, y = sample_batch(self.data.train.tokens, c.batch_size, c.seq_len,
                                seed=batch_seed(c.seed, self.step, micro))
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                loss = lm_loss(self.model(x), y)
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"loss is {loss.item()} at step {self.step} (micro-batch {micro}); the last good "
                    f"checkpoint in {self.checkpoint_path} is kept. Fix: lower --lr, raise --warmup_steps "
                    "or use --grad_clip"
                )
            (loss / c.grad_accum).backward()
            loss_sum += loss.item()
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._last_lr = lr
        return loss_sum / c.grad_accum

    def run(self) -> TrainResult:
        c = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(
            {"model": self.model_config.to_dict(), "train": c.to_dict()}, indent=2))
        self.data.tokenizer.save(str(self.out_dir / "tokenizer.json"))
        tokens_per_step = c.batch_size * c.seq_len * c.grad_accum
        metrics = MetricsLogger(self.out_dir, resume_step=self.step if self.resume else None)
        step_times = []
        bar = None
        if c.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=c.steps, initial=self.step, desc=self.out_dir.name, unit="step",
                       dynamic_ncols=True, leave=True)
        start_wall = time.perf_counter()
        try:
            with _GracefulInterrupt() as interrupt:
                while self.step < c.steps:
                    t0 = time.perf_counter()
                    loss = self.train_step()
                    dt = time.perf_counter() - t0
                    step_times.append(dt)
                    self.state["tokens"] += tokens_per_step
                    self.state["elapsed"] += dt
                    self.state["train_loss"] = loss
                    row = {"loss": loss, "lr": self._last_lr, "tokens": self.state["tokens"],
                           "step_seconds": dt, "tokens_per_second": tokens_per_step / dt}
                    if self.step % c.eval_every == 0 or self.step == c.steps:
                        ev = self.evaluate()
                        metrics.log({**ev, "tokens": self.state["tokens"]}, step=self.step, kind="eval")
                        self.state.update(ev)
                    metrics.log(row, step=self.step, kind="train")
                    if bar is not None:
                        bar.update(1)
                        post = {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_step / dt:,.0f}"}
                        if "val_loss" in self.state:
                            post["val"] = f"{self.state['val_loss']:.3f}"
                        bar.set_postfix(post)
                    if self.step % c.checkpoint_every == 0 or self.step == c.steps:
                        self.save()
                    if interrupt.requested:
                        path = self.save()
                        raise TrainingInterrupted(
                            f"interrupted at step {self.step}; checkpoint written to {path}; "
                            f"continue with --resume --out {self.out_dir}"
                        )
        finally:
            if bar is not None:
                bar.close()
            metrics.close()

        if "val_loss" not in self.state:  # resumed a finished run
            self.state.update(self.evaluate())
        median = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
        result = TrainResult(
            steps=self.step, tokens=self.state["tokens"], val_loss=self.state["val_loss"],
            val_bpb=self.state["val_bpb"], train_loss=self.state["train_loss"],
            params=self.model.num_params(), wall_seconds=time.perf_counter() - start_wall,
            step_seconds=median, tokens_per_second=tokens_per_step / median if step_times else float("nan"),
            out_dir=str(self.out_dir),
        )
        (self.out_dir / SUMMARY_FILE).write_text(json.dumps(result.__dict__, indent=2))
        return result


def load_model(run_or_checkpoint: str, device: str = "cpu"):
    """Rebuild a trained model (and its tokenizer when present) from a run or checkpoint directory."""
    path = Path(run_or_checkpoint)
    ckpt = path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR).is_dir() else path
    if not (ckpt / "state.json").exists():
        raise FileNotFoundError(
            f"no checkpoint found at {path}; pass a run directory (holding {CHECKPOINT_DIR}/) or a "
            "checkpoint directory"
        )
    state = read_checkpoint_state(ckpt)
    config = ModelConfig.from_dict(state["model_config"])
    model = AttnResLM(config)
    load_checkpoint(ckpt, model=model, restore_rng=False)
    model.to(resolve_device(device)).eval()
    tokenizer = None
    run_dir = ckpt.parent if ckpt.name == CHECKPOINT_DIR else ckpt
    if (run_dir / "tokenizer.json").exists():
        from attnres.data import load_tokenizer

        tokenizer = load_tokenizer(str(run_dir / "tokenizer.json"))
    return model, tokenizer, state
