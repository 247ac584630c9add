"""Inkling-2's depth attention (transformers' ``Inkling2BlockAttentionResidual``) is
``multi_query_depth_attention`` with an unweighted key norm, scale D^-1/2 and normalised values:
checked against transformers' own module, one query (every sublayer) and three (the q, k and v inputs
of a full-attention layer), with random non-zero queries, in float32."""

import pytest
import torch

from attnres.ops import multi_query_depth_attention

inkling2 = pytest.importorskip(
    "transformers.models.inkling2.modeling_inkling2",
    reason="this transformers does not ship Inkling-2 (transformers.models.inkling2)",
)


def inkling2_read(d: int, num_queries: int, seed: int):
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    config = Inkling2TextConfig(hidden_size=d)
    config._attn_implementation = "eager"
    module = inkling2.Inkling2BlockAttentionResidual(config, num_queries=num_queries)
    with torch.no_grad():
        module.query.copy_(torch.randn(module.query.shape, generator=torch.Generator().manual_seed(seed)))
    return module.eval()


@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("sealed", [1, 4])
def test_inkling2_block_attention_residual(num_queries, sealed):
    d, b, t = 32, 2, 5
    module = inkling2_read(d, num_queries, seed=num_queries)
    g = torch.Generator().manual_seed(10 + sealed)
    block_states = torch.randn(b, t, sealed, d, generator=g) * 3 + 0.5  # completed blocks [B, T, N, D]
    partial = torch.randn(b, t, d, generator=g) * 2  # the running block sum [B, T, D]
    with torch.no_grad():
        want = module(block_states, partial)  # one [B, T, D] per query

    sources = torch.cat([block_states, partial.unsqueeze(-2)], dim=-2).movedim(-2, 0)  # [K, B, T, D]
    queries = module.query.detach().reshape(num_queries, d)
    # transformers 5.25 renamed the norm's eps to variance_epsilon; both are supported (hf extra: <6)
    eps = getattr(module.norm, "variance_epsilon", None) or module.norm.eps
    h = multi_query_depth_attention(sources, queries, None, eps=eps, scale=d**-0.5, values="normalized")
    assert h.shape == (num_queries, b, t, d) and len(want) == num_queries
    diff = max((h[q] - want[q]).abs().max().item() for q in range(num_queries))
    assert diff <= 1e-6, f"max difference {diff:.3g} from Inkling2BlockAttentionResidual"
