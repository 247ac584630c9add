"""Gated multi-head depth attention (``residual="gated"``): what popular write-ups present as AttnRes.

Not the paper's method (docs/method.md §3-4), and not from the paper: a module that
many users copy believing it is AttnRes, kept here as a rival so that the difference
is measured. The module, as shipped:

    DepthAttention(dim, heads=8): q/k/v projections (nn.Linear with bias); q from the
    current state, k and v from the stacked history; softmax over depth scaled by
    1/sqrt(d_h) (d_h = dim / heads, the head width); output g·current + (1 − g)·mix with
    a learned scalar g initialised at 0.5; q_proj's weight N(0, 0.01), its bias 0;
    k_proj and v_proj keep PyTorch's default Linear initialisation.

How it is wired into the model (the choices the write-ups leave open; method.md §5):

- One module per consumer, not shared: sublayers l = 1 … L and the final aggregation
  (index L), as AttnRes has one query per consumer.
- History of consumer l: the embedding and the outputs of all earlier sublayers,
  [v_0, f_1, …, f_{l-1}]: the paper's sources, so that this scheme differs from Full
  AttnRes in the mechanism only (projections, heads, temperature, gate), not in what
  it reads.
- Current state x_l: a residual stream that the module's output replaces, as in the
  drop-in use ``x = depth_attn(x, history); x = x + sublayer(norm(x))``:

      x_1 = v_0
      h_l = DepthAttention_l(x_l, [v_0, f_1, …, f_{l-1}])     (the input of sublayer l)
      x_{l+1} = h_l + f_l,   f_l = sublayer_l(Norm_l(h_l))
      output: DepthAttention_{L+1}(x_{L+1}, [v_0, f_1, …, f_L]) -> final norm -> head

- Heads: ``gated_heads`` = H (default 8, the write-ups' default) channel groups of
  d/H with their own depth weights; the temperature is 1/sqrt(d/H).

At init it is not PreNorm: g = 0.5 halves the stream and adds a random value
projection. Parameters: (L + 1)(3d² + 3d + 1) (three d×d projections with biases and
the gate per consumer). ``attnres_impl="reference"`` runs the module literally
(every source projected to a key and a value); the other impls run the exact
rearrangement of ``attnres.ops.gated_depth_attention`` (3d² + 2KHd per token instead
of (2K + 1)d²). Depth weights are reported per head ([K, B, T, H]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

from attnres.ops.gated_depth_attention import gated_depth_attention
from attnres.residual.base import ResidualScheme, Stream, widened


def gated_params(config) -> int:
    """Per consumer (L sublayers + the final aggregation): W_q, W_k, W_v with biases, and the gate."""
    d = config.d_model
    return (config.n_sublayers + 1) * (3 * d * d + 3 * d + 1)


class DepthAttention(nn.Module):
    """``DepthAttention(dim, heads=8)`` as the write-ups ship it; ``forward(current, sources)``."""

    def __init__(self, dim: int, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.tensor(0.5))
        nn.init.normal_(self.q_proj.weight, mean=0.0, std=0.01)
        nn.init.zeros_(self.q_proj.bias)

    def forward(
        self, current: Tensor, sources: Sequence[Tensor], *, absorbed: bool = True, return_weights: bool = False
    ):
        """current [B, T, D], sources K tensors [B, T, D] (the history) -> [B, T, D]."""
        return gated_depth_attention(
            current, sources, *self.weights(), heads=self.heads, absorbed=absorbed, return_weights=return_weights
        )

    def weights(self):
        """The op's parameter arguments, in order (W_q, b_q, W_k, b_k, W_v, b_v, gate)."""
        return (
            self.q_proj.weight,
            self.q_proj.bias,
            self.k_proj.weight,
            self.k_proj.bias,
            self.v_proj.weight,
            self.v_proj.bias,
            self.gate,
        )


class GatedDepthAttentionResidual(ResidualScheme):
    scheme_name = "gated"

    def __init__(self, config):
        super().__init__()
        self.n_sublayers = config.n_sublayers
        self.d_model = config.d_model
        self.heads = config.gated_heads
        self.absorbed = config.attnres_impl != "reference"
        self.depth_attention = nn.ModuleList(
            DepthAttention(config.d_model, config.gated_heads) for _ in range(config.n_sublayers + 1)
        )

    def settings(self) -> dict:
        return {"n_sublayers": self.n_sublayers, "d_model": self.d_model, "gated_heads": self.heads}

    def _begin(self, embedding: Tensor) -> Stream:
        return GatedStream(self, [embedding], embedding)

    def _resume(self, history, state, cache=()):
        return GatedStream(self, history, state[0])


class GatedStream(Stream):
    """sources [v_0, f_1, …] (the history) and x, the residual stream the module output replaces."""

    def __init__(self, scheme: GatedDepthAttentionResidual, sources: list[Tensor], x: Tensor):
        super().__init__(scheme.n_sublayers)
        self.scheme = scheme
        self.sources = sources
        self.x = x
        self._h: Tensor | None = None  # the last read, to which its sublayer's output is added

    def _mix(self, l: int) -> Tensor:
        module = cast(DepthAttention, self.scheme.depth_attention[l])  # ModuleList items are typed Module
        return self.ops.gated(
            self.x, self.sources, *module.weights(), heads=module.heads, absorbed=self.scheme.absorbed
        )

    def _read(self, l: int) -> Tensor:
        self._h = self._mix(l)
        return self._h

    def _write(self, l: int, f: Tensor) -> None:
        f = widened(f, self.sources[0])
        self.x = self.ops.accumulate(self._h, f)
        self._h = None
        self.sources.append(f)

    def _end(self) -> Tensor:
        return self._mix(self.n_sublayers)

    def _export(self):
        return list(self.sources), [self.x]

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.sources)

    def depth_weights(self, l: int):
        names = ["emb"] + [f"v{i}" for i in range(1, len(self.sources))]
        with torch.no_grad():
            _, weights = self.scheme.depth_attention[l](
                self.x, self.sources, absorbed=self.scheme.absorbed, return_weights=True
            )
        return weights, names
