"""``attnres report NAME``: REPORT.md and PNG figures from an experiment's cached runs alone.

No training happens here: every number is read back from the run directories
(summary.json, probes.json, metrics.jsonl, config.json, run.json). A partial
suite gives a partial report, marked as such at the top, with the runs still
missing. The report kind (``[experiment] report``) picks the sections:

========== ===================== =====================================================
kind       axes it reads          what it adds
========== ===================== =====================================================
scaling    size, scheme           per-size table, L = A·C^-α fits per scheme, compute
                                  multiplier at the largest budget, Figure 4
ablations  variant                Table 4 beside the paper: Δ vs baseline and ranks
block-size variant                Figure 6: loss against the block size S
arena      scheme, budget         equal tokens and equal wall-clock; loss vs tokens/time
dynamics   scheme                 Figure 5 b/c (output and gradient magnitude per
                                  block), Figure 8 heatmaps, Figure 9 mixing matrices
arch-sweep shape, scheme          loss against d_model/L_b, optimum per scheme
demo       scheme                 ``attnres demo``'s page of its own: one table row per
                                  scheme, loss curves, depth-weight heatmaps
kimi-linear backbone, scheme      per backbone: loss, paired Δ and step-time ratio vs the
                                  baseline, MoE load balance, depth-weight heatmaps; the
                                  verdicts of the two backbones side by side
generic    any                    groups with mean ± std and paired Δ vs the baseline
========== ===================== =====================================================
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from attnres.experiments import figures
from attnres.experiments.env import git_commit, machine
from attnres.experiments.fit import (FLOPS_FORMULA, PFLOPS_DAY, compute_multiplier, fit_power_law,
                                     flops_per_token, matmul_params, measured_multiplier)
from attnres.experiments.results import Collected, Result, collect, finite, mean_matrix, nan_matrix
from attnres.experiments.spec import ExperimentSpec
from attnres.experiments.stats import NOISE_RULE, Paired, fmt_mean_std, mean_std, paired, ranks, spearman

REPORT_FILE = "REPORT.md"
DEFAULT_REPORTS_ROOT = "reports"


# ----------------------------------------------------------------------------- helpers


def md_table(headers: List[str], rows: List[List[str]], align: Optional[str] = None) -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _f(x, digits: int = 4, sign: bool = False) -> str:
    if x is None or not finite(float(x)):
        return "—"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _group_label(labels: Dict[str, str], axes: List[str]) -> str:
    return ", ".join(labels[a] for a in axes if a in labels)


def _seed_statement(col: Collected, axes: List[str]) -> str:
    """'3 seeds for a, b (headline); 2 seeds for the other rows'."""
    per: Dict[str, set] = {}
    for r in col.results:
        per.setdefault(_group_label(r.run.labels, axes), set()).add(r.run.seed)
    by_n: Dict[int, List[str]] = {}
    for g, seeds in per.items():
        by_n.setdefault(len(seeds), []).append(g)
    if len(by_n) == 1:
        (n, _), = by_n.items()
        return f"every row runs {n} seed{'s' if n > 1 else ''}"
    parts = []
    for n in sorted(by_n, reverse=True):
        names = by_n[n]
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        parts.append(f"{n} seed{'s' if n > 1 else ''} for {shown}")
    head = f" (headline rows: {', '.join(col.spec.headline)})" if col.spec.headline else ""
    return "; ".join(parts) + head


_INIT_CACHE: Dict[Tuple[str, str], bool] = {}


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
        _INIT_CACHE[key] = all(k in sb and sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k])
                               for k in keys)
    return _INIT_CACHE[key]


def _model_of(col: Collected, **labels) -> Optional[dict]:
    for r in col.select(**labels):
        return r.model
    return None


class Report:
    """Accumulates markdown and figure names for one experiment."""

    def __init__(self, col: Collected, out_dir: Path):
        self.col = col
        self.out = out_dir
        self.lines: List[str] = []
        self.figures: List[str] = []
        self.notes: List[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def figure(self, name: str, caption: str, make: Callable[[str], str]) -> None:
        try:
            make(str(self.out / name))
        except Exception as e:  # a figure must never sink the report
            self.add(f"*(figure {name} could not be drawn: {type(e).__name__}: {e})*", "")
            return
        self.figures.append(name)
        self.add(f"![{caption}]({name})", "", f"*{caption}*", "")

    def paired_cell(self, variant: Dict[int, float], base: Dict[int, float], init_ok: bool = True) -> str:
        p = paired(variant, base)
        return p.describe() + ("" if init_ok else " †")


# ----------------------------------------------------------------------------- common sections


def _status(col: Collected) -> List[str]:
    uniq = col.unique
    counts: Dict[str, int] = {}
    for r in uniq:
        counts[r.state] = counts.get(r.state, 0) + 1
    finished = col.n_done + counts.get("diverged", 0)
    if col.complete:
        head = (f"**Status: complete.** All {len(uniq)} planned runs finished"
                + (f" ({counts['diverged']} diverged)" if counts.get("diverged") else "") + ".")
        return [head, ""]
    missing = [r for r in uniq if r.state not in ("done", "diverged")]
    names = ", ".join(f"`{r.run.name}`" for r in missing[:15])
    more = f" and {len(missing) - 15} more" if len(missing) > 15 else ""
    return [f"> **PARTIAL REPORT: {finished} of {len(uniq)} planned runs finished** "
            f"({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}). Every number below comes from "
            "the finished runs only; rows and fits with missing runs are incomplete. "
            f"Continue with `attnres experiment {col.spec.name}`.", ">",
            f"> Not finished: {names}{more}.", ""]


def _provenance(col: Collected, command: str, report_seconds: float) -> List[str]:
    spec = col.spec
    commands, machines, commits = [], [], []
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
    copied = (f"; {reused} run{'s' if plural else ''} come{'' if plural else 's'} from identical runs of "
              f"{', '.join(sorted(sources))} (their time counts there)") if reused else ""
    lines = ["## Provenance", "",
             f"- Report: `{command}` (regenerates every number from the cached runs; no training)",
             "- Runs produced by: " + ("; ".join(f"`{c}`" for c in commands) if commands
                                       else f"`attnres experiment {spec.name}` (no runs yet)"),
             "- Machine: " + ("; ".join(machines) if machines else machine()),
             f"- Code: runs at commit {', '.join(f'`{c}`' for c in commits) or '—'}; report written at "
             f"`{git_commit()}`",
             f"- Spec: `{spec.path}` (sha256 `{spec.sha256[:16]}`)",
             f"- Wall time of the finished runs: {wall / 3600:.2f} h in all "
             f"({train / 3600:.2f} h in optimizer steps; the rest is evaluation, data preparation and "
             f"probes){copied}",
             ]
    if spec.budget_cpu_hours:
        lines.append(f"- Planned budget: {spec.budget_cpu_hours:g} CPU-hours"
                     + (f" ({spec.budget_note})" if spec.budget_note else ""))
    lines += [f"- Report generation: {report_seconds:.1f} s", ""]
    return lines


def _stats_rule(col: Collected, axes: List[str]) -> List[str]:
    return ["## Statistics", "",
            f"Seeds: {_seed_statement(col, axes)}. Values are the final validation loss (nats/token, "
            "held-out works) as mean ± sample std over seeds. Paired differences: " + NOISE_RULE + ". "
            "A cell reads `Δ ± s.e. (t, k/n seeds lower): verdict`. "
            "† marks pairs whose sublayer initialisation differs although the seed is the same (the "
            "scheme's constructor draws random numbers), so only the data order is shared.", ""]


def _runs_table(col: Collected) -> List[str]:
    rows = []
    by_hash: Dict[str, List[Result]] = {}
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
        rows.append([names, f"`{h}`", state, _f(r.loss) if r.done else "—",
                     f"{r.run.tokens:,}", _f(r.train_seconds, 0) if r.done else "—",
                     f"{r.summary['params']:,}" if r.done else "—"])
    return ["## All runs", "", md_table(["run", "hash", "state", "val loss", "tokens", "train s", "params"],
                                        rows, "llllrrr"), ""]


# ----------------------------------------------------------------------------- curves


def mean_curve(results: List[Result], x: str) -> Optional[Tuple[np.ndarray, np.ndarray]]:
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


# ----------------------------------------------------------------------------- generic


def _generic(rep: Report) -> None:
    col = rep.col
    axes = [a for a, _ in col.spec.axes]
    groups: Dict[Tuple, Dict[str, str]] = {}
    for r in col.results:
        groups.setdefault(tuple(r.run.labels.get(a) for a in axes), {a: r.run.labels[a] for a in axes})
    base = col.spec.baseline
    base_axis = next((a for a, pts in col.spec.axes if any(p.label == base for p in pts)), None)
    rows, curves = [], {}
    for key, labels in groups.items():
        losses = col.losses(**labels)
        row = [_group_label(labels, axes), fmt_mean_std(list(losses.values()))]
        if base is not None and base_axis is not None:
            ref = col.losses(**{**labels, base_axis: base})
            row.append("—" if labels.get(base_axis) == base else rep.paired_cell(losses, ref))
        rows.append(row)
        c = mean_curve(col.select(**labels), "tokens")
        if c is not None:
            curves[_group_label(labels, axes)] = c
    headers = ["group", "val loss"] + ([f"Δ vs {base}"] if base else [])
    rep.add("## Results", "", md_table(headers, rows), "")
    if curves:
        rep.figure("loss_curves.png", "Validation loss against training tokens (mean over seeds).",
                   lambda p: figures.curves_plot([("validation loss", "tokens", curves)], p, col.spec.name))


# ----------------------------------------------------------------------------- scaling


def _fmt_multipliers(values: List[float]) -> str:
    """Per-seed compute multipliers as 'mean× ± std (n seeds)'."""
    m, sd, n = mean_std(values)
    if n == 0:
        return "—"
    return f"{m:.2f}× (1 seed)" if n == 1 else f"{m:.2f}× ± {sd:.2f} ({n} seeds)"


def _scaling(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    sizes, schemes = col.points("size"), col.points("scheme")
    others = [s for s in schemes if s != base]
    rows, series = [], {s: {"C": [], "mean": [], "std": [], "fit": None} for s in schemes}
    per_seed: Dict[str, Dict[int, Tuple[List[float], List[float]]]] = {s: {} for s in schemes}
    C_of: Dict[str, float] = {}
    for size in sizes:
        model = _model_of(col, size=size, scheme=base) or _model_of(col, size=size)
        runs = col.select(size=size)
        if model is None or not runs:
            continue
        tokens = runs[0].run.tokens
        seq = runs[0].run.train.seq_len
        C = flops_per_token(model, seq) * tokens / PFLOPS_DAY
        C_of[size] = C
        ref = col.losses(size=size, scheme=base)
        blk = next((r.run.model for r in runs if r.run.model.residual == "block"), None)
        shape = f"d={model['d_model']}, L_b={model['n_layers']}"
        if blk is not None:
            shape += f" (block S={blk.block_size}, N={blk.num_blocks})"
        row = [size, shape, f"{matmul_params(model):,}",
               f"{tokens:,}", f"{C * PFLOPS_DAY:.3g}", f"{C:.3g}"]
        for s in schemes:
            losses = col.losses(size=size, scheme=s)
            row.append(fmt_mean_std(list(losses.values())))
            m, sd, n = mean_std(losses.values())
            if n:
                series[s]["C"].append(C)
                series[s]["mean"].append(m)
                series[s]["std"].append(sd)
            for seed, v in losses.items():
                per_seed[s].setdefault(seed, ([], []))
                per_seed[s][seed][0].append(C)
                per_seed[s][seed][1].append(v)
        for s in others:
            ok = shares_sublayer_init(_model_of(col, size=size, scheme=s) or model, model)
            row.append(rep.paired_cell(col.losses(size=size, scheme=s), ref, ok))
        rows.append(row)
    headers = (["size", "shape", "N_matmul", "tokens", "C (FLOPs)", "C (PF-days)"]
               + [f"{s} loss" for s in schemes] + [f"Δ {s} − {base}" for s in others])
    rep.add("## Losses per size", "", f"Compute: {FLOPS_FORMULA}.", "", md_table(headers, rows), "")

    fits = {}
    fit_rows = []
    for s in schemes:
        try:
            fits[s] = fit_power_law(series[s]["C"], series[s]["mean"])
            series[s]["fit"] = fits[s]
            fit_rows.append([s, f"{fits[s].A:.4g}", f"{fits[s].alpha:.4f}", f"{fits[s].r2:.3f}",
                             str(fits[s].n)])
        except ValueError:
            fit_rows.append([s, "—", "—", "—", str(len(series[s]["C"]))])
    rep.add("## Power-law fits", "",
            "L = A·C^-α fitted by least squares on log L vs log C over the per-size mean losses "
            "(C in PFLOP/s-days). Paper (MoE, 194M–528M): baseline 1.891·C^-0.057, Block 1.870·C^-0.058, "
            "Full 1.865·C^-0.057. A depends on the compute range and unit, so compare α and the "
            "compute multiplier rather than A.", "",
            md_table(["scheme", "A", "α", "R² (log space)", "sizes"], fit_rows), "")

    if C_of and base in fits:
        C_max = max(C_of.values())
        largest = max(C_of, key=C_of.get)
        lines = [f"Compute multiplier at the largest budget (size {largest}, C = {C_max:.3g} PF-days): how much "
                 f"more compute {base} needs, on its fitted curve, to reach each scheme's loss. The paper "
                 "reports 1.25× for Block AttnRes.", ""]
        mrows = []
        for s in others:
            if s not in fits:
                mrows.append([s, "—", "—", "—"])
                continue
            from_fit = compute_multiplier(fits[base], fits[s], C_max)
            obs, base_obs = col.losses(size=largest, scheme=s), col.losses(size=largest, scheme=base)
            from_point = [measured_multiplier(base_obs[k], obs[k], fits[base].alpha)
                          for k in sorted(set(obs) & set(base_obs)) if finite(obs[k]) and finite(base_obs[k])]
            seeds_mult = []
            for seed, (Cs, Ls) in per_seed[s].items():
                bC, bL = per_seed[base].get(seed, ([], []))
                if len(Cs) >= 2 and len(bC) >= 2 and len(set(Cs)) >= 2 and len(set(bC)) >= 2:
                    seeds_mult.append(compute_multiplier(fit_power_law(bC, bL), fit_power_law(Cs, Ls), C_max))
            mrows.append([s, f"{from_fit:.2f}×", _fmt_multipliers(from_point), _fmt_multipliers(seeds_mult)])
        rep.add(*lines, md_table(["scheme", "from the fits", f"from the losses measured at {largest}",
                                  "per-seed fits (mean ± std)"], mrows), "",
                f"From the losses measured at {largest}: each seed's loss ratio to the same seed's {base} "
                f"run, turned into compute through {base}'s fitted slope, (L_{base} / L)^(1/α), so the fitted "
                f"curves' residuals at {largest} do not enter. Per-seed fits pair each seed's curve of a "
                "scheme with the same seed's baseline curve. With a small compute range a small difference "
                "in α moves the fitted multiplier a lot.", "")
    if any(series[s]["C"] for s in schemes):
        rep.figure("scaling.png", "Figure 4 analogue: validation loss against training compute, "
                   "mean ± std over seeds, with the fitted power laws.",
                   lambda p: figures.scaling_plot(series, p, f"{col.spec.name}: loss vs compute"))


# ----------------------------------------------------------------------------- ablations / block size


def _variant_rows(col: Collected) -> Tuple[str, List[str]]:
    axis = col.spec.axes[0][0] if col.spec.axes else "run"
    return axis, col.points(axis)


def _ablations(rep: Report) -> None:
    col = rep.col
    axis, labels = _variant_rows(col)
    base = col.spec.baseline or labels[0]
    ref = col.losses(**{axis: base})
    base_model = _model_of(col, **{axis: base})
    paper_base = col.point(axis, base).paper_loss
    means = {l: mean_std(col.losses(**{axis: l}).values())[0] for l in labels}
    paper = {l: col.point(axis, l).paper_loss for l in labels}
    ours_rank = dict(zip([l for l in labels if finite(means[l])],
                         ranks([means[l] for l in labels if finite(means[l])])))
    paper_rank = dict(zip([l for l in labels if paper[l] is not None],
                          ranks([paper[l] for l in labels if paper[l] is not None])))
    rows, bars = [], []
    for l in labels:
        losses = col.losses(**{axis: l})
        div = [r for r in col.select(**{axis: l}) if r.state == "diverged"]
        p = paired(losses, ref)
        model = _model_of(col, **{axis: l})
        ok = True if (model is None or base_model is None or l == base) else shares_sublayer_init(model, base_model)
        pd = None if paper[l] is None or paper_base is None else paper[l] - paper_base
        rows.append([l + (" (headline)" if l in col.spec.headline else ""),
                     _f(paper[l], 3), _f(pd, 3, sign=True) if l != base else "—",
                     f"{paper_rank[l]:g}" if l in paper_rank else "—",
                     fmt_mean_std(list(losses.values())) + (f" ({len(div)} diverged)" if div else ""),
                     "—" if l == base else rep.paired_cell(losses, ref, ok),
                     f"{ours_rank[l]:g}" if l in ours_rank else "—"])
        if l != base:
            bars.append((l, p.mean, p.se, pd))
    rep.add("## Results beside the paper", "",
            "The paper's absolute losses come from a 16-layer MoE model trained on far more tokens; compare "
            "the deltas to the baseline and the ranks, not the absolute values. Rank 1 = lowest loss.", "",
            md_table(["variant", "paper loss", "paper Δ", "paper rank", "our loss", f"our Δ vs {base} (paired)",
                      "our rank"], rows, "lrrrrlr"), "")
    both = [l for l in labels if l in ours_rank and l in paper_rank]
    rho = spearman([means[l] for l in both], [paper[l] for l in both])
    agree = [l for l in labels if l != base and l in ours_rank and paper[l] is not None and paper_base is not None
             and finite(means[l]) and finite(means.get(base, float("nan")))
             and (means[l] < means[base]) == (paper[l] < paper_base)]
    n_cmp = sum(1 for l in labels if l != base and l in ours_rank and paper[l] is not None)
    rep.add(f"Rank agreement with the paper over {len(both)} rows: Spearman ρ = "
            f"{'—' if rho is None else f'{rho:+.2f}'}. Sign of Δ vs {base} agrees with the paper for "
            f"{len(agree)} of {n_cmp} variants (by mean; see the verdicts for which differences exceed "
            "seed noise).", "")
    if bars:
        rep.figure("ablations.png", f"Δ validation loss vs {base}: this run (left, ± s.e. over seeds) and the "
                   "paper's Table 4 (right).",
                   lambda pth: figures.delta_bars(bars, pth, col.spec.name, base))


def _block_size(rep: Report) -> None:
    col = rep.col
    axis, labels = _variant_rows(col)
    base = col.spec.baseline or next((l for l in labels if (_model_of(col, **{axis: l}) or {}).get("residual")
                                      == "prenorm"), labels[0])
    ref = col.losses(**{axis: base})
    full = next((l for l in labels if col.point(axis, l) and _planned_model(col, axis, l).residual == "full"),
                None)
    ref_full = col.losses(**{axis: full}) if full else {}
    rows, S_pts, means, stds, paper = [], [], [], [], {}
    uneven = [l for l in labels if _planned_model(col, axis, l).attnres_block_sizes is not None]
    for l in labels:
        m = _planned_model(col, axis, l)
        losses = col.losses(**{axis: l})
        if l in uneven:
            continue  # not one S: compared with the uniform row of the same N below
        if m.residual in ("block", "full"):
            S, N = m.block_size, m.num_blocks
            pt = col.point(axis, l)
            if pt.paper_loss is not None:
                paper[S] = pt.paper_loss
            mm, sd, n = mean_std(losses.values())
            if n:
                S_pts.append(S)
                means.append(mm)
                stds.append(sd)
        else:
            S, N = None, None
        rows.append([l, "—" if S is None else str(S), "—" if N is None else str(N),
                     "—" if N is None else str(N + 1),
                     _f(col.point(axis, l).paper_loss, 3), fmt_mean_std(list(losses.values())),
                     "—" if l == base else rep.paired_cell(losses, ref),
                     "—" if full is None or l in (full, base) else rep.paired_cell(losses, ref_full)])
    rep.add("## Loss against block size", "",
            "S = sublayers per depth block, N = depth blocks; a sublayer reads at most N + 1 sources "
            "(the embedding, the completed blocks and the running partial sum). S = 1 is Full AttnRes; "
            "S = L is one block (a standard residual with the embedding kept as a separate source). "
            "Paper (Figure 6): S = 1 1.737; S = 2, 4, 8 ≈ 1.746; S = 16, 32 drift back toward the "
            "baseline 1.766.", "",
            md_table(["variant", "S", "N", "max sources", "paper loss", "our loss", f"Δ vs {base} (paired)",
                      f"Δ vs {full} (paired)"], rows, "lrrrrrll"), "")
    if uneven:
        _uneven_blocks(rep, axis, labels, uneven, base)
    base_mean = mean_std(ref.values())[0]
    paper_base = col.point(axis, base).paper_loss if col.point(axis, base) else None
    if S_pts:
        order = np.argsort(S_pts)
        rep.figure("block_size.png", "Figure 6 analogue: validation loss against block size (mean ± std over "
                   "seeds), the baseline as a dashed line; the paper's curve on the right.",
                   lambda p: figures.block_size_plot(np.array(S_pts)[order], np.array(means)[order],
                                                     np.array(stds)[order], base_mean, paper, paper_base, p,
                                                     col.spec.name))


def _uneven_blocks(rep: Report, axis: str, labels: List[str], uneven: List[str], base: str) -> None:
    """Uneven (e.g. learned) depth blocks against the equal blocks with the same N (issue 18)."""
    col = rep.col
    uniform = {}  # N -> the label of a Block row with equal blocks and N blocks
    for l in labels:
        m = _planned_model(col, axis, l)
        if l not in uneven and m.residual == "block":
            uniform.setdefault(m.num_blocks, l)
    ref = col.losses(**{axis: base})
    rows = []
    for l in uneven:
        m = _planned_model(col, axis, l)
        losses = col.losses(**{axis: l})
        same_n = uniform.get(m.num_blocks)
        rows.append([l, str(list(m.attnres_block_sizes)), str(m.num_blocks),
                     "—" if same_n is None else f"{same_n} ({_planned_model(col, axis, same_n).block_size} each)",
                     fmt_mean_std(list(losses.values())),
                     "—" if same_n is None else rep.paired_cell(losses, col.losses(**{axis: same_n})),
                     rep.paired_cell(losses, ref)])
    rep.add("## Uneven depth blocks against equal ones", "",
            "Block AttnRes with the depth-block sizes given (`attnres_block_sizes`, in sublayers; the "
            "learned rows come from `attnres placement` on the Full AttnRes runs, command in the spec) "
            "against the equal blocks with the same N, paired over seeds.", "",
            md_table(["variant", "block sizes", "N", "equal blocks, same N", "our loss",
                      "Δ vs equal blocks (paired)", f"Δ vs {base} (paired)"], rows, "lllllll"), "")


def _planned_model(col: Collected, axis: str, label: str):
    for r in col.results:
        if r.run.labels.get(axis) == label:
            return r.run.model
    return None


# ----------------------------------------------------------------------------- arena


def _arena(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    schemes, budgets = col.points("scheme"), col.points("budget") or [None]
    panels = []
    for budget in budgets:
        sel = {"budget": budget} if budget else {}
        ref = col.losses(scheme=base, **sel)
        base_runs = [r for r in col.select(scheme=base, **sel) if r.done]
        base_params = base_runs[0].summary["params"] if base_runs else None
        base_secs = mean_std([r.train_seconds for r in base_runs])[0]
        base_model = _model_of(col, scheme=base, **sel)
        rows, curves_tok, curves_time = [], {}, {}
        for s in schemes:
            runs = [r for r in col.select(scheme=s, **sel)]
            done = [r for r in runs if r.done]
            losses = col.losses(scheme=s, **sel)
            secs = mean_std([r.train_seconds for r in done])[0]
            tps = mean_std([r.summary["tokens_per_second"] for r in done])[0]
            params = done[0].summary["params"] if done else None
            model = _model_of(col, scheme=s, **sel)
            ok = True if (s == base or model is None or base_model is None) else shares_sublayer_init(model,
                                                                                                    base_model)
            rows.append([s, "—" if params is None or base_params is None else f"{params - base_params:+,}",
                         f"{runs[0].run.train.steps:,}" if runs else "—",
                         f"{runs[0].run.tokens:,}" if runs else "—",
                         _f(secs, 0), "—" if not finite(secs) or not finite(base_secs) else f"{secs / base_secs:.2f}",
                         _f(tps, 0), fmt_mean_std(list(losses.values())),
                         "—" if s == base else rep.paired_cell(losses, ref, ok)])
            for store, x in ((curves_tok, "tokens"), (curves_time, "seconds")):
                c = mean_curve(done, x)
                if c is not None:
                    store[s] = c
        title = f"budget: {budget}" if budget else "results"
        rep.add(f"## {title}", "",
                md_table(["scheme", "params vs " + base, "steps", "tokens", "train s (mean)",
                          f"time / {base}", "tokens/s", "val loss", f"Δ vs {base} (paired)"], rows,
                         "lrrrrrrrl"), "")
        if budget and "time" in budget:
            rep.add("Equal wall-clock: each scheme's step count was set in the spec from its measured "
                    "throughput relative to the baseline; the `time / baseline` column shows how well the "
                    "actual optimizer-step time matched on the machine that ran it.", "")
        if budget is None or "time" not in budget:
            panels.append((f"{budget or 'all runs'}: loss vs tokens", "training tokens", curves_tok))
        if budget is None or "time" in budget:
            panels.append((f"{budget or 'all runs'}: loss vs time", "training seconds (optimizer steps)",
                           curves_time))
    if any(p[2] for p in panels):
        rep.figure("arena_curves.png", "Validation loss (mean over seeds) against training tokens at equal "
                   "tokens, and against optimizer-step time at equal wall-clock.",
                   lambda p: figures.curves_plot(panels, p, col.spec.name))


# ----------------------------------------------------------------------------- dynamics


def _per_block(values: List[float]) -> np.ndarray:
    """Per Transformer block: RMS over its two sublayers (attention, MLP)."""
    v = np.asarray(values, dtype=float)
    return np.sqrt((v[0::2] ** 2 + v[1::2] ** 2) / 2)


def _spearman_depth(v: np.ndarray) -> Optional[float]:
    return spearman(list(range(len(v))), list(v))


def _dynamics(rep: Report) -> None:
    col = rep.col
    schemes = col.points("scheme")
    base = col.spec.baseline or "prenorm"
    focus = [s for s in schemes if s in (base, "block", "full")] or schemes[:3]
    profiles = {"out": {}, "in": {}, "grad": {}}
    stat_rows = []
    cv: Dict[str, Dict[int, float]] = {}
    mono: Dict[str, Dict[int, float]] = {}
    for s in schemes:
        done = [r for r in col.select(scheme=s) if r.done and r.probes]
        if not done:
            continue
        out = np.stack([_per_block(r.probes["output_rms"]) for r in done])
        inp = np.stack([np.asarray(r.probes["input_rms"], dtype=float)[0::2] for r in done])
        grad = np.stack([np.asarray(r.probes["block_grad_norm"], dtype=float) for r in done])
        if s in focus:
            for key, arr in (("out", out), ("in", inp), ("grad", grad)):
                sd = arr.std(0, ddof=1) if len(arr) > 1 else np.zeros(arr.shape[1])
                profiles[key][s] = (arr.mean(0), sd)
        cv[s] = {r.run.seed: float(g.std() / g.mean()) for r, g in zip(done, grad)}
        mono[s] = {r.run.seed: _spearman_depth(o) for r, o in zip(done, out)}
        stat_rows.append([s, str(len(done)),
                          fmt_mean_std(list(mono[s].values()), 2),
                          fmt_mean_std([o[-1] / o[0] for o in out], 2),
                          fmt_mean_std([i[-1] / i[0] for i in inp], 2),
                          fmt_mean_std(list(cv[s].values()), 3),
                          fmt_mean_std([g.max() / g.min() for g in grad], 2)])
    rep.add("## Training dynamics (Figure 5 b, c)", "",
            "Measured once at the end of training on one validation batch: *output magnitude* of "
            "Transformer block i = RMS of its attention and MLP outputs f (over batch, tokens, channels); "
            "*input magnitude* = RMS of the hidden state h read by its attention sublayer; *gradient "
            "magnitude* = L2 norm of the loss gradient over the block's parameters (one backward pass). "
            "Paper: the baseline's output magnitude grows monotonically with depth, Block AttnRes stays "
            "bounded and periodic, and its gradient magnitude is more uniform.", "",
            md_table(["scheme", "seeds", "Spearman(depth, output)", "output last/first", "input last/first",
                      "gradient CV across blocks", "gradient max/min"], stat_rows), "")
    if base in cv:
        cmp_rows = []
        for s in schemes:
            if s != base and s in cv:
                cmp_rows.append([s, rep.paired_cell(cv[s], cv[base]), rep.paired_cell(mono[s], mono[base])])
        if cmp_rows:
            rep.add(f"Paired over seeds against {base} (negative = more uniform gradients / less monotone "
                    "growth):", "", md_table(["scheme", "Δ gradient CV", "Δ Spearman(depth, output)"],
                                             cmp_rows, "lll"), "")
    if profiles["out"]:
        rep.figure("dynamics.png", "Figure 5 analogue: per-block output magnitude, input (hidden-state) "
                   "magnitude and gradient magnitude at the end of training (mean ± std over seeds).",
                   lambda p: figures.depth_profile_plot(
                       [("output magnitude (RMS of f)", "RMS", profiles["out"]),
                        ("input magnitude (RMS of h)", "RMS", profiles["in"]),
                        ("gradient magnitude", "‖∇ block params‖", profiles["grad"])], p, col.spec.name,
                       log=True))

    heat_rows = []
    for s in schemes:
        done = [r for r in col.select(scheme=s) if r.done and r.probes and r.probes.get("depth_weights")]
        if not done:
            continue
        M = mean_matrix([nan_matrix(r.probes["depth_weights"]) for r in done])
        labels = done[0].probes["depth_sources"]
        heat_rows.append(_depth_weight_stats(s, M, len(done)))
        if s in ("full", "block"):
            from attnres.analysis.plots import plot_depth_heatmaps

            rep.figure(f"depth_weights_{s}.png",
                       f"Figure 8 analogue, {s}: mean depth weights (over {len(done)} seeds, one validation "
                       "batch) of the pre-attention and pre-MLP inputs; the last row is the final "
                       "aggregation.",
                       lambda p, M=M, labels=labels, s=s: plot_depth_heatmaps(
                           M, labels, p, f"{s}: mean depth weights"))
    if heat_rows:
        rep.add("Depth-weight structure (Figure 8; rows = consumers reading more than one source): weight "
                "on the embedding, on the most recent source, and how often the most recent source gets the "
                "largest weight, against uniform weights over the same sources; *width* = entropy of a row / "
                "log(sources), 1 for uniform weights, 0 for a single source, for pre-attention and pre-MLP "
                "inputs (paper: pre-attention inputs wider, pre-MLP inputs more local).", "",
                md_table(["scheme", "seeds", "mean weight on embedding", "uniform would give",
                          "mean weight on most recent", "rows where most recent is largest",
                          "width pre-attention", "width pre-MLP"], heat_rows), "")

    _routing_sharpness(rep, schemes)

    mats, notes, r2_rows = {}, {}, []
    for s in schemes:
        done = [r for r in col.select(scheme=s) if r.done and r.probes and r.probes.get("mixing")]
        if not done:
            continue
        M = mean_matrix([nan_matrix(r.probes["mixing"]) for r in done])
        r2 = min(min(x for x in r.probes["mixing_r2"] if x is not None) for r in done)
        mats[s] = M
        notes[s] = f"min R² {r2:.3f}"
        r2_rows.append([s, str(len(done)), f"{r2:.4f}", "exact" if r2 > 0.9999 else "best scalar fit"])
    if mats:
        rep.add("## Depth mixing matrices (Figure 9)", "",
                "M[l, i] = the coefficient of source i (0 = embedding, i = output of sublayer i − 1) in the "
                "input of consumer l (sublayer l, last row = the input of the final norm), by per-token least "
                "squares, averaged over tokens and seeds. Every scheme has one: for prenorm it is 1 on and "
                "below the diagonal by construction; AttnRes rows are its depth weights (Block: each "
                "block's weight repeated over its sublayers); for per-channel schemes (LayerScale, "
                "Highway) it is the best scalar description and R² says how much it explains.", "",
                md_table(["scheme", "seeds", "min R² over rows", "M is"], r2_rows), "")
        rep.figure("mixing_matrices.png", "Figure 9 analogue: depth mixing matrix M of each scheme "
                   "(own colour scale per panel).",
                   lambda p: figures.matrices_plot(mats, p, col.spec.name, notes))


# Schemes whose streams report depth weights (the routing probe reads them); every other scheme's
# mixing is in the Figure 9 matrices.
DEPTH_ROUTED = ("full", "block", "gated")

# "Delta Attention Residuals" (2026), at 1B parameters, as summarised in issue 18: the largest depth
# weight is about 0.6 when the sources are sublayer outputs ("deltas", the paper's sources) and about
# 0.2 when they are accumulated hidden states.
FOLLOW_UP_MAX_WEIGHT = {"outputs": "≈ 0.6", "states": "≈ 0.2"}


def _routing_sharpness(rep: Report, schemes: List[str]) -> None:
    """Routing sharpness (issue 18): per scheme, the mean over consumers reading >= 2 sources of the
    largest depth weight and of the entropy / log K (the ``routing`` probe), beside uniform routing and
    the follow-up paper's values."""
    col = rep.col
    rows = []
    for s in schemes:
        runs = col.select(scheme=s)
        model = _model_of(col, scheme=s)
        if not runs or model is None or model.get("residual") not in DEPTH_ROUTED:
            continue
        sources = model.get("attnres_sources", "outputs") if model["residual"] != "gated" else "outputs"
        paper = FOLLOW_UP_MAX_WEIGHT[sources] if model["residual"] != "gated" else "—"
        what = f"{model['residual']}, {sources}"
        done = [r for r in runs if r.done and r.probes]
        measured = [r.probes["routing"] for r in done if r.probes.get("routing")]
        if not measured:
            state = ("not yet run" if not done else
                     "not measured: its runs finished before the routing probe existed")
            rows.append([s, what, "0", state, "", "", "", paper])
            continue
        maxes, widths, uniform = [], [], []
        for probe in measured:
            keep = [l for l, k in enumerate(probe["n_sources"]) if k >= 2]
            maxes.append(float(np.mean([probe["max_weight"][l] for l in keep])))
            widths.append(float(np.mean([probe["entropy"][l] / math.log(probe["n_sources"][l]) for l in keep])))
            uniform.append(float(np.mean([1 / probe["n_sources"][l] for l in keep])))
        rows.append([s, what, str(len(measured)), fmt_mean_std(maxes, 3), f"{np.mean(uniform):.3f}",
                     f"{np.mean(maxes) / np.mean(uniform):.2f}", fmt_mean_std(widths, 3), paper])
    if not rows:
        return
    rep.add("## Routing sharpness (issue 18)", "",
            "Per consumer (every sublayer and the final aggregation that reads at least 2 sources), on one "
            "validation batch of the final model: the largest depth weight of a token (of a token and head "
            "for multi-head schemes), averaged over tokens, then over consumers; *width* = the weights' "
            "entropy / log K (1 = uniform over the K sources, 0 = one source). Uniform routing would give "
            "the mean of 1/K shown beside it. The follow-up paper (\"Delta Attention Residuals\", 2026, "
            "1B parameters, as summarised in issue 18) reports a largest weight of about 0.6 with output "
            "sources and about 0.2 with state sources; its models are larger and deeper, so compare "
            "the ratio between our output- and state-sourced rows rather than the absolute values.", "",
            md_table(["scheme", "residual, sources", "seeds", "mean largest weight", "uniform would give",
                      "largest / uniform", "width", "follow-up paper, largest weight"], rows, "llrlrrll"), "")


def _depth_weight_stats(scheme: str, M: np.ndarray, seeds: int) -> List[str]:
    """Embedding weight, locality and width of the mean depth weights (rows reading >= 2 sources).
    Width = entropy of a row divided by log(number of sources): 1 = uniform, 0 = one source; split
    into pre-attention (even sublayers) and pre-MLP (odd) rows."""
    emb, recent, uniform, top = [], [], [], 0
    width: Dict[str, List[float]] = {"attn": [], "mlp": []}
    rows = 0
    n_sub = M.shape[0] - 1
    for l, row in enumerate(M):
        idx = np.where(~np.isnan(row))[0]
        if len(idx) < 2:
            continue
        rows += 1
        w = row[idx]
        emb.append(row[0] if not np.isnan(row[0]) else 0.0)
        recent.append(w[-1])
        uniform.append(1.0 / len(idx))
        top += int(np.argmax(w) == len(idx) - 1)
        if l < n_sub and np.all(w >= 0) and w.sum() > 0:
            p = w / w.sum()
            h = -sum(x * math.log(x) for x in p if x > 0) / math.log(len(p))
            width["attn" if l % 2 == 0 else "mlp"].append(h)
    return [scheme, str(seeds), _f(np.mean(emb), 3), _f(np.mean(uniform), 3), _f(np.mean(recent), 3),
            f"{top}/{rows}", _f(np.mean(width["attn"]) if width["attn"] else float("nan"), 3),
            _f(np.mean(width["mlp"]) if width["mlp"] else float("nan"), 3)]


# ----------------------------------------------------------------------------- architecture sweep


def _arch_sweep(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    shapes, schemes = col.points("shape"), col.points("scheme")
    others = [s for s in schemes if s != base]
    rows, series, best = [], {}, {}
    ratio_of = {}
    for shape in shapes:
        m = _planned_model(col, "shape", shape)
        runs = col.select(shape=shape)
        if m is None or not runs:
            continue
        ratio = m.d_model / m.n_layers
        ratio_of[shape] = ratio
        model = _model_of(col, shape=shape)
        seq = runs[0].run.train.seq_len
        non_emb = matmul_params(model) - model["d_model"] * model["vocab_size"]
        row = [shape, str(m.d_model), str(m.n_layers), f"{ratio:.1f}", f"{non_emb:,}",
               f"{flops_per_token(model, seq):.3g}"]
        ref = col.losses(shape=shape, scheme=base)
        for s in schemes:
            row.append(fmt_mean_std(list(col.losses(shape=shape, scheme=s).values())))
        for s in others:
            row.append(rep.paired_cell(col.losses(shape=shape, scheme=s), ref))
        rows.append(row)
    rep.add("## Loss over the shape grid", "",
            "Each shape keeps the non-embedding parameters (attention and SwiGLU weights, listed) and the "
            "training tokens about fixed, so the compute per token (FLOPs/token, same formula as the "
            "scaling experiment, LM head and attention included) is about fixed too.", "",
            md_table(["shape", "d_model", "L_b", "d/L_b", "non-embedding matmul params", "FLOPs/token"]
                     + [f"{s} loss" for s in schemes] + [f"Δ {s} − {base}" for s in others], rows), "")
    opt_rows = []
    for s in schemes:
        pts = [(ratio_of[sh], mean_std(col.losses(shape=sh, scheme=s).values())) for sh in shapes
               if sh in ratio_of]
        pts = [(x, m, sd) for x, (m, sd, n) in pts if n]
        if not pts:
            continue
        pts.sort()
        xs, ms, sds = (np.array(v) for v in zip(*pts))
        series[s] = (xs, ms, sds)
        i = int(np.argmin(ms))
        vertex = _parabola_vertex(np.log(xs), ms)
        best[s] = float(np.exp(vertex)) if vertex is not None else None
        opt_rows.append([s, f"{xs[i]:.1f}", _f(ms[i]),
                         "—" if vertex is None else f"{np.exp(vertex):.1f}"])
    if opt_rows:
        rep.add("Optimum per scheme: the grid point with the lowest mean loss, and the vertex of a parabola "
                "fitted to loss against log(d/L_b) (— when the fit is not convex or its vertex lies outside "
                "the grid). Paper: baseline optimum d_model/L_b ≈ 60, AttnRes ≈ 45 (deeper and narrower), "
                "AttnRes better in all 25 cells.", "",
                md_table(["scheme", "best grid d/L_b", "its loss", "parabola vertex d/L_b"], opt_rows), "")
    for s in others:
        pairs = [paired(col.losses(shape=sh, scheme=s), col.losses(shape=sh, scheme=base)) for sh in shapes]
        pairs = [p for p in pairs if p.n]
        if pairs:
            rep.add(f"{s} has a lower mean loss than {base} in {sum(p.mean < 0 for p in pairs)} of "
                    f"{len(pairs)} shapes; beyond seed noise in {sum(p.verdict == 'better' for p in pairs)} "
                    f"(worse beyond noise in {sum(p.verdict == 'worse' for p in pairs)}).", "")
    if series:
        rep.figure("arch_sweep.png", "Loss against d_model/L_b at fixed parameters and tokens (mean ± std "
                   "over seeds); dotted lines: parabola-vertex optima.",
                   lambda p: figures.sweep_plot(series, p, col.spec.name, best))


def _parabola_vertex(x: np.ndarray, y: np.ndarray) -> Optional[float]:
    if len(x) < 3:
        return None
    a, b, _ = np.polyfit(x, y, 2)
    if a <= 0:
        return None
    v = -b / (2 * a)
    return float(v) if x.min() <= v <= x.max() else None


# ----------------------------------------------------------------------------- backbones (Kimi Linear)

BACKBONE_NAMES = {"kimi_linear": "Kimi Linear (KDA + MLA, MoE)", "llama": "LLaMA (GQA + RoPE, SwiGLU)"}


def _final_moe_imbalance(r: Result) -> Optional[float]:
    """Mean over MoE layers of max load / mean load - 1 at the last training step (None: no experts)."""
    train = r.metrics().get("train", [])
    if not train:
        return None
    last = max(train, key=lambda row: row["step"])
    values = [float(v) for k, v in last.items() if k.startswith("moe_maxvio.") and v not in ("", None)]
    return sum(values) / len(values) if values else None


def _median_step_seconds(r: Result) -> float:
    steps = [float(row["step_seconds"]) for row in r.metrics().get("train", []) if "step_seconds" in row]
    return float(np.median(steps)) if steps else float("nan")


def _kimi_linear(rep: Report) -> None:
    """Per backbone the same schemes on the same data, size and budget: losses and paired Δ against
    the baseline of the same backbone, step-time ratios measured in the same suite, the routers'
    final balance, depth-weight heatmaps; then whether the backbone changes the verdict."""
    col = rep.col
    base = col.spec.baseline or "prenorm"
    backbones, schemes = col.points("backbone"), col.points("scheme")
    verdicts: Dict[str, Dict[str, Paired]] = {}
    for bb in backbones:
        ref = col.losses(backbone=bb, scheme=base)
        base_runs = [r for r in col.select(backbone=bb, scheme=base) if r.done]
        base_step = float(np.mean([_median_step_seconds(r) for r in base_runs])) if base_runs else float("nan")
        rows = []
        for s in schemes:
            done = [r for r in col.select(backbone=bb, scheme=s) if r.done]
            losses = col.losses(backbone=bb, scheme=s)
            step = float(np.mean([_median_step_seconds(r) for r in done])) if done else float("nan")
            moe = [v for v in (_final_moe_imbalance(r) for r in done) if v is not None]
            params = done[0].summary.get("params") if done else None
            rows.append([s, f"{params:,}" if params else "—", str(len(done)), fmt_mean_std(list(losses.values())),
                         "—" if s == base else rep.paired_cell(losses, ref),
                         _f(step, 3), "—" if not (finite(step) and finite(base_step)) else f"{step / base_step:.2f}",
                         fmt_mean_std(moe, 3) if moe else "—"])
            if s != base:
                verdicts.setdefault(s, {})[bb] = paired(losses, ref)
        rep.add(f"## {BACKBONE_NAMES.get(bb, bb)}", "",
                md_table(["scheme", "params", "seeds", "val loss", f"Δ vs {base} (paired)", "step s (median)",
                          f"step time / {base}", "MoE max load / mean − 1 (last step)"], rows, "lrrrlrrr"), "")
        heat_rows = []
        for s in schemes:
            done = [r for r in col.select(backbone=bb, scheme=s) if r.done and r.probes
                    and r.probes.get("depth_weights")]
            if not done or s not in ("block", "full"):
                continue
            M = mean_matrix([nan_matrix(r.probes["depth_weights"]) for r in done])
            labels = done[0].probes["depth_sources"]
            heat_rows.append(_depth_weight_stats(s, M, len(done)))
            from attnres.analysis.plots import plot_depth_heatmaps

            rep.figure(f"depth_weights_{bb}_{s}.png",
                       f"{bb}, {s}: mean depth weights (over {len(done)} seeds, one validation batch) of the "
                       "pre-attention and pre-MLP inputs; the last row is the final aggregation.",
                       lambda p, M=M, labels=labels, s=s, bb=bb: plot_depth_heatmaps(
                           M, labels, p, f"{bb}, {s}: mean depth weights"))
        if heat_rows:
            rep.add("Depth-weight structure (rows = consumers reading more than one source; columns as in the "
                    "dynamics report):", "",
                    md_table(["scheme", "seeds", "mean weight on embedding", "uniform would give",
                              "mean weight on most recent", "rows where most recent is largest",
                              "width pre-attention", "width pre-MLP"], heat_rows), "")
    if len(backbones) > 1 and verdicts:
        rows, sentences = [], []
        for s, by in verdicts.items():
            rows.append([s] + [by[bb].describe() if bb in by else "—" for bb in backbones])
            known = {bb: p.verdict for bb, p in by.items() if p.n > 1}
            if len(known) == len(backbones):
                same = len(set(known.values())) == 1
                sentences.append(f"{s}: " + ", ".join(f"{known[bb]} on {bb}" for bb in backbones)
                                 + (" — the backbone does not change the verdict." if same
                                    else " — the verdict differs between the backbones."))
        rep.add("## Does the backbone change the verdict?", "",
                f"Paired Δ of the final validation loss against {base} of the same backbone (same seeds, data "
                "order, size and tokens; the verdict follows the noise rule above).", "",
                md_table(["scheme"] + [f"Δ on {bb}" for bb in backbones], rows), "")
        if sentences:
            rep.add(*[f"- {line}" for line in sentences], "")


# ----------------------------------------------------------------------------- demo

# how the demo page names its schemes in titles
DEMO_NAMES = {"block": "Block AttnRes", "full": "Full AttnRes"}


def _demo_runs(col: Collected) -> Dict[str, Result]:
    """scheme label -> its finished run (the demo trains one seed)."""
    runs = {}
    for label in col.points("scheme"):
        done = [r for r in col.select(scheme=label) if r.done]
        if done:
            runs[label] = done[0]
    return runs


def demo_table(col: Collected) -> str:
    """The demo's table: size, tokens, validation loss and speed per scheme; step time (the median
    optimizer step) relative to the baseline's."""
    base = col.spec.baseline or "prenorm"
    runs = _demo_runs(col)
    base_step = runs[base].summary["step_seconds"] if base in runs else None
    lines = [f"| scheme | params | tokens | val loss (nats/token) | bits/byte | tokens/s | step time vs {base} |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, r in runs.items():
        s = r.summary
        ratio = f"{s['step_seconds'] / base_step:.2f}x" if base_step else "—"
        lines.append(f"| {label} | {s['params']:,} | {s['tokens']:,} | {s['val_loss']:.4f} | "
                     f"{s['val_bpb']:.4f} | {s['tokens_per_second']:,.0f} | {ratio} |")
    return "\n".join(lines)


def _demo_page(rep: Report, command: str, wall_seconds: Optional[float]) -> str:
    """The whole demo report: what was trained, the table, loss curves and depth-weight heatmaps."""
    from attnres.analysis.plots import plot_depth_heatmaps, plot_loss_curves
    from attnres.model import ModelConfig

    col, out = rep.col, rep.out
    runs = _demo_runs(col)
    machines = []
    for r in col.unique:
        for inv in (r.info or {}).get("invocations", []):
            if inv.get("machine") and inv["machine"] not in machines:
                machines.append(inv["machine"])
    if wall_seconds is not None:
        wall = f"Wall time (this invocation, including data preparation and reused runs): {wall_seconds / 60:.1f} min"
    else:
        spent = sum(r.wall_seconds for r in runs.values())
        wall = f"Wall time (training, evaluation and probes of the runs): {spent / 60:.1f} min"
    planned = col.results[0].run
    m, t = planned.model, planned.train
    block_size = ModelConfig(**{**m.to_dict(), "residual": "block"}).block_size
    lines = ["# attnres demo", ""] + ([] if col.complete else _status(col)) + [
        f"Command: `{command}`  ",
        f"Machine: {'; '.join(machines) if machines else machine()}  ",
        wall,
        "",
        f"Model: {m.n_layers} Transformer blocks ({m.n_sublayers} sublayers), d_model={m.d_model}, "
        f"{m.n_heads} heads; Block AttnRes with S={block_size} sublayers per block. Training: {t.steps} steps x "
        f"{t.batch_size} x {t.seq_len} tokens, {t.optimizer}, {t.schedule} schedule, lr {t.lr}, seed "
        f"{planned.seed}; same data order for every scheme.",
        "",
        "Validation loss is measured on whole held-out works; one seed, so differences of a few "
        "hundredths may be noise (the experiments report several seeds). Step time is the median "
        "optimizer step (forward + backward + update) measured in the same process.",
        "",
        demo_table(col),
        "",
    ]
    if runs:
        curves = plot_loss_curves({label: str(r.dir) for label, r in runs.items()}, str(out / "loss_curves.png"),
                                  " vs ".join(DEMO_NAMES.get(label, label) for label in runs))
        lines += [f"![loss curves]({Path(curves).name})", ""]
    for label, r in runs.items():
        if not (r.probes and r.probes.get("depth_weights")):
            continue  # no depth weights: prenorm
        name = f"depth_weights_{label}.png"
        plot_depth_heatmaps(nan_matrix(r.probes["depth_weights"]), r.probes["depth_sources"], str(out / name),
                            f"{label} AttnRes: mean depth weights on validation text")
        lines += [f"### {label}: depth weights (pre-attention and pre-MLP inputs)", "", f"![{label}]({name})", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point

BUILDERS: Dict[str, Callable[[Report], None]] = {
    "scaling": _scaling, "ablations": _ablations, "block-size": _block_size, "arena": _arena,
    "dynamics": _dynamics, "arch-sweep": _arch_sweep, "kimi-linear": _kimi_linear, "generic": _generic,
}


def write_report(spec: ExperimentSpec, runs_root, out_dir=None, command: Optional[str] = None,
                 wall_seconds: Optional[float] = None) -> Path:
    """Build ``<out_dir>/REPORT.md`` (default ``reports/NAME/``) and its PNGs; returns the path.
    ``wall_seconds``: the demo page states the wall time of the invocation that trained the runs and
    wrote it (``attnres demo``); without it, the runs' own."""
    started = time.time()
    if not Path(runs_root).is_dir():
        raise FileNotFoundError(
            f"runs directory {runs_root} does not exist; a report reads finished runs from there "
            f"(experiments/runs in a clone of the repository): pass --runs DIR, or run "
            f"`attnres experiment {spec.name}` first")
    out = Path(out_dir) if out_dir is not None else Path(DEFAULT_REPORTS_ROOT) / spec.name
    out.mkdir(parents=True, exist_ok=True)
    col = collect(spec, runs_root)
    rep = Report(col, out)
    command = command or f"attnres report {spec.name}"
    if spec.report == "demo":
        (out / REPORT_FILE).write_text(_demo_page(rep, command, wall_seconds))
        return out / REPORT_FILE
    builder = BUILDERS.get(spec.report, _generic)
    axes = [a for a, _ in spec.axes if a not in ("budget",)]
    if col.n_done:
        builder(rep)
    else:
        rep.add("## Results", "", "No run has finished yet: nothing to report.", "")
    body = rep.lines
    head = ([f"# Experiment `{spec.name}`", ""] + ([spec.description, ""] if spec.description else [])
            + _status(col)
            + _provenance(col, command, time.time() - started) + _stats_rule(col, axes))
    (out / REPORT_FILE).write_text("\n".join(head + body + _runs_table(col)) + "\n")
    return out / REPORT_FILE
