"""The sections every report page has: its status (complete or partial), provenance, statistics rule
and the table of all runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from attnres.experiments.env import machine
from attnres.experiments.reports.common import (
    Report,
    fmt,
    md_table,
    variant_rows,
)
from attnres.experiments.results import Collected, Result, finite
from attnres.experiments.spec import experiment_command
from attnres.experiments.stats import (
    STATS_RULE,
    Comparisons,
    fmt_mean_std,
    seed_shortfall,
)


def _seed_statement(col: Collected, axes: list[str]) -> str:
    """'3 seeds for a, b (headline); 2 seeds for the other rows'."""
    per: dict[str, set] = {}
    for r in col.results:  # a group of several axes reads 'block/kimi_linear', so the list stays readable
        per.setdefault("/".join(r.run.labels[a] for a in axes if a in r.run.labels), set()).add(r.run.seed)
    by_n: dict[int, list[str]] = {}
    for g, seeds in per.items():
        by_n.setdefault(len(seeds), []).append(g)
    if len(by_n) == 1:
        ((n, _),) = by_n.items()
        return f"every row runs {n} seed{'s' if n > 1 else ''}"
    parts = []
    for n in sorted(by_n, reverse=True):
        names = by_n[n]
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        parts.append(f"{n} seed{'s' if n > 1 else ''} for {shown}")
    head = f" (headline rows: {', '.join(col.spec.headline)})" if col.spec.headline else ""
    return "; ".join(parts) + head


def progress(col: Collected) -> str:
    """How far a collection is, in a phrase: "all 270 planned runs finished, 12 of them diverged" (a
    diverged run is an outcome, not a missing one)."""
    diverged = sum(r.state == "diverged" for r in col.unique)
    finished = col.n_done + diverged
    head = f"all {finished}" if col.complete else f"{finished} of {len(col.unique)}"
    return f"{head} planned runs finished" + (f", {diverged} of them diverged" if diverged else "")


def status(col: Collected) -> list[str]:
    uniq = col.unique
    counts: dict[str, int] = {}
    for r in uniq:
        counts[r.state] = counts.get(r.state, 0) + 1
    finished = col.n_done + counts.get("diverged", 0)
    if col.complete:
        head = (
            f"**Status: complete.** All {len(uniq)} planned runs finished"
            + (f" ({counts['diverged']} diverged)" if counts.get("diverged") else "")
            + "."
        )
        return [head, ""]
    missing = [r for r in uniq if r.state not in ("done", "diverged")]
    names = ", ".join(f"`{r.run.name}`" for r in missing[:15])
    more = f" and {len(missing) - 15} more" if len(missing) > 15 else ""
    return [
        f"> **PARTIAL REPORT: {finished} of {len(uniq)} planned runs finished** "
        f"({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}). Every number below comes from "
        "the finished runs only; rows and fits with missing runs are incomplete. "
        f"Continue with `{experiment_command(col.spec, uniq[0].dir.parent.parent if uniq else None)}`.",
        ">",
        f"> Not finished: {names}{more}.",
        "",
    ]


def provenance(col: Collected, command: str) -> list[str]:
    spec = col.spec
    # each distinct value, in order of first appearance, over the runs' invocations (run.json)
    commands: list[str] = []
    machines: list[str] = []
    commits: list[str] = []
    wall = train = 0.0
    reused = 0
    sources = set()
    for r in col.unique:
        if not r.info:
            continue
        is_copy = r.done and r.dir.parent.name != spec.name  # finished by another experiment, read there
        if is_copy:
            reused += 1
            sources.add(r.dir.parent.name)
        for inv in r.info.get("invocations", []) + r.info.get("source_invocations", []):
            if "reused_from" in inv:
                is_copy = True
                reused += 1
                sources.add(Path(inv["reused_from"]).parent.name)
                continue
            for bag, key in ((commands, "command"), (machines, "machine"), (commits, "commit")):
                v = inv.get(key)
                if v and v not in bag:
                    bag.append(v)
        if r.done and not is_copy:  # a copy's time (wall and steps alike) counts where it was trained
            wall += r.wall_seconds
            train += r.train_seconds if finite(r.train_seconds) else 0.0
    plural = reused > 1
    copied = (
        (
            f"; {reused} run{'s' if plural else ''} come{'' if plural else 's'} from identical runs of "
            f"{', '.join(sorted(sources))} (their time counts there)"
        )
        if reused
        else ""
    )
    lines = [
        "## Provenance",
        "",
        f"- Report: `{command}` (regenerates every number from the cached runs; no training)",
        "- Runs produced by: "
        + ("; ".join(f"`{c}`" for c in commands) if commands else f"`attnres experiment {spec.name}` (no runs yet)"),
        "- Machine: " + ("; ".join(machines) if machines else machine()),
        f"- Code: runs at commit {', '.join(f'`{c}`' for c in commits) or '—'}",
        f"- Spec: `{spec.path}` (sha256 `{spec.sha256[:16]}`)",
        f"- Wall time of the finished runs: {wall / 3600:.2f} h in all "
        f"({train / 3600:.2f} h in optimizer steps; the rest is evaluation, data preparation and "
        f"probes){copied}",
    ]
    if spec.budget_cpu_hours:
        lines.append(
            f"- Planned budget: {spec.budget_cpu_hours:g} CPU-hours"
            + (f" ({spec.budget_note})" if spec.budget_note else "")
        )
    lines.append("")
    return lines


def eval_scope(col: Collected) -> str:
    """What the final losses of a report average over: the whole validation split, or the trainer's last
    evaluation on the split's first batches, with the number of tokens."""
    tokens = sorted({t for r in col.unique if r.done and (t := r.eval_tokens)})
    if not tokens:
        return "held-out works"
    counts = " or ".join(f"{t:,}" for t in tokens) + " tokens per run"
    if col.scope == "split":
        split = sorted({r.summary["val_split"].get("split_tokens") for r in col.unique if r.done} - {None})
        return f"the whole validation split: {counts}" + (
            f" of {' or '.join(f'{t:,}' for t in split)}" if split and split != tokens else ""
        )
    done = [r for r in col.unique if r.done]
    with_split = sum(r.has_split_eval for r in done)
    slice_only = (
        f"the trainer's last evaluation, on the first eval_batches batches of the validation split only: {counts}"
    )
    if with_split:
        return (
            f"{slice_only}, not the whole split: {with_split} of the {len(done)} finished runs also have the "
            "whole-split evaluation, the others predate it"
        )
    return f"{slice_only}, not the whole split (these runs predate the whole-split evaluation)"


def split_section(
    rep: Report,
    base: str,
    ok: Callable[[str], bool],
    partner: tuple[str, Callable[[str], str | None]] | None = None,
    within: dict[str, str] | None = None,
    row_name: str = "variant",
) -> list[str]:
    """'## On the whole validation split': in a report that reads the slice because some runs predate the
    whole-split evaluation, the rows (labels of the first axis, among the runs with the labels ``within``) whose
    every run has it, the baseline ``base`` among them, compared there: paired against the baseline over
    the seeds both have. The comparisons join the report's Holm family. ``ok(label)``: whether that row
    shares the baseline's sublayer initialisation (else †). ``partner``: (column header, label -> the row
    it is also compared with, or None) for a report whose rows have a second reference (the routing
    report's paper cell of a family); a partner that lacks the whole-split loss leaves the cell empty.
    ``row_name``: the first column's header, the word the report's other tables use for a row."""
    col, within = rep.col, within or {}
    if not col.spec.axes:
        return []
    split = col.split_rows(*variant_rows(col), within)
    if base not in split or len(split) < 2:
        return []
    rows = []
    for label, losses in split.items():
        cell = "—" if label == base else rep.paired_cell(losses, split[base], ok(label))
        row = [label, str(len(losses)), fmt_mean_std(list(losses.values())), cell]
        if partner is not None:
            other = partner[1](label)
            row.append(rep.paired_cell(losses, split[other]) if other is not None and other in split else "—")
        rows.append(row)
    tokens = sorted({r.split_tokens for r in col.select(**within) if r.done and r.has_split_eval})
    where = "".join(f", {k}: {v}" for k, v in within.items())
    headers = [row_name, "seeds", "loss, whole split", f"Δ vs {base}, whole split (paired)"]
    if partner is not None:
        headers.append(f"{partner[0]}, whole split (paired)")
    return [
        f"## On the whole validation split{where}",
        "",
        f"Every run of these rows was also scored on the whole validation split "
        f"({' or '.join(f'{t:,}' for t in tokens)} tokens per run), so they are compared there as well: a "
        "larger evaluation, the same for every arm, than the slice the other tables read (they keep these "
        "runs' slice losses beside the rows that have no other). These comparisons join the report's Holm "
        "correction; the README quotes them.",
        "",
        md_table(headers, rows, "lrrl" + "l" * (partner is not None)),
        "",
    ]


def _headline_seeds(col: Collected) -> str:
    """' Headline rows prenorm, block: 3 seeds: below the 5 the README requires.' (per headline row, the
    fewest finished seeds it has in any group of the other axes)."""
    if not col.spec.headline:
        return ""
    axis_of = {p.label: name for name, points in col.spec.axes for p in points}
    by_n: dict[int, list[str]] = {}
    for label in col.spec.headline:
        axis = axis_of.get(label)
        groups: dict[tuple, set[int]] = {}
        for r in col.results:  # the row's runs, by the points of the other axes (a tag is not a row)
            if r.done and axis is not None and r.run.labels.get(axis) == label:
                others = tuple((a, r.run.labels.get(a)) for a, _ in col.spec.axes if a != axis)
                groups.setdefault(others, set()).add(r.run.seed)
        by_n.setdefault(min((len(s) for s in groups.values()), default=0), []).append(label)
    parts = [f"{', '.join(labels)}: {seed_shortfall(n) or f'{n} seeds'}" for n, labels in sorted(by_n.items())]
    return " Headline rows " + "; ".join(parts) + "."


def stats_rule(col: Collected, axes: list[str], comparisons: Comparisons) -> list[str]:
    evaluated = eval_scope(col)
    return [
        "## Statistics",
        "",
        f"Seeds: {_seed_statement(col, axes)}.{_headline_seeds(col)} Values are the final validation loss "
        f"(nats/token, {evaluated}) as mean ± sample std over seeds. Paired differences: {STATS_RULE}. "
        f"This report makes {comparisons.summary()}. "
        "† marks pairs whose sublayer initialisation differs although the seed is the same (the "
        "scheme's constructor draws random numbers), so only the data order is shared.",
        "",
    ]


def runs_table(col: Collected) -> list[str]:
    rows = []
    by_hash: dict[str, list[Result]] = {}
    for r in col.results:
        by_hash.setdefault(r.run.hash, []).append(r)
    for h, rs in by_hash.items():
        r = rs[0]
        names = "<br>".join(x.run.name for x in rs)
        state = r.state
        if r.done and r.dir.parent.name != col.spec.name:
            state = f"done (in {r.dir.parent.name})"
        if r.diverged:
            state = f"diverged at step {r.diverged.get('step')}"
        # a finished run is named by its directory: a run hashed before a config field was added keeps
        # its directory (the runner finds it as compatible), and the table should point at it
        rows.append(
            [
                names,
                f"`{r.dir.name if r.done else h}`",
                state,
                fmt(r.loss) if r.done else "—",
                f"{r.eval_tokens:,}" if r.done and r.eval_tokens else "—",
                f"{r.run.tokens:,}",
                fmt(r.train_seconds, 0) if r.done else "—",
                f"{r.summary['params']:,}" if r.done else "—",
            ]
        )
    return [
        "## All runs",
        "",
        md_table(["run", "hash", "state", "val loss", "val tokens", "tokens", "train s", "params"], rows, "llllrrrr"),
        "",
    ]
