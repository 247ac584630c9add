"""Several depth-attention reads of the same sources in one pass: Q queries, one read of the K sources.

A layer that needs more than one depth mixture of the same sources (Inkling-2's full-attention
layers read three, one each for the inputs of the attention's q, k and v projections) should not
read the K sources three times. Here the Q queries meet the sources in one product
``[K·B·T, D] @ [D, Q]``, the key statistics are computed once, and each mixture is one batched
``[Q, K] @ [K, D]`` per token. This is not the multi-head query ``[H, D/H]`` of
``depth_attention`` (which splits the channels into H groups and returns one output): every query
here spans all D channels and has its own output.

For sources v_0 … v_{K-1} [B, T, D], queries w_1 … w_Q [D], a key-norm weight g (or none) and a
score scale s (1 by default; Inkling-2 uses D^-1/2):

    r_i       = 1 / sqrt(mean(v_i²) + eps)                 (per token)
    z_{q,i}   = s · w_q · (g ⊙ v_i · r_i)                  (docs/method.md §3 with a scale)
    α_{q,·}   = softmax_i(z_{q,·})                         (or sigmoid)
    h_q       = Σ_i α_{q,i} v_i                            values="raw" (the paper, Kimi K3)
    h_q       = Σ_i α_{q,i} v_i · r_i                      values="normalized" (Inkling-2)

Inkling-2 (transformers' ``Inkling2BlockAttentionResidual``) is ``g = None``, ``scale = D**-0.5``,
``values="normalized"``, eps 1e-6, zero-initialised float32 queries; its reads return float32.
The normalised values are never built: α_{q,i} r_i weighs the raw source instead.

Precision: logits, weights and the mixture in float32 for float32/bfloat16/float16 sources (float64
stays float64); the result has the sources' dtype. Plain autograd (every intermediate is [Q, K, B, T]
or [K, B, T], besides the sources in the compute dtype).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnres.ops.common import compute_dtype
from attnres.ops.depth_attention.reference import (
    check_companion,
    check_kernel,
    check_sources,
    check_vector,
)

VALUES = ("raw", "normalized")


class MultiQueryOutput(NamedTuple):
    h: Tensor  # [Q, B, T, D]
    weights: Tensor  # [Q, K, B, T]


def _check_queries(queries, sources: Tensor) -> None:
    d = sources.shape[-1]
    check_companion(queries, "queries", f"[Q, D] = [Q, {d}]", sources)
    if queries.dim() == 1 and queries.shape[0] == d:
        raise ValueError(
            f"queries must be [Q, D] = [Q, {d}]; got one query of shape {tuple(queries.shape)}: "
            "pass queries.unsqueeze(0) (Q = 1)"
        )
    if queries.dim() != 2 or queries.shape[-1] != d or queries.shape[0] == 0:
        raise ValueError(
            f"queries must be [Q, D] = [Q, {d}] with Q >= 1 (one full-width query per read); "
            f"got shape {tuple(queries.shape)}"
        )


def multi_query_depth_attention(
    sources: Tensor,
    queries: Tensor,
    key_norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    scale: float | None = None,
    values: str = "raw",
    kernel: str = "softmax",
    return_weights: bool = False,
):
    """Q depth-attention reads of the same sources in one pass (see the module docstring).

    sources: [K, B, T, D]. queries: [Q, D], one full-width query per read. key_norm_weight: the key
    RMSNorm's weight [D], shared by the Q reads, or None (an unweighted key norm). eps: the key
    RMSNorm's eps. scale: multiplies every logit (None: 1, the paper's AttnRes; Inkling-2:
    ``D ** -0.5``). values: "raw" mixes the sources as they are, "normalized" their RMS-normalised
    form v_i · r_i (unweighted: the key-norm weight scores, it does not scale the values).
    kernel: "softmax" or "sigmoid".

    Returns h [Q, B, T, D] (the sources' dtype), or ``MultiQueryOutput(h, weights [Q, K, B, T])``
    with ``return_weights`` (the compute dtype).
    """
    check_kernel(kernel)
    check_sources(sources)
    _check_queries(queries, sources)
    check_vector(key_norm_weight, "key_norm_weight", sources)
    if values not in VALUES:
        raise ValueError(f"values={values!r} is not supported; use one of {VALUES}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"scale={scale!r} is invalid: give a positive number (Inkling-2: D ** -0.5) or None")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps={eps!r} is invalid: give a non-negative number (the key RMSNorm's eps)")

    cd = compute_dtype(sources.dtype)
    k, b, t, d = sources.shape
    v = sources.to(cd)
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [K, B, T]
    u = queries.to(cd)
    if key_norm_weight is not None:
        u = u * key_norm_weight.to(cd)
    if scale is not None:
        u = u * scale
    # every query meets every source in one product: [K*B*T, D] @ [D, Q]
    s = (v.reshape(k * b * t, d) @ u.t()).t().reshape(-1, k, b, t)  # [Q, K, B, T]
    z = s * r
    alpha = torch.softmax(z, dim=1) if kernel == "softmax" else torch.sigmoid(z)
    mix = alpha * r if values == "normalized" else alpha  # weights on the raw sources
    # per token, [Q, K] @ [K, D]
    h = torch.matmul(mix.permute(2, 3, 0, 1), v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3)  # [Q, B, T, D]
    h = h.to(sources.dtype).contiguous()
    return MultiQueryOutput(h, alpha) if return_weights else h


def multi_query_depth_attention_reference(
    sources: Tensor,
    queries: Tensor,
    key_norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    scale: float | None = None,
    values: str = "raw",
    kernel: str = "softmax",
) -> MultiQueryOutput:
    """The same reads one query at a time, with the normalised keys (and values) built explicitly:
    the plain form the fast one is tested against. Returns ``MultiQueryOutput(h, weights)``."""
    check_kernel(kernel)
    check_sources(sources)
    _check_queries(queries, sources)
    check_vector(key_norm_weight, "key_norm_weight", sources)
    if values not in VALUES:
        raise ValueError(f"values={values!r} is not supported; use one of {VALUES}")
    cd = compute_dtype(sources.dtype)
    v = sources.to(cd)
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)  # [K, B, T, D]
    keys = normed * key_norm_weight.to(cd) if key_norm_weight is not None else normed
    vals = normed if values == "normalized" else v
    outs, weights = [], []
    for q in queries.to(cd).unbind(0):
        z = (keys * q).sum(-1) * (1.0 if scale is None else scale)  # [K, B, T]
        a = torch.softmax(z, dim=0) if kernel == "softmax" else torch.sigmoid(z)
        outs.append((a.unsqueeze(-1) * vals).sum(0))
        weights.append(a)
    return MultiQueryOutput(torch.stack(outs).to(sources.dtype), torch.stack(weights))
