"""Two-phase depth attention: Phase 1 for S queries at once, and the exact Phase-2 merge."""
import pytest
import torch

from attnres.ops import depth_attention_reference
from attnres.ops.two_phase import inverse_rms, merge_outputs, merge_partial, phase1
from reference import naive

EPS = 1e-6


def inputs(n=5, S=3, B=2, T=3, D=8, heads=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, B, T, D, generator=g, dtype=torch.float64) * 1.5 + 0.2
    qshape = (S, D) if heads == 1 else (S, heads, D // heads)
    q = torch.randn(qshape, generator=g, dtype=torch.float64)
    kw = torch.rand(S, D, generator=g, dtype=torch.float64) + 0.5
    p = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    return v, q, kw, p


def run_phase1(v, q, kw, kernel, key_norm, buffer_rows=None):
    """Phase 1 over v [n, B, T, D] read from a wider buffer, like the residual stream does."""
    n, B, T, D = v.shape
    rows = buffer_rows or n + 2
    buffer = torch.full((B, T, rows, D), 7.0, dtype=v.dtype)
    buffer[:, :, :n] = v.movedim(0, 2)
    inv = inverse_rms(buffer[:, :, :n], EPS) if key_norm else None
    return phase1(buffer[:, :, :n], inv, q, kw if key_norm else None, list(v.unbind(0)), kernel=kernel)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_equals_one_attention_per_query(kernel, key_norm, heads):
    v, q, kw, _ = inputs(heads=heads)
    h1, lse = run_phase1(v, q, kw, kernel, key_norm)
    for s in range(q.shape[0]):
        want, _ = naive(v, q[s], kw[s], EPS, kernel, key_norm)
        torch.testing.assert_close(h1[:, :, s], want, rtol=1e-12, atol=1e-12)
        if kernel == "softmax":
            stats = depth_attention_reference(v, q[s], kw[s] if key_norm else None, eps=EPS,
                                              normalize_keys=key_norm).stats
            m, l = stats.m, stats.l
            if heads == 1:
                m, l = m.unsqueeze(-1), l.unsqueeze(-1)
            torch.testing.assert_close(lse[:, :, s], m + torch.log(l), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_then_merge_equals_attention_over_all_sources(kernel, key_norm, heads):
    v, q, kw, p = inputs(heads=heads)
    h1, lse = run_phase1(v, q, kw, kernel, key_norm)
    everything = torch.cat([v, p.unsqueeze(0)])
    for s in range(q.shape[0]):
        h = merge_partial(h1[:, :, s], lse[:, :, s], p, q[s], kw[s] if key_norm else None, EPS, kernel)
        want, _ = naive(everything, q[s], kw[s], EPS, kernel, key_norm)
        torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_gradcheck(kernel, key_norm, heads):
    v, q, kw, _ = inputs(n=3, S=2, B=1, T=2, D=4, heads=heads)
    producers = [x.clone().requires_grad_() for x in v.unbind(0)]
    q.requires_grad_()
    kw.requires_grad_()

    def f(q, kw, *vs):
        # values and inverse RMS are rebuilt from the producers so gradcheck's perturbations reach them
        values = torch.stack(vs, dim=2)
        inv = inverse_rms(values, EPS) if key_norm else None
        h1, lse = phase1(values, inv, q, kw if key_norm else None, vs, kernel=kernel)
        return (h1, lse) if kernel == "softmax" else h1

    assert torch.autograd.gradcheck(f, (q, kw, *producers), eps=1e-6, atol=1e-8)


def test_float32_phase1_matches_float64():
    v, q, kw, _ = inputs(n=6, S=4, B=2, T=5, D=16, seed=2)
    outs = {}
    for dtype in (torch.float64, torch.float32):
        h1, lse = run_phase1(v.to(dtype), q.to(dtype), kw.to(dtype), "softmax", True)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        outs[dtype] = (h1, lse)
    for a, b in zip(outs[torch.float32], outs[torch.float64]):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_count_mismatch_is_a_clear_error():
    v, q, kw, _ = inputs()
    with pytest.raises(ValueError, match="5 sources but 4 producers"):
        phase1(v.movedim(0, 2), None, q, None, list(v.unbind(0))[:4])


@pytest.mark.parametrize("heads,kernel,key_norm", [(1, "softmax", True), (2, "softmax", True),
                                                   (1, "sigmoid", True), (1, "softmax", False)])
def test_merge_partial_gradcheck(heads, kernel, key_norm):
    v, q, kw, p = inputs(n=2, S=1, B=2, T=2, D=4, heads=heads, seed=5)
    h1, lse = run_phase1(v, q, kw, kernel, key_norm)
    args = (h1[:, :, 0].detach().clone().requires_grad_(), lse[:, :, 0].detach().clone().requires_grad_(),
            p.clone().requires_grad_(), q[0].clone().requires_grad_(), kw[0].clone().requires_grad_())

    def f(h1, lse, p, q, kw):
        return merge_partial(h1, lse, p, q, kw if key_norm else None, EPS, kernel)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("heads", [1, 2])
def test_merge_outputs_of_two_source_sets_is_exact(kernel, heads):
    v, q, kw, _ = inputs(n=7, heads=heads, seed=4)
    h_all, lse_all = run_phase1(v, q, kw, kernel, True)
    h_a, lse_a = run_phase1(v[:3], q, kw, kernel, True)
    h_b, lse_b = run_phase1(v[3:], q, kw, kernel, True)
    for s in range(q.shape[0]):
        h, lse = merge_outputs(h_a[:, :, s], lse_a[:, :, s], h_b[:, :, s], lse_b[:, :, s], kernel)
        torch.testing.assert_close(h, h_all[:, :, s], rtol=1e-12, atol=1e-12)
        if kernel == "softmax":
            torch.testing.assert_close(lse, lse_all[:, :, s], rtol=1e-12, atol=1e-12)
