"""A thin trainer that composes the pieces: data, model, optimizer, schedule, checkpoints, metrics.

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
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from attnres.checkpoint import (
    CheckpointError, find_checkpoint, load_checkpoint, load_model, read_checkpoint_state, resolve_device,
    save_checkpoint,
)
from attnres.files import CHECKPOINT_DIR, CONFIG_FILE, SUMMARY_FILE, TOKENIZER_FILE, atomic_write_text, read_json
from attnres.model import AttnResLM, ModelConfig
from attnres.model.compile import compile_backend, compile_model
from attnres.model.llama import lm_loss
from attnres.parallel.runtime import (
    DataParallel, PipelineParallel, SingleProcess, check_layout, init_distributed,
)
from attnres.parallel.state import load_full_model_state, load_named_optimizer_state, named_optimizer_state
from attnres.train.config import RESUMABLE_CHANGES, TrainConfig
from attnres.train.memory import check_memory
from attnres.train.metrics import MetricsLogger, check_trackers
from attnres.train.progress import StepProgress, progress_bar
from attnres.train.optim import build_optimizer
from attnres.train.run_dir import claim_run_directory
from attnres.train.schedule import make_schedule, set_lr


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


_DIVERGED_FIX = "Fix: lower --lr, or raise --set warmup_steps=N, or set --set grad_clip=1.0"


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

    def describe(self) -> str:
        return (f"step {self.steps}: val loss {self.val_loss:.4f} nats/token, {self.val_bpb:.4f} bits/byte, "
                f"{self.tokens_per_second:,.0f} tokens/s -> {self.out_dir}")


@torch.no_grad()
def evaluate(model, split, *, batch_size: int, seq_len: int, max_batches: Optional[int] = None,
             autocast=nullcontext, loss_of: Optional[Callable] = None, progress: bool = False) -> dict:
    """Validation loss (nats/token) and bits per byte over the split's first windows.

    ``loss_of(x, y) -> float`` (mean loss of a batch) replaces ``model(x)`` for parallel runs.
    ``progress``: a bar over the batches (on a terminal, see ``attnres.train.progress``)."""
    from attnres.data import bits_per_byte, eval_batches

    check_max_batches(max_batches)
    device = next(model.parameters()).device
    if loss_of is None:
        def loss_of(x, y):
            with autocast():
                return lm_loss(model(x), y).item()
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    batches = -(-((len(split.tokens) - 1) // seq_len) // batch_size)
    bar = progress_bar(total=min(batches, max_batches or batches), desc="eval", unit="batch") if progress else None
    for x, y in eval_batches(split.tokens, batch_size, seq_len, max_batches=max_batches):
        x, y = x.to(device), y.to(device)
        total += loss_of(x, y) * x.numel()
        n += x.numel()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    model.train(was_training)
    loss = total / n
    return {"val_loss": loss, "val_bpb": bits_per_byte(loss, split.bytes_per_token)}


def evaluate_run(run_or_checkpoint: str, *, data: Optional[str] = None, max_batches: Optional[int] = None,
                 device: str = "cpu", progress: bool = False, compile: Union[bool, str] = False) -> dict:
    """Validation loss of a trained run on its own validation split (or on ``data``'s): the
    checkpoint's step plus :func:`evaluate`'s numbers, with the run's batch shape and the run's own
    tokenizer (``tokenizer.json``: a tokenizer trained anew on other data would give other ids).
    ``compile``: torch.compile the model first (True: inductor, or a backend name)."""
    from attnres.data import prepare_data

    check_max_batches(max_batches)
    model, tokenizer, state = load_model(run_or_checkpoint, device=device)
    compile_model(model, compile)
    tc = state.get("train_config") or {}
    if not tc:
        raise CheckpointError(f"{run_or_checkpoint} is a weights-only checkpoint without the run's training "
                              "config (batch shape, data); evaluate a run directory written by attnres train")
    if tokenizer is None and tc["tokenizer"] != "byte":
        raise CheckpointError(f"{run_or_checkpoint} has no {TOKENIZER_FILE}, and a {tc['tokenizer']} tokenizer "
                              "trained anew would give other token ids; restore the run's tokenizer.json")
    split = prepare_data(data=data if data else tc["data"], tokenizer=tokenizer or tc["tokenizer"],
                         vocab_size=tc["vocab_size"], val_fraction=tc["val_fraction"],
                         cache_dir=tc.get("cache_dir")).val
    ev = evaluate(model, split, batch_size=tc["batch_size"], seq_len=tc["seq_len"], max_batches=max_batches,
                  progress=progress)
    return {"step": state["step"], **ev}


def check_max_batches(max_batches) -> None:
    """``max_batches``: None (the whole split) or a positive integer."""
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ValueError(f"max_batches={max_batches!r} is invalid: must be a positive number of batches "
                         "(or None for the whole split)")


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
                 force: bool = False, log: Callable[[str], None] = print, trackers: Sequence[str] = (),
                 name: Optional[str] = None):
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
        c = train_config
        world = check_layout(c.dp, c.pp)
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
        saved = self._saved_state() if self.resume else None

        from attnres.data import check_length, load_tokenizer, prepare_data

        tokenizer = c.tokenizer
        if saved is not None and (self.out_dir / TOKENIZER_FILE).is_file():
            tokenizer = load_tokenizer(self.out_dir / TOKENIZER_FILE)  # the run's own, never a retrained one

        def data():
            return prepare_data(data=c.data, tokenizer=tokenizer, vocab_size=c.vocab_size,
                                val_fraction=c.val_fraction, cache_dir=c.cache_dir)

        if world > 1:  # rank 0 fills the tokenizer and token caches, the others then read them
            if self.is_main:
                self.data = data()
            dist.barrier()
            if not self.is_main:
                self.data = data()
        else:
            self.data = data()
        if saved is not None:
            digest = saved.get("train_state", {}).get("data_digest")
            if digest and digest != self.data.data_digest:
                where = "the bundled corpus" if c.data is None else repr(c.data)
                raise ValueError(
                    f"--resume: the data {where} changed since the run in {self.out_dir} started (digest "
                    f"{self.data.data_digest[:12]} now, {digest[:12]} in its checkpoint), so resuming would "
                    "train on other text. Fix: restore the original data, or train a new run (a new --out)")
        check_length(self.data.train, c.seq_len)
        check_length(self.data.val, c.seq_len)
        model_config.vocab_size = self.data.tokenizer.vocab_size
        model_config.validate()
        self.model_config = model_config
        check_memory(model_config, c, self.device)

        torch.manual_seed(c.seed)
        model = AttnResLM(model_config).to(self.device)
        model.set_activation_checkpointing(c.activation_checkpointing)
        self.n_params = model.num_params()
        if c.pp > 1:
            self.strategy = PipelineParallel(
                model, self._autocast, pp=c.pp, vpp=c.vpp, schedule=c.pp_schedule,
                microbatches=c.pipeline_microbatches, batch_size=c.batch_size, seq_len=c.seq_len,
                cache=c.pp_cache, dp=c.dp)
        elif c.dp > 1:
            self.strategy = DataParallel(model, self._autocast, shard=c.fsdp)
        else:
            self.strategy = SingleProcess(model, self._autocast)
        self.compiled = self.strategy.compile(c.compile) if c.compile else None  # in place: names unchanged
        self.model = self.strategy.model  # this rank's parameters, under their full-model names
        self.optimizer = self._build_optimizer(self.model)
        options = {"decay_fraction": c.decay_fraction} if c.schedule == "wsd" else {}
        self.schedule = make_schedule(c.schedule, total_steps=c.steps, warmup_steps=c.warmup_steps,
                                      **options)
        self.step = 0
        self.saved_step: Optional[int] = None  # the step of the checkpoint on disk, if any
        self.step_report = {}  # what the model reports after each step (MoE expert loads)
        self.state = {"tokens": 0, "elapsed": 0.0, "train_loss": float("nan"),
                      "data_digest": self.data.data_digest}
        if self.resume:
            self._resume()

    def describe(self) -> str:
        """One line: the model, the data and, for parallel runs, the layout."""
        m, c = self.model_config, self.cfg
        layout = ""
        if c.pp > 1:
            layout = (f"; pipeline pp={c.pp} vpp={c.vpp} {c.pp_schedule}, {c.pipeline_microbatches} microbatches, "
                      f"caching {'on' if c.pp_cache else 'off'}" + (f", {c.dp} replicas" if c.dp > 1 else ""))
        elif c.dp > 1:
            layout = f"; data parallel dp={c.dp} ({'FSDP2' if c.fsdp else 'DDP'})"
        if self.compiled:
            layout += f"; torch.compile {compile_backend(c.compile)} ({self.compiled})"
        if c.activation_checkpointing != "none":
            layout += f"; activation checkpointing: {c.activation_checkpointing}"
        return (f"model: {m.residual}, {self.n_params:,} parameters, {m.n_layers} blocks x d={m.d_model}; data: "
                f"{len(self.data.train_names)} train / {len(self.data.val_names)} validation documents{layout}")

    def pipeline_traffic(self) -> Optional[str]:
        """The pipeline's bytes on the wire next to docs/method.md §7 (``attnres.parallel.report``); None without a
        pipeline or before any step. Collective: every rank of a pipeline run calls it."""
        if self.cfg.pp == 1:
            return None
        from attnres.parallel.report import gather_traffic, traffic_table

        pipe = self.strategy.pipeline
        mode = "cached" if self.cfg.pp_cache else "naive"
        measured = gather_traffic(pipe)
        if not pipe.steps_run:
            return None
        return traffic_table({mode: pipe.layout}, {mode: measured}, steps=pipe.steps_run,
                             microbatches=pipe.microbatches)

    def _build_optimizer(self, model):
        c = self.cfg
        return build_optimizer(model, c.optimizer, lr=c.lr, weight_decay=c.weight_decay,
                               betas=(c.beta1, c.beta2), muon_lr=c.muon_lr)

    def _full_copy(self):
        """A single-process model and optimizer on CPU: what a checkpoint holds, whatever the layout."""
        with torch.random.fork_rng(devices=[]):
            model = AttnResLM(self.model_config)
        return model, self._build_optimizer(model)

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT_DIR

    def _saved_state(self) -> dict:
        """The checkpoint's state.json, checked against this run's options (before anything costly)."""
        path = find_checkpoint(self.out_dir)
        if path is None:
            raise FileNotFoundError(
                f"--resume: no checkpoint in {self.out_dir}; start over with --force (deletes what is there) "
                "or pass the --out of the run to continue")
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
        if saved["step"] > self.cfg.steps:
            raise ValueError(
                f"--resume: the run in {self.out_dir} is already at step {saved['step']}, past steps="
                f"{self.cfg.steps}; pass --steps above {saved['step']} to train it further")
        return saved

    def _resume(self) -> None:
        path = find_checkpoint(self.out_dir)
        if self.strategy.distributed:  # load the full checkpoint, keep this rank's part
            model, optimizer = self._full_copy()
            state = load_checkpoint(path, model=model, optimizer=optimizer)
            self.strategy.scatter(model.state_dict(), named_optimizer_state(optimizer), self.optimizer)
        else:
            state = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.step = self.saved_step = state["step"]
        self.state.update(state["train_state"])
        if self.is_main:
            self.log(f"resumed {self.out_dir} at step {self.step}")

    def save(self) -> Path:
        """Write the checkpoint (in the single-process format; rank 0 writes, all ranks take part).

        Only a state that can continue is saved: every parameter finite and the loss of the next
        step's first batch finite (weights can be finite and still give NaN logits). Otherwise the
        checkpoint on disk is kept and :class:`TrainingDiverged` says which step it holds."""
        problem = self._unfit_to_save()
        if problem is not None:
            raise TrainingDiverged(f"{problem} after step {self.step}; {self._kept()}. {_DIVERGED_FIX}")
        model, optimizer = self.model, self.optimizer
        if self.strategy.distributed:
            gathered = self.strategy.gather(self.optimizer)
            if gathered is not None:
                model, optimizer = self._full_copy()
                load_full_model_state(model, gathered[0])
                load_named_optimizer_state(optimizer, gathered[1], model)
        if self.is_main:
            save_checkpoint(
                self.checkpoint_path, model=model, optimizer=optimizer, step=self.step,
                train_state=self.state, model_config=self.model_config.to_dict(),
                train_config=self.cfg.to_dict(),
            )
        self.strategy.barrier()
        self.saved_step = self.step
        return self.checkpoint_path

    @torch.no_grad()
    def _unfit_to_save(self) -> Optional[str]:
        """None when the current state may be checkpointed, else what is wrong with it (collective)."""
        from attnres.data import batch_seed, sample_batch

        bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(p).all()]
        if self.strategy.any_rank(bool(bad)):
            more = ", ..." if len(bad) > 3 else ""
            return f"non-finite parameters ({', '.join(bad[:3]) or 'on another rank'}{more})"
        c = self.cfg
        x, y = sample_batch(self.data.train.tokens, c.batch_size, c.seq_len, seed=batch_seed(c.seed, self.step, 0))
        was_training = self.model.training
        self.model.eval()
        try:
            loss = self.strategy.eval_loss(x.to(self.device), y.to(self.device))
        finally:
            self.model.train(was_training)
        if not math.isfinite(loss):
            return f"the loss of the next batch is {loss}"
        return None

    def _kept(self) -> str:
        if self.saved_step is None:
            return f"no checkpoint was written to {self.checkpoint_path}"
        return f"the last good checkpoint, step {self.saved_step}, is kept in {self.checkpoint_path}"

    # ------------------------------------------------------------------ evaluation
    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def evaluate(self) -> dict:
        return evaluate(self.model, self.data.val, batch_size=self.cfg.batch_size,
                        seq_len=self.cfg.seq_len, max_batches=self.cfg.eval_batches,
                        loss_of=self.strategy.eval_loss)

    # ------------------------------------------------------------------ training
    def train_step(self) -> float:
        from attnres.data import batch_seed, sample_batch

        c = self.cfg
        lr = set_lr(self.optimizer, self.schedule(self.step))
        loss_sum = 0.0
        for micro in range(c.grad_accum):
            x, y = sample_batch(self.data.train.tokens, c.batch_size, c.seq_len,
                                seed=batch_seed(c.seed, self.step, micro))
            loss = self.strategy.forward_backward(x.to(self.device), y.to(self.device), 1.0 / c.grad_accum)
            if not math.isfinite(loss):
                raise TrainingDiverged(
                    f"loss is {loss} at step {self.step} (micro-batch {micro}); {self._kept()}. {_DIVERGED_FIX}")
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
            self.log(f"the run in {self.out_dir} is already complete at step {self.step} (steps={self.cfg.steps}); "
                     f"nothing to train. Pass --steps above {self.step} to train it further")
        summary = read_json(self.out_dir / SUMMARY_FILE)
        names = [f.name for f in dataclasses.fields(TrainResult)]
        if isinstance(summary, dict) and set(names) <= set(summary):
            return TrainResult(**{k: summary[k] for k in names})
        # interrupted between the last checkpoint and the summary: write the summary from the state
        if "val_loss" not in self.state:
            self.state.update(self.evaluate())
        elapsed = self.state["elapsed"]
        return self._write_summary(TrainResult(
            steps=self.step, tokens=self.state["tokens"], val_loss=self.state["val_loss"],
            val_bpb=self.state["val_bpb"], train_loss=self.state["train_loss"], params=self.n_params,
            wall_seconds=elapsed, step_seconds=elapsed / max(self.step, 1),
            tokens_per_second=self.state["tokens"] / elapsed if elapsed > 0 else 0.0, out_dir=str(self.out_dir)))

    def _write_summary(self, result: TrainResult) -> TrainResult:
        if self.is_main:
            atomic_write_text(self.out_dir / SUMMARY_FILE, json.dumps(result.__dict__, indent=2))
        return result

    def _train(self) -> TrainResult:
        c = self.cfg
        if self.is_main:  # one writer: rank 0 owns (and has locked) the run directory
            atomic_write_text(self.out_dir / CONFIG_FILE, json.dumps(
                {"model": self.model_config.to_dict(), "train": c.to_dict()}, indent=2))
            if not (self.resume and (self.out_dir / TOKENIZER_FILE).is_file()):  # a resumed run's stays
                self.data.tokenizer.save(str(self.out_dir / TOKENIZER_FILE))
        tokens_per_step = c.batch_size * c.seq_len * c.grad_accum
        # from the checkpoint's step (0 for a new run): rows of an interrupted attempt beyond it go
        wandb_config = {"model": self.model_config.to_dict(), "train": c.to_dict()} \
            if "wandb" in self.trackers else None
        metrics = MetricsLogger(self.out_dir, resume_step=self.step, wandb_config=wandb_config) \
            if self.is_main else None
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
                    row = {"loss": loss, "lr": self._last_lr, "tokens": self.state["tokens"],
                           "step_seconds": dt, "tokens_per_second": tokens_per_step / dt, **self.step_report}
                    evaluated = self.step % c.eval_every == 0 or self.step == c.steps
                    if evaluated:
                        ev = self.evaluate()
                        if metrics is not None:
                            metrics.log({**ev, "tokens": self.state["tokens"]}, step=self.step, kind="eval")
                        self.state.update(ev)
                    if metrics is not None:
                        metrics.log(row, step=self.step, kind="train")
                    if progress is not None:
                        progress.update(self.step, loss, tokens_per_step / dt, self.state.get("val_loss"),
                                        evaluated)
                    if self.step % c.checkpoint_every == 0 or self.step == c.steps:
                        self.save()
                    if self.strategy.any_rank(interrupt.requested):  # all ranks stop at the same step
                        path = self.save()
                        raise TrainingInterrupted(
                            f"interrupted at step {self.step}; checkpoint written to {path}; "
                            f"continue with --resume --out {self.out_dir}"
                        )
        finally:
            if progress is not None:
                progress.close()
            if metrics is not None:
                metrics.close()

        median = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
        result = TrainResult(
            steps=self.step, tokens=self.state["tokens"], val_loss=self.state["val_loss"],
            val_bpb=self.state["val_bpb"], train_loss=self.state["train_loss"],
            params=self.n_params, wall_seconds=time.perf_counter() - start_wall,
            step_seconds=median, tokens_per_second=tokens_per_step / median if step_times else float("nan"),
            out_dir=str(self.out_dir),
        )
        return self._write_summary(result)

    def write_figures(self) -> List[Path]:
        """Draw the run's figures into its directory (``attnres.analysis.plots.plot_run``): loss.png and,
        for depth-attention schemes, depth_weights.png of the model now on the first validation batch.
        Rank 0 draws; the depth weights need the whole model in one process (no DDP, FSDP2, pipeline)."""
        if not self.is_main:
            return []
        from attnres.analysis.depth import write_depth_weights
        from attnres.analysis.plots import plot_run
        from attnres.data import eval_batches

        if not self.strategy.distributed:
            x, _ = next(iter(eval_batches(self.data.val.tokens, self.cfg.batch_size, self.cfg.seq_len,
                                          max_batches=1)))
            with self._autocast():
                write_depth_weights(self.model, x.to(self.device), self.out_dir)
        return plot_run(self.out_dir)

