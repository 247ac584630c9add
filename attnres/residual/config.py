"""A residual scheme's own configuration, for models that are not ours.

``ModelConfig`` describes a whole decoder; a scheme reads only a few of its fields: the width, the
number of sublayers, the norm eps and its options. ``ResidualConfig`` is exactly that, so a scheme
can be built for any model from plain arguments (``attnres.residual.modules``: ``residual_scheme``,
``FullAttnRes``, ``BlockAttnRes``), with any number of sublayers; they validate it with the same
checks as ``ModelConfig``'s (``attnres.residual.args``).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres.residual.args import SchemeArgs


@dataclass
class _SchemeShape:
    residual: str
    d_model: int
    n_sublayers: int
    norm_eps: float = 1e-6


@dataclass
class ResidualConfig(SchemeArgs, _SchemeShape):
    """What a residual scheme reads: its shape, then the options of every scheme family, inherited
    from ``attnres.residual.args.SchemeArgs`` exactly as ``ModelConfig`` inherits them.

    ``n_sublayers``: L, the sublayers the scheme connects (any number for Full and Block AttnRes;
    schemes that act once per Transformer block, DenseFormer and MUDD, need pairs). ``norm_eps``:
    the eps of the depth attention's key RMSNorm (and of the rivals' norms)."""

    @property
    def n_layers(self) -> int:
        """Transformer blocks of two sublayers each (what DenseFormer, MUDD and LayerScale count)."""
        return self.n_sublayers // 2
