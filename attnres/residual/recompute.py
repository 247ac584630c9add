"""Activation checkpointing of a block that takes and returns a ``DepthState`` (docs/own_model.md).

torch's non-reentrant checkpoint (``use_reentrant=False``, ``checkpoint_wrapper``'s default) walks the
arguments with pytree and so sees every tensor of a ``DepthState``. The reentrant one (torch's default
when ``use_reentrant`` is not given) is an ``autograd.Function``: it differentiates only the tensors
passed as arguments themselves and returns a plain tuple, so a ``DepthState`` would lose its type and
its gradients. ``checkpoint_block`` passes the state's tensors one by one there and builds the state
again on both sides, so either form recomputes the block in backward with the gradients of no
checkpoint. The reentrant form also saves its inputs as they are, so there the state crosses without
its cache (``DepthState.cache``, which later blocks extend in place) and the block derives its own;
the non-reentrant form is torch's own call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint
from torch import Tensor

from attnres.residual.base import DepthState, not_a_depth_state

Layout = tuple[int, int, int, int]  # at, and how many tensors of history, state and cache


def _layout(depth: DepthState) -> Layout:
    return depth.at, len(depth.history), len(depth.state), len(depth.cache)


def _tensors(depth: DepthState) -> tuple[Tensor, ...]:
    return (*depth.history, *depth.state, *depth.cache)


def _rebuilt(layout: Layout, tensors: tuple[Tensor, ...]) -> DepthState:
    at, n_history, n_state, n_cache = layout
    state_end = n_history + n_state
    history, state = tuple(tensors[:n_history]), tuple(tensors[n_history:state_end])
    return DepthState(at, history, state, tuple(tensors[state_end : state_end + n_cache]))


def _returned(out: Any) -> DepthState:
    if not isinstance(out, DepthState):
        raise TypeError(
            f"checkpoint_block: the block returned a {type(out).__name__}, not a DepthState; end its forward "
            "with `return stream.depth()`"
        )
    return out


def checkpoint_block(
    block: Callable[..., DepthState], depth: DepthState, *args: Any, use_reentrant: bool = False, **kwargs: Any
) -> DepthState:
    """``block(depth, *args, **kwargs)``, its activations recomputed in backward instead of kept.

    ``use_reentrant``: which of torch's two checkpoint forms runs (``torch.utils.checkpoint.checkpoint``;
    by default False, the one torch recommends); both give the gradients of the block run plainly.
    ``args``: the block's other arguments (the residual scheme, a mask). Keywords go to the block and to
    the checkpoint as torch's ``checkpoint`` sends them; the reentrant form takes ``preserve_rng_state``
    only, so pass the block's own arguments positionally there (and only tensors among them receive
    gradients, as for any reentrant checkpoint). As ``checkpoint_wrapper(block,
    checkpoint_fn=attnres.checkpoint_block, use_reentrant=True)`` it wraps a block module."""
    if not isinstance(depth, DepthState):
        raise TypeError(not_a_depth_state(depth, "checkpoint_block(block, depth, ...)"))
    if not use_reentrant:  # pytree carries the state, and its cache is no saved input there
        return _returned(torch.utils.checkpoint.checkpoint(block, depth, *args, use_reentrant=False, **kwargs))
    unknown = sorted(kwargs.keys() - {"preserve_rng_state"})
    if unknown:
        raise ValueError(
            f"checkpoint_block(use_reentrant=True) got the keyword(s) {unknown}; the reentrant checkpoint passes "
            "positional arguments only: pass them positionally or use_reentrant=False"
        )
    depth = depth._replace(cache=())  # saved as an input, then written in place by the blocks after
    layout = _layout(depth)
    n = sum(layout[1:])
    returned: list[Layout] = []  # the output's layout; forward and recompute agree on it

    def run(*flat: Any) -> tuple[Tensor, ...]:
        out = _returned(block(_rebuilt(layout, flat[:n]), *flat[n:]))._replace(cache=())
        returned[:] = [_layout(out)]
        return _tensors(out)

    flat = torch.utils.checkpoint.checkpoint(run, *_tensors(depth), *args, use_reentrant=True, **kwargs)
    return _rebuilt(returned[0], tuple(flat))
