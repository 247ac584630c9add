"""The standard PreNorm residual (SPEC §2): h_{l+1} = h_l + f_l."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from attnres.residual.base import DepthRecord, ResidualScheme, Stream


class PreNormStream(Stream):
    def __init__(self, embedding: Tensor, n_sublayers: int, record: Optional[DepthRecord]):
        super().__init__(n_sublayers, record)
        self.h = embedding

    def _read(self, l: int) -> Tensor:
        return self.h

    def _write(self, l: int, f: Tensor) -> None:
        self._io(l, 2, 1)  # read h and f, write h
        self.h = self.h + f

    def _end(self) -> Tensor:
        return self.h

    def _export(self):
        return [], [self.h]


class PreNormResidual(ResidualScheme):
    def __init__(self, config):
        super().__init__()
        self.n_sublayers = config.n_sublayers

    def begin(self, embedding: Tensor, record: Optional[DepthRecord] = None) -> Stream:
        return PreNormStream(embedding, self.n_sublayers, record)

    def _resume(self, history, state, record):
        return PreNormStream(state[0], self.n_sublayers, record)
