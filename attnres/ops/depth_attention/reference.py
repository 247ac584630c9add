"""Depth attention, the plain reference: docs/method.md §3 written as ordinary autograd.

For sources v_0 … v_{K-1}, a query q and a key-norm weight g:

    logit_i = q · RMSNorm_g(v_i)        (no 1/sqrt(d) temperature)
    alpha   = softmax_i(logit)          (per token, and per head)
    h       = sum_i alpha_i v_i

Heads. A query of shape ``[H, D/H]`` splits the channels into H groups with their own weights
(Table 4, "multi-head"). The key RMSNorm still runs over the whole ``D``-vector (the same φ as
single-head), so with zero queries every head is uniform and the zero-query equivalence holds for
any H.

Precision. Logits, softmax statistics and weights are float32 for float32, bfloat16 and float16
inputs (float64 stays float64, for gradcheck).

Easy to read and checkable in float64; it keeps every [B, T, K, D] intermediate for backward.
``fused.py`` computes the same thing keeping only [B, T, K]-sized tensors, ``triton.py`` in one
pass over the sources on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnres.ops.common import DepthStats, compute_dtype, split_heads

KERNELS = ("softmax", "sigmoid")


class DepthAttentionOutput(NamedTuple):
    h: Tensor
    weights: Tensor | None  # [K, B, T] or [K, B, T, H]
    stats: DepthStats | None


# ----------------------------------------------------------------------------- shapes


def query_heads(query: Tensor, d: int) -> int:
    """Number of depth-attention heads implied by the query's shape."""
    if query.dim() in (1, 3):  # [D] or [B, T, D]
        if query.shape[-1] != d:
            raise ValueError(f"query has {query.shape[-1]} channels, sources have {d}")
        return 1
    if query.dim() in (2, 4):  # [H, D/H] or [B, T, H, D/H]
        h, dh = query.shape[-2:]
        if h * dh != d:
            raise ValueError(f"query heads {h} x {dh} do not cover the {d} source channels")
        return h
    raise ValueError(f"query must be [D], [H, D/H], [B, T, D] or [B, T, H, D/H]; got shape {tuple(query.shape)}")


def is_per_token(query: Tensor) -> bool:
    """A query per token ([B, T, D] / [B, T, H, D/H]) rather than one shared by all tokens."""
    return query.dim() >= 3


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not supported; use one of {KERNELS}")


# ----------------------------------------------------------------------------- argument checks
# What the public ops check before computing: types, ranks, shapes, dtypes and devices, from tensor
# metadata only (no data is read, nothing synchronises, torch.compile traces straight through).


def check_sources(sources, name: str = "sources") -> None:
    """``sources`` is one floating tensor [K, B, T, D] holding at least one source."""
    if not isinstance(sources, Tensor):
        if isinstance(sources, (list, tuple)):
            raise TypeError(
                f"{name} must be one tensor [K, B, T, D]; got a {type(sources).__name__} of {len(sources)} "
                f"items: pass torch.stack({name}) (the K sources [B, T, D] stacked along a new dim 0)"
            )
        raise TypeError(f"{name} must be a tensor [K, B, T, D]; got {type(sources).__name__}")
    if sources.dim() != 4:
        hint = (
            " (one [B, T, D] tensor: add the source dim with unsqueeze(0), or stack K of them)"
            if sources.dim() == 3
            else ""
        )
        raise ValueError(
            f"{name} must be [K, B, T, D] (K sources of [B, T, D]); got shape {tuple(sources.shape)}{hint}"
        )
    if sources.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one source; got shape {tuple(sources.shape)} (K = 0)")
    if not sources.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {sources.dtype}")


def check_companion(x, name: str, expected: str, sources: Tensor, optional: bool = False) -> None:
    """``x`` (a query or a weight read with ``sources``) is a floating tensor on the sources' device.
    ``expected``: its expected shape, in words, for the messages."""
    if x is None and optional:
        return
    if not isinstance(x, Tensor):
        what = "a tensor" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {what} of shape {expected}; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {x.dtype}")
    if x.device != sources.device:
        raise ValueError(
            f"{name} is on {x.device} but sources are on {sources.device}; move it with {name}.to(sources.device)"
        )


def check_query(query, sources: Tensor, name: str = "query") -> None:
    """``query`` is [D], [H, D/H], or per token [B, T, D] / [B, T, H, D/H] for sources [K, B, T, D]."""
    _, b, t, d = sources.shape
    expected = f"[D] = [{d}], [H, D/H] with H * D/H = {d}, or per token [B, T, D] = [{b}, {t}, {d}] / [B, T, H, D/H]"
    check_companion(query, name, expected, sources)
    rank = query.dim()
    ok = rank in (1, 2, 3, 4)
    if ok and rank >= 3:
        ok = tuple(query.shape[:2]) == (b, t)
    if ok and rank in (1, 3):
        ok = query.shape[-1] == d
    if ok and rank in (2, 4):
        ok = query.shape[-2] * query.shape[-1] == d
    if not ok:
        raise ValueError(f"{name} must be {expected}; got shape {tuple(query.shape)}")


def check_vector(x, name: str, sources: Tensor, optional: bool = True) -> None:
    """``x`` is one weight per channel, [D], for sources [K, B, T, D] (or None when ``optional``)."""
    d = sources.shape[-1]
    check_companion(x, name, f"[D] = [{d}]", sources, optional=optional)
    if x is not None and tuple(x.shape) != (d,):
        raise ValueError(f"{name} must be [D] = [{d}] (one weight per source channel); got shape {tuple(x.shape)}")


def _expand_heads(x: Tensor, d: int) -> Tensor:
    """Per-head quantity [..., H] -> per-channel [..., D]."""
    return x.repeat_interleave(d // x.shape[-1], dim=-1)


# ----------------------------------------------------------------------------- reference


def _reference_logits(v: Tensor, query: Tensor, key_weight: Tensor | None, eps: float, normalize_keys: bool) -> Tensor:
    """v: [B, T, K, D] (compute dtype). Returns logits [B, T, K, H]."""
    d = v.shape[-1]
    heads = query_heads(query, d)
    keys = v
    if normalize_keys:
        keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        if key_weight is not None:
            keys = keys * key_weight.to(v.dtype)
    q = query.to(v.dtype)
    q = q.reshape(*q.shape[:-2], d) if heads > 1 else q  # [D] or [B, T, D]
    q = q.unsqueeze(-2) if is_per_token(query) else q  # broadcast over K
    return split_heads(keys * q, heads).sum(-1)


def depth_attention_reference(
    sources: Tensor,
    query: Tensor,
    key_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    kernel: str = "softmax",
    normalize_keys: bool = True,
) -> DepthAttentionOutput:
    """Plain-autograd depth attention over sources [K, B, T, D].

    Returns h [B, T, D] (the sources' dtype), the weights [K, B, T] ([K, B, T, H] for a
    multi-head query) and, for softmax, ``DepthStats(h, lse [B, T, H])`` in the compute dtype.
    """
    check_kernel(kernel)
    check_sources(sources)
    check_query(query, sources)
    check_vector(key_weight, "key_weight", sources)
    cd = compute_dtype(sources.dtype)
    v = sources.movedim(0, 2).to(cd)  # [B, T, K, D]
    d = v.shape[-1]
    z = _reference_logits(v, query, key_weight, eps, normalize_keys)  # [B, T, K, H]
    if kernel == "softmax":
        lse = torch.logsumexp(z, dim=2)  # [B, T, H]
        alpha = torch.exp(z - lse.unsqueeze(2))
    else:
        alpha = torch.sigmoid(z)
    h = (_expand_heads(alpha, d) * v).sum(2)
    stats = DepthStats(h, lse) if kernel == "softmax" else None
    weights = alpha.movedim(2, 0)  # [K, B, T, H]
    if weights.shape[-1] == 1 and query.dim() in (1, 3):
        weights = weights.squeeze(-1)
    return DepthAttentionOutput(h.to(sources.dtype), weights, stats)
