"""Observers: what is measured about a residual stream, kept out of its arithmetic.

An observer attaches to a stream (``attach``) and is called after each read, before each
write and before the end. Two ship with the library:

- ``DepthRecorder`` fills a ``DepthRecord`` (depth weights, source names, input/output RMS):
  ``model(ids, return_record=True)`` uses it.
- ``IOCounter`` counts the residual mechanism's memory traffic, in d-vectors per token, per
  sublayer, by wrapping the stream's tensor operations (``Stream.ops``). The rules, one per
  operation, are those of paper Table 1 (docs/method.md §6):

  ======================  ===================================  =========================
  operation               reads                                writes
  ======================  ===================================  =========================
  accumulate (s + f)      2 (s and f)                          1
  store (into a buffer)   1                                    1
  phase1                  the n completed sources, once        one output per query (S)
  phase1_sources          the n completed sources, once        one output per query (S)
  merge (two outputs)     2                                    1
  merge_partial           2 (the Phase-1 output, the partial)  1
  attend (one query)      every source it reads                1
  phase1_token            the n completed sources, once        one output per query (S)
  merge_partial_token     2 (the Phase-1 output, the partial)  1
  gated                   the current state and every source   1
  ======================  ===================================  =========================

  Counts land on the sublayer being read or written (index L: the final aggregation).

``with observing(model.residual, IOCounter()) as counter: model(x)`` attaches observers to
every stream the scheme starts inside the block; ``with record_depth(scheme) as record: model(x)``
records the depth weights of a model of your own (docs/own_model.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class DepthRecord:
    """What a stream saw during one forward pass, for analysis (filled when requested).

    ``weights[l]``: depth weights of read l over its sources, [K_l, B, T] (or [K_l, B, T, H] for
    multi-head). Reads count as sublayers do, from 0: read l is the input of sublayer l (the l-th
    ``stream.apply``), index L the final aggregation. None for schemes without depth weights.
    ``sources[l]`` names the K_l sources, row for row. Sources count from the embedding: "emb" is
    source 0, and "v<i>" (Full AttnRes) is source i, the output of sublayer i - 1; "b<i>" (Block
    AttnRes) is depth block i (blocks counted from 1), "b<i>~" its running sum while it is still open;
    with ``attnres_sources="states"`` the sources are running sums, "s<i>" / "sb<i>", numbered alike.
    So in ``attnres.depth_weight_matrix(record)`` [L + 1, sources] row l is read l and column i is
    the source numbered i. ``input_rms[l]`` / ``output_rms[l]``: root-mean-square of the sublayer's
    input h_l and output f_l over batch and tokens.
    """

    weights: list[Tensor | None] = field(default_factory=list)
    sources: list[list[str] | None] = field(default_factory=list)
    input_rms: list[float] = field(default_factory=list)
    output_rms: list[float] = field(default_factory=list)


def _rms(x: Tensor) -> float:
    return x.detach().float().pow(2).mean().sqrt().item()


class StreamObserver:
    """Base class: every hook does nothing.

    ``reads_inputs``: whether ``after_read`` needs the sublayer input h_l. A stream that computes a read
    together with the sublayer's pre-norm (``read(norm=...)``) never forms h_l, so with such an observer
    attached it reads h_l and applies the norm after; observers that set it False are not called after a
    fused read, and the stream's arithmetic stays exactly what it is unobserved."""

    reads_inputs = True

    def attach(self, stream) -> None:
        stream.observers.append(self)

    def after_read(self, stream, l: int, h: Tensor) -> None:
        pass

    def before_write(self, stream, l: int, f: Tensor) -> None:
        pass

    def before_end(self, stream) -> None:
        pass


class DepthRecorder(StreamObserver):
    """Fills ``record`` with the stream's depth weights and the RMS of every sublayer input/output."""

    def __init__(self, record: DepthRecord):
        self.record = record

    def _weights(self, stream, l: int) -> None:
        found = stream.depth_weights(l)
        weights, names = found if found is not None else (None, None)
        self.record.weights.append(None if weights is None else weights.detach().float().cpu())
        self.record.sources.append(names)

    def after_read(self, stream, l, h):
        self.record.input_rms.append(_rms(h))
        self._weights(stream, l)

    def before_write(self, stream, l, f):
        self.record.output_rms.append(_rms(f))

    def before_end(self, stream):
        self._weights(stream, stream.n_sublayers)


def _vectors(t: Tensor) -> int:
    """d-vectors per token in a source tensor: [B, T, D] is 1, [B, T, n, D] is n."""
    return 1 if t.dim() == 3 else t.shape[2]


# operation name -> (args, kwargs) -> (reads, writes), in d-vectors per token
IO_RULES: dict[str, Callable[..., tuple[int, int]]] = {
    "accumulate": lambda s, f: (2, 1),
    "store": lambda buffer, row, v: (1, 1),
    "phase1": lambda values, inv_rms, queries, *rest, **kw: (_vectors(values), queries.shape[0]),
    "phase1_sources": lambda sources, inv_rms, queries, *rest, **kw: (len(sources), queries.shape[0]),
    "merge": lambda *args, **kw: (2, 1),
    "merge_norm": lambda *args, **kw: (2, 1),  # the merge and the norm in one pass: the merged read, normed
    "merge_partial": lambda *args, **kw: (2, 1),
    "attend": lambda segments, producers, *rest, **kw: (len(producers), 1),
    "attend_reference": lambda sources, *rest, **kw: (sources.shape[0], 1),
    "phase1_token": lambda sources, queries, *rest, **kw: (len(sources), queries.shape[2]),
    "merge_partial_token": lambda *args, **kw: (2, 1),
    "gated": lambda current, sources, *rest, **kw: (1 + len(sources), 1),
}


class IOCounter(StreamObserver):
    """Residual I/O per sublayer (``reads[l]``, ``writes[l]``; index L: the final aggregation),
    in d-vectors per token, of the last forward pass: the stream begun at sublayer 0 and those
    resumed from it block by block."""

    reads_inputs = False  # it counts the operations, not the values

    def __init__(self):
        self.reads: list[int] = []
        self.writes: list[int] = []

    def attach(self, stream) -> None:
        super().attach(stream)
        if stream.at == 0 or len(self.reads) != stream.n_sublayers + 1:
            # a new forward pass; a stream resumed by the next block keeps counting the same pass
            self.reads = [0] * (stream.n_sublayers + 1)
            self.writes = [0] * (stream.n_sublayers + 1)
        wrapped = {
            f.name: self._counting(stream, f.name, getattr(stream.ops, f.name)) for f in dataclasses.fields(stream.ops)
        }
        stream.ops = dataclasses.replace(stream.ops, **wrapped)

    def _counting(self, stream, name: str, op: Callable) -> Callable:
        rule = IO_RULES[name]

        def counted(*args, **kwargs):
            reads, writes = rule(*args, **kwargs)
            self.reads[stream.at] += reads
            self.writes[stream.at] += writes
            return op(*args, **kwargs)

        return counted


@contextmanager
def record_depth(scheme) -> Iterator[DepthRecord]:
    """Record what ``scheme`` reads inside the block: yields a ``DepthRecord`` that every stream the
    scheme starts or resumes there fills, block after block (one forward pass: run one inside it)."""
    record = DepthRecord()
    with observing(scheme, DepthRecorder(record)):
        yield record


@contextmanager
def observing(scheme, *observers: StreamObserver) -> Iterator:
    """Attach ``observers`` to every stream ``scheme`` starts inside the block; yields the first one
    (or all of them, given several)."""
    scheme.observers.extend(observers)
    try:
        yield observers[0] if len(observers) == 1 else observers
    finally:
        for observer in observers:
            scheme.observers.remove(observer)
