"""Depth attention (docs/method.md §3): ``reference.py`` the plain reference, ``fused.py`` the fused
autograd Function and the dispatcher, ``triton.py`` the GPU kernels (imported only on CUDA);
``multi_query.py`` several full-width queries read over the same sources in one pass (Inkling-2);
``k3.py`` Kimi K3's fused score weight (query ⊙ key-norm weight)."""

from attnres.ops.depth_attention.fused import depth_attention, fused_depth_attention
from attnres.ops.depth_attention.k3 import fuse_score_weight, unfuse_score_weight
from attnres.ops.depth_attention.multi_query import (
    MultiQueryOutput,
    multi_query_depth_attention,
    multi_query_depth_attention_reference,
)
from attnres.ops.depth_attention.reference import (
    DepthAttentionOutput,
    depth_attention_reference,
)

__all__ = [
    "DepthAttentionOutput",
    "MultiQueryOutput",
    "depth_attention",
    "depth_attention_reference",
    "fuse_score_weight",
    "fused_depth_attention",
    "multi_query_depth_attention",
    "multi_query_depth_attention_reference",
    "unfuse_score_weight",
]
