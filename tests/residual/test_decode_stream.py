"""The decoding form of the AttnRes stream (``DecodeStream``: one token, no gradients) computes what the
whole-sequence forward computes: token-by-token logits against one forward pass in float64, for every
variant the form claims; the variants it leaves to the general forms still decode exactly; and the
stream-level cases the form adds (a state resumed twice, a cache handed to or from two-phase, an observer
that wraps the ops, queries changed between tokens) agree with the reference stream."""

from __future__ import annotations

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache
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
    if scheme.additive:
        stream.residual = x
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
