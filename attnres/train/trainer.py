"""A thin trainer that composes the pieces: data, model, optimizer, schedule, checkpoints, metrics.

Each piece is a module of its own: the run's data (``run_data``), its process layout (``layout``),
its checkpoint (``checkpointer``), evaluation (``evaluation``), the summary (``summary``), metrics
and progress (``metrics``, ``progress``); the trainer wires them and runs the steps.

Resuming reproduces an uninterrupted run exactly on CPU: batches are drawn
from a generator seeded by (seed, step, micro-step) alone, the learning rate
is a pure function of the step, and the checkpoint carries optimizer and RNG
states. The first Ctrl-C finishes the current step, writes a checkpoint and
exits; a second one stops at once.

Nothing is lost or silently wrong: one trainer at a time writes a run directory, and a run there
is continued only with ``resume`` and replaced only with ``force`` (``attnres.train.run_dir``); a
checkpoint is written only from a state whose parameters and next loss are finite, so a diverged
run keeps its last good checkpoint; a resumed run encodes with its saved tokenizer and refuses
data that changed since it started; resuming a finished run trains nothing and keeps its summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from attnres.checkpoint import resolve_device
from attnres.files import CONFIG_FILE, TOKENIZER_FILE, atomic_write_text
from attnres.model import AttnResLM, ModelConfig
from attnres.model.compile import check_compiler
from attnres.parallel.runtime import check_layout, init_distributed
from attnres.residual.attnres import routing_gain_stats
from attnres.train.checkpointer import Checkpointer, check_resume, unfit_to_save
from attnres.train.config import TrainConfig
from attnres.train.evaluation import evaluate
from attnres.train.layout import build_layout, describe_layout, pipeline_traffic
from attnres.train.memory import check_memory
from attnres.train.metrics import MetricsLogger, check_trackers
from attnres.train.optim import build_optimizer
from attnres.train.progress import StepProgress
from attnres.train.retrofit import check_retrofit, depth_stats, prenorm_of, retrofitted
from attnres.train.run_data import prepare_run_data
from attnres.train.run_dir import claim_run_directory
from attnres.train.schedule import make_schedule, set_lr
from attnres.train.summary import (
    TrainResult,
    read_summary,
    summary_from_state,
    summary_of_run,
    write_summary,
)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


_DIVERGED_FIX = "Fix: lower --lr, or raise --set warmup_steps=N, or set --set grad_clip=1.0"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGUSR1: a checkpoint was written before stopping. ``exit_code``: 128 + the
    signal's number (130 for Ctrl-C, 143 for SIGTERM), what a shell reports for a process it stopped."""

    exit_code = 130


# what stops a run gracefully: Ctrl-C; SIGTERM, what timeout, kill, SLURM and Kubernetes send; SIGUSR1,
# SLURM's warning before pre-emption (sbatch --signal=USR1@90)
_GRACEFUL_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name))


class _GracefulInterrupt:
    """The first SIGINT, SIGTERM or SIGUSR1 sets a flag (checked between steps); the second raises at once."""

    def __init__(self):
        self.requested = False
        self.signum = signal.SIGINT
        self._previous: dict = {}

    def __enter__(self):
        for signum in _GRACEFUL_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = "press again" if signum == signal.SIGINT else "send it again"
        print(f"\n{name}: finishing this step and writing a checkpoint ({again} to stop at once)", flush=True)

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)
        self._previous = {}
        return False


def _log(metrics: MetricsLogger | None, row: dict, step: int, kind: str) -> None:
    """A metrics row, on the rank that writes them (the others have no logger)."""
    if metrics is not None:
        metrics.log(row, step=step, kind=kind)


def _interrupted(step: int, path: Path, out_dir: Path, signum: int) -> TrainingInterrupted:
    """The stop after a signal: the checkpoint it wrote and the command that continues the run."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    launch = ["torchrun", "--nproc-per-node", str(world), "-m", "attnres"] if world > 1 else ["attnres"]
    again = shlex.join([*launch, "train", "--out", str(out_dir), "--resume"])
    stop = TrainingInterrupted(f"interrupted at step {step}; checkpoint written to {path}; continue with {again}")
    stop.exit_code = 128 + int(signum)  # another rank's signal: Ctrl-C's code
    return stop


def write_run_files(
    out_dir: Path, model_config: ModelConfig, train_config: TrainConfig, tokenizer, *, keep_tokenizer: bool
) -> None:
    """The run's config.json and tokenizer.json (a resumed run keeps the tokenizer it has)."""
    config = {"model": model_config.to_dict(), "train": train_config.to_dict()}
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config, indent=2))
    if not (keep_tokenizer and (out_dir / TOKENIZER_FILE).is_file()):
        tokenizer.save(str(out_dir / TOKENIZER_FILE))


class Trainer:
    retrofit_to: ModelConfig | None = None

    def __init__(
        self,
        model_config: ModelConfig,
        train_config: TrainConfig,
        *,
        resume: bool = False,
        force: bool = False,
        log: Callable[[str], None] = print,
        trackers: Sequence[str] = (),
        name: str | None = None,
    ):
        """``resume``: continue the run in ``train_config.out_dir``; ``force``: delete the run there and
        start over; with neither, a directory that holds a run is refused. The run directory stays
        locked to this trainer until :meth:`run` returns (or :meth:`close`). ``trackers``: where the
        metrics go besides the run directory's files (``attnres.train.metrics.TRACKERS``:
        "tensorboard", on anyway when installed; "wandb"); checked here, before any work. ``name``:
        what the progress bar calls the run (default: the run directory's name)."""
        check_trackers(trackers)
        self.trackers = tuple(trackers)
        self.name = name or Path(train_config.out_dir).name
        self.cfg = train_config
        self.resume = resume
        self.log = log
        self.out_dir = Path(train_config.out_dir)
        self._lock = None
        if train_config.threads:
            torch.set_num_threads(train_config.threads)
        self.device = resolve_device(train_config.device)
        check_compiler(train_config.compile, self.device)
        c = train_config
        world = check_layout(c.dp, c.pp, c.tp)
        if world > 1:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            init_distributed(self.device, c.dist_timeout)
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        if self.is_main:  # one writer: rank 0 owns the run directory
            self._lock = claim_run_directory(self.out_dir, resume=resume, force=force)
        try:
            self._setup(model_config, world)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory (:meth:`run` does; for a trainer that is never run)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _setup(self, model_config: ModelConfig, world: int) -> None:
        c = self.cfg
        saved = check_resume(self.out_dir, c) if self.resume else None
        self.data = prepare_run_data(c, self.out_dir, saved, world, self.is_main)
        model_config.vocab_size = self.data.tokenizer.vocab_size
        model_config.validate()
        self.model_config = model_config
        check_memory(model_config, c, self.device)

        if c.retrofit_step:
            check_retrofit(c.retrofit_step, model_config, self.resume, self.out_dir)
            self.retrofit_to, model_config = model_config, prenorm_of(model_config)
        torch.manual_seed(c.seed)
        self._install(AttnResLM(model_config).to(self.device), model_config)
        options = {"decay_fraction": c.decay_fraction} if c.schedule == "wsd" else {}
        self.schedule = make_schedule(c.schedule, total_steps=c.steps, warmup_steps=c.warmup_steps, **options)
        self.step = 0
        self.step_report: dict[str, object] = {}  # what the model reports after each step (MoE expert loads)
        self.state = {"tokens": 0, "elapsed": 0.0, "train_loss": float("nan"), "data_digest": self.data.data_digest}
        if self.resume:
            self._resume()

    def _install(self, model: AttnResLM, model_config: ModelConfig) -> None:
        """``model`` as the one this trainer trains: its layout, compilation, optimizer, checkpointer."""
        c = self.cfg
        model.set_activation_checkpointing(c.activation_checkpointing)
        self.model_config = model_config
        self.n_params = model.num_params()
        self.strategy = build_layout(model, c, self._autocast)
        # in place: names unchanged
        self.compiled = self.strategy.compile(c.compile, c.compile_granularity) if c.compile else None
        self.model = self.strategy.model  # this rank's parameters, under their full-model names
        self.optimizer = self._build_optimizer(self.model)
        self.checkpointer = Checkpointer(
            self.out_dir, c, model_config, self.strategy, self.optimizer, self._build_optimizer, self.is_main
        )

    def _val_batch(self, batch_size: int) -> torch.Tensor:
        from attnres.data import eval_batches

        x, _ = next(eval_batches(self.data.val.tokens, batch_size, self.cfg.seq_len, max_batches=1))
        return x.to(self.device)

    def _retrofit(self) -> float:
        """At ``retrofit_step``: the PreNorm model's weights into the configured residual (zero queries, eps
        scaled), a fresh optimizer; returns the largest logit change on a validation batch (rounding)."""
        assert self.retrofit_to is not None  # _setup sets it whenever retrofit_step is
        model, change = retrofitted(self.model, self.retrofit_to, self.device, self._val_batch(2))
        self._install(model, self.retrofit_to)
        return change

    def _depth_stats(self) -> dict:
        return depth_stats(self.model, self._val_batch(self.cfg.batch_size))

    def describe(self) -> str:
        """One line: the model, the data and, for parallel runs, the layout."""
        m, layout = self.model_config, describe_layout(self.cfg, self.compiled)
        return (
            f"model: {m.residual}, {self.n_params:,} parameters, {m.n_layers} blocks x d={m.d_model}; data: "
            f"{len(self.data.train_names)} train / {len(self.data.val_names)} validation documents{layout}"
        )

    def pipeline_traffic(self) -> str | None:
        """The pipeline's bytes on the wire next to docs/method.md §7 (``attnres.parallel.report``); None without a
        pipeline or before any step. Collective: every rank of a pipeline run calls it."""
        return pipeline_traffic(self.strategy, self.cfg)

    def _build_optimizer(self, model):
        c = self.cfg
        return build_optimizer(
            model, c.optimizer, lr=c.lr, weight_decay=c.weight_decay, betas=(c.beta1, c.beta2), muon_lr=c.muon_lr
        )

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> None:
        state = self.checkpointer.load()
        self.step = state["step"]
        self.state.update(state["train_state"])
        if self.is_main:
            self.log(f"resumed {self.out_dir} at step {self.step}")

    def save(self) -> Path:
        """Write the checkpoint (in the single-process format; rank 0 writes, all ranks take part).

        Only a state that can continue is saved: every parameter finite and the loss of the next
        step's first batch finite (weights can be finite and still give NaN logits). Otherwise the
        checkpoint on disk is kept and :class:`TrainingDiverged` says which step it holds."""
        problem = unfit_to_save(self.model, self.strategy, self.data.train.tokens, self.cfg, self.step, self.device)
        if problem is not None:
            raise TrainingDiverged(f"{problem} after step {self.step}; {self.checkpointer.kept()}. {_DIVERGED_FIX}")
        return self.checkpointer.save(self.step, self.state)

    # ------------------------------------------------------------------ evaluation
    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def evaluate(self) -> dict:
        return evaluate(
            self.model,
            self.data.val,
            batch_size=self.cfg.batch_size,
            seq_len=self.cfg.seq_len,
            max_batches=self.cfg.eval_batches,
            loss_of=self.strategy.eval_loss,
        )

    # ------------------------------------------------------------------ training
    def train_step(self) -> float:
        from attnres.data import batch_seed, sample_batch

        c = self.cfg
        lr = set_lr(self.optimizer, self.schedule(self.step))
        loss_sum = 0.0
        for micro in range(c.grad_accum):
            x, y = sample_batch(
                self.data.train.tokens, c.batch_size, c.seq_len, seed=batch_seed(c.seed, self.step, micro)
            )
            loss = self.strategy.forward_backward(x.to(self.device), y.to(self.device), 1.0 / c.grad_accum)
            if not math.isfinite(loss):
                raise TrainingDiverged(
                    f"loss is {loss} at step {self.step} (micro-batch {micro}); {self.checkpointer.kept()}. "
                    f"{_DIVERGED_FIX}"
                )
            loss_sum += loss
        self.strategy.reduce_gradients()
        if c.grad_clip > 0:
            self.strategy.clip_grad_norm(c.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_report = self.strategy.end_step()
        self.step += 1
        self._last_lr = lr
        return loss_sum / c.grad_accum

    def run(self) -> TrainResult:
        """Train up to ``steps`` (checkpoints, metrics, summary); the run directory is released after."""
        try:
            if self.step >= self.cfg.steps:
                return self._already_complete()
            return self._train()
        finally:
            self.close()

    def _already_complete(self) -> TrainResult:
        """A resumed run that has reached its steps: nothing is trained, its summary stays as it is."""
        if self.is_main:
            self.log(
                f"the run in {self.out_dir} is already complete at step {self.step} (steps={self.cfg.steps}); "
                f"nothing to train. Pass --steps above {self.step} to train it further"
            )
        result = read_summary(self.out_dir)
        if result is not None:  # where the run is now (it may have been copied or moved since)
            return dataclasses.replace(result, out_dir=str(self.out_dir))
        # interrupted between the last checkpoint and the summary: write the summary from the state
        if "val_loss" not in self.state:
            self.state.update(self.evaluate())
        return self._write_summary(summary_from_state(self.state, self.step, self.n_params, self.out_dir))

    def _write_summary(self, result: TrainResult) -> TrainResult:
        if self.is_main:
            write_summary(self.out_dir, result)
        return result

    def _train(self) -> TrainResult:
        c = self.cfg
        if self.is_main:  # one writer: rank 0 owns (and has locked) the run directory
            write_run_files(self.out_dir, self.model_config, c, self.data.tokenizer, keep_tokenizer=self.resume)
        tokens_per_step = c.batch_size * c.seq_len * c.grad_accum
        # from the checkpoint's step (0 for a new run): rows of an interrupted attempt beyond it go
        wandb_config = (
            {"model": self.model_config.to_dict(), "train": c.to_dict()} if "wandb" in self.trackers else None
        )
        metrics = (
            MetricsLogger(self.out_dir, resume_step=self.step, wandb_config=wandb_config) if self.is_main else None
        )
        step_times = []
        # a bar on a terminal, plain lines in a log (attnres.train.progress)
        progress = StepProgress(c.steps, self.step, self.name) if c.progress and self.is_main else None
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
                    row = {
                        "loss": loss,
                        "lr": self._last_lr,
                        "tokens": self.state["tokens"],
                        "step_seconds": dt,
                        "tokens_per_second": tokens_per_step / dt,
                        **self.step_report,
                        **routing_gain_stats(self.model),  # additive routing: whether its gain moves
                    }
                    evaluated = self.step % c.eval_every == 0 or self.step == c.steps
                    if evaluated:
                        ev = self.evaluate()
                        if c.retrofit_step and self.step > c.retrofit_step:
                            ev.update(self._depth_stats())
                        _log(metrics, {**ev, "tokens": self.state["tokens"]}, self.step, "eval")
                        self.state.update(ev)
                    _log(metrics, row, self.step, "train")
                    if progress is not None:
                        progress.update(self.step, loss, tokens_per_step / dt, self.state.get("val_loss"), evaluated)
                    if self.step % c.checkpoint_every == 0 or self.step == c.steps:
                        self.save()
                    if c.retrofit_step and self.step == c.retrofit_step:
                        change = {"max_logit_change": self._retrofit(), "residual": self.model_config.residual}
                        _log(metrics, {**change, **self._depth_stats()}, self.step, "retrofit")
                    if self.strategy.any_rank(interrupt.requested):  # all ranks stop at the same step
                        raise _interrupted(self.step, self.save(), self.out_dir, interrupt.signum)
        finally:
            if progress is not None:
                progress.close()
            if metrics is not None:
                metrics.close()

        wall = time.perf_counter() - start_wall
        result = summary_of_run(self.state, self.step, self.n_params, wall, step_times, tokens_per_step, self.out_dir)
        return self._write_summary(result)

    def write_figures(self) -> list[Path]:
        """Draw the run's figures into its directory (``attnres.analysis.plots.plot_run``): loss.png and,
        for depth-attention schemes, depth_weights.png of the model now on the first validation batch.
        Rank 0 draws; the depth weights need the whole model in one process (no DDP, FSDP2, pipeline)."""
        if not self.is_main:
            return []
        from attnres.analysis.depth import write_depth_weights
        from attnres.analysis.plots import plot_run
        from attnres.data import eval_batches

        if not self.strategy.distributed:
            x, _ = next(iter(eval_batches(self.data.val.tokens, self.cfg.batch_size, self.cfg.seq_len, max_batches=1)))
            with self._autocast():
                write_depth_weights(self.model, x.to(self.device), self.out_dir)
        return plot_run(self.out_dir)
