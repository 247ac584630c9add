"""A run's result: ``TrainResult``, kept as ``summary.json`` in the run directory (``attnres.files``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from attnres.files import SUMMARY_FILE, atomic_write_text, read_json


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
    val_batches: int | None = None  # the validation sample the losses are of (eval_batches; None: not recorded)

    def describe(self) -> str:
        sample = (
            f" on {self.val_batches} validation batch{'es' if self.val_batches != 1 else ''} "
            f"(`attnres eval` takes the whole split)"
            if self.val_batches
            else ""
        )
        return (
            f"step {self.steps}: val loss {self.val_loss:.4f} nats/token, {self.val_bpb:.4f} bits/byte{sample}, "
            f"{self.tokens_per_second:,.0f} tokens/s -> {self.out_dir}"
        )


def read_summary(out_dir: Path) -> TrainResult | None:
    """The run's summary.json, or None when there is none (or it is not a whole summary)."""
    summary = read_json(Path(out_dir) / SUMMARY_FILE)
    fields = dataclasses.fields(TrainResult)
    names = [f.name for f in fields if f.default is dataclasses.MISSING]  # the optional ones came later
    if isinstance(summary, dict) and set(names) <= set(summary):
        return TrainResult(**{f.name: summary[f.name] for f in fields if f.name in summary})
    return None


def summary_from_state(state: dict, step: int, params: int, out_dir: Path) -> TrainResult:
    """The summary of a run interrupted between its last checkpoint and its summary, from the
    checkpoint's train state (``state`` holds its last evaluation)."""
    elapsed = state["elapsed"]
    return TrainResult(
        steps=step,
        tokens=state["tokens"],
        val_loss=state["val_loss"],
        val_bpb=state["val_bpb"],
        train_loss=state["train_loss"],
        params=params,
        wall_seconds=elapsed,
        step_seconds=elapsed / max(step, 1),
        tokens_per_second=state["tokens"] / elapsed if elapsed > 0 else 0.0,
        out_dir=str(out_dir),
        val_batches=state.get("val_batches"),
    )


def summary_of_run(
    state: dict, step: int, params: int, wall: float, step_times: list[float], tokens_per_step: int, out_dir: Path
) -> TrainResult:
    """The summary of a run that trained: its last evaluation and the median step time of this attempt."""
    median = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
    return TrainResult(
        steps=step,
        tokens=state["tokens"],
        val_loss=state["val_loss"],
        val_bpb=state["val_bpb"],
        train_loss=state["train_loss"],
        params=params,
        wall_seconds=wall,
        step_seconds=median,
        tokens_per_second=tokens_per_step / median if step_times else float("nan"),
        out_dir=str(out_dir),
        val_batches=state.get("val_batches"),
    )


def write_summary(out_dir: Path, result: TrainResult) -> None:
    atomic_write_text(Path(out_dir) / SUMMARY_FILE, json.dumps(result.__dict__, indent=2))
