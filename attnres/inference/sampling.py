"""Text generation: temperature, top-k and top-p (nucleus) sampling with a seed.

Decoding runs through the cache of the model's backbone (``make_cache``: a ``KVCache``,
or Kimi Linear's ``HybridCache``): the prompt is
prefilled once and each new token costs one single-position forward pass. Once
the sequence reaches ``max_seq_len`` the model sees the last ``max_seq_len``
tokens, exactly as the uncached path (``use_cache=False``) does: each further
step re-prefills that window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from attnres.inference.cache import make_cache
from attnres.inference.compiled import CompiledDecoder


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
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


def check_sampling(
    max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> None:
    """The sampling options, checked before anything is generated (or printed): a ValueError naming
    the option, its value and what is valid. None for top_k / top_p means no filtering."""

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a non-negative integer")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(f"temperature={temperature!r} is invalid: must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} is invalid: must be a positive integer (or unset for no top-k)")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} is invalid: must be in (0, 1] (or unset for no nucleus filter)")


def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    compile: bool | str = False,
) -> Iterator[int]:
    """Yield new token ids one at a time (batch of one). temperature 0 = greedy. The arguments are
    checked when it is called, before the first token is asked for. ``compile``: decode with a
    compiled step over a static KV cache (``attnres.inference.compiled``; True: inductor, or a
    torch.compile backend name); the first tokens wait for the compilation."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"generate takes one prompt [1, T]; got shape {tuple(input_ids.shape)}")
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if compile and not use_cache:
        raise ValueError("compile=True decodes through a static KV cache: drop use_cache=False")
    return _generate(
        model,
        input_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        use_cache=use_cache,
        compile=compile,
    )


@torch.no_grad()
def _generate(
    model, input_ids, max_new_tokens, *, temperature, top_k, top_p, seed, use_cache, compile
) -> Iterator[int]:
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    ids = input_ids.to(device)
    limit = model.config.max_seq_len
    # the positions this call can reach, not max_seq_len's (a long-context model's would be gigabytes)
    room = min(limit, ids.shape[1] + max_new_tokens)
    cache = None
    step: Callable[[torch.Tensor], torch.Tensor]
    if compile:
        step = CompiledDecoder(model, 1, room, setting=compile)
        cache = step.cache
    elif use_cache:
        cache = make_cache(model, 1, room)
        step = lambda tokens: model(tokens, cache=cache)  # noqa: E731
    pending = ids[:, -limit:]  # tokens the model has not seen yet
    for position in range(max_new_tokens):
        if cache is None:
            logits = model(ids[:, -limit:])[:, -1]
        else:
            if cache.room() < pending.shape[1]:  # full: slide the window, as the uncached path does
                cache.reset()
                pending = ids[:, -limit:]
            logits = step(pending)[:, -1]
        logits = logits.float()
        if not torch.isfinite(logits).all():
            raise ValueError(
                f"the model's logits are not finite at new token {position}: its weights are "
                "broken (a diverged checkpoint?); sample from another checkpoint"
            )
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            # shifted so the largest is 0 before dividing: a tiny temperature then sends the others
            # to -inf instead of overflowing every logit to inf (and softmax to NaN)
            scaled = (logits - logits.max(-1, keepdim=True).values) / temperature
            probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
        pending = nxt
        yield int(nxt.item())


def stream_text(
    model, tokenizer, prompt: str, max_new_tokens: int, *, stop: str | None = None, **sampling
) -> Iterator[str]:
    """Generate from a text prompt and yield the new text piece by piece as it decodes (a character
    split over several tokens appears once complete). With ``stop``, the text ends right after its
    first occurrence. ``sampling``: temperature, top_k, top_p, seed (see :func:`generate`). The
    prompt and the options are checked when it is called, before anything is yielded."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    return _stream_text(tokenizer, generate(model, torch.tensor([ids]), max_new_tokens, **sampling), stop)


def _stream_text(tokenizer, tokens: Iterator[int], stop: str | None) -> Iterator[str]:
    new_ids, text = [], ""
    for token in tokens:
        new_ids.append(token)
        decoded = tokenizer.decode(new_ids)
        if stop and stop in decoded:
            yield decoded[len(text) : decoded.index(stop) + len(stop)]
            return
        yield decoded[len(text) :]
        text = decoded
