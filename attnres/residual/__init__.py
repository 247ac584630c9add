"""Residual schemes behind one interface.

- base.py: the interface (``ResidualScheme``, ``Stream``, ``DepthState``, ``StreamOps``);
- registry.py: ``RESIDUALS``, what each scheme is, its options and their checks, its geometry;
- config.py: ``ResidualConfig``, what a scheme reads; modules.py: schemes for your own model
  from plain arguments (``FullAttnRes``, ``BlockAttnRes``, ``residual_scheme``); norms.py: the
  pre-norm eps that makes a zero-init model PreNorm exactly; param_groups.py: optimizer groups;
- options.py: scheme options and their validation; observe.py: observers (the depth record,
  residual I/O counting), kept out of the streams' arithmetic; record.py: the settings a scheme's
  state dict saves, so that its weights never load into a scheme computing another function;
- prenorm.py: the PreNorm baseline; method.py: the paper's method in one screen (the depth blocks,
  ``source_plan``, and the reference stream, each line of docs/method.md §3-§4 beside its code);
  attnres.py: Full and Block AttnRes as one scheme, with each variant a named object in variants.py
  and each fast form of its stream in depth_streams.py;
- scaled.py: single-state rivals (ReZero, LayerScale, Highway);
- dense.py: cross-layer rivals over block outputs (DenseFormer, MUDD);
- hyper.py: multi-stream rivals (Hyper-Connections, mHC);
- gated.py: the gated multi-head depth attention of popular write-ups (a rival, not AttnRes).
"""

from attnres.residual.attnres import DepthAttentionResidual
from attnres.residual.base import DepthState, ResidualScheme, Stream, StreamOps
from attnres.residual.config import ResidualConfig
from attnres.residual.dense import DenseFormerResidual, MUDDResidual
from attnres.residual.gated import GatedDepthAttentionResidual
from attnres.residual.hyper import (
    HyperConnectionResidual,
    ManifoldHyperConnectionResidual,
    sinkhorn,
)
from attnres.residual.method import source_plan
from attnres.residual.modules import (
    BlockAttnRes,
    FullAttnRes,
    residual_config,
    residual_scheme,
)
from attnres.residual.norms import match_prenorm_eps, prenorm_eps_scales
from attnres.residual.observe import (
    DepthRecord,
    DepthRecorder,
    IOCounter,
    StreamObserver,
    observing,
)
from attnres.residual.options import Option
from attnres.residual.param_groups import param_groups, parameter_kinds
from attnres.residual.prenorm import PreNormResidual
from attnres.residual.record import SchemeMismatch
from attnres.residual.registry import (
    RESIDUALS,
    SchemeInfo,
    build_residual,
    scheme_options,
    validate_scheme,
)
from attnres.residual.scaled import HighwayResidual, LayerScaleResidual, ReZeroResidual

__all__ = [
    "RESIDUALS",
    "BlockAttnRes",
    "DenseFormerResidual",
    "DepthAttentionResidual",
    "DepthRecord",
    "DepthRecorder",
    "DepthState",
    "FullAttnRes",
    "GatedDepthAttentionResidual",
    "HighwayResidual",
    "HyperConnectionResidual",
    "IOCounter",
    "LayerScaleResidual",
    "MUDDResidual",
    "ManifoldHyperConnectionResidual",
    "Option",
    "PreNormResidual",
    "ReZeroResidual",
    "ResidualConfig",
    "ResidualScheme",
    "SchemeInfo",
    "SchemeMismatch",
    "Stream",
    "StreamObserver",
    "StreamOps",
    "build_residual",
    "match_prenorm_eps",
    "observing",
    "param_groups",
    "parameter_kinds",
    "prenorm_eps_scales",
    "residual_config",
    "residual_scheme",
    "scheme_options",
    "sinkhorn",
    "source_plan",
    "validate_scheme",
]
