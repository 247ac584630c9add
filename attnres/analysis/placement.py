"""Learned depth-block boundaries: where a trained Full AttnRes model says blocks should be.

Input: the mean depth-weight matrix A of a Full AttnRes model (``depth_weight_matrix``, or the
``depth_weights`` of an experiment run's probes.json): row l (0-based sublayer, then the final
aggregation) reads column j (0 = the embedding, j >= 1 the output v_j of sublayer j, 1-based).

Objective (method.md §5, uneven blocks). Split sublayers 1 … L into N contiguous blocks of sizes
s_1 … s_N (sum L); block n covers sublayers a_n … b_n. The attention mass kept inside blocks is

    M(s) = sum_n  sum_{l = a_n}^{b_n}  sum_{j = a_n}^{l - 1}  A[l - 1, j]

the weight each sublayer puts on the outputs of earlier sublayers of its own block: the triangle
of A under the diagonal within each diagonal block. Block AttnRes reads exactly those sources as
one running partial sum, every other output inside one of the complete blocks. Not counted: the
embedding (a source of its own under any placement) and the final aggregation (reads complete
blocks only). Unread entries (NaN, e.g. outside a window) count as 0.

Caution: M grows when blocks merge, so without bounds on the sizes its optimum tends to one large
block and N - 1 single sublayers (it does on the committed ablation runs); bound the sizes with
``max_size``, or use the second objective, which has no such pull:

    objective="fit": minimise E(s), the squared error of the best Block approximation of A.
    Block AttnRes gives all sources merged into one block representation the same weight, so for
    consumer l the best it can do is the mean of A[l, ·] over each group it reads: the complete
    blocks before its own (for the final aggregation: all blocks), and its own block's earlier
    outputs (the partial sum). E(s) = sum over consumers and groups of
    sum_{j in group} (A[l, j] - mean_group A[l, ·])^2. Zero when A is constant on every group.

Both objectives are sums of one term per block (inside(a, b), or the error that block adds for its
own later sublayers and for every consumer after it), so ``best_block_sizes`` optimises them over all
placements with N blocks (optionally each of size in [min_size, max_size]) exactly, by dynamic
programming over the last boundary:

    best[n][e] = max_{e'} best[n-1][e'] + score(e' + 1, e)

in O(N L^2) time after an O(L^2) table of block scores.

    attnres placement experiments/runs/ablations/<hash> [<hash> ...] --blocks 8 [--max-size 8]

prints the sizes as a line for an experiment spec or ``--set`` (``attnres_block_sizes = [...]``),
from the mean weights of the runs given (e.g. the seeds of one config); ``--objective fit`` for the
second objective.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attnres.residual.attnres import equal_block_sizes


def _consumer_matrix(weights) -> np.ndarray:
    """A as float64 with unread entries 0; checks the shape [L + 1, L + 1] of a Full AttnRes matrix."""
    a = np.asarray(weights, dtype=float)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 2:
        raise ValueError(
            f"depth-weight matrix of shape {a.shape} is not a Full AttnRes matrix [L + 1, L + 1] "
            "(rows: sublayers and the final aggregation; columns: embedding and sublayer outputs)"
        )
    return np.nan_to_num(a, nan=0.0)


def _inside_table(a: np.ndarray) -> np.ndarray:
    """inside[a, b] (1-based, a <= b): the mass sublayers a … b put on outputs a … l-1 of the same block."""
    L = a.shape[0] - 1
    inside = np.zeros((L + 2, L + 2))
    for start in range(1, L + 1):
        total = 0.0
        for end in range(start + 1, L + 1):
            total += a[end - 1, start:end].sum()  # sublayer `end` reads v_start … v_{end-1}
            inside[start, end] = total
    return inside


def _fit_error_table(a: np.ndarray) -> np.ndarray:
    """error[a, b] (1-based, a <= b): the squared error block a … b adds for the consumers that read it,
    its own sublayers a+1 … b (through the partial sum) and every consumer after it (one representation)."""
    L = a.shape[0] - 1
    cum = np.concatenate([np.zeros((L + 1, 1)), a.cumsum(1)], axis=1)  # cum[r, j] = sum of a[r, :j]
    cum2 = np.concatenate([np.zeros((L + 1, 1)), (a * a).cumsum(1)], axis=1)

    def sse(rows, lo, hi):  # sum over rows of the squared deviation of a[r, lo:hi + 1] from its mean
        s = cum[rows, hi + 1] - cum[rows, lo]
        return float(np.sum(cum2[rows, hi + 1] - cum2[rows, lo] - s * s / (hi - lo + 1)))

    error = np.zeros((L + 2, L + 2))
    for start in range(1, L + 1):
        own = 0.0
        for end in range(start, L + 1):
            if end > start:  # sublayer `end` reads v_start … v_{end-1} as its partial sum
                own += sse(np.array([end - 1]), start, end - 1)
            error[start, end] = own + sse(np.arange(end, L + 1), start, end)  # rows of sublayers end+1 … L, final
    return error


def block_mass(weights, sizes: Sequence[int]) -> float:
    """M(sizes): the attention mass kept inside the blocks of this placement (see the module doc)."""
    a = _consumer_matrix(weights)
    total = 0.0
    for start, end in _spans(sizes, a.shape[0] - 1):
        total += sum(a[j - 1, start:j].sum() for j in range(start, end + 1))
    return float(total)


def block_fit_error(weights, sizes: Sequence[int]) -> float:
    """E(sizes): squared error of the best Block AttnRes approximation of the weights (module doc),
    consumer by consumer."""
    a = _consumer_matrix(weights)
    L = a.shape[0] - 1
    spans = _spans(sizes, L)
    total = 0.0
    for row in range(L + 1):  # sublayer row + 1, then the final aggregation
        for start, end in spans:
            hi = min(end, row)  # sources v_start … v_hi of this block are read by this consumer
            if hi >= start:
                group = a[row, start : hi + 1]
                total += float(((group - group.mean()) ** 2).sum())
    return total


def _spans(sizes: Sequence[int], L: int) -> list[tuple]:
    if sum(sizes) != L:
        raise ValueError(f"block sizes {list(sizes)} do not add up to the L={L} sublayers")
    spans, start = [], 1
    for size in sizes:
        spans.append((start, start + size - 1))
        start += size
    return spans


OBJECTIVES = ("mass", "fit")


def best_block_sizes(
    weights, n_blocks: int, *, objective: str = "mass", min_size: int = 1, max_size: int | None = None
) -> list[int]:
    """The N block sizes (in sublayers, in order) that maximise the mass kept inside blocks
    (``objective="mass"``) or minimise the error of the Block approximation (``"fit"``), exactly."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is invalid: choose one of {OBJECTIVES}")
    a = _consumer_matrix(weights)
    L = a.shape[0] - 1
    top = L if max_size is None else max_size
    if not isinstance(n_blocks, int) or isinstance(n_blocks, bool) or not 1 <= n_blocks <= L:
        raise ValueError(f"n_blocks={n_blocks!r} is invalid: must be an integer in [1, {L}] (L={L} sublayers)")
    if not 1 <= min_size <= top or n_blocks * min_size > L or n_blocks * top < L:
        raise ValueError(
            f"min_size={min_size}, max_size={max_size} is invalid: no {n_blocks} blocks with sizes "
            f"in [{min_size}, {top}] add up to L={L}"
        )
    score = _inside_table(a) if objective == "mass" else -_fit_error_table(a)
    best = np.full((n_blocks + 1, L + 1), -math.inf)
    back = np.zeros((n_blocks + 1, L + 1), dtype=int)
    best[0, 0] = 0.0
    for n in range(1, n_blocks + 1):
        for end in range(1, L + 1):
            for prev in range(max(0, end - top), end - min_size + 1):
                value = best[n - 1, prev] + score[prev + 1, end]
                if value > best[n, end]:
                    best[n, end], back[n, end] = value, prev
    sizes, end = [], L
    for n in range(n_blocks, 0, -1):
        prev = int(back[n, end])
        sizes.append(end - prev)
        end = prev
    return sizes[::-1]


def run_depth_weights(run_dir) -> np.ndarray:
    """The mean depth-weight matrix a finished Full AttnRes run measured (probes.json), NaN where unread."""
    run_dir = Path(run_dir)
    config_path, probes_path = run_dir / "config.json", run_dir / "probes.json"
    if not probes_path.exists():
        raise ValueError(f"{probes_path} not found: {run_dir} is not a finished experiment run")
    model = json.loads(config_path.read_text())["model"] if config_path.exists() else {}
    if model.get("residual") != "full" or model.get("attnres_sources", "outputs") != "outputs":
        raise ValueError(
            f"{run_dir} trained residual={model.get('residual')!r} "
            f"(attnres_sources={model.get('attnres_sources', 'outputs')!r}); the placement needs "
            "a Full AttnRes run over sublayer outputs (residual='full', attnres_sources='outputs')"
        )
    weights = json.loads(probes_path.read_text())["depth_weights"]
    return np.array([[np.nan if v is None else v for v in row] for row in weights], dtype=float)


def runs_depth_weights(run_dirs: Sequence) -> np.ndarray:
    """The mean of several Full AttnRes runs' depth-weight matrices (e.g. the seeds of one config)."""
    if not run_dirs:
        raise ValueError("no run directories given; pass at least one finished Full AttnRes run")
    matrices = [run_depth_weights(d) for d in run_dirs]
    shapes = {m.shape for m in matrices}
    if len(shapes) > 1:
        raise ValueError(
            f"the runs have depth-weight matrices of different shapes {sorted(shapes)}; pass runs of one model depth"
        )
    stacked = np.stack(matrices)
    mean = np.full(stacked.shape[1:], np.nan)
    read = ~np.isnan(stacked).all(0)
    mean[read] = np.nanmean(stacked[:, read], axis=0)  # unread entries stay NaN (no empty-slice mean)
    return mean


def learned_block_sizes(
    run_dirs, n_blocks: int, *, objective: str = "mass", min_size: int = 1, max_size: int | None = None
) -> list[int]:
    """``best_block_sizes`` on the (mean) depth weights of finished Full AttnRes runs (one directory or
    a list): the value for ``attnres_block_sizes`` in an experiment spec."""
    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    return best_block_sizes(
        runs_depth_weights(dirs), n_blocks, objective=objective, min_size=min_size, max_size=max_size
    )


def describe_placement(weights, sizes: Sequence[int]) -> list[str]:
    """The sizes as a spec / ``--set`` line, then both objectives for them and for equal blocks
    (ceil(L / N), the last one shorter) as a comment line."""
    a = _consumer_matrix(weights)
    L = a.shape[0] - 1
    equal = equal_block_sizes(L, math.ceil(L / len(sizes)))
    return [
        f"attnres_block_sizes = {list(sizes)}",
        f"# mass inside blocks {block_mass(weights, sizes):.3f}, fit error {block_fit_error(weights, sizes):.4f}; "
        f"equal blocks {equal}: {block_mass(weights, equal):.3f}, {block_fit_error(weights, equal):.4f}; "
        f"total mass on sublayer outputs {float(np.nansum(a[:L, 1:])):.3f}",
    ]
