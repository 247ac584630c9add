"""Phase 1 in the form compiled streams trace (``compiled.phase1_sources``: the sources as separate
tensors, plain autograd): against the float64 loop reference per query and against ``reference.phase1``
in values and gradients, and gradcheck."""

import pytest
import torch
from reference import logits, loop_reference, two_phase_inputs

from attnres.ops.common import inverse_rms
from attnres.ops.two_phase import compiled
from attnres.ops.two_phase import reference as two_phase_reference

EPS = 1e-6
F64 = dict(rtol=1e-12, atol=1e-12)
F64_GRAD = dict(rtol=1e-10, atol=1e-12)


def inputs(**shape):
    return two_phase_inputs(**shape)[:3]  # sources, queries, key weights (no partial sum)


def unstacked(sources, q, kw, kernel, key_norm):
    inv = [inverse_rms(v, EPS) for v in sources] if key_norm else None
    return compiled.phase1_sources(sources, inv, q, kw if key_norm else None, kernel=kernel)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_sources_equals_one_attention_per_query(kernel, key_norm, heads):
    v, q, kw = inputs(heads=heads)
    h1s, lse = unstacked(list(v.unbind(0)), q, kw, kernel, key_norm)
    assert len(h1s) == q.shape[0] and lse.shape == (2, 3, q.shape[0], heads)
    for s, h in enumerate(h1s):
        want, _ = loop_reference(v, q[s], kw[s], EPS, kernel, key_norm)
        torch.testing.assert_close(h, want, **F64)
        if kernel == "softmax":
            torch.testing.assert_close(lse[:, :, s], torch.logsumexp(logits(v, q[s], kw[s], EPS, key_norm), 0), **F64)
        else:
            assert (lse == 0).all()


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_sources_equals_reference_values_and_grads(kernel, key_norm, heads):
    v, q, kw = inputs(n=4, S=3, heads=heads, seed=1)
    g = torch.Generator().manual_seed(2)
    gh = torch.randn(2, 3, 3, 8, generator=g, dtype=torch.float64)
    glse = torch.randn(2, 3, 3, heads, generator=g, dtype=torch.float64)
    results = []
    for form in ("reference", "compiled"):
        sources = [x.clone().requires_grad_() for x in v.unbind(0)]
        qq, kk = q.clone().requires_grad_(), kw.clone().requires_grad_()
        if form == "reference":
            values = torch.stack(sources, dim=2)
            stats = two_phase_reference.phase1(
                values, inverse_rms(values, EPS) if key_norm else None, qq, kk if key_norm else None, kernel=kernel
            )
            h, lse = stats.h, stats.lse
        else:
            h1s, lse = unstacked(sources, qq, kk, kernel, key_norm)
            h = torch.stack(h1s, dim=2)
        loss = (h * gh).sum() + ((lse * glse).sum() if kernel == "softmax" else 0)
        loss.backward()
        results.append((h, lse, *(s.grad for s in sources), qq.grad, kk.grad))
    for got, want in zip(*results, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, **F64_GRAD)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_sources_gradcheck(kernel, key_norm, heads):
    v, q, kw = inputs(n=3, S=2, B=1, T=2, D=4, heads=heads)
    sources = [x.clone().requires_grad_() for x in v.unbind(0)]

    def f(q, kw, *vs):
        h1s, lse = unstacked(list(vs), q, kw, kernel, key_norm)
        return (*h1s, lse) if kernel == "softmax" else h1s

    assert torch.autograd.gradcheck(f, (q.requires_grad_(), kw.requires_grad_(), *sources), eps=1e-6, atol=1e-8)


def test_phase1_sources_float32_matches_float64():
    v, q, kw = inputs(n=6, S=4, D=16, seed=3)
    want, want_lse = unstacked(list(v.unbind(0)), q, kw, "softmax", True)
    got, got_lse = unstacked(list(v.float().unbind(0)), q.float(), kw.float(), "softmax", True)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_phase1_sources_clear_errors():
    v, q, kw = inputs()
    sources = list(v.unbind(0))
    with pytest.raises(ValueError, match="at least one source"):
        compiled.phase1_sources([], None, q)
    with pytest.raises(ValueError, match="2 inverse RMS tensors for 5 sources"):
        compiled.phase1_sources(sources, [inverse_rms(v[0], EPS)] * 2, q, kw)
    with pytest.raises(ValueError, match="do not cover the 8 source channels"):
        compiled.phase1_sources(sources, None, q[:, :5])
    with pytest.raises(ValueError, match=r"key_weights must be \[S, D\]"):
        compiled.phase1_sources(sources, None, q, kw[:2])
    with pytest.raises(ValueError, match="kernel=.relu. is not supported"):
        compiled.phase1_sources(sources, None, q, kernel="relu")
