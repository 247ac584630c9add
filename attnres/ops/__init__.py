"""Pure functions: the math of depth attention, one folder per op, each with its plain reference
(``reference.py``) beside the fast paths (``fused.py``, ``triton.py``)."""
from attnres.ops.common import DepthStats
from attnres.ops.depth_attention import (
    DepthAttentionOutput,
    depth_attention,
    depth_attention_reference,
    fused_depth_attention,
)
from attnres.ops.two_phase.reference import merge as merge_stats

__all__ = [
    "DepthAttentionOutput",
    "DepthStats",
    "depth_attention",
    "depth_attention_reference",
    "fused_depth_attention",
    "merge_stats",
]
