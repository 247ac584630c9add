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

import dataclasses
import math
from collections.abc import Sequence

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


def routing_gain_stats(model: nn.Module) -> dict[str, float]:
    """The learned additive gain of ``model``'s AttnRes scheme, for the trainer's metric rows and the
    experiment probes: ``gain_rms`` and ``gain_shift_rms`` (``DepthAttentionResidual.gain_stats``); {}
    where the model has no learned gain."""
    for module in model.modules():
        if isinstance(module, DepthAttentionResidual):
            return module.gain_stats()
    return {}


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
