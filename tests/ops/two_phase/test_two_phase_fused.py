"""Two-phase depth attention, reference and fused: Phase 1 for S queries at once, the exact merge and
Phase 2, against the float64 loop-by-loop reference in tests/reference.py and against each other."""

import pytest
import torch
from reference import logits, loop_reference
from reference import two_phase_inputs as inputs

from attnres.ops.common import DepthStats, inverse_rms
from attnres.ops.depth_attention import fused_depth_attention
from attnres.ops.two_phase import fused
from attnres.ops.two_phase import reference as two_phase_reference
from attnres.ops.two_phase.library import phase1_op

EPS = 1e-6
F64 = dict(rtol=1e-12, atol=1e-12)
F64_GRAD = dict(rtol=1e-10, atol=1e-12)
IMPLS = {"reference": two_phase_reference, "fused": fused}


def assert_all_close(got, want):
    """Pairwise equal to float64 gradient rounding; None (an unused input's gradient) only opposite None."""
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, **F64_GRAD)


def in_buffer(v, extra_rows=2):
    """v [n, B, T, D] as the first n rows of a wider [B, T, n + extra, D] buffer, like the stream's."""
    n, B, T, D = v.shape
    buffer = torch.full((B, T, n + extra_rows, D), 7.0, dtype=v.dtype)
    buffer[:, :, :n] = v.movedim(0, 2)
    return buffer[:, :, :n]


def run_phase1(impl, v, q, kw, kernel, key_norm):
    values = in_buffer(v)
    inv = inverse_rms(values, EPS) if key_norm else None
    return IMPLS[impl].phase1(values, inv, q, kw if key_norm else None, kernel=kernel)


def phase1_with_grads(impl, v, q, kw, gh, glse, kernel, key_norm):
    """Phase 1's outputs and the gradients of sum(h * gh) + sum(lse * glse) for values, q and kw."""
    values = v.movedim(0, 2).clone().requires_grad_()
    qq, kk = q.clone().requires_grad_(), kw.clone().requires_grad_()
    inv = inverse_rms(values, EPS) if key_norm else None
    stats = impl.phase1(values, inv, qq, kk if key_norm else None, kernel=kernel)
    loss = (stats.h * gh).sum() + ((stats.lse * glse).sum() if kernel == "softmax" else 0)
    loss.backward()
    return stats.h, stats.lse, values.grad, qq.grad, kk.grad if key_norm else None


def phase1_of_producers(kernel, key_norm):
    """fused.phase1_outputs as a function of (q, kw, *producers) for gradcheck: the values and
    inverse RMS are rebuilt from the producers so gradcheck's perturbations reach them."""

    def f(q, kw, *vs):
        values = torch.stack(vs, dim=2)
        inv = inverse_rms(values, EPS) if key_norm else None
        h1s, lse = fused.phase1_outputs(values, inv, q, kw if key_norm else None, vs, kernel=kernel)
        return (*h1s, lse) if kernel == "softmax" else h1s

    return f


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_equals_one_attention_per_query(impl, kernel, key_norm, heads):
    v, q, kw, _ = inputs(heads=heads)
    stats = run_phase1(impl, v, q, kw, kernel, key_norm)
    assert isinstance(stats, DepthStats)
    assert stats.h.shape == (2, 3, q.shape[0], 8) and stats.lse.shape == (2, 3, q.shape[0], heads)
    for s in range(q.shape[0]):
        want, _ = loop_reference(v, q[s], kw[s], EPS, kernel, key_norm)
        torch.testing.assert_close(stats.h[:, :, s], want, **F64)
        if kernel == "softmax":
            z = logits(v, q[s], kw[s], EPS, key_norm)
            torch.testing.assert_close(stats.lse[:, :, s], torch.logsumexp(z, dim=0), **F64)
        else:
            assert (stats.lse == 0).all()


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_fused_phase1_equals_reference_values_and_grads(kernel, key_norm, heads):
    v, q, kw, _ = inputs(n=4, S=3, heads=heads, seed=1)
    g = torch.Generator().manual_seed(2)
    gh = torch.randn(2, 3, 3, 8, generator=g, dtype=torch.float64)
    glse = torch.randn(2, 3, 3, heads, generator=g, dtype=torch.float64)
    assert_all_close(*(phase1_with_grads(impl, v, q, kw, gh, glse, kernel, key_norm) for impl in IMPLS.values()))


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_fused_phase1_gradcheck(kernel, key_norm, heads):
    v, q, kw, _ = inputs(n=3, S=2, B=1, T=2, D=4, heads=heads)
    producers = [x.clone().requires_grad_() for x in v.unbind(0)]
    q.requires_grad_()
    kw.requires_grad_()

    assert torch.autograd.gradcheck(phase1_of_producers(kernel, key_norm), (q, kw, *producers), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_then_merge_partial_equals_attention_over_all_sources(impl, kernel, key_norm, heads):
    v, q, kw, p = inputs(heads=heads)
    stats = run_phase1(impl, v, q, kw, kernel, key_norm)
    everything = torch.cat([v, p.unsqueeze(0)])
    for s in range(q.shape[0]):
        one = DepthStats(stats.h[:, :, s], stats.lse[:, :, s])
        h = IMPLS[impl].merge_partial(one, p, q[s], kw[s] if key_norm else None, EPS, kernel)
        want, _ = loop_reference(everything, q[s], kw[s], EPS, kernel, key_norm)
        torch.testing.assert_close(h, want, **F64)


def test_float32_phase1_matches_float64():
    v, q, kw, _ = inputs(n=6, S=4, B=2, T=5, D=16, seed=2)
    for impl in IMPLS:
        outs = {}
        for dtype in (torch.float64, torch.float32):
            stats = run_phase1(impl, v.to(dtype), q.to(dtype), kw.to(dtype), "softmax", True)
            assert stats.h.dtype == stats.lse.dtype == dtype
            outs[dtype] = stats
        for a, b in zip(outs[torch.float32], outs[torch.float64], strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_clear_errors():
    v, q, kw, _ = inputs()
    values = v.movedim(0, 2)
    with pytest.raises(ValueError, match="5 sources but 4 producers"):
        fused.phase1_outputs(values, None, q, None, list(v.unbind(0))[:4])
    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="key_weights must be"):
            impl.phase1(values, None, q, kw[:2])
        with pytest.raises(ValueError, match="inv_rms must be"):
            impl.phase1(values, inverse_rms(values[:, :, :2], EPS), q, kw)
        with pytest.raises(ValueError, match="kernel='relu'"):
            impl.phase1(values, None, q, kw, kernel="relu")


@pytest.mark.parametrize(
    "heads,kernel,key_norm", [(1, "softmax", True), (2, "softmax", True), (1, "sigmoid", True), (1, "softmax", False)]
)
def test_merge_partial_gradcheck_and_fused_equals_reference(heads, kernel, key_norm):
    v, q, kw, p = inputs(n=2, S=1, B=2, T=2, D=4, heads=heads, seed=5)
    stats = run_phase1("reference", v, q, kw, kernel, key_norm)
    args = (
        stats.h[:, :, 0].detach().clone().requires_grad_(),
        stats.lse[:, :, 0].detach().clone().requires_grad_(),
        p.clone().requires_grad_(),
        q[0].clone().requires_grad_(),
        kw[0].clone().requires_grad_(),
    )

    def run(impl):
        def f(h1, lse, p, q, kw):
            return impl.merge_partial(DepthStats(h1, lse), p, q, kw if key_norm else None, EPS, kernel)

        return f

    assert torch.autograd.gradcheck(run(fused), args, eps=1e-6, atol=1e-8)
    gh = torch.randn(2, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads = []
    for impl in (fused, two_phase_reference):
        h = run(impl)(*args)
        grads.append((h, *torch.autograd.grad((h * gh).sum(), args, allow_unused=True)))
    assert_all_close(*grads)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("heads", [1, 2])
def test_merge_of_two_source_sets_is_exact(kernel, heads):
    v, q, kw, _ = inputs(n=7, heads=heads, seed=4)
    whole = run_phase1("reference", v, q, kw, kernel, True)
    a = run_phase1("reference", v[:3], q, kw, kernel, True)
    b = run_phase1("reference", v[3:], q, kw, kernel, True)
    merged = two_phase_reference.merge(a, b, kernel)
    torch.testing.assert_close(merged.h, whole.h, **F64)
    if kernel == "softmax":
        torch.testing.assert_close(merged.lse, whole.lse, **F64)


def test_merge_gradcheck():
    v, q, kw, _ = inputs(n=4, S=2, B=1, T=2, D=4, heads=2, seed=7)
    a = run_phase1("reference", v[:2], q, kw, "softmax", True)
    b = run_phase1("reference", v[2:], q, kw, "softmax", True)
    args = tuple(x.detach().clone().requires_grad_() for x in (*a, *b))
    assert torch.autograd.gradcheck(
        lambda ha, la, hb, lb: tuple(two_phase_reference.merge(DepthStats(ha, la), DepthStats(hb, lb))),
        args,
        eps=1e-6,
        atol=1e-8,
    )


def test_the_fused_ops_infer_shapes_on_the_meta_device():
    """On the meta device (no autocast exists there) the custom Functions and the custom op run forward
    and backward on shapes alone: bfloat16 sources give float32 statistics, a bfloat16 merge."""
    B, T, n, S, D = 2, 3, 4, 2, 8

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=True)

    producers, q, kw = [meta(B, T, D) for _ in range(n)], meta(S, D, dtype=torch.float32), meta(S, D)
    values, inv = torch.empty(B, T, n, D, device="meta", dtype=torch.bfloat16), torch.empty(B, T, n, device="meta")
    h1s, lse = fused.phase1_outputs(values, inv, q, kw, producers)
    assert [tuple(h.shape) for h in h1s] == [(B, T, D)] * S and tuple(lse.shape) == (B, T, S, 1)
    assert h1s[0].dtype == lse.dtype == torch.float32
    partial = meta(B, T, D)
    h = fused.merge_partial(DepthStats(h1s[0], lse[:, :, 0]), partial, q[0], kw[0], EPS)
    attended = fused_depth_attention([values], producers, q[1], kw[1])
    assert h.dtype == attended.dtype == torch.bfloat16 and tuple(h.shape) == tuple(attended.shape) == (B, T, D)
    (h.float().sum() + attended.float().sum()).backward()
    assert all(p.grad.device.type == "meta" and p.grad.shape == p.shape for p in (*producers, q, kw, partial))
    h, lse = phase1_op(list(values.unbind(2)), list(inv.unbind(2)), q, kw, "softmax")
    assert tuple(h.shape) == (B, T, S, D) and h.dtype == lse.dtype == torch.float32
