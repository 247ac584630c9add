"""Metrics logging to JSON lines, per-kind CSV files and (optionally) TensorBoard.

Files in ``run_dir``:

``metrics.jsonl``       every row, one JSON object per line, flushed per row. This is
                        the source of truth; each row has ``kind``, ``step``, ``time``.
``metrics_<kind>.csv``  the same rows split by kind (``metrics_train.csv``,
                        ``metrics_eval.csv``, ...), columns ``step, time`` then the
                        metric names in first-seen order. When a row brings a new
                        metric name, that kind's file is rewritten with the wider
                        header (older rows get empty cells).
``tb/``                 TensorBoard events (tag ``<kind>/<name>``) when
                        ``torch.utils.tensorboard`` can be imported (``pip install
                        'attnres[tb]'``); off otherwise, unless asked for (``trackers``).
``wandb/``              with the tracker ``wandb`` (when installed): the same scalars in a
                        Weights & Biases run; ``WANDB_MODE=offline`` keeps it local.

Values may be Python/numpy scalars, 0-d tensors, strings or None. Non-finite
floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (valid JSON;
``float()`` parses them back).

Resuming: ``MetricsLogger(run_dir, resume_step=N)`` drops every row whose step is
greater than ``N`` (and a line torn by a crash), rewrites ``metrics.jsonl``
atomically and regenerates the CSV files from it, so the resumed run appends
without duplicated steps. Without ``resume_step`` existing files are appended to.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from attnres.files import METRICS_FILE, atomic_write_text

__all__ = ["MetricsLogger"]

_RESERVED = ("kind", "step", "time")
_KIND_RE = re.compile(r"[A-Za-z0-9_\-]+")


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 else value.tolist()
    elif hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar / 0-d array
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _csv_text(fields: list[str], rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, restval="", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return buf.getvalue()


def _csv_cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, list) else value


TRACKERS = {
    "tensorboard": ("torch.utils.tensorboard", "pip install 'attnres[tb]'"),
    "wandb": ("wandb", "pip install wandb (WANDB_MODE=offline logs without a network)"),
}


def check_trackers(names) -> None:
    """Each of ``names`` (``TRACKERS``) can log here; a ValueError naming the install command if not."""
    import importlib

    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}; choose from {sorted(TRACKERS)}")
        module, install = TRACKERS[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ValueError(f"--log {name}: {module} is not installed; {install}") from None


class MetricsLogger:
    """Append-only metrics logger; see the module docstring for the file layout."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        resume_step: int | None = None,
        *,
        tensorboard: bool = True,
        wandb_config: Mapping[str, Any] | None = None,
    ):
        """``wandb_config``: log to a Weights & Biases run too, with this config (see :func:`check_trackers`)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / METRICS_FILE
        self._csv_fields: dict[str, list[str]] = {}
        self._csv_files: dict[str, Any] = {}

        if resume_step is not None:
            self._truncate(resume_step)
        else:
            self._drop_torn_tail()
            self._read_csv_headers()
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 -- appended to until close()

        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception:  # tensorboard not installed
                pass
            else:
                purge = None if resume_step is None else resume_step + 1
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge)
        self._wandb = None
        if wandb_config is not None:
            import wandb

            self._wandb = wandb.init(
                project="attnres", name=self.run_dir.name, dir=str(self.run_dir), config=dict(wandb_config)
            )

    # ------------------------------------------------------------------ paths / setup

    def csv_path(self, kind: str) -> Path:
        return self.run_dir / f"metrics_{kind}.csv"

    def _existing_csvs(self) -> dict[str, Path]:
        out = {}
        for p in self.run_dir.glob("metrics_*.csv"):
            kind = p.stem[len("metrics_") :]
            if _KIND_RE.fullmatch(kind):
                out[kind] = p
        return out

    def _read_csv_headers(self) -> None:
        for kind, p in self._existing_csvs().items():
            with open(p, encoding="utf-8", newline="") as f:
                header = next(csv.reader(f), None)
            if header:
                self._csv_fields[kind] = header

    def _drop_torn_tail(self) -> None:
        """A crash mid-write can leave a last line without newline: cut it off."""
        if not self.jsonl_path.exists():
            return
        data = self.jsonl_path.read_bytes()
        if data and not data.endswith(b"\n"):
            atomic_write_text(self.jsonl_path, data[: data.rfind(b"\n") + 1].decode("utf-8", "replace"))

    def _truncate(self, resume_step: int) -> None:
        rows: list[dict] = []
        if self.jsonl_path.exists():
            with open(self.jsonl_path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # torn by a crash
                    if not isinstance(row, dict):
                        continue
                    step = row.get("step")
                    if isinstance(step, (int, float)) and step > resume_step:
                        continue
                    rows.append(row)
            atomic_write_text(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in rows))
        # regenerate the CSV files from the surviving rows
        by_kind: dict[str, list[dict]] = {}
        for row in rows:
            kind = str(row.get("kind", "train"))
            if _KIND_RE.fullmatch(kind):
                by_kind.setdefault(kind, []).append(row)
        for kind, p in self._existing_csvs().items():
            if kind not in by_kind:
                p.unlink()
        for kind, krows in by_kind.items():
            fields = ["step", "time"]
            for row in krows:
                fields += [k for k in row if k not in _RESERVED and k not in fields]
            cells = [{k: _csv_cell(v) for k, v in r.items()} for r in krows]
            atomic_write_text(self.csv_path(kind), _csv_text(fields, cells))
            self._csv_fields[kind] = fields

    # ------------------------------------------------------------------ logging

    def log(self, values: Mapping[str, Any], *, step: int, kind: str = "train") -> dict:
        """Write one row ``{kind, step, time, **values}`` to every sink; returns the row."""
        if not _KIND_RE.fullmatch(kind):
            raise ValueError(f"kind must match [A-Za-z0-9_-]+ (it names a CSV file), got {kind!r}")
        clash = [k for k in values if k in _RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} are reserved (row fields {list(_RESERVED)})")
        row = {"kind": kind, "step": int(step), "time": round(time.time(), 3)}
        row.update((str(k), _plain(v)) for k, v in values.items())

        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        self._write_csv(kind, row)
        if self._tb is not None:
            for k, v in row.items():
                if k not in _RESERVED and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", v, global_step=row["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(
                {
                    f"{kind}/{k}": v
                    for k, v in row.items()
                    if k not in _RESERVED and isinstance(v, (int, float)) and not isinstance(v, bool)
                },
                step=row["step"],
            )
        return row

    def _write_csv(self, kind: str, row: dict) -> None:
        fields = self._csv_fields.get(kind)
        new = [k for k in row if k != "kind" and (fields is None or k not in fields)]
        if fields is None or new:
            path = self.csv_path(kind)
            old_rows: list[dict] = []
            if fields is not None and path.exists():
                if kind in self._csv_files:
                    self._csv_files.pop(kind).close()
                with open(path, encoding="utf-8", newline="") as old:
                    old_rows = list(csv.DictReader(old))
            fields = (fields or ["step", "time"]) + [k for k in new if k not in ("step", "time")]
            atomic_write_text(path, _csv_text(fields, old_rows))
            self._csv_fields[kind] = fields
        f = self._csv_files.get(kind)
        if f is None:
            path = self.csv_path(kind)
            f = self._csv_files[kind] = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 -- kept until close()
        csv.DictWriter(f, fieldnames=fields, restval="", extrasaction="ignore").writerow(
            {k: _csv_cell(v) for k, v in row.items()}
        )
        f.flush()

    def close(self) -> None:
        if self._jsonl is not None and not self._jsonl.closed:
            self._jsonl.close()
        for f in self._csv_files.values():
            f.close()
        self._csv_files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
