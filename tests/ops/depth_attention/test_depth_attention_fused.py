"""Depth attention, reference and fused, against the float64 loop-by-loop reference in tests/reference.py
and against each other."""

import itertools

import pytest
import torch
from reference import logits, loop_reference

from attnres.ops import depth_attention, fused_depth_attention, merge_stats


def make_inputs(K=5, B=2, T=3, D=8, heads=1, per_token=False, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = torch.randn(K, B, T, D, generator=g, dtype=dtype) * 2 + 0.3
    shape = (D,) if heads == 1 else (heads, D // heads)
    if per_token:
        shape = (B, T) + shape
    query = torch.randn(shape, generator=g, dtype=dtype)
    key_weight = torch.rand(D, generator=g, dtype=dtype) + 0.5
    return sources, query, key_weight


CASES = list(itertools.product(["softmax", "sigmoid"], [True, False], [1, 2], [False, True]))


@pytest.mark.parametrize("kernel,normalize_keys,heads,per_token", CASES)
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_values_match_loop_reference(kernel, normalize_keys, heads, per_token, impl):
    sources, query, kw = make_inputs(heads=heads, per_token=per_token)
    want_h, want_a = loop_reference(sources, query, kw, 1e-6, kernel, normalize_keys)
    h = depth_attention(sources, query, kw, eps=1e-6, kernel=kernel, normalize_keys=normalize_keys, impl=impl)
    torch.testing.assert_close(h, want_h, rtol=1e-12, atol=1e-12)
    out = depth_attention(
        sources, query, kw, eps=1e-6, kernel=kernel, normalize_keys=normalize_keys, return_weights=True
    )
    torch.testing.assert_close(out.weights, want_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.h, want_h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel,normalize_keys,heads,per_token", CASES)
def test_fused_gradcheck(kernel, normalize_keys, heads, per_token):
    sources, query, kw = make_inputs(K=4, B=2, T=2, D=4, heads=heads, per_token=per_token)
    vs = [s.clone().requires_grad_() for s in sources.unbind(0)]
    query.requires_grad_()
    kw.requires_grad_()

    def f(q, w, *v):
        # segments are built from the producers so that gradcheck's perturbations reach them;
        # two segments exercise the cross-segment softmax
        stacked = torch.stack(v, dim=2)
        segments = (stacked[:, :, :3], stacked[:, :, 3:])
        return fused_depth_attention(segments, v, q, w, eps=1e-6, kernel=kernel, normalize_keys=normalize_keys)

    assert torch.autograd.gradcheck(f, (query, kw, *vs), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("kernel,normalize_keys,heads,per_token", CASES[::3])
def test_reference_gradcheck(kernel, normalize_keys, heads, per_token):
    sources, query, kw = make_inputs(K=3, B=1, T=2, D=4, heads=heads, per_token=per_token)
    args = (sources.requires_grad_(), query.requires_grad_(), kw.requires_grad_())

    def f(s, q, w):
        return depth_attention(s, q, w, kernel=kernel, normalize_keys=normalize_keys, impl="reference")

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("heads,per_token", [(1, False), (2, True)])
def test_float32_fused_grads_match_float64(heads, per_token):
    s64, q64, w64 = make_inputs(K=6, B=2, T=5, D=16, heads=heads, per_token=per_token, seed=3)
    gh = torch.randn(2, 5, 16, dtype=torch.float64)
    grads = {}
    for dtype in (torch.float64, torch.float32):
        s = s64.detach().to(dtype).requires_grad_()
        q = q64.detach().to(dtype).requires_grad_()
        w = w64.detach().to(dtype).requires_grad_()
        h = depth_attention(s, q, w, impl="fused" if dtype == torch.float32 else "reference")
        (h * gh.to(dtype)).sum().backward()
        grads[dtype] = (h.detach(), s.grad, q.grad, w.grad)
    for a, b in zip(grads[torch.float32], grads[torch.float64], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", [1, 4])
def test_stats_and_exact_merge(heads):
    sources, query, kw = make_inputs(K=7, B=2, T=3, D=8, heads=heads)
    full = depth_attention(sources, query, kw, return_stats=True, return_weights=True)
    torch.testing.assert_close(full.stats.h, full.h, rtol=0, atol=0)  # float64: no rounding between
    torch.testing.assert_close(
        full.stats.lse, torch.logsumexp(logits(sources, query, kw, 1e-6), dim=0), rtol=1e-12, atol=1e-12
    )
    a = depth_attention(sources[:4], query, kw, return_stats=True).stats
    b = depth_attention(sources[4:], query, kw, return_stats=True).stats
    merged = merge_stats(a, b)
    torch.testing.assert_close(merged.h, full.h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.lse, full.stats.lse, rtol=1e-12, atol=1e-12)
    _, alpha = loop_reference(sources, query, kw, 1e-6, "softmax", True)
    torch.testing.assert_close(full.weights, alpha, rtol=1e-12, atol=1e-12)


def test_bfloat16_inputs_keep_float32_statistics():
    sources, query, kw = make_inputs(K=5, D=16, dtype=torch.float32)
    out = depth_attention(sources.bfloat16(), query.bfloat16(), kw.bfloat16(), return_stats=True, return_weights=True)
    assert out.stats.h.dtype == out.stats.lse.dtype == torch.float32
    assert out.weights.dtype == torch.float32
    assert out.h.dtype == torch.bfloat16
    h32 = depth_attention(sources, query, kw)
    torch.testing.assert_close(out.h.float(), h32, rtol=3e-2, atol=3e-2)
    fused = depth_attention(sources.bfloat16(), query.bfloat16(), kw.bfloat16())
    torch.testing.assert_close(fused.float(), out.h.float(), rtol=1e-2, atol=1e-2)


def test_softmax_weights_sum_to_one():
    sources, query, kw = make_inputs(K=9, heads=2)
    w = depth_attention(sources, query, kw, return_weights=True).weights
    torch.testing.assert_close(w.sum(0), torch.ones_like(w[0]), rtol=1e-12, atol=1e-12)


def test_zero_query_gives_the_mean():
    sources, _, kw = make_inputs(K=6)
    h = depth_attention(sources, torch.zeros(8, dtype=torch.float64), kw)
    torch.testing.assert_close(h, sources.mean(0), rtol=1e-12, atol=1e-12)


def test_fused_reads_buffer_views_and_routes_gradients():
    sources, query, kw = make_inputs(K=5, D=8)
    producers = [s.clone().requires_grad_() for s in sources.unbind(0)]
    buffer = torch.empty(2, 3, 8, 8, dtype=torch.float64)  # room for more rows than used
    for i, p in enumerate(producers[:4]):
        buffer[:, :, i] = p.detach()
    partial = producers[4]
    h = fused_depth_attention([buffer[:, :, :4], partial.unsqueeze(2)], producers, query, kw)
    buffer[:, :, 4:] = 123.0  # later writes to other rows must not disturb backward
    gh = torch.randn_like(h)
    (h * gh).sum().backward()

    ref = [s.clone().requires_grad_() for s in sources.unbind(0)]
    h_ref = depth_attention(torch.stack(ref), query, kw, impl="reference")
    (h_ref * gh).sum().backward()
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    for p, r in zip(producers, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-12)


def test_clear_errors():
    sources, query, kw = make_inputs()
    with pytest.raises(ValueError, match="kernel='relu'"):
        depth_attention(sources, query, kw, kernel="relu")
    with pytest.raises(ValueError, match="query"):
        depth_attention(sources, torch.randn(7, dtype=torch.float64), kw)
    with pytest.raises(ValueError, match="sigmoid|softmax"):
        depth_attention(sources, query, kw, kernel="sigmoid", return_stats=True)
    with pytest.raises(ValueError, match="sources must be"):
        depth_attention(sources[0], query, kw)
    with pytest.raises(ValueError, match="impl='triton'"):
        depth_attention(sources, query, kw, impl="triton")
