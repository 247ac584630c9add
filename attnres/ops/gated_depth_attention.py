"""The gated multi-head depth attention that popular write-ups present as AttnRes (method.md §5).

For a current state x [B, T, D] and K sources v_i [B, T, D], with H heads of width
d_h = D / H (projections W_q, W_k, W_v [D, D] with biases b_q, b_k, b_v, and a
learned scalar gate g):

    q   = W_q x + b_q,   k_i = W_k v_i + b_k,   u_i = W_v v_i + b_v      (split into H heads)
    z_ih = q_h · k_ih / sqrt(d_h)
    a_ih = softmax_i(z_ih)
    out  = g x + (1 - g) · concat_h( sum_i a_ih u_ih )

Two implementations, equal up to rounding:

- literal (``absorbed=False``): as written above and as users write it: every source
  is projected to a key and a value, K d^2 operations each per token and consumer;
- absorbed (default): the projections move to the other side of the products,
  z_ih = (W_k,h^T q_h) · v_i + q_h · b_k,h and sum_i a_ih u_ih = W_v,h (sum_i a_ih v_i) + b_v,h
  (the weights of a head sum to 1). Per token: 3 D^2 + 2 K H D operations instead of
  (2K + 1) D^2, and no [K, D] keys or values are materialised.

The term q_h · b_k,h is the same for every source of a head, so softmax ignores it:
b_k is inert (it receives zero gradient). It is kept because the module as shipped
has it; the absorbed form still adds it so that both forms use the same parameters.

Precision: logits and softmax in float32 for 16-bit inputs (float64 stays float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from attnres.ops.common import compute_dtype


def gated_depth_attention(
    current: Tensor,
    sources: Sequence[Tensor],
    q_weight: Tensor,
    q_bias: Tensor,
    k_weight: Tensor,
    k_bias: Tensor,
    v_weight: Tensor,
    v_bias: Tensor,
    gate: Tensor,
    *,
    heads: int,
    absorbed: bool = True,
    return_weights: bool = False,
):
    """current [B, T, D], sources K tensors [B, T, D] -> out [B, T, D] (and, with ``return_weights``,
    the depth weights [K, B, T, H] as a second value, float32/float64)."""
    b, t, d = current.shape
    dh = d // heads
    dtype = current.dtype
    values = torch.stack(list(sources), dim=2)  # [B, T, K, D]
    k_count = values.shape[2]
    q = F.linear(current, q_weight.to(dtype), q_bias.to(dtype)).view(b, t, heads, dh)
    if absorbed:
        wk = k_weight.to(dtype).view(heads, dh, d)
        u = torch.einsum("bthe,hed->bthd", q, wk)  # W_k,h^T q_h
        z = torch.einsum("btkd,bthd->btkh", values, u)
        z = z + (q * k_bias.to(dtype).view(heads, dh)).sum(-1).unsqueeze(2)  # q_h . b_k,h (inert)
    else:
        keys = F.linear(values, k_weight.to(dtype), k_bias.to(dtype)).view(b, t, k_count, heads, dh)
        z = torch.einsum("bthe,btkhe->btkh", q, keys)
    cd = compute_dtype(dtype)
    alpha = torch.softmax(z.to(cd) / math.sqrt(dh), dim=2)  # [B, T, K, H]
    a = alpha.to(dtype)
    if absorbed:
        mixed = torch.einsum("btkh,btkd->bthd", a, values)  # per head, a mix of the raw sources
        out = torch.einsum("bthd,hed->bthe", mixed, v_weight.to(dtype).view(heads, dh, d))
        out = out.reshape(b, t, d) + v_bias.to(dtype)
    else:
        vals = F.linear(values, v_weight.to(dtype), v_bias.to(dtype)).view(b, t, k_count, heads, dh)
        out = torch.einsum("btkh,btkhe->bthe", a, vals).reshape(b, t, d)
    g = gate.to(dtype)
    h = g * current + (1 - g) * out
    if return_weights:
        return h, alpha.movedim(2, 0)
    return h
