"""Text generation: temperature, top-k and top-p (nucleus) sampling with a seed.

Decoding runs through the model's cache (``model.make_cache``: a ``KVCache``, or
Kimi Linear's ``HybridCache``): the prompt is
prefilled once and each new token costs one single-position forward pass. Once
the sequence reaches ``max_seq_len`` the model sees the last ``max_seq_len``
tokens, exactly as the uncached path (``use_cache=False``) does: each further
step re-prefills that window.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch



def filter_logits(logits: torch.Tensor, top_k: Optional[int] = None,
                  top_p: Optional[float] = None) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and outside the smallest set whose mass >= top_p."""
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             seed: Optional[int] = None, use_cache: bool = True) -> Iterator[int]:
    """Yield new token ids one at a time (batch of one). temperature 0 = greedy."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"generate takes one prompt [1, T]; got shape {tuple(input_ids.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    ids = input_ids.to(device)
    limit = model.config.max_seq_len
    cache = model.make_cache(1) if use_cache else None
    pending = ids[:, -limit:]  # tokens the model has not seen yet
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(ids[:, -limit:])[:, -1]
        else:
            if cache.room() < pending.shape[1]:  # full: slide the window, as the uncached path does
                cache.reset()
                pending = ids[:, -limit:]
            logits = model(pending, cache=cache)[:, -1]
        logits = logits.float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
        pending = nxt
        yield int(nxt.item())


def stream_text(model, tokenizer, prompt: str, max_new_tokens: int, *, stop: Optional[str] = None,
                **sampling) -> Iterator[str]:
    """Generate from a text prompt and yield the new text piece by piece as it decodes (a character
    split over several tokens appears once complete). With ``stop``, the text ends right after its
    first occurrence. ``sampling``: temperature, top_k, top_p, seed (see :func:`generate`)."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    new_ids, text = [], ""
    for token in generate(model, torch.tensor([ids]), max_new_tokens, **sampling):
        new_ids.append(token)
        decoded = tokenizer.decode(new_ids)
        if stop and stop in decoded:
            yield decoded[len(text):decoded.index(stop) + len(stop)]
            return
        yield decoded[len(text):]
        text = decoded
