"""The streams of Full and Block AttnRes: each fast form as a subclass of the reference, tested against it.

The reference, ``DepthAttentionStream``, is docs/method.md §3-§4 as written and lives with the rest of
the paper's method in ``attnres.residual.method`` (importable from here too). Every class here
computes the same values to rounding (tests/residual/test_stream_forms.py runs each against it).
``stream_class`` picks the form from the scheme's implementation, its query form
(``attnres.residual.variants``) and the compiler:

==========================  ====================================================================
class                       what it changes
==========================  ====================================================================
DepthAttentionStream        the reference: per read, stack the sources and attend (plain autograd)
ScalarMixStream             ``ScalarMixing``: no query, no key norm; a learned softmax per read
MultiQueryStream            ``MultiQueries``: normalized values, scaled logits, several queries per
                            read (Inkling-2)
FusedStream                 completed sources copied once into a buffer [B, T, N+1, D]; each read
                            is one custom-autograd depth attention over views of it
TwoPhaseStream              docs/method.md §6 in training too: one Phase-1 pass per depth block
                            (or per group of G sublayers in Full AttnRes), then one exact merge
                            with the partial sum per sublayer
TokenQueryTwoPhaseStream    two-phase with ``LowRankQueries``, per token (their input: the block's)
CompiledTwoPhaseStream      two-phase as torch.compile traces it for training and prefill: Phase 1
                            over the sources as separate tensors, no buffer (a custom op with its
                            own backward, small ones pointwise), recomputed in backward
DecodeStream                two-phase's buffer read one token at a time without gradients: per read
                            one pass over the rows and the partial sum (no Phase-1 statistics),
                            one C++ kernel call on the CPU
==========================  ====================================================================

The state a stream holds is tensors: ``sources`` (the completed sources b_0 = embedding, b_1, ...),
``partial`` (the running sum of the current depth block, None at a block's start: a zero source
would add a bogus term to the softmax), and in the fast forms tensors derived from the sources (the
buffer, inverse RMS, the group's Phase-1 statistics). ``export`` hands over the first two,
``depth()`` the derived ones too (``DepthState.cache``), so a Transformer block that resumes the
stream recomputes nothing.

Precision follows PreNorm's stream h + f: a sublayer output enters in the wider of its dtype and the
embedding's, so under autocast (bfloat16 outputs, a float32 embedding) the sources, partial sums and
buffer are float32, and in a bfloat16 model they are bfloat16. The ops compute logits, Phase-1
statistics and merges in float32 either way (``attnres.ops.common.compute_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnres.ops.backends import Case, choose
from attnres.ops.common import DepthStats, RMSNormArgs, compute_dtype, inverse_rms
from attnres.ops.depth_attention import multi_query_depth_attention
from attnres.ops.rms_norm import rms_norm
from attnres.ops.two_phase.cpu import DecodeReader
from attnres.residual.base import COMPILED_OPS, PLAIN_OPS, unviewed
from attnres.residual.method import DepthAttentionStream
from attnres.residual.variants import (
    LowRankQueries,
    MultiQueries,
    PseudoQueries,
    ReplacementRouting,
    ScalarMixing,
)


class ScalarMixStream(DepthAttentionStream):
    """Input-independent mixing (paper Table 4): one learned logit per (sublayer, source), no query."""

    def _alpha(self, l: int) -> Tensor:
        return self.scheme.query_form.weights(self.scheme, l)

    def _aggregate(self, l: int) -> Tensor:
        # no stacking: each term keeps a reference to its (already alive) source
        h: Tensor | None = None
        for a, v in zip(self._alpha(l), self._producers(l), strict=True):
            term = a.to(v.dtype) * v
            h = term if h is None else h + term
        assert h is not None  # every read has a producer: the embedding at least
        return h

    def _weights(self, l: int) -> Tensor:
        b, t, _ = self.sources[0].shape
        return self._alpha(l)[:, None, None].expand(-1, b, t)


class MultiQueryStream(DepthAttentionStream):
    """The read of Inkling-2 and its relatives: normalized values (``attnres_values``), scaled logits
    (``attnres_score_scale``) and several queries per read (``attnres_read_queries``), all Q mixtures
    of a read from one pass over its sources (``attnres.ops.multi_query_depth_attention``). A read
    with Q > 1 returns [Q, B, T, D]. A read over a single source returns that source (as the raw-value
    softmax does; Inkling-2 skips the read there)."""

    def _queries(self, l: int) -> Tensor:
        return self.scheme.query_form.queries(self.scheme, l)

    def _aggregate(self, l: int) -> Tensor:
        s, form = self.scheme, self.scheme.query_form
        producers, q = self._producers(l), form.read_queries[l]
        if len(producers) == 1:
            h = producers[0]
            return h if q == 1 else h.expand(q, *h.shape)
        out = multi_query_depth_attention(
            torch.stack(producers),
            self._queries(l),
            self._key_weight(l),
            eps=s.eps,
            scale=form.score_scale,
            values=form.values,
            kernel=s.kernel,
        )
        return out[0] if q == 1 else out

    def _weights(self, l: int) -> Tensor:
        s, form = self.scheme, self.scheme.query_form
        producers = self._producers(l)
        if len(producers) == 1:
            b, t, _ = producers[0].shape
            return producers[0].new_ones(1, b, t)
        return multi_query_depth_attention(
            torch.stack(producers),
            self._queries(l)[:1],
            self._key_weight(l),
            eps=s.eps,
            scale=form.score_scale,
            values=form.values,
            kernel=s.kernel,
            return_weights=True,
        ).weights[0]


class FusedStream(DepthAttentionStream):
    """Each completed source is copied once into ``buffer`` [B, T, N + 1, D]; a read hands the fused
    depth-attention op views of its rows instead of stacking the history every sublayer."""

    buffer: Tensor

    def _allocate(self, embedding: Tensor) -> None:
        b, t, d = embedding.shape
        self.buffer = embedding.new_empty(b, t, self.scheme.num_blocks + 1, d)

    def _add_source(self, v: Tensor) -> None:
        self.ops.store(self.buffer, len(self.sources), v)
        super()._add_source(v)

    def _aggregate(self, l: int) -> Tensor:
        s = self.scheme
        segments = [self.buffer[:, :, a:b] for a, b in self._source_rows(l)]
        if self.partial is not None:
            segments.append(self.partial.unsqueeze(2))
        return self.ops.attend(
            segments,
            self._producers(l),
            self._query(l),
            self._key_weight(l),
            eps=s.eps,
            kernel=s.kernel,
            normalize_keys=s.key_norm,
        )

    def state_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _cache(self) -> Sequence[Tensor]:
        return (self.buffer,)

    def _restore(self, cache: Sequence[Tensor]) -> None:
        self.buffer = cache[0]  # rows 0..n-1 hold the sources already


class Phase1(NamedTuple):
    """A Phase-1 group's statistics (docs/method.md §6), kept by the stream until the group ends."""

    start: int  # the group's first sublayer
    h: tuple[Tensor, ...]  # per query of the group: its normalised output over the group's sources [B, T, D]
    lse: Tensor  # [B, T, S] ([B, T, S, H] with heads), float32
    queries: Tensor | None  # the group's per-token queries (low-rank), else None


class TwoPhaseStream(FusedStream):
    """docs/method.md §6: at the first sublayer of a group (a depth block; G sublayers in Full
    AttnRes) one Phase-1 op attends all the group's pseudo-queries to the sources completed before
    it (its backward also runs once per group); each sublayer then merges what completed inside the
    group and the partial sum by online softmax. The group's statistics are tensors of the state."""

    keeps_inv_rms = True  # each source's inverse RMS, computed once for every reader (with key norm)
    inv_rms: Tensor | None = None
    _phase1: Phase1 | None = None  # the current group's
    _handed: Sequence[Tensor] = ()  # a resumed group's statistics, unpacked at the first read

    def _allocate(self, embedding: Tensor) -> None:
        super()._allocate(embedding)
        if self.scheme.key_norm and self.keeps_inv_rms:
            b, t, _ = embedding.shape
            self.inv_rms = embedding.new_empty(
                b,
                t,
                self.scheme.num_blocks + 1,
                dtype=torch.float64 if embedding.dtype == torch.float64 else torch.float32,
            )

    def _add_source(self, v: Tensor) -> None:
        if self.inv_rms is not None:
            with torch.no_grad():
                self.inv_rms[:, :, len(self.sources)].copy_(inverse_rms(v, self.scheme.eps))
        super()._add_source(v)

    def _group(self, l: int) -> tuple[int, int]:
        """[start, stop) of the Phase-1 group of sublayer l."""
        starts = self.scheme.group_start
        start = stop = starts[l]
        while stop < len(starts) and starts[stop] == start:
            stop += 1
        return start, stop

    def _group_queries(self, start: int, stop: int) -> Tensor:
        s = self.scheme
        q = s.queries[start:stop]
        return q.view(stop - start, s.heads, -1) if s.heads > 1 else q

    def _phase1_over(self, a: int, b: int, queries: Tensor, key_weights: Tensor | None):
        """Phase 1 of ``queries`` over completed sources a..b-1, read in place from the buffer."""
        inv = self.inv_rms[:, :, a:b] if self.inv_rms is not None else None
        return self.ops.phase1(
            self.buffer[:, :, a:b], inv, queries, key_weights, self.sources[a:b], kernel=self.scheme.kernel
        )

    def _run_phase1(self, start: int, stop: int, n: int) -> Phase1:
        s = self.scheme
        key_weights = s.key_norm_weight[start:stop] if s.key_norm else None
        h1, lse = self._phase1_over(0, n, self._group_queries(start, stop), key_weights)
        return Phase1(start, h1, lse, None)

    def _merge_partial(self, l: int, stats: DepthStats, i: int, norm: RMSNormArgs | None = None) -> Tensor:
        s = self.scheme
        return self.ops.merge_partial(
            stats, self.partial, s.queries[l], self._key_weight(l), s.eps, s.kernel, norm=norm
        )

    def _read_normed(self, l: int, norm: RMSNormArgs) -> Tensor | None:
        # Phase 2 and the sublayer's pre-norm in one pass; routings other than replacement transform the
        # mixture first, so they read it whole
        if type(self.scheme.routing) is not ReplacementRouting:
            return None
        return self._aggregate(l, norm)

    def _aggregate(self, l: int, norm: RMSNormArgs | None = None) -> Tensor:
        s = self.scheme
        start, stop = self._group(l)
        n = s.plan[start][0]  # sources completed when the group began
        if self._handed:  # handed over by the previous block: this group's statistics
            self._phase1 = Phase1(
                start,
                tuple(self._handed[: stop - start]),
                self._handed[stop - start],
                self._handed[stop - start + 1] if len(self._handed) > stop - start + 1 else None,
            )
            self._handed = ()
        if self._phase1 is None or self._phase1.start != start:
            self._phase1 = self._run_phase1(start, stop, n)
        i = l - start
        h, lse = self._phase1.h[i], self._phase1.lse[:, :, i]
        m = s.plan[l][0]
        if m > n:  # sources completed inside the group (Full AttnRes): attend to them, merge
            q = self._group_queries(l, l + 1)
            kw = s.key_norm_weight[l : l + 1] if s.key_norm else None
            (h2,), lse2 = self._phase1_over(n, m, q, kw)
            inside = DepthStats(h2, lse2[:, :, 0])
            if self.partial is None:  # the merge is the read: merged and normed in one pass where a kernel can
                return self.ops.merge_norm(DepthStats(h, lse), inside, s.kernel, norm, self.sources[0].dtype)
            h, lse = self.ops.merge(DepthStats(h, lse), inside, s.kernel)
        if self.partial is None:
            h = h.to(self.sources[0].dtype)
            return h if norm is None else rms_norm(h, norm)
        return self._merge_partial(l, DepthStats(h, lse), i, norm)

    def state_bytes(self) -> int:
        held = [self.buffer] + ([self.inv_rms] if self.inv_rms is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    # the cache: the buffer, the inverse RMS, and the current group's statistics if it has begun
    def _derived(self) -> list[Tensor]:
        return [self.buffer] + ([self.inv_rms] if self.inv_rms is not None else [])

    def _cache(self) -> Sequence[Tensor]:
        cache = self._derived()
        if self._handed:
            cache += list(self._handed)
        elif self._phase1 is not None and self._phase1.start == self.scheme.group_start[self._next]:
            h1, lse, queries = self._phase1.h, self._phase1.lse, self._phase1.queries
            cache += [*h1, lse] + ([queries] if queries is not None else [])
        return tuple(unviewed(t) for t in cache)

    def _restore(self, cache: Sequence[Tensor]) -> None:
        own = self._restore_derived(cache)
        self._handed = tuple(cache[own:])

    def _restore_derived(self, cache: Sequence[Tensor]) -> int:
        """Take the derived tensors from the front of ``cache``; returns how many. A cache of the
        compiled form (a block that dynamo ran, handing over to one it fell back from, or the other way)
        has no buffer: the buffer is derived again from the sources and the form's own tensors skipped."""
        if not _has_buffer(cache):
            sources, self.sources = self.sources, []
            self._allocate(sources[0])
            for v in sources:
                self._add_source(v)
            return len(sources) if self.scheme.key_norm else 0
        self.buffer = cache[0]
        if self.scheme.key_norm and self.keeps_inv_rms:
            self.inv_rms = cache[1]
            return 2
        return 1


def _has_buffer(cache: Sequence[Tensor]) -> bool:
    """Whether a two-phase cache starts with the buffer form's [B, T, K, D] buffer (every other tensor
    of a cache, the compiled form's inverse RMS and a group's statistics, has fewer dimensions first)."""
    return cache[0].dim() == 4


class TokenQueryTwoPhaseStream(TwoPhaseStream):
    """Two-phase with low-rank per-token queries q = w + U V h (Block AttnRes): their input is the
    block's input, the last completed source, so all S queries of a block are known at its start
    (``attnres.ops.token_queries``). Keys are normalised inside its ops: no inverse-RMS buffer."""

    keeps_inv_rms = False  # the token-query ops normalise their keys themselves

    def _run_phase1(self, start: int, stop: int, n: int) -> Phase1:
        s = self.scheme
        key_weights = s.key_norm_weight[start:stop] if s.key_norm else None
        queries = s.query_form.block_queries(s, start, stop, self.sources[n - 1])
        h1, lse = self.ops.phase1_token(self.sources[:n], queries, key_weights, eps=s.eps, kernel=s.kernel)
        return Phase1(start, h1, lse, queries)

    def _merge_partial(self, l: int, stats: DepthStats, i: int, norm: RMSNormArgs | None = None) -> Tensor:
        s = self.scheme
        assert self._phase1 is not None and self._phase1.queries is not None  # _aggregate ran Phase 1
        queries = self._phase1.queries
        h = self.ops.merge_partial_token(stats, self.partial, queries[:, :, i], self._key_weight(l), s.eps, s.kernel)
        return h if norm is None else rms_norm(h, norm)


class _DecodeViews:
    """Views of a decoding buffer [B, 1, K, D] and its inverse RMS [B, 1, K] (or None), each made at its
    first use: the first m rows as [B, m, D] and [B, m, 1] (what a read attends over), and row i as
    [B, 1, D] and [B, 1] (what a store writes)."""

    def __init__(self, buffer: Tensor, inv_rms: Tensor | None, scheme):
        self.buffer, self.inv_rms = buffer, inv_rms
        self._prefixes: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._rows: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._all: tuple[Tensor, Tensor | None] | None = None  # all K rows: [B, K, D] and [B, K, 1]
        # the C++ kernel's reader where the backend table chooses it (one call per read), else None (torch ops)
        case = Case.like(buffer, heads=scheme.heads, kernel=scheme.kernel, key_norm=inv_rms is not None)
        self.reader = None
        if choose("decode_read", "forward", case).backend == "cpu_kernel":
            inv = inv_rms.select(1, 0) if inv_rms is not None else None
            self.reader = DecodeReader(buffer.select(1, 0), inv, scheme.heads, scheme.kernel, scheme.eps)

    def prefix(self, m: int) -> tuple[Tensor, Tensor | None]:
        got = self._prefixes.get(m)
        if got is None:
            if self._all is None:
                inv = self.inv_rms.select(1, 0).unsqueeze(-1) if self.inv_rms is not None else None
                self._all = (self.buffer.select(1, 0), inv)
            rows, inv = self._all
            got = self._prefixes[m] = (rows.narrow(1, 0, m), inv.narrow(1, 0, m) if inv is not None else None)
        return got

    def row(self, i: int) -> tuple[Tensor, Tensor | None]:
        got = self._rows.get(i)
        if got is None:
            inv = self.inv_rms.select(2, i) if self.inv_rms is not None else None
            got = self._rows[i] = (self.buffer.select(2, i), inv)
        return got


class DecodeStream(TwoPhaseStream):
    """Two-phase's buffer read one token at a time without gradients (KV-cached decoding). At T = 1 a read
    is a handful of vectors, so the general form's dozens of small ops per sublayer (Phase-1 statistics,
    merges, casts, views) cost more than the arithmetic. Here a read stores the partial sum as the row after
    the sources (with its inverse RMS) and attends over all its rows in one pass: logits, softmax or
    sigmoid, weighted sum: on the CPU in float32/float64 one call of the C++ kernel
    (``two_phase.cpu.DecodeReader``, the ``decode_read`` op of ``attnres.ops.backends``), else a few torch
    ops. Pseudo-queries only, no window. The cache is two-phase's (buffer, inverse RMS), so either form
    resumes from the other's. With an observer that wraps ``ops`` (I/O counting) it reads
    and stores as two-phase does, so the counts stay those of the ops."""

    _partial_stored = False  # whether the row after the sources holds this stream's partial sum
    _rows: _DecodeViews | None = None  # ``_views``, once looked up
    _kept: tuple[list[Tensor], Tensor] | None = None  # ``_constants``, once looked up

    def _constants(self) -> tuple[list[Tensor], Tensor]:
        """(u = query * key-norm weight of each read as a column [1, D, 1], eps as a 0-d tensor), in the
        compute dtype: computed once and kept on the scheme until a query, weight or eps changes (in place,
        as an optimizer step or a load does, or moved to another device or dtype); looked up once per stream."""
        if self._kept is not None:
            return self._kept
        s = self.scheme
        cd = compute_dtype(self.buffer.dtype)
        q, g = s.queries, s.key_norm_weight if s.key_norm else None
        # inference tensors (parameters made under inference_mode) have no version counter: not kept
        versioned = not q.is_inference() and (g is None or not g.is_inference())
        key = (
            (q.data_ptr(), q._version, cd, s.eps) + ((g.data_ptr(), g._version) if g is not None else ())
            if versioned
            else None
        )
        kept = s.__dict__.get("_decode_constants")
        if key is None or kept is None or kept[0] is not q or kept[1] is not g or kept[2] != key:
            u = q.detach().to(cd)
            if g is not None:
                u = u * g.detach().to(cd)
            columns = list(u[:, None, :, None].unbind(0))
            kept = (q, g, key, (columns, torch.tensor(s.eps, dtype=cd, device=u.device)))
            if key is not None:
                s.__dict__["_decode_constants"] = kept
        self._kept = kept[3]
        return kept[3]

    def _store(self, row: int, v: Tensor) -> None:
        """Row ``row`` of the buffer and of the inverse RMS from v [B, 1, D] (gradients are off already)."""
        slot = self._views().row(row)
        slot[0].copy_(v)
        if slot[1] is not None:
            cd = slot[1].dtype
            norm = (
                torch.linalg.vector_norm(v, dim=-1) if v.dtype == cd else torch.linalg.vector_norm(v, dim=-1, dtype=cd)
            )
            torch.rsqrt(torch.addcmul(self._constants()[1], norm, norm, value=1.0 / v.shape[-1]), out=slot[1])

    def _views(self) -> _DecodeViews:
        """Views of the buffer and the inverse RMS, made once per forward pass (kept on the scheme with the
        buffer they view), not once per Transformer block's stream: the views are ops as costly as the
        arithmetic here."""
        if self._rows is None:
            kept = self.scheme.__dict__.get("_decode_views")
            if kept is None or kept.buffer is not self.buffer or kept.inv_rms is not self.inv_rms:
                kept = _DecodeViews(self.buffer, self.inv_rms, self.scheme)
                self.scheme.__dict__["_decode_views"] = kept
            self._rows = kept
        return self._rows

    def _add_source(self, v: Tensor) -> None:
        if self.ops is not PLAIN_OPS:
            super()._add_source(v)
            return
        reader = self._views().reader
        if reader is not None:
            reader.store(len(self.sources), v)
        else:
            self._store(len(self.sources), v)
        self.sources.append(v)

    def _write(self, l: int, f: Tensor) -> None:
        super()._write(l, f)
        self._partial_stored = False

    def _read_normed(self, l: int, norm: RMSNormArgs) -> Tensor | None:
        return None  # one token per read: the decode kernel's read, then the norm

    def _aggregate(self, l: int, norm: RMSNormArgs | None = None) -> Tensor:
        if self.ops is not PLAIN_OPS or norm is not None:  # norm: never handed here (_read_normed is None)
            return super()._aggregate(l, norm)
        s = self.scheme
        self._handed, self._phase1 = (), None  # the two-phase form's group statistics: none needed here
        m = len(self.sources)
        columns, _ = self._constants()
        reader = self._views().reader
        if reader is not None:  # one kernel call: store the partial sum (once) as row m, attend over the rows
            fresh = self.partial if self.partial is not None and not self._partial_stored else None
            self._partial_stored = self.partial is not None
            return reader.read(m + int(self.partial is not None), columns[l], store=fresh)
        if self.partial is not None:
            # stored by the reader, not the writer: a stream resumed from an earlier state rewrites the row
            if not self._partial_stored:
                self._store(m, self.partial)
                self._partial_stored = True
            m += 1
        v, inv = self._views().prefix(m)  # [B, m, D]: the completed sources, then the partial sum; [B, m, 1]
        u = columns[l]  # [1, D, 1]
        if v.dtype != u.dtype:
            v = v.to(u.dtype)
        b, _, d = v.shape
        if s.heads == 1:
            z = torch.bmm(v, u if b == 1 else u.expand(b, -1, -1))  # [B, m, 1]
            if inv is not None:
                z.mul_(inv)
            alpha = s.kernel_form.weights(z, dim=1)
            h = torch.bmm(alpha.transpose(1, 2), v)  # [B, 1, D]
        else:
            vh = v.view(b, m, s.heads, d // s.heads)
            z = (vh * u.view(s.heads, -1)).sum(-1)  # [B, m, H]
            if inv is not None:
                z.mul_(inv)
            alpha = s.kernel_form.weights(z, dim=1)
            h = (alpha.unsqueeze(-1) * vh).sum(1).view(b, 1, d)
        out_dtype = self.sources[0].dtype
        return h if h.dtype == out_dtype else h.to(out_dtype)

    def _export(self):
        # without gradients no tensor needs ``unviewed``: skip its per-tensor checks over the whole history
        history = list(self.sources)
        state = ([self.partial] if self.partial is not None else []) + self.scheme.routing.state(self)
        if any(t.requires_grad for t in history) or any(t.requires_grad for t in state):
            return super()._export()
        return history, state

    def _cache(self) -> Sequence[Tensor]:
        if self.ops is not PLAIN_OPS:
            return super()._cache()
        return tuple(self._derived())


def decode_form(scheme, embedding: Tensor) -> bool:
    """Whether a stream runs ``DecodeStream``: one token per sequence without gradients, in eager mode
    (a compiled step fuses the general form itself) and outside autocast (whose lower-precision products
    the general form's ops turn off), with pseudo-queries and no window."""
    return (
        embedding.shape[1] == 1
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(embedding.device.type)
        and type(scheme.query_form) is PseudoQueries
        and scheme.window is None
    )


def compiled_form(embedding: Tensor) -> bool:
    """Whether a stream is traced by torch.compile for training or prefill. Such a stream keeps no
    buffer and runs ``COMPILED_OPS``: under the compiler, row writes into a buffer become copies
    of it, the partitioner keeps a version of it per read for backward, and matrix products in the
    hand-written backwards cannot fuse (``attnres.ops.two_phase.compiled``). A compiled one-token
    step without gradients (decoding) keeps the buffer: it decoded faster (docs/performance.md)."""
    return torch.compiler.is_compiling() and (torch.is_grad_enabled() or embedding.shape[1] > 1)


class CompiledTwoPhaseStream(TwoPhaseStream):
    """Two-phase as torch.compile traces it for training and prefill: Phase 1 reads the sources as
    separate tensors (``attnres.ops.two_phase.compiled``), which the compiler fuses and
    differentiates without copies; with gradients, Phase 1 is recomputed in backward."""

    ops = COMPILED_OPS
    buffer = None  # type: ignore[assignment]  # the point of this form: no buffer
    # inverse RMS of each completed source, as autograd tensors (with key norm)
    source_inv_rms: list[Tensor] | None = None

    def __init__(self, scheme, sources: Sequence[Tensor], partial: Tensor | None = None, cache: Sequence[Tensor] = ()):
        self.recompute_phase1 = torch.is_grad_enabled()
        super().__init__(scheme, sources, partial, cache)

    def _allocate(self, embedding: Tensor) -> None:
        if self.scheme.key_norm:
            self.source_inv_rms = []

    def _add_source(self, v: Tensor) -> None:
        if self.source_inv_rms is not None:
            self.source_inv_rms.append(inverse_rms(v, self.scheme.eps))
        DepthAttentionStream._add_source(self, v)

    def _phase1_over(self, a: int, b: int, queries: Tensor, key_weights: Tensor | None):
        inv = self.source_inv_rms[a:b] if self.source_inv_rms is not None else None
        kernel = self.scheme.kernel
        if self.recompute_phase1:
            # from the sources, which backward keeps anyway. Kept instead, a block's stacked
            # outputs (Block) or a group's and the in-group attentions (Full) are what made
            # AttnRes keep more for backward than prenorm (`attnres bench graph`, docs/performance.md).
            # The custom op (larger Phase 1s) keeps only lse itself, but the merges after it would
            # keep its outputs
            return checkpoint(
                self.ops.phase1_sources,
                self.sources[a:b],
                inv,
                queries,
                key_weights,
                kernel=kernel,
                use_reentrant=False,
            )
        return self.ops.phase1_sources(self.sources[a:b], inv, queries, key_weights, kernel=kernel)

    def state_bytes(self) -> int:
        held = list(self.sources) + (self.source_inv_rms or [])
        return sum(t.numel() * t.element_size() for t in held)

    def _derived(self) -> list[Tensor]:
        return list(self.source_inv_rms or [])

    def _restore_derived(self, cache: Sequence[Tensor]) -> int:
        if _has_buffer(cache):  # the buffer form's cache: its buffer and inverse RMS, derived again here
            self._allocate(self.sources[0])
            if self.source_inv_rms is not None:
                self.source_inv_rms = [inverse_rms(v, self.scheme.eps) for v in self.sources]
            return 2 if self.scheme.key_norm else 1
        if not self.scheme.key_norm:
            return 0
        n = len(self.sources)
        self.source_inv_rms = list(cache[:n])
        return n


def stream_class(scheme, embedding: Tensor) -> type:
    """The form a ``DepthAttentionResidual`` runs (``attnres_impl``, its query form, the compiler)."""
    form = scheme.query_form
    if isinstance(form, ScalarMixing):  # query forms with a read of their own, under any impl
        return ScalarMixStream
    if isinstance(form, MultiQueries):
        return MultiQueryStream
    if scheme.impl == "reference":
        return DepthAttentionStream
    # Phase 1 needs every query of a group known when it starts: pseudo-queries, and low-rank queries
    # in Block AttnRes (their input is the block's input); Full AttnRes' per-sublayer low-rank
    # queries, full-rank input-dependent queries and windows read one sublayer at a time
    two_phase = scheme.impl == "two_phase" and scheme.window is None and form.known_at_block_start(scheme.block_size)
    if not two_phase:
        return FusedStream
    if isinstance(form, LowRankQueries):
        return TokenQueryTwoPhaseStream
    if decode_form(scheme, embedding):
        return DecodeStream
    return CompiledTwoPhaseStream if compiled_form(embedding) else TwoPhaseStream
