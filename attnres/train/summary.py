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

    def describe(self) -> str:
        return (
            f"step {self.steps}: val loss {self.val_loss:.4f} nats/token, {self.val_bpb:.4f} bits/byte, "
            f"{self.tokens_per_second:,.0f} tokens/s -> {self.out_dir}"
        )


def read_summary(out_dir: Path) -> TrainResult | None:
    """The run's summary.json, or None when there is none (or it is not a whole summary)."""
    summary = read_json(Path(out_dir) / SUMMARY_FILE)
    names = [f.name for f in dataclasses.fields(TrainResult)]
    if isinstance(summary, dict) and set(names) <= set(summary):
        return TrainResult(**{k: summary[k] for k in names})
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
    )


def write_summary(out_dir: Path, result: TrainResult) -> None:
    atomic_write_text(Path(out_dir) / SUMMARY_FILE, json.dumps(result.__dict__, indent=2))
