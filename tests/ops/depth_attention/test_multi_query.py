"""multi_query_depth_attention: Q full-width queries over the same sources in one pass, against a float64
loop-by-loop reference, the plain reference beside it, depth_attention once per query, and gradcheck."""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnres.ops import (
    MultiQueryOutput,
    depth_attention,
    multi_query_depth_attention,
    multi_query_depth_attention_reference,
)


def make_inputs(K=5, B=2, T=3, D=8, Q=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = torch.randn(K, B, T, D, generator=g, dtype=dtype) * 2 + 0.3
    queries = torch.randn(Q, D, generator=g, dtype=dtype)
    key_norm_weight = torch.rand(D, generator=g, dtype=dtype) + 0.5
    return sources, queries, key_norm_weight


def loop_reference(sources, queries, key_norm_weight, eps, scale, values, kernel):
    """Per query, per token, per source, from the formulas of the module docstring (float64)."""
    K, B, T, D = sources.shape
    Q = queries.shape[0]
    h = torch.zeros(Q, B, T, D, dtype=torch.float64)
    alpha = torch.zeros(Q, K, B, T, dtype=torch.float64)
    g = torch.ones(D, dtype=torch.float64) if key_norm_weight is None else key_norm_weight
    s = 1.0 if scale is None else scale
    for q in range(Q):
        for b in range(B):
            for t in range(T):
                normed = [sources[i, b, t] / torch.sqrt((sources[i, b, t] ** 2).mean() + eps) for i in range(K)]
                z = torch.stack([s * (queries[q] * g * normed[i]).sum() for i in range(K)])
                a = torch.softmax(z, 0) if kernel == "softmax" else torch.sigmoid(z)
                alpha[q, :, b, t] = a
                for i in range(K):
                    h[q, b, t] += a[i] * (normed[i] if values == "normalized" else sources[i, b, t])
    return h, alpha


CASES = list(itertools.product(["raw", "normalized"], ["softmax", "sigmoid"], [True, False], [None, 0.35]))


@pytest.mark.parametrize("values,kernel,weighted,scale", CASES)
def test_matches_loop_reference(values, kernel, weighted, scale):
    sources, queries, g = make_inputs()
    g = g if weighted else None
    want_h, want_a = loop_reference(sources, queries, g, 1e-6, scale, values, kernel)
    out = multi_query_depth_attention(
        sources, queries, g, eps=1e-6, scale=scale, values=values, kernel=kernel, return_weights=True
    )
    assert isinstance(out, MultiQueryOutput)
    torch.testing.assert_close(out.h, want_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.weights, want_a, rtol=1e-12, atol=1e-12)
    ref = multi_query_depth_attention_reference(
        sources, queries, g, eps=1e-6, scale=scale, values=values, kernel=kernel
    )
    torch.testing.assert_close(ref.h, want_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.weights, want_a, rtol=1e-12, atol=1e-12)
    h = multi_query_depth_attention(sources, queries, g, eps=1e-6, scale=scale, values=values, kernel=kernel)
    torch.testing.assert_close(h, want_h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
def test_raw_values_equal_depth_attention_once_per_query(kernel):
    sources, queries, g = make_inputs(Q=4, seed=1)
    h = multi_query_depth_attention(sources, queries, g, scale=0.5, kernel=kernel)
    for q in range(queries.shape[0]):
        want = depth_attention(sources, queries[q] * 0.5, g, kernel=kernel)
        torch.testing.assert_close(h[q], want, rtol=1e-12, atol=1e-12)


def test_zero_queries_give_the_mean():
    sources, queries, _ = make_inputs(seed=2)
    h = multi_query_depth_attention(sources, torch.zeros_like(queries))
    for q in range(queries.shape[0]):
        torch.testing.assert_close(h[q], sources.mean(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("values,kernel,weighted,scale", CASES[::3])
def test_gradcheck(values, kernel, weighted, scale):
    sources, queries, g = make_inputs(K=3, B=1, T=2, D=4, Q=3, seed=3)
    args = [sources.requires_grad_(), queries.requires_grad_()] + ([g.requires_grad_()] if weighted else [])

    def f(s, q, *w):
        return multi_query_depth_attention(s, q, w[0] if w else None, scale=scale, values=values, kernel=kernel)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_computes_in_float32(dtype):
    s64, q64, g64 = make_inputs(K=6, B=2, T=4, D=16, seed=4)
    sources = s64.to(dtype)
    out = multi_query_depth_attention(
        sources, q64.float(), g64.float(), scale=0.25, values="normalized", return_weights=True
    )
    assert out.h.dtype == dtype and out.weights.dtype == torch.float32
    want = multi_query_depth_attention(
        sources.double(), q64.float().double(), g64.float().double(), scale=0.25, values="normalized"
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.h.double(), want, rtol=tol, atol=tol)


class _CountProducts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.products += 1
        return func(*args, **(kwargs or {}))


def test_sources_are_read_once_for_any_number_of_queries():
    """One product for all the logits and one for all the mixtures, whatever Q is."""
    counts = []
    for q in (1, 3, 7):
        sources, queries, g = make_inputs(Q=q, seed=5)
        with _CountProducts() as mode:
            multi_query_depth_attention(sources, queries, g, values="normalized")
        counts.append(mode.products)
    assert counts == [2, 2, 2], counts
