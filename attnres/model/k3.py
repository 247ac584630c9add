"""The two elementwise formulas Kimi K3 adds to Kimi Linear, as plain tensor functions (the modules
that use them are in ``attnres.model.k3_blocks``; both serving writers read the same definitions).

- **SiTU**, K3's MLP and expert activation (``situ_beta``, ``situ_linear_beta``):
  ``situ(up, gate) = beta·tanh(gate/beta)·sigmoid(gate) · up``, with ``up`` first squashed to
  ``linear_beta·tanh(up/linear_beta)`` when a linear beta is set. beta -> infinity gives SwiGLU.
- **the bounded KDA decay** (``kda_gate_lower_bound`` = b < 0): the per-channel log decay of a step is
  ``b·sigmoid(exp(A_log)·(f + dt_bias))``, in (b, 0), so no step forgets more than a factor exp(b);
  Kimi Linear's is ``-exp(A_log)·softplus(f + dt_bias)``, unbounded below.

Both compute in at least float32 (as mlx-lm and llama.cpp do) and return the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the ModelConfig fields of K3's additions (attnres.model.k3_blocks), each off by default
K3_OPTIONS = (
    "situ_beta",
    "situ_linear_beta",
    "kda_full_rank_gate",
    "kda_gate_lower_bound",
    "mla_output_gate",
    "moe_layer_freq",
    "moe_groups",
    "moe_topk_groups",
    "moe_latent_dim",
    "moe_latent_norm",
)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def situ(up: Tensor, gate: Tensor, beta: float, linear_beta: float | None = None) -> Tensor:
    """K3's activation: beta·tanh(gate/beta)·sigmoid(gate) times ``up`` (squashed to
    linear_beta·tanh(up/linear_beta) when linear_beta is set)."""
    wide = _wide(up.dtype)
    g, u = gate.to(wide), up.to(wide)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(up.dtype)


def bounded_log_decay(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """K3's KDA log decay ``lower_bound·sigmoid(exp(A_log)·(f + dt_bias))`` (broadcasting: ``f`` and
    ``dt_bias`` per channel, ``A_log`` per head)."""
    wide = _wide(f.dtype)
    return lower_bound * torch.sigmoid(torch.exp(A_log.to(wide)) * (f.to(wide) + dt_bias.to(wide)))
