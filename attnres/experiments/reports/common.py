"""What the reports share: the ``Report`` page being built, markdown tables and numbers, the
runs of one group, mean curves, depth-weight statistics, and whether two runs share their initialisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from attnres.experiments.results import Collected, Result, finite
from attnres.experiments.stats import Comparisons, Paired


def md_table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(x, digits: int = 4, sign: bool = False) -> str:
    if x is None or not finite(float(x)):
        return "—"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def group_label(labels: dict[str, str], axes: list[str]) -> str:
    return ", ".join(labels[a] for a in axes if a in labels)


_INIT_CACHE: dict[tuple[str, str], bool] = {}


def shares_sublayer_init(a: dict, b: dict) -> bool:
    """Whether two model configs built under one seed start from the same sublayer, embedding and head
    weights (everything outside the residual scheme). Builds both models; nothing is trained."""
    import json

    import torch

    from attnres.model import AttnResLM, ModelConfig

    key = (json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True))
    if key not in _INIT_CACHE:
        states = []
        for cfg in (a, b):
            torch.manual_seed(0)
            states.append(AttnResLM(ModelConfig.from_dict(dict(cfg))).state_dict())
        sa, sb = states
        keys = [k for k in sa if not k.startswith("residual.")]
        _INIT_CACHE[key] = all(k in sb and sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in keys)
    return _INIT_CACHE[key]


def model_of(col: Collected, **labels) -> dict | None:
    for r in col.select(**labels):
        return r.model
    return None


def same_init_as(col: Collected, axis: str, base: str, **within: str) -> Callable[[str], bool]:
    """label -> whether the row ``axis = label`` (among the runs labelled ``within``) starts from the sublayer
    initialisation of the row ``axis = base`` (``shares_sublayer_init``); the base itself, and a row
    without a model, count as sharing it. A report marks the pairs that do not with †."""
    base_model = model_of(col, **{axis: base}, **within)

    def check(label: str) -> bool:
        model = model_of(col, **{axis: label}, **within)
        return label == base or model is None or base_model is None or shares_sublayer_init(model, base_model)

    return check


def planned_model(col: Collected, axis: str, label: str):
    for r in col.results:
        if r.run.labels.get(axis) == label:
            return r.run.model
    return None


def variant_rows(col: Collected) -> tuple[str, list[str]]:
    axis = col.spec.axes[0][0] if col.spec.axes else "run"
    return axis, col.points(axis)


class Report:
    """Accumulates markdown and figure names for one experiment. ``comparisons``: the report's family of
    paired comparisons (``write_report`` builds a page twice, the second time with them Holm-corrected);
    ``draw``: False writes the figure lines without drawing the figures."""

    def __init__(self, col: Collected, out_dir: Path, comparisons: Comparisons | None = None, draw: bool = True):
        self.col = col
        self.out = out_dir
        self.comparisons = comparisons if comparisons is not None else Comparisons()
        self.draw = draw
        self.lines: list[str] = []
        self.figures: list[str] = []
        self.notes: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def figure(self, name: str, caption: str, make: Callable[[str], str]) -> None:
        try:
            if self.draw:
                make(str(self.out / name))
        except Exception as e:  # a figure must never sink the report
            self.add(f"*(figure {name} could not be drawn: {type(e).__name__}: {e})*", "")
            return
        self.figures.append(name)
        self.add(f"![{caption}]({name})", "", f"*{caption}*", "")

    def paired(self, variant: Mapping[int, float | None], base: Mapping[int, float | None]) -> Paired:
        """A paired comparison of this report (``attnres.experiments.stats``), counted in its Holm family."""
        return self.comparisons.paired(variant, base)

    def paired_cell(
        self, variant: Mapping[int, float | None], base: Mapping[int, float | None], init_ok: bool = True
    ) -> str:
        return self.paired(variant, base).describe() + ("" if init_ok else " †")


def mean_curve(results: list[Result], x: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Validation loss against ``x`` (tokens | seconds | step), averaged over seeds at common steps."""
    curves = [r.eval_curve() for r in results if r.done]
    curves = [c for c in curves if len(c["step"])]
    if not curves:
        return None
    common = sorted(set.intersection(*(set(c["step"].tolist()) for c in curves)))
    if not common:
        return None
    xs, ys = [], []
    for s in common:
        xs.append(np.mean([c[x][list(c["step"]).index(s)] for c in curves]))
        ys.append(np.mean([c["val_loss"][list(c["step"]).index(s)] for c in curves]))
    return np.array(xs), np.array(ys)


# the header of the rows depth_weight_stats makes (the dynamics and kimi-linear reports)
DEPTH_WEIGHT_COLUMNS = [
    "scheme",
    "seeds",
    "mean weight on embedding",
    "uniform would give",
    "mean weight on most recent",
    "rows where most recent is largest",
    "width pre-attention",
    "width pre-MLP",
]


def depth_weight_stats(scheme: str, M: np.ndarray, seeds: int) -> list[str]:
    """Embedding weight, locality and width of the mean depth weights (rows reading >= 2 sources).
    Width = entropy of a row divided by log(number of sources): 1 = uniform, 0 = one source; split
    into pre-attention (even sublayers) and pre-MLP (odd) rows."""
    emb, recent, uniform, top = [], [], [], 0
    width: dict[str, list[float]] = {"attn": [], "mlp": []}
    rows = 0
    n_sub = M.shape[0] - 1
    for j, row in enumerate(M):
        idx = np.where(~np.isnan(row))[0]
        if len(idx) < 2:
            continue
        rows += 1
        w = row[idx]
        emb.append(row[0] if not np.isnan(row[0]) else 0.0)
        recent.append(w[-1])
        uniform.append(1.0 / len(idx))
        top += int(np.argmax(w) == len(idx) - 1)
        if j < n_sub and np.all(w >= 0) and w.sum() > 0:
            p = w / w.sum()
            h = -sum(x * math.log(x) for x in p if x > 0) / math.log(len(p))
            width["attn" if j % 2 == 0 else "mlp"].append(h)
    return [
        scheme,
        str(seeds),
        fmt(np.mean(emb), 3),
        fmt(np.mean(uniform), 3),
        fmt(np.mean(recent), 3),
        f"{top}/{rows}",
        fmt(np.mean(width["attn"]) if width["attn"] else float("nan"), 3),
        fmt(np.mean(width["mlp"]) if width["mlp"] else float("nan"), 3),
    ]


def corrected(col: Collected, builder: Callable[[Report], None]) -> Report:
    """The report ``builder`` makes of ``col`` as ``write_report`` builds it on its second pass: its
    comparisons Holm-corrected over everything the report asks, for another page to quote. Nothing is
    drawn or written."""
    first = Report(col, Path("."), draw=False)
    builder(first)
    return Report(col, Path("."), first.comparisons.corrected(), draw=False)
