"""Wrong arguments at the public depth-attention ops fail at once, naming the argument, what was found
and what was expected (instead of broadcasting silently or failing deep inside)."""

import re

import pytest
import torch

from attnres.ops import (
    depth_attention,
    depth_attention_reference,
    multi_query_depth_attention,
)

K, B, T, D = 4, 2, 3, 8


def make_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(K, B, T, D, generator=g, dtype=dtype),
        torch.randn(D, generator=g, dtype=dtype),
        torch.rand(D, generator=g, dtype=dtype) + 0.5,
    )


OPS = {
    "fused": lambda s, q, w: depth_attention(s, q, w),
    "weights": lambda s, q, w: depth_attention(s, q, w, return_weights=True),
    "reference": lambda s, q, w: depth_attention_reference(s, q, w),
}


@pytest.mark.parametrize("op", OPS)
def test_sources(op):
    sources, query, w = make_inputs()
    attend = OPS[op]
    with pytest.raises(TypeError, match=re.escape("got a list of 4 items: pass torch.stack(sources)")):
        attend(list(sources.unbind(0)), query, w)
    with pytest.raises(TypeError, match="got a tuple of 4 items"):
        attend(tuple(sources.unbind(0)), query, w)
    with pytest.raises(TypeError, match="sources must be a tensor .K, B, T, D.; got ndarray"):
        attend(sources.numpy(), query, w)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "sources must be [K, B, T, D] (K sources of [B, T, D]); got shape (2, 3, 8) (one [B, T, D] tensor"
        ),
    ):
        attend(sources[0], query, w)
    with pytest.raises(ValueError, match=re.escape("got shape (1, 4, 2, 3, 8)")):
        attend(sources[None], query, w)
    with pytest.raises(ValueError, match=re.escape("at least one source; got shape (0, 2, 3, 8) (K = 0)")):
        attend(sources[:0], query, w)
    with pytest.raises(TypeError, match="sources must be a floating-point tensor; got dtype torch.int64"):
        attend(sources.long(), query, w)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "shape", [(7,), (3, 3), (B, T, 7), (B + 1, T, D), (B, 1, D), (B, T, 3, 3), (D, 1, 1, 1, 1), ()]
)
def test_query_shape(op, shape):
    sources, _, w = make_inputs()
    expected = "[D] = [8], [H, D/H] with H * D/H = 8, or per token [B, T, D] = [2, 3, 8] / [B, T, H, D/H]"
    with pytest.raises(ValueError, match=re.escape(f"query must be {expected}; got shape {shape}")):
        OPS[op](sources, torch.randn(shape, dtype=torch.float64), w)


@pytest.mark.parametrize("op", OPS)
def test_query_and_key_weight_type_dtype_device(op):
    sources, query, w = make_inputs()
    attend = OPS[op]
    with pytest.raises(TypeError, match=r"query must be a tensor of shape \[D\] = \[8\].*got list"):
        attend(sources, query.tolist(), w)
    with pytest.raises(TypeError, match="query must be a floating-point tensor; got dtype torch.int64"):
        attend(sources, query.long(), w)
    with pytest.raises(ValueError, match=r"query is on meta but sources are on cpu.*query.to\(sources.device\)"):
        attend(sources, query.to("meta"), w)
    with pytest.raises(
        ValueError, match=re.escape("key_weight must be [D] = [8] (one weight per source channel); got shape (2, 4)")
    ):
        attend(sources, query, w.view(2, 4))
    with pytest.raises(TypeError, match=r"key_weight must be a tensor or None of shape \[D\] = \[8\]; got float"):
        attend(sources, query, 1.0)
    with pytest.raises(TypeError, match="key_weight must be a floating-point tensor; got dtype torch.bool"):
        attend(sources, query, w > 0)
    with pytest.raises(ValueError, match="key_weight is on meta but sources are on cpu"):
        attend(sources, query, w.to("meta"))


def test_valid_shapes_still_pass():
    sources, query, w = make_inputs()
    for q in (
        query,
        query.view(2, 4),
        torch.randn(B, T, D, dtype=torch.float64),
        torch.randn(B, T, 2, 4, dtype=torch.float64),
    ):
        for impl in ("fused", "reference"):
            assert depth_attention(sources, q, w, impl=impl).shape == (B, T, D)
        assert depth_attention(sources, q, None).shape == (B, T, D)
    # a float32 query with bfloat16 sources: the op computes in float32 either way
    assert depth_attention(sources.bfloat16(), query.float(), w.float()).dtype == torch.bfloat16


def test_checks_trace_under_compile():
    """The checks read shapes only: a compiled call traces them without a graph break."""
    sources, query, w = make_inputs(torch.float32)
    compiled = torch.compile(
        lambda s, q, g: depth_attention(s, q, g, impl="reference"), fullgraph=True, backend="eager"
    )
    torch.testing.assert_close(compiled(sources, query, w), depth_attention(sources, query, w, impl="reference"))


def test_multi_query_errors():
    sources, query, w = make_inputs()
    queries = torch.randn(3, D, dtype=torch.float64)
    with pytest.raises(TypeError, match=re.escape("pass torch.stack(sources)")):
        multi_query_depth_attention(list(sources.unbind(0)), queries)
    with pytest.raises(ValueError, match=re.escape("got one query of shape (8,): pass queries.unsqueeze(0)")):
        multi_query_depth_attention(sources, query)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "queries must be [Q, D] = [Q, 8] with Q >= 1 (one full-width query per read); got shape (3, 2, 4)"
        ),
    ):
        multi_query_depth_attention(sources, queries.view(3, 2, 4))
    with pytest.raises(ValueError, match=re.escape("got shape (0, 8)")):
        multi_query_depth_attention(sources, queries[:0])
    with pytest.raises(ValueError, match=re.escape("key_norm_weight must be [D] = [8]")):
        multi_query_depth_attention(sources, queries, w[:4])
    with pytest.raises(ValueError, match="queries is on meta"):
        multi_query_depth_attention(sources, queries.to("meta"))
    with pytest.raises(ValueError, match=r"values='normalised' is not supported; use one of \('raw', 'normalized'\)"):
        multi_query_depth_attention(sources, queries, values="normalised")
    with pytest.raises(ValueError, match=r"scale=0 is invalid: give a positive number"):
        multi_query_depth_attention(sources, queries, scale=0)
    with pytest.raises(ValueError, match=r"eps=-1.0 is invalid"):
        multi_query_depth_attention(sources, queries, eps=-1.0)
    with pytest.raises(ValueError, match="kernel='relu'"):
        multi_query_depth_attention(sources, queries, kernel="relu")
