"""The decoding cache of a Kimi Linear model: MLA's latent keys/values and KDA's recurrent states.

A Kimi Linear model has two kinds of attention with two kinds of state. An MLA layer attends to every
past position and caches its compressed latent (the normalised KV latent and the key part shared by
all heads): it grows by one entry per token. A KDA layer is recurrent: it keeps the last
``kda_conv_kernel`` inputs of its short causal convolution and one state matrix per head
[head_dim x head_dim], fixed in size however long the sequence.

The storage is transformers' own cache for this layer layout (``DynamicCache`` built from the
``KimiLinearConfig``: one attention layer per MLA block, one linear-attention layer per KDA block),
handed as is to transformers' sublayers, which read and update it themselves. ``HybridCache`` adds
what ``AttnResLM``, ``attnres.inference.sampling`` and the Hugging Face wrapper expect of a cache (the
interface of ``attnres.inference.KVCache``: positions, ``room``, ``advance``, ``reset``) and the
causal mask MLA needs when several new tokens follow cached ones (chunked prefill). As with
``KVCache``, no residual-stream state is kept: depth attention only mixes a token's own sources.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor


class HybridCache:
    """MLA keys/values plus KDA convolution and recurrent states, for one batch of sequences."""

    def __init__(self, hf_config, batch_size: int, max_len: int):
        from transformers import DynamicCache

        self.hf_config, self.batch_size, self.max_len = hf_config, batch_size, max_len
        self.layers = DynamicCache(config=hf_config)
        self.length = 0  # positions already cached

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None) -> HybridCache:
        from attnres.model.kimi_linear import kimi_linear_config

        return cls(kimi_linear_config(model.config), batch_size, max_len or model.config.max_seq_len)

    def positions(self, t: int) -> slice:
        """The absolute positions of the next t tokens (what the model reads them from)."""
        return slice(self.length, self.length + t)

    def room(self) -> int:
        return self.max_len - self.length

    def layer_cache(self, t: int):
        """transformers' cache object, for a sublayer about to store ``t`` more positions."""
        if self.length + t > self.max_len:
            raise ValueError(
                f"hybrid cache holds {self.length} of {self.max_len} positions; {t} more do not fit. "
                "Fix: a larger max_len (at most ModelConfig.max_seq_len), or a new cache"
            )
        return self.layers

    def attention_mask(self, t: int, device=None) -> Tensor | None:
        """MLA's mask for ``t`` new queries after the cached positions: None where SDPA's own causal
        rule (no cache yet) or no mask at all (a single new token sees everything) is right; else
        query i may see keys 0 .. length + i."""
        if self.length == 0 or t == 1:
            return None
        keys = torch.arange(self.length + t, device=device)
        return keys[None, :] <= (self.length + torch.arange(t, device=device))[:, None]

    def advance(self, t: int) -> None:
        """Called by the model once all layers have stored the step's t positions."""
        self.length += t

    def reset(self) -> None:
        from transformers import DynamicCache

        self.layers = DynamicCache(config=self.hf_config)
        self.length = 0

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Keep, for each row, the state of row ``beam_idx[row]`` (beam search re-ranks its beams after
        every step): MLA latents and KDA convolution and recurrent states alike, by transformers' own
        per-layer reorder."""
        # transformers annotates the index torch.LongTensor, a type no tensor has at run time
        self.layers.reorder_cache(cast(torch.LongTensor, beam_idx))

    def get_seq_length(self, layer: int = 0) -> int:
        """Cached positions (the name transformers' generate() asks a cache for)."""
        return self.length

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers.layers:
            tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
            tensors += list(getattr(layer, "conv_states", {}).values())
            tensors += list(getattr(layer, "recurrent_states", {}).values())
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))
        return total
