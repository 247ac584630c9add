"""Finding checkpoints: the one to resume from in a run directory (``latest_checkpoint``), and the
checkpoint of a run or checkpoint directory (``find_checkpoint``).
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

from attnres.checkpoint.format import (
    OLD_TAG,
    STATE_FILE,
    CheckpointError,
    read_checkpoint_state,
    resolve,
)
from attnres.files import CHECKPOINT_DIR


def _looks_whole(path: Path) -> dict | None:
    """Parsed state.json if every listed file exists with its recorded size, else None."""
    try:
        state = read_checkpoint_state(path)
        for name, info in state["files"].items():
            if (path / name).stat().st_size != info["bytes"]:
                return None
        return state
    except (CheckpointError, OSError, KeyError, TypeError):
        return None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: the one with the highest step.

    Looks at ``run_dir`` itself and its immediate subdirectories, plus those of
    ``run_dir/checkpoints``. Hidden temp/backup directories of interrupted saves
    are never returned (a backup is reported under its checkpoint's own name,
    which :func:`load_checkpoint` resolves). Checkpoints whose files are missing
    or have the wrong size are skipped with a warning (hashes are checked by
    :func:`load_checkpoint`). Ties on step go to the newest. Returns None when
    there is none.
    """
    run_dir = Path(run_dir)
    roots = [run_dir, run_dir / "checkpoints"]
    candidates: set[Path] = set()
    if (run_dir / STATE_FILE).is_file():
        candidates.add(run_dir)
    for root in roots:
        if not root.is_dir():
            continue
        for child in root.iterdir():
            if not child.is_dir():
                continue
            if child.name.startswith("."):
                if OLD_TAG in child.name:
                    logical = root / child.name[1:].rsplit(OLD_TAG, 1)[0]
                    if not logical.exists():
                        candidates.add(logical)
                continue
            if (child / STATE_FILE).exists():
                candidates.add(child)
    best: tuple | None = None
    for cand in candidates:
        real = resolve(cand)
        state = _looks_whole(real)
        if state is None:
            warnings.warn(f"skipping incomplete or unreadable checkpoint {real}", stacklevel=2)
            continue
        step = state.get("step", -1)
        finite_step = step if isinstance(step, (int, float)) and math.isfinite(step) else -1
        key = (finite_step, (real / STATE_FILE).stat().st_mtime)
        if best is None or key > best[0]:
            best = (key, cand)
    return None if best is None else best[1]


def find_checkpoint(run_or_checkpoint: str | os.PathLike) -> Path | None:
    """The checkpoint of a run directory (``<run>/checkpoint``) or the checkpoint directory itself,
    also when a crash between the two renames of a save left only its backup
    (``.checkpoint.old-*``, which :func:`load_checkpoint` reads under the checkpoint's own name).
    None when there is none."""
    path = Path(run_or_checkpoint)
    for candidate in (path / CHECKPOINT_DIR, path):
        if (resolve(candidate) / STATE_FILE).is_file():
            return candidate
    return None
