"""Residual schemes for your own model, built from plain arguments (docs/own_model.md).

    attnres = BlockAttnRes(d_model=256, n_sublayers=24, num_blocks=8)
    depth = attnres.start(x)                        # x: the embedding [B, T, D]
    for block in blocks:                            # each block: stream = attnres.stream(depth)
        depth = block(depth, attnres)               #   stream.apply(sublayer) per sublayer
    y = attnres.finish(depth)                       #   return stream.depth()

``FullAttnRes`` and ``BlockAttnRes`` are the paper's two schemes (docs/method.md §3, §4) with their
variants as keyword arguments; ``residual_scheme(name, ...)`` builds any registered scheme (the
PreNorm baseline and the rivals too: ``attnres schemes`` lists them) behind the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnres.residual.attnres import DepthAttentionResidual
from attnres.residual.base import ResidualScheme
from attnres.residual.config import ResidualConfig
from attnres.residual.registry import RESIDUALS, validate_scheme

# keyword arguments of FullAttnRes / BlockAttnRes -> the ResidualConfig field each sets
_VARIANTS = (
    "weights",
    "query_rank",
    "sources",
    "kernel",
    "key_norm",
    "heads",
    "impl",
    "scale_norm_eps",
    "values",
    "score_scale",
    "read_queries",
    "routing",
    "gain",
    "gain_init",
    "gain_lr",
)
_FULL_ONLY = ("window", "group_size")


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


def _variant_fields(kind: str, kwargs: dict[str, Any], allowed: Sequence[str]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"{kind}() got unknown option(s) {unknown}; its options are {sorted(allowed)}")
    return {f"attnres_{name}": value for name, value in kwargs.items()}


class FullAttnRes(DepthAttentionResidual):
    """Full Attention Residuals (docs/method.md §3): every sublayer reads a softmax mixture of the
    embedding and all earlier sublayer outputs, with a zero-initialised pseudo-query and a key
    RMSNorm of its own.

    ``d_model``: width D; ``n_sublayers``: L, the sublayers of your model (any number; a Transformer
    block with attention and MLP has two). ``norm_eps``: the key norm's eps. Variants (paper Table 4,
    docs/options.md): ``weights`` ("pseudo_query", "input_query", "low_rank_query" with
    ``query_rank``, "scalar"), ``kernel`` ("softmax", "sigmoid"), ``key_norm``, ``heads``,
    ``sources`` ("outputs", "states"), ``window`` (the embedding and the last W outputs),
    ``group_size`` and ``impl`` (how it is computed, never what), ``scale_norm_eps``, ``routing``
    ("replacement": a read is the depth mixture, the paper; "additive": the PreNorm stream plus a
    gain times the mixture, Delta AttnRes) with ``gain`` ("per_channel", "scalar", "unit"), ``gain_init``
    and ``gain_lr``.

    Parameters: ``queries`` [L + 1, D] and ``key_norm_weight`` [L + 1, D] (index L: the final
    aggregation before your final norm), with additive routing ``routing_gain`` [L + 1, D] ([L + 1, 1]
    for a scalar gain, a buffer for the unit one); give them no
    weight decay (``attnres.param_groups``)."""

    def __init__(self, d_model: int, n_sublayers: int, *, norm_eps: float = 1e-6, **variants: Any):
        fields = _variant_fields("FullAttnRes", variants, _VARIANTS + _FULL_ONLY)
        super().__init__(residual_config("full", d_model, n_sublayers, norm_eps=norm_eps, **fields))


class BlockAttnRes(DepthAttentionResidual):
    """Block Attention Residuals (docs/method.md §4): the L sublayers form depth blocks whose outputs
    are summed; each sublayer reads a softmax mixture of the embedding, the completed block sums and
    the running sum of its own block.

    Give the geometry one way: ``num_blocks`` (N; blocks of ceil(L / N) with the last one shorter),
    ``block_size`` (S sublayers per block) or ``block_sizes`` (the list, summing to L); with none, the
    smallest even S giving at most 8 blocks (the paper's N of about 8, boundaries before attention).
    The other options are ``FullAttnRes``'s, without ``window`` and ``group_size``."""

    def __init__(
        self,
        d_model: int,
        n_sublayers: int,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        block_sizes: Sequence[int] | None = None,
        norm_eps: float = 1e-6,
        **variants: Any,
    ):
        fields = _variant_fields("BlockAttnRes", variants, _VARIANTS)
        geometry = {
            "attnres_blocks": num_blocks,
            "attnres_block_size": block_size,
            "attnres_block_sizes": list(block_sizes) if block_sizes is not None else None,
        }
        fields.update({name: value for name, value in geometry.items() if value is not None})
        super().__init__(residual_config("block", d_model, n_sublayers, norm_eps=norm_eps, **fields))
