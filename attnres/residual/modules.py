"""Residual schemes for your own model, built from plain arguments (docs/own_model.md).

    attnres = BlockAttnRes(d_model=256, n_sublayers=24, attnres_blocks=8)
    depth = attnres.start(x)                        # x: the embedding [B, T, D]
    for block in blocks:                            # each block: stream = attnres.stream(depth)
        depth = block(depth, attnres)               #   stream.apply(sublayer) per sublayer
    y = attnres.finish(depth)                       #   return stream.depth()

``FullAttnRes`` and ``BlockAttnRes`` are the paper's two schemes (docs/method.md §3, §4) with their
variants as keyword arguments; ``residual_scheme(name, ...)`` builds any registered scheme (the
PreNorm baseline and the rivals too: ``attnres schemes`` lists them) behind the same interface. Every
option has one name everywhere: the ``ModelConfig`` field (``attnres.residual.args``; ``attnres
options`` lists them).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from attnres.residual.args import BLOCK_ONLY, FULL_ONLY, AttnResArgs, validate_scheme
from attnres.residual.attnres import DepthAttentionResidual
from attnres.residual.base import ResidualScheme
from attnres.residual.config import ResidualConfig
from attnres.residual.registry import RESIDUALS

_ATTNRES = tuple(f.name for f in dataclasses.fields(AttnResArgs))
FULL_ARGS = tuple(name for name in _ATTNRES if name not in BLOCK_ONLY)
BLOCK_ARGS = tuple(name for name in _ATTNRES if name not in FULL_ONLY)


def _old_name(name: str) -> str:
    """The short keyword these classes took before they took the ``ModelConfig`` names."""
    return "num_blocks" if name == "attnres_blocks" else name.removeprefix("attnres_")


def residual_config(
    residual: str, d_model: int, n_sublayers: int, *, norm_eps: float = 1e-6, **options: Any
) -> ResidualConfig:
    """A validated ``ResidualConfig``. ``options``: scheme fields by their ``ModelConfig`` names
    (``attnres_blocks=8``, ``hyper_streams=4``, ...; ``attnres options`` lists them)."""
    fields = set(ResidualConfig.__dataclass_fields__) - {"residual", "d_model", "n_sublayers", "norm_eps"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(
            f"unknown scheme option(s) {unknown}; the options are {sorted(fields)} "
            "(`attnres options` says what each one does)"
        )
    config = ResidualConfig(residual=residual, d_model=d_model, n_sublayers=n_sublayers, norm_eps=norm_eps, **options)
    for name in ("d_model", "n_sublayers"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: must be a positive integer")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not norm_eps > 0:
        raise ValueError(f"norm_eps={norm_eps!r} is invalid: must be a positive number")
    if residual in ("denseformer", "mudd") and n_sublayers % 2:
        raise ValueError(
            f"n_sublayers={n_sublayers} is invalid for residual={residual!r}: it acts after each "
            "Transformer block of two sublayers, so give an even number"
        )
    validate_scheme(config)
    return config


def residual_scheme(
    residual: str, d_model: int, n_sublayers: int, *, norm_eps: float = 1e-6, **options: Any
) -> ResidualScheme:
    """Any registered residual scheme for a model with ``n_sublayers`` sublayers of width ``d_model``.

    ``residual``: "prenorm", "full", "block" or a rival (``attnres schemes``); ``options``: its
    fields by their ``ModelConfig`` names, e.g. ``residual_scheme("block", 256, 24, attnres_blocks=8)``.
    Bad values raise a ValueError naming the field, the value and what is valid."""
    config = residual_config(residual, d_model, n_sublayers, norm_eps=norm_eps, **options)
    return RESIDUALS[config.residual].factory(config)


def _attnres_options(kind: str, kwargs: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    """``kwargs`` by their ``ModelConfig`` names; an old short name still works, with a DeprecationWarning."""
    old = {_old_name(name): name for name in allowed}
    options: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in old:
            warnings.warn(
                f"{kind}({name}={value!r}) is deprecated: write {old[name]}={value!r}", DeprecationWarning, stacklevel=3
            )
            name = old[name]
        elif name not in allowed:
            raise TypeError(
                f"{kind}() got an unknown option {name!r}; its options are {sorted(allowed)} "
                "(`attnres options` says what each one does)"
            )
        if name in options:
            raise TypeError(f"{kind}() got {name} twice (once by its deprecated short name); give it once")
        options[name] = value
    if options.get("attnres_block_sizes") is not None:
        options["attnres_block_sizes"] = list(options["attnres_block_sizes"])
    return options


class FullAttnRes(DepthAttentionResidual):
    """Full Attention Residuals (docs/method.md §3): every sublayer reads a softmax mixture of the
    embedding and all earlier sublayer outputs, with a zero-initialised pseudo-query and a key
    RMSNorm of its own.

    ``d_model``: width D; ``n_sublayers``: L, the sublayers of your model (any number; a Transformer
    block with attention and MLP has two). ``norm_eps``: the key norm's eps. Variants (paper Table 4,
    docs/options.md), by their ``ModelConfig`` names: ``attnres_weights`` ("pseudo_query",
    "input_query", "low_rank_query" with ``attnres_query_rank``, "scalar"), ``attnres_kernel``
    ("softmax", "sigmoid"), ``attnres_key_norm``, ``attnres_heads``, ``attnres_sources`` ("outputs",
    "states"), ``attnres_window`` (the embedding and the last W outputs), ``attnres_group_size`` and
    ``attnres_impl`` (how it is computed, never what), ``attnres_scale_norm_eps``, ``attnres_values``,
    ``attnres_score_scale``, ``attnres_read_queries``, ``attnres_routing`` ("replacement": a read is the
    depth mixture, the paper; "additive": the PreNorm stream plus a gain times the mixture, Delta
    AttnRes) with ``attnres_gain`` ("per_channel", "scalar", "unit"), ``attnres_gain_init`` and
    ``attnres_gain_lr``. The short names without ``attnres_`` still work, with a DeprecationWarning.

    Parameters: ``queries`` [L + 1, D] and ``key_norm_weight`` [L + 1, D] (index L: the final
    aggregation before your final norm), with additive routing ``routing_gain`` [L + 1, D] ([L + 1, 1]
    for a scalar gain, a buffer for the unit one); give them no
    weight decay (``attnres.param_groups``)."""

    def __init__(self, d_model: int, n_sublayers: int, *, norm_eps: float = 1e-6, **options: Any):
        fields = _attnres_options("FullAttnRes", options, FULL_ARGS)
        super().__init__(residual_config("full", d_model, n_sublayers, norm_eps=norm_eps, **fields))


class BlockAttnRes(DepthAttentionResidual):
    """Block Attention Residuals (docs/method.md §4): the L sublayers form depth blocks whose outputs
    are summed; each sublayer reads a softmax mixture of the embedding, the completed block sums and
    the running sum of its own block.

    Give the geometry one way: ``attnres_blocks`` (N; blocks of ceil(L / N) with the last one
    shorter), ``attnres_block_size`` (S sublayers per block) or ``attnres_block_sizes`` (the list,
    summing to L); with none, the smallest even S giving at most 8 blocks (the paper's N of about 8,
    boundaries before attention). The other options are ``FullAttnRes``'s, without ``attnres_window``
    and ``attnres_group_size``. The short names (``num_blocks``, ``block_size``, ``block_sizes``,
    ``kernel``, ...) still work, with a DeprecationWarning."""

    def __init__(self, d_model: int, n_sublayers: int, *, norm_eps: float = 1e-6, **options: Any):
        fields = _attnres_options("BlockAttnRes", options, BLOCK_ARGS)
        super().__init__(residual_config("block", d_model, n_sublayers, norm_eps=norm_eps, **fields))
