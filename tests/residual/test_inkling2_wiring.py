"""Inkling-2's residual wiring, reproduced by Block AttnRes with its variant options: transformers' own
decoder layers (``Inkling2SlidingDecoderLayer`` / ``Inkling2FullDecoderLayer``) and its model loop bank the
layer input at every block boundary and read depth mixtures with ``Inkling2BlockAttentionResidual``; the
same layers' sublayers, replaced by small stand-ins, run through our stream built with
``values="normalized"``, ``score_scale=d ** -0.5`` and three queries before each full-attention layer
(one each for its q, k and v inputs). The two agree in float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnres.residual import BlockAttnRes

modeling = pytest.importorskip(
    "transformers.models.inkling2.modeling_inkling2",
    reason="this transformers does not ship Inkling-2 (transformers.models.inkling2)",
)

D, LAYERS, PER_BLOCK = 16, 6, 2
TYPES = ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"]


class StandInAttention(nn.Module):
    """Takes the place of Inkling-2's attention: a function of its (q, k, v) inputs."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(3, D, D, generator=g) / D**0.5)

    def forward(self, hidden_states, key_hidden_states=None, value_hidden_states=None, **kwargs):
        k = hidden_states if key_hidden_states is None else key_hidden_states
        v = hidden_states if value_hidden_states is None else value_hidden_states
        out = torch.tanh(hidden_states @ self.w[0]) * torch.sigmoid(k @ self.w[1]) + v @ self.w[2]
        return out, None


class StandIn(nn.Module):
    """Takes the place of the MoE MLP (and, as the identity, of the short convolutions)."""

    def __init__(self, seed: int | None):
        super().__init__()
        self.w = (
            None
            if seed is None
            else nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(seed)) / D**0.5)
        )

    def forward(self, hidden_states, **kwargs):
        return hidden_states if self.w is None else torch.tanh(hidden_states @ self.w) * 1.5


def inkling2_layers():
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    config = Inkling2TextConfig(
        hidden_size=D,
        num_hidden_layers=LAYERS,
        layer_types=TYPES,
        n_layers_per_attn_res_block=PER_BLOCK,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        swa_num_attention_heads=2,
        swa_num_key_value_heads=1,
        swa_head_dim=8,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        d_rel=4,
        rel_extent=8,
        sliding_window_size=8,
    )
    config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(0)
    layers = []
    for i, kind in enumerate(TYPES):
        cls = modeling.Inkling2FullDecoderLayer if kind == "hybrid" else modeling.Inkling2SlidingDecoderLayer
        layer = cls(config, i)
        layer.self_attn, layer.mlp = StandInAttention(10 + i), StandIn(20 + i)
        layer.post_attention_convolution = layer.post_mlp_convolution = StandIn(None)
        for read in (layer.attention_input, layer.mlp_input):
            if read is not None:
                with torch.no_grad():
                    read.query.copy_(torch.randn(read.query.shape, generator=g))
        layers.append(layer.eval())
    final = modeling.Inkling2BlockAttentionResidual(config)
    with torch.no_grad():
        final.query.copy_(torch.randn(final.query.shape, generator=g))
    return layers, final


def inkling2_forward(layers, final, x):
    """transformers' Inkling2TextModel loop: bank the layer input at each block boundary, read at the end."""
    hidden, banked = x, x.new_zeros(*x.shape[:-1], 0, x.shape[-1])
    for layer in layers:
        out = layer(hidden, banked)
        if layer.is_block_boundary:
            banked = torch.cat([banked, hidden.unsqueeze(-2)], dim=-2)
        hidden = out
    return final(banked, hidden)[0]


def our_scheme(layers, final) -> BlockAttnRes:
    reads = [q for kind in TYPES for q in ((3 if kind == "hybrid" else 1), 1)] + [1]
    scheme = BlockAttnRes(
        D,
        2 * LAYERS,
        attnres_block_size=2 * PER_BLOCK,
        attnres_values="normalized",
        attnres_score_scale=D**-0.5,
        attnres_read_queries=reads,
    )
    with torch.no_grad():
        for i, layer in enumerate(layers):
            if layer.attention_input is not None:  # layer 0 reads the embedding alone: no read, no query
                q = layer.attention_input.query.reshape(-1, D)
                scheme.queries[2 * i].copy_(q[0])
                if len(q) > 1:
                    scheme.extra_queries[
                        scheme.query_form.extra_start[2 * i] : scheme.query_form.extra_start[2 * i] + 2
                    ].copy_(q[1:])
            scheme.queries[2 * i + 1].copy_(layer.mlp_input.query)
        scheme.queries[2 * LAYERS].copy_(final.query)
    return scheme


def our_forward(scheme, layers, x):
    depth = scheme.start(x)
    for layer in layers:
        stream = scheme.stream(depth)
        h = stream.read()
        if h.dim() == 4:  # three mixtures: the inputs of q, k and v
            q, k, v = h
            a = layer.self_attn(
                layer.q_input_layernorm(q),
                key_hidden_states=layer.k_input_layernorm(k),
                value_hidden_states=layer.v_input_layernorm(v),
            )[0]
        else:
            norm = layer.input_layernorm if hasattr(layer, "input_layernorm") else layer.q_input_layernorm
            a = layer.self_attn(norm(h))[0]
        stream.write(None, a)
        stream.apply(lambda h, layer=layer: layer.mlp(layer.post_attention_layernorm(h)))
        depth = stream.depth()
    return scheme.finish(depth)


def test_block_attnres_with_inkling2_options_computes_inkling2s_wiring():
    layers, final = inkling2_layers()
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)) * 2
    with torch.no_grad():
        want = inkling2_forward(layers, final, x)
        got = our_forward(our_scheme(layers, final), layers, x)
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"max difference {diff:.3g} from transformers' Inkling-2 wiring"
    # the options are what make it Inkling-2: the paper's raw-value read differs
    with torch.no_grad():
        plain = BlockAttnRes(D, 2 * LAYERS, attnres_block_size=2 * PER_BLOCK)
        plain.queries.copy_(our_scheme(layers, final).queries)
        assert (our_forward_plain(plain, layers, x) - want).abs().max() > 1e-3


def our_forward_plain(scheme, layers, x):
    """The same stand-ins through the paper's read (one query: q = k = v input)."""
    depth = scheme.start(x)
    for layer in layers:
        stream = scheme.stream(depth)
        norm = layer.input_layernorm if hasattr(layer, "input_layernorm") else layer.q_input_layernorm
        stream.apply(lambda h, layer=layer, norm=norm: layer.self_attn(norm(h))[0])
        stream.apply(lambda h, layer=layer: layer.mlp(layer.post_attention_layernorm(h)))
        depth = stream.depth()
    return scheme.finish(depth)


def test_read_queries_are_checked():
    with pytest.raises(ValueError, match="attnres_read_queries"):
        BlockAttnRes(D, 4, attnres_block_size=2, attnres_read_queries=[3, 1, 1])
    with pytest.raises(ValueError, match="attnres_values.*pseudo_query"):
        BlockAttnRes(D, 4, attnres_block_size=2, attnres_values="normalized", attnres_weights="scalar")
