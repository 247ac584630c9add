"""The rival residual schemes (ReZero, LayerScale, Highway, DenseFormer, MUDD, HC, mHC).

Every update rule is re-derived here in float64, token by token, from the
papers' equations (see the module docstrings of attnres/residual/scaled.py,
dense.py, hyper.py), and compared with the stream the model drives.
"""

import math

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.model.schemes_table import (
    DEMO_MODEL,
    base_params,
    scheme_config,
    schemes_table,
)
from attnres.residual import RESIDUALS, build_residual, sinkhorn

RIVALS = ("rezero", "layerscale", "highway", "denseformer", "mudd", "hyper", "mhc")

VARIANTS = [
    ("rezero", {}),
    ("layerscale", {}),
    ("layerscale", {"layerscale_init": 0.5}),
    ("highway", {}),
    ("highway", {"highway_rank": 3}),
    ("denseformer", {}),
    ("denseformer", {"denseformer_dilation": 2}),
    ("denseformer", {"denseformer_period": 2}),
    ("denseformer", {"n_layers": 5, "denseformer_dilation": 2, "denseformer_period": 2}),
    ("mudd", {}),
    ("hyper", {}),
    ("hyper", {"hyper_dynamic": False}),
    ("hyper", {"hyper_streams": 2}),
    ("mhc", {}),
    ("mhc", {"mhc_streams": 2, "mhc_sinkhorn_iters": 5}),
]
IDS = [f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for r, o in VARIANTS]


def prenorm_overrides(overrides):
    return {k: v for k, v in overrides.items() if k in ("n_layers", "norm_eps")}


# ----------------------------------------------------------------------------- float64 references


def sig(x):
    return 1.0 / (1.0 + torch.exp(-x))


def rms_unit(x, eps):
    return x / torch.sqrt((x * x).mean() + eps)


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def reference(s, cfg, emb, outs):
    """Sublayer inputs and the stream's final output, one token at a time."""
    B, T, D = emb.shape
    L, eps, name = cfg.n_sublayers, cfg.norm_eps, cfg.residual
    inputs = [torch.zeros(B, T, D, dtype=torch.float64) for _ in range(L)]
    final = torch.zeros(B, T, D, dtype=torch.float64)
    P = {n: p.detach() for n, p in s.named_parameters()}
    for b in range(B):
        for t in range(T):
            e = emb[b, t]
            f = [o[b, t] for o in outs]
            if name in ("rezero", "layerscale", "highway"):
                ins, out = _ref_single(name, P, cfg, e, f, eps)
            elif name in ("denseformer", "mudd"):
                ins, out = _ref_dense(name, P, cfg, e, f, eps)
            elif name == "hyper":
                ins, out = _ref_hyper(P, cfg, e, f, eps)
            else:
                ins, out = _ref_mhc(P, cfg, e, f, eps)
            for l in range(L):
                inputs[l][b, t] = ins[l]
            final[b, t] = out
    return inputs, final


def _ref_single(name, P, cfg, h, f, eps):
    ins = []
    for l in range(cfg.n_sublayers):
        ins.append(h)
        if name == "rezero":
            h = h + P["alpha"][l] * f[l]
        elif name == "layerscale":
            h = h + P["scale"][l] * f[l]
        else:
            W = P["gate_weight"][l] if cfg.highway_rank is None else P["gate_up"][l] @ P["gate_down"][l]
            g = sig(W @ rms_unit(h, eps) + P["gate_bias"][l])
            h = (1 - g) * h + g * f[l]
    return ins, h


def _ref_dense(name, P, cfg, h, f, eps):
    k, p = cfg.denseformer_dilation, cfg.denseformer_period
    X, ins, n_dwa = [h], [], 0
    for l in range(cfg.n_sublayers):
        ins.append(h)
        h = h + f[l]
        if l % 2 == 0:
            continue
        I = len(X)  # Transformer block I just finished
        X.append(h)
        if name == "denseformer":
            if I % p:
                continue
            js = [j for j in range(I + 1) if (I - j) % k == 0]
            w = P[f"dwa_weights.{n_dwa}"]
            n_dwa += 1
            h = sum(w[m] * X[j] for m, j in enumerate(js))
        else:
            w1, w2, a = P[f"w1.{I - 1}"], P[f"w2.{I - 1}"], P[f"static.{I - 1}"]
            w = w2 @ gelu(w1 @ rms_unit(X[I], eps)) + a
            assert w.shape == (I + 1,)
            h = sum(w[j] * X[j] for j in range(I + 1))
    return ins, h


def _ref_hyper(P, cfg, e, f, eps):
    n, d = cfg.hyper_streams, cfg.d_model
    H = [e.clone() for _ in range(n)]
    ins = []
    for l in range(cfg.n_sublayers):
        A_m = P["static_pre"][l].clone()
        A_r = P["static_res"][l].clone()  # A_r[j, k]: old stream j -> new stream k
        Bv = P["static_post"][l].clone()
        if cfg.hyper_dynamic:
            for j in range(n):
                u = rms_unit(H[j], eps)
                A_m[j] += P["alpha_scale"][l] * torch.tanh(u @ P["dynamic_alpha"][l][:, 0])
                for k in range(n):
                    A_r[j, k] += P["alpha_scale"][l] * torch.tanh(u @ P["dynamic_alpha"][l][:, 1 + k])
                Bv[j] += P["beta_scale"][l] * torch.tanh(u @ P["dynamic_beta"][l])
        ins.append(sum(A_m[j] * H[j] for j in range(n)))
        H = [sum(A_r[j, k] * H[j] for j in range(n)) + Bv[k] * f[l] for k in range(n)]
    assert all(x.shape == (d,) for x in H)
    return ins, sum(H)


def _ref_sinkhorn(logits, iters):
    n = logits.shape[0]
    M = torch.exp(logits)
    for _ in range(iters):
        for i in range(n):
            M[i, :] = M[i, :] / M[i, :].sum()
        for j in range(n):
            M[:, j] = M[:, j] / M[:, j].sum()
    return M


def _ref_mhc(P, cfg, e, f, eps):
    n = cfg.mhc_streams
    H = [e.clone() for _ in range(n)]
    ins = []
    for l in range(cfg.n_sublayers):
        u = rms_unit(torch.cat(H), eps)
        a_pre, a_post, a_res = P["gate"][l]
        pre = sig(a_pre * (u @ P["phi_pre"][l]) + P["bias_pre"][l])
        post = 2 * sig(a_post * (u @ P["phi_post"][l]) + P["bias_post"][l])
        logits = torch.zeros(n, n, dtype=torch.float64)
        for i in range(n):
            for j in range(n):
                logits[i, j] = a_res * (u @ P["phi_res"][l][:, i * n + j]) + P["bias_res"][l][i, j]
        R = _ref_sinkhorn(logits, cfg.mhc_sinkhorn_iters)  # R[i, j]: old stream j -> new stream i
        ins.append(sum(pre[j] * H[j] for j in range(n)))
        H = [sum(R[i, j] * H[j] for j in range(n)) + post[i] * f[l] for i in range(n)]
    return ins, sum(H)


# ----------------------------------------------------------------------------- tests


def test_registry_lists_every_scheme():
    assert set(RIVALS) | {"prenorm", "full", "block", "gated"} == set(RESIDUALS)  # gated: tests/residual/test_gated.py
    for name, info in RESIDUALS.items():
        assert info.name == name and info.description
        assert info.weight_type_of(ModelConfig(residual=name)) in ("fixed", "static", "dynamic")
        assert info.source in ("single state", "multi-stream", "cross-layer")
    table5 = {
        "rezero": ("static", "single state"),
        "layerscale": ("static", "single state"),
        "highway": ("dynamic", "single state"),
        "denseformer": ("static", "cross-layer"),
        "mudd": ("dynamic", "cross-layer"),
        "hyper": ("dynamic", "multi-stream"),
        "mhc": ("dynamic", "multi-stream"),
    }
    for name, (weight, source) in table5.items():
        info = RESIDUALS[name]
        assert (info.weight_type_of(ModelConfig(residual=name)), info.source) == (weight, source)
    assert RESIDUALS["hyper"].weight_type_of(ModelConfig(residual="hyper", hyper_dynamic=False)) == "static"


@pytest.mark.parametrize("residual,overrides", VARIANTS, ids=IDS)
def test_stream_matches_float64_reference(residual, overrides, config):
    cfg = config(residual, **overrides)
    torch.manual_seed(0)
    scheme = build_residual(cfg).double()
    randomize(scheme)
    g = torch.Generator().manual_seed(2)
    B, T, D, L = 2, 3, cfg.d_model, cfg.n_sublayers
    emb = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    outs = [torch.randn(B, T, D, generator=g, dtype=torch.float64) for _ in range(L)]
    stream = scheme.begin(emb)
    got = []
    for l in range(L):
        got.append(stream.read(l))
        stream.write(l, outs[l])
    final = stream.end()
    want, want_final = reference(scheme, cfg, emb, outs)
    for l in range(L):
        torch.testing.assert_close(got[l], want[l], rtol=1e-10, atol=1e-12, msg=f"sublayer {l}")
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)


STEP0 = [
    ("layerscale", {"layerscale_init": 1.0}),
    ("denseformer", {}),
    ("denseformer", {"n_layers": 5, "denseformer_dilation": 2, "denseformer_period": 2}),
    ("mudd", {}),
    ("hyper", {}),
    ("hyper", {"hyper_dynamic": False, "hyper_streams": 3}),
    ("mhc", {}),
    ("mhc", {"mhc_streams": 3}),
]


@pytest.mark.parametrize(
    "residual,overrides",
    STEP0,
    ids=[f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for r, o in STEP0],
)
def test_initialised_scheme_equals_prenorm(residual, overrides, make, tokens):
    """Identity-initialised averaging, PreNorm-equivalent HC matrices, mHC's static init."""
    overrides = {**overrides, "norm_eps": 1e-20}  # exact up to norm eps: keep eps far below the RMS
    model = make(residual, **overrides)
    base = make("prenorm", **prenorm_overrides(overrides))
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("residual.") for k in missing)
    x = tokens()
    torch.testing.assert_close(model(x), base(x), rtol=1e-9, atol=1e-9)


def test_rezero_starts_as_the_identity_and_layerscale_damps_by_its_init(config, make, tokens):
    x = tokens()
    model, base = make("rezero"), make("prenorm")
    model.load_state_dict(base.state_dict(), strict=False)
    emb = model.embed(x)
    torch.testing.assert_close(model(x), model.lm_head(model.norm(emb)), rtol=1e-12, atol=1e-12)
    assert torch.all(build_residual(config("layerscale")).scale == 0.1)  # CaiT: 0.1 up to 18 blocks
    assert torch.all(build_residual(config("layerscale", n_layers=20)).scale == 1e-5)
    assert torch.all(build_residual(config("layerscale", n_layers=30)).scale == 1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mhc_mixer_is_doubly_stochastic(dtype, config):
    """20 Sinkhorn-Knopp iterations from the documented init, every parameter perturbed."""
    cfg = config("mhc")
    scheme = build_residual(cfg).to(dtype)
    randomize(scheme, scale=0.1)
    H = torch.randn(cfg.mhc_streams, 2, 5, cfg.d_model, dtype=dtype, generator=torch.Generator().manual_seed(3))
    for l in range(cfg.n_sublayers):
        pre, post, res = scheme.coefficients(l, H)
        assert res.dtype == torch.promote_types(dtype, torch.float32) and res.shape == (2, 5, 4, 4)
        assert res.std(-1).min() > 0  # input-dependent, not the static init
        assert (res >= 0).all() and (pre > 0).all() and (pre < 1).all()
        assert (post > 0).all() and (post < 2).all()
        ones = torch.ones_like(res[..., 0])
        torch.testing.assert_close(res.sum(-1), ones, rtol=0, atol=1e-6)
        torch.testing.assert_close(res.sum(-2), ones, rtol=0, atol=1e-6)


def test_sinkhorn_on_sharp_logits_needs_more_than_20_iterations():
    """The caveat in hyper.py: near-permutation mixers converge slowly. Columns are exact
    after any number of iterations (the last step), rows approach 1 as iterations grow."""
    g = torch.Generator().manual_seed(4)
    z = torch.full((64, 4, 4), -4.0, dtype=torch.float64)
    z[:, range(4), range(4)] = 0.0
    z = z + torch.randn(z.shape, generator=g, dtype=torch.float64)
    gaps = []
    for iters in (20, 100, 400):
        m = sinkhorn(z, iters)
        torch.testing.assert_close(m.sum(-2), torch.ones(64, 4, dtype=torch.float64), rtol=0, atol=1e-12)
        gaps.append((m.sum(-1) - 1).abs().max().item())
    assert gaps[0] > 1e-4 and gaps[0] > gaps[1] > gaps[2]


def test_sinkhorn_is_computed_in_float32_under_half_inputs():
    logits = torch.randn(3, 4, 4).to(torch.bfloat16)
    m = sinkhorn(logits, 20)
    assert m.dtype == torch.float32
    torch.testing.assert_close(m.sum(-1), torch.ones(3, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(m.sum(-2), torch.ones(3, 4), rtol=0, atol=1e-6)


@pytest.mark.parametrize("residual,overrides", VARIANTS, ids=IDS)
def test_gradients_reach_every_scheme_parameter(residual, overrides, make, tokens):
    model = make(residual, **overrides)
    randomize(model.residual)
    model(tokens()).logsumexp(-1).mean().backward()
    for name, p in model.residual.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    kinds = model.param_kinds()
    assert all(kinds[f"residual.{n}"] == "no_decay" for n, _ in model.residual.named_parameters())


@pytest.mark.parametrize("residual,overrides", VARIANTS, ids=IDS)
def test_extra_params_formula_matches_the_model(residual, overrides, make):
    model = make(residual, **overrides)
    prenorm = make("prenorm", **prenorm_overrides(overrides))
    assert model.num_params() - prenorm.num_params() == RESIDUALS[residual].extra_params(model.config)


def test_parameter_overheads_by_hand(config):
    cfg = config
    d, L = cfg("prenorm").d_model, cfg("prenorm").n_sublayers
    assert RESIDUALS["rezero"].extra_params(cfg("rezero")) == L
    assert RESIDUALS["layerscale"].extra_params(cfg("layerscale")) == L * d
    assert RESIDUALS["highway"].extra_params(cfg("highway")) == L * (d * d + d)
    assert RESIDUALS["highway"].extra_params(cfg("highway", highway_rank=2)) == L * (4 * d + d)
    # DWA after block I reads I + 1 outputs: 2 + 3 + 4
    assert RESIDUALS["denseformer"].extra_params(cfg("denseformer")) == 9
    # dilation 2: block 1 reads {1}, block 2 {0, 2}, block 3 {1, 3}
    assert RESIDUALS["denseformer"].extra_params(cfg("denseformer", denseformer_dilation=2)) == 5
    assert RESIDUALS["mudd"].extra_params(cfg("mudd")) == sum(k * d + k * k + k for k in (2, 3, 4))
    assert RESIDUALS["hyper"].extra_params(cfg("hyper", hyper_dynamic=False)) == L * (4 + 16 + 4)
    assert RESIDUALS["mhc"].extra_params(cfg("mhc")) == L * (4 * d * 24 + 24 + 3)


@pytest.mark.parametrize("residual", RIVALS)
def test_record_keeps_rms_and_reports_no_depth_weights(residual, make, tokens):
    from attnres.analysis.depth import depth_weight_matrix

    model = make(residual)
    record = model(tokens(), return_record=True).record
    L = model.config.n_sublayers
    assert len(record.input_rms) == len(record.output_rms) == L
    assert len(record.weights) == L + 1 and all(w is None for w in record.weights)
    assert depth_weight_matrix(record) is None


def test_multi_stream_state_shape_and_collapse(config):
    cfg = config("mhc")
    scheme = build_residual(cfg).double()
    emb = torch.randn(2, 3, cfg.d_model, dtype=torch.float64)
    stream = scheme.begin(emb)
    assert stream.H.shape == (4, 2, 3, cfg.d_model)
    for l in range(cfg.n_sublayers):
        stream.read(l)
        stream.write(l, torch.zeros_like(emb))
    # zero outputs, equal streams, rows of R summing to one: the collapse is n times the embedding
    torch.testing.assert_close(stream.end(), 4 * emb, rtol=1e-12, atol=1e-12)


BAD = [
    ({"residual": "layerscale", "layerscale_init": 0}, "layerscale_init", "positive number"),
    ({"residual": "layerscale", "layerscale_init": True}, "layerscale_init", "positive number"),
    ({"layerscale_init": 0.1}, "layerscale_init", "residual='layerscale' only"),
    ({"residual": "highway", "highway_rank": 0}, "highway_rank", "use None for a full-rank gate"),
    ({"residual": "highway", "highway_rank": 32}, "highway_rank", "below d_model=32"),
    ({"residual": "mhc", "highway_rank": 4}, "highway_rank", "residual='highway' only"),
    ({"residual": "denseformer", "denseformer_dilation": 0}, "denseformer_dilation", "in [1, 8]"),
    ({"residual": "denseformer", "denseformer_period": 9}, "denseformer_period", "in [1, 8]"),
    ({"residual": "full", "denseformer_period": 2}, "denseformer_period", "residual='denseformer' only"),
    ({"denseformer_dilation": 2}, "denseformer_dilation", "residual='denseformer' only"),
    ({"residual": "hyper", "hyper_streams": 0}, "hyper_streams", "positive integer"),
    ({"residual": "hyper", "hyper_dynamic": "no"}, "hyper_dynamic", "True or False"),
    ({"residual": "mhc", "hyper_dynamic": False}, "hyper_dynamic", "residual='hyper' only"),
    ({"residual": "mhc", "mhc_streams": 2.0}, "mhc_streams", "positive integer"),
    ({"residual": "mhc", "mhc_sinkhorn_iters": 0}, "mhc_sinkhorn_iters", "positive integer"),
    ({"residual": "hyper", "mhc_streams": 2}, "mhc_streams", "residual='mhc' only"),
]


@pytest.mark.parametrize("overrides,field,fix", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_invalid_rival_option_raises_naming_field_value_and_fix(overrides, field, fix):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{"d_model": 32, "n_layers": 8, "n_heads": 4, **overrides})
    msg = str(err.value)
    assert f"ModelConfig.{field}={overrides[field]!r}" in msg
    assert fix in msg


def test_rival_options_round_trip():
    cfg = ModelConfig(residual="denseformer", denseformer_dilation=2, denseformer_period=2)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_schemes_table():
    table = schemes_table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == list(RESIDUALS)
    demo = ModelConfig(**DEMO_MODEL)
    assert f"{base_params(demo):,} parameters" in table
    by_name = {row.split("|")[1].strip(): [c.strip() for c in row.split("|")[1:-1]] for row in rows}
    assert by_name["prenorm"][3:6] == ["0", "0.00%", "0"]
    assert by_name["full"][5] == "17" and by_name["block"][5] == "9"  # L + 1 sources, N + 1 blocks
    assert by_name["mhc"][5] == "4" and by_name["denseformer"][5] == "9"
    assert by_name["mhc"][3] == f"{RESIDUALS['mhc'].extra_params(scheme_config(demo, 'mhc')):,}"
    # a scheme's own options change its row and no other
    custom = schemes_table(
        ModelConfig(**{**DEMO_MODEL, "residual": "hyper", "hyper_streams": 2, "hyper_dynamic": False})
    )
    changed = [(a, b) for a, b in zip(table.splitlines(), custom.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and changed[0][1].startswith("| hyper ")
    assert "| static | multi-stream | 128 |" in changed[0][1]  # 16 sublayers x (2 + 4 + 2)
    assert "| 2 |" in changed[0][1]


def test_base_params_matches_the_prenorm_model(config):
    for overrides in ({}, {"tie_embeddings": True, "n_kv_heads": 1}):
        cfg = config("prenorm", **overrides)
        assert base_params(cfg) == AttnResLM(cfg).num_params()
