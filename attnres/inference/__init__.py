"""Inference: KV-cached decoding, chunked and sequence-sharded prefill, sampling."""

from attnres.inference.cache import (
    CACHE_KINDS,
    KVCache,
    StaticKVCache,
    causal_attention,
    make_cache,
)
from attnres.inference.compiled import CompiledDecoder
from attnres.inference.prefill import chunked_prefill
from attnres.inference.sampling import filter_logits, generate, stream_text
from attnres.inference.sharded import ShardedAttention, sharded_prefill

__all__ = [
    "CACHE_KINDS",
    "CompiledDecoder",
    "KVCache",
    "ShardedAttention",
    "StaticKVCache",
    "causal_attention",
    "chunked_prefill",
    "filter_logits",
    "generate",
    "make_cache",
    "sharded_prefill",
    "stream_text",
]
