"""Learning-rate schedules as multipliers of each group's ``initial_lr``.

Conventions: ``step`` is the 0-based index of the optimizer update about to be
taken; a run of ``total_steps`` updates uses steps ``0 .. total_steps - 1``.

* Warmup is linear and never yields a zero learning rate:
  ``mult(step) = (step + 1) / warmup_steps`` for ``step < warmup_steps``, so the
  multiplier reaches 1.0 at ``step = warmup_steps - 1`` and stays 1.0 at
  ``warmup_steps``.
* Decays end exactly at ``total_steps`` (``mult(total_steps) == final_lr_frac``);
  steps past the end stay at ``final_lr_frac``.

Usage::

    mult = make_schedule("wsd", total_steps=10_000, warmup_steps=500)
    for step in range(start, total):
        set_lr(optimizer, mult(step))
        ...
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["SCHEDULE_NAMES", "Schedule", "wsd", "cosine", "constant", "make_schedule", "set_lr"]

SCHEDULE_NAMES = ("wsd", "cosine", "constant")
DECAY_SHAPES = ("linear", "1-sqrt")


def _check_common(total_steps: int, warmup_steps: int, final_lr_frac: float = 0.0) -> None:
    for label, value in (("total_steps", total_steps), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{label} must be a non-negative int, got {value!r}")
    if total_steps == 0:
        raise ValueError("total_steps must be > 0")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps})")
    if not (0.0 <= final_lr_frac <= 1.0):
        raise ValueError(f"final_lr_frac must be in [0, 1], got {final_lr_frac!r}")


def _check_step(step: int) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def _warmup(step: int, warmup_steps: int) -> float | None:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return None


def _wsd_decay_steps(total_steps: int, warmup_steps: int, decay_fraction: float) -> int:
    if not (0.0 <= decay_fraction <= 1.0):
        raise ValueError(f"decay_fraction must be in [0, 1], got {decay_fraction!r}")
    decay_steps = round(decay_fraction * total_steps)
    if warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"warmup ({warmup_steps} steps) and decay ({decay_steps} = {decay_fraction} * {total_steps} steps) "
            f"overlap: together they exceed total_steps ({total_steps}); shorten one of them"
        )
    return decay_steps


def wsd(
    step: int,
    total_steps: int,
    warmup_steps: int,
    decay_fraction: float = 0.2,
    final_lr_frac: float = 0.0,
    decay_shape: str = "linear",
) -> float:
    """Warmup-Stable-Decay: linear warmup, constant 1.0, then decay over the last
    ``decay_fraction`` of ``total_steps`` down to ``final_lr_frac``.

    ``decay_shape="linear"`` decays linearly; ``"1-sqrt"`` uses
    ``1 - sqrt(progress)`` (drops faster at first; often slightly better loss).
    """
    _check_common(total_steps, warmup_steps, final_lr_frac)
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"unknown decay_shape {decay_shape!r}; allowed: {list(DECAY_SHAPES)}")
    decay_steps = _wsd_decay_steps(total_steps, warmup_steps, decay_fraction)
    _check_step(step)
    w = _warmup(step, warmup_steps)
    if w is not None:
        return w
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    shape = 1.0 - progress if decay_shape == "linear" else 1.0 - math.sqrt(progress)
    return final_lr_frac + (1.0 - final_lr_frac) * shape


def cosine(step: int, total_steps: int, warmup_steps: int, final_lr_frac: float = 0.1) -> float:
    """Linear warmup, then half-cosine from 1.0 at ``warmup_steps`` to ``final_lr_frac`` at ``total_steps``."""
    _check_common(total_steps, warmup_steps, final_lr_frac)
    _check_step(step)
    w = _warmup(step, warmup_steps)
    if w is not None:
        return w
    span = total_steps - warmup_steps
    progress = 1.0 if span == 0 else min(1.0, (step - warmup_steps) / span)
    return final_lr_frac + (1.0 - final_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warmup, then 1.0."""
    _check_common(total_steps, warmup_steps)
    _check_step(step)
    w = _warmup(step, warmup_steps)
    return 1.0 if w is None else w


_FUNCS: dict[str, Callable[..., float]] = {"wsd": wsd, "cosine": cosine, "constant": constant}
_OPTIONS = {
    "wsd": ("decay_fraction", "final_lr_frac", "decay_shape"),
    "cosine": ("final_lr_frac",),
    "constant": (),
}


class Schedule:
    """A picklable ``step -> multiplier`` callable with its arguments validated up front."""

    def __init__(self, name: str, total_steps: int, warmup_steps: int, **options: Any):
        if name not in _FUNCS:
            raise ValueError(f"unknown schedule {name!r}; allowed: {list(SCHEDULE_NAMES)}")
        unknown = sorted(set(options) - set(_OPTIONS[name]))
        if unknown:
            raise ValueError(f"schedule {name!r} got unknown options {unknown}; it accepts {list(_OPTIONS[name])}")
        self.name = name
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.options = options
        self(0)  # validate now rather than at the first training step

    def __call__(self, step: int) -> float:
        return _FUNCS[self.name](step, self.total_steps, self.warmup_steps, **self.options)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"Schedule({self.name!r}, total_steps={self.total_steps}, warmup_steps={self.warmup_steps}{opts})"


def make_schedule(name: str, *, total_steps: int, warmup_steps: int, **options: Any) -> Schedule:
    """Return ``mult(step)`` for schedule ``name`` (``"wsd"``, ``"cosine"`` or ``"constant"``).

    ``options`` are the schedule's keyword arguments (e.g. ``decay_fraction``,
    ``final_lr_frac``, ``decay_shape`` for wsd). All values are checked here.
    """
    return Schedule(name, total_steps, warmup_steps, **options)


def set_lr(optimizer: Any, mult: float) -> float:
    """Set ``group["lr"] = group["initial_lr"] * mult`` for every param group.

    Groups without ``initial_lr`` get it from their current ``lr`` first (as
    torch's LR schedulers do). Returns the first group's new lr, for logging.
    """
    if not (mult >= 0 and math.isfinite(mult)):
        raise ValueError(f"LR multiplier must be a finite number >= 0, got {mult!r}")
    first = None
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * mult
        if first is None:
            first = group["lr"]
    return 0.0 if first is None else first
