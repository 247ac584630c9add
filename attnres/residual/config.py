"""A residual scheme's own configuration, for models that are not ours.

``ModelConfig`` describes a whole decoder; a scheme reads only a few of its fields: the width, the
number of sublayers, the norm eps and its options. ``ResidualConfig`` is exactly that, so a scheme
can be built for any model from plain arguments (``attnres.residual.modules``: ``residual_scheme``,
``FullAttnRes``, ``BlockAttnRes``), with any number of sublayers; they validate it with the same
registry checks as ``ModelConfig``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class ResidualConfig:
    """What a residual scheme reads. The option fields and their defaults are ``ModelConfig``'s
    (``attnres options`` lists them; a test keeps the two in step).

    ``n_sublayers``: L, the sublayers the scheme connects (any number for Full and Block AttnRes;
    schemes that act once per Transformer block, DenseFormer and MUDD, need pairs). ``norm_eps``:
    the eps of the depth attention's key RMSNorm (and of the rivals' norms)."""

    residual: str
    d_model: int
    n_sublayers: int
    norm_eps: float = 1e-6
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
    layerscale_init: float | None = None
    highway_rank: int | None = None
    denseformer_dilation: int = 1
    denseformer_period: int = 1
    hyper_streams: int = 4
    hyper_dynamic: bool = True
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20
    gated_heads: int = 8

    @property
    def n_layers(self) -> int:
        """Transformer blocks of two sublayers each (what DenseFormer, MUDD and LayerScale count)."""
        return self.n_sublayers // 2
