"""Phase 1 as the custom ops ``attnres::phase1`` / ``attnres::phase1_backward`` (``library.py``) and the
choice between them and the pointwise form in ``compiled.phase1_sources``: both forms against
``reference.phase1`` in float64 (values and gradients, gradcheck), float32 against float64,
``torch.library.opcheck``, and a ``torch.compile(fullgraph=True)`` trace with no graph break."""

import pytest
import torch
from reference import two_phase_inputs

from attnres.ops import backends
from attnres.ops.common import inverse_rms
from attnres.ops.two_phase import compiled, library
from attnres.ops.two_phase import reference as two_phase_reference

EPS = 1e-6
F64 = dict(rtol=1e-10, atol=1e-12)

CASES = [("softmax", True, 1), ("softmax", True, 2), ("softmax", False, 1), ("sigmoid", True, 1), ("sigmoid", False, 2)]


def force_form(monkeypatch, custom_op: bool) -> None:
    """phase1_sources onto one form whatever the size and device (the CPU runs pointwise by default)."""
    monkeypatch.setattr(backends, "POINTWISE_PAIRS", 0 if custom_op else 10**6)
    monkeypatch.setattr(backends, "CUSTOM_OP_DEVICES", frozenset({"cpu", "cuda"}))


@pytest.fixture(params=["custom_op", "pointwise"])
def form(request, monkeypatch):
    force_form(monkeypatch, request.param == "custom_op")
    return request.param


def run_phase1(form_name, v, q, kw, kernel, key_norm, gh, glse):
    """(h [B, T, S, D], lse, source grads..., query grad, key-weight grad) of one form."""
    sources = [x.clone().requires_grad_() for x in v.unbind(0)]
    qq, kk = q.clone().requires_grad_(), kw.clone().requires_grad_()
    if form_name == "reference":
        values = torch.stack(sources, dim=2)
        inv = inverse_rms(values, EPS) if key_norm else None
        stats = two_phase_reference.phase1(values, inv, qq, kk if key_norm else None, kernel=kernel)
        h, lse = stats.h, stats.lse
    else:
        inv = [inverse_rms(x, EPS) for x in sources] if key_norm else None
        h1s, lse = compiled.phase1_sources(sources, inv, qq, kk if key_norm else None, kernel=kernel)
        h = torch.stack(h1s, dim=2)
    loss = (h * gh.to(h.dtype)).sum() + ((lse * glse.to(lse.dtype)).sum() if kernel == "softmax" else 0)
    loss.backward()
    return (h, lse, *(s.grad for s in sources), qq.grad, kk.grad if key_norm else None)


@pytest.mark.parametrize("kernel,key_norm,heads", CASES)
def test_both_forms_equal_the_reference_in_float64(form, kernel, key_norm, heads):
    v, q, kw, _ = two_phase_inputs(n=4, S=3, heads=heads, seed=3)
    g = torch.Generator().manual_seed(4)
    gh = torch.randn(2, 3, 3, 8, generator=g, dtype=torch.float64)
    glse = torch.randn(2, 3, 3, heads, generator=g, dtype=torch.float64)
    got = run_phase1(form, v, q, kw, kernel, key_norm, gh, glse)
    want = run_phase1("reference", v, q, kw, kernel, key_norm, gh, glse)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
        else:
            assert a.dtype == torch.float64
            torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("kernel,key_norm,heads", CASES)
def test_custom_op_float32_is_close_to_float64(kernel, key_norm, heads, monkeypatch):
    force_form(monkeypatch, True)
    v, q, kw, _ = two_phase_inputs(n=5, S=2, T=4, D=16, heads=heads, seed=5)
    g = torch.Generator().manual_seed(6)
    gh = torch.randn(2, 4, 2, 16, generator=g, dtype=torch.float64)
    glse = torch.randn(2, 4, 2, heads, generator=g, dtype=torch.float64)
    want = run_phase1("compiled", v, q, kw, kernel, key_norm, gh, glse)
    got = run_phase1("compiled", v.float(), q.float(), kw.float(), kernel, key_norm, gh, glse)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
        else:
            assert a.dtype == torch.float32
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel,key_norm,heads", CASES)
def test_custom_op_gradcheck(kernel, key_norm, heads):
    v, q, kw, _ = two_phase_inputs(n=3, S=2, B=1, T=2, D=4, heads=heads, seed=7)
    sources = [x.clone().requires_grad_() for x in v.unbind(0)]
    qq, kk = q.clone().requires_grad_(), kw.clone().requires_grad_()
    n = len(sources)

    def fn(*args):
        srcs, query, weights = list(args[:n]), args[n], args[n + 1]
        inv = [inverse_rms(x, EPS).detach() for x in srcs] if key_norm else []
        h, lse = library.phase1_op(srcs, inv, query, weights if key_norm else None, kernel)
        return (h, lse) if kernel == "softmax" else h

    assert torch.autograd.gradcheck(fn, (*sources, qq, kk), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("kernel,key_norm,heads", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck(kernel, key_norm, heads, dtype):
    v, q, kw, _ = two_phase_inputs(n=3, S=2, T=4, heads=heads, seed=8)
    sources = [x.to(dtype).requires_grad_() for x in v.unbind(0)]
    inv = [inverse_rms(x, EPS).detach() for x in sources] if key_norm else []
    q = q.to(dtype).requires_grad_()
    kw = kw.to(dtype).requires_grad_() if key_norm else None
    torch.library.opcheck(library.phase1_op, (sources, inv, q, kw, kernel))
    h, lse = library.phase1_op(sources, inv, q, kw, kernel)
    g = torch.Generator().manual_seed(9)
    gh, glse = torch.randn(h.shape, generator=g, dtype=h.dtype), torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    plain = [x.detach() for x in sources]
    args = (gh, glse, plain, inv, q.detach(), None if kw is None else kw.detach(), lse.detach(), kernel)
    torch.library.opcheck(library.phase1_backward_op, args)


def test_compiled_with_fullgraph_and_no_graph_break(monkeypatch):
    """Forward and backward traced whole (dynamo + AOT autograd over the fake implementations): one graph,
    the same values and gradients as eager."""
    force_form(monkeypatch, True)
    v, q, kw, _ = two_phase_inputs(n=4, S=3, T=4, heads=1, seed=10)
    v, q, kw = v.float(), q.float(), kw.float()

    def step(sources, query, weights):
        inv = [inverse_rms(x, EPS) for x in sources]
        h1s, lse = compiled.phase1_sources(sources, inv, query, weights)
        return sum(h.square().sum() for h in h1s) + lse.sum()

    def grads(fn):
        sources = [x.clone().requires_grad_() for x in v.unbind(0)]
        qq, kk = q.clone().requires_grad_(), kw.clone().requires_grad_()
        loss = fn(sources, qq, kk)
        loss.backward()
        return [loss, *(s.grad for s in sources), qq.grad, kk.grad]

    torch._dynamo.reset()
    sources = [x.clone().requires_grad_() for x in v.unbind(0)]
    explained = torch._dynamo.explain(step)(sources, q.clone().requires_grad_(), kw.clone().requires_grad_())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("attnres.phase1" in o for o in ops)
    for a, b in zip(grads(torch.compile(step, backend="aot_eager", fullgraph=True)), grads(step), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_small_phase1_and_the_cpu_run_pointwise():
    assert compiled.pointwise_phase1(1, 1, "cuda") and compiled.pointwise_phase1(2, 2, "cuda")
    assert not compiled.pointwise_phase1(3, 2, "cuda") and not compiled.pointwise_phase1(8, 1, "cuda:0")
    # measured faster there than the op, with the compiled C++ kernel inside it or not (CUSTOM_OP_DEVICES)
    assert compiled.pointwise_phase1(8, 4, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads", [1, 4])
def test_custom_op_on_cuda_against_the_float64_cpu_reference(dtype, tol, heads):
    """The op on a GPU (the Triton forward, torch's backward) at a realistic width, values and gradients
    relative to the float64 CPU reference's scale; and traced whole by the compiler (inductor)."""
    v, q, kw, _ = two_phase_inputs(n=9, S=4, B=2, T=64, D=256, heads=heads, seed=11)
    g = torch.Generator().manual_seed(12)
    gh = torch.randn(2, 64, 4, 256, generator=g, dtype=torch.float64)
    glse = torch.randn(2, 64, 4, heads, generator=g, dtype=torch.float64)
    want = run_phase1("reference", v, q, kw, "softmax", True, gh, glse)
    # sources in the activations' dtype, queries and key weights float32 (parameters under autocast)
    cuda = [v.to("cuda", dtype), q.to("cuda", torch.float32), kw.to("cuda", torch.float32)]
    cuda += [gh.to("cuda", dtype), glse.to("cuda", dtype)]
    got = run_phase1("compiled", *cuda[:3], "softmax", True, *cuda[3:])
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a.double().cpu(), b, rtol=tol, atol=tol * scale)

    def loss(sources, query, weights):
        inv = [inverse_rms(x, EPS) for x in sources]
        h1s, lse = compiled.phase1_sources(sources, inv, query, weights)
        return sum(h.float().square().sum() for h in h1s) + lse.sum()

    sources = [x.clone().requires_grad_() for x in cuda[0].unbind(0)]
    step = torch.compile(loss, fullgraph=True)
    compiled_loss = step(sources, cuda[1], cuda[2])
    compiled_loss.backward()
    eager_sources = [x.clone().requires_grad_() for x in cuda[0].unbind(0)]
    eager_loss = loss(eager_sources, cuda[1], cuda[2])
    eager_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=tol, atol=0)
    for a, b in zip(sources, eager_sources, strict=True):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol * b.grad.abs().max().item())
