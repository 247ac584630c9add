"""Pure functions: the math of depth attention, each with a plain reference beside the fast path."""
from attnres.ops.depth_attention import (
    DepthAttentionOutput,
    DepthStats,
    depth_attention,
    depth_attention_reference,
    finalize_stats,
    fused_depth_attention,
    merge_stats,
)

__all__ = [
    "DepthAttentionOutput",
    "DepthStats",
    "depth_attention",
    "depth_attention_reference",
    "finalize_stats",
    "fused_depth_attention",
    "merge_stats",
]
