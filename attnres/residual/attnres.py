"""Attention Residuals: Full (docs/method.md §3) and Block (docs/method.md §4) with the Table-4 variants.

Full AttnRes is Block AttnRes with one sublayer per depth block (S = 1): every
output is its own block, no partial sums exist, and each sublayer attends over
the embedding and all earlier outputs. One class therefore serves both.

Per forward pass the stream keeps:
- ``sources``: the completed sources [b_0 = embedding, b_1, …] as autograd
  tensors (gradients flow back to them);
- ``buffer``: the same values in a preallocated [B, T, N + 1, D] tensor
  (fused path only), written once per completed block, so a read hands the
  depth-attention op a view of its first n rows instead of stacking the
  history every sublayer. A two-phase stream that ``torch.compile`` traces for
  training keeps no buffer: its Phase 1 reads ``sources`` as separate tensors
  (``attnres.ops.two_phase.compiled``), which the compiler fuses and
  differentiates without copies;
- ``partial``: the running sum b_n^i of the current depth block, or None at
  a block's start (the first sublayer of a block sees no partial sum: a zero
  source would add a bogus term to the softmax).

Three implementations (``ModelConfig.attnres_impl``), equal to rounding:
- ``two_phase`` (default): docs/method.md §6 in training too. At a depth block's first
  sublayer one Phase-1 op attends all S pseudo-queries of the block to the
  completed blocks at once (its backward also runs once per block); each
  sublayer then merges the partial sum by online softmax. Needs queries known when
  the block starts: pseudo-queries, and low-rank queries (whose input is the
  block's input; ``attnres.ops.token_queries``) in Block AttnRes. Full-rank
  input-dependent queries, low-rank queries in Full AttnRes and windows use
  ``fused``; scalar mixing (no query at all) is a plain weighted sum under any impl.
- ``fused``: one custom-autograd depth attention per sublayer over buffer views.
- ``reference``: plain autograd over a stacked source list.

Sources (``attnres_sources``): "outputs" (the paper: block sums of sublayer
outputs) or "states" (running residual sums at block boundaries; method.md §5,
not from the paper). A states stream is the outputs stream whose partial sum
starts from the last completed state instead of from nothing, so every
implementation serves both.

Depth blocks may be uneven (``attnres_block_sizes``): the geometry lives in
``source_plan`` alone, which every path reads.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from attnres.ops.depth_attention import depth_attention_reference
from attnres.ops.token_queries import low_rank_queries
from attnres.ops.common import DepthStats, inverse_rms
from attnres.residual.base import COMPILED_OPS, ResidualScheme, Stream
from attnres.residual.options import Option, boolean, is_positive_int, one_of, positive_int

WEIGHTS = ("pseudo_query", "input_query", "low_rank_query", "scalar")
SOURCES = ("outputs", "states")
KERNELS = ("softmax", "sigmoid")
IMPLS = ("two_phase", "fused", "reference")
DEFAULT_TARGET_BLOCKS = 8  # the paper's N ≈ 8


# ----------------------------------------------------------------------------- geometry


def block_size(config) -> int:
    """S for Block AttnRes: ``attnres_block_size``, else ceil(L / ``attnres_blocks``), else the
    smallest even S giving at most 8 depth blocks (boundaries before attention, the paper's default)."""
    L = config.n_sublayers
    if config.attnres_block_sizes is not None:
        return max(config.attnres_block_sizes)
    if config.attnres_block_size is not None:
        return config.attnres_block_size
    if config.attnres_blocks is not None:
        return math.ceil(L / config.attnres_blocks)
    s = 2
    while math.ceil(L / s) > DEFAULT_TARGET_BLOCKS:
        s += 2
    return min(s, L)


def equal_block_sizes(n_sublayers: int, size: int) -> List[int]:
    """Blocks of ``size`` sublayers, the last one shorter when ``size`` does not divide L."""
    full, rest = divmod(n_sublayers, size)
    return [size] * full + ([rest] if rest else [])


def block_sizes(config) -> List[int]:
    """Sublayers per depth block, in order: ``attnres_block_sizes``, else equal blocks of S
    (``block_size``) with the last one shorter."""
    if config.attnres_block_sizes is not None:
        return list(config.attnres_block_sizes)
    return equal_block_sizes(config.n_sublayers, block_size(config))


def group_size(config) -> int:
    """G for Full AttnRes' two-phase schedule: ``attnres_group_size``, else round(sqrt(L))."""
    if config.attnres_group_size is not None:
        return config.attnres_group_size
    return max(1, round(math.sqrt(config.n_sublayers)))


# ----------------------------------------------------------------------------- options


def _heads(value, config):
    if not is_positive_int(value):
        return "must be a positive integer"
    if config.d_model % value:
        return f"must divide d_model={config.d_model}"
    if value > 1 and config.attnres_weights == "scalar":
        return "scalar mixing has no query to split into heads; use attnres_heads=1"
    return None


def _weights(value, config):
    if value not in WEIGHTS:
        return f"choose one of {WEIGHTS}"
    if value == "low_rank_query" and config.attnres_query_rank is None:
        return f"needs attnres_query_rank=r, the rank of the input-dependent term (1 <= r < d_model={config.d_model})"
    return None


def _query_rank(r, config):
    if config.attnres_weights != "low_rank_query":
        return (f"applies to attnres_weights='low_rank_query' only (attnres_weights={config.attnres_weights!r}); "
                "drop it or set attnres_weights='low_rank_query'")
    if not is_positive_int(r) or r >= config.d_model:
        return (f"must be an integer in [1, {config.d_model - 1}] (below d_model={config.d_model}); "
                "use attnres_weights='input_query' for a full-rank query")
    return None


def _sources(value, config):
    if value not in SOURCES:
        return f"choose one of {SOURCES}"
    if value == "states" and config.attnres_scale_norm_eps:
        return ("states-sourced AttnRes reads a weighted mix of running sums at init, not a multiple of the "
                "PreNorm sum, so attnres_scale_norm_eps cannot make it exact; drop attnres_scale_norm_eps")
    return None


def _blocks(n, config):
    L = config.n_sublayers
    if config.attnres_block_size is not None:
        return "give either attnres_blocks (N) or attnres_block_size (S), not both"
    if config.attnres_block_sizes is not None:
        return "give either attnres_blocks (N) or attnres_block_sizes (the sizes themselves), not both"
    if not is_positive_int(n):
        return "must be a positive integer"
    if n > L:
        return f"exceeds the number of sublayers L={L} (2 * n_layers); use at most {L}"
    s = math.ceil(L / n)
    if math.ceil(L / s) != n:
        return (f"cannot split L={L} sublayers into {n} blocks of {s} with only the last one shorter; "
                f"set attnres_block_size instead (S={s} gives {math.ceil(L / s)} blocks), or list the sizes "
                f"in attnres_block_sizes")
    return None


def _block_size(s, config):
    L = config.n_sublayers
    if not is_positive_int(s):
        return "must be an integer >= 1 (sublayers per block)"
    if s > L:
        return f"exceeds the number of sublayers L={L}; use at most {L}"
    if config.attnres_block_sizes is not None:
        return "give either attnres_block_size (S) or attnres_block_sizes (the sizes themselves), not both"
    return None


def _block_sizes(sizes, config):
    L = config.n_sublayers
    if (not isinstance(sizes, (list, tuple)) or not sizes
            or not all(is_positive_int(s) for s in sizes)):
        return "must be a non-empty list of positive integers (sublayers per depth block, in order)"
    if sum(sizes) != L:
        return (f"sums to {sum(sizes)}, not to the L={L} sublayers (2 * n_layers); "
                f"make the sizes add up to {L}")
    return None


# read by Full and Block AttnRes; the first five are ignored by every other scheme (so one
# --set attnres_kernel=sigmoid can apply to a whole prenorm/block/full comparison)
SHARED_OPTIONS = {
    "attnres_weights": Option(_weights, exclusive=False),
    "attnres_query_rank": Option(_query_rank, exclusive=False),
    "attnres_sources": Option(_sources, exclusive=False),
    "attnres_kernel": Option(one_of(*KERNELS), exclusive=False),
    "attnres_key_norm": Option(boolean, exclusive=False),
    "attnres_heads": Option(_heads, exclusive=False),
    "attnres_impl": Option(one_of(*IMPLS), exclusive=False),
    "attnres_scale_norm_eps": Option(boolean),
}
FULL_OPTIONS = {
    **SHARED_OPTIONS,
    "attnres_window": Option(positive_int("sources kept")),
    "attnres_group_size": Option(positive_int("sublayers per group")),
}
BLOCK_OPTIONS = {
    **SHARED_OPTIONS,
    "attnres_blocks": Option(_blocks),
    "attnres_block_size": Option(_block_size),
    "attnres_block_sizes": Option(_block_sizes),
}


def source_plan(n_sublayers: int, block_size: Union[int, Sequence[int]]) -> List[Tuple[int, bool]]:
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


class DepthAttentionResidual(ResidualScheme):
    """Block AttnRes with block size S (S = 1: Full AttnRes), L sublayers, one query per sublayer + final."""

    def __init__(self, config):
        super().__init__()
        d, L = config.d_model, config.n_sublayers
        self.d_model, self.n_sublayers = d, L
        self.block_size = config.block_size  # the largest block (uneven blocks: see block_sizes)
        self.block_sizes = config.block_sizes
        self.num_blocks = config.num_blocks
        self.heads = config.attnres_heads
        self.weights_kind = config.attnres_weights
        self.kernel = config.attnres_kernel
        self.key_norm = config.attnres_key_norm and config.attnres_weights != "scalar"
        self.window = config.attnres_window
        self.eps = config.norm_eps
        self.impl = config.attnres_impl
        self.scale_norm_eps = config.attnres_scale_norm_eps
        self.states = config.attnres_sources == "states"
        self.plan = source_plan(L, self.block_sizes)
        # the first sublayer of each sublayer's depth block (the final aggregation is its own block)
        self.block_start = []
        for l, (_, partial) in enumerate(self.plan):
            self.block_start.append(self.block_start[-1] if partial else l)
        # the first sublayer of each sublayer's Phase-1 group: its depth block, or for Full AttnRes
        # G consecutive sublayers (their later sources are merged in per sublayer)
        group = config.group_size
        self.grouped = self.block_size == 1 and group > 1
        self.group_start = [(l // group) * group if l < L else L for l in range(L + 1)] \
            if self.grouped else list(self.block_start)

        n_q = L + 1  # every sublayer plus the final aggregation
        if self.weights_kind == "pseudo_query":
            # zero init: uniform weights at step 0 (docs/method.md §3; random init destabilises training)
            self.queries = nn.Parameter(torch.zeros(n_q, d))
        elif self.weights_kind == "input_query":
            self.query_proj = nn.ParameterList([nn.Parameter(torch.zeros(d, d)) for _ in range(n_q)])
        elif self.weights_kind == "low_rank_query":
            # q_l = w_l + U_l V_l h: U zero-initialised (q = w = 0 at step 0, uniform weights as for
            # pseudo-queries), V random so that U receives gradient from the first step
            r = config.attnres_query_rank
            self.queries = nn.Parameter(torch.zeros(n_q, d))
            self.query_up = nn.Parameter(torch.zeros(n_q, d, r))
            self.query_down = nn.Parameter(torch.randn(n_q, r, d) / math.sqrt(d))
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

    def norm_eps_scale(self, l: int) -> float:
        """With ``attnres_scale_norm_eps``: c^2, where at init read l returns c times the residual
        sum (c = 1/K_l for softmax over K_l sources, 1/2 for sigmoid). RMSNorm(c S) with eps c^2
        is RMSNorm(S) with eps, so a zero-query model computes the PreNorm function exactly."""
        if not self.scale_norm_eps:
            return 1.0
        c = 0.5 if self.kernel == "sigmoid" else 1.0 / self.num_sources(l)
        return c * c

    def _begin(self, embedding: Tensor) -> Stream:
        return DepthAttentionStream(self, embedding)

    def _resume(self, history, state):
        stream = DepthAttentionStream(self, history[0])
        for v in history[1:]:
            stream._add_source(v)
        stream.partial = state[0] if state else None
        return stream


def _compiled_form(embedding: Tensor) -> bool:
    """Whether a stream is traced by torch.compile for training or prefill. Such a stream keeps no
    buffer and runs ``COMPILED_OPS``: under the compiler, row writes into a buffer become copies
    of it, the partitioner keeps a version of it per read for backward, and matrix products in the
    hand-written backwards cannot fuse (``attnres.ops.two_phase.compiled``). A compiled one-token
    step without gradients (decoding) keeps the buffer: it decoded faster (README "Performance")."""
    return torch.compiler.is_compiling() and (torch.is_grad_enabled() or embedding.shape[1] > 1)


class DepthAttentionStream(Stream):
    def __init__(self, scheme: DepthAttentionResidual, embedding: Tensor):
        super().__init__(scheme.n_sublayers)
        self.scheme = scheme
        self.sources: List[Tensor] = []
        self.partial: Optional[Tensor] = None
        self.fused = scheme.impl in ("fused", "two_phase") and scheme.weights_kind != "scalar"
        # low-rank queries join Phase 1 per depth block (their input is the block's input); Full
        # AttnRes has one sublayer per block and nothing to batch, so it runs the fused op
        self.two_phase = (scheme.impl == "two_phase" and scheme.window is None
                          and (scheme.weights_kind == "pseudo_query"
                               or (scheme.weights_kind == "low_rank_query" and scheme.block_size > 1)))
        self.token_queries = scheme.weights_kind == "low_rank_query"
        # traced by torch.compile for training or prefill: Phase 1 over the sources as separate tensors, no buffer
        self.unstacked = self.two_phase and not self.token_queries and _compiled_form(embedding)
        # Phase 1, traced for training, is recomputed in backward (_phase1_over)
        self.recompute_phase1 = self.unstacked and torch.is_grad_enabled()
        self.buffer = self.inv_rms = None
        # inverse RMS of each completed source, as autograd tensors (unstacked streams with key norm)
        self.source_inv_rms: Optional[List[Tensor]] = None
        # (block start, S tensors h1 [B, T, D], lse [B, T, S, H], per-token queries or None) of the
        # current block
        self._phase1 = None
        if self.unstacked:
            self.ops = COMPILED_OPS
            if scheme.key_norm:
                self.source_inv_rms = []
        elif self.fused:
            b, t, d = embedding.shape
            self.buffer = embedding.new_empty(b, t, scheme.num_blocks + 1, d)
            if self.two_phase and scheme.key_norm and not self.token_queries:
                self.inv_rms = embedding.new_empty(b, t, scheme.num_blocks + 1,
                                                   dtype=torch.float64 if embedding.dtype == torch.float64
                                                   else torch.float32)
        self._add_source(embedding)

    def state_bytes(self) -> int:
        held = [self.buffer] if self.buffer is not None else list(self.sources)
        held += [self.inv_rms] if self.inv_rms is not None else (self.source_inv_rms or [])
        return sum(t.numel() * t.element_size() for t in held)

    def _add_source(self, v: Tensor) -> None:
        """A completed source: appended to ``sources``, written into the buffer (if any), and its
        inverse RMS computed once for all readers (into the buffer's row, or as an autograd tensor
        for unstacked streams)."""
        row = len(self.sources)
        if self.buffer is not None:
            self.ops.store(self.buffer, row, v)
        if self.inv_rms is not None:
            with torch.no_grad():
                self.inv_rms[:, :, row].copy_(inverse_rms(v, self.scheme.eps))
        if self.source_inv_rms is not None:
            self.source_inv_rms.append(inverse_rms(v, self.scheme.eps))
        self.sources.append(v)

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
        if s.weights_kind == "low_rank_query":
            # the most recent completed source: the same for every sublayer of a depth block
            q = low_rank_queries(s.queries[l:l + 1], s.query_up[l:l + 1], s.query_down[l:l + 1],
                                 self.sources[-1])[:, :, 0]
            return q.unflatten(-1, (s.heads, -1)) if s.heads > 1 else q
        # input-dependent: project the stream's most recent state
        recent = self.partial if self.partial is not None else self.sources[-1]
        q = recent @ s.query_proj[l].to(recent.dtype).t()
        return q.unflatten(-1, (s.heads, -1)) if s.heads > 1 else q

    def _key_weight(self, l: int) -> Optional[Tensor]:
        return self.scheme.key_norm_weight[l] if self.scheme.key_norm else None

    # ------------------------------------------------------------------ aggregation
    def _phase1_over(self, a: int, b: int, queries: Tensor, key_weights: Optional[Tensor]):
        """Phase 1 of ``queries`` over completed sources a..b-1: buffer rows read in place, or
        (traced by torch.compile) the source tensors themselves."""
        kernel = self.scheme.kernel
        if self.unstacked:
            inv = self.source_inv_rms[a:b] if self.source_inv_rms is not None else None
            if self.recompute_phase1:
                # from the sources, which backward keeps anyway. Kept instead, a block's stacked
                # outputs (Block) or a group's and the in-group attentions (Full) are what made
                # AttnRes keep more for backward than prenorm; recomputed, both keep what prenorm
                # keeps (`attnres bench graph`, README "Performance")
                return checkpoint(self.ops.phase1_sources, self.sources[a:b], inv, queries, key_weights,
                                  kernel=kernel, use_reentrant=False)
            return self.ops.phase1_sources(self.sources[a:b], inv, queries, key_weights, kernel=kernel)
        inv = self.inv_rms[:, :, a:b] if self.inv_rms is not None else None
        return self.ops.phase1(self.buffer[:, :, a:b], inv, queries, key_weights, self.sources[a:b],
                               kernel=kernel)

    def _two_phase(self, l: int) -> Tensor:
        s = self.scheme
        start = s.group_start[l]
        n = s.plan[start][0]  # sources completed when the group began
        if self._phase1 is None or self._phase1[0] != start:
            stop = start + 1
            while stop < len(s.plan) and s.group_start[stop] == start:
                stop += 1
            key_weights = s.key_norm_weight[start:stop] if s.key_norm else None
            if self.token_queries:  # all S queries of the block at once, from the block's input
                queries = low_rank_queries(s.queries[start:stop], s.query_up[start:stop],
                                           s.query_down[start:stop], self.sources[n - 1])
                if s.heads > 1:
                    queries = queries.unflatten(-1, (s.heads, -1))
                h1, lse = self.ops.phase1_token(self.sources[:n], queries, key_weights, eps=s.eps,
                                                kernel=s.kernel)
            else:
                queries = s.queries[start:stop]
                if s.heads > 1:
                    queries = queries.view(stop - start, s.heads, -1)
                h1, lse = self._phase1_over(0, n, queries, key_weights)
            self._phase1 = (start, h1, lse, queries if self.token_queries else None)
        _, h1, lse, token_queries = self._phase1
        i = l - start
        h, lse = h1[i], lse[:, :, i]
        m = s.plan[l][0]
        if m > n:  # sources completed inside the group (Full AttnRes): attend to them, merge
            q = s.queries[l:l + 1]
            if s.heads > 1:
                q = q.view(1, s.heads, -1)
            kw = s.key_norm_weight[l:l + 1] if s.key_norm else None
            (h2,), lse2 = self._phase1_over(n, m, q, kw)
            h, lse = self.ops.merge(DepthStats(h, lse), DepthStats(h2, lse2[:, :, 0]), s.kernel)
        if self.partial is None:
            return h.to(self.sources[0].dtype)
        if token_queries is not None:
            return self.ops.merge_partial_token(DepthStats(h, lse), self.partial, token_queries[:, :, i], self._key_weight(l),
                                                s.eps, s.kernel)
        return self.ops.merge_partial(DepthStats(h, lse), self.partial, s.queries[l], self._key_weight(l), s.eps,
                                      s.kernel)

    def _aggregate(self, l: int) -> Tensor:
        s = self.scheme
        if s.weights_kind == "scalar":
            return self._scalar_mix(l)
        if self.two_phase:
            return self._two_phase(l)
        query, key_weight = self._query(l), self._key_weight(l)
        producers = self._producers(l)
        if self.fused:
            segments = [self.buffer[:, :, a:b] for a, b in self._source_rows(l)]
            if self.partial is not None:
                segments.append(self.partial.unsqueeze(2))
            return self.ops.attend(
                segments, producers, query, key_weight,
                eps=s.eps, kernel=s.kernel, normalize_keys=s.key_norm,
            )
        stacked = torch.stack(producers)
        return self.ops.attend_reference(
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
            self.partial = self.ops.accumulate(self.partial, f)
        elif self.scheme.states:  # a running sum of the whole stream: it continues from the last state
            self.partial = self.ops.accumulate(self.sources[-1], f)
        else:
            self.partial = f
        complete, _ = self.scheme.plan[l + 1]
        if complete > len(self.sources):  # the depth block just closed
            self._add_source(self.partial)
            self.partial = None

    def _end(self) -> Tensor:
        return self._aggregate(self.n_sublayers)

    def _export(self):
        return list(self.sources), ([self.partial] if self.partial is not None else [])

    def depth_weights(self, l: int):
        s = self.scheme
        # outputs: v_i (Full) / b_i (Block); states: s_i, the running sum after i sublayers (Full) /
        # sb_i, after i depth blocks (Block); "~": the running sum inside the current block
        prefix = ("s" if s.block_size == 1 else "sb") if s.states else ("v" if s.block_size == 1 else "b")
        names = [("emb" if i == 0 else f"{prefix}{i}") for a, b in self._source_rows(l) for i in range(a, b)]
        if self.partial is not None:
            names.append(f"{prefix}{len(self.sources)}~")
        with torch.no_grad():
            if s.weights_kind == "scalar":
                b, t, _ = self.sources[0].shape
                weights = self._scalar_weights(l)[:, None, None].expand(-1, b, t)
            else:
                weights = depth_attention_reference(
                    torch.stack(self._producers(l)), self._query(l), self._key_weight(l),
                    eps=s.eps, kernel=s.kernel, normalize_keys=s.key_norm,
                ).weights
        return weights, names
