"""The kimi-linear report (axes backbone, scheme): per backbone loss, paired Δ and step-time ratio
vs the baseline, MoE load balance, depth-weight heatmaps; the two backbones' verdicts side by side.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from attnres.experiments.reports import lr_sweep
from attnres.experiments.reports.common import (
    DEPTH_WEIGHT_COLUMNS,
    Report,
    corrected,
    depth_weight_stats,
    fmt,
    md_table,
)
from attnres.experiments.reports.sections import progress
from attnres.experiments.results import Result, collect, finite, mean_matrix, nan_matrix
from attnres.experiments.spec import ExperimentError, load_spec
from attnres.experiments.stats import Paired, fmt_mean_std

BACKBONE_NAMES = {"kimi_linear": "Kimi Linear (KDA + MLA, MoE)", "llama": "LLaMA (GQA + RoPE, SwiGLU)"}


def _median_step_seconds(r: Result) -> float:
    steps = [float(row["step_seconds"]) for row in r.metrics().get("train", []) if "step_seconds" in row]
    return float(np.median(steps)) if steps else float("nan")


def kimi_linear_report(rep: Report) -> None:
    """Per backbone the same schemes on the same data, size and budget: losses and paired Δ against
    the baseline of the same backbone, step-time ratios measured in the same suite, the routers'
    final balance, depth-weight heatmaps; then whether the backbone changes the verdict."""
    col = rep.col
    base = col.spec.baseline or "prenorm"
    backbones, schemes = col.points("backbone"), col.points("scheme")
    verdicts: dict[str, dict[str, Paired]] = {}
    for bb in backbones:
        ref = col.losses(backbone=bb, scheme=base)
        base_runs = [r for r in col.select(backbone=bb, scheme=base) if r.done]
        base_step = float(np.mean([_median_step_seconds(r) for r in base_runs])) if base_runs else float("nan")
        rows = []
        for s in schemes:
            done = [r for r in col.select(backbone=bb, scheme=s) if r.done]
            losses = col.losses(backbone=bb, scheme=s)
            step = float(np.mean([_median_step_seconds(r) for r in done])) if done else float("nan")
            moe = [v for v in (r.final_moe_imbalance() for r in done) if v is not None]
            params = done[0].summary.get("params") if done else None
            rows.append(
                [
                    s,
                    f"{params:,}" if params else "—",
                    str(len(done)),
                    fmt_mean_std(list(losses.values())),
                    "—" if s == base else rep.paired_cell(losses, ref),
                    fmt(step, 3),
                    "—" if not (finite(step) and finite(base_step)) else f"{step / base_step:.2f}",
                    fmt_mean_std(moe, 3) if moe else "—",
                ]
            )
            if s != base:
                verdicts.setdefault(s, {})[bb] = rep.paired(losses, ref)
        rep.add(
            f"## {BACKBONE_NAMES.get(bb, bb)}",
            "",
            md_table(
                [
                    "scheme",
                    "params",
                    "seeds",
                    "val loss",
                    f"Δ vs {base} (paired)",
                    "step s (median)",
                    f"step time / {base}",
                    "MoE max load / mean − 1 (last step)",
                ],
                rows,
                "lrrrlrrr",
            ),
            "",
        )
        heat_rows = []
        for s in schemes:
            done = [
                r for r in col.select(backbone=bb, scheme=s) if r.done and r.probes and r.probes.get("depth_weights")
            ]
            if not done or s not in ("block", "full"):
                continue
            M = mean_matrix([nan_matrix(r.probes["depth_weights"]) for r in done])
            assert M is not None  # done is not empty
            labels = done[0].probes["depth_sources"]
            heat_rows.append(depth_weight_stats(s, M, len(done)))
            from attnres.analysis.plots import plot_depth_heatmaps

            rep.figure(
                f"depth_weights_{bb}_{s}.png",
                f"{bb}, {s}: mean depth weights (over {len(done)} seeds, one validation batch) of the "
                "pre-attention and pre-MLP inputs; the last row is the final aggregation.",
                partial(plot_depth_heatmaps, M, labels, title=f"{bb}, {s}: mean depth weights"),
            )
        if heat_rows:
            rep.add(
                "Depth-weight structure (rows = consumers reading more than one source; columns as in the "
                "dynamics report):",
                "",
                md_table(
                    DEPTH_WEIGHT_COLUMNS,
                    heat_rows,
                ),
                "",
            )
    if len(backbones) > 1 and verdicts:
        rows, sentences = [], []
        for s, by in verdicts.items():
            rows.append([s] + [by[bb].describe() if bb in by else "—" for bb in backbones])
            known = {bb: p.verdict for bb, p in by.items() if p.n > 1}
            if len(known) == len(backbones):
                same = len(set(known.values())) == 1
                sentences.append(
                    f"{s}: "
                    + ", ".join(f"{by[bb].verdict_text()} on {bb}" for bb in backbones)
                    + (
                        " — the backbone does not change the verdict."
                        if same
                        else " — the verdict differs between the backbones."
                    )
                )
        rep.add(
            "## Does the backbone change the verdict?",
            "",
            f"Paired Δ of the final validation loss against {base} of the same backbone (same seeds, data "
            "order, size and tokens; interval and Holm-corrected verdict as the Statistics section says).",
            "",
            md_table(["scheme"] + [f"Δ on {bb}" for bb in backbones], rows),
            "",
        )
        if sentences:
            rep.add(*[f"- {line}" for line in sentences], "")
    _tuned_section(rep)


def _lr_sweep(rep: Report) -> Report | None:
    """The lr-sweep report beside this one (same runs root, same specs directory), Holm-corrected in its
    own family; None where it has no spec there or no finished run."""
    done = [r for r in rep.col.results if r.done]
    if not done:
        return None
    runs_root, specs_dir = done[0].dir.parent.parent, rep.col.spec.path.parent
    try:
        spec = load_spec("lr-sweep", specs_dir)
    except ExperimentError as e:
        if "unknown experiment" in str(e):  # a specs directory of its own, without the sweep
            return None
        raise
    sweep = corrected(collect(spec, runs_root), lr_sweep.lr_sweep_report)
    return sweep if sweep.col.n_done else None


def _tuned_section(rep: Report) -> None:
    """The same backbone tuned: this experiment trains every arm at one untuned rate over 3 seeds, so its
    verdicts are not the headline; the lr-sweep retrains it at each arm's best rate over 5 seeds and with
    dense MLPs in place of the experts. Its numbers are quoted here with its own Holm correction."""
    rates = sorted({r.config["train"]["lr"] for r in rep.col.results if r.done and r.config})
    shared = f"lr {', '.join(f'{lr:g}' for lr in rates)}" if rates else "one shared rate"
    rep.add(
        "## Tuned learning rates and dense MLPs",
        "",
        f"Every arm above trains at {shared}, untuned, over {len(rep.col.spec.seeds)} seeds. The "
        "learning-rate sweep ([`reports/lr-sweep/REPORT.md`](../lr-sweep/REPORT.md), `attnres experiment "
        "lr-sweep`) retrains this backbone's prenorm, Block and Full AttnRes over a grid of rates and compares "
        "every arm at its own best rate, on the whole validation split; beside them the same backbone with "
        "dense MLPs in place of the experts, which has no expert load to balance, so what AttnRes gains there "
        "is not a repaired router.",
        "",
    )
    sweep = _lr_sweep(rep)
    if sweep is None:
        rep.add("No lr-sweep run has finished beside these runs yet.", "")
        return
    base = sweep.col.spec.baseline or "prenorm"
    backbones = [bb for bb in (lr_sweep.MOE, lr_sweep.DENSE) if bb in sweep.col.points("backbone")]
    rows = lr_sweep.at_best_rows(sweep, backbones)
    _, lines = lr_sweep.dense_share(sweep)
    rep.add(
        f"From the lr-sweep's runs (grid lr {', '.join(sweep.col.points('lr'))}; its Holm family, m = "
        f"{len(sweep.comparisons.tests)}; {progress(sweep.col)}). "
        "Expert imbalance: max load / mean load − 1 at the last step, averaged over the MoE layers.",
        "",
        md_table(
            [h.format(base=base) for h in lr_sweep.AT_BEST_HEADER] + ["expert imbalance at that lr"],
            rows,
            "lllrrlr",
        ),
        "",
    )
    if lines:
        rep.add(
            "How much of the gain stays without experts (dense − MoE, per seed; positive: less gain without them):",
            "",
            *lines,
            "",
        )
