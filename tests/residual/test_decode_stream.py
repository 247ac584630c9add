"""The decoding form of the AttnRes stream (``DecodeStream``: one token, no gradients) computes what the
whole-sequence forward computes: token-by-token logits against one forward pass in float64, for every
variant the form claims; the variants it leaves to the general forms still decode exactly; and the
stream-level cases the form adds (a state resumed twice, a cache handed to or from two-phase, an observer
that wraps the ops, queries changed between tokens) agree with the reference stream. Every test runs with
each backend of the ``decode_read`` op (the C++ kernel's one call per read, and the torch ops), and the
kernel's reader is checked against a float64 reference on random rows."""

from __future__ import annotations

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache
from attnres.ops import backends
from attnres.ops.two_phase import cpu
from attnres.residual import BlockAttnRes, FullAttnRes
from attnres.residual import depth_streams as forms
from attnres.residual.observe import IOCounter, observing

# what the decoding form claims: pseudo-queries under two-phase, every option that keeps them
CLAIMED = {
    "block": ("block", {}),
    "block_uneven": ("block", {"attnres_block_sizes": [1, 3, 2]}),
    "block_heads": ("block", {"attnres_heads": 2}),
    "block_sigmoid_heads": ("block", {"attnres_heads": 2, "attnres_kernel": "sigmoid"}),
    "block_sigmoid": ("block", {"attnres_kernel": "sigmoid"}),
    "block_no_key_norm": ("block", {"attnres_key_norm": False}),
    "block_states": ("block", {"attnres_sources": "states"}),
    "block_additive": ("block", {"attnres_routing": "additive", "attnres_gain_init": 0.3}),
    "block_additive_unit": ("block", {"attnres_routing": "additive", "attnres_gain": "unit"}),
    "full": ("full", {}),
    "full_grouped": ("full", {"attnres_group_size": 2}),
    "full_heads_no_key_norm": ("full", {"attnres_heads": 4, "attnres_key_norm": False}),
    "full_states": ("full", {"attnres_sources": "states"}),
}
# what it leaves to the general forms
FALLBACK = {
    "block_low_rank": ("block", {"attnres_weights": "low_rank_query", "attnres_query_rank": 2}),
    "block_fused": ("block", {"attnres_impl": "fused"}),
    "block_reference": ("block", {"attnres_impl": "reference"}),
    "block_scalar": ("block", {"attnres_weights": "scalar"}),
    "full_window": ("full", {"attnres_window": 2}),
    "full_input_query": ("full", {"attnres_weights": "input_query"}),
    "block_normalized_values": ("block", {"attnres_values": "normalized"}),
}


@pytest.fixture(autouse=True, params=["cpu_kernel", "torch"])
def decode_backend(request):
    """Every test of this module once per decode_read backend."""
    if request.param == "cpu_kernel" and cpu.kernel() is None:
        pytest.skip(f"the C++ kernel is not available here: {cpu.status()}")
    with backends.forced("decode_read", request.param):
        yield request.param


def model_for(residual: str, dtype=torch.float64, **overrides) -> AttnResLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=24,
        residual=residual,
        **({"attnres_block_size": 2} if residual == "block" and "attnres_block_sizes" not in overrides else {}),
        **overrides,
    )
    model = AttnResLM(cfg).to(dtype).eval()
    randomize(model.residual, seed=1, scale=0.3)  # queries and key weights away from their init
    return model


def tokens(t: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 61, (batch, t), generator=torch.Generator().manual_seed(0))


def decoded(model: AttnResLM, x: torch.Tensor, prefill: int = 5) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens, then the rest one token at a time."""
    with torch.no_grad():
        cache = KVCache.for_model(model, batch_size=x.shape[0])
        steps = [model(x[:, :prefill], cache=cache)]
        steps += [model(x[:, t : t + 1], cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(steps, 1)


def form_for(model: AttnResLM, dtype=torch.float64) -> type:
    with torch.no_grad():
        return model.residual.stream_form(torch.zeros(2, 1, model.config.d_model, dtype=dtype))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", sorted(CLAIMED))
def test_decoding_form_equals_the_whole_sequence(case, batch):
    residual, overrides = CLAIMED[case]
    model = model_for(residual, **overrides)
    assert form_for(model) is forms.DecodeStream
    x = tokens(14, batch)
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(decoded(model, x), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", sorted(FALLBACK))
def test_variants_left_to_the_general_forms_still_decode_exactly(case):
    residual, overrides = FALLBACK[case]
    model = model_for(residual, **overrides)
    assert form_for(model) is not forms.DecodeStream
    x = tokens(12)
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(decoded(model, x), full, rtol=1e-10, atol=1e-10)


def test_the_form_is_for_one_token_without_gradients():
    model = model_for("block")
    one = torch.zeros(1, 1, 32, dtype=torch.float64)
    assert model.residual.stream_form(one) is not forms.DecodeStream  # gradients on
    with torch.no_grad():
        assert model.residual.stream_form(one) is forms.DecodeStream
        assert model.residual.stream_form(torch.zeros(1, 2, 32, dtype=torch.float64)) is not forms.DecodeStream


def test_inference_mode_decodes_exactly():
    model = model_for("block", attnres_heads=2)
    x = tokens(10)
    with torch.no_grad():
        full = model(x)
    with torch.inference_mode():
        got = decoded(model, x)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-10)


def test_autocast_is_left_to_two_phase():
    """Under autocast the general form's ops keep their products in float32 themselves; the decoding
    form's would be recast, so it steps aside."""
    model = model_for("block", torch.float32)
    one = torch.zeros(1, 1, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.residual.stream_form(one) is forms.TwoPhaseStream


def test_float32_decoding_equals_the_whole_sequence():
    model = model_for("block", torch.float32, attnres_heads=2)
    assert form_for(model, torch.float32) is forms.DecodeStream
    x = tokens(12)
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(decoded(model, x), full, rtol=1e-5, atol=1e-5)


def test_queries_changed_between_tokens_are_read():
    """The form keeps query * key-norm weight across tokens; an in-place change (an optimizer step, a
    load) must be seen at the next token."""
    model = model_for("block")
    x = tokens(10)
    decoded(model, x)
    with torch.no_grad():
        model.residual.queries.mul_(-1.5)
        model.residual.key_norm_weight.add_(0.25)
        full = model(x)
    torch.testing.assert_close(decoded(model, x), full, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- the stream itself
D, L = 8, 6


def block_scheme(**kw):
    torch.manual_seed(0)
    return randomize(BlockAttnRes(D, L, attnres_block_size=3, **kw).double())


def full_scheme(**kw):
    torch.manual_seed(0)
    return randomize(FullAttnRes(D, L, **kw).double())


def sublayers():
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5 for _ in range(L)]
    return [lambda h, w=w: torch.tanh(h @ w) for w in weights]


def reference_run(scheme, x: torch.Tensor) -> torch.Tensor:
    """Sublayer by sublayer through the reference stream."""
    stream = forms.DepthAttentionStream(scheme, [x])
    scheme.routing.begin(stream, x)
    for f in sublayers():
        stream.apply(f)
    return stream.end()


def x_token(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 1, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


@pytest.mark.parametrize("make", [block_scheme, full_scheme], ids=["block", "full"])
def test_a_state_resumed_twice_reads_its_own_partial_sum(make):
    """The row after the sources holds the partial sum of whichever stream read last: a second stream
    resumed from the same earlier state must read its own partial sum, not the later one."""
    scheme, x, fs = make(), x_token(), sublayers()
    with torch.no_grad():
        want = reference_run(scheme, x)
        stream = scheme.begin(x)
        assert type(stream) is forms.DecodeStream
        stream.apply(fs[0])
        earlier = stream.depth()
        ahead = scheme.stream(earlier)
        for f in fs[1:4]:
            ahead.apply(f)  # writes later partial sums into the shared buffer
        again = scheme.stream(earlier)
        for f in fs[1:]:
            again.apply(f)
        got = again.end()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make", [block_scheme, full_scheme], ids=["block", "full"])
def test_the_cache_passes_between_decoding_and_two_phase(make, monkeypatch):
    """Sublayers alternately in the decoding form and in two-phase (as where only some of them run under
    the compiler), each resumed from the other's cache."""
    scheme, x, fs = make(), x_token(), sublayers()
    with torch.no_grad():
        want = reference_run(scheme, x)
        depth = scheme.start(x)
        for i, f in enumerate(fs):
            form = forms.DecodeStream if i % 2 == 0 else forms.TwoPhaseStream
            monkeypatch.setattr(scheme, "stream_form", lambda embedding, form=form: form)
            stream = scheme.stream(depth)
            assert type(stream) is form
            stream.apply(f)
            depth = stream.depth()
        monkeypatch.setattr(scheme, "stream_form", lambda embedding: forms.TwoPhaseStream)
        got = scheme.finish(depth)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_observer_that_wraps_the_ops_counts_two_phase_reads():
    """With the ops wrapped (I/O counting) the form reads as two-phase does: the same counts and values."""
    x, fs = x_token(), sublayers()
    counts = {}
    for form in (forms.DecodeStream, forms.TwoPhaseStream):
        scheme = block_scheme()
        scheme.stream_form = lambda embedding, form=form: form
        with torch.no_grad(), observing(scheme, IOCounter()) as counter:
            stream = scheme.begin(x)
            for f in fs:
                stream.apply(f)
            out = stream.end()
        counts[form] = (counter.reads, counter.writes, out)
    (r1, w1, o1), (r2, w2, o2) = counts.values()
    assert (r1, w1) == (r2, w2) and sum(r1) > 0
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)


def reference_read(rows, inv, u, m, heads, kernel):
    """The decode read in float64 as the math is written: z_i = r_i (v_i . u) per head, softmax over the m
    rows (or sigmoid), the weighted sum of the rows."""
    b, _, d = rows.shape
    v = rows[:, :m].double().view(b, m, heads, d // heads)
    z = (v * u.double().view(heads, -1)).sum(-1)
    if inv is not None:
        z = z * inv[:, :m, None].double()
    alpha = torch.softmax(z, dim=1) if kernel == "softmax" else torch.sigmoid(z)
    return (alpha.unsqueeze(-1) * v).sum(1).reshape(b, 1, d)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
def test_the_kernel_reader_equals_the_float64_reference(decode_backend, dtype, heads, kernel, key_norm):
    if decode_backend != "cpu_kernel":
        pytest.skip("the reader is the kernel's")
    g = torch.Generator().manual_seed(3)
    b, k, d, eps = 3, 6, 40, 1e-6
    buffer = torch.randn(b, 2, k, d, generator=g, dtype=dtype)[:, :1]  # batch stride of two tokens' rows
    inv = torch.rand(b, 1, k, generator=g, dtype=dtype) + 0.5 if key_norm else None
    reader = cpu.DecodeReader(buffer.select(1, 0), inv.select(1, 0) if inv is not None else None, heads, kernel, eps)
    u = torch.randn(d, generator=g, dtype=dtype)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 2e-6}
    rows, norms = buffer.select(1, 0), (inv.select(1, 0) if inv is not None else None)
    torch.testing.assert_close(reader.read(4, u).double(), reference_read(rows, norms, u, 4, heads, kernel), **tol)
    # a read that first stores a vector as row m - 1, with its inverse RMS
    v = torch.randn(b, 1, d, generator=g, dtype=dtype)
    got = reader.read(5, u, store=v)
    torch.testing.assert_close(rows[:, 4], v[:, 0])
    if norms is not None:
        want = torch.rsqrt(v.double().pow(2).mean(-1) + eps)[:, 0]
        torch.testing.assert_close(norms[:, 4].double(), want, **tol)
    torch.testing.assert_close(got.double(), reference_read(rows, norms, u, 5, heads, kernel), **tol)
    # a store alone writes the row and reads nothing
    w = torch.randn(b, 1, d, generator=g, dtype=dtype)
    reader.store(5, w)
    torch.testing.assert_close(rows[:, 5], w[:, 0])


def test_the_table_chooses_the_kernel_for_float_cpu_rows_and_torch_otherwise(decode_backend):
    if decode_backend != "cpu_kernel":
        pytest.skip("one run is enough")
    case = backends.Case(device="cpu", dtype=torch.float32, d=32, heads=2)
    assert backends._RULES["decode_read"]("decode_read", "forward", case, None).backend == "cpu_kernel"
    bf16 = backends.Case(device="cpu", dtype=torch.bfloat16, d=32, heads=2)
    assert backends._RULES["decode_read"]("decode_read", "forward", bf16, None).backend == "torch"
    off = backends._RULES["decode_read"]("decode_read", "forward", case, {"ATTNRES_CPU_KERNEL": "0"})
    assert off.backend == "torch" and "ATTNRES_CPU_KERNEL=0" in off.reason
    cuda = backends.Case(device="cuda", dtype=torch.float32, d=32, heads=2)
    assert backends._RULES["decode_read"]("decode_read", "forward", cuda, None).backend == "torch"


def test_decoding_runs_the_backend_the_table_chose(decode_backend):
    model = model_for("block", torch.float32, attnres_heads=2)
    with backends.record() as choices:
        decoded(model, tokens(8), prefill=6)
    ran = {c.backend for c in choices if c.op == "decode_read"}
    assert ran == {decode_backend}
