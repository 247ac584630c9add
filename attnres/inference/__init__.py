"""Inference: KV-cached decoding, chunked and sequence-sharded prefill."""
from attnres.inference.cache import KVCache, causal_attention
from attnres.inference.prefill import chunked_prefill
from attnres.inference.sharded import ShardedAttention, sharded_prefill

__all__ = ["KVCache", "ShardedAttention", "causal_attention", "chunked_prefill", "sharded_prefill"]
