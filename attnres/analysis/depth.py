"""Depth weights as a matrix: row = consumer (sublayer l, then the final aggregation), column = source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from attnres.files import DEPTH_WEIGHTS_FILE, atomic_write_text
from attnres.residual import DepthRecord


def _column(name: str) -> int:
    """Source name -> column: emb -> 0, v3 / b3 / b3~ (partial sum of block 3) -> 3, and the states
    sources s3 / sb3 / sb3~ -> 3."""
    if name == "emb":
        return 0
    return int(name.lstrip("vbs").rstrip("~"))


def _consumers(record: DepthRecord) -> list[tuple[torch.Tensor, list[str]]] | None:
    """(depth weights, source names) of every consumer; None for schemes without depth weights. A
    scheme records weights at every consumer or at none."""
    if not record.weights or record.weights[0] is None:
        return None
    consumers = []
    for w, names in zip(record.weights, record.sources, strict=True):
        if w is None or names is None:
            raise ValueError("a depth record with weights at some consumers only")
        consumers.append((w, names))
    return consumers


def depth_weight_matrix(record: DepthRecord) -> np.ndarray | None:
    """Mean depth weight over batch, tokens (and heads): [L + 1, max sources]; NaN where a
    consumer does not read that source. None for schemes without depth weights (prenorm)."""
    consumers = _consumers(record)
    if consumers is None:
        return None
    cols = max(_column(n) for _, names in consumers for n in names) + 1
    out = np.full((len(consumers), cols), np.nan)
    for row, (w, names) in enumerate(consumers):
        mean = w.float().flatten(1).mean(1) if w.dim() > 1 else w.float()
        for value, name in zip(mean.tolist(), names, strict=True):
            out[row, _column(name)] = value
    return out


def routing_sharpness(record: DepthRecord) -> dict[str, list[float]] | None:
    """How sharply each consumer routes over depth (sublayers 0 … L-1, then the final aggregation).

    ``max_weight[l]``: the largest depth weight, max_i alpha_i, averaged over batch, tokens (and
    heads); ``entropy[l]``: -sum_i p_i log p_i in nats, averaged the same way, with p = alpha for
    softmax weights (sigmoid weights are first normalised to sum to 1); ``n_sources[l]``: K_l, so that
    uniform routing reads max_weight = 1/K_l and entropy = log K_l. None for schemes without depth
    weights (prenorm and the other single-state or multi-stream rivals).
    """
    consumers = _consumers(record)
    if consumers is None:
        return None
    out: dict[str, list[float]] = {"max_weight": [], "entropy": [], "n_sources": []}
    for w, _ in consumers:
        w = w.double()  # [K, B, T] or [K, B, T, H]
        p = w / w.sum(0, keepdim=True)
        out["max_weight"].append(w.amax(0).mean().item())
        out["entropy"].append(-torch.special.xlogy(p, p).sum(0).mean().item())
        out["n_sources"].append(w.shape[0])
    return out


@torch.no_grad()
def record_on_batch(model, input_ids: torch.Tensor) -> DepthRecord:
    """Run one forward pass with recording on (model left in eval mode)."""
    model.eval()
    return model(input_ids, return_record=True).record


def source_labels(record: DepthRecord) -> list[str]:
    sources = [names for names in record.sources if names is not None]
    cols = max(_column(n) for names in sources for n in names) + 1
    labels = [""] * cols
    for names in sources:
        for n in names:
            labels[_column(n)] = n.rstrip("~")
    return labels


def write_depth_weights(model, input_ids: torch.Tensor, run_dir) -> Path | None:
    """Save the mean depth-weight matrix of ``model`` on ``input_ids`` and its source labels as
    ``run_dir``/depth_weights.json (NaN written as null); None, writing nothing, for a scheme without
    depth weights."""
    record = record_on_batch(model, input_ids)
    matrix = depth_weight_matrix(record)
    if matrix is None:
        return None
    weights = [[None if np.isnan(v) else float(v) for v in row] for row in matrix]
    path = Path(run_dir) / DEPTH_WEIGHTS_FILE
    atomic_write_text(path, json.dumps({"weights": weights, "sources": source_labels(record)}))
    return path


def read_depth_weights(run_dir) -> tuple | None:
    """(matrix with NaN, source labels) from ``run_dir``/depth_weights.json; None if it has none."""
    path = Path(run_dir) / DEPTH_WEIGHTS_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        matrix = np.array([[np.nan if v is None else v for v in row] for row in saved["weights"]], dtype=float)
        sources = [str(s) for s in saved["sources"]]
        if matrix.ndim != 2 or matrix.shape[0] < 2 or matrix.shape[1] != len(sources):
            raise ValueError(f"weights of shape {matrix.shape} for {len(sources)} sources")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is not a depth-weights file of attnres train ({type(e).__name__}: {e}); delete it, or "
            "redraw it by resuming or retraining the run"
        ) from e
    return matrix, sources
