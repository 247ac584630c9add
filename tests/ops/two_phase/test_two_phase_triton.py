"""The Triton Phase-1 and merge kernels against the naive two-phase ops (tests/interpreted_triton.py
says how they run without a GPU). float64 runs the kernels in float64: 1e-12; float32 must match
the float64 reference to rtol 1e-4, atol 1e-5."""
import pytest
import torch

from interpreted_triton import DEVICE, import_kernels

tp = import_kernels("attnres.ops.two_phase.triton")

from attnres.ops import depth_attention  # noqa: E402
from attnres.ops.common import DepthStats, inverse_rms  # noqa: E402
from attnres.ops.two_phase import naive  # noqa: E402

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
    return (tp.phase1(values, inv, queries, kw, kernel=kernel),
            naive.phase1(values.double(), None if inv is None else inv.double(), queries.double(),
                         None if kw is None else kw.double(), kernel=kernel))


@pytest.mark.parametrize("heads,D,S,K", [(1, 8, 3, 4), (2, 6, 5, 2), (3, 12, 1, 1)])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
def test_phase1_matches_naive(heads, D, S, K, key_norm, kernel):
    values, queries, kws = make_block(K=K, S=S, D=D, heads=heads)
    got, want = phase1_both(values, queries, kws, key_norm, kernel)
    assert got.h.shape == (2, 3, S, D) and got.lse.shape == (2, 3, S, heads)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **F64)
    # float32 sources: float32 statistics, close to the float64 ones
    got32, _ = phase1_both(values.float(), queries.float(), kws.float(), key_norm, kernel)
    assert got32.h.dtype == got32.lse.dtype == torch.float32
    for a, b in zip(got32, want):
        torch.testing.assert_close(a.double(), b, **F32)


def test_phase1_many_tokens_and_queries():
    # several token tiles and (for a wide D) several query tiles per program grid
    values, queries, kws = make_block(K=3, S=6, B=2, T=40, D=16, heads=2, seed=11)
    got, want = phase1_both(values, queries, kws, True, "softmax")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
def test_merge_matches_naive_and_is_exact(heads, kernel):
    values, queries, kws = make_block(K=5, S=2, D=8, heads=heads)
    inv = inverse_rms(values, EPS)
    a = tp.phase1(values[:, :, :3], inv[:, :, :3], queries, kws, kernel=kernel)
    b = tp.phase1(values[:, :, 3:], inv[:, :, 3:], queries, kws, kernel=kernel)
    got = tp.merge(a, b, kernel)
    want = naive.merge(a, b, kernel)
    for x, y in zip(got, want):
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
            one = tp.phase1(partial.unsqueeze(2), inverse_rms(partial.unsqueeze(2), EPS), queries[i:i + 1],
                            kws[i:i + 1])
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
