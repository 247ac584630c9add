"""Each residual scheme family's options, declared once, with their checks and the depth geometry.

A family (Full and Block AttnRes, LayerScale, Highway, DenseFormer, Hyper-Connections, mHC, the gated
rival) owns one small dataclass whose field names are THE names of its options: ``ModelConfig``
and ``ResidualConfig`` inherit them (``SchemeArgs`` composes them all), ``FullAttnRes`` /
``BlockAttnRes`` take them as keyword arguments, ``--set NAME=VALUE`` and docs/options.md use them.

``SCHEME_RULES`` says, per registered scheme, which options it reads (each with its check), its
depth blocks and its whole-config check; ``validate_scheme`` validates through it. This module
imports no scheme or model builder, so a config can be validated without building anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from attnres.residual.options import (
    Option,
    bad_option,
    boolean,
    check_scheme_options,
    is_positive_int,
    one_of,
    positive_int,
)

WEIGHTS = ("pseudo_query", "input_query", "low_rank_query", "scalar")
SOURCES = ("outputs", "states")
KERNELS = ("softmax", "sigmoid")
VALUES = ("raw", "normalized")
ROUTINGS = ("replacement", "additive")
GAINS = ("per_channel", "scalar", "unit")
IMPLS = ("two_phase", "fused", "reference")
DEFAULT_TARGET_BLOCKS = 8  # the paper's N ≈ 8


# ----------------------------------------------------------------------------- the options


@dataclass
class AttnResArgs:
    """Full and Block AttnRes (docs/method.md §3, §4; every field is described in docs/options.md)."""

    attnres_blocks: int | None = None
    attnres_block_size: int | None = None
    attnres_weights: str = "pseudo_query"
    attnres_kernel: str = "softmax"
    attnres_key_norm: bool = True
    attnres_heads: int = 1
    attnres_window: int | None = None
    attnres_group_size: int | None = None
    attnres_scale_norm_eps: bool = False
    attnres_impl: str = "two_phase"
    attnres_sources: str = "outputs"
    attnres_block_sizes: Sequence[int] | None = None
    attnres_query_rank: int | None = None
    attnres_values: str = "raw"
    attnres_score_scale: float | None = None
    attnres_read_queries: Sequence[int] | None = None
    attnres_routing: str = "replacement"
    attnres_gain: str = "per_channel"
    attnres_gain_init: float = 0.0
    attnres_gain_lr: float = 1.0


@dataclass
class LayerScaleArgs:
    layerscale_init: float | None = None


@dataclass
class HighwayArgs:
    highway_rank: int | None = None


@dataclass
class DenseFormerArgs:
    denseformer_dilation: int = 1
    denseformer_period: int = 1


@dataclass
class HyperArgs:
    hyper_streams: int = 4
    hyper_dynamic: bool = True


@dataclass
class MHCArgs:
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20


@dataclass
class GatedArgs:
    gated_heads: int = 8


# Bases listed last come first among the fields: AttnRes, LayerScale, ..., Gated.
@dataclass
class SchemeArgs(GatedArgs, MHCArgs, HyperArgs, DenseFormerArgs, HighwayArgs, LayerScaleArgs, AttnResArgs):
    """Every scheme family's options: what ``ModelConfig`` and ``ResidualConfig`` inherit."""


FAMILIES = (AttnResArgs, LayerScaleArgs, HighwayArgs, DenseFormerArgs, HyperArgs, MHCArgs, GatedArgs)


# ----------------------------------------------------------------------------- geometry


def block_size(config) -> int:
    """S for Block AttnRes: ``attnres_block_size``, else ceil(L / ``attnres_blocks``), else the
    smallest even S giving at most 8 depth blocks (boundaries before attention, the paper's default)."""
    L = config.n_sublayers
    if config.attnres_block_sizes is not None:
        return max(config.attnres_block_sizes)
    if config.attnres_block_size is not None:
        return config.attnres_block_size
    if config.attnres_blocks is not None:
        return math.ceil(L / config.attnres_blocks)
    s = 2
    while math.ceil(L / s) > DEFAULT_TARGET_BLOCKS:
        s += 2
    return min(s, L)


def equal_block_sizes(n_sublayers: int, size: int) -> list[int]:
    """Blocks of ``size`` sublayers, the last one shorter when ``size`` does not divide L."""
    full, rest = divmod(n_sublayers, size)
    return [size] * full + ([rest] if rest else [])


def block_sizes(config) -> list[int]:
    """Sublayers per depth block, in order: ``attnres_block_sizes``, else equal blocks of S
    (``block_size``) with the last one shorter."""
    if config.attnres_block_sizes is not None:
        return list(config.attnres_block_sizes)
    return equal_block_sizes(config.n_sublayers, block_size(config))


def full_block_sizes(config) -> list[int]:
    """Full AttnRes: every sublayer output is its own source (S = 1)."""
    return [1] * config.n_sublayers


def group_size(config) -> int:
    """G for Full AttnRes' two-phase schedule: ``attnres_group_size``, else round(sqrt(L))."""
    if config.attnres_group_size is not None:
        return config.attnres_group_size
    return max(1, round(math.sqrt(config.n_sublayers)))


def _one_block(config) -> list[int]:
    return [config.n_sublayers]


def _no_groups(config) -> int:
    return 1


# ----------------------------------------------------------------------------- AttnRes checks


def _heads(value, config):
    if not is_positive_int(value):
        return "must be a positive integer"
    if config.d_model % value:
        return f"must divide d_model={config.d_model}"
    if value > 1 and config.attnres_weights == "scalar":
        return "scalar mixing has no query to split into heads; use attnres_heads=1"
    return None


def _weights(value, config):
    if value not in WEIGHTS:
        return f"choose one of {WEIGHTS}"
    if value == "low_rank_query" and config.attnres_query_rank is None:
        return f"needs attnres_query_rank=r, the rank of the input-dependent term (1 <= r < d_model={config.d_model})"
    return None


def _query_rank(r, config):
    if config.attnres_weights != "low_rank_query":
        return (
            f"applies to attnres_weights='low_rank_query' only (attnres_weights={config.attnres_weights!r}); "
            "drop it or set attnres_weights='low_rank_query'"
        )
    if not is_positive_int(r) or r >= config.d_model:
        return (
            f"must be an integer in [1, {config.d_model - 1}] (below d_model={config.d_model}); "
            "use attnres_weights='input_query' for a full-rank query"
        )
    return None


def _sources(value, config):
    if value not in SOURCES:
        return f"choose one of {SOURCES}"
    if value == "states" and config.attnres_scale_norm_eps:
        return (
            "states-sourced AttnRes reads a weighted mix of running sums at init, not a multiple of the "
            "PreNorm sum, so attnres_scale_norm_eps cannot make it exact; drop attnres_scale_norm_eps"
        )
    return None


def _blocks(n, config):
    L = config.n_sublayers
    if config.attnres_block_size is not None:
        return "give either attnres_blocks (N) or attnres_block_size (S), not both"
    if config.attnres_block_sizes is not None:
        return "give either attnres_blocks (N) or attnres_block_sizes (the sizes themselves), not both"
    if not is_positive_int(n):
        return "must be a positive integer"
    if n > L:
        return f"exceeds the number of sublayers L={L} (2 * n_layers); use at most {L}"
    s = math.ceil(L / n)
    if math.ceil(L / s) != n:
        return (
            f"cannot split L={L} sublayers into {n} blocks of {s} with only the last one shorter; "
            f"set attnres_block_size instead (S={s} gives {math.ceil(L / s)} blocks), or list the sizes "
            f"in attnres_block_sizes"
        )
    return None


def _block_size(s, config):
    L = config.n_sublayers
    if not is_positive_int(s):
        return "must be an integer >= 1 (sublayers per block)"
    if s > L:
        return f"exceeds the number of sublayers L={L}; use at most {L}"
    if config.attnres_block_sizes is not None:
        return "give either attnres_block_size (S) or attnres_block_sizes (the sizes themselves), not both"
    return None


def _block_sizes(sizes, config):
    L = config.n_sublayers
    if not isinstance(sizes, (list, tuple)) or not sizes or not all(is_positive_int(s) for s in sizes):
        return "must be a non-empty list of positive integers (sublayers per depth block, in order)"
    if sum(sizes) != L:
        return f"sums to {sum(sizes)}, not to the L={L} sublayers (2 * n_layers); make the sizes add up to {L}"
    return None


def _multi_query_variant(config) -> str | None:
    """What the multi-query read (normalized values, a score scale, several queries) cannot combine with."""
    if config.attnres_weights != "pseudo_query":
        return f"needs attnres_weights='pseudo_query' (attnres_weights={config.attnres_weights!r})"
    if config.attnres_heads != 1:
        return f"needs attnres_heads=1 (attnres_heads={config.attnres_heads})"
    return None


def _values(value, config):
    if value not in VALUES:
        return f"choose one of {VALUES}"
    if value == "normalized" and config.attnres_scale_norm_eps:
        return (
            "a zero-query read of normalized values is no multiple of the PreNorm sum, so "
            "attnres_scale_norm_eps cannot make it exact; drop attnres_scale_norm_eps"
        )
    return _multi_query_variant(config) if value == "normalized" else None


def _score_scale(value, config):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return "must be a positive number (Inkling-2: d_model ** -0.5) or None"
    return _multi_query_variant(config)


def _read_queries(value, config):
    n = config.n_sublayers + 1
    if not isinstance(value, (list, tuple)) or len(value) != n or not all(is_positive_int(q) for q in value):
        return (
            f"must list {n} positive integers (queries per read: the L={config.n_sublayers} sublayers, then the "
            "final aggregation)"
        )
    return _multi_query_variant(config)


def _routing(value, config):
    if value not in ROUTINGS:
        return f"choose one of {ROUTINGS} (additive: the PreNorm stream plus a gained depth mixture)"
    return None


def _needs_additive(config) -> str | None:
    if config.attnres_routing != "additive":
        return (
            f"applies to attnres_routing='additive' only (attnres_routing={config.attnres_routing!r}); "
            "drop it or set attnres_routing='additive'"
        )
    return None


def _learned_gain(config) -> str | None:
    if config.attnres_gain == "unit":
        return "attnres_gain='unit' has no learned gain (g = 1, fixed); drop it or set attnres_gain='per_channel'"
    return None


def _gain(value, config):
    if value not in GAINS:
        return f"choose one of {GAINS} (unit: Delta AttnRes' h_std + mixture, no gain parameter)"
    if value == "unit" and config.attnres_scale_norm_eps:
        return "a unit gain reads h_std + mixture, no multiple of the PreNorm sum; drop attnres_scale_norm_eps"
    return _needs_additive(config)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _gain_init(value, config):
    if not _is_number(value):
        return "must be a finite number (0: the model starts as PreNorm exactly; 1: h_std + the mixture)"
    if value != 0 and config.attnres_scale_norm_eps:
        return (
            "with a nonzero gain a read at init is no multiple of the PreNorm sum, so attnres_scale_norm_eps "
            "cannot make it exact; drop attnres_scale_norm_eps or set attnres_gain_init=0"
        )
    return _needs_additive(config) or _learned_gain(config)


def _gain_lr(value, config):
    if not _is_number(value) or value <= 0:
        return "must be a positive number (the gain's learning rate over the optimizer's; 1: the same rate)"
    return _needs_additive(config) or _learned_gain(config)


# read by Full and Block AttnRes; the first seven are ignored by every other scheme (so one
# --set attnres_kernel=sigmoid can apply to a whole prenorm/block/full comparison)
SHARED_OPTIONS = {
    "attnres_weights": Option(_weights, exclusive=False),
    "attnres_query_rank": Option(_query_rank, exclusive=False),
    "attnres_sources": Option(_sources, exclusive=False),
    "attnres_kernel": Option(one_of(*KERNELS), exclusive=False),
    "attnres_key_norm": Option(boolean, exclusive=False),
    "attnres_heads": Option(_heads, exclusive=False),
    "attnres_impl": Option(one_of(*IMPLS), exclusive=False),
    "attnres_scale_norm_eps": Option(boolean),
    "attnres_values": Option(_values),
    "attnres_score_scale": Option(_score_scale),
    "attnres_read_queries": Option(_read_queries),
    "attnres_routing": Option(_routing),
    "attnres_gain": Option(_gain),
    "attnres_gain_init": Option(_gain_init),
    "attnres_gain_lr": Option(_gain_lr),
}
FULL_ONLY = ("attnres_window", "attnres_group_size")
BLOCK_ONLY = ("attnres_blocks", "attnres_block_size", "attnres_block_sizes")
FULL_OPTIONS = {
    **SHARED_OPTIONS,
    "attnres_window": Option(positive_int("sources kept")),
    "attnres_group_size": Option(positive_int("sublayers per group")),
}
BLOCK_OPTIONS = {
    **SHARED_OPTIONS,
    "attnres_blocks": Option(_blocks),
    "attnres_block_size": Option(_block_size),
    "attnres_block_sizes": Option(_block_sizes),
}


# ----------------------------------------------------------------------------- the rivals' checks


def _layerscale_init(v, config):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        return "must be a positive number (or None for CaiT's depth rule)"
    return None


def _highway_rank(r, config):
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r < config.d_model:
        return (
            f"must be an integer in [1, {config.d_model - 1}] (below d_model={config.d_model}); "
            "use None for a full-rank gate"
        )
    return None


def _gated_heads(h, config):
    if not is_positive_int(h):
        return "must be a positive integer (depth-attention heads)"
    if config.d_model % h:
        return f"must divide d_model={config.d_model}"
    return None


def check_gated(config) -> None:
    """The default head count is never checked as an option; it must divide d_model too."""
    if config.d_model % config.gated_heads:
        raise bad_option(
            "gated_heads",
            config.gated_heads,
            f"must divide d_model={config.d_model} (the default is 8); set gated_heads",
            owner=type(config).__name__,
        )


LAYERSCALE_OPTIONS = {"layerscale_init": Option(_layerscale_init)}
HIGHWAY_OPTIONS = {"highway_rank": Option(_highway_rank)}
DENSEFORMER_OPTIONS = {
    "denseformer_dilation": Option(positive_int("blocks between connected outputs", lambda c: c.n_layers, "n_layers")),
    "denseformer_period": Option(positive_int("blocks between two averagings", lambda c: c.n_layers, "n_layers")),
}
HYPER_OPTIONS = {"hyper_streams": Option(positive_int("number of residual streams")), "hyper_dynamic": Option(boolean)}
MHC_OPTIONS = {
    "mhc_streams": Option(positive_int("number of residual streams")),
    "mhc_sinkhorn_iters": Option(positive_int("Sinkhorn-Knopp iterations")),
}
GATED_OPTIONS = {
    "gated_heads": Option(_gated_heads),
    "attnres_impl": Option(one_of(*IMPLS), exclusive=False),
}


# ----------------------------------------------------------------------------- per scheme


@dataclass(frozen=True)
class SchemeRules:
    """What validation and geometry know of a scheme: ``options`` (the config fields it reads, each
    with its check), ``block_sizes(config)`` / ``group_size(config)`` (its depth blocks, [L] without,
    and G, the sublayers sharing one Phase-1 pass, 1 without) and ``check(config)``, a rule over the
    whole config beyond its set options (raises the ValueError of ``bad_option``)."""

    options: Mapping[str, Option] = field(default_factory=dict)
    block_sizes: Callable = _one_block
    group_size: Callable = _no_groups
    check: Callable | None = None


SCHEME_RULES: dict[str, SchemeRules] = {
    "prenorm": SchemeRules(),
    "full": SchemeRules(FULL_OPTIONS, full_block_sizes, group_size),
    "block": SchemeRules(BLOCK_OPTIONS, block_sizes),
    "rezero": SchemeRules(),
    "layerscale": SchemeRules(LAYERSCALE_OPTIONS),
    "highway": SchemeRules(HIGHWAY_OPTIONS),
    "denseformer": SchemeRules(DENSEFORMER_OPTIONS),
    "mudd": SchemeRules(),
    "hyper": SchemeRules(HYPER_OPTIONS),
    "mhc": SchemeRules(MHC_OPTIONS),
    "gated": SchemeRules(GATED_OPTIONS, check=check_gated),
}


def validate_scheme(config) -> None:
    """``config.residual`` names a registered scheme and its options pass their checks."""
    if not isinstance(config.residual, str) or config.residual not in SCHEME_RULES:
        raise bad_option(
            "residual", config.residual, f"choose one of {sorted(SCHEME_RULES)}", owner=type(config).__name__
        )
    check_scheme_options(config, SCHEME_RULES)
    rules = SCHEME_RULES[config.residual]
    if rules.check is not None:
        rules.check(config)
