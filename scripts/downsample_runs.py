#!/usr/bin/env python3
"""Thin the committed experiment runs (``experiments/runs/NAME/<hash>/``) to what the reports need.

A finished run's ``metrics.jsonl`` holds one row per optimizer step (250-550 rows, up to 250 KB with
the MoE routers' loads), and its ``probes.json`` is indented JSON: over about 200 committed runs,
22 MB of the repository's 27 MB. Per finished run (one with a ``summary.json``) this script keeps:

* in ``metrics.jsonl``, the original lines byte for byte and in their order: every row that is not a
  ``train`` row (the ``eval`` rows: every validation loss the reports use), and of the ``train`` rows
  the first, the last (the MoE balance at the last step, kimi-linear report), one per each of
  ``--train-rows`` evenly spaced steps, and the middle one or two in the order by ``step_seconds``.
  The evenly spaced rows are chosen within half a spacing of their step so that as many lie below that
  middle as above it: the kept rows' median step time is then the full log's, float for float (the
  kimi-linear report's "step s (median)" is ``np.median`` over the rows it reads; see ``kept_steps``).
  A first row of kind ``downsampled`` records the rule, how many ``train`` rows there were and what
  the reports compute from all of them: ``step_seconds_median`` and ``train_seconds_at_eval``
  (``[step, seconds]`` per ``eval`` row: the optimizer-step seconds summed up to that step, as
  ``Result.eval_curve`` interpolates them for the arena figure's time axis; the kept rows no longer
  add up to it). ``train_seconds`` in ``summary.json`` (the sum) is untouched;
* in ``probes.json`` and ``metrics.jsonl``, every float at float32 precision, written as the shortest
  decimal that reads back as the same float32 (``0.7618867`` for ``0.761886715888977``): the probes and
  the losses come from float32 tensors, so most values are float32 numbers already and lose nothing;
  the others (means taken in float64, timings, the learning rate) round to the same float32 as before,
  moving by less than 1.2e-7 of their size, far below the digits a report prints: every REPORT.md
  regenerates byte for byte. ``probes.json`` on one line (``sort_keys``), each
  ``metrics.jsonl`` row on its line in its key order, both without spaces;
* ``run.json``, ``config.json`` and ``summary.json`` without indentation or spaces, values unchanged
  (``run.json``'s ``hashed_config`` is compared with the planned configs, float for float).

A run without ``summary.json`` (unfinished or diverged) is left alone: it may still resume.

Idempotent: a ``metrics.jsonl`` that already has its ``downsampled`` row is not thinned again, and
every file compacts to itself. ``--check`` writes nothing and exits 1 when a file would change.

    python scripts/downsample_runs.py                      # experiments/runs
    python scripts/downsample_runs.py --check
    python scripts/downsample_runs.py path/to/runs --train-rows 24
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

METRICS_FILE, PROBES_FILE, SUMMARY_FILE = "metrics.jsonl", "probes.json", "summary.json"
RUN_FILE, CONFIG_FILE = "run.json", "config.json"
KIND = "downsampled"
TRAIN_ROWS = 16  # evenly spaced training rows kept per run, first and last included
RULE = (
    "every non-train row; train rows: the first, the last, the nearest to each of train_rows_max "
    "evenly spaced steps, and the rows that keep the median step_seconds"
)


def _aggregates(train: list[dict], evals: list[dict]) -> dict:
    """What the reports compute from every training row, computed as they compute it."""
    train = sorted(train, key=lambda r: r["step"])
    steps = np.array([r["step"] for r in train], dtype=float)
    cum = np.cumsum([float(r.get("step_seconds", 0.0)) for r in train])
    est = np.array(sorted(r["step"] for r in evals), dtype=float)
    secs = np.interp(est, steps, cum) if len(steps) else np.full(len(est), np.nan)
    timed = [float(r["step_seconds"]) for r in train if "step_seconds" in r]
    return {
        "step_seconds_median": float(np.median(timed)) if timed else None,
        "train_seconds_at_eval": [[int(s), float(x)] for s, x in zip(est, secs, strict=True)],
    }


def _nearest(target: float, pool: list[int]) -> int | None:
    return min(pool, key=lambda s: (abs(s - target), s)) if pool else None


def kept_steps(train: list[dict], n: int) -> set:
    """The steps of the ``train`` rows to keep: the first, the last, one per evenly spaced target step
    in between (the nearest, ties: the lower), and the middle of the order by ``step_seconds`` (one row
    for an odd count, two for an even one) so that the kept rows' ``np.median`` of ``step_seconds`` is
    the full log's, float for float. That needs as many kept rows below the middle as above it: where
    they differ, targets on the long side take the nearest row on the short side within half a spacing
    (cheapest moves first), and what is left over (an odd difference) is made up by the rows next to
    the middle in that order."""
    steps = sorted({r["step"] for r in train})
    if len(steps) <= n:
        return set(steps)
    timed = sorted((float(r["step_seconds"]), r["step"]) for r in train if "step_seconds" in r)
    side: dict[int, int] = {}  # -1 below the middle, +1 above it; middle rows and untimed rows: 0
    middle: set = set()
    lo = hi = 0
    if timed:
        lo, hi = (len(timed) - 1) // 2, len(timed) // 2
        side = {step: (-1 if i < lo else 1 if i > hi else 0) for i, (_, step) in enumerate(timed)}
        middle = {timed[lo][1], timed[hi][1]}
    targets = np.linspace(steps[0], steps[-1], n)
    half = (steps[-1] - steps[0]) / (n - 1) / 2
    window = [[s for s in steps if abs(s - t) <= half] for t in targets]
    picks = (
        [steps[0]]
        + [_nearest(t, w if w else steps) for t, w in zip(targets[1:-1], window[1:-1], strict=True)]
        + [steps[-1]]
    )
    keep = set(picks) | middle
    excess = sum(side.get(s, 0) for s in keep)  # kept rows above the middle minus those below
    if excess:
        short = -1 if excess > 0 else 1
        moves = []
        for j in range(1, n - 1):
            if side.get(picks[j], 0) == -short and picks[j] not in middle:
                alt = _nearest(targets[j], [s for s in window[j] if side.get(s, 0) == short and s not in keep])
                if alt is not None:
                    moves.append((abs(alt - targets[j]) - abs(picks[j] - targets[j]), j, alt))
        for _, j, alt in sorted(moves)[: abs(excess) // 2]:
            keep.discard(picks[j])
            keep.add(alt)
        excess = sum(side.get(s, 0) for s in keep)
        order = [step for _, step in timed]
        nearby = order[lo - 1 :: -1] if excess > 0 else order[hi + 1 :]
        keep |= set([s for s in nearby if s not in keep][: abs(excess)])
    return keep


def thin_metrics(text: str, n: int) -> str:
    """The thinned file; a file that already has its ``downsampled`` row is returned as it is."""
    lines = [line for line in text.splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines]
    if any(r.get("kind") == KIND for r in rows):
        return "".join(line + "\n" for line in lines)
    train = [r for r in rows if r.get("kind", "train") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    keep = kept_steps(train, n)
    head = {
        "kind": KIND,
        "rule": RULE,
        "train_rows_max": n,
        "train_rows": len(train),
        "train_rows_kept": sum(1 for r in train if r["step"] in keep),
        **_aggregates(train, evals),
    }
    out = [line for line, r in zip(lines, rows, strict=True) if r.get("kind", "train") != "train" or r["step"] in keep]
    return "".join(line + "\n" for line in [json.dumps(head)] + out)


FLOAT32 = np.finfo(np.float32)


def float32_value(x: float) -> float:
    """``x`` rounded to float32, as the float that the shortest decimal of that float32 reads back as
    (``repr`` writes it with at most 9 significant digits). A float32 number is only rewritten to its
    short decimal; zero, NaN, infinities and magnitudes outside float32's normal range stay as they are."""
    if x == 0.0 or not math.isfinite(x) or not float(FLOAT32.tiny) <= abs(x) <= float(FLOAT32.max):
        return x
    return float(str(np.float32(x)))


def float32_values(value):
    """``value`` (parsed JSON) with every float through ``float32_value``; key order kept."""
    if isinstance(value, float):
        return float32_value(value)
    if isinstance(value, list):
        return [float32_values(v) for v in value]
    if isinstance(value, dict):
        return {k: float32_values(v) for k, v in value.items()}
    return value


def compact_json(text: str) -> str:
    """One line, sorted keys, no spaces; values unchanged."""
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), allow_nan=True) + "\n"


def compact_probes(text: str) -> str:
    """``compact_json`` with every float at float32 precision."""
    return compact_json(json.dumps(float32_values(json.loads(text)), allow_nan=True))


def compact_metrics(text: str) -> str:
    """Every row on its own line in its key order, floats at float32 precision, no spaces."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return "".join(json.dumps(float32_values(r), separators=(",", ":"), allow_nan=True) + "\n" for r in rows)


def plan(runs_root: Path, n: int) -> list[tuple[Path, str, str]]:
    """(path, old text, new text) of every file this rule changes."""
    changes = []
    for summary in sorted(runs_root.glob(f"*/*/{SUMMARY_FILE}")):
        run = summary.parent
        rules = (
            (METRICS_FILE, lambda t: compact_metrics(thin_metrics(t, n))),
            (PROBES_FILE, compact_probes),
            (RUN_FILE, compact_json),
            (CONFIG_FILE, compact_json),
            (SUMMARY_FILE, compact_json),
        )
        for name, fn in rules:
            path = run / name
            if not path.is_file():
                continue
            old = path.read_text()
            new = fn(old)
            if new != old:
                changes.append((path, old, new))
    return changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="?", default="experiments/runs", help="runs root (default experiments/runs)")
    p.add_argument(
        "--train-rows",
        type=int,
        default=TRAIN_ROWS,
        help=f"evenly spaced training rows kept per run (default {TRAIN_ROWS}; a file thinned "
        "before keeps its own number)",
    )
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    args = p.parse_args(argv)
    root = Path(args.runs)
    if args.train_rows < 2:
        p.error("--train-rows must be at least 2 (the first and the last row)")
    if not root.is_dir():
        p.error(f"{root} is not a directory")
    changes = plan(root, args.train_rows)
    before = sum(len(o.encode()) for _, o, _ in changes)
    after = sum(len(n.encode()) for _, _, n in changes)
    for path, _, _ in changes:
        print(("would thin " if args.check else "thinned ") + str(path))
    if args.check:
        print(f"{len(changes)} files to thin ({before:,} -> {after:,} bytes)")
        return 1 if changes else 0
    for path, _, new in changes:
        tmp = path.with_name("." + path.name + ".tmp")  # git-ignored while it exists
        tmp.write_text(new)
        tmp.replace(path)
    print(f"{len(changes)} files thinned ({before:,} -> {after:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
