"""Activation checkpointing at depth-block boundaries (or per sublayer).

Block AttnRes' structure says what to keep: between depth blocks the residual stream is the
embedding and the completed block representations b_0..b_n and nothing else (no partial sum: a
block boundary is where it is folded into b_{n+1}). ``"block"`` therefore runs each depth block
under ``torch.utils.checkpoint`` with exactly that as input: backward recomputes one depth block at a
time from the kept history, so the activations kept for backward grow with the number of depth
blocks N, not with the number of sublayers L.

The segments go through the depth state every scheme hands from block to block (``DepthState``,
the pipeline's hand-over too), so every scheme can be checkpointed; for schemes without depth
blocks (PreNorm and the rivals) "block" uses the boundaries Block AttnRes would have with its
default geometry. Segments are whole Transformer blocks: a depth block that ends inside a
Transformer block (odd S) joins the next segment. Full AttnRes (S = 1) keeps every source by definition:
"block" there is one
segment per Transformer block and its kept state still grows with L.

``"sublayer"`` recomputes the inside of each attention and MLP sublayer (norm included) and keeps
the stream's own tensors, the usual per-layer checkpointing: the Transformer blocks'
``gradient_checkpointing`` flag (transformers' name, set by ``gradient_checkpointing_enable()`` too),
which applies in training mode.

Recomputation repeats the forward's exact operations, so gradients equal the plain path's
(tested in float64).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from attnres.residual import DepthState

CHECKPOINTING = ("none", "block", "sublayer")


def check_checkpointing(mode: str) -> None:
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={mode!r} is invalid: choose one of {CHECKPOINTING}")


def segment_layers(config) -> list[range]:
    """The Transformer blocks of each checkpointed segment under "block": runs that end where a
    depth block ends and a Transformer block ends too (for schemes without depth blocks: where
    Block AttnRes' default blocks would end)."""
    from attnres.residual.attnres import block_sizes

    sizes = config.block_sizes  # [1] * L for Full AttnRes, [L] for schemes without depth blocks
    if len(sizes) == 1:
        sizes = block_sizes(config)  # Block AttnRes' default geometry (no Block option is set here)
    ends, at = [], 0
    for size in sizes:
        at += size
        if at % 2 == 0:  # a depth block ends between two Transformer blocks
            ends.append(at // 2)
    starts = [0] + ends[:-1]
    return [range(a, b) for a, b in zip(starts, ends, strict=True)]


def run_segments(depth, scheme, blocks: nn.ModuleList, segments: Sequence[range], cos, sin, attention=None):
    """Run the depth state (``attnres.residual.DepthState``) through ``blocks`` (all of the model's,
    by index), one checkpointed segment per entry of ``segments``; returns the state after the last
    block (``scheme.finish`` it).

    What crosses a segment boundary is the state's (history, state) pair; its derived tensors
    (``DepthState.cache``) are dropped there, so each segment recomputes them from what it is given
    and the checkpoint keeps nothing else from inside. ``attention``: the blocks' attention context
    (a padded batch's mask), as in ``run_blocks``."""
    history, state = depth.history, depth.state
    for seg in segments:
        n_hist = len(history)
        grown: list[int] = []  # how many sources the segment completed, set by its forward

        def run(*tensors, seg=seg, n_hist=n_hist, grown=grown):
            inner = DepthState(2 * seg.start, tensors[:n_hist], tensors[n_hist:])
            for i in seg:
                inner = blocks[i](inner, scheme, i, cos, sin, attention)
            grown[:] = [len(inner.history) - n_hist]  # the same on recomputation
            return (*inner.history[n_hist:], *inner.state)

        out = checkpoint(run, *history, *state, use_reentrant=False)
        history = tuple(history) + tuple(out[: grown[0]])
        state = tuple(out[grown[0] :])
    return DepthState(2 * segments[-1].stop, history, state)
