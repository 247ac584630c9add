"""The registry of residual schemes: what each one is, its options and their checks, its geometry and
its size. ``ModelConfig`` (and ``ResidualConfig``) ask the registries about schemes and name none
themselves: a new scheme is one module, its options and checks in ``attnres.residual.args``
(``SCHEME_RULES``, which validation reads without importing any builder) and one entry here.

Each entry says where the scheme sits in the paper's Table 5 classification (weight type: fixed /
static / dynamic; source: single state / multi-stream / cross-layer), how many parameters it adds and
how much depth state it keeps per token (``attnres.model.schemes_table`` renders them all).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from attnres.residual.args import SCHEME_RULES, SchemeRules, validate_scheme
from attnres.residual.attnres import DepthAttentionResidual, source_plan
from attnres.residual.base import ResidualScheme
from attnres.residual.dense import (
    DenseFormerResidual,
    MUDDResidual,
    denseformer_params,
    denseformer_state,
    mudd_params,
)
from attnres.residual.gated import GatedDepthAttentionResidual, gated_params
from attnres.residual.hyper import (
    HyperConnectionResidual,
    ManifoldHyperConnectionResidual,
    hyper_params,
    mhc_params,
)
from attnres.residual.options import Option
from attnres.residual.prenorm import PreNormResidual
from attnres.residual.scaled import (
    HighwayResidual,
    LayerScaleResidual,
    ReZeroResidual,
    highway_params,
    layerscale_params,
    rezero_params,
)

__all__ = ["RESIDUALS", "SchemeInfo", "build_residual", "scheme_options", "validate_scheme"]


def _attnres_params(config) -> int:
    """Parameters added by Full/Block AttnRes: per sublayer and for the final aggregation.

    pseudo_query:   d (query) + d (key-norm weight)             -> 2d each, 2d(L + 1) in all
    input_query:    d*d (query projection) + d (key norm)       -> (d^2 + d)(L + 1)
    low_rank_query: d + 2rd (w, U: d x r, V: r x d) + d         -> (2d + 2rd)(L + 1)
    scalar:         one logit per source read, no key norm      -> sum over l of K_l
    Without key norm the d of the key-norm weight drops; additive routing adds the gain g per read: d
    (per_channel), 1 (scalar) or nothing (unit).
    """
    d, n_q = config.d_model, config.n_sublayers + 1
    gains = 0
    if config.attnres_routing == "additive":
        gains = {"per_channel": d, "scalar": 1, "unit": 0}.get(config.attnres_gain, d) * n_q
    if config.attnres_weights == "scalar":
        scheme_plan = source_plan(config.n_sublayers, config.block_sizes)
        w = config.attnres_window
        return gains + sum((1 + min(w, c - 1)) if w is not None else c + int(p) for c, p in scheme_plan)
    per = {"pseudo_query": d, "input_query": d * d, "low_rank_query": d + 2 * d * (config.attnres_query_rank or 0)}[
        config.attnres_weights
    ]
    if config.attnres_key_norm:
        per += d
    extra = sum(config.attnres_read_queries) - n_q if config.attnres_read_queries else 0  # queries beyond the first
    return per * n_q + extra * d + gains


def _full_state(config) -> int:
    """Full AttnRes keeps every source: L + 1 (with a window only the embedding and the last W)."""
    L, w = config.n_sublayers, config.attnres_window
    return L + 1 if w is None else 1 + min(w, L)


def _no_state(config) -> int:
    return 0


@dataclass(frozen=True)
class SchemeInfo:
    """A registry entry: everything the rest of the library knows about a scheme.

    ``weight_type``: fixed | static | dynamic (or a function of the config, when an option
    changes it). ``source``: single state | multi-stream | cross-layer.
    ``extra_params(config)``: parameters added to the PreNorm model.
    ``depth_state(config)``: the depth state the stream keeps alive between sublayers, per
    token, in units of d floats. A single running hidden state (every PreNorm-like scheme)
    counts 0; schemes that hold more count every d-vector they hold (n streams, or each stored
    source / block output).
    ``options``, ``block_sizes``, ``group_size``, ``check``: the scheme's ``SchemeRules`` of
    ``attnres.residual.args`` (the config fields it reads with their checks, its depth blocks, its
    whole-config rule), which validation reads without importing any builder.
    """

    name: str
    factory: Callable
    description: str
    weight_type: str | Callable
    source: str
    extra_params: Callable
    depth_state: Callable = _no_state

    @property
    def rules(self) -> SchemeRules:
        return SCHEME_RULES[self.name]

    @property
    def options(self) -> Mapping[str, Option]:
        return self.rules.options

    @property
    def block_sizes(self) -> Callable:
        return self.rules.block_sizes

    @property
    def group_size(self) -> Callable:
        return self.rules.group_size

    @property
    def check(self) -> Callable | None:
        return self.rules.check

    def weight_type_of(self, config) -> str:
        return self.weight_type(config) if callable(self.weight_type) else self.weight_type


RESIDUALS: dict[str, SchemeInfo] = {
    "prenorm": SchemeInfo(
        "prenorm",
        PreNormResidual,
        "standard PreNorm residual: h <- h + f (the baseline)",
        "fixed",
        "single state",
        lambda config: 0,
    ),
    "full": SchemeInfo(
        "full",
        DepthAttentionResidual,
        "Full AttnRes: softmax attention over the embedding and every earlier sublayer output",
        "dynamic",
        "cross-layer",
        _attnres_params,
        _full_state,
    ),
    "block": SchemeInfo(
        "block",
        DepthAttentionResidual,
        "Block AttnRes: attention over N depth-block sums plus the running partial sum",
        "dynamic",
        "cross-layer",
        _attnres_params,
        lambda config: config.num_blocks + 1,
    ),
    "rezero": SchemeInfo(
        "rezero",
        ReZeroResidual,
        "ReZero: h <- h + a_l f, one scalar per sublayer, zero at init",
        "static",
        "single state",
        rezero_params,
    ),
    "layerscale": SchemeInfo(
        "layerscale",
        LayerScaleResidual,
        "LayerScale: h <- h + diag(lambda_l) f, per-channel scales (CaiT init by depth)",
        "static",
        "single state",
        layerscale_params,
    ),
    "highway": SchemeInfo(
        "highway",
        HighwayResidual,
        "Highway: h <- (1 - g) h + g f, per-channel gate g = sigmoid(W_g rms(h) + b_g), b_g = -2",
        "dynamic",
        "single state",
        highway_params,
    ),
    "denseformer": SchemeInfo(
        "denseformer",
        DenseFormerResidual,
        "DenseFormer: learned scalar depth-weighted average of block outputs after each block",
        "static",
        "cross-layer",
        denseformer_params,
        denseformer_state,
    ),
    "mudd": SchemeInfo(
        "mudd",
        MUDDResidual,
        "MUDD (one way): per-token weights over block outputs from an MLP on the current state",
        "dynamic",
        "cross-layer",
        mudd_params,
        lambda config: config.n_layers + 1,
    ),
    "hyper": SchemeInfo(
        "hyper",
        HyperConnectionResidual,
        "Hyper-Connections: n streams, learned read/mix/write (dynamic DHC; static SHC with hyper_dynamic=False)",
        lambda config: "dynamic" if config.hyper_dynamic else "static",
        "multi-stream",
        hyper_params,
        lambda config: config.hyper_streams,
    ),
    "mhc": SchemeInfo(
        "mhc",
        ManifoldHyperConnectionResidual,
        "mHC: hyper-connections with sigmoid read/write and a Sinkhorn doubly stochastic mixer",
        "dynamic",
        "multi-stream",
        mhc_params,
        lambda config: config.mhc_streams,
    ),
    "gated": SchemeInfo(
        "gated",
        GatedDepthAttentionResidual,
        "gated multi-head depth attention as popular write-ups present AttnRes (not the paper's): "
        "h = g x + (1 - g) softmax(q k / sqrt(d_h)) v over the embedding and sublayer outputs, "
        "q/k/v projections, g = 0.5 at init",
        "dynamic",
        "cross-layer",
        gated_params,
        lambda config: config.n_sublayers + 1,
    ),
}


def scheme_options() -> dict[str, Option]:
    """Every option of every registered scheme (the ModelConfig fields that belong to schemes)."""
    return {name: option for info in RESIDUALS.values() for name, option in info.options.items()}


def build_residual(config) -> ResidualScheme:
    """The scheme ``config.residual`` names, built from a validated ``ModelConfig`` or ``ResidualConfig``
    (for your own model, ``attnres.residual_scheme`` takes plain arguments)."""
    return RESIDUALS[config.residual].factory(config)
