"""The retrofit report (``experiments/retrofit.toml``): a PreNorm model retrofitted to Block / Full
AttnRes at ``retrofit_step`` S and trained N more steps, against the PreNorm model continued the same way.

Each run trains the same PreNorm model for S steps (same seed, same data order: identical to the bit), then
switches (``TrainConfig.retrofit_step``): the arm's residual with zero queries and eps scaled (the same
function: the largest logit change at the switch is logged as a ``retrofit`` metrics row), a fresh
optimizer, the same schedule. The PreNorm arm switches to PreNorm (only the optimizer is fresh), so every
arm sees the same N steps and tokens after S.
"""

from __future__ import annotations

import math

import numpy as np

from attnres.experiments.reports.common import Report, fmt, md_table
from attnres.experiments.results import Result
from attnres.experiments.stats import fmt_mean_std, fmt_p


def _rows(r: Result, kind: str) -> list[dict]:
    return sorted(r.metrics().get(kind, []), key=lambda row: row["step"])


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(values)) if values else float("nan")


def _at(results: list[Result], step: int, key: str) -> float:
    return _mean([next((row.get(key) for row in _rows(r, "eval") if row["step"] == step), None) for r in results])


def _val_at(r: Result, step: int) -> float | None:
    return next((float(row["val_loss"]) for row in _rows(r, "eval") if row["step"] == step), None)


def retrofit_verdict(rep: Report) -> str:
    """One line: each retrofitted arm's final loss against the continued PreNorm model."""
    col = rep.col
    base = col.spec.baseline or "prenorm"
    parts = []
    for arm in col.points("arm"):
        if arm == base:
            continue
        p = rep.paired(col.losses(arm=arm), col.losses(arm=base))
        if p.n == 0:
            continue
        word = {"better": "lower loss than", "worse": "higher loss than"}.get(p.verdict, "not distinguishable from")
        parts.append(
            f"{arm} {p.mean:+.4f} nats, 95 % interval {p.interval()} ({word} {base} continued, "
            f"{p.lower}/{p.n} seeds lower, {fmt_p(p.p_holm, 'p_holm')})"
        )
    return "Verdict: retrofit-by-fine-tuning ends " + "; ".join(parts) + "." if parts else "Verdict: no runs yet."


def retrofit_report(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    arms = col.points("arm")
    done = {arm: [r for r in col.select(arm=arm) if r.done] for arm in arms}
    planned = col.results[0].run
    m, t = planned.model, planned.train
    S, N = t.retrofit_step, t.steps - t.retrofit_step
    switches = [row for rs in done.values() for r in rs for row in _rows(r, "retrofit")]
    change = max((row["max_logit_change"] for row in switches), default=float("nan"))
    rep.add(
        "## Setup",
        "",
        f"Model: {m.n_layers} Transformer blocks ({m.n_sublayers} sublayers), d_model={m.d_model}, {m.n_heads} heads; "
        f"{t.batch_size} x {t.seq_len} tokens a step, {t.optimizer}, {t.schedule} schedule over {t.steps} steps, "
        f"lr {t.lr}. Every run trains PreNorm for S = {S} steps, then the arm's residual for N = {N} steps "
        f"({N * t.batch_size * t.seq_len:,} tokens) with a fresh optimizer. The switch keeps the function: the "
        f"largest logit change at the switch over {len(switches)} retrofitted runs is {change:.2g} (float32 rounding).",
        "",
    )
    rows = []
    for arm in arms:
        losses = col.losses(arm=arm)
        at_switch = [_val_at(r, S) for r in done[arm]]
        final = [r.eval_curve() for r in done[arm]]
        last = max((int(c["step"][-1]) for c in final if len(c["step"])), default=t.steps)
        cell = "—" if arm == base else rep.paired_cell(losses, col.losses(arm=base))
        rows.append(
            [
                arm,
                str(len(done[arm])),
                fmt_mean_std(at_switch),
                fmt_mean_std(list(losses.values())),
                cell,
                fmt(_at(done[arm], last, "query_norm"), 3),
                fmt(_at(done[arm], last, "routing_entropy"), 3),
            ]
        )
    rep.add(
        "## Results",
        "",
        md_table(
            [
                "arm",
                "seeds",
                f"val loss at S = {S}",
                f"val loss at {t.steps}",
                f"Δ vs {base} continued (paired)",
                "query norm (end)",
                "routing entropy / log K (end)",
            ],
            rows,
        ),
        "",
        "Δ: mean over seeds of (arm − continued PreNorm), its 95 % interval and verdict as the Statistics "
        "section says. Query norm: the mean L2 norm of the "
        "pseudo-queries (0 at the switch). Routing entropy: the depth weights' entropy over log K_l, averaged "
        "over consumers, on the first validation batch (1 = uniform, as at the switch).",
        "",
    )
    steps = sorted(
        {int(row["step"]) for rs in done.values() for r in rs for row in _rows(r, "eval") if row["step"] >= S}
    )
    retro = [a for a in arms if a != base]
    headers = ["step"] + [f"{a} loss" for a in arms] + [f"{a} {k}" for a in retro for k in ("query norm", "entropy")]
    table = []
    for s in steps:
        row = [str(s)] + [fmt(_at(done[a], s, "val_loss")) for a in arms]
        for a in retro:
            q = 0.0 if s == S else _at(done[a], s, "query_norm")
            e = 1.0 if s == S else _at(done[a], s, "routing_entropy")
            row += [fmt(q, 3), fmt(e, 3)]
        table.append(row)
    rep.add("## Over time (means over seeds)", "", md_table(headers, table), "")
    rep.add("## Verdict", "", retrofit_verdict(rep), "")
