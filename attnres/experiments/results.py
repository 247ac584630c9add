"""Reading an experiment's finished runs back: summaries, probes, metrics, grouped by labels."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attnres.experiments.runner import (
    DIVERGED_FILE,
    PROBES_FILE,
    RUN_FILE,
    SPLIT_EVAL,
    RunStatus,
    plan_status,
)
from attnres.experiments.spec import ExperimentSpec, PlannedRun
from attnres.files import CONFIG_FILE, SUMMARY_FILE, read_json


@dataclass
class Result:
    """One planned entry and what its run directory holds."""

    run: PlannedRun
    dir: Path
    state: str
    # summary.json and probes.json of a finished run; {} for the others (and where a file is missing)
    summary: dict = field(default_factory=dict)
    probes: dict = field(default_factory=dict)
    info: dict | None = None  # run.json
    config: dict | None = None  # config.json written by the Trainer (actual vocabulary)
    diverged: dict | None = None
    # which final loss the report reads: "split" (the whole validation split, summary.json's val_split) or
    # "slice" (the trainer's last evaluation, the split's first eval_batches batches); one per collection
    scope: str = "slice"
    _metrics: dict | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def loss(self) -> float:
        if not self.summary:
            return float("nan")
        if self.scope == "split":
            return self.split_loss
        return float(self.summary["val_loss"])

    @property
    def split_loss(self) -> float:
        """The final model's loss on the whole validation split, whatever ``scope`` the report reads."""
        return float(self.summary[SPLIT_EVAL]["val_loss"])

    @property
    def split_tokens(self) -> int:
        """How many tokens ``split_loss`` averages over."""
        return int(self.summary[SPLIT_EVAL]["val_tokens"])

    @property
    def eval_tokens(self) -> int | None:
        """How many validation tokens ``loss`` averages over (runs that predate the record: the planned
        eval_batches x batch_size x seq_len, which the split may cut short)."""
        if not self.summary:
            return None
        if self.scope == "split":
            return self.split_tokens
        if "val_tokens" in self.summary:
            return int(self.summary["val_tokens"])
        t = self.run.train
        return t.eval_batches * t.batch_size * t.seq_len

    @property
    def has_split_eval(self) -> bool:
        return isinstance(self.summary.get(SPLIT_EVAL), dict)

    @property
    def model(self) -> dict:
        """The model config as trained (vocabulary from the tokenizer) or as planned."""
        return self.config["model"] if self.config else self.run.model.to_dict()

    def metrics(self) -> dict[str, list[dict]]:
        if self._metrics is None:
            from attnres.analysis.plots import read_metrics

            self._metrics = read_metrics(str(self.dir))
        return self._metrics

    def final_moe_imbalance(self) -> float | None:
        """Mean over MoE layers of max load / mean load - 1 at the last training step (None: no experts)."""
        train = self.metrics().get("train", [])
        if not train:
            return None
        last = max(train, key=lambda row: row["step"])
        values = [float(v) for k, v in last.items() if k.startswith("moe_maxvio.") and v not in ("", None)]
        return sum(values) / len(values) if values else None

    def eval_curve(self) -> dict[str, np.ndarray]:
        """Validation loss against step, tokens and cumulative training seconds (step times only)."""
        m = self.metrics()
        train = sorted(m.get("train", []), key=lambda r: r["step"])
        steps = np.array([r["step"] for r in train], dtype=float)
        cum = np.cumsum([float(r.get("step_seconds", 0.0)) for r in train])
        ev = sorted(m.get("eval", []), key=lambda r: r["step"])
        est = np.array([r["step"] for r in ev], dtype=float)
        secs = np.interp(est, steps, cum) if len(steps) else np.full(len(est), np.nan)
        thinned = m.get("downsampled")  # scripts/downsample_runs.py kept the sums of the rows it dropped
        if thinned and "train_seconds_at_eval" in thinned[0]:
            at = {int(s): float(x) for s, x in thinned[0]["train_seconds_at_eval"]}
            secs = np.array([at.get(int(s), np.nan) for s in est], dtype=float)
        return {
            "step": est,
            "tokens": np.array([r["tokens"] for r in ev], dtype=float),
            "seconds": secs,
            "val_loss": np.array([float(r["val_loss"]) for r in ev], dtype=float),
        }

    @property
    def train_seconds(self) -> float:
        return float(self.summary.get("train_seconds", float("nan"))) if self.summary else float("nan")

    @property
    def wall_seconds(self) -> float:
        if not self.info:
            return 0.0
        return sum(float(i.get("wall_seconds", 0.0)) for i in self.info.get("invocations", []))


@dataclass
class Collected:
    spec: ExperimentSpec
    results: list[Result]

    @property
    def scope(self) -> str:
        """'split' when every finished run has its whole-split evaluation, else 'slice': the runs of one
        report are compared on one evaluation, never one run's whole split against another's slice."""
        done = [r for r in self.results if r.done]
        return "split" if done and all(r.has_split_eval for r in done) else "slice"

    @property
    def unique(self) -> list[Result]:
        seen, out = set(), []
        for r in self.results:
            if r.run.hash not in seen:
                seen.add(r.run.hash)
                out.append(r)
        return out

    @property
    def n_done(self) -> int:
        return sum(1 for r in self.unique if r.done)

    @property
    def complete(self) -> bool:
        return all(r.state in ("done", "diverged") for r in self.unique)

    def select(self, **labels) -> list[Result]:
        return [r for r in self.results if all(r.run.labels.get(k) == v for k, v in labels.items())]

    def losses(self, **labels) -> dict[int, float]:
        """seed -> final validation loss of the finished runs with these labels."""
        return {r.run.seed: r.loss for r in self.select(**labels) if r.done}

    def split_losses(self, **labels) -> dict[int, float] | None:
        """seed -> whole-split loss of the finished runs with these labels, or None unless every one of
        them has it. A collection whose runs do not all have the whole-split evaluation reads the slice
        (``scope``); the rows that do can still be compared on the split, among themselves."""
        done = [r for r in self.select(**labels) if r.done]
        if not done or not all(r.has_split_eval for r in done):
            return None
        return {r.run.seed: r.split_loss for r in done}

    def split_rows(
        self, axis: str, labels: list[str], within: dict[str, str] | None = None
    ) -> dict[str, dict[int, float]]:
        """label -> its whole-split losses (``split_losses``), for the labels of ``axis`` (among the runs
        with the labels ``within``) whose every run has them; empty for a collection that already reads
        the split (``scope``), whose other tables compare there."""
        if self.scope == "split":
            return {}
        within = within or {}
        return {label: v for label in labels if (v := self.split_losses(**{axis: label}, **within)) is not None}

    def points(self, axis: str) -> list[str]:
        for name, points in self.spec.axes:
            if name == axis:
                return [p.label for p in points]
        return []

    def point(self, axis: str, label: str):
        for name, points in self.spec.axes:
            if name == axis:
                for p in points:
                    if p.label == label:
                        return p
        return None


def collect(spec: ExperimentSpec, runs_root) -> Collected:
    col = Collected(spec, [_result(s) for s in plan_status(spec, runs_root)])
    scope = col.scope
    for r in col.results:
        r.scope = scope
    return col


def _result(s: RunStatus) -> Result:
    """A run finished in another experiment's directory (state ``reusable``) is read from there."""
    d = s.source if s.state == "reusable" and s.source is not None else s.dir
    state = "done" if s.state == "reusable" else s.state
    r = Result(run=s.run, dir=d, state=state, info=read_json(d / RUN_FILE), config=read_json(d / CONFIG_FILE))
    if state == "done":
        r.summary = read_json(d / SUMMARY_FILE) or {}
        r.probes = read_json(d / PROBES_FILE) or {}
    elif state == "diverged":
        r.diverged = read_json(d / DIVERGED_FILE)
    return r


def nan_matrix(rows: Sequence[Sequence[float | None]]) -> np.ndarray:
    """A probe's matrix (JSON rows, null where undefined) as floats with NaN."""
    return np.array([[np.nan if v is None else float(v) for v in row] for row in rows], dtype=float)


def mean_matrix(mats: Sequence[np.ndarray | None]) -> np.ndarray | None:
    """Element-wise mean over seeds, NaN where no seed has a value; None when there is none."""
    present = [m for m in mats if m is not None]
    if not present:
        return None
    same = [m for m in present if m.shape == present[0].shape]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN cells stay NaN
        return np.nanmean(np.stack(same), axis=0)


def finite(x: float) -> bool:
    return x is not None and not (isinstance(x, float) and (math.isnan(x) or math.isinf(x)))
