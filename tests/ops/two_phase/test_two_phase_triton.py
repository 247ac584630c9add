"""The Triton Phase-1 (forward and backward) and merge kernels against the reference two-phase ops (the
backward against float64 autograd through it; tests/interpreted_triton.py says how they run without a
GPU). float64 runs the kernels in float64: 1e-12; float32 must match the float64 reference to rtol 1e-4,
atol 1e-5."""

import pytest
import torch
from interpreted_triton import DEVICE, ON_GPU, import_kernels

tp = import_kernels("attnres.ops.two_phase.triton")

from attnres.ops import depth_attention  # noqa: E402
from attnres.ops.common import DepthStats, inverse_rms  # noqa: E402
from attnres.ops.two_phase import fused, library, triton_backward  # noqa: E402
from attnres.ops.two_phase import reference as two_phase_reference  # noqa: E402

EPS = 1e-6
F64 = dict(rtol=1e-12, atol=1e-12)
F32 = dict(rtol=1e-4, atol=1e-5)


def make_block(K=4, S=3, B=2, T=3, D=8, heads=1, dtype=torch.float64, seed=10, extra_rows=2):
    """K sources as the first rows of a wider [B, T, K + extra, D] buffer (read in place), S queries."""
    g = torch.Generator().manual_seed(seed)
    sources = torch.randn(K, B, T, D, generator=g, dtype=torch.float64) * 2 + 0.3
    queries = torch.randn(S, D, generator=g, dtype=torch.float64)
    if heads > 1:
        queries = queries.view(S, heads, D // heads)
    key_weights = torch.rand(S, D, generator=g, dtype=torch.float64) + 0.5
    buffer = torch.full((B, T, K + extra_rows, D), 99.0, dtype=torch.float64)
    buffer[:, :, :K] = sources.movedim(0, 2)
    buffer, queries, key_weights = (x.to(DEVICE, dtype) for x in (buffer, queries, key_weights))
    return buffer[:, :, :K], queries, key_weights


def phase1_both(values, queries, key_weights, key_norm, kernel):
    inv = inverse_rms(values, EPS) if key_norm else None
    kw = key_weights if key_norm else None
    return (
        tp.phase1(values, inv, queries, kw, kernel=kernel),
        two_phase_reference.phase1(
            values.double(),
            None if inv is None else inv.double(),
            queries.double(),
            None if kw is None else kw.double(),
            kernel=kernel,
        ),
    )


@pytest.mark.parametrize("heads,D,S,K", [(1, 8, 3, 4), (2, 6, 5, 2), (3, 12, 1, 1)])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
def test_phase1_matches_reference(heads, D, S, K, key_norm, kernel):
    values, queries, kws = make_block(K=K, S=S, D=D, heads=heads)
    got, want = phase1_both(values, queries, kws, key_norm, kernel)
    assert got.h.shape == (2, 3, S, D) and got.lse.shape == (2, 3, S, heads)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **F64)
    # float32 sources: float32 statistics, close to the float64 ones
    got32, _ = phase1_both(values.float(), queries.float(), kws.float(), key_norm, kernel)
    assert got32.h.dtype == got32.lse.dtype == torch.float32
    for a, b in zip(got32, want, strict=True):
        torch.testing.assert_close(a.double(), b, **F32)


def test_phase1_many_tokens_and_queries():
    # several token tiles and (for a wide D) several query tiles per program grid
    values, queries, kws = make_block(K=3, S=6, B=2, T=40, D=16, heads=2, seed=11)
    got, want = phase1_both(values, queries, kws, True, "softmax")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
def test_merge_matches_reference_and_is_exact(heads, kernel):
    values, queries, kws = make_block(K=5, S=2, D=8, heads=heads)
    inv = inverse_rms(values, EPS)
    a = tp.phase1(values[:, :, :3], inv[:, :, :3], queries, kws, kernel=kernel)
    b = tp.phase1(values[:, :, 3:], inv[:, :, 3:], queries, kws, kernel=kernel)
    got = tp.merge(a, b, kernel)
    want = two_phase_reference.merge(a, b, kernel)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, **F64)
    whole = tp.phase1(values, inv, queries, kws, kernel=kernel)
    torch.testing.assert_close(got.h, whole.h, **F64)
    if kernel == "softmax":
        torch.testing.assert_close(got.lse, whole.lse, **F64)


def test_two_phase_block_equals_plain_forward():
    # one depth block of S sublayers over completed blocks b_0..b_{n-1} (docs/method.md §6): Phase 1
    # once, then each sublayer i >= 2 merges its one intra-block source, the partial sum
    S, D = 3, 8
    values, queries, kws = make_block(K=3, S=S, D=D, heads=2, seed=12)
    blocks = values.movedim(2, 0)
    g = torch.Generator().manual_seed(13)
    outputs = [torch.randn(2, 3, D, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(S)]
    stats = tp.phase1(values, inverse_rms(values, EPS), queries, kws)
    partial = None
    for i in range(S):
        mine = DepthStats(stats.h[:, :, i], stats.lse[:, :, i])
        if partial is None:
            h, sources = mine.h, blocks
        else:
            one = tp.phase1(
                partial.unsqueeze(2), inverse_rms(partial.unsqueeze(2), EPS), queries[i : i + 1], kws[i : i + 1]
            )
            h = tp.merge(mine, DepthStats(one.h[:, :, 0], one.lse[:, :, 0])).h
            sources = torch.cat([blocks, partial.unsqueeze(0)])
        want = depth_attention(sources, queries[i], kws[i], impl="reference")
        torch.testing.assert_close(h, want, **F64)
        partial = outputs[i] if partial is None else partial + outputs[i]


def test_refuses_what_it_cannot_do():
    values, queries, kws = make_block(K=3, S=2, D=8)
    inv = inverse_rms(values, EPS)
    with pytest.raises(RuntimeError, match="no backward"):
        tp.phase1(values, inv, queries.clone().requires_grad_(), kws)
    with torch.no_grad():  # under no_grad the same call is fine
        tp.phase1(values, inv, queries.clone().requires_grad_(), kws)
    stats = tp.phase1(values, inv, queries, kws)
    with pytest.raises(RuntimeError, match="no backward"):
        tp.merge(DepthStats(stats.h.requires_grad_(), stats.lse), stats)
    with pytest.raises(ValueError, match="queries must be"):
        tp.phase1(values, inv, torch.randn(2, 3, 2, 2, 4, dtype=torch.float64, device=DEVICE), kws)
    with pytest.raises(ValueError, match="do not line up"):
        tp.merge(stats, DepthStats(stats.h[:, :1], stats.lse[:, :1]))


# ----------------------------------------------------------------------------- routing (fused -> triton)


def route_to_triton(monkeypatch):
    """Make the fused two-phase ops take their Triton route for these (CPU, interpreted) tensors, as
    they do for CUDA float32/bfloat16/float16 ones; returns the list of kernel calls."""
    calls = []

    def kernels_for(x):
        calls.append(x.shape)
        return tp

    monkeypatch.setattr(fused, "triton_for", kernels_for)
    return calls


@pytest.mark.parametrize(
    "kernel,key_norm,heads", [("softmax", True, 1), ("softmax", True, 2), ("sigmoid", True, 1), ("softmax", False, 2)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_routed_phase1_equals_torch_forward_and_backward(monkeypatch, kernel, key_norm, heads, dtype):
    values, queries, kws = make_block(K=4, S=3, D=8, heads=heads, dtype=dtype, seed=14)
    g = torch.Generator().manual_seed(15)
    gh = [torch.randn(2, 3, 8, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(3)]
    glse = torch.randn(2, 3, 3, heads, generator=g, dtype=torch.float64).to(DEVICE)

    def run():
        producers = [values[:, :, i].clone().requires_grad_() for i in range(4)]
        q, kw = queries.clone().requires_grad_(), kws.clone().requires_grad_()
        inv = inverse_rms(values, EPS) if key_norm else None
        h1s, lse = fused.phase1_outputs(values, inv, q, kw if key_norm else None, producers, kernel=kernel)
        loss = sum((h * g_).sum() for h, g_ in zip(h1s, gh, strict=True))
        if kernel == "softmax":
            loss = loss + (lse * glse).sum()
        grads = torch.autograd.grad(loss, [q, kw, *producers] if key_norm else [q, *producers])
        return (*h1s, lse, *grads)

    want = run()
    calls = route_to_triton(monkeypatch)
    got = run()
    assert len(calls) == 1
    tol = F64 if dtype == torch.float64 else F32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("kernel,key_norm,heads", [("softmax", True, 1), ("softmax", False, 2), ("sigmoid", True, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_routed_phase1_custom_op_equals_torch_forward_and_backward(monkeypatch, kernel, key_norm, heads, dtype):
    """attnres::phase1 over a list of sources: the Triton forward and backward kernels against the torch
    forms, values and gradients; opcheck with the route on."""
    values, queries, kws = make_block(K=4, S=3, D=8, heads=heads, dtype=dtype, seed=21)
    g = torch.Generator().manual_seed(22)
    gh = torch.randn(2, 3, 3, 8, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    glse = torch.randn(2, 3, 3, heads, generator=g, dtype=torch.float64).to(DEVICE, dtype)

    def run():
        sources = [values[:, :, i].clone().requires_grad_() for i in range(4)]
        q, kw = queries.clone().requires_grad_(), kws.clone().requires_grad_()
        inv = [inverse_rms(v, EPS).detach() for v in sources] if key_norm else []
        h, lse = library.phase1_op(sources, inv, q, kw if key_norm else None, kernel)
        loss = (h * gh).sum() + ((lse * glse).sum() if kernel == "softmax" else 0)
        grads = torch.autograd.grad(loss, [q, kw, *sources] if key_norm else [q, *sources])
        return (h, lse, *grads)

    want = run()
    calls = route_to_triton(monkeypatch)
    got = run()
    assert len(calls) == 2  # the forward op and the backward op
    tol = F64 if dtype == torch.float64 else F32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)
    sources = [values[:, :, i].clone().requires_grad_() for i in range(4)]
    inv = [inverse_rms(v, EPS).detach() for v in sources] if key_norm else []
    kw = kws.clone().requires_grad_() if key_norm else None
    torch.library.opcheck(library.phase1_op, (sources, inv, queries.clone().requires_grad_(), kw, kernel))


def test_routed_merge_only_without_gradients(monkeypatch):
    values, queries, kws = make_block(K=5, S=2, D=8, heads=2, dtype=torch.float32, seed=16)
    inv = inverse_rms(values, EPS)
    a = two_phase_reference.phase1(values[:, :, :2], inv[:, :, :2], queries, kws)
    b = two_phase_reference.phase1(values[:, :, 2:], inv[:, :, 2:], queries, kws)
    want = two_phase_reference.merge(a, b)
    calls = route_to_triton(monkeypatch)
    got = fused.merge(a, b)
    assert len(calls) == 1
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, **F32)
    # a merge that needs a gradient stays with torch (the kernel has no backward)
    h = a.h.clone().requires_grad_()
    merged = fused.merge(DepthStats(h, a.lse), b)
    merged.h.sum().backward()
    assert h.grad is not None
    torch.testing.assert_close(merged.h, want.h, **F32)


@pytest.mark.parametrize(
    "residual,overrides",
    [
        ("block", {"attnres_heads": 2}),
        ("full", {"attnres_group_size": 2}),  # Phase 1 per group, then merges inside the group
        ("block", {"attnres_key_norm": False, "attnres_kernel": "sigmoid"}),
    ],
)
def test_whole_model_through_the_routed_two_phase_path(monkeypatch, residual, overrides):
    # the default attnres_impl ("two_phase"): every Phase 1 of a small float64 model (forward and
    # backward) and every merge of a no-grad forward go through the Triton kernels: same results
    from reference import randomize

    from attnres import AttnResLM, ModelConfig

    cfg = ModelConfig(
        vocab_size=40,
        d_model=12,
        n_layers=3,
        n_heads=2,
        max_seq_len=8,
        residual=residual,
        **({"attnres_blocks": 2} if residual == "block" else {}),
        **overrides,
    )
    assert cfg.attnres_impl == "two_phase"
    torch.manual_seed(0)
    model = randomize(AttnResLM(cfg).to(device=DEVICE, dtype=torch.float64))
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def loss_grads_and_logits():
        model.zero_grad()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        with torch.no_grad():
            again = model(ids)
        return loss.detach(), again, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want_logits, want = loss_grads_and_logits()
    calls = route_to_triton(monkeypatch)
    loss, logits, got = loss_grads_and_logits()
    assert calls
    torch.testing.assert_close(loss, want_loss, **F64)
    torch.testing.assert_close(logits, want_logits, **F64)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


# ----------------------------------------------------------------------------- Phase 1's backward kernel


def backward_reference(values, key_norm, queries, key_weights, gh, glse, kernel):
    """(dL/dvalues, dL/du) in float64 by autograd through reference.phase1 with u = queries * key_weights as
    the leaf, the key-norm term through inverse_rms(values) (the kernel's contract)."""
    s_count, d = queries.shape[0], values.shape[-1]
    v = values.detach().cpu().double().requires_grad_()
    u = queries.detach().cpu().double().reshape(s_count, d)
    if key_norm:
        u = u * key_weights.detach().cpu().double()
    u = u.reshape(queries.shape).requires_grad_()
    stats = two_phase_reference.phase1(v, inverse_rms(v, EPS) if key_norm else None, u, None, kernel=kernel)
    loss = (stats.h * gh.cpu().double()).sum()
    if kernel == "softmax" and glse is not None:
        loss = loss + (stats.lse * glse.cpu().double()).sum()
    gv, gu = torch.autograd.grad(loss, [v, u])
    return gv, gu.reshape(s_count, d)


def backward_case(K, S, B, T, D, heads, key_norm, kernel, dtype, seed, glse=True):
    """Inputs of the backward kernel (values a strided view into a wider buffer, lse from the Triton forward)
    and the float64 reference gradients."""
    values, queries, kws = make_block(K=K, S=S, B=B, T=T, D=D, heads=heads, dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    gh = torch.randn(B, T, S, D, generator=g, dtype=torch.float64).to(DEVICE)
    g_lse = torch.randn(B, T, S, heads, generator=g, dtype=torch.float64).to(DEVICE) if glse else None
    want = backward_reference(values, key_norm, queries, kws, gh, g_lse, kernel)
    values = values.to(dtype)
    inv = inverse_rms(values, EPS) if key_norm else None
    kw = kws.to(dtype) if key_norm else None
    lse = tp.phase1(values, inv, queries.to(dtype), kw, kernel=kernel).lse
    args = (values, inv, queries.to(dtype), kw, lse, gh.to(dtype), None if g_lse is None else g_lse.to(dtype))
    return args, want


@pytest.mark.parametrize("K,S", [(1, 3), (3, 1), (5, 3)])
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
def test_phase1_backward_matches_float64_autograd(K, S, heads, key_norm, kernel):
    # B * T = 5 (odd), sources read in place from a strided buffer view
    args, (want_v, want_u) = backward_case(K, S, 1, 5, 8, heads, key_norm, kernel, torch.float64, seed=30 + K + S)
    assert args[0].stride(2) == 8 and not args[0].is_contiguous()
    gv, du = tp.phase1_backward(*args, kernel=kernel)
    torch.testing.assert_close(gv.cpu(), want_v, **F64)
    torch.testing.assert_close(du.cpu(), want_u, **F64)
    # float32 sources: float32 gradients, close to the float64 ones
    args, _ = backward_case(K, S, 1, 5, 8, heads, key_norm, kernel, torch.float32, seed=30 + K + S)
    gv, du = tp.phase1_backward(*args, kernel=kernel)
    assert gv.dtype == du.dtype == torch.float32 and gv.shape == (1, 5, K, 8) and gv.is_contiguous()
    torch.testing.assert_close(gv.double().cpu(), want_v, **F32)
    torch.testing.assert_close(du.double().cpu(), want_u, **F32)


def test_phase1_backward_over_many_tiles_permuted_strides_and_without_du():
    # D = 64: 4 tokens a tile, 6 tiles over the CPU's 4 programs (two programs reduce du over two tiles);
    # values a [T, B, ...] buffer read as [B, T, ...]; no lse gradient; needs_du=False leaves dv alone
    B, T, K, S, D = 3, 7, 3, 3, 64
    values, queries, kws = make_block(K=K + 1, S=S, B=T, T=B, D=D, heads=2, dtype=torch.float64, seed=40)
    values = values.transpose(0, 1)[:, :, 1:]
    g = torch.Generator().manual_seed(41)
    gh = torch.randn(B, T, S, D, generator=g, dtype=torch.float64).to(DEVICE)
    want_v, want_u = backward_reference(values, True, queries, kws, gh, None, "softmax")
    inv = inverse_rms(values, EPS)
    lse = tp.phase1(values, inv, queries, kws).lse
    assert triton_backward._backward_tile(2, D, S)[0] == 4
    gv, du = tp.phase1_backward(values, inv, queries, kws, lse, gh, None)
    torch.testing.assert_close(gv.cpu(), want_v, **F64)
    torch.testing.assert_close(du.cpu(), want_u, **F64)
    gv_only, none = tp.phase1_backward(values, inv, queries, kws, lse, gh, None, needs_du=False)
    assert none is None
    torch.testing.assert_close(gv_only, gv, rtol=0, atol=0)


def test_phase1_backward_refuses_bad_input():
    args, _ = backward_case(2, 3, 1, 3, 8, 1, True, "softmax", torch.float32, seed=50)
    values, inv, queries, kws, lse, gh, glse = args
    with pytest.raises(ValueError, match=r"lse must be \[B, T, S, H\] = \(1, 3, 3, 1\); got \(1, 3, 2, 1\)"):
        tp.phase1_backward(values, inv, queries, kws, lse[:, :, :2], gh, glse)
    with pytest.raises(ValueError, match="grad_h must be"):
        tp.phase1_backward(values, inv, queries, kws, lse, gh[..., :4], glse)
    with pytest.raises(ValueError, match="grad_lse must be"):
        tp.phase1_backward(values, inv, queries, kws, lse, gh, glse[:1, :1])
    with pytest.raises(ValueError, match="inv_rms must be"):
        tp.phase1_backward(values, inv[:, :, :1], queries, kws, lse, gh, glse)
    with pytest.raises(ValueError, match="kernel"):
        tp.phase1_backward(values, inv, queries, kws, lse, gh, glse, kernel="relu")
    wide = torch.zeros(1, 1, 1, 8192, device=DEVICE)
    lse, gh = torch.zeros(1, 1, 3, 1, device=DEVICE), torch.zeros(1, 1, 3, 8192, device=DEVICE)
    assert tp.backward_fits(1, 8192, 2) and not tp.backward_fits(1, 8192, 3)
    with pytest.raises(ValueError, match=r"S=3 queries of D=8192 channels \(1 heads\) are too wide"):
        tp.phase1_backward(wide, None, torch.ones(3, 8192, device=DEVICE), None, lse, gh, None)


@pytest.mark.parametrize("fits", [True, False])
@pytest.mark.parametrize("kernel,heads", [("softmax", 2), ("sigmoid", 1)])
def test_routed_phase1_backward_runs_the_kernel_when_it_fits(monkeypatch, fits, kernel, heads):
    # fused._Phase1 with the Triton forward: the backward kernel when it fits (else torch, from lse), the
    # same gradients as the torch path; create_graph (a gradient with a graph) always stays with torch
    values, queries, kws = make_block(K=5, S=3, B=1, T=5, D=8, heads=heads, dtype=torch.float32, seed=60)
    g = torch.Generator().manual_seed(61)
    gh = [torch.randn(1, 5, 8, generator=g).to(DEVICE) for _ in range(3)]
    glse = torch.randn(1, 5, 3, heads, generator=g).to(DEVICE)

    def run(create_graph=False):
        producers = [values[:, :, i].clone().requires_grad_() for i in range(5)]
        q, kw = queries.clone().requires_grad_(), kws.clone().requires_grad_()
        h1s, lse = fused.phase1_outputs(values, inverse_rms(values, EPS), q, kw, producers, kernel=kernel)
        loss = sum((h * g_).sum() for h, g_ in zip(h1s, gh, strict=True)) + (lse * glse).sum()
        return torch.autograd.grad(loss, [q, kw, *producers], create_graph=create_graph)

    want = run()
    kernel_calls = []

    def spy(*args, **kwargs):
        kernel_calls.append(kwargs)
        return triton_backward.phase1_backward(*args, **kwargs)

    route_to_triton(monkeypatch)
    monkeypatch.setattr(tp, "phase1_backward", spy)
    monkeypatch.setattr(tp, "backward_fits", lambda heads, d, s: fits)
    got = run()
    assert kernel_calls == ([{"kernel": kernel, "needs_du": True}] if fits else [])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **F32)
    kernel_calls.clear()
    got = run(create_graph=True)
    assert kernel_calls == [] and all(x.requires_grad for x in got)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.detach(), b, **F32)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("heads,kernel", [(1, "softmax"), (4, "softmax"), (1, "sigmoid")])
def test_phase1_backward_on_cuda_against_float64(dtype, tol, heads, kernel):
    """The compiled kernel at a realistic width (D 256, 9 sources, S 4, several tiles per program) against
    the float64 CPU reference of the same (rounded) inputs, relative to the gradients' scale."""
    args, (want_v, want_u) = backward_case(9, 4, 2, 300, 256, heads, True, kernel, torch.float64, seed=70)
    values, inv, queries, kws, _, gh, glse = args
    values, gh, glse = values.to(dtype), gh.to(dtype), glse.to(dtype)
    # the reference of the rounded values and output gradients: only the kernel's arithmetic is measured
    want_v, want_u = backward_reference(values, True, queries, kws, gh, glse, kernel)
    inv = inverse_rms(values, EPS)
    q32, kw32 = queries.float(), kws.float()
    lse = tp.phase1(values, inv, q32, kw32, kernel=kernel).lse
    gv, du = tp.phase1_backward(values, inv, q32, kw32, lse, gh, glse, kernel=kernel)
    assert gv.dtype == du.dtype == torch.float32
    for got, want in ((gv, want_v), (du, want_u)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol * scale)


def merge_norm_inputs(B=2, T=5, D=12, S=3, dtype=torch.float64, seed=3):
    """Phase 1's h1 as one query's slice of a [B, T, S, D] output (read in place), its lse [B, T, 1], a
    partial sum, a query and key weight, and a norm weight; every tensor random (never zeros)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(DEVICE, dtype)

    h1 = rand(B, T, S, D)[:, :, 1]
    return (
        h1,
        rand(B, T, 1),
        rand(B, T, D, scale=2, shift=0.3),
        rand(D),
        rand(D, scale=0.2, shift=1.0),
        rand(D, shift=1.0),
    )


@pytest.mark.parametrize("norm", ["weighted", "unweighted", "none"])
@pytest.mark.parametrize("D", [12, 64])
def test_merge_norm_matches_float64_autograd(norm, D):
    """The Triton merge + RMSNorm, forward and backward, against float64 autograd through
    reference.merge_partial with its norm: h1 read in place from a strided slice, tokens over several
    programs (B * T = 70 at D = 12, 3 tokens at D = 64)."""
    from attnres.ops.common import RMSNormArgs
    from attnres.ops.two_phase import triton_merge_norm as tm

    b, t = (2, 35) if D == 12 else (1, 3)
    h1, lse, p, q, kw, w = merge_norm_inputs(B=b, T=t, D=D)
    weight = w if norm == "weighted" else None
    norm_eps = None if norm == "none" else 1e-5
    out, saved = tm.merge_norm(h1, lse, p, q * kw, EPS, weight, norm_eps)

    leaves = [x.detach().double().cpu().requires_grad_() for x in (h1, lse, p, q, kw, w)]
    args = RMSNormArgs(leaves[5] if norm == "weighted" else None, norm_eps) if norm_eps is not None else None
    want = two_phase_reference.merge_partial(
        DepthStats(leaves[0], leaves[1]), leaves[2], leaves[3], leaves[4], EPS, norm=args
    )
    torch.testing.assert_close(out.cpu(), want.detach(), **F64)

    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    want.backward(grad)
    gh1, glse, gp, du, dw = tm.merge_norm_backward(h1, p, q * kw, EPS, weight, norm_eps, saved, grad.to(DEVICE))
    torch.testing.assert_close(gh1.view(h1.shape).cpu(), leaves[0].grad, **F64)
    torch.testing.assert_close(glse.view(lse.shape).cpu(), leaves[1].grad, **F64)
    torch.testing.assert_close(gp.view(p.shape).cpu(), leaves[2].grad, **F64)
    torch.testing.assert_close((du * kw).cpu(), leaves[3].grad, **F64)  # du is dL/du, u = query * key weight
    torch.testing.assert_close((du * q).cpu(), leaves[4].grad, **F64)
    if norm == "weighted":
        torch.testing.assert_close(dw.cpu(), leaves[5].grad, **F64)
    else:
        assert dw is None

    # float32 inputs: float32 results close to the float64 truth
    h1f, lsef, pf, qf, kwf, wf = (x.float() for x in (h1, lse, p, q, kw, w))
    out32, saved32 = tm.merge_norm(h1f, lsef, pf, qf * kwf, EPS, wf if norm == "weighted" else None, norm_eps)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double().cpu(), want.detach(), **F32)
    gp32 = tm.merge_norm_backward(
        h1f, pf, qf * kwf, EPS, wf if norm == "weighted" else None, norm_eps, saved32, grad.float().to(DEVICE)
    )[2]
    torch.testing.assert_close(gp32.view(p.shape).double().cpu(), leaves[2].grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm", ["weighted", "none"])
def test_routed_merge_partial_runs_the_triton_merge_norm(monkeypatch, norm):
    """fused.merge_partial offered the Triton kernels (as on CUDA) runs them, forward and backward, and gives
    the reference's values and gradients."""
    from attnres.ops import backends
    from attnres.ops.common import RMSNormArgs

    h1, lse, p, q, kw, w = merge_norm_inputs(B=2, T=4, D=8)

    def run():
        leaves = [x.detach().clone().requires_grad_() for x in (h1, lse, p, q, kw, w)]
        args = RMSNormArgs(leaves[5], 1e-5) if norm == "weighted" else None
        with backends.record() as found:
            out = fused.merge_partial(DepthStats(leaves[0], leaves[1]), leaves[2], leaves[3], leaves[4], EPS, norm=args)
            grads = torch.autograd.grad((out * out.detach().cos()).sum(), leaves[: 6 if args else 5])
        return (out, *grads), {(c.phase, c.backend) for c in found if c.op == "merge_partial"}

    want, _ = run()
    route_to_triton(monkeypatch)
    got, ran = run()
    assert ("forward", "triton") in ran
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **F64)
