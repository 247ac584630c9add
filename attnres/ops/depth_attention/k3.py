"""Kimi K3's fused score weight: the pseudo-query and the key-norm weight folded into one vector.

A depth-attention logit is ``w · (g ⊙ v · r)`` (docs/method.md §3), with r the inverse RMS of the
source v. Only the product ``w ⊙ g`` ever acts, so a checkpoint can store one vector per read instead
of the pair: llama.cpp's ``kimi-k3`` keeps ``attn_res_score`` = ``res_norm.weight`` ⊙ ``res_proj.weight``
(the score of docs/method.md §10, Σ_c (v_c r) · norm.weight_c · proj.weight_c). The two forms
convert exactly:

    fused = fuse_score_weight(query, key_norm_weight)      # w ⊙ g
    query, key_norm_weight = unfuse_score_weight(fused)    # (w ⊙ g, ones): the same logits

``fuse(unfuse(f)) == f`` bit for bit; ``unfuse(fuse(w, g))`` is a different pair computing the same
logits (to the rounding of one product). A fused vector goes to ``depth_attention`` as the query with
``key_weight=None``, or as the pair ``unfuse_score_weight`` returns. What cannot be recovered is the
split of the product into w and g, which only training sees (the two are separate parameters with
their own optimizer states); fusing is for inference and export.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnres.ops.common import compute_dtype


def fuse_score_weight(query: Tensor, key_norm_weight: Tensor | None = None) -> Tensor:
    """``query ⊙ key_norm_weight``: the one vector per read that scores sources as the pair does.

    query: [D] (or any [..., D], e.g. K3's ``res_proj.weight`` [1, D]); key_norm_weight: [D], or None
    (no key-norm weight: the query itself). The product is taken in float32 for 16-bit inputs (exact
    for bfloat16 x bfloat16, as K3 scores in float32), float64 for float64; it has that dtype.
    """
    if not isinstance(query, Tensor) or not query.is_floating_point() or query.dim() < 1:
        raise TypeError(f"query must be a floating-point tensor [..., D]; got {_describe(query)}")
    d = query.shape[-1]
    if key_norm_weight is None:
        return query.to(compute_dtype(query.dtype)).clone()
    if not isinstance(key_norm_weight, Tensor) or not key_norm_weight.is_floating_point():
        raise TypeError(
            f"key_norm_weight must be a floating-point tensor [D] = [{d}] or None; got {_describe(key_norm_weight)}"
        )
    if tuple(key_norm_weight.shape) != (d,):
        raise ValueError(
            f"key_norm_weight must be [D] = [{d}] (query has {d} channels); got shape {tuple(key_norm_weight.shape)}"
        )
    if key_norm_weight.device != query.device:
        raise ValueError(f"key_norm_weight is on {key_norm_weight.device} but query is on {query.device}")
    cd = compute_dtype(torch.promote_types(query.dtype, key_norm_weight.dtype))
    return query.to(cd) * key_norm_weight.to(cd)


def unfuse_score_weight(fused: Tensor) -> tuple[Tensor, Tensor]:
    """A (query, key_norm_weight) pair for a fused score weight [..., D]: (a copy of it, ones [D]).

    With it, ``depth_attention(sources, query, key_norm_weight)`` computes the logits of the fused
    vector; ``fuse_score_weight`` of the pair gives ``fused`` back exactly."""
    if not isinstance(fused, Tensor) or not fused.is_floating_point() or fused.dim() < 1:
        raise TypeError(f"fused must be a floating-point tensor [..., D]; got {_describe(fused)}")
    return fused.clone(), torch.ones(fused.shape[-1], dtype=fused.dtype, device=fused.device)


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__
