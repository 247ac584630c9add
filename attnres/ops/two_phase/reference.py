"""Two-phase depth attention, the plain reference (docs/method.md §6), as ordinary autograd.

Pseudo-queries do not depend on the input, so the S sublayers of a depth block can attend to the
completed blocks [b_0 … b_{n-1}] all at once:

- **Phase 1** (``phase1``, once per depth block): for every query s, the depth attention over the
  n completed sources, returned as ``DepthStats(h, lse)``: the normalised output and the
  log-sum-exp of the logits (attnres.ops.common).
- **Merge** (``merge``): two depth attentions over disjoint source sets combine exactly,
  ``lse = logaddexp(lse_a, lse_b)``, ``h = lerp(h_a, h_b, exp(lse_b - lse))``.
- **Phase 2** (``merge_partial``, per sublayer): attend to the one intra-block source, the
  partial sum p, and merge it in; the weight of p is ``exp(z_p - logaddexp(lse, z_p)) =
  sigmoid(z_p - lse)``.

For the sigmoid kernel the weights are not normalised: h is the plain weighted sum, lse is zero,
and merging adds.

``fused.py`` computes the same with custom autograd Functions (the sources read once per block in
backward too, from the stream's buffer in place); ``triton.py`` with GPU kernels for inference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnres.ops.common import (
    DepthStats,
    RMSNormArgs,
    compute_dtype,
    inverse_rms,
    split_heads,
)
from attnres.ops.depth_attention.reference import check_kernel


def check_phase1_inputs(values: Tensor, inv_rms: Tensor | None, queries: Tensor, key_weights: Tensor | None) -> int:
    """The number of heads of Phase 1's queries, after checking that the arguments line up."""
    if values.dim() != 4 or values.shape[2] == 0:
        raise ValueError(f"values must be [B, T, n, D] with n >= 1; got {tuple(values.shape)}")
    b, t, n, d = values.shape
    heads = check_queries(queries, key_weights, d)
    if inv_rms is not None and tuple(inv_rms.shape) != (b, t, n):
        raise ValueError(f"inv_rms must be [B, T, n] = {(b, t, n)}; got {tuple(inv_rms.shape)}")
    return heads


def check_queries(queries: Tensor, key_weights: Tensor | None, d: int) -> int:
    """The number of heads of S queries [S, D] or [S, H, D/H] over D source channels, after checking
    them and the key weights [S, D] (or None)."""
    if queries.dim() not in (2, 3):
        raise ValueError(f"queries must be [S, D] or [S, H, D/H]; got {tuple(queries.shape)}")
    heads = query_heads(queries)
    if heads * queries.shape[-1] != d:
        raise ValueError(f"queries {tuple(queries.shape)} do not cover the {d} source channels")
    if key_weights is not None and tuple(key_weights.shape) != (queries.shape[0], d):
        raise ValueError(f"key_weights must be [S, D]; got {tuple(key_weights.shape)}")
    return heads


def query_heads(queries: Tensor) -> int:
    """H of queries [S, D] (1) or [S, H, D/H]."""
    return 1 if queries.dim() == 2 else queries.shape[1]


def query_matrix(queries: Tensor, key_weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    """u = queries * key_weights as [S, D] in ``dtype`` (the queries alone without key weights): what every
    Phase-1 logit takes its dot product with. Kernels take ``.detach().contiguous()`` of it."""
    u = queries.to(dtype).reshape(queries.shape[0], -1)
    return u * key_weights.to(dtype) if key_weights is not None else u


def phase1(
    values: Tensor,
    inv_rms: Tensor | None,
    queries: Tensor,
    key_weights: Tensor | None = None,
    *,
    kernel: str = "softmax",
) -> DepthStats:
    """Phase 1: S static queries against n completed sources.

    values [B, T, n, D]; inv_rms [B, T, n], ``inverse_rms(values, eps)`` (None: no key norm);
    queries [S, D] or [S, H, D/H]; key_weights [S, D] (the key RMSNorm weights) or None.
    Returns ``DepthStats(h [B, T, S, D], lse [B, T, S, H])`` in the compute dtype. Gradients
    flow through values and inv_rms as given.
    """
    check_kernel(kernel)
    heads = check_phase1_inputs(values, inv_rms, queries, key_weights)
    cd = compute_dtype(values.dtype)
    v = split_heads(values.to(cd), heads)  # [B, T, n, H, D/H]
    z = torch.einsum("btnhe,she->btnsh", v, split_heads(query_matrix(queries, key_weights, cd), heads))
    if inv_rms is not None:
        z = z * inv_rms.to(cd)[..., None, None]
    if kernel == "softmax":
        lse = torch.logsumexp(z, dim=2)  # [B, T, S, H]
        alpha = torch.exp(z - lse.unsqueeze(2))
    else:
        lse = z.new_zeros(z.shape[:2] + z.shape[3:])
        alpha = torch.sigmoid(z)
    h = torch.einsum("btnsh,btnhe->btshe", alpha, v).flatten(-2)
    return DepthStats(h, lse)


def merge(a: DepthStats, b: DepthStats, kernel: str = "softmax") -> DepthStats:
    """Exactly combine the depth attentions over two disjoint source sets (h [..., D], lse [..., H])."""
    check_kernel(kernel)
    if kernel != "softmax":
        return DepthStats(a.h + b.h, a.lse)
    heads = a.lse.shape[-1]
    w = torch.sigmoid(b.lse - a.lse)  # the second set's share of the total mass
    h_b = b.h.to(a.h.dtype)
    if heads == 1:
        h = torch.lerp(a.h, h_b, w.to(a.h.dtype))
    else:
        h = torch.lerp(split_heads(a.h, heads), split_heads(h_b, heads), w.to(a.h.dtype).unsqueeze(-1)).flatten(-2)
    return DepthStats(h, torch.logaddexp(a.lse, b.lse))


def merge_norm(
    a: DepthStats, b: DepthStats, kernel: str, norm: RMSNormArgs | None, dtype: torch.dtype | None = None
) -> Tensor:
    """The read of a sublayer whose depth attention is the merge of two (Full AttnRes: the group's Phase 1 and
    the sources completed inside the group): ``merge(a, b).h`` in ``dtype`` (default a.h's), then ``norm``."""
    h = merge(a, b, kernel).h
    h = h.to(dtype) if dtype is not None else h
    return h if norm is None else norm(h)


def merge_partial(
    stats: DepthStats,
    partial: Tensor,
    query: Tensor,
    key_weight: Tensor | None,
    eps: float,
    kernel: str = "softmax",
    norm: RMSNormArgs | None = None,
) -> Tensor:
    """Phase 2: fold the intra-block partial sum p [B, T, D] into one query's Phase-1 result, exactly.

    stats: h [B, T, D], lse [B, T, H]; query [D] or [H, D/H]; key_weight [D] (key norm on) or None.
    ``norm``: the RMSNorm the reading sublayer applies next; the result is then norm(h). Returns
    partial's dtype.
    """
    check_kernel(kernel)
    heads = stats.lse.shape[-1]
    d = partial.shape[-1]
    cd = compute_dtype(partial.dtype)
    u = query.to(cd).reshape(d)
    if key_weight is not None:
        u = u * key_weight.to(cd)
    p = split_heads(partial.to(cd), heads)  # [B, T, H, D/H]
    z = (p * split_heads(u, heads)).sum(-1)  # [B, T, H]
    if key_weight is not None:
        z = z * inverse_rms(partial, eps).unsqueeze(-1)
    h1 = split_heads(stats.h.to(cd), heads)
    if kernel == "softmax":
        h = torch.lerp(h1, p, torch.sigmoid(z - stats.lse.to(cd)).unsqueeze(-1))
    else:
        h = h1 + torch.sigmoid(z).unsqueeze(-1) * p
    h = h.flatten(-2).to(partial.dtype)
    return h if norm is None else norm(h)
