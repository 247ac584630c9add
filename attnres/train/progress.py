"""What a command shows while it works: a tqdm bar on a terminal, plain log lines elsewhere.

A bar redraws one line with carriage returns, which is right on a terminal and spam in a log file
or a pipe. :class:`StepProgress` (training) therefore writes a bar when its stream is a terminal and
otherwise one plain line every few steps (``step 120/600  loss 4.2100  val 4.6500  4,980 tok/s``,
the nanoGPT habit). :func:`progress_bar` (evaluation, benchmarks: loops whose result is printed at
the end) shows a bar on a terminal and stays quiet elsewhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

LINES_PER_RUN = 20  # plain lines a run writes when not on a terminal (plus one per evaluation)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    stream: TextIO | None = None,
    log_lines: int = 0,
):
    """A tqdm bar over ``iterable`` on ``stream`` (default stderr) when it is a terminal; a bar that
    draws nothing otherwise (same interface: ``update``, ``set_postfix``, ``close``, iteration), or,
    with ``log_lines`` and a known ``total``, one that writes about that many plain lines
    (``eval: 40/200 batch``): a long evaluation in a log is not silent."""
    from tqdm.auto import tqdm

    stream = stream if stream is not None else sys.stderr
    if log_lines and total and iterable is None and not _is_terminal(stream):
        return _LineProgress(total, desc, unit, stream, max(1, -(-total // log_lines)))
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=stream,
        dynamic_ncols=True,
        leave=False,
        disable=not _is_terminal(stream),
    )


class _LineProgress:
    """A progress bar for a log: a line at the start, every ``every`` updates and at the end."""

    def __init__(self, total: int, desc: str, unit: str, stream: TextIO, every: int):
        self.total, self.desc, self.unit, self.stream, self.every, self.n = total, desc, unit, stream, every, 0
        self._write()

    def _write(self) -> None:
        self.stream.write(f"{self.desc}: {self.n}/{self.total} {self.unit}\n")
        self.stream.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            self._write()

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class StepProgress:
    """Per-step feedback of a training run named ``name`` from step ``initial`` to ``total``."""

    def __init__(self, total: int, initial: int, name: str, *, stream: TextIO | None = None, every: int | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.total = total
        self.every = every or max(1, total // LINES_PER_RUN)
        self.bar = None
        if _is_terminal(self.stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=name, unit="step", file=self.stream, dynamic_ncols=True, leave=True
            )

    def update(
        self, step: int, loss: float, tokens_per_second: float, val_loss: float | None = None, evaluated: bool = False
    ) -> None:
        """After ``step``: its loss and throughput, and the latest validation loss (``evaluated``: it is
        this step's)."""
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_second:,.0f}"}
            if val_loss is not None:
                post["val"] = f"{val_loss:.3f}"
            self.bar.set_postfix(post)
        elif step % self.every == 0 or evaluated or step == self.total:
            # the validation loss on the lines of the steps that computed it, not repeated after
            val = f"  val {val_loss:.4f}" if val_loss is not None and evaluated else ""
            self.stream.write(f"step {step}/{self.total}  loss {loss:.4f}{val}  {tokens_per_second:,.0f} tok/s\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
