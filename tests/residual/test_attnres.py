"""Full and Block AttnRes streams (docs/method.md §3-6) driven by the model: every option against the
float64 loop reference, the zero-query equivalence with PreNorm, the fast paths against the plain
one, the depth record and the bookkeeping."""

import pytest
import torch
from reference import randomize, reference_stream_inputs

from attnres.residual import RESIDUALS

# (residual, overrides) covering every option; "block" with S odd and L not divisible
VARIANTS = [
    ("full", {}),
    ("full", {"attnres_kernel": "sigmoid"}),
    ("full", {"attnres_key_norm": False}),
    ("full", {"attnres_weights": "input_query"}),
    ("full", {"attnres_weights": "scalar"}),
    ("full", {"attnres_window": 2}),
    ("full", {"attnres_heads": 4}),
    ("full", {"attnres_group_size": 1}),
    ("full", {"attnres_group_size": 4}),  # L=6: groups of 4 and 2
    ("full", {"attnres_group_size": 3, "attnres_kernel": "sigmoid", "attnres_heads": 2}),
    ("block", {}),
    ("block", {"attnres_blocks": 2}),
    ("block", {"n_layers": 5, "attnres_blocks": 4}),  # L=10, S=3: blocks of 3, 3, 3, 1
    ("block", {"attnres_block_size": 1}),
    ("block", {"attnres_block_size": 6}),  # N = 1
    ("block", {"attnres_heads": 2, "attnres_weights": "input_query"}),
    ("block", {"attnres_key_norm": False, "attnres_kernel": "sigmoid"}),
    ("block", {"attnres_weights": "scalar"}),
]
IDS = [f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for r, o in VARIANTS]


@pytest.mark.parametrize(
    "residual,overrides",
    [v for v in VARIANTS if "attnres_window" not in v[1]],
    ids=[i for i, v in zip(IDS, VARIANTS, strict=True) if "attnres_window" not in v[1]],
)
def test_zero_initialised_attnres_equals_prenorm(residual, overrides, make, tokens):
    """docs/method.md §3: zero queries -> uniform weights -> mean of sources -> same function after RMSNorm."""
    # exact up to norm eps; at init the mean of K sources has a small RMS (embedding std 0.02),
    # so eps must be far below it for the comparison to be tight
    overrides = {**overrides, "norm_eps": 1e-20}
    model = make(residual, **overrides)
    base = make("prenorm", **{k: v for k, v in overrides.items() if not k.startswith("attnres")})
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("residual.") for k in missing)
    x = tokens()
    torch.testing.assert_close(model(x), base(x), rtol=1e-9, atol=1e-9)


def test_block_with_n_equal_l_is_full(make, tokens):
    full = make("full")
    randomize(full.residual)
    block = make("block", attnres_blocks=full.config.n_sublayers)
    block.load_state_dict(full.state_dict())
    x = tokens()
    torch.testing.assert_close(block(x), full(x), rtol=1e-12, atol=1e-12)


def capture(model, x):
    """Run the model and capture the embedding, every sublayer input and output, the final input."""
    got = {"in": [], "out": []}
    hooks = [model.embed.register_forward_hook(lambda m, a, o: got.__setitem__("emb", o))]
    for block in model.blocks:
        for norm, fn in ((block.attn_norm, block.attn), (block.mlp_norm, block.mlp)):
            hooks.append(norm.register_forward_pre_hook(lambda m, a: got["in"].append(a[0])))
            hooks.append(fn.register_forward_hook(lambda m, a, o: got["out"].append(o)))
    hooks.append(model.norm.register_forward_pre_hook(lambda m, a: got.__setitem__("final", a[0])))
    model(x)
    for h in hooks:
        h.remove()
    return got


@pytest.mark.parametrize("impl", ["two_phase", "fused", "reference"])
@pytest.mark.parametrize("residual,overrides", VARIANTS, ids=IDS)
def test_sublayer_inputs_match_float64_reference(residual, overrides, impl, make, tokens):
    model = make(residual, attnres_impl=impl, **overrides)
    randomize(model.residual)
    got = capture(model, tokens())
    want = reference_stream_inputs(model.residual, got["emb"], got["out"])
    assert len(got["in"]) == model.config.n_sublayers
    for l, (a, b) in enumerate(zip(got["in"] + [got["final"]], want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"sublayer {l}")


@pytest.mark.parametrize("residual,overrides", VARIANTS[:2] + VARIANTS[3:4] + VARIANTS[6:10] + VARIANTS[12:14])
def test_fast_and_reference_paths_agree_on_gradients(residual, overrides, make, tokens):
    models = {}
    for impl in ("two_phase", "fused", "reference"):
        m = make(residual, attnres_impl=impl, **overrides)
        randomize(m.residual)
        loss = m(tokens()).logsumexp(-1).mean()
        loss.backward()
        models[impl] = m
    grads = {n: p.grad for n, p in models["reference"].named_parameters()}
    for impl in ("two_phase", "fused"):
        for n, p in models[impl].named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-9, atol=1e-12, msg=f"{impl}: {n}")


@pytest.mark.parametrize("residual,overrides", [v for v in VARIANTS if v[1].get("attnres_kernel") != "sigmoid"])
def test_softmax_weights_sum_to_one(residual, overrides, make, tokens):
    model = make(residual, **overrides)
    randomize(model.residual)
    record = model(tokens(), return_record=True).record
    assert len(record.weights) == model.config.n_sublayers + 1
    for l, w in enumerate(record.weights):
        assert w.shape[0] == len(record.sources[l]) == model.residual.num_sources(l)
        torch.testing.assert_close(w.sum(0), torch.ones_like(w[0]), rtol=1e-6, atol=1e-6)
    assert len(record.input_rms) == len(record.output_rms) == model.config.n_sublayers


def test_record_names_sources(make, tokens):
    model = make("block", attnres_block_size=2)
    srcs = model(tokens(), return_record=True).record.sources
    assert srcs[0] == ["emb"]
    assert srcs[1] == ["emb", "b1~"]  # second sublayer of block 1: the partial sum
    assert srcs[2] == ["emb", "b1"]  # first sublayer of block 2: no partial sum
    assert srcs[-1] == ["emb", "b1", "b2", "b3"]
    assert make("prenorm")(tokens(), return_record=True).record.weights[0] is None


def test_parameter_counts(make):
    prenorm = make("prenorm").num_params()
    d, L = make("prenorm").config.d_model, make("prenorm").config.n_sublayers
    assert make("full").num_params() - prenorm == 2 * d * L + 2 * d
    assert make("block").num_params() - prenorm == 2 * d * L + 2 * d
    assert make("full", attnres_heads=4).num_params() - prenorm == 2 * d * (L + 1)
    assert make("full", attnres_key_norm=False).num_params() - prenorm == d * (L + 1)
    assert make("full", attnres_weights="input_query").num_params() - prenorm == (d * d + d) * (L + 1)
    # scalar mixing: sublayer l of Full reads l + 1 sources; the final reads L + 1
    assert make("full", attnres_weights="scalar").num_params() - prenorm == sum(l + 1 for l in range(L)) + L + 1
    for residual, overrides in VARIANTS + [("prenorm", {})]:
        model = make(residual, **overrides)
        formula = RESIDUALS[residual].extra_params(model.config)
        assert (
            model.num_params()
            - make("prenorm", **{k: v for k, v in overrides.items() if not k.startswith("attnres")}).num_params()
            == formula
        )


def test_stream_must_be_driven_in_order(make):
    model = make("block")
    d = model.config.d_model
    stream = model.residual.begin(torch.randn(1, 2, d, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="out of order"):
        stream.read(1)
    stream.read(0)
    with pytest.raises(RuntimeError, match="out of order"):
        stream.write(1, torch.zeros(1, 2, d))
    with pytest.raises(RuntimeError, match="end"):
        stream.end()


@pytest.mark.parametrize(
    "residual,overrides",
    [("full", {}), ("block", {"attnres_blocks": 2}), ("full", {"attnres_heads": 2, "attnres_kernel": "sigmoid"})],
)
def test_scaled_norm_eps_makes_the_equivalence_exact_at_default_eps(residual, overrides, make, tokens):
    model = make(residual, attnres_scale_norm_eps=True, **overrides)
    base = make("prenorm")
    model.load_state_dict(base.state_dict(), strict=False)
    x = tokens()
    torch.testing.assert_close(model(x), base(x), rtol=1e-12, atol=1e-12)
    unscaled = make(residual, **overrides)
    unscaled.load_state_dict(base.state_dict(), strict=False)
    assert (unscaled(x) - base(x)).abs().max() > 1e-6  # without it the default eps shows
