"""Attention Residuals: Full (docs/method.md §3) and Block (docs/method.md §4) with the Table-4 variants.

Full AttnRes is Block AttnRes with one sublayer per depth block (S = 1): every
output is its own block, no partial sums exist, and each sublayer attends over
the embedding and all earlier outputs. One class therefore serves both.

This module holds the scheme: its options, the depth-block geometry and the parameters. The
streams it starts, the reference and each fast form, are in ``attnres.residual.depth_streams``.

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

Routing (``attnres_routing``): "replacement" (the paper: a read is the depth mixture) or "additive"
(Delta Attention Residuals' corrected form: a read is the ordinary PreNorm stream h_std plus g_l times
the mixture). The gain (``attnres_gain``) is learned per channel or as one scalar per read, starting
at ``attnres_gain_init`` (0: the model starts as PreNorm exactly) and trained at ``attnres_gain_lr``
times the learning rate; or it is "unit", Delta AttnRes as published: no gain parameter, h_std plus the
mixture at every read but the first and the final one, which return h_std (docs/method.md §5). The
stream keeps h_std beside its sources and wraps whatever its form's read computes, so every
implementation serves all of them.

Depth blocks may be uneven (``attnres_block_sizes``): the geometry lives in
``source_plan`` alone, which every path reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnres.residual.base import ResidualScheme, Stream
from attnres.residual.depth_streams import stream_class
from attnres.residual.options import (
    Option,
    boolean,
    is_positive_int,
    one_of,
    positive_int,
)

WEIGHTS = ("pseudo_query", "input_query", "low_rank_query", "scalar")
SOURCES = ("outputs", "states")
KERNELS = ("softmax", "sigmoid")
VALUES = ("raw", "normalized")
ROUTINGS = ("replacement", "additive")
GAINS = ("per_channel", "scalar", "unit")
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


def equal_block_sizes(n_sublayers: int, size: int) -> list[int]:
    """Blocks of ``size`` sublayers, the last one shorter when ``size`` does not divide L."""
    full, rest = divmod(n_sublayers, size)
    return [size] * full + ([rest] if rest else [])


def block_sizes(config) -> list[int]:
    """Sublayers per depth block, in order: ``attnres_block_sizes``, else equal blocks of S
    (``block_size``) with the last one shorter."""
    if config.attnres_block_sizes is not None:
        return list(config.attnres_block_sizes)
    return equal_block_sizes(config.n_sublayers, block_size(config))


def full_block_sizes(config) -> list[int]:
    """Full AttnRes: every sublayer output is its own source (S = 1)."""
    return [1] * config.n_sublayers


def group_size(config) -> int:
    """G for Full AttnRes' two-phase schedule: ``attnres_group_size``, else round(sqrt(L))."""
    if config.attnres_group_size is not None:
        return config.attnres_group_size
    return max(1, round(math.sqrt(config.n_sublayers)))


def routing_gain_stats(model: nn.Module) -> dict[str, float]:
    """The learned additive gain of ``model``'s AttnRes scheme, for the trainer's metric rows and the
    experiment probes: ``gain_rms`` and ``gain_shift_rms`` (``DepthAttentionResidual.gain_stats``); {}
    where the model has no learned gain."""
    for module in model.modules():
        if isinstance(module, DepthAttentionResidual):
            return module.gain_stats()
    return {}


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
        return (
            f"applies to attnres_weights='low_rank_query' only (attnres_weights={config.attnres_weights!r}); "
            "drop it or set attnres_weights='low_rank_query'"
        )
    if not is_positive_int(r) or r >= config.d_model:
        return (
            f"must be an integer in [1, {config.d_model - 1}] (below d_model={config.d_model}); "
            "use attnres_weights='input_query' for a full-rank query"
        )
    return None


def _sources(value, config):
    if value not in SOURCES:
        return f"choose one of {SOURCES}"
    if value == "states" and config.attnres_scale_norm_eps:
        return (
            "states-sourced AttnRes reads a weighted mix of running sums at init, not a multiple of the "
            "PreNorm sum, so attnres_scale_norm_eps cannot make it exact; drop attnres_scale_norm_eps"
        )
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
        return (
            f"cannot split L={L} sublayers into {n} blocks of {s} with only the last one shorter; "
            f"set attnres_block_size instead (S={s} gives {math.ceil(L / s)} blocks), or list the sizes "
            f"in attnres_block_sizes"
        )
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
    if not isinstance(sizes, (list, tuple)) or not sizes or not all(is_positive_int(s) for s in sizes):
        return "must be a non-empty list of positive integers (sublayers per depth block, in order)"
    if sum(sizes) != L:
        return f"sums to {sum(sizes)}, not to the L={L} sublayers (2 * n_layers); make the sizes add up to {L}"
    return None


def _multi_query_variant(config) -> str | None:
    """What the multi-query read (normalized values, a score scale, several queries) cannot combine with."""
    if config.attnres_weights != "pseudo_query":
        return f"needs attnres_weights='pseudo_query' (attnres_weights={config.attnres_weights!r})"
    if config.attnres_heads != 1:
        return f"needs attnres_heads=1 (attnres_heads={config.attnres_heads})"
    return None


def _values(value, config):
    if value not in VALUES:
        return f"choose one of {VALUES}"
    if value == "normalized" and config.attnres_scale_norm_eps:
        return (
            "a zero-query read of normalized values is no multiple of the PreNorm sum, so "
            "attnres_scale_norm_eps cannot make it exact; drop attnres_scale_norm_eps"
        )
    return _multi_query_variant(config) if value == "normalized" else None


def _score_scale(value, config):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return "must be a positive number (Inkling-2: d_model ** -0.5) or None"
    return _multi_query_variant(config)


def _read_queries(value, config):
    n = config.n_sublayers + 1
    if not isinstance(value, (list, tuple)) or len(value) != n or not all(is_positive_int(q) for q in value):
        return (
            f"must list {n} positive integers (queries per read: the L={config.n_sublayers} sublayers, then the "
            "final aggregation)"
        )
    return _multi_query_variant(config)


def _routing(value, config):
    if value not in ROUTINGS:
        return f"choose one of {ROUTINGS} (additive: the PreNorm stream plus a gained depth mixture)"
    return None


def _needs_additive(config) -> str | None:
    if config.attnres_routing != "additive":
        return (
            f"applies to attnres_routing='additive' only (attnres_routing={config.attnres_routing!r}); "
            "drop it or set attnres_routing='additive'"
        )
    return None


def _learned_gain(config) -> str | None:
    if config.attnres_gain == "unit":
        return "attnres_gain='unit' has no learned gain (g = 1, fixed); drop it or set attnres_gain='per_channel'"
    return None


def _gain(value, config):
    if value not in GAINS:
        return f"choose one of {GAINS} (unit: Delta AttnRes' h_std + mixture, no gain parameter)"
    if value == "unit" and config.attnres_scale_norm_eps:
        return "a unit gain reads h_std + mixture, no multiple of the PreNorm sum; drop attnres_scale_norm_eps"
    return _needs_additive(config)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _gain_init(value, config):
    if not _is_number(value):
        return "must be a finite number (0: the model starts as PreNorm exactly; 1: h_std + the mixture)"
    if value != 0 and config.attnres_scale_norm_eps:
        return (
            "with a nonzero gain a read at init is no multiple of the PreNorm sum, so attnres_scale_norm_eps "
            "cannot make it exact; drop attnres_scale_norm_eps or set attnres_gain_init=0"
        )
    return _needs_additive(config) or _learned_gain(config)


def _gain_lr(value, config):
    if not _is_number(value) or value <= 0:
        return "must be a positive number (the gain's learning rate over the optimizer's; 1: the same rate)"
    return _needs_additive(config) or _learned_gain(config)


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
    "attnres_values": Option(_values),
    "attnres_score_scale": Option(_score_scale),
    "attnres_read_queries": Option(_read_queries),
    "attnres_routing": Option(_routing),
    "attnres_gain": Option(_gain),
    "attnres_gain_init": Option(_gain_init),
    "attnres_gain_lr": Option(_gain_lr),
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


class DepthAttentionResidual(ResidualScheme):
    """Block AttnRes with block size S (S = 1: Full AttnRes), L sublayers, one query per sublayer + final."""

    query_rank: int | None = None  # r of low-rank queries (attnres_weights="low_rank_query")

    def __init__(self, config):
        super().__init__()
        d, L = config.d_model, config.n_sublayers
        self.d_model, self.n_sublayers = d, L
        self.scheme_name = config.residual  # "full" or "block" (or a subclass's)
        self.block_sizes = full_block_sizes(config) if config.residual == "full" else block_sizes(config)
        self.block_size = max(self.block_sizes)  # the largest block (uneven blocks: see block_sizes)
        self.num_blocks = len(self.block_sizes)
        self.heads = config.attnres_heads
        self.weights_kind = config.attnres_weights
        self.kernel = config.attnres_kernel
        self.key_norm = config.attnres_key_norm and config.attnres_weights != "scalar"
        self.window = config.attnres_window
        self.eps = config.norm_eps
        self.impl = config.attnres_impl
        self.scale_norm_eps = config.attnres_scale_norm_eps
        self.states = config.attnres_sources == "states"
        # the Inkling-2 variant (docs/own_model.md): normalized values, scaled logits, several queries per read
        self.values = config.attnres_values
        self.score_scale = config.attnres_score_scale
        self.read_queries = list(config.attnres_read_queries or [1] * (L + 1))
        self.multi_query = self.values != "raw" or self.score_scale is not None or max(self.read_queries) > 1
        # additive routing (Delta AttnRes): read l is h_std + g_l * (the depth mixture), h_std the PreNorm
        # stream; g = 0 at init (the default) starts the model as PreNorm exactly
        self.additive = config.attnres_routing == "additive"
        self.gain_form = config.attnres_gain
        self.gain_init = float(config.attnres_gain_init)
        self.gain_lr = float(config.attnres_gain_lr)
        if self.additive and self.gain_form == "unit":
            # Delta AttnRes' own form: no gain; its first read has no earlier source and its output is
            # norm(h_std), so g is 0 there. A buffer, not a skipped read: every query stays in the graph
            unit = torch.ones(L + 1, 1)
            unit[0] = unit[L] = 0.0
            self.register_buffer("routing_gain", unit, persistent=False)
        elif self.additive:
            self.routing_gain = nn.Parameter(
                torch.full((L + 1, d if self.gain_form == "per_channel" else 1), self.gain_init)
            )
        self.plan = source_plan(L, self.block_sizes)
        # the first sublayer of each sublayer's depth block (the final aggregation is its own block)
        self.block_start: list[int] = []
        for l, (_, partial) in enumerate(self.plan):
            self.block_start.append(self.block_start[-1] if partial else l)
        # the first sublayer of each sublayer's Phase-1 group: its depth block, or for Full AttnRes
        # G consecutive sublayers (their later sources are merged in per sublayer)
        group = group_size(config) if config.residual == "full" else 1
        self.grouped = self.block_size == 1 and group > 1
        self.group_start = (
            [(l // group) * group if l < L else L for l in range(L + 1)] if self.grouped else list(self.block_start)
        )

        n_q = L + 1  # every sublayer plus the final aggregation
        if self.weights_kind == "pseudo_query":
            # zero init: uniform weights at step 0 (docs/method.md §3; random init destabilises training)
            self.queries = nn.Parameter(torch.zeros(n_q, d))
        elif self.weights_kind == "input_query":
            self.query_proj = nn.ParameterList([nn.Parameter(torch.zeros(d, d)) for _ in range(n_q)])
        elif self.weights_kind == "low_rank_query":
            # q_l = w_l + U_l V_l h: U zero-initialised (q = w = 0 at step 0, uniform weights as for
            # pseudo-queries), V random so that U receives gradient from the first step
            r = self.query_rank = config.attnres_query_rank
            self.queries = nn.Parameter(torch.zeros(n_q, d))
            self.query_up = nn.Parameter(torch.zeros(n_q, d, r))
            self.query_down = nn.Parameter(torch.randn(n_q, r, d) / math.sqrt(d))
        else:  # scalar: one learned logit per (sublayer, source)
            self.mix_logits = nn.ParameterList([nn.Parameter(torch.zeros(self.num_sources(l))) for l in range(n_q)])
        if max(self.read_queries) > 1:
            # a read's queries beyond its first, in read order; zero at init like the first
            self.extra_queries = nn.Parameter(torch.zeros(sum(self.read_queries) - n_q, d))
            self.extra_start = [sum(q - 1 for q in self.read_queries[:l]) for l in range(n_q)]
        if self.key_norm:
            self.key_norm_weight = nn.Parameter(torch.ones(n_q, d))

    def settings(self) -> dict:
        return {
            "d_model": self.d_model,
            "n_sublayers": self.n_sublayers,
            "attnres_blocks": self.num_blocks,
            "attnres_block_sizes": list(self.block_sizes),
            "attnres_window": self.window,
            "attnres_weights": self.weights_kind,
            "attnres_query_rank": self.query_rank,
            "attnres_kernel": self.kernel,
            "attnres_key_norm": self.key_norm,
            "attnres_heads": self.heads,
            "attnres_sources": "states" if self.states else "outputs",
            "attnres_values": self.values,
            "attnres_score_scale": self.score_scale,
            "attnres_read_queries": list(self.read_queries),
            "attnres_routing": "additive" if self.additive else "replacement",
            "attnres_scale_norm_eps": self.scale_norm_eps,
            "norm_eps": self.eps,
            # the additive gain's form (per_channel under replacement routing); its init and learning rate only
            # start and train the gain, whose value the weights carry, so they are no setting (as impl is not).
            # attnres.residual.record reads a record without it as this default
            "attnres_gain": self.gain_form,
        }

    def lr_scales(self) -> dict[str, float]:
        """Parameter name (relative to this module) -> its learning-rate multiplier, where not 1
        (``attnres.residual.param_groups.lr_scales``; the trainer's optimizer honours it)."""
        learned = self.additive and self.gain_form != "unit"
        return {"routing_gain": self.gain_lr} if learned and self.gain_lr != 1.0 else {}

    @torch.no_grad()
    def gain_stats(self) -> dict[str, float]:
        """The additive gain now: ``gain_rms`` (RMS of g over reads and channels) and ``gain_shift_rms``
        (RMS of g minus its initial value: 0 until training moves it); {} without a learned gain."""
        if not self.additive or self.gain_form == "unit":
            return {}
        g = self.routing_gain.detach()
        full = getattr(g, "full_tensor", None)  # sharded (FSDP2): the whole gain
        g = (full() if callable(full) else g).double()
        return {
            "gain_rms": g.pow(2).mean().sqrt().item(),
            "gain_shift_rms": (g - self.gain_init).pow(2).mean().sqrt().item(),
        }

    def num_sources(self, l: int) -> int:
        """K_l: how many sources sublayer l (L = final aggregation) attends over."""
        complete, partial = self.plan[l]
        if self.window is not None:
            return 1 + min(self.window, complete - 1)
        return complete + int(partial)

    def prenorm_read_scale(self, l: int) -> float | None:
        """c, where at init (zero queries: uniform weights) read l returns c times the PreNorm residual
        sum: 1/K_l for softmax over K_l sources, 1/2 for sigmoid. None where no such c exists: with
        "states" sources (a mix of running sums), normalized values, or a window that leaves sources out.
        Additive routing with zero-initialised gains reads the PreNorm sum itself at init: c = 1; with
        nonzero (or unit) gains it reads h_std + g * mixture, no multiple of it."""
        if self.additive:
            return 1.0 if self.gain_form != "unit" and self.gain_init == 0 else None
        if (
            self.states
            or self.values != "raw"
            or (self.window is not None and self.num_sources(l) < self.plan[l][0] + int(self.plan[l][1]))
        ):
            return None
        return 0.5 if self.kernel == "sigmoid" else 1.0 / self.num_sources(l)

    def norm_eps_scale(self, l: int) -> float:
        """With ``attnres_scale_norm_eps``: c^2 (``prenorm_read_scale``). RMSNorm(c S) with eps c^2
        eps is RMSNorm(S) with eps (LayerNorm too), so a zero-query model computes the PreNorm
        function exactly."""
        c = self.prenorm_read_scale(l) if self.scale_norm_eps else None
        return 1.0 if c is None else c * c

    def stream_form(self, embedding: Tensor) -> type:
        """The stream class this scheme runs (``attnres_impl``, its weights, the compiler); an
        instance may override it to run a measuring form (``attnres.experiments.importance``)."""
        return stream_class(self, embedding)

    def _begin(self, embedding: Tensor) -> Stream:
        stream = self.stream_form(embedding)(self, [embedding])
        if self.additive:
            stream.residual = embedding
        return stream

    def _resume(self, history, state, cache=()):
        # the state: [partial block sum] if a block is open, then with additive routing the PreNorm stream
        residual = state[-1] if self.additive else None
        partial = state[0] if len(state) > int(self.additive) else None
        stream = self.stream_form(history[0])(self, history, partial, cache)
        stream.residual = residual
        return stream
