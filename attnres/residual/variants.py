"""The variants of Full and Block AttnRes: each a named object composed onto the paper's method.

``DepthAttentionResidual`` (``attnres.residual.attnres``) runs the paper's method
(``attnres.residual.method``); each choice away from it is one object here, holding its own settings
and doing what it changes. The scheme builds them from its config in one place (``variants_of``) and
its streams ask them, instead of branching on flags:

===============  =============================================  =======================================
choice           objects (the paper's first)                     ``ModelConfig`` fields
===============  =============================================  =======================================
query form       ``PseudoQueries``, ``InputQueries``,            ``attnres_weights``,
                 ``LowRankQueries(rank)``, ``ScalarMixing``,     ``attnres_query_rank``, ``attnres_values``,
                 ``MultiQueries(values, score_scale,             ``attnres_score_scale``,
                 read_queries)``                                 ``attnres_read_queries``
kernel           ``Softmax``, ``Sigmoid``                        ``attnres_kernel``
sources          ``OutputSources``, ``StateSources``             ``attnres_sources``
routing          ``ReplacementRouting``,                         ``attnres_routing``, ``attnres_gain``,
                 ``AdditiveRouting(gain, init, lr)``             ``attnres_gain_init``, ``attnres_gain_lr``
===============  =============================================  =======================================

The parameters stay on the scheme under the names checkpoints hold (``queries``, ``query_proj``,
``query_up``, ``query_down``, ``mix_logits``, ``extra_queries``, ``routing_gain``): an object makes
them (``build``) and reads them from the scheme it is handed, so it holds settings, not tensors.
docs/method.md §5 defines every variant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnres.ops.token_queries import low_rank_queries

# ----------------------------------------------------------------------------- query forms


class PseudoQueries:
    """The paper's query (docs/method.md §3): w_l, one parameter per consumer (``queries``), zero at
    init so that every read starts uniform. Every query of a depth block is known when it starts, so
    Phase 1 (§6) batches them."""

    name: ClassVar[str] = "pseudo_query"  # ``attnres_weights``
    rank: int | None = None  # ``attnres_query_rank``
    has_keys: ClassVar[bool] = True  # reads score keys, so the key norm applies
    # the read: raw values, unscaled logits, one query per read (``MultiQueries`` changes them)
    values: str = "raw"
    score_scale: float | None = None

    def build(self, scheme, n_reads: int, d: int) -> None:
        # zero init: uniform weights at step 0 (docs/method.md §3; random init destabilises training)
        scheme.queries = nn.Parameter(torch.zeros(n_reads, d))

    def known_at_block_start(self, block_size: int) -> bool:
        """Whether every query of a depth block is known when the block starts (Phase 1 can batch them)."""
        return True

    def query(self, stream, l: int) -> Tensor:
        """The query of read l: [D] ([H, D/H] with heads), or per token [B, T, D] ([B, T, H, D/H])."""
        s = stream.scheme
        q = s.queries[l]
        return q.view(s.heads, -1) if s.heads > 1 else q

    def uniform_at_init(self) -> bool:
        """Whether at init every read weighs its raw sources alike (the zero-query equivalence, §3)."""
        return self.values == "raw"

    def per_read(self, n_reads: int) -> list[int]:
        """Queries per read (``attnres_read_queries``)."""
        return [1] * n_reads


class InputQueries(PseudoQueries):
    """Input-dependent query (paper Table 4): q_l = W_l h, h the stream's newest source (the partial sum
    if there is one), W_l = ``query_proj[l]`` zero at init. Known only sublayer by sublayer."""

    name: ClassVar[str] = "input_query"

    def build(self, scheme, n_reads: int, d: int) -> None:
        scheme.query_proj = nn.ParameterList([nn.Parameter(torch.zeros(d, d)) for _ in range(n_reads)])

    def known_at_block_start(self, block_size: int) -> bool:
        return False

    def query(self, stream, l: int) -> Tensor:
        s = stream.scheme
        recent = stream.partial if stream.partial is not None else stream.sources[-1]
        q = recent @ s.query_proj[l].to(recent.dtype).t()
        return q.unflatten(-1, (s.heads, -1)) if s.heads > 1 else q


class LowRankQueries(PseudoQueries):
    """Low-rank input-dependent query (docs/method.md §5): q_l = w_l + U_l V_l h, h the newest complete
    source (the same for every sublayer of a depth block), ``queries`` w, ``query_up`` U [d, r] zero at
    init, ``query_down`` V [r, d] random so that U receives gradient from the first step. Block AttnRes
    knows a block's queries at its start (a per-token Phase 1, ``attnres.ops.token_queries``)."""

    name: ClassVar[str] = "low_rank_query"
    rank: int  # r

    def __init__(self, rank: int):
        self.rank = rank

    def build(self, scheme, n_reads: int, d: int) -> None:
        scheme.queries = nn.Parameter(torch.zeros(n_reads, d))
        scheme.query_up = nn.Parameter(torch.zeros(n_reads, d, self.rank))
        scheme.query_down = nn.Parameter(torch.randn(n_reads, self.rank, d) / math.sqrt(d))

    def known_at_block_start(self, block_size: int) -> bool:
        return block_size > 1  # Full AttnRes: every source completes a block, each read has its own h

    def block_queries(self, scheme, start: int, stop: int, h: Tensor) -> Tensor:
        """Queries of reads start … stop-1 from h [B, T, D]: [B, T, S, D] ([B, T, S, H, D/H] with heads)."""
        q = low_rank_queries(scheme.queries[start:stop], scheme.query_up[start:stop], scheme.query_down[start:stop], h)
        return q.unflatten(-1, (scheme.heads, -1)) if scheme.heads > 1 else q

    def query(self, stream, l: int) -> Tensor:
        return self.block_queries(stream.scheme, l, l + 1, stream.sources[-1])[:, :, 0]


class ScalarMixing(PseudoQueries):
    """Input-independent mixing (paper Table 4): one learned logit per (read, source), ``mix_logits``,
    zero at init; no query and no keys (so no key norm)."""

    name: ClassVar[str] = "scalar"
    has_keys: ClassVar[bool] = False

    def build(self, scheme, n_reads: int, d: int) -> None:
        scheme.mix_logits = nn.ParameterList([nn.Parameter(torch.zeros(scheme.num_sources(l))) for l in range(n_reads)])

    def known_at_block_start(self, block_size: int) -> bool:
        return False  # no logits to batch: a read is a direct weighted sum

    def query(self, stream, l: int) -> Tensor:
        raise TypeError("scalar mixing has no query: its weights are mix_logits (ScalarMixing.weights)")

    def weights(self, scheme, l: int) -> Tensor:
        """alpha [K] of read l."""
        logits = scheme.mix_logits[l]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return scheme.kernel_form.weights(logits, dim=0)


class MultiQueries(PseudoQueries):
    """Pseudo-queries read as Inkling-2 and its relatives do (docs/own_model.md): ``values``
    "normalized" (RMS-normalised values), logits times ``score_scale``, and ``read_queries[l]`` queries
    for read l, those beyond the first in ``extra_queries`` (zero at init, in read order)."""

    def __init__(self, values: str, score_scale: float | None, read_queries: list[int]):
        self.values, self.score_scale, self.read_queries = values, score_scale, list(read_queries)
        # the row of read l's second query in extra_queries
        self.extra_start = [sum(q - 1 for q in read_queries[:l]) for l in range(len(read_queries))]

    def build(self, scheme, n_reads: int, d: int) -> None:
        super().build(scheme, n_reads, d)
        if max(self.read_queries) > 1:
            scheme.extra_queries = nn.Parameter(torch.zeros(sum(self.read_queries) - n_reads, d))

    def per_read(self, n_reads: int) -> list[int]:
        return list(self.read_queries)

    def queries(self, scheme, l: int) -> Tensor:
        """The queries of read l, [Q, D]."""
        first = scheme.queries[l : l + 1]
        extra = self.read_queries[l] - 1
        if not extra:
            return first
        start = self.extra_start[l]
        return torch.cat([first, scheme.extra_queries[start : start + extra]])


# ----------------------------------------------------------------------------- kernels


class Softmax:
    """The paper's kernel: alpha = softmax over a read's sources (weights sum to 1)."""

    name: ClassVar[str] = "softmax"  # ``attnres_kernel``; the ops take the kernel by this name (scheme.kernel)

    def weights(self, z: Tensor, dim: int) -> Tensor:
        return torch.softmax(z, dim=dim)

    def uniform_weight(self, k: int) -> float:
        """Each weight at zero logits over k sources."""
        return 1.0 / k


class Sigmoid(Softmax):
    """alpha_i = sigmoid(z_i), each weight on its own (paper Table 4)."""

    name: ClassVar[str] = "sigmoid"

    def weights(self, z: Tensor, dim: int) -> Tensor:
        return torch.sigmoid(z)

    def uniform_weight(self, k: int) -> float:
        return 0.5


# ----------------------------------------------------------------------------- sources


class OutputSources:
    """The paper's sources (docs/method.md §4): the embedding, each complete depth block's sum of
    outputs b_n, and the open block's partial sum b_n^i, which starts at the block's first output."""

    name: ClassVar[str] = "outputs"  # ``attnres_sources``
    sums_to_prenorm: ClassVar[bool] = True  # the sources add up to the PreNorm hidden state

    def open_block(self, last: Tensor, f: Tensor, accumulate: Callable) -> Tensor:
        """The partial sum after a depth block's first output ``f`` (``last``: the newest complete source)."""
        return f

    def prefix(self, full: bool) -> str:
        """Source names in depth records: v_i (Full), b_i (Block)."""
        return "v" if full else "b"


class StateSources(OutputSources):
    """Hidden states as sources (docs/method.md §5): the running residual sum at each depth-block
    boundary; a block's partial sum continues from the last complete state."""

    name: ClassVar[str] = "states"
    sums_to_prenorm: ClassVar[bool] = False

    def open_block(self, last: Tensor, f: Tensor, accumulate: Callable) -> Tensor:
        return accumulate(last, f)

    def prefix(self, full: bool) -> str:
        return "s" if full else "sb"


# ----------------------------------------------------------------------------- routing


class ReplacementRouting:
    """The paper's routing: read l is the depth mixture itself."""

    name: ClassVar[str] = "replacement"  # ``attnres_routing``
    gain: str = "per_channel"  # no gain; the default ``attnres_gain`` a record names
    state_size: ClassVar[int] = 0  # tensors of its own in a stream's exported state

    def build(self, scheme, n_reads: int, d: int) -> None:
        """Make the routing's parameters on ``scheme``: none."""

    def begin(self, stream, embedding: Tensor) -> None:
        """A stream starts at the embedding."""

    def resume(self, stream, state: list[Tensor]) -> None:
        """A stream resumes: ``state`` is the routing's part of the exported state."""

    def state(self, stream) -> list[Tensor]:
        """The routing's part of the stream's exported state."""
        return []

    def write(self, stream, f: Tensor) -> None:
        """Sublayer output ``f`` (widened) enters the stream."""

    def route(self, stream, l: int, mixture: Tensor) -> Tensor:
        """What read l returns, given its depth mixture."""
        return mixture

    def read_scale(self, mixture_scale: float | None) -> float | None:
        """c, where at init a read returns c times the PreNorm sum, given the mixture's own c (or None)."""
        return mixture_scale

    def lr_scales(self) -> dict[str, float]:
        return {}

    def gain_stats(self, scheme) -> dict[str, float]:
        return {}


class AdditiveRouting(ReplacementRouting):
    """Delta Attention Residuals' corrected form (docs/method.md §5): read l is h_std + g_l ⊙ mixture,
    h_std the PreNorm stream (embedding + every output so far), kept beside the sources, so every
    stream form routes additively without a path of its own. ``gain``: "per_channel" (g_l ∈ R^d) or
    "scalar" (g_l ∈ R), a parameter ``routing_gain`` starting at ``init`` (0: the model starts as
    PreNorm exactly) and trained at ``lr`` times the learning rate; or "unit", Delta AttnRes as
    published: no parameter, g = 1 except at the first and the final read, which return h_std."""

    name: ClassVar[str] = "additive"
    state_size: ClassVar[int] = 1  # h_std

    def __init__(self, gain: str = "per_channel", init: float = 0.0, lr: float = 1.0):
        self.gain, self.init, self.lr = gain, init, lr

    @property
    def learned(self) -> bool:
        return self.gain != "unit"

    def build(self, scheme, n_reads: int, d: int) -> None:
        if not self.learned:
            # no gain; the first read has no earlier source and the output is norm(h_std), so g is 0
            # there. A buffer, not a skipped read: every query stays in the graph
            unit = torch.ones(n_reads, 1)
            unit[0] = unit[n_reads - 1] = 0.0
            scheme.register_buffer("routing_gain", unit, persistent=False)
        else:
            scheme.routing_gain = nn.Parameter(torch.full((n_reads, d if self.gain == "per_channel" else 1), self.init))

    def begin(self, stream, embedding: Tensor) -> None:
        stream.residual = embedding

    def resume(self, stream, state: list[Tensor]) -> None:
        stream.residual = state[0]

    def state(self, stream) -> list[Tensor]:
        assert stream.residual is not None  # set on begin and resume
        return [stream.residual]

    def write(self, stream, f: Tensor) -> None:
        assert stream.residual is not None  # set on begin and resume
        stream.residual = stream.ops.accumulate(stream.residual, f)

    def route(self, stream, l: int, mixture: Tensor) -> Tensor:
        assert stream.residual is not None  # set on begin and resume
        return stream.residual + stream.scheme.routing_gain[l].to(mixture.dtype) * mixture

    def read_scale(self, mixture_scale: float | None) -> float | None:
        # a zero gain reads the PreNorm sum itself at init; a nonzero (or unit) one h_std + g * mixture
        return 1.0 if self.learned and self.init == 0 else None

    def lr_scales(self) -> dict[str, float]:
        """Parameter name -> learning-rate multiplier, where not 1."""
        return {"routing_gain": self.lr} if self.learned and self.lr != 1.0 else {}

    def gain_stats(self, scheme) -> dict[str, float]:
        if not self.learned:
            return {}
        g = scheme.routing_gain.detach()
        full = getattr(g, "full_tensor", None)  # sharded (FSDP2): the whole gain
        g = (full() if callable(full) else g).double()
        return {
            "gain_rms": g.pow(2).mean().sqrt().item(),
            "gain_shift_rms": (g - self.init).pow(2).mean().sqrt().item(),
        }


# ----------------------------------------------------------------------------- from a config


class Variants(NamedTuple):
    """One scheme's choices (the objects above)."""

    query_form: PseudoQueries
    kernel_form: Softmax
    source_form: OutputSources
    routing: ReplacementRouting


def query_form_of(config) -> PseudoQueries:
    read_queries = list(config.attnres_read_queries or [1] * (config.n_sublayers + 1))
    if config.attnres_values != "raw" or config.attnres_score_scale is not None or max(read_queries) > 1:
        # validation allows these with pseudo-queries only
        return MultiQueries(config.attnres_values, config.attnres_score_scale, read_queries)
    kind = config.attnres_weights
    if kind == "low_rank_query":
        return LowRankQueries(config.attnres_query_rank)
    forms: dict[str, type[PseudoQueries]] = {
        "pseudo_query": PseudoQueries,
        "input_query": InputQueries,
        "scalar": ScalarMixing,
    }
    return forms[kind]()


def variants_of(config) -> Variants:
    """The variant objects a validated config names (``attnres.residual.args`` checks the fields)."""
    routing = (
        AdditiveRouting(config.attnres_gain, float(config.attnres_gain_init), float(config.attnres_gain_lr))
        if config.attnres_routing == "additive"
        else ReplacementRouting()
    )
    return Variants(
        query_form=query_form_of(config),
        kernel_form=Sigmoid() if config.attnres_kernel == "sigmoid" else Softmax(),
        source_form=StateSources() if config.attnres_sources == "states" else OutputSources(),
        routing=routing,
    )
