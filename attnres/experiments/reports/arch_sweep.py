"""The architecture-sweep report (axes shape, scheme): loss against d_model/L_b at fixed parameters
and tokens, the optimum per scheme.
"""

from __future__ import annotations

import numpy as np

from attnres.experiments import figures
from attnres.experiments.fit import flops_per_token, matmul_params
from attnres.experiments.reports.common import (
    Report,
    fmt,
    md_table,
    planned_model,
)
from attnres.experiments.stats import fmt_mean_std, mean_std


def arch_sweep_report(rep: Report) -> None:
    col = rep.col
    base = col.spec.baseline or "prenorm"
    shapes, schemes = col.points("shape"), col.points("scheme")
    others = [s for s in schemes if s != base]
    rows, series, best = [], {}, {}
    ratio_of = {}
    for shape in shapes:
        m = planned_model(col, "shape", shape)
        runs = col.select(shape=shape)
        if m is None or not runs:
            continue
        ratio = m.d_model / m.n_layers
        ratio_of[shape] = ratio
        model = runs[0].model
        seq = runs[0].run.train.seq_len
        non_emb = matmul_params(model) - model["d_model"] * model["vocab_size"]
        row = [
            shape,
            str(m.d_model),
            str(m.n_layers),
            f"{ratio:.1f}",
            f"{non_emb:,}",
            f"{flops_per_token(model, seq):.3g}",
        ]
        ref = col.losses(shape=shape, scheme=base)
        for s in schemes:
            row.append(fmt_mean_std(list(col.losses(shape=shape, scheme=s).values())))
        for s in others:
            row.append(rep.paired_cell(col.losses(shape=shape, scheme=s), ref))
        rows.append(row)
    rep.add(
        "## Loss over the shape grid",
        "",
        "Each shape keeps the non-embedding parameters (attention and SwiGLU weights, listed) and the "
        "training tokens about fixed, so the compute per token (FLOPs/token, same formula as the "
        "scaling experiment, LM head and attention included) is about fixed too.",
        "",
        md_table(
            ["shape", "d_model", "L_b", "d/L_b", "non-embedding matmul params", "FLOPs/token"]
            + [f"{s} loss" for s in schemes]
            + [f"Δ {s} − {base}" for s in others],
            rows,
        ),
        "",
    )
    opt_rows = []
    for s in schemes:
        stats = [(ratio_of[sh], mean_std(col.losses(shape=sh, scheme=s).values())) for sh in shapes if sh in ratio_of]
        pts = [(x, m, sd) for x, (m, sd, n) in stats if n]
        if not pts:
            continue
        pts.sort()
        xs, ms, sds = (np.array(v) for v in zip(*pts, strict=True))
        series[s] = (xs, ms, sds)
        i = int(np.argmin(ms))
        vertex = _parabola_vertex(np.log(xs), ms)
        best[s] = float(np.exp(vertex)) if vertex is not None else None
        opt_rows.append([s, f"{xs[i]:.1f}", fmt(ms[i]), "—" if vertex is None else f"{np.exp(vertex):.1f}"])
    if opt_rows:
        rep.add(
            "Optimum per scheme: the grid point with the lowest mean loss, and the vertex of a parabola "
            "fitted to loss against log(d/L_b) (— when the fit is not convex or its vertex lies outside "
            "the grid). Paper: baseline optimum d_model/L_b ≈ 60, AttnRes ≈ 45 (deeper and narrower), "
            "AttnRes better in all 25 cells.",
            "",
            md_table(["scheme", "best grid d/L_b", "its loss", "parabola vertex d/L_b"], opt_rows),
            "",
        )
    for s in others:
        pairs = [rep.paired(col.losses(shape=sh, scheme=s), col.losses(shape=sh, scheme=base)) for sh in shapes]
        pairs = [p for p in pairs if p.n]
        if pairs:
            rep.add(
                f"{s} has a lower mean loss than {base} in {sum(p.mean < 0 for p in pairs)} of "
                f"{len(pairs)} shapes; better after the Holm correction in {sum(p.verdict == 'better' for p in pairs)} "
                f"(worse in {sum(p.verdict == 'worse' for p in pairs)}).",
                "",
            )
    if series:
        rep.figure(
            "arch_sweep.png",
            "Loss against d_model/L_b at fixed parameters and tokens (mean ± std "
            "over seeds); dotted lines: parabola-vertex optima.",
            lambda p: figures.sweep_plot(series, p, col.spec.name, best),
        )


def _parabola_vertex(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 3:
        return None
    a, b, _ = np.polyfit(x, y, 2)
    if a <= 0:
        return None
    v = -b / (2 * a)
    return float(v) if x.min() <= v <= x.max() else None
