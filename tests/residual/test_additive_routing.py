"""Additive routing (``attnres_routing="additive"``, Delta Attention Residuals): a read is the PreNorm
stream h_std plus g_l * sum_i alpha_i v_i. Checked in float64 on random inputs against a loop written
here, every stream form against the reference stream, zero gains against PreNorm (outputs and
gradients), a handed-over stream, cached decoding, the parameter groups, the checks and the table."""

from __future__ import annotations

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache
from attnres.model.schemes_table import schemes_table
from attnres.residual import BlockAttnRes, DepthState, FullAttnRes, residual_scheme
from attnres.residual import attnres as attnres_scheme
from attnres.residual import depth_streams as forms
from attnres.residual.param_groups import param_groups

D, L = 8, 7
SOURCES = ("outputs", "states")


def scheme(kind: str, sources: str, seed: int = 0, **variants):
    torch.manual_seed(seed)
    if kind == "full":
        s = FullAttnRes(D, L, routing="additive", sources=sources, **variants)
    else:
        s = BlockAttnRes(D, L, block_size=3, routing="additive", sources=sources, **variants)
    s = s.double()
    randomize(s, seed=seed + 1)  # queries, key norms and the gains away from their init
    return s


def sublayers():
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5 for _ in range(L)]
    return [lambda h, w=w: torch.tanh(h @ w) for w in weights]


def run(s, x, handover: str = "none"):
    """(inputs h_l, output); ``handover``: "none", or "cache"/"plain": a new stream from the DepthState
    after every sublayer (with and without the fast forms' cache)."""
    inputs = []
    stream = s.begin(x)
    for f in sublayers():
        if handover != "none":
            depth = stream.depth()
            if handover == "plain":
                depth = DepthState(depth.at, depth.history, depth.state)
            stream = s.stream(depth)
        h = stream.read()
        inputs.append(h)
        stream.write(None, f(h))
    return inputs, stream.end()


def loop_reference(s, x):
    """The reads written out: sources by hand, RMSNorm keys, softmax over depth, h_std + g * mixture."""
    S = s.block_size
    inputs, outputs = [], []
    for l, f in enumerate([*sublayers(), None]):
        # completed depth blocks before sublayer l, and whether one is open (the final read: all closed,
        # the last block shorter)
        n_closed, open_block = (l // S, l % S > 0) if f is not None else (-(-L // S), False)
        if s.states:
            running = [x + sum(outputs[: j * S], torch.zeros_like(x)) for j in range(n_closed + 1)]
            values = running + ([x + sum(outputs, torch.zeros_like(x))] if open_block else [])
        else:
            values = [x] + [sum(outputs[j * S : (j + 1) * S]) for j in range(n_closed)]
            values += [sum(outputs[n_closed * S :])] if open_block else []
        q, w, g = s.queries[l], s.key_norm_weight[l], s.routing_gain[l]
        logits = []
        for v in values:
            key = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + s.eps) * w
            logits.append((key * q).sum(-1))
        alpha = torch.softmax(torch.stack(logits), dim=0)
        mixture = sum(a[..., None] * v for a, v in zip(alpha, values, strict=True))
        h_std = x + sum(outputs, torch.zeros_like(x))
        h = h_std + g * mixture
        if f is None:
            return inputs, h
        inputs.append(h)
        outputs.append(f(h))
    raise AssertionError("unreachable")


@pytest.mark.parametrize("sources", SOURCES)
@pytest.mark.parametrize("kind", ["full", "block"])
def test_the_read_matches_a_loop_written_out(kind, sources):
    s = scheme(kind, sources, impl="reference")
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got_inputs, got = run(s, x)
    want_inputs, want = loop_reference(s, x)
    for a, b in zip(got_inputs, want_inputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# (kind, variants, the form it must run)
FORMS = {
    "fused_block": ("block", {"impl": "fused"}, forms.FusedStream),
    "two_phase_block": ("block", {}, forms.TwoPhaseStream),
    "two_phase_full_grouped": ("full", {"group_size": 3}, forms.TwoPhaseStream),
    "compiled_block": ("block", {}, forms.CompiledTwoPhaseStream),
    "token_queries": ("block", {"weights": "low_rank_query", "query_rank": 2}, forms.TokenQueryTwoPhaseStream),
    "scalar": ("full", {"weights": "scalar"}, forms.ScalarMixStream),
    "multi_query": ("block", {"values": "normalized"}, forms.MultiQueryStream),
}


@pytest.mark.parametrize("sources", SOURCES)
@pytest.mark.parametrize("case", sorted(FORMS))
def test_each_form_routes_additively_as_the_reference_stream(case, sources, monkeypatch):
    kind, variants, form = FORMS[case]
    if form is forms.CompiledTwoPhaseStream:  # run as eager code: what torch.compile traces
        monkeypatch.setattr(forms, "compiled_form", lambda embedding: True)
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    fast = scheme(kind, sources, **variants)
    assert type(fast.begin(x)) is form
    got_inputs, got = run(fast, x)
    (got.square().sum() + sum(h.sum() for h in got_inputs)).backward()
    got_grads = {n: p.grad.clone() for n, p in fast.named_parameters()}
    got_x = x.grad.clone()

    plain = forms.ScalarMixStream if case == "scalar" else forms.MultiQueryStream if case == "multi_query" else None
    monkeypatch.setattr(attnres_scheme, "stream_class", lambda s, e: plain or forms.DepthAttentionStream)
    reference = scheme(kind, sources, **variants)
    x.grad = None
    want_inputs, want = run(reference, x)
    (want.square().sum() + sum(h.sum() for h in want_inputs)).backward()
    for a, b in zip(got_inputs, want_inputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-9, atol=1e-12)
    assert got_grads["routing_gain"].abs().sum() > 0  # the gain is trained
    for n, p in reference.named_parameters():
        torch.testing.assert_close(got_grads[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("handover", ["cache", "plain"])
@pytest.mark.parametrize("case", ["two_phase_block", "two_phase_full_grouped", "fused_block"])
def test_a_handed_over_stream_carries_the_prenorm_stream(case, handover):
    kind, variants, _ = FORMS[case]
    s = scheme(kind, "outputs", **variants)
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want_inputs, want = run(s, x)
    got_inputs, got = run(s, x, handover)
    for a, b in zip(got_inputs, want_inputs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def tiny_model(residual: str, **overrides) -> AttnResLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=24)
    cfg = ModelConfig(**{**cfg.to_dict(), "residual": residual, **overrides})
    return AttnResLM(cfg).double()


@pytest.mark.parametrize("sources", SOURCES)
@pytest.mark.parametrize("kind", ["full", "block"])
def test_zero_gains_compute_the_prenorm_model_and_its_gradients(kind, sources):
    prenorm = tiny_model("prenorm")
    geometry = {"attnres_block_size": 2} if kind == "block" else {}
    model = tiny_model(kind, attnres_routing="additive", attnres_sources=sources, **geometry)
    missing, unexpected = model.load_state_dict(prenorm.state_dict(), strict=False)
    assert not unexpected and all(n.startswith("residual.") for n in missing)
    with torch.no_grad():  # the depth attention itself away from its init: only the zero gains make it PreNorm
        randomize(model.residual, seed=3)
        model.residual.routing_gain.zero_()
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
    want, got = prenorm(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want.logsumexp(-1).sum().backward()
    got.logsumexp(-1).sum().backward()
    for name, p in prenorm.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, p.grad, rtol=1e-10, atol=1e-12)
    # at zero gains only the gains learn: the depth attention's output is multiplied by them
    assert model.residual.routing_gain.grad.abs().sum() > 0
    assert model.residual.queries.grad.abs().max() == 0


@pytest.mark.parametrize("kind", ["full", "block"])
def test_cached_decoding_equals_the_full_forward(kind):
    model = tiny_model(kind, attnres_routing="additive").eval()
    randomize(model.residual, seed=1, scale=0.3)
    x = torch.randint(0, 61, (2, 18), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        cache = KVCache.for_model(model, batch_size=2)
        steps = [model(x[:, :6], cache=cache)]
        steps += [model(x[:, t : t + 1], cache=cache) for t in range(6, 18)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


def test_the_gains_are_attnres_parameters_without_weight_decay():
    model = tiny_model("block", attnres_routing="additive")
    gain = model.residual.routing_gain
    assert gain.shape == (model.config.n_sublayers + 1, 16) and gain.abs().max() == 0
    groups = param_groups(model, weight_decay=0.1)
    (no_decay,) = [g for g in groups if g["weight_decay"] == 0]
    assert any(p is gain for p in no_decay["params"])
    extra = model.num_params() - tiny_model("block").num_params()
    assert extra == gain.numel()


def test_bad_routing_is_named_with_its_fix():
    choices = r"choose one of \('replacement', 'additive'\)"
    with pytest.raises(ValueError, match=r"attnres_routing='sum' is invalid: " + choices):
        ModelConfig(residual="block", attnres_routing="sum")
    applies = r"applies to residual='full' or 'block' only \(residual='prenorm'\); drop it"
    with pytest.raises(ValueError, match=r"attnres_routing='additive' is invalid: " + applies):
        ModelConfig(residual="prenorm", attnres_routing="additive")
    with pytest.raises(ValueError, match="ResidualConfig.attnres_routing"):
        residual_scheme("full", D, L, attnres_routing="delta")


def test_the_schemes_table_lists_additive_routing():
    table = schemes_table()
    line = next(row for row in table.splitlines() if "additive" in row)
    assert "attnres_routing" in line
