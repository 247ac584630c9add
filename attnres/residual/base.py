"""The one interface every residual scheme implements.

A scheme is an ``nn.Module`` that owns its parameters. ``begin(embedding)``
starts one forward pass and returns a ``Stream`` that the model drives:

    stream = scheme.begin(x)              # x = token embedding, [B, T, D]
    for l in range(L):                    # L = 2 * n_layers sublayers
        h = stream.read(l)                # input of sublayer l (before its pre-norm)
        stream.write(l, f_l(norm_l(h)))   # its output
    y = stream.end()                      # goes to the final norm and the LM head

The model never asks which scheme it holds. Streams must be driven in this
order; they check it, because a silently skipped write would corrupt the
depth history.

Between two sublayers a stream can be handed to another pipeline stage:
``stream.export()`` returns ``(history, state)``, and on the receiving side
``scheme.resume(l, history, state)`` continues at sublayer l. ``history`` is
the append-only part of the depth state (the embedding and completed block
representations): every later sublayer reads it and nothing changes it, so a
stage that already holds a prefix of it need not receive that prefix again
(SPEC §7's cross-stage caching). ``state`` is the running part (a partial
block sum, the hidden state, the extra streams), sent at every transition.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn


@dataclass
class DepthRecord:
    """What a stream saw during one forward pass, for analysis (filled when requested).

    ``weights[l]``: depth weights of sublayer l over its sources, [K_l, B, T]
    (or [K_l, B, T, H] for multi-head); index L is the final aggregation.
    None for schemes without depth weights. ``sources[l]`` names those
    sources ("emb", "v3", "b2", "b2~" for a partial block sum).
    ``input_rms[l]`` / ``output_rms[l]``: root-mean-square of the sublayer's
    input h_l and output f_l over batch and tokens.
    """

    weights: List[Optional[Tensor]] = field(default_factory=list)
    sources: List[Optional[List[str]]] = field(default_factory=list)
    input_rms: List[float] = field(default_factory=list)
    output_rms: List[float] = field(default_factory=list)


def _rms(x: Tensor) -> float:
    return x.detach().float().pow(2).mean().sqrt().item()


class Stream:
    """One forward pass through a residual scheme. Subclasses implement _read/_write/_end."""

    def __init__(self, n_sublayers: int, record: Optional[DepthRecord] = None):
        self.n_sublayers = n_sublayers
        self.record = record
        self._next = 0
        self._reading = False
        # memory traffic of the residual mechanism, in d-vectors per token, per sublayer (index L:
        # the final aggregation); see attnres.bench.decode for the counting rules
        self.io_reads = [0] * (n_sublayers + 1)
        self.io_writes = [0] * (n_sublayers + 1)

    def _io(self, l: int, reads: int, writes: int) -> None:
        self.io_reads[l] += reads
        self.io_writes[l] += writes

    def read(self, l: int) -> Tensor:
        if l != self._next or self._reading:
            raise RuntimeError(f"stream.read({l}) out of order: expected read({self._next})")
        self._reading = True
        h = self._read(l)
        if self.record is not None:
            self.record.input_rms.append(_rms(h))
            self._record_weights(l)
        return h

    def write(self, l: int, f: Tensor) -> None:
        if l != self._next or not self._reading:
            raise RuntimeError(f"stream.write({l}) out of order: expected read({self._next}) first")
        self._reading = False
        self._next += 1
        if self.record is not None:
            self.record.output_rms.append(_rms(f))
        self._write(l, f)

    def end(self) -> Tensor:
        if self._next != self.n_sublayers:
            raise RuntimeError(f"stream.end() after {self._next} of {self.n_sublayers} sublayers")
        if self.record is not None:
            self._record_weights(self.n_sublayers)
        return self._end()

    def export(self) -> Tuple[List[Tensor], List[Tensor]]:
        """(history, state) between two sublayers, for a pipeline transition (see the module doc)."""
        if self._reading:
            raise RuntimeError(f"stream.export() between read({self._next}) and its write")
        return self._export()

    def state_bytes(self) -> int:
        """Bytes of depth history this stream keeps beyond the one running state every scheme
        has (block representations, Full AttnRes' sources, block outputs, extra streams);
        0 for single-state schemes."""
        return 0

    # -- to implement
    def _read(self, l: int) -> Tensor:
        raise NotImplementedError

    def _write(self, l: int, f: Tensor) -> None:
        raise NotImplementedError

    def _end(self) -> Tensor:
        raise NotImplementedError

    def _export(self) -> Tuple[List[Tensor], List[Tensor]]:
        raise NotImplementedError

    def _record_weights(self, l: int) -> None:
        """Append the depth weights used by sublayer l (L = final) to the record."""
        self.record.weights.append(None)
        self.record.sources.append(None)


class ResidualScheme(nn.Module):
    """Base class of residual schemes: owns parameters, starts streams."""

    def begin(self, embedding: Tensor, record: Optional[DepthRecord] = None) -> Stream:
        raise NotImplementedError

    def resume(self, at: int, history: Sequence[Tensor], state: Sequence[Tensor],
               record: Optional[DepthRecord] = None) -> Stream:
        """Continue, at sublayer ``at``, a stream that another stage exported after sublayer at - 1."""
        stream = self._resume(list(history), list(state), record)
        stream._next = at
        return stream

    def _resume(self, history: List[Tensor], state: List[Tensor], record: Optional[DepthRecord]) -> Stream:
        raise NotImplementedError

    def no_weight_decay(self) -> List[str]:
        """Names (relative to this module) of parameters the trainer must not decay: all of ours."""
        return [name for name, _ in self.named_parameters()]
