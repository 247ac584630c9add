"""Single-state residuals with learned scales or gates: ReZero, LayerScale, Highway.

All three keep one running hidden state h (like PreNorm, docs/method.md §2) and change
only how a sublayer output f_l = f_l(Norm(h_l)) is folded into it. The
sublayer's own pre-norm stays in the model.

- ``rezero`` (Bachlechner et al., 2020): h <- h + a_l f, one scalar a_l per
  sublayer, initialised to 0. At step 0 every sublayer is switched off (the
  network is the identity on the embedding), so it does *not* start as PreNorm.
- ``layerscale`` (Touvron et al., 2021, CaiT): h <- h + diag(lambda_l) f, one
  vector lambda_l in R^d per sublayer. Initial value ``layerscale_init``; by
  default CaiT's depth rule on the number of Transformer blocks: 0.1 up to 18
  blocks, 1e-5 up to 24, 1e-6 beyond. ``layerscale_init=1.0`` is PreNorm exactly.
- ``highway`` (Srivastava et al., 2015): h <- (1 - g) * h + g * f with the
  per-channel gate g = sigmoid(W_g u + b_g), u = h / rms(h) (the same unit-RMS
  view the sublayer's pre-norm sees, without a gain: a gain in front of W_g
  would be redundant with it). W_g is zero at init and b_g = HIGHWAY_BIAS_INIT
  = -2, so every gate starts at sigmoid(-2) ~ 0.12: mostly carry, as the
  Highway paper recommends (negative bias). With ``highway_rank = r`` the gate
  matrix is low rank, W_g = U V (U: d x r, zero at init; V: r x d, normal with
  std 1/sqrt(d), so U receives gradient from the first step).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnres.residual.base import ResidualScheme, Stream

HIGHWAY_BIAS_INIT = -2.0


def layerscale_init_value(config) -> float:
    """lambda's initial value: ``layerscale_init``, else CaiT's rule on the number of blocks."""
    if config.layerscale_init is not None:
        return float(config.layerscale_init)
    if config.n_layers <= 18:
        return 0.1
    if config.n_layers <= 24:
        return 1e-5
    return 1e-6


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, no gain."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _SingleStateStream(Stream):
    """One running state h; ``update(l, h, f)`` returns the new state."""

    def __init__(self, scheme: _SingleStateScheme, embedding: Tensor):
        super().__init__(scheme.n_sublayers)
        self.scheme = scheme
        self.h = embedding

    def _read(self, l: int) -> Tensor:
        return self.h

    def _write(self, l: int, f: Tensor) -> None:
        self.h = self.scheme.update(l, self.h, f)

    def _end(self) -> Tensor:
        return self.h

    def _export(self):
        return [], [self.h]


class _SingleStateScheme(ResidualScheme):
    def __init__(self, config):
        super().__init__()
        self.n_sublayers = config.n_sublayers
        self.d_model = config.d_model
        self.eps = config.norm_eps

    def settings(self) -> dict:
        return {"n_sublayers": self.n_sublayers, "d_model": self.d_model}

    def update(self, l: int, h: Tensor, f: Tensor) -> Tensor:
        raise NotImplementedError

    def _begin(self, embedding: Tensor) -> Stream:
        return _SingleStateStream(self, embedding)

    def _resume(self, history, state, cache=()):
        return _SingleStateStream(self, state[0])


class ReZeroResidual(_SingleStateScheme):
    """h <- h + a_l f with a scalar a_l per sublayer, zero at init."""

    scheme_name = "rezero"

    def __init__(self, config):
        super().__init__(config)
        self.alpha = nn.Parameter(torch.zeros(self.n_sublayers))

    def update(self, l: int, h: Tensor, f: Tensor) -> Tensor:
        return h + self.alpha[l].to(f.dtype) * f


class LayerScaleResidual(_SingleStateScheme):
    """h <- h + lambda_l * f with a per-channel vector lambda_l per sublayer."""

    scheme_name = "layerscale"  # layerscale_init only initialises: not a setting of the function

    def __init__(self, config):
        super().__init__(config)
        init = layerscale_init_value(config)
        self.scale = nn.Parameter(torch.full((self.n_sublayers, self.d_model), init))

    def update(self, l: int, h: Tensor, f: Tensor) -> Tensor:
        return h + self.scale[l].to(f.dtype) * f


class HighwayResidual(_SingleStateScheme):
    """h <- (1 - g) h + g f, g = sigmoid(W_g unit_rms(h) + b_g), per channel and token."""

    scheme_name = "highway"

    def settings(self) -> dict:
        return {**super().settings(), "highway_rank": self.rank, "norm_eps": self.eps}

    def __init__(self, config):
        super().__init__(config)
        d, L = self.d_model, self.n_sublayers
        self.rank = config.highway_rank
        if self.rank is None:
            self.gate_weight = nn.Parameter(torch.zeros(L, d, d))
        else:
            self.gate_up = nn.Parameter(torch.zeros(L, d, self.rank))
            self.gate_down = nn.Parameter(torch.randn(L, self.rank, d) / math.sqrt(d))
        self.gate_bias = nn.Parameter(torch.full((L, d), HIGHWAY_BIAS_INIT))

    def gate(self, l: int, h: Tensor) -> Tensor:
        u = unit_rms(h, self.eps)
        if self.rank is None:
            z = u @ self.gate_weight[l].to(u.dtype).t()
        else:
            z = (u @ self.gate_down[l].to(u.dtype).t()) @ self.gate_up[l].to(u.dtype).t()
        return torch.sigmoid(z + self.gate_bias[l].to(u.dtype))

    def update(self, l: int, h: Tensor, f: Tensor) -> Tensor:
        g = self.gate(l, h)
        return h + g * (f - h)  # = (1 - g) h + g f


def rezero_params(config) -> int:
    """One scalar per sublayer: L."""
    return config.n_sublayers


def layerscale_params(config) -> int:
    """One d-vector per sublayer: L d."""
    return config.n_sublayers * config.d_model


def highway_params(config) -> int:
    """Per sublayer: gate matrix (d^2, or 2 r d when low rank) plus the d-vector bias."""
    d, r = config.d_model, config.highway_rank
    per = d * d if r is None else 2 * r * d
    return config.n_sublayers * (per + d)
