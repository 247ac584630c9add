"""The Triton Phase-1 and merge kernels against the reference two-phase ops (tests/interpreted_triton.py
says how they run without a GPU). float64 runs the kernels in float64: 1e-12; float32 must match
the float64 reference to rtol 1e-4, atol 1e-5."""

import pytest
import torch
from interpreted_triton import DEVICE, import_kernels

tp = import_kernels("attnres.ops.two_phase.triton")

from attnres.ops import depth_attention  # noqa: E402
from attnres.ops.common import DepthStats, inverse_rms  # noqa: E402
from attnres.ops.two_phase import fused, library  # noqa: E402
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
    """attnres::phase1 over a list of sources: the Triton forward (then torch's backward from its lse)
    against the torch forward, values and gradients; opcheck with the route on."""
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
    assert len(calls) == 1
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
