"""Kimi Linear's layout from a config: which attention each layer has, which layers are mixtures of
experts, and the sizes with their defaults filled in. Plain arithmetic on the config, below both the
backbone registry (``attnres.model.backbones``) and the blocks (``attnres.model.kimi_linear``)."""

from __future__ import annotations

import math

KDA, MLA = "K", "M"


def layer_kinds(config) -> list[str]:
    """Per Transformer block, its attention: "K" (KDA) or "M" (MLA); the pattern repeats over layers."""
    pattern = config.kimi_layer_pattern
    return [pattern[i % len(pattern)] for i in range(config.n_layers)]


def moe_layers(config) -> list[bool]:
    """Per Transformer block, whether its MLP is the mixture of experts: after the dense first layers,
    every ``moe_layer_freq``-th one (index divisible by it; K3's rule, 1: all of them)."""
    freq = config.moe_layer_freq
    return [config.moe_experts > 0 and i >= config.moe_dense_layers and i % freq == 0 for i in range(config.n_layers)]


def kimi_sizes(config) -> dict[str, int]:
    """The Kimi Linear sizes with their defaults filled in: head width hd = d_model // n_heads for KDA
    heads, MLA's per-head query/key part (``mla_qk_nope_dim``) and value; half of it for the key part
    shared by all heads (``mla_qk_rope_dim``); d_model // 2 for the latent KV rank; expert width
    ceil(d_ff / (top_k + shared experts)), so routed plus shared experts match the dense MLP's width
    (Kimi Linear: 8 + 1 experts of 1024 = 9216)."""
    hd = max(1, config.d_model // config.n_heads)
    routed_and_shared = config.moe_top_k + config.moe_shared_experts
    given = {
        "kda_heads": config.kda_heads,
        "kda_head_dim": config.kda_head_dim,
        "mla_kv_rank": config.mla_kv_rank,
        "mla_qk_nope_dim": config.mla_qk_nope_dim,
        "mla_qk_rope_dim": config.mla_qk_rope_dim,
        "mla_v_dim": config.mla_v_dim,
        "moe_d_ff": config.moe_d_ff,
    }
    defaults = {
        "kda_heads": config.n_heads,
        "kda_head_dim": hd,
        "mla_kv_rank": max(1, config.d_model // 2),
        "mla_qk_nope_dim": hd,
        "mla_qk_rope_dim": max(1, hd // 2),
        "mla_v_dim": hd,
        "moe_d_ff": math.ceil(config.d_ff / routed_and_shared),
    }
    return {k: defaults[k] if v is None else v for k, v in given.items()}
