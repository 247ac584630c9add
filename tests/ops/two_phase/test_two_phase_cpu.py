"""The compiled C++ Phase-1 kernel (``attnres/ops/two_phase/cpu.py``) against float64 autograd through
``reference.phase1``; its buffer-view and list forms, threads, the custom op and the eager fused path run
both ways (kernel and ``ATTNRES_CPU_KERNEL=0``), and the fallback when it cannot build."""

import pytest
import torch
from reference import randomize, two_phase_inputs

from attnres import AttnResLM, ModelConfig
from attnres.ops.common import inverse_rms
from attnres.ops.two_phase import cpu, fused, library
from attnres.ops.two_phase import reference as two_phase_reference

EPS = 1e-6
F64 = dict(rtol=1e-10, atol=1e-12)

needs_kernel = pytest.mark.skipif(cpu.kernel() is None, reason=f"the CPU kernel does not build here: {cpu.status()}")


def reference_grads(v, q, kw, kernel, key_norm, gh, glse):
    """(h, lse, dL/dsources [B, T, n, D], dL/du [S, D]) by float64 autograd through reference.phase1."""
    values = v.permute(1, 2, 0, 3).clone().requires_grad_()  # [B, T, n, D]
    s_count = q.shape[0]
    u = (q.reshape(s_count, -1) * (kw if key_norm else 1)).clone().requires_grad_()
    inv = inverse_rms(values, EPS) if key_norm else None
    stats = two_phase_reference.phase1(values, inv, u.view(q.shape), None, kernel=kernel)
    loss = (stats.h * gh).sum() + ((stats.lse * glse).sum() if kernel == "softmax" else 0)
    gv, du = torch.autograd.grad(loss, [values, u])
    return stats.h, stats.lse, gv, du


CASES = [
    # kernel, key norm, heads, n, S
    ("softmax", True, 1, 5, 3),
    ("softmax", True, 2, 3, 1),
    ("softmax", False, 4, 1, 3),
    ("sigmoid", True, 1, 3, 3),
    ("sigmoid", False, 2, 5, 1),
]


@needs_kernel
@pytest.mark.parametrize("kernel,key_norm,heads,n,S", CASES)
@pytest.mark.parametrize("layout", ["buffer view", "list"])
def test_kernel_equals_float64_autograd(kernel, key_norm, heads, n, S, layout):
    # D = 40: one two-vector chunk, one single vector and a scalar tail of float64 per head at heads 1 and 2
    v, q, kw, _ = two_phase_inputs(n=n, S=S, B=3, T=5, D=40, heads=heads, seed=11)
    g = torch.Generator().manual_seed(12)
    gh = torch.randn(3, 5, S, 40, generator=g, dtype=torch.float64)
    glse = torch.randn(3, 5, S, heads, generator=g, dtype=torch.float64)
    h, lse, gv, du = reference_grads(v, q, kw, kernel, key_norm, gh, glse)

    buffer = torch.randn(3, 5, n + 3, 40, dtype=torch.float64)  # the stream's buffer: rows 1..n hold the sources
    buffer[:, :, 1 : n + 1] = v.permute(1, 2, 0, 3)
    values = buffer[:, :, 1 : n + 1]
    inv = inverse_rms(values, EPS) if key_norm else None
    if layout == "list":
        values = [x.contiguous() for x in values.unbind(2)]
        inv = [x.contiguous() for x in inv.unbind(2)] if inv is not None else None
    weights = kw if key_norm else None
    stats = cpu.phase1(values, inv, q, weights, kernel=kernel)
    torch.testing.assert_close(stats.h, h, **F64)
    torch.testing.assert_close(stats.lse, lse if kernel == "softmax" else torch.zeros_like(lse), **F64)
    got_gv, got_du = cpu.phase1_backward(values, inv, q, weights, stats.lse, gh, glse, kernel=kernel)
    torch.testing.assert_close(got_gv, gv, **F64)
    torch.testing.assert_close(got_du, du, **F64)
    no_du = cpu.phase1_backward(values, inv, q, weights, stats.lse, gh, None, kernel=kernel, needs_du=False)
    assert no_du[1] is None
    if kernel == "sigmoid":  # grad_lse is not read
        torch.testing.assert_close(no_du[0], gv, **F64)


@needs_kernel
def test_float32_kernel_within_float32_rounding_of_float64():
    v, q, kw, _ = two_phase_inputs(n=6, S=4, B=2, T=7, D=64, seed=13)
    g = torch.Generator().manual_seed(14)
    gh = torch.randn(2, 7, 4, 64, generator=g, dtype=torch.float64)
    glse = torch.randn(2, 7, 4, 1, generator=g, dtype=torch.float64)
    h, lse, gv, du = reference_grads(v, q, kw, "softmax", True, gh, glse)
    values = v.permute(1, 2, 0, 3).float()
    inv = inverse_rms(values, EPS)
    stats = cpu.phase1(values, inv, q.float(), kw.float())
    assert stats.h.dtype == torch.float32
    torch.testing.assert_close(stats.h.double(), h, rtol=1e-5, atol=1e-5)
    got_gv, got_du = cpu.phase1_backward(values, inv, q.float(), kw.float(), stats.lse, gh.float(), glse.float())
    torch.testing.assert_close(got_gv.double(), gv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_du.double(), du, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_threads_split_the_tokens_to_the_same_result(monkeypatch):
    v, q, kw, _ = two_phase_inputs(n=4, S=2, B=3, T=11, D=24, seed=15)
    values = v.permute(1, 2, 0, 3)
    inv = inverse_rms(values, EPS)
    gh = torch.randn(3, 11, 2, 24, dtype=torch.float64)

    def run():
        stats = cpu.phase1(values, inv, q, kw)
        return (*stats, *cpu.phase1_backward(values, inv, q, kw, stats.lse, gh, None))

    one = run()
    monkeypatch.setattr(cpu, "PARALLEL_MIN_VALUES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(split[:3], one[:3], strict=True):
        assert torch.equal(a, b)  # per token: the same arithmetic in any thread
    torch.testing.assert_close(split[3], one[3], **F64)  # du: partial sums added in another grouping


@pytest.fixture(params=["kernel", "torch"])
def cpu_form(request, monkeypatch):
    """Both CPU forms of Phase 1: the compiled kernel, and torch's products (``ATTNRES_CPU_KERNEL=0``)."""
    if request.param == "kernel" and cpu.kernel() is None:
        pytest.skip(f"the CPU kernel does not build here: {cpu.status()}")
    monkeypatch.setenv(cpu.ENV, "1" if request.param == "kernel" else "0")
    return request.param


@pytest.mark.parametrize("kernel,key_norm", [("softmax", True), ("sigmoid", False)])
def test_custom_op_gradcheck_both_ways(cpu_form, kernel, key_norm):
    assert fused.phase1_kernels_for(torch.zeros(1)) is (cpu if cpu_form == "kernel" else None)
    v, q, kw, _ = two_phase_inputs(n=3, S=2, B=2, T=2, D=6, heads=2, seed=16)
    sources = [x.clone().requires_grad_() for x in v.unbind(0)]

    def f(*xs):
        *srcs, qq, kk = xs
        inv = [inverse_rms(x, EPS).detach() for x in srcs] if key_norm else []
        h, lse = library.phase1_op(list(srcs), inv, qq, kk if key_norm else None, kernel)
        return h, lse

    inputs = (*sources, q.clone().requires_grad_(), kw.clone().requires_grad_())
    # the key norm's gradient is taken through the sources (inv_rms is detached above on purpose)
    assert torch.autograd.gradcheck(f, inputs)


def test_eager_block_model_equals_with_and_without_the_kernel(monkeypatch):
    """A float64 Block AttnRes model's loss and every gradient through the eager fused path, both ways."""
    if cpu.kernel() is None:
        pytest.skip(f"the CPU kernel does not build here: {cpu.status()}")
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=2, residual="block", attnres_blocks=2)
    torch.manual_seed(0)
    model = randomize(AttnResLM(cfg).double())
    x = torch.randint(0, 61, (2, 9))

    def grads():
        model.zero_grad()
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    calls = []
    for name in ("phase1", "phase1_backward"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    monkeypatch.setenv(cpu.ENV, "1")
    with_kernel = grads()
    assert "phase1" in calls and "phase1_backward" in calls  # the eager path ran the kernel both ways
    calls.clear()
    monkeypatch.setenv(cpu.ENV, "0")
    without = grads()
    assert not calls
    assert len(with_kernel) == len(without) > 10
    for a, b in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_no_compiler_falls_back_to_torch_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "_STATE", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu.ENV, "auto")
    assert cpu.kernel() is None
    assert "no C++ compiler" in cpu.status() and "CXX" in cpu.status()
    assert fused.phase1_kernels_for(torch.zeros(1)) is None
    v, q, kw, _ = two_phase_inputs(n=3, S=2, seed=17)
    h, lse = library.phase1_op(list(v.unbind(0)), [], q, kw, "softmax")  # torch's products
    want = two_phase_reference.phase1(v.permute(1, 2, 0, 3), None, q, kw)
    torch.testing.assert_close(h, want.h, **F64)
    monkeypatch.setenv(cpu.ENV, "1")
    with pytest.raises(RuntimeError, match="ATTNRES_CPU_KERNEL=1 but the CPU kernel is not available: no C"):
        cpu.kernel()


def test_a_failing_build_falls_back_and_keeps_the_complaint(monkeypatch, tmp_path):
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu, "_STATE", {})
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu.ENV, "auto")
    assert cpu.kernel() is None
    assert "failed" in cpu.status() and "this compiler is broken" in cpu.status()
    assert not list((tmp_path / "cache").glob("*"))  # no half-written library left behind


def test_non_cpu_tensors_are_refused_by_name():
    with pytest.raises(ValueError, match="CPU tensors only"):
        cpu._operands([torch.zeros(1, 1, 4, device="meta")], None, torch.zeros(1, 4), None)
