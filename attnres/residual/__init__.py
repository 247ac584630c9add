"""Residual schemes behind one interface, and the registry that names them.

Each registry entry says what the scheme is, where it sits in the paper's
Table 5 classification (weight type: fixed / static / dynamic; source: single
state / multi-stream / cross-layer), and how many parameters it adds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

from attnres.residual.attnres import DepthAttentionResidual, source_plan
from attnres.residual.base import DepthRecord, ResidualScheme, Stream
from attnres.residual.prenorm import PreNormResidual


def _attnres_params(config) -> int:
    """Parameters added by Full/Block AttnRes: per sublayer and for the final aggregation.

    pseudo_query: d (query) + d (key-norm weight)          -> 2d each, 2d(L + 1) in all
    input_query:  d*d (query projection) + d (key norm)    -> (d^2 + d)(L + 1)
    scalar:       one logit per source read, no key norm   -> sum over l of K_l
    Without key norm the d of the key-norm weight drops.
    """
    d, n_q = config.d_model, config.n_sublayers + 1
    if config.attnres_weights == "scalar":
        scheme_plan = source_plan(config.n_sublayers, config.block_size)
        w = config.attnres_window
        return sum((1 + min(w, c - 1)) if w is not None else c + int(p) for c, p in scheme_plan)
    per = d if config.attnres_weights == "pseudo_query" else d * d
    if config.attnres_key_norm:
        per += d
    return per * n_q


@dataclass(frozen=True)
class SchemeInfo:
    name: str
    factory: Callable
    description: str
    weight_type: str  # fixed | static | dynamic
    source: str  # single state | multi-stream | cross-layer
    extra_params: Callable  # config -> int


RESIDUALS: Dict[str, SchemeInfo] = {
    "prenorm": SchemeInfo(
        "prenorm", PreNormResidual,
        "standard PreNorm residual: h <- h + f (the baseline)",
        "fixed", "single state", lambda config: 0,
    ),
    "full": SchemeInfo(
        "full", DepthAttentionResidual,
        "Full AttnRes: softmax attention over the embedding and every earlier sublayer output",
        "dynamic", "cross-layer", _attnres_params,
    ),
    "block": SchemeInfo(
        "block", DepthAttentionResidual,
        "Block AttnRes: attention over N depth-block sums plus the running partial sum",
        "dynamic", "cross-layer", _attnres_params,
    ),
}


def build_residual(config) -> ResidualScheme:
    return RESIDUALS[config.residual].factory(config)


__all__ = [
    "DepthAttentionResidual", "DepthRecord", "PreNormResidual", "RESIDUALS", "ResidualScheme",
    "SchemeInfo", "Stream", "build_residual", "source_plan",
]
