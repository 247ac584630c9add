"""Chunked prefill: a long prompt through the KV cache in fixed-size chunks.

Peak activation memory then scales with the chunk, not the prompt: for Block
AttnRes the block representations of a chunk are N * chunk * d values instead
of N * T * d (docs/method.md §6, "memory-efficient prefill").
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnres.inference.cache import KVCache


@torch.no_grad()
def chunked_prefill(
    model,
    input_ids: Tensor,
    cache: KVCache,
    chunk_size: int,
    *,
    all_logits: bool = False,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """Feed ``input_ids`` [B, T] through ``cache`` ``chunk_size`` tokens at a time.

    ``attention_mask`` [B, cache.length + T]: a padded batch (1 = token, 0 = padding), see
    ``AttnResLM.forward``.

    Returns the logits of the last position [B, V], or of every position [B, T, V]
    with ``all_logits`` (equal to one full forward pass, to rounding).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    outputs, cached = [], cache.length
    for start in range(0, input_ids.shape[1], chunk_size):
        end = min(start + chunk_size, input_ids.shape[1])
        mask = None if attention_mask is None else attention_mask[:, : cached + end]
        logits = model(input_ids[:, start:end], cache=cache, attention_mask=mask)
        outputs.append(logits if all_logits else logits[:, -1:])
    out = torch.cat(outputs, dim=1)
    return out if all_logits else out[:, -1]
