"""Pure functions: the math of depth attention, one folder per op, each with its plain reference
(``reference.py``) beside the fast paths (``fused.py``, ``triton.py``); ``backends.py`` chooses which
implementation runs each call, and says why (``attnres doctor``)."""

from attnres.ops.common import DepthStats
from attnres.ops.depth_attention import (
    DepthAttentionOutput,
    MultiQueryOutput,
    depth_attention,
    depth_attention_reference,
    fuse_score_weight,
    fused_depth_attention,
    multi_query_depth_attention,
    multi_query_depth_attention_reference,
    unfuse_score_weight,
)
from attnres.ops.two_phase.reference import merge as merge_stats

__all__ = [
    "DepthAttentionOutput",
    "DepthStats",
    "MultiQueryOutput",
    "depth_attention",
    "depth_attention_reference",
    "fuse_score_weight",
    "fused_depth_attention",
    "merge_stats",
    "multi_query_depth_attention",
    "multi_query_depth_attention_reference",
    "unfuse_score_weight",
]
