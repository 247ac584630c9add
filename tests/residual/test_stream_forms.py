"""Every form of the AttnRes stream (attnres/residual/depth_streams.py) against the reference stream, in
float64 with stand-in sublayers: the sublayer inputs, the output and the gradients; and a stream handed
from sublayer to sublayer as a DepthState (with the fast forms' cache, and without it) computes the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import randomize

from attnres.ops import backends
from attnres.residual import BlockAttnRes, DepthState, FullAttnRes
from attnres.residual import attnres as attnres_scheme
from attnres.residual import depth_streams as forms

D, L = 8, 6

# (scheme, the form it must run); each builds its scheme fresh so parameters are seeded the same way
CASES = {
    "scalar": (lambda: BlockAttnRes(D, L, attnres_block_size=2, attnres_weights="scalar"), forms.ScalarMixStream),
    "fused": (lambda: BlockAttnRes(D, L, attnres_block_size=2, attnres_impl="fused"), forms.FusedStream),
    "fused_window": (lambda: FullAttnRes(D, L, attnres_window=2), forms.FusedStream),
    "two_phase_block": (lambda: BlockAttnRes(D, L, attnres_block_sizes=[1, 3, 2]), forms.TwoPhaseStream),
    "two_phase_full_grouped": (lambda: FullAttnRes(D, L, attnres_group_size=3), forms.TwoPhaseStream),
    "two_phase_heads_sigmoid": (
        lambda: BlockAttnRes(D, L, attnres_block_size=4, attnres_heads=2, attnres_kernel="sigmoid"),
        forms.TwoPhaseStream,
    ),
    "token_queries": (
        lambda: BlockAttnRes(D, L, attnres_block_size=3, attnres_weights="low_rank_query", attnres_query_rank=2),
        forms.TokenQueryTwoPhaseStream,
    ),
    "compiled": (lambda: BlockAttnRes(D, L, attnres_block_size=4), forms.CompiledTwoPhaseStream),
    "compiled_full": (
        lambda: FullAttnRes(D, L, attnres_group_size=2, attnres_key_norm=False),
        forms.CompiledTwoPhaseStream,
    ),
    "compiled_full_grouped": (lambda: FullAttnRes(D, L, attnres_group_size=3), forms.CompiledTwoPhaseStream),
    "compiled_heads_sigmoid": (
        lambda: BlockAttnRes(D, L, attnres_block_size=4, attnres_heads=2, attnres_kernel="sigmoid"),
        forms.CompiledTwoPhaseStream,
    ),
}
COMPILED_CASES = sorted(c for c, (_, form) in CASES.items() if form is forms.CompiledTwoPhaseStream)


def scheme_for(case: str):
    torch.manual_seed(0)
    scheme = CASES[case][0]().double()
    randomize(scheme)
    return scheme


def sublayers():
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5 for _ in range(L)]
    return [lambda h, w=w: torch.tanh(h @ w) for w in weights]


def run(scheme, x, handover: str = "none"):
    """(inputs h_l, output) of one pass; ``handover``: "none" (one stream), "cache" (a new stream from
    the DepthState after every sublayer) or "plain" (the same without the cache)."""
    inputs = []
    stream = scheme.begin(x)
    for f in sublayers():
        if handover != "none":
            depth = stream.depth()
            if handover == "plain":
                depth = DepthState(depth.at, depth.history, depth.state)
            stream = scheme.stream(depth)
        h = stream.read()
        inputs.append(h)
        stream.write(None, f(h))
    return inputs, stream.end()


def trained_pass(scheme, x, handover: str = "none"):
    """One pass and its backward: (inputs h_l, output, d/dx, d/dparameters)."""
    x.grad = None
    inputs, out = run(scheme, x, handover)
    (out.square().sum() + sum(h.sum() for h in inputs)).backward()
    return inputs, out, x.grad.clone(), {n: p.grad.clone() for n, p in scheme.named_parameters()}


def assert_same_pass(got, want):
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[2], want[2], rtol=1e-9, atol=1e-12)
    for n, grad in want[3].items():
        torch.testing.assert_close(got[3][n], grad, rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_form_matches_the_reference_stream(case, monkeypatch):
    # the compiled form runs here as eager code: what torch.compile traces, without the compiler
    if CASES[case][1] is forms.CompiledTwoPhaseStream:
        monkeypatch.setattr(forms, "compiled_form", lambda embedding: True)
    scheme = scheme_for(case)
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert type(scheme.begin(x)) is CASES[case][1]
    got = trained_pass(scheme, x)

    monkeypatch.setattr(
        attnres_scheme,
        "stream_class",
        lambda s, e: forms.ScalarMixStream if case == "scalar" else forms.DepthAttentionStream,
    )
    assert_same_pass(got, trained_pass(scheme_for(case), x))


@pytest.mark.parametrize("pairs", [0, 10**6])
@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_forms_match_the_reference_with_either_phase1(case, pairs, monkeypatch):
    """Every Phase 1 as the custom op (pairs 0) or every one pointwise and recomputed in backward."""
    monkeypatch.setattr(backends, "POINTWISE_PAIRS", pairs)
    monkeypatch.setattr(backends, "CUSTOM_OP_DEVICES", frozenset({"cpu", "cuda"}))
    test_each_form_matches_the_reference_stream(case, monkeypatch)


@pytest.mark.parametrize("handover", ["cache", "plain"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stream_handed_over_after_every_sublayer_computes_the_same(case, handover, monkeypatch):
    if CASES[case][1] is forms.CompiledTwoPhaseStream:
        monkeypatch.setattr(forms, "compiled_form", lambda embedding: True)
    scheme = scheme_for(case)
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want_inputs, want = run(scheme, x)
    got_inputs, got = run(scheme, x, handover)
    for a, b in zip(got_inputs, want_inputs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_the_cache_carries_the_group_statistics_so_phase1_runs_once_per_group():
    scheme = scheme_for("two_phase_block")  # blocks of 1, 3, 2 sublayers: three Phase-1 groups + the final read
    calls = []
    stream = scheme.begin(torch.randn(1, 2, D, dtype=torch.float64))
    phase1 = stream.ops.phase1
    for f in sublayers():
        stream = scheme.stream(stream.depth())
        stream.ops = dataclasses.replace(stream.ops, phase1=lambda *a, **k: calls.append(1) or phase1(*a, **k))
        stream.write(None, f(stream.read()))
    assert len(calls) == 3


def test_wrong_inputs_get_errors_naming_what_was_expected():
    scheme = BlockAttnRes(D, L, attnres_block_size=2)
    with pytest.raises(ValueError, match=r"expected a floating tensor \[B, T, D\]"):
        scheme.begin(torch.randn(3, D))
    with pytest.raises(ValueError, match="last dimension 4 is not d_model=8"):
        scheme.begin(torch.randn(2, 3, 4))
    stream = scheme.begin(torch.randn(2, 3, D))
    stream.read()
    with pytest.raises(ValueError, match=r"f has shape \(2, 3, 1\).*\[2, 3, 8\]"):
        stream.write(None, torch.randn(2, 3, 1))  # would broadcast silently
    with pytest.raises(ValueError, match="resume at sublayer 9"):
        scheme.resume(9, [torch.randn(2, 3, D)], [])


@pytest.mark.parametrize("first", ["compiled", "buffer"])
@pytest.mark.parametrize("case", COMPILED_CASES)
def test_a_stream_handed_between_the_compiled_and_the_buffer_form_computes_the_same(case, first, monkeypatch):
    """When dynamo runs some Transformer blocks and falls back to eager for others (its recompile limit),
    a depth state written by one two-phase form is resumed by the other: after every sublayer the form
    flips, forward and backward equal one stream of one form."""
    turn = iter(range(10**6))
    start = 0 if first == "compiled" else 1
    monkeypatch.setattr(forms, "compiled_form", lambda embedding: (next(turn) + start) % 2 == 0)
    scheme = scheme_for(case)
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got = trained_pass(scheme, x, "cache")
    assert next(turn) > L  # the form was chosen anew at every handover

    monkeypatch.setattr(forms, "compiled_form", lambda embedding: False)
    assert_same_pass(got, trained_pass(scheme_for(case), x))


def normed_pass(scheme, x, norms, fused: bool):
    """One pass whose sublayers read through their pre-norms (``read(norm=...)`` where ``fused``, else
    norm(read())) and its backward: (normed inputs, output, d/dx, d/dparameters of scheme and norms)."""
    x.grad = None
    inputs = []
    stream = scheme.begin(x)
    for f, norm in zip(sublayers(), norms, strict=True):
        h = stream.read(norm=norm) if fused else norm(stream.read())
        inputs.append(h)
        stream.write(None, f(h))
    out = stream.end()
    (out.square().sum() + sum((h * h.detach().cos()).sum() for h in inputs)).backward()
    named = [*scheme.named_parameters(), *((f"norm{i}", n.weight) for i, n in enumerate(norms))]
    return inputs, out, x.grad.clone(), {n: p.grad.clone() for n, p in named}


@pytest.mark.parametrize("kernel", ["0", "auto"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_read_through_the_pre_norm_equals_the_norm_of_the_read(case, kernel, monkeypatch):
    """``read(norm=)``, which two-phase fuses with Phase 2 (and the C++ kernel computes in one pass), gives
    the reference stream's norm(read()), values and gradients, norm weights included."""
    monkeypatch.setenv("ATTNRES_CPU_KERNEL", kernel)
    monkeypatch.setattr(backends, "RMS_NORM_MIN_VALUES", 0)  # these tiny reads run the norm's kernel too
    if CASES[case][1] is forms.CompiledTwoPhaseStream:
        monkeypatch.setattr(forms, "compiled_form", lambda embedding: True)
    g = torch.Generator().manual_seed(4)

    def norms():
        made = [torch.nn.RMSNorm(D, eps=1e-5).double() for _ in range(L)]
        with torch.no_grad():
            for n in made:
                n.weight.copy_(torch.rand(D, generator=torch.Generator().manual_seed(7), dtype=torch.float64) + 0.5)
        return made

    x = torch.randn(2, 3, D, dtype=torch.float64, generator=g, requires_grad=True)
    with backends.record() as found:
        got = normed_pass(scheme_for(case), x, norms(), fused=True)
    if CASES[case][1] is forms.TwoPhaseStream and kernel == "auto" and backends.availability("cpu_kernel")[0]:
        # one head, softmax, key norm: Block's kernel merges the partial sum and normalises at once; Full
        # AttnRes has no partial sum, and its reads run the norm's kernel
        op = "merge_partial" if "block" in case else "rms_norm"
        if "heads" not in case:
            assert ("forward", "cpu_kernel") in {(c.phase, c.backend) for c in found if c.op == op}
    monkeypatch.setattr(
        attnres_scheme,
        "stream_class",
        lambda s, e: forms.ScalarMixStream if case == "scalar" else forms.DepthAttentionStream,
    )
    assert_same_pass(got, normed_pass(scheme_for(case), x, norms(), fused=False))


def test_observers_that_read_inputs_see_the_whole_mixture_before_the_norm(monkeypatch):
    from attnres.residual import DepthRecord, DepthRecorder, IOCounter, observing

    scheme = BlockAttnRes(D, L, attnres_block_size=2).double()
    norm = torch.nn.RMSNorm(D).double()
    x = torch.randn(2, 3, D, dtype=torch.float64)
    calls = []
    monkeypatch.setattr(forms.TwoPhaseStream, "_read_normed", lambda self, l, n: calls.append(l))
    scheme.begin(x).read(norm=norm)
    assert calls == [0]
    with observing(scheme, IOCounter()):  # it counts operations, not values: the read stays fused
        scheme.begin(x).read(norm=norm)
    assert calls == [0, 0]
    record = DepthRecord()
    with observing(scheme, DepthRecorder(record)):
        stream = scheme.begin(x)
        torch.testing.assert_close(stream.read(norm=norm), norm(x))
    assert calls == [0, 0]  # the recorder sees h_l, so nothing was fused
    assert record.input_rms
