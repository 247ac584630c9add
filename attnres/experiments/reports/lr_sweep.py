"""The lr-sweep report (axes lr, backbone, scheme): per backbone and scheme the final loss at each learning
rate, each arm's best rate, Block and Full against the baseline each at its own best rate, the routers'
load balance on the mixture-of-experts backbone, and how much of the Kimi Linear gain stays with dense MLPs.

An arm is one (backbone, scheme) cell; its best rate is the rate with the lowest mean final loss over
the seeds finished there. The comparisons pair seeds across rates: a seed fixes the data order and the
initial weights whatever the learning rate, so the per-seed difference still cancels the noise two runs
share.
"""

from __future__ import annotations

from attnres.experiments.reports.common import Report, md_table
from attnres.experiments.stats import Paired, fmt_mean_interval, fmt_mean_std, mean_std

BACKBONE_NAMES = {
    "llama": "LLaMA (GQA + RoPE, SwiGLU MLPs)",
    "kimi_linear": "Kimi Linear (KDA + MLA 3:1, mixture of experts)",
    "kimi_dense": "Kimi Linear with dense MLPs (no experts)",
}
MOE = "kimi_linear"  # the backbone with experts
DENSE = "kimi_dense"  # the same backbone with dense MLPs


def _rate(label: str) -> float:
    try:
        return float(label)
    except ValueError:
        return float("nan")


def _diverged(rep: Report, **labels) -> set[int]:
    """The seeds whose run with these labels diverged (the runner stops it at a non-finite loss)."""
    return {r.run.seed for r in rep.col.select(**labels) if r.state == "diverged"}


def _finished(rep: Report, **labels) -> set[int]:
    """The seeds whose run with these labels has an outcome: a final loss, or a divergence."""
    return set(rep.col.losses(**labels)) | _diverged(rep, **labels)


def selection(rep: Report, backbone: str) -> tuple[list[str], list[int]]:
    """The rates every arm of a backbone chooses its best rate from and the seeds it averages over: one grid
    and one seed set for all arms, so no arm picks from a wider grid or on other seeds than the arm it is
    compared with. The grid is the widest set of rates on which every scheme with a finished run shares at
    least max(2, half the most) finished seeds (ties: more seeds, then the rates listed first); the seeds
    are the ones shared there. A diverged run is finished: its rate stays in the grid, and ``best_lr``
    rules the rate out for that arm. So a last seed finished at one rate does not shrink the grid to that
    rate, and a rate just begun (one seed) waits until it has enough seeds to be averaged. The whole grid
    on every seed once every run has finished."""
    col = rep.col
    schemes = [s for s in col.points("scheme") if col.losses(backbone=backbone, scheme=s)]
    if not schemes:
        return [], []
    rates = col.points("lr")
    shared = {
        lr: set.intersection(*(_finished(rep, lr=lr, backbone=backbone, scheme=s) for s in schemes)) for lr in rates
    }
    most = max(len(seeds) for seeds in shared.values())
    if not most:
        return [], []
    need = min(most, max(2, -(-most // 2)))
    best: tuple[list[str], set[int]] = ([], set())
    for mask in range(1, 1 << len(rates)):
        subset = [lr for i, lr in enumerate(rates) if mask >> i & 1]
        seeds = set.intersection(*(shared[lr] for lr in subset))
        if len(seeds) >= need and (len(subset), len(seeds)) > (len(best[0]), len(best[1])):
            best = (subset, seeds)
    return best[0], sorted(best[1])


def candidate_lrs(rep: Report, backbone: str) -> list[str]:
    """The rates of ``selection``: the grid every arm of the backbone picks its best rate from."""
    return selection(rep, backbone)[0]


def best_lr(rep: Report, backbone: str, scheme: str) -> str | None:
    """The learning rate (its label) with the lowest mean final loss of one arm over the seeds of
    ``selection``, among its rates; ties go to the rate listed first. A rate where the arm diverged on
    any of those seeds is not a candidate (no one would train at it). None when the backbone has no
    selection yet or the arm no run on it."""
    col = rep.col
    rates, seeds = selection(rep, backbone)
    means = {}
    for lr in rates:
        if _diverged(rep, lr=lr, backbone=backbone, scheme=scheme) & set(seeds):
            continue
        losses = col.losses(lr=lr, backbone=backbone, scheme=scheme)
        m, _, n = mean_std(losses[seed] for seed in seeds if seed in losses)
        if n:
            means[lr] = m
    return min(means, key=means.__getitem__) if means else None


def _loss_cell(rep: Report, **labels) -> str:
    """Mean and interval of the finished runs, and how many seeds diverged."""
    losses = list(rep.col.losses(**labels).values())
    diverged = len(_diverged(rep, **labels))
    if not diverged:
        return fmt_mean_interval(losses)
    n = len(losses) + diverged
    return (fmt_mean_interval(losses) + f"; {diverged} diverged") if losses else f"diverged ({diverged} of {n} seeds)"


def _best_label(rep: Report, backbone: str, scheme: str) -> str:
    """'0.003', '0.001 (edge of the grid)' or '0.001 (of 0.001 only: the other rates are unfinished)'."""
    lr = best_lr(rep, backbone, scheme)
    if lr is None:
        return "—"
    cands = candidate_lrs(rep, backbone)
    if len(cands) < len(rep.col.points("lr")):
        return f"{lr} (of {', '.join(cands)} only: the other rates are unfinished)"
    return f"{lr}{_edge(rep, lr)}"


def _at_best(rep: Report, backbone: str, scheme: str) -> dict[int, float]:
    lr = best_lr(rep, backbone, scheme)
    return rep.col.losses(lr=lr, backbone=backbone, scheme=scheme) if lr is not None else {}


def _edge(rep: Report, lr: str) -> str:
    """' (edge of the grid)' when the best rate is the smallest or the largest swept."""
    rates = sorted(rep.col.points("lr"), key=_rate)
    return " (edge of the grid)" if len(rates) > 2 and lr in (rates[0], rates[-1]) else ""


def _delta(rep: Report, backbone: str, scheme: str, base: str) -> Paired | None:
    """``scheme`` at its best rate against ``base`` at its own best rate, paired over seeds."""
    if scheme == base:
        return None
    ours, ref = _at_best(rep, backbone, scheme), _at_best(rep, backbone, base)
    if not ours or not ref:
        return None
    return rep.paired(ours, ref)


def _per_seed_delta(rep: Report, backbone: str, scheme: str, base: str) -> dict[int, float]:
    ours, ref = _at_best(rep, backbone, scheme), _at_best(rep, backbone, base)
    return {s: ours[s] - ref[s] for s in sorted(set(ours) & set(ref))}


def imbalance(rep: Report, backbone: str, scheme: str, lr: str | None) -> list[float]:
    """The routers' final imbalance of each finished run of one arm at one rate ([]: no experts, no run)."""
    if lr is None:
        return []
    runs = rep.col.select(lr=lr, backbone=backbone, scheme=scheme)
    return [v for r in runs if r.done if (v := r.final_moe_imbalance()) is not None]


def at_best_rows(rep: Report, backbones: list[str]) -> list[list[str]]:
    """Per backbone and scheme: the best rate, the seeds there, the loss, the Δ against the baseline at
    its best rate (with the report's Holm verdict) and the expert-load imbalance at that rate."""
    col, base = rep.col, rep.col.spec.baseline or "prenorm"
    rows = []
    for bb in backbones:
        for s in col.points("scheme"):
            lr = best_lr(rep, bb, s)
            if lr is None:
                rows.append([BACKBONE_NAMES.get(bb, bb), s, "—", "0", "—", "—", "—"])
                continue
            losses = col.losses(lr=lr, backbone=bb, scheme=s)
            d = _delta(rep, bb, s, base)
            moe = imbalance(rep, bb, s, lr)
            rows.append(
                [
                    BACKBONE_NAMES.get(bb, bb),
                    s,
                    _best_label(rep, bb, s),
                    str(len(losses)),
                    fmt_mean_std(list(losses.values())),
                    "—" if s == base else (d.describe() if d is not None else f"no {base} run"),
                    fmt_mean_std(moe, 3) if moe else "—",
                ]
            )
    return rows


AT_BEST_HEADER = ["backbone", "scheme", "best lr", "seeds", "val loss (mean ± std)", "Δ vs {base} at its best lr"]


def dense_share(rep: Report) -> tuple[list[list[str]], list[str]]:
    """How much of each scheme's Kimi Linear gain stays with dense MLPs: table rows and one line each."""
    base = rep.col.spec.baseline or "prenorm"
    rows, lines = [], []
    for s in rep.col.points("scheme"):
        if s == base:
            continue
        moe, dense = _delta(rep, MOE, s, base), _delta(rep, DENSE, s, base)
        if moe is None or dense is None:
            rows.append([s, moe.describe() if moe else "—", dense.describe() if dense else "—", "—", "—"])
            continue
        diff = rep.paired(_per_seed_delta(rep, DENSE, s, base), _per_seed_delta(rep, MOE, s, base))
        share = f"{dense.mean / moe.mean:.0%}" if moe.mean < 0 and moe.n and dense.n else "—"
        rows.append([s, moe.describe(), dense.describe(), diff.describe(), share])
        lines.append(
            f"- {s}: Δ {moe.mean:+.3f} with experts, {dense.mean:+.3f} with dense MLPs; dense − MoE "
            f"{diff.mean:+.3f}" + (f" {diff.interval(3)}, {diff.verdict_text()}" if diff.n > 1 else " (1 seed)")
        )
    return rows, lines


def lr_sweep_report(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    backbones, schemes, rates = col.points("backbone"), col.points("scheme"), col.points("lr")
    started = [bb for bb in backbones if any(r.done for r in col.select(backbone=bb))]
    missing = [bb for bb in backbones if bb not in started]
    if missing:
        rep.add(
            "**Backbones with no finished run yet:** " + ", ".join(BACKBONE_NAMES.get(bb, bb) for bb in missing) + ".",
            "",
        )

    rep.add(
        "## Final loss per learning rate",
        "",
        "Mean final validation loss over seeds with its 95 % interval (mean ± t_{0.975, n−1}·std/√n). The "
        "best rate of an arm is the one with the lowest mean over the seeds every scheme of the backbone "
        "finished at every rate of the grid (the whole grid and every seed once all runs have finished; "
        "while some still train, the widest set of rates that at least half the seeds finished; the same "
        "rates and seeds for each arm of a comparison); a rate where an arm diverged (a non-finite loss "
        "stopped the run) on any of those seeds cannot be its best. "
        "A best rate at the edge of the grid means the arm's optimum may lie outside it.",
        "",
    )
    for bb in started:
        rows = []
        for s in schemes:
            cells = [_loss_cell(rep, lr=lr, backbone=bb, scheme=s) for lr in rates]
            rows.append([s] + cells + [_best_label(rep, bb, s)])
        rep.add(
            f"### {BACKBONE_NAMES.get(bb, bb)}",
            "",
            md_table(["scheme"] + [f"lr = {lr}" for lr in rates] + ["best lr"], rows, "l" + "r" * len(rates) + "l"),
            "",
        )

    rows = [row[:-1] for row in at_best_rows(rep, started)]  # the imbalance has its own section
    if rows:
        rep.add(
            "## Each arm at its own best learning rate",
            "",
            f"Block and Full AttnRes each at its best rate against {base} at {base}'s best rate, paired over "
            f"the seeds both finished. The best rate is chosen on the seeds every arm finished at every rate of "
            f"the grid (the comparison's seeds, or fewer while some still train), for every arm alike, so each "
            f"arm's loss is optimistic by the selection, a bias every arm has and the pairing does not remove. "
            f"These comparisons and the dense-against-MoE ones below form the report's Holm family: "
            f"m = {len(rep.comparisons.tests)}.",
            "",
            md_table([h.format(base=base) for h in AT_BEST_HEADER], rows, "lllrrl"),
            "",
        )

    moe_rows = []
    for bb in started:
        for s in schemes:
            per_lr = [imbalance(rep, bb, s, lr) for lr in rates]
            if any(per_lr):
                at_best = imbalance(rep, bb, s, best_lr(rep, bb, s))
                moe_rows.append(
                    [BACKBONE_NAMES.get(bb, bb), s]
                    + [fmt_mean_std(v, 3) if v else "—" for v in per_lr]
                    + [fmt_mean_std(at_best, 3) if at_best else "—"]
                )
    if moe_rows:
        rep.add(
            "## Expert-load balance",
            "",
            "The routers' imbalance at the last training step: max load / mean load − 1, averaged over the "
            "MoE layers (0 = every expert gets the same number of tokens), mean ± std over seeds.",
            "",
            md_table(
                ["backbone", "scheme"] + [f"lr = {lr}" for lr in rates] + ["at the arm's best lr"],
                moe_rows,
                "ll" + "r" * (len(rates) + 1),
            ),
            "",
        )

    if MOE in started and DENSE in started:
        rows, lines = dense_share(rep)
        rep.add(
            "## How much of the Kimi Linear gain remains with dense MLPs",
            "",
            f"Each scheme's Δ against {base} (both at their best rates) on Kimi Linear with experts and with "
            f"dense MLPs, and the per-seed difference of the two Δs (dense − MoE; positive: the gain shrinks "
            f"without experts). The share is the dense Δ over the MoE Δ, of the means, where the MoE Δ is a "
            f"gain.",
            "",
            md_table(
                [
                    "scheme",
                    f"Δ vs {base}, with experts",
                    f"Δ vs {base}, dense MLPs",
                    "dense − MoE (worse: less gain without experts)",
                    "share kept",
                ],
                rows,
                "lllll",
            ),
            "",
            *lines,
            "",
        )

    verdicts = []
    for bb in started:
        parts = []
        for s in schemes:
            d = _delta(rep, bb, s, base)
            if d is not None and d.n:
                lr = best_lr(rep, bb, s)
                parts.append(
                    f"{s} (lr {lr}) {d.mean:+.3f}"
                    + (f" {d.interval(3)}, {d.verdict_text()}" if d.n > 1 else " (1 seed: no test)")
                    + (f", {d.n} seeds" if d.n > 1 else "")
                )
        if parts:
            cands = candidate_lrs(rep, bb)
            provisional = (
                f" (provisional: the best rates are chosen from lr {', '.join(cands)} only, the rest of the grid "
                "is unfinished)"
                if len(cands) < len(rates)
                else ""
            )
            verdicts.append(
                f"- {BACKBONE_NAMES.get(bb, bb)}, against {base} at lr {best_lr(rep, bb, base)}: "
                + "; ".join(parts)
                + provisional
            )
    if verdicts:
        rep.add("## Verdict", "", *verdicts, "")
