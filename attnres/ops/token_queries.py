"""Two-phase depth attention with per-token queries (method.md §5, low-rank query; §6).

The pseudo-queries of §6 are parameters, so Phase 1 can score all S queries of a
depth block before the block runs. A query that depends on the input can join
Phase 1 only if its input is known when the block starts. The low-rank query
``q_s = w_s + U_s V_s h`` (``attnres_weights="low_rank_query"``) reads
h = the most recent *completed* source, which is the same tensor for all S_n
sublayers of depth block n (b_{n-1}), so:

- ``low_rank_queries``: the S queries of a block at once, one [D, S r] product
  for the V_s h terms and one batched product for the U_s terms;
- ``phase1_token_queries``: Phase 1 with one query per (token, sublayer): the
  completed sources are read once per block for all S queries, as in §6;
- ``merge_partial_token``: Phase 2, the exact online-softmax merge of the
  intra-block partial sum with a per-token query (attnres.ops.two_phase.reference.merge_partial
  with the query per token).

Plain autograd: Phase 1 stacks its n sources once per block (a copy autograd
can keep; the stream's buffer is written in place later, so a view of it
cannot be saved here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnres.ops.common import DepthStats, compute_dtype, inverse_rms


def low_rank_queries(base: Tensor, up: Tensor, down: Tensor, h: Tensor) -> Tensor:
    """q_s = w_s + U_s (V_s h) for S queries at once.

    base [S, D] (the pseudo-queries w_s), up [S, D, r] (U_s), down [S, r, D] (V_s), h [B, T, D]
    -> [B, T, S, D], in h's dtype.
    """
    s_count, rank, d = down.shape
    coords = torch.matmul(h, down.to(h.dtype).reshape(s_count * rank, d).t())  # [B, T, S r]
    coords = coords.unflatten(-1, (s_count, rank))  # [B, T, S, r]
    delta = torch.einsum("btsr,sdr->btsd", coords, up.to(h.dtype))
    return delta + base.to(h.dtype)


def _heads_of(queries: Tensor, per_query_dims: int) -> int:
    """[..., D] -> 1; [..., H, D/H] -> H (``per_query_dims``: 4 for [B, T, S, D], 3 for [B, T, D])."""
    return 1 if queries.dim() == per_query_dims else queries.shape[-2]


def phase1_token_queries(
    sources: list[Tensor] | tuple[Tensor, ...],
    queries: Tensor,
    key_weights: Tensor | None,
    *,
    eps: float,
    kernel: str = "softmax",
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Phase 1 of §6 for S per-token queries over n completed sources.

    sources: n tensors [B, T, D]; queries [B, T, S, D] or [B, T, S, H, D/H]; key_weights [S, D] (key
    RMSNorm on) or None (off). Returns (S outputs h1_s [B, T, D] in the compute dtype,
    lse [B, T, S, H] float32/float64). With the sigmoid kernel h1 is the unnormalised sum and lse is 0.
    """
    heads = _heads_of(queries, 4)
    cd = compute_dtype(sources[0].dtype)
    v = torch.stack(sources, dim=2).to(cd)  # [B, T, n, D]
    b, t, n, d = v.shape
    s_count = queries.shape[2]
    u = queries.to(cd).reshape(b, t, s_count, d)
    if key_weights is not None:
        u = u * key_weights.to(cd)
    vh = v.view(b, t, n, heads, d // heads)
    dots = torch.einsum("btnhe,btshe->btnsh", vh, u.view(b, t, s_count, heads, d // heads))
    z = dots * inverse_rms(v, eps)[..., None, None] if key_weights is not None else dots  # [B, T, n, S, H]
    if kernel == "softmax":
        lse = torch.logsumexp(z, dim=2)  # [B, T, S, H]
        alpha = torch.exp(z - lse.unsqueeze(2))
    else:
        lse = z.new_zeros(b, t, s_count, heads)
        alpha = torch.sigmoid(z)
    h1 = torch.einsum("btnsh,btnhe->btshe", alpha, vh).reshape(b, t, s_count, d)
    return h1.unbind(2), lse


def merge_partial_token(
    stats: DepthStats, partial: Tensor, query: Tensor, key_weight: Tensor | None, eps: float, kernel: str = "softmax"
) -> Tensor:
    """Phase 2 with a per-token query: fold the partial sum p into a Phase-1 result, exactly.

    stats: h [B, T, D], lse [B, T, H]; partial [B, T, D], query [B, T, D] or [B, T, H, D/H], key_weight [D] or
    None. Softmax: h = (1 - w) h1 + w p with w = sigmoid(z_p - lse1); sigmoid: h = h1 + sigmoid(z_p) p.
    Returns partial's dtype.
    """
    heads = _heads_of(query, 3)
    cd = compute_dtype(partial.dtype)
    b, t, d = partial.shape
    p = partial.to(cd)
    u = query.to(cd).reshape(b, t, d)
    if key_weight is not None:
        u = u * key_weight.to(cd)
    ph = p.view(b, t, heads, d // heads)
    z = (ph * u.view(b, t, heads, d // heads)).sum(-1)  # [B, T, H]
    if key_weight is not None:
        z = z * inverse_rms(p, eps).unsqueeze(-1)
    h1h = stats.h.to(cd).view(b, t, heads, d // heads)
    if kernel == "softmax":
        h = torch.lerp(h1h, ph, torch.sigmoid(z - stats.lse.to(cd)).unsqueeze(-1))
    else:
        h = h1h + torch.sigmoid(z).unsqueeze(-1) * ph
    return h.reshape(b, t, d).to(partial.dtype)
