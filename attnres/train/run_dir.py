"""Claiming a run directory for one trainer: one writer at a time, and no run overwritten by accident.

A trainer holds an exclusive lock on ``<out>/.lock`` (``attnres.files.ExclusiveLock``: an
``flock`` the kernel drops when the process dies) from start-up to the end of training, so a
second trainer on the same directory is refused with one line instead of racing the first for
its checkpoint and metrics. A directory that already holds a run (a checkpoint, metrics or a
summary) is continued only with ``resume``, replaced only with ``force``, and otherwise refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from attnres.checkpoint import find_checkpoint
from attnres.files import (
    CHECKPOINT_DIR,
    LOCK_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    ExclusiveLock,
)

__all__ = ["RunDirectoryError", "claim_run_directory", "run_contents"]


class RunDirectoryError(ValueError):
    """The run directory cannot be used as asked: busy, not writable, or holding another run."""


def run_contents(out_dir) -> list[str]:
    """What of a run ``out_dir`` holds: its checkpoint (also a crash-window backup), metrics, summary."""
    out = Path(out_dir)
    found = []
    if find_checkpoint(out) is not None:
        found.append(f"{CHECKPOINT_DIR}/")
    found += [name for name in (METRICS_FILE, SUMMARY_FILE) if (out / name).is_file()]
    return found


def _clear_run(out: Path) -> None:
    """Delete the run in ``out`` (``force``): its checkpoint, the traces of interrupted saves, the
    summary and the metrics' source of truth (the trainer's metrics logger rebuilds the rest)."""
    for p in [out / CHECKPOINT_DIR, *out.glob(f".{CHECKPOINT_DIR}.*")]:
        if p.is_dir():
            shutil.rmtree(p)
    for name in (SUMMARY_FILE, METRICS_FILE):
        (out / name).unlink(missing_ok=True)


def claim_run_directory(out_dir, *, resume: bool, force: bool) -> ExclusiveLock:
    """Create ``out_dir``, take its lock and check it may be written as asked; returns the held lock
    (release it when training ends). ``resume``: the directory must hold a run to continue.
    ``force``: delete the run it holds first. Raises :class:`RunDirectoryError`."""
    out = Path(out_dir)
    if resume and force:
        raise RunDirectoryError("--resume continues the run in --out and --force deletes it: pass one of them")
    if out.exists() and not out.is_dir():
        raise RunDirectoryError(
            f"TrainConfig.out_dir={str(out)!r} is a file, not a run directory; pass --out with a directory path"
        )
    lock = ExclusiveLock(out / LOCK_FILE)
    try:
        out.mkdir(parents=True, exist_ok=True)
        busy = lock.acquire()
    except OSError as e:
        raise RunDirectoryError(
            f"TrainConfig.out_dir={str(out)!r} cannot be written ({e.strerror or e}); "
            "pass --out with a directory you can write to"
        ) from None
    if busy:
        raise RunDirectoryError(
            f"{out} is in use by another trainer ({busy}); wait for it to finish, or pass a different --out"
        )
    try:
        existing = run_contents(out)
        if existing and not resume:
            if not force:
                raise RunDirectoryError(
                    f"{out} already holds a run ({', '.join(existing)}); continue it with --resume, start "
                    "over with --force (deletes it), or pass a new --out"
                )
            _clear_run(out)
    except BaseException:
        lock.release()
        raise
    return lock
