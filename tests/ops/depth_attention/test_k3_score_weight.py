"""Kimi K3's fused score weight (llama.cpp's ``attn_res_score`` = key-norm weight ⊙ query): the fused
vector and the pair score the sources alike, and fuse(unfuse(f)) == f exactly."""

import pytest
import torch

from attnres.ops import depth_attention, fuse_score_weight, unfuse_score_weight


def make_inputs(K=6, B=2, T=3, D=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    sources = torch.randn(K, B, T, D, generator=g, dtype=dtype) * 2 - 0.4
    query = torch.randn(D, generator=g, dtype=dtype)
    key_norm_weight = torch.rand(D, generator=g, dtype=dtype) * 1.5 + 0.25
    return sources, query, key_norm_weight


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_fused_weight_scores_like_the_pair(impl):
    sources, query, w = make_inputs()
    want = depth_attention(sources, query, w, eps=1e-5, impl=impl, return_weights=True)
    fused = fuse_score_weight(query, w)
    torch.testing.assert_close(fused, query * w, rtol=0, atol=0)
    # the fused vector as the query, without a key-norm weight
    got = depth_attention(sources, fused, None, eps=1e-5, impl=impl, return_weights=True)
    torch.testing.assert_close(got.h, want.h, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-13, atol=1e-13)
    # the unfused pair
    q2, w2 = unfuse_score_weight(fused)
    assert torch.equal(w2, torch.ones(16, dtype=torch.float64))
    got = depth_attention(sources, q2, w2, eps=1e-5, impl=impl, return_weights=True)
    torch.testing.assert_close(got.h, want.h, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fuse_of_unfuse_is_exact(dtype):
    f = torch.randn(2, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    again = fuse_score_weight(*unfuse_score_weight(f))
    assert again.dtype == dtype and torch.equal(again, f)


def test_k3_layout_and_bfloat16():
    """K3 stores proj.weight [1, D] and norm.weight [D] in bfloat16 and scores in float32: the fused
    product, taken in float32, is exact there."""
    _, query, w = make_inputs(seed=2)
    proj, norm = query.to(torch.bfloat16)[None], w.to(torch.bfloat16)
    fused = fuse_score_weight(proj, norm)
    assert fused.shape == (1, 16) and fused.dtype == torch.float32
    assert torch.equal(fused.double(), proj.double() * norm.double())
    assert torch.equal(fuse_score_weight(query), query)


def test_errors():
    _, query, w = make_inputs()
    with pytest.raises(ValueError, match=r"key_norm_weight must be \[D\] = \[16\].*got shape \(8,\)"):
        fuse_score_weight(query, w[:8])
    with pytest.raises(TypeError, match="query must be a floating-point tensor"):
        fuse_score_weight([1.0, 2.0], w)
    with pytest.raises(TypeError, match="key_norm_weight must be a floating-point tensor"):
        fuse_score_weight(query, torch.ones(16, dtype=torch.long))
    with pytest.raises(TypeError, match="fused must be a floating-point tensor"):
        unfuse_score_weight(torch.ones(3, dtype=torch.long))
