"""The additive report (``experiments/additive.toml``): additive routing (Delta Attention Residuals: a read is
the PreNorm stream plus g_l times the depth mixture) against PreNorm and the replacement routing of its family,
with each run's learned gain, on every backbone.

Per backbone, one row per scheme: the final loss, its paired Δ against the baseline and, for an additive arm,
against the replacement arm of its family (the scheme whose model config differs from it only in the routing
and gain fields), all in the report's one Holm family; for an additive arm, its gain at the end of training
(RMS over channels and reads, mean and min-max over seeds, and its shift from the initial value) and whether
its runs test additive routing at all (``TEST_RULE``). A figure draws each learned gain's RMS against the
training step (the trainer logs ``gain_rms`` on its metric rows).

The rule exists because an additive read with a gain near zero is PreNorm's read: a run whose gain never left
zero compares PreNorm with itself and says nothing about additive routing (the routing experiment's additive
cells were such runs). A row whose runs do not all count keeps its Δ, marked as not a test.
"""

from __future__ import annotations

import numpy as np

from attnres.experiments import figures
from attnres.experiments.reports.common import (
    Report,
    md_table,
    mean_curve,
    planned_model,
)
from attnres.experiments.reports.kimi_linear import BACKBONE_NAMES
from attnres.experiments.results import Collected, Result, finite
from attnres.experiments.stats import fmt_mean_std, fmt_p

MIN_GAIN_RMS = 0.1  # a tenth of Delta AttnRes' unit gain
TEST_RULE = (
    f"a run tests additive routing when the mixture enters its reads at no less than a tenth of Delta "
    f"AttnRes' unit strength: its learned gain's final RMS (over channels and reads, `probes.json` "
    f'`routing_gain.gain_rms`) is ≥ {MIN_GAIN_RMS:g}; a run with the fixed unit gain (`attnres_gain = "unit"`, '
    f"Delta AttnRes as published, no gain parameter) counts by construction, a learned-gain run without a "
    f"logged gain does not count. The rule reads the gain's size, not its movement: a gain started at 1 that "
    f"stays near 1 is the published form and counts; one started at 0 counts only if it grew"
)
NOT_A_TEST = "not a test of additive routing"
# the model fields that make a read additive and set its gain; a replacement partner differs only in these
ROUTING_FIELDS = ("attnres_routing", "attnres_gain", "attnres_gain_init", "attnres_gain_lr")


def _model(col: Collected, scheme: str) -> dict:
    m = planned_model(col, "scheme", scheme)
    return m.to_dict() if m is not None else {}


def is_additive(col: Collected, scheme: str) -> bool:
    return _model(col, scheme).get("attnres_routing") == "additive"


def has_unit_gain(col: Collected, scheme: str) -> bool:
    return _model(col, scheme).get("attnres_gain") == "unit"


def replacement_partner(col: Collected, scheme: str) -> str | None:
    """The replacement arm of an additive scheme's family: the scheme whose model config is the same but for
    the routing and gain fields, with replacement routing; None where the spec has none."""
    model = _model(col, scheme)
    strip = lambda m: {k: v for k, v in m.items() if k not in ROUTING_FIELDS}  # noqa: E731
    for s in col.points("scheme"):
        other = _model(col, s)
        if s != scheme and other.get("attnres_routing") == "replacement" and strip(other) == strip(model):
            return s
    return None


def final_gain(r: Result) -> dict | None:
    """The run's ``routing_gain`` probe (gain_rms, gain_shift_rms, gain_init, per_read_rms), or None."""
    g = r.probes.get("routing_gain") if r.probes else None
    return g if isinstance(g, dict) and finite(float(g.get("gain_rms", float("nan")))) else None


def run_counts(col: Collected, scheme: str, r: Result) -> bool:
    """Whether a finished run of an additive ``scheme`` tests additive routing (``TEST_RULE``)."""
    if has_unit_gain(col, scheme):
        return True
    g = final_gain(r)
    return g is not None and float(g["gain_rms"]) >= MIN_GAIN_RMS


def _spread(values: list[float], digits: int = 3) -> str:
    if not values:
        return "—"
    return f"{np.mean(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def gain_curve(results: list[Result]) -> tuple[np.ndarray, np.ndarray] | None:
    """The learned gain's RMS against the step from the runs' metric rows, averaged over seeds. A compacted
    metrics.jsonl keeps different train rows in different runs, so each run's curve is interpolated
    (linearly) at every step any of them logged, within the steps both ends of every run cover."""
    curves = []
    for r in results:
        rows = [row for row in r.metrics().get("train", []) if finite(float(row.get("gain_rms", float("nan"))))]
        if rows:
            rows.sort(key=lambda row: row["step"])
            curves.append(
                (np.array([row["step"] for row in rows], float), np.array([row["gain_rms"] for row in rows], float))
            )
    if not curves:
        return None
    lo, hi = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
    steps = np.array(sorted({s for x, _ in curves for s in x.tolist() if lo <= s <= hi}), dtype=float)
    if not len(steps):
        return None
    return steps, np.mean([np.interp(steps, x, y) for x, y in curves], axis=0)


def additive_report(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    schemes = col.points("scheme")
    rates = sorted({r.run.train.lr for r in col.results})
    rep.add(
        "## Which runs test additive routing",
        "",
        f"Rule: {TEST_RULE}. A row whose finished runs do not all count says how many do, and its Δ are "
        f"marked *{NOT_A_TEST}*: they compare a read that is (nearly) PreNorm's.",
        "",
        f"Every run trains at learning rate {', '.join(f'{x:g}' for x in rates)}. The Δ vs replacement pairs an "
        "additive arm with the replacement arm of its family (the same scheme with replacement routing and no "
        "gain). Every Δ of the tables below, against the baseline and against replacement, is one comparison "
        "of the report's Holm family.",
        "",
    )
    curves: list[tuple[str, str, dict[str, tuple[np.ndarray, np.ndarray]]]] = []
    loss_curves: list[tuple[str, str, dict[str, tuple[np.ndarray, np.ndarray]]]] = []
    verdicts = []
    for bb in col.points("backbone"):
        name = BACKBONE_NAMES.get(bb, bb)
        ref = col.losses(backbone=bb, scheme=base)
        rows, lines, losses_by_scheme = [], {}, {}
        weaker: list[str] = []  # replacement arms worse than the baseline at this rate
        for s in schemes:
            done = [r for r in col.select(backbone=bb, scheme=s) if r.done]
            losses = col.losses(backbone=bb, scheme=s)
            additive = is_additive(col, s)
            partner = replacement_partner(col, s) if additive else None
            counted = sum(run_counts(col, s, r) for r in done) if additive else 0
            mark = f" — *{NOT_A_TEST}*" if additive and done and counted < len(done) else ""
            vs_base = "—" if s == base or not losses else rep.paired_cell(losses, ref) + mark
            vs_partner = (
                rep.paired_cell(losses, col.losses(backbone=bb, scheme=partner)) + mark
                if partner is not None and losses
                else "—"
            )
            loss_curve = mean_curve(done, "tokens")
            if loss_curve is not None:
                losses_by_scheme[s] = loss_curve
            gains = [g for r in done if (g := final_gain(r)) is not None]
            if not additive:
                gain_rms = shift = tests = "—"
            elif has_unit_gain(col, s):
                gain_rms, shift = "1 (fixed)", "—"
                tests = f"yes: {len(done)}/{len(done)} (unit gain)" if done else "—"
            else:
                gain_rms = _spread([float(g["gain_rms"]) for g in gains])
                shift = _spread([float(g["gain_shift_rms"]) for g in gains])
                if not done:
                    tests = "—"
                elif counted == len(done):
                    tests = f"yes: {counted}/{len(done)}"
                else:
                    tests = f"**no**: {counted}/{len(done)}" + (
                        f" (gain not logged in {len(done) - len(gains)})" if len(gains) < len(done) else ""
                    )
                c = gain_curve(done)
                if c is not None:
                    lines[s] = c
            rows.append(
                [
                    s,
                    _model(col, s).get("attnres_routing", "—") if s != base else "—",
                    str(len(done)),
                    fmt_mean_std(list(losses.values())),
                    vs_base,
                    vs_partner,
                    gain_rms,
                    shift,
                    tests,
                ]
            )
            if additive and done and counted == len(done) and ref and losses:
                p = rep.paired(losses, ref)
                claim = f"{s}: vs {base} {p.mean:+.4f} {p.interval(4)}, {p.verdict_text()}"
                if partner is not None and col.losses(backbone=bb, scheme=partner):
                    q = rep.paired(losses, col.losses(backbone=bb, scheme=partner))
                    claim += f"; vs {partner} {q.mean:+.4f} {q.interval(4)}, {q.verdict_text()}"
                verdicts.append((name, claim))
            elif not additive and s != base and losses and ref:
                p = rep.paired(losses, ref)
                if p.verdict == "worse":
                    weaker.append(f"{s} ({p.mean:+.4f} {p.interval(4)}, {fmt_p(p.p_holm, 'p_holm')})")
        if not any(r.done for r in col.select(backbone=bb)):
            rep.add(f"## {name}", "", "No run has finished on this backbone yet.", "")
            continue
        rep.add(
            f"## {name}",
            "",
            md_table(
                [
                    "scheme",
                    "routing",
                    "seeds",
                    "val loss",
                    f"Δ vs {base} (paired)",
                    "Δ vs the replacement arm of its family (paired)",
                    "final gain RMS, mean [min–max]",
                    "shift from init, mean [min–max]",
                    "tests additive routing (runs)",
                ],
                rows,
                "llrrllrrl",
            ),
            "",
        )
        if weaker:
            rep.add(
                f"At this learning rate the replacement arm{'s' if len(weaker) > 1 else ''} "
                f"{', '.join(weaker)} {'are' if len(weaker) > 1 else 'is'} worse than {base}: an additive arm's Δ "
                "against it carries that deficit, so read it beside the Δ against the baseline (an arm that is "
                f"not a test of additive routing, a read that is nearly {base}'s, shows the deficit alone).",
                "",
            )
        if lines:
            curves.append((name, "training step", lines))
        if losses_by_scheme:
            loss_curves.append((name, "tokens", losses_by_scheme))
    rep.add(
        "## Verdict",
        "",
        f"The report's Holm family: m = {len(rep.comparisons.tests)} paired comparisons. The additive arms whose "
        "runs all test additive routing (Δ, 95 % interval, Holm-corrected verdict):",
        "",
    )
    rep.add(*([f"- {n}: {c}" for n, c in verdicts] or ["- none yet"]), "")
    if curves:
        rep.figure(
            "gain_rms.png",
            "The learned additive gain's RMS (over channels and reads) against the training step, mean over "
            f"seeds per arm (log scale; the rule's threshold is {MIN_GAIN_RMS:g}, Delta AttnRes' fixed gain is 1).",
            lambda p: figures.curves_plot(curves, p, col.spec.name, ylabel="gain RMS", logy=True),
        )
    if loss_curves:
        rep.figure(
            "loss_curves.png",
            "Validation loss against training tokens (mean over seeds).",
            lambda p: figures.curves_plot(loss_curves, p, col.spec.name),
        )
