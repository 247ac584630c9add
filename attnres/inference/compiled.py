"""Compiled decoding: one compiled forward over a static KV cache, compiled once per input shape.

The eager decoding step runs some hundred small ops per sublayer (projections, RoPE, attention,
and the residual stream's depth attention), each a separate PyTorch call; at batch 1 their call
overhead is most of the step. Compiled, the step is a handful of fused loops. A compiled step
must not see anything that changes per token as a Python value, or dynamo recompiles at every
token: ``StaticKVCache`` keeps every shape fixed and the position in a tensor, so the step
compiles once for the prompt's shape (prefill) and once for one token, and never again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnres.inference.cache import StaticKVCache
from attnres.model.compile import check_compiler, compile_backend


def check_static_cache(config, who: str) -> None:
    """A one-line error unless the backbone's decoding state is a KV cache, which ``StaticKVCache``
    holds (Kimi Linear's recurrent KDA state is not)."""
    from attnres.model.backbones import BACKBONES

    if BACKBONES[config.backbone].cache != "kv":
        raise ValueError(
            f"{who}: backbone={config.backbone!r} keeps recurrent state that the static KV cache "
            "does not hold; decode it eager (compile off)"
        )


class CompiledDecoder:
    """``model`` (an AttnResLM) behind a static KV cache for ``batch_size`` sequences, its forward
    compiled with ``setting`` (True: inductor, or a backend name).

    ``decoder(ids)`` runs the tokens ``ids`` [B, t] after the cached ones and returns their logits,
    as ``model(ids, cache=cache)`` does. ``room()`` and ``reset()`` as on the cache.
    """

    def __init__(self, model, batch_size: int, max_len: int | None = None, setting: bool | str = True):
        check_static_cache(model.config, "compiled decoding")
        check_compiler(setting, next(model.parameters()).device, "compile")
        self.model = model
        self.cache = StaticKVCache.for_model(model, batch_size, max_len)
        model.rope(self.cache.max_len)  # grown now, not in a traced step, which would then compile again
        # dynamic=False: one graph per shape (prefill, one token) rather than a symbolic-shape graph
        self._step = torch.compile(self._forward, backend=compile_backend(setting) or "inductor", dynamic=False)

    def _forward(self, ids: Tensor) -> Tensor:
        return self.model(ids, cache=self.cache)

    def __call__(self, ids: Tensor) -> Tensor:
        if ids.shape[1] > self.room():
            raise ValueError(
                f"the static KV cache has room for {self.room()} of {self.cache.max_len} positions; "
                f"{ids.shape[1]} more do not fit. Fix: reset() it, or a larger max_len"
            )
        # a fresh contiguous copy: dynamo guards on strides too, and a token sliced out of a larger
        # tensor ([B, 1] with stride T) would otherwise recompile the step (a few bytes per token)
        return self._step(ids.clone(memory_format=torch.contiguous_format))

    @property
    def length(self) -> int:
        return self.cache.length

    def get_seq_length(self, layer: int = 0) -> int:
        """Cached positions (the name transformers' generate() asks a cache for)."""
        return self.cache.length

    def room(self) -> int:
        return self.cache.room()

    def reset(self) -> None:
        self.cache.reset()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.cache.reorder_cache(beam_idx)
