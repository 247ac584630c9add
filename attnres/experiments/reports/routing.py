"""The routing report (``experiments/routing.toml``): source (outputs | states) x routing
(replacement | additive) for Block and Full AttnRes, plus PreNorm, on two backbones.

Each scheme point carries the tags ``family`` (prenorm | block | full), ``source`` and ``routing``. Per
backbone: every cell's loss, its paired Δ against PreNorm and, for the other cells of a family, against
the paper's cell of that family (outputs, replacement); the 2 x 2 grids of Δ vs PreNorm; which cell wins
and whether it is distinguishable after the Holm correction; a one-line verdict on the cells as trained
(additive routing with its gain initialised to zero, which these runs do not show moving: not a test of Delta
Attention Residuals' claim that additive routing is the lever).
"""

from __future__ import annotations

import numpy as np

from attnres.experiments.reports.additive import MIN_GAIN_RMS, final_gain
from attnres.experiments.reports.common import (
    Report,
    fmt,
    md_table,
    same_init_as,
)
from attnres.experiments.reports.kimi_linear import BACKBONE_NAMES, _median_step_seconds
from attnres.experiments.reports.sections import split_section
from attnres.experiments.results import Collected
from attnres.experiments.stats import fmt_mean_std, mean_std

PAPER_CELL = ("outputs", "replacement")  # the paper's AttnRes: sublayer outputs, replacement routing


def _tags(col: Collected, scheme: str) -> tuple[str, str, str]:
    point = col.point("scheme", scheme)
    tags = point.tags if point is not None else {}
    return tags.get("family", scheme), tags.get("source", "-"), tags.get("routing", "-")


def _paper_cell(col: Collected, family: str) -> str | None:
    return next((s for s in col.points("scheme") if _tags(col, s) == (family, *PAPER_CELL)), None)


def routing_verdict(rep: Report) -> str:
    """One line: per backbone and family, additive against replacement (outputs source) and the winner.
    Where the baseline and some cells of a backbone have the whole-split evaluation, the line reads those
    cells there (the comparisons of the section "On the whole validation split"), not the slice."""
    col = rep.col
    base = col.spec.baseline or "prenorm"
    parts = []
    for bb in col.points("backbone"):
        cells = [s for s in col.points("scheme") if s != base and col.losses(backbone=bb, scheme=s)]
        split = col.split_rows("scheme", [base, *cells], {"backbone": bb})
        if base in split and len(split) > 1:
            losses, cells, where = split, [s for s in cells if s in split], " (whole split)"
        else:
            losses, where = {s: col.losses(backbone=bb, scheme=s) for s in [base, *cells]}, ""
        if not cells:
            continue
        claims = []
        for family in ("block", "full"):
            paper = _paper_cell(col, family)
            additive = next((s for s in cells if _tags(col, s) == (family, "outputs", "additive")), None)
            if paper not in cells or additive is None:
                continue
            p = rep.paired(losses[additive], losses[paper])
            if p.n:
                claims.append(f"{family} additive {p.mean:+.3f} {p.interval(3)} vs replacement ({p.verdict_text()})")
        best = min(cells, key=lambda s: float(np.mean(list(losses[s].values()))))
        win = rep.paired(losses[best], losses[base])
        claims.append(f"best cell {best} {win.mean:+.3f} {win.interval(3)} vs {base} ({win.verdict_text()})")
        parts.append(f"{bb}{where}: " + ", ".join(claims))
    if not parts:
        return "Verdict: no runs yet."
    return (
        "Verdict on the cells as trained (Δ, 95 % interval, Holm-corrected verdict; on the whole validation "
        "split where a backbone's cells have it, among the cells scored there): "
        + "; ".join(parts)
        + ". "
        + _additive_gain(col)
        + " This does not test Delta AttnRes's claim that additive routing beats replacement; nothing here "
        "refutes it (reports/additive tests the published form)."
    )


def _additive_gain(col: Collected) -> str:
    """What the additive cells' logged gain did: a zero-initialised gain that stays near zero leaves the read
    PreNorm's, and then additive ≈ PreNorm holds by construction."""
    runs = [r for s in col.points("scheme") if _tags(col, s)[2] == "additive" for r in col.select(scheme=s) if r.done]
    rms = [float(g["gain_rms"]) for r in runs if (g := final_gain(r)) is not None]
    head = "The additive cells' gain starts at zero"
    if not rms:
        return (
            f"{head} and these runs do not record whether it moved: where it stays near zero the additive read "
            "is PreNorm's, so additive ≈ PreNorm holds by construction."
        )
    grown = sum(v >= MIN_GAIN_RMS for v in rms)
    older = " (the others predate the log)" if len(rms) < len(runs) else ""
    return (
        f"{head}; {len(rms)} of their {len(runs)} runs record it{older}, and it ends at an RMS of "
        f"{min(rms):.3f}-{max(rms):.3f}: {grown} of them reach the {MIN_GAIN_RMS:g} that reports/additive asks "
        "of a test of additive routing. Where it stays near zero the additive read is PreNorm's, so additive ≈ "
        "PreNorm holds by construction."
    )


def routing_report(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    schemes = col.points("scheme")
    for bb in col.points("backbone"):
        ref = col.losses(backbone=bb, scheme=base)
        same_init = same_init_as(col, "scheme", base, backbone=bb)

        def paper_partner(s: str) -> str | None:
            paper = _paper_cell(col, _tags(col, s)[0])
            return None if paper == s else paper

        base_runs = [r for r in col.select(backbone=bb, scheme=base) if r.done]
        base_step = float(np.mean([_median_step_seconds(r) for r in base_runs])) if base_runs else float("nan")
        rows, means = [], {}
        for s in schemes:
            family, source, routing = _tags(col, s)
            done = [r for r in col.select(backbone=bb, scheme=s) if r.done]
            losses = col.losses(backbone=bb, scheme=s)
            if losses:
                means[s] = float(np.mean(list(losses.values())))
            paper = _paper_cell(col, family)
            vs_paper = (
                rep.paired_cell(losses, col.losses(backbone=bb, scheme=paper))
                if paper is not None and paper != s and losses
                else "—"
            )
            step = float(np.mean([_median_step_seconds(r) for r in done])) if done else float("nan")
            rows.append(
                [
                    s,
                    source,
                    routing,
                    str(len(done)),
                    fmt_mean_std(list(losses.values())),
                    "—" if s == base or not losses else rep.paired_cell(losses, ref, same_init(s)),
                    vs_paper,
                    "—" if not done or not base_runs else f"{step / base_step:.2f}",
                ]
            )
        rep.add(
            f"## {BACKBONE_NAMES.get(bb, bb)}",
            "",
            md_table(
                [
                    "cell",
                    "source",
                    "routing",
                    "seeds",
                    "val loss",
                    f"Δ vs {base} (paired)",
                    "Δ vs the paper's cell of its family (outputs, replacement)",
                    f"step time / {base}",
                ],
                rows,
                "llllrllr",
            ),
            "",
            f"Step time / {base}: the median optimizer step of each cell's runs against {base}'s; the runs "
            "trained at different times on 2 shared cores whose load varied from 1 to 7, so these ratios "
            "say more about the machine than about the scheme (`attnres bench train` measures the step "
            "cost side by side).",
            "",
        )
        grid_rows = []
        for family in ("block", "full"):
            for source in ("outputs", "states"):
                row = [family, source]
                for routing in ("replacement", "additive"):
                    cell = next((s for s in schemes if _tags(col, s) == (family, source, routing)), None)
                    losses = col.losses(backbone=bb, scheme=cell) if cell else {}
                    row.append(fmt(_mean_difference(losses, ref), 4, sign=True) if losses and ref else "—")
                grid_rows.append(row)
        rep.add(
            f"Mean paired Δ vs {base} in the 2 x 2 of each family (negative: lower loss than {base}; the "
            "tests are in the table above):",
            "",
            md_table(["family", "source", "replacement", "additive"], grid_rows, "llrr"),
            "",
        )
        cells = [s for s in means if s != base]
        if cells and ref:
            ranked = sorted(cells, key=means.__getitem__)
            best = ranked[0]
            lines = [f"Winner on {bb}: **{best}** (mean {means[best]:.4f}); against {base}: "]
            lines[0] += rep.paired(col.losses(backbone=bb, scheme=best), ref).describe()
            if len(ranked) > 1:
                runner = ranked[1]
                p = rep.paired(col.losses(backbone=bb, scheme=best), col.losses(backbone=bb, scheme=runner))
                lines.append(f"; against the runner-up {runner}: {p.describe()}.")
            rep.add("".join(lines), "")
        partner = ("Δ vs the paper's cell of its family", paper_partner)
        rep.add(*split_section(rep, base, same_init, partner, within={"backbone": bb}, row_name="cell"))
    rep.add("## Verdict", "", routing_verdict(rep), "")


def _mean_difference(variant: dict[int, float], base: dict[int, float]) -> float:
    """The mean per-seed difference over the seeds both have (a table repeating Δs tested elsewhere)."""
    return mean_std([variant[k] - base[k] for k in variant if k in base])[0]
