"""The paper's method in one screen: Full (docs/method.md §3) and Block AttnRes (§4).

Full AttnRes is Block AttnRes with one sublayer per depth block (S = 1). For consumer l (0-based:
sublayers 0 … L-1, then the final aggregation l = L), each line of docs/method.md (Eq. 1-4 are the
numbered lines of §3) and the code here that computes it:

    §4   depth blocks: which sources are complete,   ``source_plan``
         whether a partial sum b_n^i is open
         sources of l = [b_0, b_1 … b_{n-1}, b_n^i]  ``DepthAttentionStream._producers``
    (1)  z_i = w_l · RMSNorm_{g_l}(b_i)              ``DepthAttentionStream._attend``: the reference op
    (2)  α   = softmax_i(z)                          ``depth_attention_reference`` computes (1)-(3),
    (3)  h_l = Σ_i α_i b_i                           w_l = ``_query(l)``, g_l = ``_key_weight(l)``
    (4)  v_l = f_l(Norm_l(h_l)), written back        ``DepthAttentionStream._write``: v_l joins b_n^i;
                                                     a block that closes becomes b_n, a source

The parameters live on the scheme (``DepthAttentionResidual``, ``attnres.residual.attnres``: ``queries``
= w, ``key_norm_weight`` = g), and the stream asks its variant objects (``attnres.residual.variants``)
for the query, the kernel, a block's first sum and the routing; the paper's objects (the defaults) do
exactly what the lines above say. Every fast form (``attnres.residual.depth_streams``) subclasses
``DepthAttentionStream`` and computes the same values to rounding. This module imports neither of
those two modules (they import it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attnres.ops.depth_attention import depth_attention_reference
from attnres.residual.args import equal_block_sizes
from attnres.residual.base import Stream, unviewed, widened


def source_plan(n_sublayers: int, block_size: int | Sequence[int]) -> list[tuple[int, bool]]:
    """For each sublayer l (and the final aggregation at index L): (completed sources, has partial).

    ``block_size``: S (equal blocks, the last one shorter) or the list of block sizes.
    Completed sources count b_0 (the embedding) and every finished depth block.
    """
    sizes = equal_block_sizes(n_sublayers, block_size) if isinstance(block_size, int) else list(block_size)
    if sum(sizes) != n_sublayers:
        raise ValueError(f"block sizes {sizes} do not add up to the {n_sublayers} sublayers")
    closes = set()
    end = 0
    for size in sizes:
        end += size
        closes.add(end - 1)  # a block closes after its last sublayer
    plan, complete, partial = [], 1, False
    for l in range(n_sublayers):
        plan.append((complete, partial))
        partial = True
        if l in closes:
            complete, partial = complete + 1, False
    plan.append((complete, False))
    return plan


class DepthAttentionStream(Stream):
    """The reference stream, docs/method.md §3-§4 as written: per read, stack the sources and attend
    (plain autograd); per write, add the output to the open block's partial sum.

    ``scheme``: the ``DepthAttentionResidual`` that owns the queries, key norms, variants and the
    geometry (``scheme.plan[l]`` = (completed sources, has partial) for sublayer l). ``sources``: the
    completed sources, [embedding] at the start; ``partial``: the running block sum b_n^i, None at a
    block's start (a zero source would add a bogus term to the softmax); ``cache``: what ``_cache`` of
    the same form handed over (then nothing is recomputed)."""

    # additive routing (``AdditiveRouting``): the ordinary PreNorm stream, embedding + every output so far
    residual: Tensor | None = None

    def __init__(self, scheme, sources: Sequence[Tensor], partial: Tensor | None = None, cache: Sequence[Tensor] = ()):
        super().__init__(scheme.n_sublayers)
        self.scheme = scheme
        self.sources: list[Tensor] = []
        if cache:
            self.sources = list(sources)
            self._restore(cache)
        else:
            self._allocate(sources[0])
            for v in sources:
                self._add_source(v)
        self.partial: Tensor | None = partial

    # ------------------------------------------------------------------ the method
    def _read(self, l: int) -> Tensor:
        """h_l (Eq. 1-3), routed (the paper: the mixture itself)."""
        return self.scheme.routing.route(self, l, self._aggregate(l))

    def _aggregate(self, l: int) -> Tensor:
        return self._attend(l, self.ops.attend_reference).h

    def _attend(self, l: int, op: Callable):
        """Eq. 1-3 over the sources of read l: z_i = q_l · RMSNorm_{g_l}(b_i), α = softmax_i(z),
        h_l = Σ_i α_i b_i, by ``op``: the reference op (``self.ops`` may wrap it to count I/O)."""
        s = self.scheme
        sources = torch.stack(self._producers(l))
        return op(sources, self._query(l), self._key_weight(l), eps=s.eps, kernel=s.kernel, normalize_keys=s.key_norm)

    def _write(self, l: int, f: Tensor) -> None:
        """v_l (Eq. 4) joins the open depth block's partial sum; a block that closes becomes a source."""
        s = self.scheme
        f = widened(f, self.sources[0])
        s.routing.write(self, f)
        if self.partial is not None:
            self.partial = self.ops.accumulate(self.partial, f)
        else:  # a block's first output (state sources: the running sum continues from the last state)
            self.partial = s.source_form.open_block(self.sources[-1], f, self.ops.accumulate)
        complete, _ = s.plan[l + 1]
        if complete > len(self.sources):  # the depth block just closed
            self._add_source(self.partial)
            self.partial = None

    def _end(self) -> Tensor:
        return self._read(self.n_sublayers)

    # ------------------------------------------------------------------ which sources, which query
    def _source_rows(self, l: int) -> list[tuple[int, int]]:
        """Row ranges [start, stop) of completed sources that sublayer l reads (a window keeps the
        embedding and the last W)."""
        complete, _ = self.scheme.plan[l]
        w = self.scheme.window
        if w is None or complete - 1 <= w:
            return [(0, complete)]
        return [(0, 1), (complete - w, complete)]

    def _producers(self, l: int) -> list[Tensor]:
        out = [t for a, b in self._source_rows(l) for t in self.sources[a:b]]
        if self.partial is not None:
            out.append(self.partial)
        return out

    def _query(self, l: int) -> Tensor:
        return self.scheme.query_form.query(self, l)

    def _key_weight(self, l: int) -> Tensor | None:
        return self.scheme.key_norm_weight[l] if self.scheme.key_norm else None

    def _weights(self, l: int) -> Tensor:
        """alpha [K, B, T] (or [K, B, T, H]) of read l, for the depth record."""
        weights = self._attend(l, depth_attention_reference).weights
        assert weights is not None  # the reference op always returns its weights
        return weights

    # ------------------------------------------------------------------ what a fast form derives
    def _allocate(self, embedding: Tensor) -> None:
        """Tensors a fast form derives from the sources, allocated once per forward pass."""

    def _restore(self, cache: Sequence[Tensor]) -> None:
        """Take back the tensors that ``_cache`` of the same form exported (the fast forms' buffers)."""
        raise NotImplementedError(f"{type(self).__name__} exports no cache to resume from")

    def _add_source(self, v: Tensor) -> None:
        """A completed source (the embedding, or a depth block just closed)."""
        self.sources.append(v)

    # ------------------------------------------------------------------ hand-over and records
    def _export(self):
        state = ([self.partial] if self.partial is not None else []) + self.scheme.routing.state(self)
        return [unviewed(t) for t in self.sources], [unviewed(t) for t in state]

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sources)

    def depth_weights(self, l: int):
        s = self.scheme
        # outputs: v_i (Full) / b_i (Block); states: s_i, the running sum after i sublayers (Full) /
        # sb_i, after i depth blocks (Block); "~": the running sum inside the current block
        prefix = s.source_form.prefix(s.block_size == 1)
        names = [("emb" if i == 0 else f"{prefix}{i}") for a, b in self._source_rows(l) for i in range(a, b)]
        if self.partial is not None:
            names.append(f"{prefix}{len(self.sources)}~")
        with torch.no_grad():
            return self._weights(l), names
