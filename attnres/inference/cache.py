"""Key/value cache for incremental decoding.

Only self-attention looks at past positions. Depth attention (every residual
scheme here) mixes a token's own sublayer outputs, so the block
representations, Full AttnRes' per-sublayer sources and the streams of
multi-stream schemes of past tokens are never needed again: a decoding step
rebuilds them for the new token alone. The cache therefore holds keys and
values, nothing else; its size is the usual 2 * n_layers * n_kv_heads *
head_dim * T values per sequence, for every residual scheme.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_attention(q: Tensor, k: Tensor, v: Tensor, offset: int, mask: Tensor | None = None) -> Tensor:
    """Attention of t queries at absolute positions offset..offset+t-1 over keys 0..offset+t-1.

    q [B, H, t, hd], k/v [B, H, offset + t, hd] (heads already repeated for GQA). ``mask``: the
    allowed (query, key) pairs [B, 1, t, offset + t] of a padded batch (causality included, see
    ``attnres.model.llama.padding_mask``); it replaces the plain causal mask.
    """
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    t, s = q.shape[2], k.shape[2]
    if offset == 0 and t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v)  # the newest token sees everything
    allowed = torch.arange(s, device=q.device)[None, :] <= (offset + torch.arange(t, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class KVCache:
    """Preallocated keys and values of every attention layer, for one batch of sequences."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        self._allocate(n_layers, (batch_size, n_kv_heads, max_len, head_dim), dtype, device)
        self.length = 0  # positions already cached

    def _allocate(self, n_layers: int, shape: tuple, dtype: torch.dtype, device) -> None:
        self.keys: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = shape[2]

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None) -> KVCache:
        c = model.config
        p = next(model.parameters())
        return cls(
            c.n_layers, batch_size, c.n_kv_heads, c.head_dim, max_len or c.max_seq_len, dtype=p.dtype, device=p.device
        )

    def positions(self, t: int) -> slice | Tensor:
        """The absolute positions of the next t tokens: a slice here (StaticKVCache's are a tensor)."""
        return slice(self.length, self.length + t)

    def room(self) -> int:
        return self.max_len - self.length

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, repeat: int, mask: Tensor | None = None) -> Tensor:
        """Store this step's keys/values of ``layer`` and attend over everything cached so far
        (``mask``: a padded batch's allowed pairs, see :func:`causal_attention`)."""
        t = k.shape[2]
        if self.length + t > self.max_len:
            raise ValueError(
                f"KV cache holds {self.length} of {self.max_len} positions; {t} more do not fit. "
                "Fix: a larger max_len (at most ModelConfig.max_seq_len), or a new cache"
            )
        end = self.length + t
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        keys, values = self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        if repeat > 1:
            keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        return causal_attention(q, keys, values, self.length, mask)

    def advance(self, t: int) -> None:
        """Called by the model once all layers have stored the step's t positions."""
        self.length += t

    def reset(self) -> None:
        self.length = 0

    def get_seq_length(self, layer: int = 0) -> int:
        """Cached positions (the name transformers' generate() asks a cache for)."""
        return self.length

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Keep, for each row, the cached keys/values of row ``beam_idx[row]`` (the call
        transformers' beam search makes after each step, when beams are re-ranked)."""
        for layer in range(len(self.keys)):
            index = beam_idx.to(self.keys[layer].device)
            self.keys[layer] = self.keys[layer].index_select(0, index)
            self.values[layer] = self.values[layer].index_select(0, index)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.keys + self.values)


class StaticKVCache(KVCache):
    """A KV cache whose every shape is fixed and whose position is a tensor: what a compiled decoding
    step needs in order to compile once (``attnres.inference.compiled``).

    ``KVCache`` slices its buffers by a Python int (the cached length), which a compiled step would
    specialise on and recompile for at every token. Here a step writes its keys and values at
    ``position + arange(t)`` (``index_copy_``) and attends over all ``max_len`` slots with a mask
    that lets query position p see slots 0..p; the position is a 0-d int64 tensor advanced in place.
    Masked slots weigh exactly zero, so the result is the sliced attention's up to rounding order.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        self._allocate(n_layers, (batch_size, n_kv_heads, max_len, head_dim), dtype, device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)

    @property
    def length(self) -> int:
        """Cached positions, read on the host (a device sync: for the caller, not the compiled step)."""
        return int(self.position)

    @length.setter
    def length(self, value: int) -> None:
        self.position.fill_(value)

    def positions(self, t: int) -> Tensor:
        return self.position + self.slots[:t]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, repeat: int, mask: Tensor | None = None) -> Tensor:
        """Store this step's keys/values of ``layer`` at their positions and attend over the cache.
        No bounds check here (it would read the position on the host): callers check ``room()``.
        Unpadded batches only: a ``mask`` (a padded batch's allowed pairs) is refused."""
        if mask is not None:
            raise ValueError("StaticKVCache decodes unpadded batches; a padded batch needs a KVCache")
        at = self.positions(k.shape[2])
        self.keys[layer].index_copy_(2, at, k)
        self.values[layer].index_copy_(2, at, v)
        keys, values = self.keys[layer], self.values[layer]
        if repeat > 1:
            keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        visible = self.slots[None, :] <= at[:, None]  # [t, max_len]: causal over the written slots
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)

    def advance(self, t: int) -> None:
        self.position.add_(t)

    def reset(self) -> None:
        self.position.zero_()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """As ``KVCache.reorder_cache``, but in place: a compiled step holds these very buffers, and
        new tensor objects would make it recompile."""
        for layer in range(len(self.keys)):
            index = beam_idx.to(self.keys[layer].device)
            self.keys[layer].copy_(self.keys[layer].index_select(0, index))
            self.values[layer].copy_(self.values[layer].index_select(0, index))


def _hybrid_cache(model, batch_size: int, max_len: int | None = None):
    from attnres.inference.hybrid_cache import HybridCache  # needs transformers

    return HybridCache.for_model(model, batch_size, max_len)


# the caches a backbone can name (``attnres.model.backbones.BackboneInfo.cache``)
CACHE_KINDS = {"kv": KVCache.for_model, "hybrid": _hybrid_cache}


def make_cache(model, batch_size: int, max_len: int | None = None):
    """An empty decoding cache for ``model`` (an ``AttnResLM``): the kind its backbone names, for
    ``batch_size`` sequences of up to ``max_len`` positions (default ``max_seq_len``)."""
    from attnres.model.backbones import BACKBONES

    return CACHE_KINDS[BACKBONES[model.config.backbone].cache](model, batch_size, max_len)
