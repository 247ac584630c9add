"""Sequence-sharded prefill over P ranks (docs/method.md §6, memory-efficient prefill).

Rank r holds tokens [r T/P, (r+1) T/P) of every sequence. Everything but
self-attention is per token, so each rank runs its own shard through the
residual stream and keeps only its slice of the block representations:
N * (T/P) * d values per sequence instead of N * T * d. Self-attention needs
the keys and values of earlier positions; they are all-gathered from the
other ranks at each attention layer (the communication the paper folds into
its tensor-parallel reduce-scatter / all-gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from attnres.inference.cache import causal_attention
from attnres.residual import StreamObserver, observing


class ShardedAttention:
    """Attention context for one rank's shard (the interface the model's attention calls)."""

    def __init__(self, local_len: int, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.local_len = local_len
        self.position_offset = self.rank * local_len
        self.gathered_bytes = 0

    def positions(self, t: int) -> slice:
        """This rank's positions (the attention context interface the model reads them from)."""
        return slice(self.position_offset, self.position_offset + t)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, repeat: int) -> Tensor:
        keys = [torch.empty_like(k) for _ in range(self.world)]
        values = [torch.empty_like(v) for _ in range(self.world)]
        dist.all_gather(keys, k.contiguous(), group=self.group)
        dist.all_gather(values, v.contiguous(), group=self.group)
        self.gathered_bytes += 2 * sum(x.numel() * x.element_size() for x in keys)
        # later ranks' positions are masked anyway: use only the shards up to this one
        k_all = torch.cat(keys[: self.rank + 1], dim=2)
        v_all = torch.cat(values[: self.rank + 1], dim=2)
        if repeat > 1:
            k_all, v_all = k_all.repeat_interleave(repeat, dim=1), v_all.repeat_interleave(repeat, dim=1)
        return causal_attention(q, k_all, v_all, self.position_offset)

    def advance(self, t: int) -> None:
        pass


@torch.no_grad()
def sharded_prefill(model, input_ids: Tensor, group: dist.ProcessGroup | None = None):
    """Run the full sequence ``input_ids`` [B, T] sharded over the ranks of ``group``.

    Every rank passes the same ``input_ids``; T must be divisible by the world size.
    Returns (local logits [B, T/P, V] of this rank's positions, residual state bytes
    held by this rank's stream, i.e. its slice of the block representations).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, t = input_ids.shape
    if t % world:
        raise ValueError(
            f"sequence length {t} is not divisible by the {world} ranks; pad the prompt to a multiple of {world}"
        )
    local = t // world
    ctx = ShardedAttention(local, group)
    shard = input_ids[:, rank * local : (rank + 1) * local]
    with observing(model.residual, LastStream()) as last:
        logits = model(shard, cache=ctx)
    return logits, last.stream.state_bytes()


class LastStream(StreamObserver):
    """Remembers the last stream of a forward pass (the one that ran the final aggregation)."""

    stream = None

    def attach(self, stream) -> None:
        self.stream = stream
