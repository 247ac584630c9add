"""Depth attention (docs/method.md §3): ``reference.py`` the plain reference, ``fused.py`` the fused
autograd Function and the dispatcher, ``triton.py`` the GPU kernels (imported only on CUDA)."""
from attnres.ops.depth_attention.fused import depth_attention, fused_depth_attention
from attnres.ops.depth_attention.reference import DepthAttentionOutput, depth_attention_reference

__all__ = ["DepthAttentionOutput", "depth_attention", "depth_attention_reference", "fused_depth_attention"]
