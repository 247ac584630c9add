"""The standard PreNorm residual (docs/method.md §2): h_{l+1} = h_l + f_l."""

from __future__ import annotations

from torch import Tensor

from attnres.residual.base import ResidualScheme, Stream


class PreNormStream(Stream):
    def __init__(self, embedding: Tensor, n_sublayers: int):
        super().__init__(n_sublayers)
        self.h = embedding

    def _read(self, l: int) -> Tensor:
        return self.h

    def _write(self, l: int, f: Tensor) -> None:
        self.h = self.ops.accumulate(self.h, f)

    def _end(self) -> Tensor:
        return self.h

    def _export(self):
        return [], [self.h]


class PreNormResidual(ResidualScheme):
    scheme_name = "prenorm"

    def __init__(self, config):
        super().__init__()
        self.n_sublayers = config.n_sublayers

    def prenorm_read_scale(self, l: int) -> float:
        return 1.0

    def _begin(self, embedding: Tensor) -> Stream:
        return PreNormStream(embedding, self.n_sublayers)

    def _resume(self, history, state, cache=()):
        return PreNormStream(state[0], self.n_sublayers)
