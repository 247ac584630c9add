"""Full (docs/method.md §3) and Block AttnRes (§4) as one residual scheme: ``DepthAttentionResidual``.

The paper's method itself, each line of docs/method.md §3-§4 beside the code that computes it, is
``attnres.residual.method``: the depth blocks (``source_plan``) and the reference stream
(``DepthAttentionStream``: read = Eq. 1-3 by the reference op, write = Eq. 4 into the block sums).
This scheme holds what that stream reads: the paper's parameters (``queries`` = w_l,
``key_norm_weight`` = g_l), the geometry (``plan``) and the variants. Full AttnRes is Block AttnRes
with one sublayer per depth block (S = 1), so one class serves both.

Every variant (docs/method.md §5: other query forms, the sigmoid kernel, state sources, additive
routing) is a named object of ``attnres.residual.variants`` that the scheme composes (``query_form``,
``kernel_form``, ``source_form``, ``routing``) and the streams ask; none is a flag here. The other
Table-4 options stay settings of the scheme: ``heads`` (channel groups), ``key_norm`` and ``window``.

Three implementations (``ModelConfig.attnres_impl``), equal to rounding:
- ``two_phase`` (default): docs/method.md §6 in training too. At a depth block's first
  sublayer one Phase-1 op attends all S queries of the block to the completed blocks at once
  (its backward also runs once per block); each sublayer then merges the partial sum by online
  softmax. Needs queries known when the block starts (``query_form.known_at_block_start``);
  other query forms and windows use ``fused``; scalar mixing (no query at all) is a plain
  weighted sum under any impl.
- ``fused``: one custom-autograd depth attention per sublayer over buffer views.
- ``reference``: the reference stream, plain autograd over a stacked source list.

Depth blocks may be uneven (``attnres_block_sizes``): the geometry lives in ``source_plan`` alone,
which every path reads.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from attnres.residual.args import (
    block_sizes,
    equal_block_sizes,
    full_block_sizes,
    group_size,
)
from attnres.residual.base import ResidualScheme, Stream
from attnres.residual.depth_streams import stream_class
from attnres.residual.method import source_plan
from attnres.residual.variants import variants_of

__all__ = [  # the helpers of args and method too: they are imported from here
    "DepthAttentionResidual",
    "block_sizes",
    "equal_block_sizes",
    "full_block_sizes",
    "group_size",
    "routing_gain_stats",
    "source_plan",
]


def routing_gain_stats(model: nn.Module) -> dict[str, float]:
    """The learned additive gain of ``model``'s AttnRes scheme, for the trainer's metric rows and the
    experiment probes: ``gain_rms`` and ``gain_shift_rms`` (``DepthAttentionResidual.gain_stats``); {}
    where the model has no learned gain."""
    for module in model.modules():
        if isinstance(module, DepthAttentionResidual):
            return module.gain_stats()
    return {}


class DepthAttentionResidual(ResidualScheme):
    """Block AttnRes with block size S (S = 1: Full AttnRes), L sublayers, one query per sublayer + final.

    The paper's parameters: ``queries`` w_l [L + 1, D] (zero at init: uniform weights, docs/method.md
    §3) and ``key_norm_weight`` g_l [L + 1, D] (ones). A variant's own parameters keep their names
    (``query_proj``, ``query_up``, ``query_down``, ``mix_logits``, ``extra_queries``, ``routing_gain``);
    its object makes them."""

    queries: nn.Parameter  # w_l (pseudo- and low-rank queries)
    key_norm_weight: nn.Parameter  # g_l (with key norm)
    routing_gain: Tensor  # g_l of additive routing (a buffer for the unit gain)

    def __init__(self, config):
        super().__init__()
        d, L = config.d_model, config.n_sublayers
        self.d_model, self.n_sublayers = d, L
        self.scheme_name = config.residual  # "full" or "block" (or a subclass's)
        self.eps = config.norm_eps
        self.impl = config.attnres_impl
        self.scale_norm_eps = config.attnres_scale_norm_eps
        # the variants (attnres.residual.variants), the paper's by default
        self.query_form, self.kernel_form, self.source_form, self.routing = variants_of(config)
        self.kernel = self.kernel_form.name  # the ops take the kernel by name
        self.heads = config.attnres_heads
        self.key_norm = config.attnres_key_norm and self.query_form.has_keys
        self.window = config.attnres_window

        # the depth blocks (docs/method.md §4)
        self.block_sizes = full_block_sizes(config) if config.residual == "full" else block_sizes(config)
        self.block_size = max(self.block_sizes)  # the largest block (uneven blocks: see block_sizes)
        self.num_blocks = len(self.block_sizes)
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

        # the parameters, one set per consumer: every sublayer plus the final aggregation
        n_q = L + 1
        self.routing.build(self, n_q, d)  # additive routing: routing_gain
        self.query_form.build(self, n_q, d)  # the paper's: queries, w_l = 0
        if self.key_norm:
            self.key_norm_weight = nn.Parameter(torch.ones(n_q, d))

    def settings(self) -> dict:
        q = self.query_form
        return {
            "d_model": self.d_model,
            "n_sublayers": self.n_sublayers,
            "attnres_blocks": self.num_blocks,
            "attnres_block_sizes": list(self.block_sizes),
            "attnres_window": self.window,
            "attnres_weights": q.name,
            "attnres_query_rank": q.rank,
            "attnres_kernel": self.kernel,
            "attnres_key_norm": self.key_norm,
            "attnres_heads": self.heads,
            "attnres_sources": self.source_form.name,
            "attnres_values": q.values,
            "attnres_score_scale": q.score_scale,
            "attnres_read_queries": q.per_read(self.n_sublayers + 1),
            "attnres_routing": self.routing.name,
            "attnres_scale_norm_eps": self.scale_norm_eps,
            "norm_eps": self.eps,
            # the additive gain's form (per_channel under replacement routing); its init and learning rate only
            # start and train the gain, whose value the weights carry, so they are no setting (as impl is not).
            # attnres.residual.record reads a record without it as this default
            "attnres_gain": self.routing.gain,
        }

    def extra_repr(self) -> str:
        """The settings that make this scheme what it is, by their ``ModelConfig`` names: the shape, the
        depth blocks (Block AttnRes) and every option away from its default."""
        from attnres.residual.config import ResidualConfig

        defaults = {f.name: f.default for f in dataclasses.fields(ResidualConfig)}
        settings = self.settings()
        shown = {"d_model": self.d_model, "n_sublayers": self.n_sublayers}
        if self.block_size > 1 or self.scheme_name != "full":
            shown["attnres_block_sizes"] = list(self.block_sizes)
        for name, value in settings.items():
            if name in shown or name in ("attnres_blocks", "attnres_block_sizes"):
                continue
            if name == "attnres_read_queries" and max(value) == 1:
                continue
            if value != defaults.get(name, value):
                shown[name] = value
        if self.impl != defaults["attnres_impl"]:
            shown["attnres_impl"] = self.impl
        return ", ".join(f"{name}={value!r}" for name, value in shown.items())

    def lr_scales(self) -> dict[str, float]:
        """Parameter name (relative to this module) -> its learning-rate multiplier, where not 1
        (``attnres.residual.param_groups.lr_scales``; the trainer's optimizer honours it)."""
        return self.routing.lr_scales()

    @torch.no_grad()
    def gain_stats(self) -> dict[str, float]:
        """The additive gain now: ``gain_rms`` (RMS of g over reads and channels) and ``gain_shift_rms``
        (RMS of g minus its initial value: 0 until training moves it); {} without a learned gain."""
        return self.routing.gain_stats(self)

    def num_sources(self, l: int) -> int:
        """K_l: how many sources sublayer l (L = final aggregation) attends over."""
        complete, partial = self.plan[l]
        if self.window is not None:
            return 1 + min(self.window, complete - 1)
        return complete + int(partial)

    def prenorm_read_scale(self, l: int) -> float | None:
        """c, where at init (zero queries: uniform weights) read l returns c times the PreNorm residual
        sum: the kernel's uniform weight (1/K_l for softmax over K_l sources, 1/2 for sigmoid). None
        where no such c exists: with "states" sources (a mix of running sums), normalized values, or a
        window that leaves sources out. The routing has the last word: additive routing with
        zero-initialised gains reads the PreNorm sum itself at init (c = 1)."""
        complete, partial = self.plan[l]
        uniform = (
            self.source_form.sums_to_prenorm
            and self.query_form.uniform_at_init()
            and self.num_sources(l) == complete + int(partial)  # no source left out by a window
        )
        return self.routing.read_scale(self.kernel_form.uniform_weight(self.num_sources(l)) if uniform else None)

    def norm_eps_scale(self, l: int) -> float:
        """With ``attnres_scale_norm_eps``: c^2 (``prenorm_read_scale``). RMSNorm(c S) with eps c^2
        eps is RMSNorm(S) with eps (LayerNorm too), so a zero-query model computes the PreNorm
        function exactly."""
        c = self.prenorm_read_scale(l) if self.scale_norm_eps else None
        return 1.0 if c is None else c * c

    def stream_form(self, embedding: Tensor) -> type:
        """The stream class this scheme runs (``attnres_impl``, its variants, the compiler); an
        instance may override it to run a measuring form (``attnres.experiments.importance``)."""
        return stream_class(self, embedding)

    def _begin(self, embedding: Tensor) -> Stream:
        stream = self.stream_form(embedding)(self, [embedding])
        self.routing.begin(stream, embedding)
        return stream

    def _resume(self, history, state, cache=()):
        # the state: [partial block sum] if a block is open, then the routing's own (additive: h_std)
        own = len(state) - self.routing.state_size
        stream = self.stream_form(history[0])(self, history, state[0] if own else None, cache)
        self.routing.resume(stream, state[own:])
        return stream
