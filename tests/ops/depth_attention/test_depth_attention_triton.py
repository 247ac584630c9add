"""The Triton depth-attention kernels against the float64 references (tests/interpreted_triton.py says
how they run without a GPU).

Tolerances: float64 inputs run the kernels in float64 and must match the loop
reference to 1e-12 (values) / 1e-10 (gradients); float32 inputs must match the
float64 reference to rtol 1e-4, atol 1e-5 (the same bound as the torch fused op).
"""

import dataclasses
import itertools
import os
import sys

import pytest
import torch
from interpreted_triton import DEVICE, ON_GPU, import_kernels

tda = import_kernels("attnres.ops.depth_attention.triton")

from reference import loop_reference  # noqa: E402

from attnres.ops import depth_attention, fused_depth_attention  # noqa: E402
from attnres.ops.depth_attention import fused as fused_module  # noqa: E402

F64 = dict(rtol=1e-12, atol=1e-12)
F64_GRAD = dict(rtol=1e-10, atol=1e-12)
F32 = dict(rtol=1e-4, atol=1e-5)


def make_inputs(K=4, B=2, T=3, D=8, heads=1, per_token=False, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = torch.randn(K, B, T, D, generator=g, dtype=torch.float64) * 2 + 0.3
    shape = (D,) if heads == 1 else (heads, D // heads)
    if per_token:
        shape = (B, T) + shape
    query = torch.randn(shape, generator=g, dtype=torch.float64)
    key_weight = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
    return tuple(x.to(DEVICE, dtype) for x in (sources, query, key_weight))


def run_both(sources, query, kw, gh, kernel, normalize_keys, impl_dtype=None):
    """(h, grads) from the Triton op in the inputs' dtype and from the float64 reference."""
    out = []
    for which in ("triton", "reference"):
        cast = (lambda x: x.double()) if which == "reference" else (lambda x: x)
        s, q, w = (cast(x).detach().clone().requires_grad_() for x in (sources, query, kw))
        if which == "triton":
            h = tda.triton_depth_attention(s, q, w, kernel=kernel, normalize_keys=normalize_keys)
        else:
            h = depth_attention(s, q, w, kernel=kernel, normalize_keys=normalize_keys, impl="reference")
        (h * cast(gh)).sum().backward()
        out.append((h.detach(), s.grad, q.grad, w.grad))
    return out


# (heads, D): one head with D a power of two and not; 3 heads (padded to 4); heads of 3 channels
SHAPES = [(1, 8), (1, 6), (3, 12), (2, 6)]
CASES = list(itertools.product(["softmax", "sigmoid"], [True, False], SHAPES, [False, True]))


@pytest.mark.parametrize("kernel,normalize_keys,shape,per_token", CASES)
def test_float64_values_and_grads(kernel, normalize_keys, shape, per_token):
    heads, d = shape
    sources, query, kw = make_inputs(K=4, D=d, heads=heads, per_token=per_token)
    want_h, _ = loop_reference(sources.cpu(), query.cpu(), kw.cpu(), 1e-6, kernel, normalize_keys)
    gh = torch.randn(2, 3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (h, *grads), (h_ref, *grads_ref) = run_both(sources, query, kw, gh.to(DEVICE), kernel, normalize_keys)
    torch.testing.assert_close(h.cpu(), want_h, **F64)
    torch.testing.assert_close(h, h_ref, **F64)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        if g_ref is None:  # key weight without key norm: unused
            assert g is None
        else:
            torch.testing.assert_close(g, g_ref, **F64_GRAD)


@pytest.mark.parametrize("K", [1, 2, 7])
@pytest.mark.parametrize("heads,per_token", [(1, False), (4, False), (2, True)])
def test_float32_matches_float64_reference(K, heads, per_token):
    sources, query, kw = make_inputs(K=K, B=2, T=5, D=24, heads=heads, per_token=per_token, dtype=torch.float32, seed=3)
    gh = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    (h, *grads), (h_ref, *grads_ref) = run_both(sources, query, kw, gh, "softmax", True)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h.double(), h_ref, **F32)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), g_ref, **F32)


def test_gradcheck_float64():
    sources, query, kw = make_inputs(K=3, B=1, T=2, D=6, heads=2)
    args = tuple(x.requires_grad_() for x in (sources, query, kw))
    assert torch.autograd.gradcheck(lambda s, q, w: tda.triton_depth_attention(s, q, w), args, eps=1e-6, atol=1e-8)


def test_many_tiles_reduce_the_query_gradient():
    # more tokens than one program's tiles: each program loops over several tiles and
    # the partial sums of dq/dg are reduced across programs
    sources, query, kw = make_inputs(K=3, B=2, T=300, D=8, seed=5)
    gh = torch.randn(2, 300, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    first, ref = run_both(sources, query, kw, gh.to(DEVICE), "softmax", True)
    for g, g_ref in zip(first, ref, strict=True):
        torch.testing.assert_close(g, g_ref, **F64_GRAD)
    again, _ = run_both(sources, query, kw, gh.to(DEVICE), "softmax", True)
    for a, b in zip(first, again, strict=True):  # deterministic: no atomics
        assert torch.equal(a, b)


def test_buffer_views_window_layout_and_producer_grads():
    # the residual stream's window layout: rows {0} and {2, 3} of a buffer plus the partial sum
    sources, query, kw = make_inputs(K=4, D=10, heads=2, seed=7)
    producers = [s.clone().requires_grad_() for s in sources.unbind(0)]
    buffer = torch.zeros(2, 3, 6, 10, dtype=torch.float64, device=DEVICE)
    for row, p in zip((0, 2, 3), producers[:3], strict=True):
        buffer[:, :, row] = p.detach()
    segments = [buffer[:, :, 0:1], buffer[:, :, 2:4], producers[3].unsqueeze(2)]
    h = tda.triton_fused_depth_attention(segments, producers, query, kw)
    buffer[:, :, 4:] = 123.0  # later writes to other rows must not disturb backward
    buffer[:, :, 1] = -7.0
    gh = torch.randn_like(h)
    (h * gh).sum().backward()

    ref = [s.clone().requires_grad_() for s in sources.unbind(0)]
    h_ref = depth_attention(torch.stack(ref), query, kw, impl="reference")
    (h_ref * gh).sum().backward()
    torch.testing.assert_close(h, h_ref, **F64)
    for p, r in zip(producers, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, **F64_GRAD)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_torch_fused(dtype):
    sources, query, kw = make_inputs(K=5, D=16, dtype=torch.float32, seed=8)
    results = []
    for fn in (tda.triton_depth_attention, depth_attention):
        s = sources.to(dtype).requires_grad_()
        q = query.to(dtype).requires_grad_()
        h = fn(s, q, kw.to(dtype))
        h.float().pow(2).sum().backward()
        results.append((h, s.grad, q.grad))
    (h, gs, gq), (h_t, gs_t, gq_t) = results
    assert h.dtype == gs.dtype == gq.dtype == dtype
    # within a couple of half-precision ulps of the torch fused op (both compute in float32)
    torch.testing.assert_close(h.float(), h_t.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gs.float(), gs_t.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(gq.float(), gq_t.float(), rtol=2e-2, atol=5e-2)


def test_zero_query_gives_the_mean():
    sources, _, kw = make_inputs(K=6, D=7)
    h = tda.triton_depth_attention(sources, torch.zeros(7, dtype=torch.float64, device=DEVICE), kw)
    torch.testing.assert_close(h, sources.mean(0), **F64)


# ----------------------------------------------------------------------------- support and dispatch


def test_unsupported_cases_are_named():
    sources, query, kw = make_inputs(K=4, D=8)
    seg = sources.movedim(0, 2)
    assert tda.unsupported_reason([seg], query, kw, require_cuda=False) is None
    four = [seg[:, :, i : i + 1] for i in range(4)]
    assert "segments" in tda.unsupported_reason(four, query, kw, require_cuda=False)
    every_other = seg[..., ::2]  # channel stride 2
    assert (
        tda.unsupported_reason([every_other], query[:4], kw[:4], require_cuda=False)
        == "a segment is not contiguous along D"
    )
    bad_q = torch.randn(4, 3, 8, dtype=torch.float64, device=DEVICE)
    assert "[B, T]" in tda.unsupported_reason([seg], bad_q, kw, require_cuda=False)
    assert tda.unsupported_reason([seg], query, kw, require_cuda=True) is not None  # float64
    if not ON_GPU:
        assert tda.unsupported_reason([seg.float()], query.float(), kw.float()) is not None
    with pytest.raises(ValueError, match="does not support"):
        tda.triton_fused_depth_attention(four, list(sources.unbind(0)), query, kw)


def test_dispatch_hook_leaves_cpu_and_float64_to_torch(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the Triton path must not be used here")

    monkeypatch.setattr(tda, "triton_fused_depth_attention", boom)
    sources, query, kw = make_inputs(K=3, D=8)
    h = depth_attention(sources, query, kw)  # float64 (and CPU without a GPU): torch fused path
    torch.testing.assert_close(h, depth_attention(sources, query, kw, impl="reference"), **F64)


@pytest.mark.skipif(not ON_GPU, reason="the dispatch to Triton happens for CUDA tensors only")
def test_dispatch_hook_uses_triton_on_cuda(monkeypatch):
    calls = []
    real = tda.triton_fused_depth_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tda, "triton_fused_depth_attention", spy)
    sources, query, kw = make_inputs(K=3, D=8, dtype=torch.float32)
    producers = [s.clone().requires_grad_() for s in sources.unbind(0)]
    h = fused_depth_attention([sources.movedim(0, 2)], producers, query, kw)
    assert calls == [1]
    torch.testing.assert_close(h, depth_attention(sources, query, kw, impl="reference"), **F32)
    monkeypatch.setenv("ATTNRES_TRITON", "0")
    fused_depth_attention([sources.movedim(0, 2)], producers, query, kw)
    assert calls == [1]
    assert fused_module._triton_module() is None


def test_kernels_compile_for_sm90_without_a_gpu():
    # interpret mode runs numpy and never sees the compiler; build the real thing in a
    # process without TRITON_INTERPRET (ptxas ships in the triton wheel)
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    code = (
        "from attnres.ops.triton_build import compile_check\n"
        "r = compile_check(arch=90, d=96, heads=3)\n"
        "assert len(r) == 11 and all(regs != 0 for regs, _ in r.values()), r\n"
        "print(r)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "residual,overrides",
    [
        ("full", {}),
        ("full", {"attnres_window": 2}),  # three segments: row 0, the window rows, the partial sum
        ("block", {"attnres_heads": 2, "attnres_weights": "input_query"}),
        ("block", {"attnres_key_norm": False, "attnres_kernel": "sigmoid"}),
    ],
)
def test_whole_model_through_the_triton_op(monkeypatch, residual, overrides):
    # every depth aggregation of a small float64 model (forward and backward) goes through
    # the Triton op instead of the torch fused one: same loss, same gradients
    from attnres import AttnResLM, ModelConfig
    from attnres.residual.base import PLAIN_OPS, Stream

    cfg = ModelConfig(
        vocab_size=40,
        d_model=12,
        n_layers=2,
        n_heads=2,
        max_seq_len=8,
        residual=residual,
        attnres_impl="fused",
        **overrides,
    )
    torch.manual_seed(0)
    model = AttnResLM(cfg).to(device=DEVICE, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.residual.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype).to(DEVICE) * 0.5
            if "query_proj" in name:
                noise = noise / p.shape[-1] ** 0.5
            p.copy_(noise + (1.0 if "key_norm" in name else 0.0))
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def loss_and_grads():
        model.zero_grad()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = loss_and_grads()
    calls = []

    def through_triton(*args, **kwargs):
        calls.append(1)
        return tda.triton_fused_depth_attention(*args, **kwargs)

    monkeypatch.setattr(Stream, "ops", dataclasses.replace(PLAIN_OPS, attend=through_triton))
    loss, got = loss_and_grads()
    assert len(calls) == cfg.n_sublayers + 1
    torch.testing.assert_close(loss, want_loss, **F64)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **F64_GRAD, msg=name)
