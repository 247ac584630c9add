"""attnres: Attention Residuals (Kimi team, 2026) for PyTorch.

    from attnres import ModelConfig, AttnResLM
    model = AttnResLM(ModelConfig(residual="block", attnres_blocks=8))

The names below are imported on first use, not with the package: the ``attnres`` command then
starts without PyTorch, and a Ctrl-C while PyTorch loads is its own, not an import traceback.
"""

import importlib

__version__ = "0.1.0"
_HOMES = {
    "AttnResLM": "attnres.model",
    "LMOutput": "attnres.model",
    "ModelConfig": "attnres.model",
    "depth_attention": "attnres.ops",
    "merge_stats": "attnres.ops",
    "RESIDUALS": "attnres.residual",
    # your own model (docs/own_model.md)
    "BlockAttnRes": "attnres.residual",
    "FullAttnRes": "attnres.residual",
    "residual_scheme": "attnres.residual",
    "DepthState": "attnres.residual",
    "ResidualScheme": "attnres.residual",
    "param_groups": "attnres.residual.param_groups",
    "match_prenorm_eps": "attnres.residual.norms",
    "checkpoint_block": "attnres.residual.recompute",
    "DepthRecord": "attnres.residual.observe",
    "record_depth": "attnres.residual.observe",
    "depth_weight_matrix": "attnres.analysis.depth",
    "source_labels": "attnres.analysis.depth",
    "multi_query_depth_attention": "attnres.ops",
}
__all__ = [
    "AttnResLM",
    "BlockAttnRes",
    "DepthRecord",
    "DepthState",
    "FullAttnRes",
    "LMOutput",
    "ModelConfig",
    "RESIDUALS",
    "ResidualScheme",
    "checkpoint_block",
    "depth_attention",
    "depth_weight_matrix",
    "match_prenorm_eps",
    "merge_stats",
    "multi_query_depth_attention",
    "param_groups",
    "record_depth",
    "residual_scheme",
    "source_labels",
]


def __getattr__(name):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnres' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
