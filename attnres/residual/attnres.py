"""Attention Residuals: Full (SPEC §3) and Block (SPEC §4) with the Table-4 variants.

Full AttnRes is Block AttnRes with one sublayer per depth block (S = 1): every
output is its own block, no partial sums exist, and each sublayer attends over
the embedding and all earlier outputs. One class therefore serves both.

Per forward pass the stream keeps:
- ``sources``: the completed sources [b_0 = embedding, b_1, …] as autograd
  tensors (gradients flow back to them);
- ``buffer``: the same values in a preallocated [B, T, N + 1, D] tensor
  (fused path only), written once per completed block, so a read hands the
  depth-attention op a view of its first n rows instead of stacking the
  history every sublayer;
- ``partial``: the running sum b_n^i of the current depth block, or None at
  a block's start (the first sublayer of a block sees no partial sum: a zero
  source would add a bogus term to the softmax).

Three implementations (``ModelConfig.attnres_impl``), equal to rounding:
- ``two_phase`` (default): SPEC §6 in training too. At a depth block's first
  sublayer one Phase-1 op attends all S pseudo-queries of the block to the
  completed blocks at once (its backward also runs once per block); each
  sublayer then merges the partial sum by online softmax. Needs input-independent
  queries, so input-dependent queries, scalar mixing and windows use ``fused``.
- ``fused``: one custom-autograd depth attention per sublayer over buffer views.
- ``reference``: plain autograd over a stacked source list.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from attnres.ops.depth_attention import depth_attention_reference, fused_depth_attention
from attnres.ops.two_phase import inverse_rms, merge_outputs, merge_partial, phase1_outputs
from attnres.residual.base import DepthRecord, ResidualScheme, Stream


def source_plan(n_sublayers: int, block_size: int) -> List[Tuple[int, bool]]:
    """For each sublayer l (and the final aggregation at index L): (completed sources, has partial).

    Completed sources count b_0 (the embedding) and every finished depth block.
    """
    plan, complete, partial = [], 1, False
    for l in range(n_sublayers):
        plan.append((complete, partial))
        partial = True
        if (l + 1) % block_size == 0 or l == n_sublayers - 1:
            complete, partial = complete + 1, False
    plan.append((complete, False))
    return plan


class DepthAttentionResidual(ResidualScheme):
    """Block AttnRes with block size S (S = 1: Full AttnRes), L sublayers, one query per sublayer + final."""

    def __init__(self, config):
        super().__init__()
        d, L = config.d_model, config.n_sublayers
        self.d_model, self.n_sublayers = d, L
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.heads = config.attnres_heads
        self.weights_kind = config.attnres_weights
        self.kernel = config.attnres_kernel
        self.key_norm = config.attnres_key_norm and config.attnres_weights != "scalar"
        self.window = config.attnres_window
        self.eps = config.norm_eps
        self.impl = config.attnres_impl
        self.plan = source_plan(L, self.block_size)
        # the first sublayer of each sublayer's depth block (the final aggregation is its own block)
        self.block_start = []
        for l, (_, partial) in enumerate(self.plan):
            self.block_start.append(self.block_start[-1] if partial else l)
        # the first sublayer of each sublayer's Phase-1 group: its depth block, or for Full AttnRes
        # G consecutive sublayers (their later sources are merged in per sublayer)
        group = config.group_size
        self.group_start = [(l // group) * group if l < L else L for l in range(L + 1)] \
            if self.block_size == 1 and group > 1 else list(self.block_start)

        n_q = L + 1  # every sublayer plus the final aggregation
        if self.weights_kind == "pseudo_query":
            # zero init: uniform weights at step 0 (SPEC §3; random init destabilises training)
            self.queries = nn.Parameter(torch.zeros(n_q, d))
        elif self.weights_kind == "input_query":
            self.query_proj = nn.ParameterList([nn.Parameter(torch.zeros(d, d)) for _ in range(n_q)])
        else:  # scalar: one learned logit per (sublayer, source)
            self.mix_logits = nn.ParameterList(
                [nn.Parameter(torch.zeros(self.num_sources(l))) for l in range(n_q)]
            )
        if self.key_norm:
            self.key_norm_weight = nn.Parameter(torch.ones(n_q, d))

    def num_sources(self, l: int) -> int:
        """K_l: how many sources sublayer l (L = final aggregation) attends over."""
        complete, partial = self.plan[l]
        if self.window is not None:
            return 1 + min(self.window, complete - 1)
        return complete + int(partial)

    def begin(self, embedding: Tensor, record: Optional[DepthRecord] = None) -> Stream:
        return DepthAttentionStream(self, embedding, record)

    def _resume(self, history, state, record):
        stream = DepthAttentionStream(self, history[0], record)
        for row, v in enumerate(history[1:], start=1):
            if stream.buffer is not None:
                stream._store(row, v)
        stream.sources = history
        stream.partial = state[0] if state else None
        return stream


class DepthAttentionStream(Stream):
    def __init__(self, scheme: DepthAttentionResidual, embedding: Tensor,
                 record: Optional[DepthRecord]):
        super().__init__(scheme.n_sublayers, record)
        self.scheme = scheme
        self.sources: List[Tensor] = [embedding]
        self.partial: Optional[Tensor] = None
        self.fused = scheme.impl in ("fused", "two_phase") and scheme.weights_kind != "scalar"
        self.two_phase = (scheme.impl == "two_phase" and scheme.weights_kind == "pseudo_query"
                          and scheme.window is None)
        self.buffer = self.inv_rms = None
        self._phase1 = None  # (block start, S tensors h1 [B, T, D], lse [B, T, S, H]) of the current block
        if self.fused:
            b, t, d = embedding.shape
            self.buffer = embedding.new_empty(b, t, scheme.num_blocks + 1, d)
            if self.two_phase and scheme.key_norm:
                self.inv_rms = embedding.new_empty(b, t, scheme.num_blocks + 1,
                                                   dtype=torch.float64 if embedding.dtype == torch.float64
                                                   else torch.float32)
            self._store(0, embedding)

    def state_bytes(self) -> int:
        held = self.buffer if self.buffer is not None else torch.stack(self.sources)
        total = held.numel() * held.element_size()
        if self.inv_rms is not None:
            total += self.inv_rms.numel() * self.inv_rms.element_size()
        return total

    def _store(self, row: int, v: Tensor) -> None:
        """Write a completed source into the buffer (values, and its inverse RMS once for all readers)."""
        with torch.no_grad():
            self.buffer[:, :, row].copy_(v)
            if self.inv_rms is not None:
                self.inv_rms[:, :, row].copy_(inverse_rms(v, self.scheme.eps))

    # ------------------------------------------------------------------ which sources
    def _source_rows(self, l: int) -> List[Tuple[int, int]]:
        """Row ranges [start, stop) of completed sources that sublayer l reads."""
        complete, _ = self.scheme.plan[l]
        w = self.scheme.window
        if w is None or complete - 1 <= w:
            return [(0, complete)]
        return [(0, 1), (complete - w, complete)]

    def _producers(self, l: int) -> List[Tensor]:
        out = [t for a, b in self._source_rows(l) for t in self.sources[a:b]]
        if self.partial is not None:
            out.append(self.partial)
        return out

    def _query(self, l: int):
        s = self.scheme
        if s.weights_kind == "pseudo_query":
            q = s.queries[l]
            return q.view(s.heads, -1) if s.heads > 1 else q
        # input-dependent: project the stream's most recent state
        recent = self.partial if self.partial is not None else self.sources[-1]
        q = recent @ s.query_proj[l].to(recent.dtype).t()
        return q.unflatten(-1, (s.heads, -1)) if s.heads > 1 else q

    def _key_weight(self, l: int) -> Optional[Tensor]:
        return self.scheme.key_norm_weight[l] if self.scheme.key_norm else None

    # ------------------------------------------------------------------ aggregation
    def _two_phase(self, l: int) -> Tensor:
        s = self.scheme
        start = s.group_start[l]
        n = s.plan[start][0]  # sources completed when the group began
        if self._phase1 is None or self._phase1[0] != start:
            stop = start + 1
            while stop < len(s.plan) and s.group_start[stop] == start:
                stop += 1
            queries = s.queries[start:stop]
            if s.heads > 1:
                queries = queries.view(stop - start, s.heads, -1)
            key_weights = s.key_norm_weight[start:stop] if s.key_norm else None
            inv = self.inv_rms[:, :, :n] if self.inv_rms is not None else None
            h1, lse = phase1_outputs(self.buffer[:, :, :n], inv, queries, key_weights,
                                     self.sources[:n], kernel=s.kernel)
            self._phase1 = (start, h1, lse)
            self._io(l, n, stop - start)  # each source read once; one output per query
        _, h1, lse = self._phase1
        i = l - start
        h, lse = h1[i], lse[:, :, i]
        m = s.plan[l][0]
        if m > n:  # sources completed inside the group (Full AttnRes): attend to them, merge
            q = s.queries[l:l + 1]
            if s.heads > 1:
                q = q.view(1, s.heads, -1)
            kw = s.key_norm_weight[l:l + 1] if s.key_norm else None
            inv = self.inv_rms[:, :, n:m] if self.inv_rms is not None else None
            (h2,), lse2 = phase1_outputs(self.buffer[:, :, n:m], inv, q, kw, self.sources[n:m],
                                         kernel=s.kernel)
            h, lse = merge_outputs(h, lse, h2, lse2[:, :, 0], s.kernel)
            self._io(l, (m - n) + 2, 2)  # intra-group sources; both outputs -> merged h
        if self.partial is None:
            return h.to(self.sources[0].dtype)
        self._io(l, 2, 1)  # h1 and the partial sum -> h
        return merge_partial(h, lse, self.partial, s.queries[l], self._key_weight(l), s.eps, s.kernel)

    def _aggregate(self, l: int) -> Tensor:
        s = self.scheme
        if s.weights_kind == "scalar":
            return self._scalar_mix(l)
        if self.two_phase:
            return self._two_phase(l)
        query, key_weight = self._query(l), self._key_weight(l)
        producers = self._producers(l)
        self._io(l, len(producers), 1)  # every source read, h written
        if self.fused:
            segments = [self.buffer[:, :, a:b] for a, b in self._source_rows(l)]
            if self.partial is not None:
                segments.append(self.partial.unsqueeze(2))
            return fused_depth_attention(
                segments, producers, query, key_weight,
                eps=s.eps, kernel=s.kernel, normalize_keys=s.key_norm,
            )
        stacked = torch.stack(producers)
        return depth_attention_reference(
            stacked, query, key_weight, eps=s.eps, kernel=s.kernel, normalize_keys=s.key_norm
        ).h

    def _scalar_weights(self, l: int) -> Tensor:
        logits = self.scheme.mix_logits[l]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if self.scheme.kernel == "softmax":
            return torch.softmax(logits, dim=0)
        return torch.sigmoid(logits)

    def _scalar_mix(self, l: int) -> Tensor:
        # no stacking: each term keeps a reference to its (already alive) source
        alpha = self._scalar_weights(l)
        h = None
        for a, v in zip(alpha, self._producers(l)):
            term = a.to(v.dtype) * v
            h = term if h is None else h + term
        return h

    # ------------------------------------------------------------------ stream interface
    def _read(self, l: int) -> Tensor:
        return self._aggregate(l)

    def _write(self, l: int, f: Tensor) -> None:
        if self.partial is not None:
            self._io(l, 2, 1)  # read the partial sum and f, write the new partial sum
        self.partial = f if self.partial is None else self.partial + f
        complete, _ = self.scheme.plan[l + 1]
        if complete > len(self.sources):  # the depth block just closed
            if self.buffer is not None:
                self._store(len(self.sources), self.partial)
                self._io(l, 1, 1)  # the block sum copied into the buffer
            self.sources.append(self.partial)
            self.partial = None

    def _end(self) -> Tensor:
        return self._aggregate(self.n_sublayers)

    def _export(self):
        return list(self.sources), ([self.partial] if self.partial is not None else [])

    def _record_weights(self, l: int) -> None:
        s = self.scheme
        names = [("emb" if i == 0 else (f"v{i}" if s.block_size == 1 else f"b{i}"))
                 for a, b in self._source_rows(l) for i in range(a, b)]
        if self.partial is not None:
            names.append(f"b{len(self.sources)}~")
        with torch.no_grad():
            if s.weights_kind == "scalar":
                b, t, _ = self.sources[0].shape
                weights = self._scalar_weights(l)[:, None, None].expand(-1, b, t)
            else:
                weights = depth_attention_reference(
                    torch.stack(self._producers(l)), self._query(l), self._key_weight(l),
                    eps=s.eps, kernel=s.kernel, normalize_keys=s.key_norm,
                ).weights
        self.record.weights.append(weights.detach().float().cpu())
        self.record.sources.append(names)
