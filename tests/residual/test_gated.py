"""The "gated" rival: the gated multi-head depth attention that write-ups present as AttnRes.

Its definition (attnres/residual/gated.py, docs/method.md §5) is re-derived here in float64, token by
token and head by head, from the module as written (every source projected to a key and a value),
and compared with both implementations the stream runs.
"""

import math

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache
from attnres.model.llama import output_logits, run_blocks
from attnres.model.schemes_table import base_params, schemes_table
from attnres.ops.gated_depth_attention import gated_depth_attention
from attnres.residual import RESIDUALS, DepthState, IOCounter, build_residual, observing
from attnres.residual.gated import DepthAttention

BASE = dict(vocab_size=50, d_model=16, n_layers=3, n_heads=2, max_seq_len=24)  # L = 6


def make(seed=0, dtype=torch.float64, **overrides):
    torch.manual_seed(seed)
    return AttnResLM(ModelConfig(**{**BASE, "residual": "gated", **overrides})).to(dtype)


def tokens(seed=0, b=2, t=6):
    return torch.randint(0, BASE["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def reference(scheme, emb, outs):
    """Sublayer inputs and the stream's output, one token and one head at a time, from the definition:
    h_l = g x_l + (1 - g) sum_i a_i (W_v v_i + b_v), a = softmax_i((W_q x_l + b_q) . (W_k v_i + b_k) / sqrt(d_h))
    per head, x_1 = v_0, x_{l+1} = h_l + f_l, sources [v_0, f_1, …, f_{l-1}]."""
    B, T, D = emb.shape
    L, H = scheme.n_sublayers, scheme.heads
    dh = D // H
    result = [torch.zeros(B, T, D, dtype=torch.float64) for _ in range(L + 1)]
    for b in range(B):
        for t in range(T):
            x, sources = emb[b, t], [emb[b, t]]
            for l in range(L + 1):
                m = scheme.depth_attention[l]
                Wq, bq, Wk, bk, Wv, bv, g = (p.detach() for p in m.weights())
                q = Wq @ x + bq
                keys = [Wk @ v + bk for v in sources]
                vals = [Wv @ v + bv for v in sources]
                out = torch.zeros(D, dtype=torch.float64)
                for head in range(H):
                    ch = slice(head * dh, (head + 1) * dh)
                    z = torch.stack([(q[ch] * k[ch]).sum() / math.sqrt(dh) for k in keys])
                    a = torch.softmax(z, 0)
                    out[ch] = sum(a[i] * vals[i][ch] for i in range(len(sources)))
                h = g * x + (1 - g) * out
                result[l][b, t] = h
                if l == L:
                    break
                x = h + outs[l][b, t]
                sources.append(outs[l][b, t])
    return result


@pytest.mark.parametrize("impl", ["two_phase", "reference"])
@pytest.mark.parametrize("heads", [1, 2, 8])
def test_stream_matches_float64_reference(heads, impl):
    cfg = ModelConfig(**{**BASE, "residual": "gated", "gated_heads": heads, "attnres_impl": impl})
    torch.manual_seed(0)
    scheme = build_residual(cfg).double()
    randomize(scheme, scale=0.3)
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(2, 3, 16, generator=g, dtype=torch.float64)
    outs = [torch.randn(2, 3, 16, generator=g, dtype=torch.float64) for _ in range(6)]
    stream = scheme.begin(emb)
    got = []
    for l in range(6):
        got.append(stream.read(l))
        stream.write(l, outs[l])
    got.append(stream.end())
    for l, (a, b) in enumerate(zip(got, reference(scheme, emb, outs), strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"consumer {l}")


@pytest.mark.parametrize("absorbed", [True, False])
def test_op_gradcheck(absorbed):
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: (0.5 * torch.randn(s, generator=g, dtype=torch.float64)).requires_grad_()  # noqa: E731
    D, H = 4, 2
    current, sources = rnd(1, 2, D), [rnd(1, 2, D) for _ in range(3)]
    params = (rnd(D, D), rnd(D), rnd(D, D), rnd(D), rnd(D, D), rnd(D), rnd())

    def f(x, *rest):
        return gated_depth_attention(x, rest[:3], *rest[3:], heads=H, absorbed=absorbed)

    assert torch.autograd.gradcheck(f, (current, *sources, *params))


def test_absorbed_and_literal_forms_agree_on_values_and_gradients():
    grads, logits = {}, {}
    for impl in ("two_phase", "reference"):
        model = make(attnres_impl=impl, gated_heads=4)
        randomize(model.residual, scale=0.3)
        out = model(tokens())
        out.logsumexp(-1).mean().backward()
        logits[impl] = out
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    torch.testing.assert_close(logits["two_phase"], logits["reference"], rtol=1e-10, atol=1e-12)
    for name, g in grads["reference"].items():
        torch.testing.assert_close(grads["two_phase"][name], g, rtol=1e-8, atol=1e-12, msg=name)
        # consumer 0 reads one source: its q and k projections get no gradient, like any softmax over one
        lone = name.startswith("residual.depth_attention.0.") and ("q_proj" in name or "k_proj" in name)
        if name.startswith("residual.") and not name.endswith("k_proj.bias") and not lone:
            assert g.abs().sum() > 0, name


def test_key_bias_is_inert():
    """q . b_k is the same for every source of a head, so softmax ignores it (documented in the op)."""
    model = make(gated_heads=2)
    randomize(model.residual, scale=0.3)
    x = tokens()
    before = model(x)
    with torch.no_grad():
        for m in model.residual.depth_attention:
            m.k_proj.bias.add_(torch.randn_like(m.k_proj.bias))
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)


def test_initialisation_as_written():
    torch.manual_seed(0)
    m = DepthAttention(256, heads=8)
    assert m.gate.item() == 0.5 and m.q_proj.bias.abs().sum() == 0
    assert abs(m.q_proj.weight.std().item() - 0.01) < 0.0005
    bound = 1 / math.sqrt(256)  # nn.Linear's default for k and v
    for p in (m.k_proj.weight, m.k_proj.bias, m.v_proj.weight, m.v_proj.bias):
        assert p.abs().max() <= bound and p.std() > bound / 3


def test_parameter_count_and_classification():
    d, L = BASE["d_model"], 6
    model, prenorm = make(), AttnResLM(ModelConfig(**BASE, residual="prenorm"))
    want = (L + 1) * (3 * d * d + 3 * d + 1)
    assert model.num_params() - prenorm.num_params() == want == RESIDUALS["gated"].extra_params(model.config)
    assert make(gated_heads=2).num_params() == model.num_params()  # heads only split channels
    info = RESIDUALS["gated"]
    assert (info.weight_type_of(model.config), info.source, info.depth_state(model.config)) == (
        "dynamic",
        "cross-layer",
        L + 1,
    )
    row = next(line for line in schemes_table().splitlines() if line.startswith("| gated |"))
    demo = 4096 * 128 * 2 + 8 * (4 * 128 * 128 + 3 * 128 * 352 + 2 * 128) + 128
    extra = 17 * (3 * 128 * 128 + 3 * 128 + 1)
    assert f"| {extra:,} | {100 * extra / demo:.2f}% | 17 |" in row
    assert base_params(ModelConfig(vocab_size=4096, d_model=128, n_layers=8, n_heads=4)) == demo


def test_depth_weights_are_reported_per_head_and_sum_to_one():
    from attnres.analysis.depth import depth_weight_matrix

    model = make(gated_heads=4)
    randomize(model.residual, scale=0.3)
    record = model(tokens(), return_record=True).record
    assert len(record.weights) == 7
    for l, (w, names) in enumerate(zip(record.weights, record.sources, strict=True)):
        assert w.shape == (l + 1, 2, 6, 4) and names == ["emb"] + [f"v{i}" for i in range(1, l + 1)]
        torch.testing.assert_close(w.sum(0), torch.ones_like(w[0]), rtol=1e-6, atol=1e-6)
    assert depth_weight_matrix(record).shape == (7, 7)


def test_causality():
    model = make(gated_heads=2)
    randomize(model.residual, scale=0.3)
    x = tokens(t=9)
    base = model(x)
    for t in (0, 4, 8):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % BASE["vocab_size"]
        out = model(y)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert (out[:, t] - base[:, t]).abs().max() > 0


@pytest.mark.parametrize("impl", ["two_phase", "reference"])
def test_cached_decoding_and_handover(impl):
    model = make(attnres_impl=impl, gated_heads=2).eval()
    randomize(model.residual, seed=4, scale=0.3)
    x = tokens(seed=1, t=12)
    with torch.no_grad():
        full = model(x)
        cache = KVCache.for_model(model, batch_size=2)
        steps = [model(x[:, :4], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    cos, sin = model.rope_cos[:12], model.rope_sin[:12]
    depth = model.residual.start(model.embed(x))
    for i, block in enumerate(model.blocks):
        depth = run_blocks(depth, model.residual, [(i, block)], cos, sin)
        history, state = depth.history, depth.state
        assert len(history) == 2 * (i + 1) + 1 and len(state) == 1
        depth = DepthState(
            2 * (i + 1), tuple(h.detach().clone() for h in history), tuple(s.detach().clone() for s in state)
        )
    torch.testing.assert_close(
        output_logits(model.norm, model.lm_head, model.residual.finish(depth)), full, rtol=0, atol=1e-12
    )


def test_io_counter_counts_the_state_and_every_source():
    model = make()
    with observing(model.residual, IOCounter()) as counter, torch.no_grad():
        model(tokens())
    assert counter.reads == [2 + l + (2 if l < 6 else 0) for l in range(7)]  # x, l + 1 sources; x + f
    assert counter.writes == [2] * 6 + [1]


BAD = [
    ({"gated_heads": 3}, "gated_heads", "must divide d_model=16"),
    ({"gated_heads": 0}, "gated_heads", "positive integer"),
    ({"d_model": 20, "n_heads": 2}, "gated_heads", "must divide d_model=20 (the default is 8)"),
    ({"residual": "block", "gated_heads": 2}, "gated_heads", "residual='gated' only"),
]


@pytest.mark.parametrize("overrides,field,fix", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_invalid_option_raises_naming_field_value_and_fix(overrides, field, fix):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**BASE, "residual": "gated", **overrides})
    value = overrides.get(field, 8)
    assert f"ModelConfig.{field}={value!r} is invalid: " in str(err.value) and fix in str(err.value)
