"""Dense cross-layer residuals over Transformer-block outputs: DenseFormer and MUDD.

Both keep, next to the running state h, the list of *block outputs*
X_0, X_1, …, X_I and replace h by a weighted average of them after a
Transformer block. In our interface Transformer block I (1-based) is the two
sublayers l = 2I - 2 (attention) and l = 2I - 1 (MLP); block I reads
Y_{I-1} (the state after the previous block's averaging, Y_0 = X_0 = the
embedding) and runs its two PreNorm sublayers on it:

    X_I = Y_{I-1} + f_{2I-2} + f_{2I-1}      (the hidden state after block I's MLP write)
    Y_I = sum_j w_{I,j} X_j                  (the new state, read by block I + 1)

so a "block output" is the hidden state right after the block's MLP write,
*before* the averaging, as in both papers: the averaged states Y are never
stored, the block outputs X are. The stream ends
with Y_{L_b} (the last block's average), which goes to the final norm.

- ``denseformer`` (Pagliardini et al., 2024, Depth-Weighted Averaging): the
  weights w_{I,j} are learned scalars, the same for every token. Identity
  initialisation (w_{I,I} = 1, all others 0), so step 0 equals ``prenorm``.
  Dilation k (``denseformer_dilation``): DWA I only reads X_j with
  j = I (mod k). Period p (``denseformer_period``): DWA only after blocks
  I = p, 2p, …; elsewhere Y_I = X_I. The k x p-DenseFormer of the paper.
- ``mudd`` (Xiao et al., 2025, MUDDFormer, one way only): the weights are
  per token, generated from the current block output by a small MLP,

      w_I(X_I) = W2 GELU(W1 unit_rms(X_I)) + a_I      W1: (I+1) x d, W2: (I+1) x (I+1)

  over the K = I + 1 block outputs X_0 … X_I. MUDDFormer decouples four input
  ways (query, key, value, residual) per block; our interface has one input
  per sublayer, so this is the residual way alone (the paper's last layer
  uses that single way too). Hidden width K as in the paper. Init: W2 = 0,
  a_I one-hot on X_I (so Y_I = X_I: step 0 equals ``prenorm``), W1 normal
  with std 1/sqrt(d) so W2 gets gradient from the first step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnres.ops.common import autocast_disabled
from attnres.residual.base import ResidualScheme, Stream
from attnres.residual.scaled import unit_rms


def dwa_blocks(config) -> list[int]:
    """The blocks I (1-based) after which DenseFormer averages: multiples of the period."""
    p = config.denseformer_period
    return [i for i in range(1, config.n_layers + 1) if i % p == 0]


def dwa_sources(block: int, dilation: int) -> list[int]:
    """Block outputs j (0 = embedding) read by the DWA after block I: j <= I, j = I (mod k)."""
    return [j for j in range(block + 1) if (block - j) % dilation == 0]


class _BlockOutputStream(Stream):
    """Running state plus the list of block outputs; the scheme averages after each block."""

    def __init__(self, scheme: _BlockAveraging, embedding: Tensor):
        super().__init__(scheme.n_sublayers)
        self.scheme = scheme
        self.h = embedding
        self.outputs: list[Tensor] = [embedding]  # X_0, X_1, …

    def _read(self, l: int) -> Tensor:
        return self.h

    def _write(self, l: int, f: Tensor) -> None:
        self.h = self.h + f
        if l % 2 == 1:  # the MLP write closes Transformer block (l + 1) / 2
            self.outputs.append(self.h)
            self.h = self.scheme.average((l + 1) // 2, self.outputs)

    def _end(self) -> Tensor:
        return self.h

    def _export(self):
        return list(self.outputs), [self.h]

    def state_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.outputs)


class _BlockAveraging(ResidualScheme):
    def __init__(self, config):
        super().__init__()
        self.n_sublayers = config.n_sublayers
        self.n_blocks = config.n_layers
        self.eps = config.norm_eps

    def average(self, block: int, outputs: list[Tensor]) -> Tensor:
        raise NotImplementedError

    def _begin(self, embedding: Tensor) -> Stream:
        return _BlockOutputStream(self, embedding)

    def _resume(self, history, state, cache=()):
        stream = _BlockOutputStream(self, state[0])
        stream.outputs = history
        return stream


class DenseFormerResidual(_BlockAveraging):
    """Depth-weighted averaging with learned scalar weights, identity-initialised."""

    scheme_name = "denseformer"

    def settings(self) -> dict:
        return {
            "n_sublayers": self.n_sublayers,
            "denseformer_dilation": self.dilation,
            "denseformer_period": self.period,
        }

    def __init__(self, config):
        super().__init__(config)
        self.dilation = config.denseformer_dilation
        self.period = config.denseformer_period
        self.blocks = dwa_blocks(config)
        self.slot = {block: i for i, block in enumerate(self.blocks)}
        self.sources = {block: dwa_sources(block, self.dilation) for block in self.blocks}
        weights = []
        for block in self.blocks:
            w = torch.zeros(len(self.sources[block]))
            w[-1] = 1.0  # the block's own output: Y_I = X_I at init
            weights.append(nn.Parameter(w))
        self.dwa_weights = nn.ParameterList(weights)

    def average(self, block: int, outputs: list[Tensor]) -> Tensor:
        if block not in self.slot:
            return outputs[block]
        w = self.dwa_weights[self.slot[block]]
        y: Tensor | None = None
        for a, j in zip(w, self.sources[block], strict=True):
            term = a.to(outputs[j].dtype) * outputs[j]
            y = term if y is None else y + term
        assert y is not None  # a block averages at least its own output
        return y


class MUDDResidual(_BlockAveraging):
    """Per-token weights over all block outputs from a small MLP on the current block output."""

    scheme_name = "mudd"

    def settings(self) -> dict:
        return {"n_sublayers": self.n_sublayers, "d_model": self.d_model, "norm_eps": self.eps}

    def __init__(self, config):
        super().__init__(config)
        d = self.d_model = config.d_model
        self.w1 = nn.ParameterList()
        self.w2 = nn.ParameterList()
        self.static = nn.ParameterList()
        for block in range(1, self.n_blocks + 1):
            k = block + 1
            self.w1.append(nn.Parameter(torch.randn(k, d) / math.sqrt(d)))
            self.w2.append(nn.Parameter(torch.zeros(k, k)))
            a = torch.zeros(k)
            a[-1] = 1.0
            self.static.append(nn.Parameter(a))

    def weights(self, block: int, current: Tensor) -> Tensor:
        """[B, T, K] weights over X_0 … X_I, in at least float32 (autocast off for this small MLP)."""
        i = block - 1
        dtype = torch.promote_types(current.dtype, torch.float32)
        with autocast_disabled(current.device.type):
            u = unit_rms(current.to(dtype), self.eps)
            hidden = F.gelu(u @ self.w1[i].to(dtype).t())
            return hidden @ self.w2[i].to(dtype).t() + self.static[i].to(dtype)

    def average(self, block: int, outputs: list[Tensor]) -> Tensor:
        w = self.weights(block, outputs[block])
        y: Tensor | None = None
        for j, x in enumerate(outputs):
            term = w[..., j : j + 1].to(x.dtype) * x
            y = term if y is None else y + term
        assert y is not None  # outputs holds the embedding at least
        return y


def denseformer_params(config) -> int:
    """One scalar per (DWA, source read): sum over DWA blocks I of (I // k + 1)."""
    return sum(len(dwa_sources(block, config.denseformer_dilation)) for block in dwa_blocks(config))


def denseformer_state(config) -> int:
    """Block outputs that some DWA reads (they must be kept), the embedding included."""
    kept = {j for block in dwa_blocks(config) for j in dwa_sources(block, config.denseformer_dilation)}
    return len(kept)


def mudd_params(config) -> int:
    """Per block I with K = I + 1 sources: W1 (K d) + W2 (K^2) + static weights (K)."""
    d = config.d_model
    return sum(k * d + k * k + k for k in range(2, config.n_layers + 2))
