"""The backend table (``attnres.ops.backends``): every backend this machine has, run through the table
(``forced``, with ``record`` showing what ran) against float64 torch references on random inputs, forward
and backward (gradcheck at tiny sizes); a backend this machine lacks skips with the table's reason. The
Triton kernels run in Triton's CPU interpreter without a GPU (tests/interpreted_triton.py). Then the
choice itself: environment variables, devices, dtypes, shapes, compile state, what the forward ran."""

import dataclasses
import importlib

import pytest
import torch
from interpreted_triton import DEVICE, ON_GPU
from reference import randomize, two_phase_inputs

from attnres import AttnResLM, ModelConfig
from attnres.ops import backends
from attnres.ops.backends import Case, choose, forced, record
from attnres.ops.common import DepthStats, RMSNormArgs, inverse_rms
from attnres.ops.depth_attention import depth_attention_reference, fused_depth_attention
from attnres.ops.rms_norm import plain_rms_norm, rms_norm
from attnres.ops.two_phase import compiled, cpu, fused, library
from attnres.ops.two_phase import reference as two_phase_reference

EPS = 1e-6
F64 = dict(rtol=1e-9, atol=1e-11)


def runnable(backend: str) -> str:
    """The device this backend's inputs live on; skips with the table's reason where it cannot run here."""
    ok, why = backends.availability(backend)
    if not ok:
        pytest.skip(f"{backend}: {why}")
    if backend == "triton":
        if not ON_GPU and not importlib.import_module("attnres.ops.depth_attention.triton").INTERPRETED:
            pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file alone")
        return DEVICE
    return "cpu"


def ran(found, op: str) -> set[tuple[str, str]]:
    return {(c.phase, c.backend) for c in found if c.op == op}


# ----------------------------------------------------------------------------- every backend, through the table


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("heads,per_token,kernel", [(1, False, "softmax"), (2, True, "sigmoid")])
def test_depth_attention_backends_equal_the_float64_reference(backend, heads, per_token, kernel):
    device = runnable(backend)
    g = torch.Generator().manual_seed(3)
    k, b, t, d = 3, 1, 2, 4
    sources = (torch.randn(k, b, t, d, generator=g, dtype=torch.float64) * 1.5 + 0.2).to(device)
    shape = ((b, t) if per_token else ()) + ((d,) if heads == 1 else (heads, d // heads))
    query = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    key_weight = (torch.rand(d, generator=g, dtype=torch.float64) + 0.5).to(device)

    def through_table(q, kw, *producers):
        segments = (torch.stack(producers, dim=2),)
        return fused_depth_attention(segments, producers, q, kw, eps=EPS, kernel=kernel)

    leaves = [x.clone().requires_grad_() for x in (query, key_weight, *sources.unbind(0))]
    gh = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    with forced("depth_attention", backend), record() as found:
        h = through_table(*leaves)
        got = torch.autograd.grad(h, leaves, gh.to(device))
        assert torch.autograd.gradcheck(through_table, tuple(leaves), eps=1e-6, atol=1e-7)
    assert ran(found, "depth_attention") == {("forward", backend)}  # the backward follows its Function

    want_leaves = [x.detach().cpu().clone().requires_grad_() for x in leaves]
    want = depth_attention_reference(
        torch.stack(want_leaves[2:]), want_leaves[0], want_leaves[1], eps=EPS, kernel=kernel
    ).h
    torch.testing.assert_close(h.detach().cpu(), want.detach(), **F64)
    for a, w in zip(got, torch.autograd.grad(want, want_leaves, gh), strict=True):
        torch.testing.assert_close(a.cpu(), w, **F64)


def phase1_case(heads, key_norm, kernel, seed=5, n=3, s=2, d=4):
    v, q, kw, _ = two_phase_inputs(n=n, S=s, B=1, T=2, D=d, heads=heads, seed=seed)
    return v, q, kw if key_norm else None


def phase1_reference(v, q, kw, kernel):
    """(h [B, T, S, D], lse [B, T, S, H]) of float64 autograd through reference.phase1, from [n, B, T, D]."""
    values = v.permute(1, 2, 0, 3)
    return two_phase_reference.phase1(
        values, inverse_rms(values, EPS) if kw is not None else None, q, kw, kernel=kernel
    )


def check_phase1(run, backend, op, v, q, kw, kernel, device):
    """``run(sources..., q, kw) -> (h, lse)`` through the table with ``backend`` forced, against the reference:
    values, gradients of a random loss, and gradcheck."""
    g = torch.Generator().manual_seed(9)
    leaves = [x.to(device).clone().requires_grad_() for x in (*v.unbind(0), q, *([kw] if kw is not None else []))]
    want_leaves = [x.detach().cpu().clone().requires_grad_() for x in leaves]
    n = v.shape[0]

    def split(xs):
        return list(xs[:n]), xs[n], (xs[n + 1] if kw is not None else None)

    want = phase1_reference(torch.stack(want_leaves[:n]), *split(want_leaves)[1:], kernel)
    gh = torch.randn(want.h.shape, generator=g, dtype=torch.float64)
    glse = torch.randn(want.lse.shape, generator=g, dtype=torch.float64) if kernel == "softmax" else None

    def loss(h, lse):
        return (h * gh.to(h.device)).sum() + ((lse * glse.to(lse.device)).sum() if glse is not None else 0)

    with forced(op, backend), record() as found:
        h, lse = run(*split(leaves))
        got = torch.autograd.grad(loss(h, lse), leaves)
        assert torch.autograd.gradcheck(lambda *xs: run(*split(xs)), tuple(leaves), eps=1e-6, atol=1e-7)
    assert ("forward", backend) in ran(found, op)
    torch.testing.assert_close(h.detach().cpu(), want.h.detach(), **F64)
    if kernel == "softmax":
        torch.testing.assert_close(lse.detach().cpu(), want.lse.detach(), **F64)
    for a, w in zip(got, torch.autograd.grad(loss(want.h, want.lse), want_leaves), strict=True):
        torch.testing.assert_close(a.cpu(), w, **F64)
    return found


PHASE1_CASES = [(1, True, "softmax"), (2, False, "softmax"), (1, True, "sigmoid")]


@pytest.mark.parametrize("backend", ["triton", "cpu_kernel", "torch"])
@pytest.mark.parametrize("heads,key_norm,kernel", PHASE1_CASES)
def test_phase1_backends_equal_the_float64_reference(backend, heads, key_norm, kernel):
    device = runnable(backend)
    v, q, kw = phase1_case(heads, key_norm, kernel)

    def run(sources, queries, weights):
        values = torch.stack(sources, dim=2)
        inv = inverse_rms(values, EPS).detach() if weights is not None else None
        h1s, lse = fused.phase1_outputs(values.detach(), inv, queries, weights, sources, kernel=kernel)
        return torch.stack(h1s, dim=2), lse

    found = check_phase1(run, backend, "phase1", v, q, kw, kernel, device)
    assert ran(found, "phase1") == {("forward", backend), ("backward", backend)}


@pytest.mark.parametrize("backend", ["triton", "cpu_kernel", "torch"])
@pytest.mark.parametrize("heads,key_norm,kernel", PHASE1_CASES)
def test_phase1_custom_op_backends_equal_the_float64_reference(backend, heads, key_norm, kernel):
    device = runnable(backend)
    v, q, kw = phase1_case(heads, key_norm, kernel, seed=6)

    def run(sources, queries, weights):
        inv = [inverse_rms(x, EPS).detach() for x in sources] if weights is not None else []
        return library.phase1_op(list(sources), inv, queries, weights, kernel)

    found = check_phase1(run, backend, "phase1_op", v, q, kw, kernel, device)
    assert ran(found, "phase1_op") == {("forward", backend), ("backward", backend)}


@pytest.mark.parametrize("backend", ["pointwise", "custom_op"])
@pytest.mark.parametrize("heads,key_norm,kernel", PHASE1_CASES)
def test_phase1_sources_backends_equal_the_float64_reference(backend, heads, key_norm, kernel):
    device = runnable(backend)
    v, q, kw = phase1_case(heads, key_norm, kernel, seed=7)

    def run(sources, queries, weights):
        inv = [inverse_rms(x, EPS) for x in sources] if weights is not None else None
        h1s, lse = compiled.phase1_sources(sources, inv, queries, weights, kernel=kernel)
        return torch.stack(h1s, dim=2), lse

    found = check_phase1(run, backend, "phase1_sources", v, q, kw, kernel, device)
    # the custom op runs the phase1_op choice inside; the pointwise form runs no other op
    assert ("phase1_op" in {c.op for c in found}) == (backend == "custom_op")


def merge_inputs(device, heads=2, seed=8):
    v, q, kw, _ = two_phase_inputs(n=4, S=2, B=1, T=2, D=4, heads=heads, seed=seed)
    values = v.permute(1, 2, 0, 3)
    inv = inverse_rms(values, EPS)
    a = two_phase_reference.phase1(values[:, :, :2], inv[:, :, :2], q, kw)
    b = two_phase_reference.phase1(values[:, :, 2:], inv[:, :, 2:], q, kw)
    return DepthStats(*(x.to(device) for x in a)), DepthStats(*(x.to(device) for x in b))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
def test_merge_backends_equal_the_float64_reference(backend, kernel):
    device = runnable(backend)
    a, b = merge_inputs(device)
    want = two_phase_reference.merge(DepthStats(*(x.cpu() for x in a)), DepthStats(*(x.cpu() for x in b)), kernel)
    with forced("merge", backend, phase="forward"), record() as found:
        got = fused.merge(a, b, kernel)
    assert ran(found, "merge") == {("forward", backend)}
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x.cpu(), y, **F64)
    if backend == "reference":  # the only one with a backward
        leaves = tuple(x.clone().requires_grad_() for x in (*a, *b))
        with forced("merge", backend, phase="forward"):
            merged = lambda *xs: tuple(fused.merge(DepthStats(*xs[:2]), DepthStats(*xs[2:]), kernel))  # noqa: E731
            assert torch.autograd.gradcheck(merged, leaves)


def check_against_reference(op, backend, run, leaves, want, g, gradgrad):
    """``run(*leaves)`` with ``op`` pinned to ``backend``: it ran that backend, passes gradcheck (and
    gradgradcheck), and equals ``want`` in value and in the gradients of a random output gradient."""
    with forced(op, backend), record() as found:
        got = run(*leaves)
        assert torch.autograd.gradcheck(run, leaves)
        if gradgrad:
            assert torch.autograd.gradgradcheck(run, leaves)
    assert ran(found, op) == {("forward", backend)}
    torch.testing.assert_close(got, want, **F64)
    gx = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad(y, leaves, gx, allow_unused=True) for y in (got, want)]
    for a, w in zip(*grads, strict=True):
        assert (a is None) == (w is None)
        if a is not None:
            torch.testing.assert_close(a, w, **F64)


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch", "reference"])
@pytest.mark.parametrize("norm", ["none", "weighted", "unweighted"])
def test_merge_partial_backends_equal_the_float64_reference(backend, norm):
    """Phase 2, alone and with the RMSNorm after it (which the C++ kernel fuses), against the float64
    reference; h1 read as a query's slice of Phase 1's [B, T, S, D] output, as streams pass it."""
    runnable(backend)
    v, q, kw, p = two_phase_inputs(n=3, S=2, B=2, T=3, D=6, seed=10)
    values = v.permute(1, 2, 0, 3)
    stats = two_phase_reference.phase1(values, inverse_rms(values, EPS), q, kw)
    g = torch.Generator().manual_seed(11)
    weight = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    h1 = stats.h.clone().requires_grad_()  # [B, T, S, D]: its slice [:, :, 1] is strided
    leaves = (stats.lse[:, :, 1].clone(), p.clone(), q[1].clone(), kw[1].clone(), weight)
    leaves = (h1, *(x.requires_grad_() for x in leaves))

    def rms(w):
        return None if norm == "none" else RMSNormArgs(w if norm == "weighted" else None, 1e-5)

    def run(h, lse, partial, query, key_weight, w):
        return fused.merge_partial(DepthStats(h[:, :, 1], lse), partial, query, key_weight, EPS, norm=rms(w))

    want = two_phase_reference.merge_partial(DepthStats(h1[:, :, 1], leaves[1]), *leaves[2:5], EPS, norm=rms(leaves[5]))
    # a graph of the gradient: the kernel's Function hands over to torch's form
    check_against_reference("merge_partial", backend, run, leaves, want, g, gradgrad=backend == "cpu_kernel")


@pytest.mark.parametrize("backend", ["cpu_kernel", "reference"])
@pytest.mark.parametrize("norm", ["none", "weighted", "unweighted"])
def test_merge_norm_backends_equal_the_float64_reference(backend, norm):
    """Full AttnRes' read inside a group: the group's Phase 1 merged with the Phase 1 over the sources completed
    inside it, and the RMSNorm after it (which the C++ kernel fuses), against the float64 reference, values,
    gradients and (the kernel's Function hands over to the reference) a graph of the gradient; h1 read as a
    query's strided slice of Phase 1's [B, T, S, D] output, as streams pass it."""
    runnable(backend)
    v, q, kw, _ = two_phase_inputs(n=3, S=2, B=2, T=3, D=6, seed=20)
    values = v.permute(1, 2, 0, 3)
    group = two_phase_reference.phase1(values[:, :, :2], inverse_rms(values[:, :, :2], EPS), q, kw)
    inside = two_phase_reference.phase1(values[:, :, 2:], inverse_rms(values[:, :, 2:], EPS), q[1:], kw[1:])
    g = torch.Generator().manual_seed(21)
    weight = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    leaves = tuple(
        x.clone().requires_grad_()
        for x in (group.h, group.lse[:, :, 1], inside.h[:, :, 0], inside.lse[:, :, 0] + 0.7, weight)
    )

    def rms(w):
        return None if norm == "none" else RMSNormArgs(w if norm == "weighted" else None, 1e-5)

    def run(h1, lse1, h2, lse2, w, impl=fused):
        return impl.merge_norm(DepthStats(h1[:, :, 1], lse1), DepthStats(h2, lse2), "softmax", rms(w))

    want = run(*leaves, impl=two_phase_reference)
    check_against_reference("merge_norm", backend, run, leaves, want, g, gradgrad=True)


def test_full_attnres_reads_inside_a_group_run_one_merge_norm_kernel_call():
    """A float64 Full AttnRes model, eagerly: every read inside a Phase-1 group is one merge_norm call (the C++
    kernel where it builds), and the model's loss and every gradient equal those of the merge-then-norm
    reference."""
    runnable("cpu_kernel")
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=2, residual="full", attnres_group_size=4)
    torch.manual_seed(0)
    x = torch.randint(0, 61, (2, 9))
    results = []
    for backend in ("cpu_kernel", "reference"):
        torch.manual_seed(0)
        model = randomize(AttnResLM(cfg).double())
        with forced("merge_norm", backend), record() as found:
            loss = model(x).logsumexp(-1).mean()
            loss.backward()
        assert ran(found, "merge_norm") == {("forward", backend)}
        assert sum(c.op == "merge_norm" for c in found) == 6  # 2 groups of 4 reads, 3 inside each
        results.append([loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1]) > 10
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("backend", ["cpu_kernel", "reference"])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_backends_equal_the_float64_reference(backend, weighted):
    runnable(backend)
    g = torch.Generator().manual_seed(13)
    wide = torch.randn(2, 3, 2, 5, generator=g, dtype=torch.float64) * 2 + 0.3
    h = wide.requires_grad_()  # read as [:, :, 0]: rows 10 values apart, as a Phase-1 slice
    weight = (torch.rand(5, generator=g, dtype=torch.float64) + 0.5).requires_grad_() if weighted else None
    leaves = (h, weight) if weighted else (h,)

    def run(x, w=None):
        return rms_norm(x[:, :, 0], RMSNormArgs(w, 1e-4))

    with forced("rms_norm", backend), record() as found:
        got = run(*leaves)
        assert torch.autograd.gradcheck(run, leaves)
        assert torch.autograd.gradgradcheck(run, leaves)
    assert ran(found, "rms_norm") == {("forward", backend)}
    want = torch.nn.functional.rms_norm(h[:, :, 0], (5,), weight, 1e-4)
    torch.testing.assert_close(got, want, **F64)
    for a, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves), strict=True):
        torch.testing.assert_close(a, w, **F64)


def test_only_a_plain_rms_norm_is_computed_by_the_stream():
    norm = torch.nn.RMSNorm(8, eps=1e-5)
    assert plain_rms_norm(norm) == (norm.weight, 1e-5)
    assert plain_rms_norm(torch.nn.RMSNorm(8, elementwise_affine=False)) == (None, None)
    assert plain_rms_norm(torch.nn.LayerNorm(8)) is None
    assert plain_rms_norm(torch.nn.RMSNorm((4, 8))) is None  # over two dimensions

    class Scaled(torch.nn.RMSNorm):
        pass

    assert plain_rms_norm(Scaled(8)) is None  # a subclass may change forward
    handle = norm.register_forward_hook(lambda *args: None)
    assert plain_rms_norm(norm) is None  # the kernel would skip the hook
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    assert plain_rms_norm(norm) is None
    handle.remove()


# ----------------------------------------------------------------------------- the choice


def test_every_op_names_known_backends_and_every_backend_says_whether_it_runs():
    for op in backends.OPS.values():
        assert op.backends and set(op.backends) <= set(backends.BACKENDS), op.name
        for phase in backends.PHASES:
            assert choose(op.name, phase, Case(), load=False).backend in op.backends
    for name in backends.BACKENDS:
        ok, why = backends.availability(name)
        assert isinstance(ok, bool) and why
    with pytest.raises(ValueError, match="op='phase3' is not known; use one of"):
        choose("phase3")
    with pytest.raises(ValueError, match="phase='sideways' is not known"):
        choose("merge", "sideways")
    with (
        pytest.raises(ValueError, match="backend='cpu_kernel' is not one of merge's backends"),
        forced("merge", "cpu_kernel"),
    ):
        pass


GPU16 = Case(device="cuda", dtype=torch.bfloat16, d=64)


@pytest.mark.parametrize("op", ["depth_attention", "phase1", "phase1_op", "merge"])
def test_cuda_tensors_run_triton_unless_turned_off_or_float64(op):
    assert choose(op, "forward", GPU16, env={}, load=False).backend == "triton"
    assert choose(op, "forward", Case(device="cuda", dtype=torch.float32, d=64), env={}, load=False).backend == "triton"
    off = choose(op, "forward", GPU16, env={"ATTNRES_TRITON": "0"}, load=False)
    assert off.backend != "triton" and "ATTNRES_TRITON=0" in off.reason
    f64 = choose(op, "forward", Case(device="cuda", dtype=torch.float64), env={}, load=False)
    assert f64.backend != "triton" and "float64" in f64.reason
    on_cpu = choose(op, "forward", Case(d=64), env={"ATTNRES_CPU_KERNEL": "0"}, load=False)
    assert on_cpu.backend != "triton" and "CUDA" in on_cpu.reason


def test_the_cpu_kernel_follows_its_variable_the_compiler_and_the_build(monkeypatch):
    off = choose("phase1", "forward", Case(), env={"ATTNRES_CPU_KERNEL": "0"})
    assert off.backend == "torch" and "ATTNRES_CPU_KERNEL=0" in off.reason
    tracing = choose("phase1", "forward", Case(compiling=True), env={})
    assert tracing.backend == "torch" and "torch.compile" in tracing.reason
    assert choose("phase1", "forward", Case(device="cuda"), env={"ATTNRES_TRITON": "0"}).backend == "torch"
    if cpu.kernel() is not None:
        for setting in ({}, {"ATTNRES_CPU_KERNEL": "1"}, {"ATTNRES_CPU_KERNEL": "auto"}):
            choice = choose("phase1", "forward", Case(), env=setting)
            assert choice.backend == "cpu_kernel" and choice.kernels is cpu
    monkeypatch.setattr(cpu, "_STATE", {"lib": cpu._Loaded(None, "no C++ compiler ('c++' is not on PATH)")})
    missing = choose("phase1_op", "backward", Case(), env={})
    assert missing.backend == "torch" and "no C++ compiler" in missing.reason
    with pytest.raises(RuntimeError, match="ATTNRES_CPU_KERNEL=1 but the CPU kernel is not available: no C"):
        choose("phase1", "forward", Case(), env={"ATTNRES_CPU_KERNEL": "1"})
    assert backends.availability("cpu_kernel") == (False, "no C++ compiler ('c++' is not on PATH)")


def test_a_backward_follows_its_forward_unless_a_graph_or_the_width_forbids():
    for forward in ("cpu_kernel", "triton"):
        case = Case(device="cpu" if forward == "cpu_kernel" else "cuda", d=64, forward=forward)
        assert choose("phase1", "backward", case, load=False).backend == forward
        graph = choose("phase1", "backward", Case(d=64, forward=forward, create_graph=True), load=False)
        assert graph.backend == "torch" and "create_graph" in graph.reason
    assert choose("phase1", "backward", Case(forward="torch")).backend == "torch"
    # S = 8 queries of 4096 channels: 8 * 4096 > 16384 for the backward kernel, while the forward fits
    wide = Case(device="cuda", dtype=torch.bfloat16, d=4096, queries=8)
    assert choose("phase1", "forward", wide, load=False).backend == "triton"
    back = choose("phase1", "backward", dataclasses.replace(wide, forward="triton"), load=False)
    assert back.backend == "torch" and "too wide" in back.reason
    assert choose("phase1_op", "backward", wide, load=False).backend == "torch"
    too_wide = Case(device="cuda", dtype=torch.bfloat16, d=16384)
    for op in ("phase1", "depth_attention"):
        assert choose(op, "forward", too_wide, load=False).backend == "torch"
    assert choose("depth_attention", "backward", Case(forward="triton")).backend == "triton"
    assert choose("depth_attention", "backward", Case(forward="torch")).backend == "torch"


def test_compiled_phase1_form_and_the_small_ops(monkeypatch):
    assert choose("phase1_sources", "forward", Case(device="cuda", sources=2, queries=2)).backend == "pointwise"
    assert choose("phase1_sources", "forward", Case(device="cuda", sources=3, queries=2)).backend == "custom_op"
    assert choose("phase1_sources", "backward", Case(device="cpu", sources=8, queries=4)).backend == "pointwise"
    monkeypatch.setattr(backends, "CUSTOM_OP_DEVICES", frozenset({"cpu", "cuda"}))  # read at call time
    assert choose("phase1_sources", "forward", Case(device="cpu", sources=8, queries=4)).backend == "custom_op"
    assert not compiled.pointwise_phase1(8, 4, "cpu")
    grad = choose("merge", "forward", Case(device="cuda", grad=True), load=False)
    assert grad.backend == "reference" and "gradient" in grad.reason
    assert choose("merge", "backward", GPU16, load=False).backend == "reference"
    eager = "cpu_kernel" if cpu.kernel() is not None else "torch"
    assert choose("merge_partial", "forward", Case()).backend == eager
    assert choose("rms_norm", "forward", Case()).backend == ("cpu_kernel" if eager == "cpu_kernel" else "reference")
    # a decoded token's norm is one torch call: below the threshold a kernel call's dispatch costs more
    small = Case(values=backends.RMS_NORM_MIN_VALUES - 1)
    assert (
        choose("rms_norm", "forward", small).backend == "reference"
        and "values" in choose("rms_norm", "forward", small).reason
    )
    large = Case(values=backends.RMS_NORM_MIN_VALUES)
    assert choose("rms_norm", "forward", large).backend == choose("rms_norm", "forward", Case()).backend
    for case in (Case(compiling=True), Case(dtype=torch.bfloat16), Case(device="cuda", compiling=True)):
        assert choose("merge_partial", "forward", case).backend == "torch"
        assert choose("rms_norm", "forward", case).backend == "reference"
    # CUDA: the Triton merge + norm where triton is installed, else the lean Function
    cuda = choose("merge_partial", "forward", Case(device="cuda"), load=False)
    assert cuda.backend == ("triton" if backends.triton_version() is not None else "torch")
    off = choose("merge_partial", "forward", Case(device="cuda"), env={"ATTNRES_TRITON": "0"}, load=False)
    assert off.backend == "torch" and "ATTNRES_TRITON=0" in off.reason
    assert choose("merge_partial", "forward", Case(), env={"ATTNRES_CPU_KERNEL": "0"}).backend == "torch"
    for case in (Case(heads=2), Case(kernel="sigmoid"), Case(key_norm=False)):
        assert choose("merge_partial", "forward", case).backend == "reference"
    asked = Case(reference="impl='reference'")
    assert choose("depth_attention", "forward", asked).reason == "impl='reference'"
    with forced("depth_attention", "torch"):  # a reference asked for by name is never overridden
        assert choose("depth_attention", "forward", asked).backend == "reference"


def test_forced_backends_that_cannot_run_the_case_say_why():
    with forced("merge_partial", "torch"), pytest.raises(ValueError, match="one head, softmax and key norm"):
        choose("merge_partial", "forward", Case(heads=2))
    with forced("phase1", "cpu_kernel", phase="backward"), pytest.raises(ValueError, match="its forward ran 'torch'"):
        choose("phase1", "backward", Case(forward="torch"))
    with forced("phase1", "torch"):
        assert choose("phase1", "forward", Case()).reason == "pinned by attnres.ops.backends.forced"
    assert not backends._FORCED  # the block left nothing pinned


def test_the_dispatch_sites_record_the_table_s_choice(monkeypatch):
    v, q, kw, _ = two_phase_inputs(n=3, S=2, B=2, T=3, D=8, seed=12)
    values = v.permute(1, 2, 0, 3).float()
    producers = [x.clone().requires_grad_() for x in values.unbind(2)]
    for setting in ("0", "auto"):
        monkeypatch.setenv("ATTNRES_CPU_KERNEL", setting)
        want = choose("phase1", "forward", Case.like(values, queries=2, sources=3))
        with record() as found:
            h1s, lse = fused.phase1_outputs(values, inverse_rms(values, EPS), q.float(), kw.float(), producers)
            sum(h.sum() for h in h1s).backward()
        assert [(c.op, c.phase, c.backend) for c in found] == [
            ("phase1", "forward", want.backend),
            ("phase1", "backward", want.backend),
        ]
    with record() as found:
        fused_depth_attention([values], producers, q[0].float(), kw[0].float())
    assert [(c.op, c.backend) for c in found] == [("depth_attention", "torch")]
    assert "cpu tensors" in found[0].reason


def test_the_dispatch_traces_whole_under_the_compiler():
    """The table is asked while dynamo traces (the compiled streams): no graph break, no recording."""
    v, q, kw, p = two_phase_inputs(n=3, S=2, B=1, T=2, D=8, seed=13)
    sources = list(v.unbind(0))

    def step(sources, q, kw, p):
        h1s, lse = compiled.phase1_sources(sources, [inverse_rms(x, EPS) for x in sources], q, kw)
        stats = DepthStats(h1s[0], lse[:, :, 0])
        h = fused.merge(stats, stats).h + fused.merge_partial(stats, p, q[0], kw[0], EPS)
        return h + fused_depth_attention([torch.stack(sources, dim=2)], sources, q[0], kw[0])

    torch._dynamo.reset()
    with record() as found:
        got = torch.compile(step, fullgraph=True, backend="eager")(sources, q, kw, p)
    assert not found
    torch.testing.assert_close(got, step(sources, q, kw, p), **F64)
