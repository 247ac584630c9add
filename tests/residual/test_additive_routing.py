"""Additive routing (``attnres_routing="additive"``, Delta Attention Residuals): a read is the PreNorm
stream h_std plus g_l * sum_i alpha_i v_i, g learned per channel or per read (from ``attnres_gain_init``,
at ``attnres_gain_lr`` times the rate) or Delta AttnRes' fixed unit gain. Checked in float64 on random
inputs against a loop written here, every stream form against the reference stream (and gradcheck),
zero gains against PreNorm (outputs and gradients), a handed-over stream, cached decoding, the parameter
and optimizer groups, the state-dict record, the logged gain, the checks and the table."""

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
GAINS = ("per_channel", "scalar", "unit")


def scheme(kind: str, sources: str, seed: int = 0, **variants):
    torch.manual_seed(seed)
    if kind == "full":
        s = FullAttnRes(D, L, attnres_routing="additive", attnres_sources=sources, **variants)
    else:
        s = BlockAttnRes(D, L, attnres_block_size=3, attnres_routing="additive", attnres_sources=sources, **variants)
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
        if s.source_form.name == "states":
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


@pytest.mark.parametrize("gain", GAINS)
@pytest.mark.parametrize("sources", SOURCES)
@pytest.mark.parametrize("kind", ["full", "block"])
def test_the_read_matches_a_loop_written_out(kind, sources, gain):
    s = scheme(kind, sources, attnres_impl="reference", attnres_gain=gain)
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got_inputs, got = run(s, x)
    want_inputs, want = loop_reference(s, x)
    for a, b in zip(got_inputs, want_inputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# (kind, variants, the form it must run)
FORMS = {
    "fused_block": ("block", {"attnres_impl": "fused"}, forms.FusedStream),
    "two_phase_block": ("block", {}, forms.TwoPhaseStream),
    "two_phase_full_grouped": ("full", {"attnres_group_size": 3}, forms.TwoPhaseStream),
    "compiled_block": ("block", {}, forms.CompiledTwoPhaseStream),
    "token_queries": (
        "block",
        {"attnres_weights": "low_rank_query", "attnres_query_rank": 2},
        forms.TokenQueryTwoPhaseStream,
    ),
    "scalar": ("full", {"attnres_weights": "scalar"}, forms.ScalarMixStream),
    "multi_query": ("block", {"attnres_values": "normalized"}, forms.MultiQueryStream),
}


@pytest.mark.parametrize(
    ("sources", "gain"),
    [("outputs", "per_channel"), ("states", "per_channel"), ("outputs", "scalar"), ("outputs", "unit")],
)
@pytest.mark.parametrize("case", sorted(FORMS))
def test_each_form_routes_additively_as_the_reference_stream(case, sources, gain, monkeypatch):
    kind, variants, form = FORMS[case]
    variants = {**variants, "attnres_gain": gain}
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
    if gain != "unit":
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


# ----------------------------------------------------------------------------- the gain's variants


@pytest.mark.parametrize("kind", ["full", "block"])
def test_the_unit_gain_is_delta_attnres_h_std_plus_the_mixture(kind):
    """No gain parameter; read 0 (no earlier output) and the final read are h_std, as Delta AttnRes' first
    read and its norm(h_std) output; between them h_std + the mixture, the same as a learned gain of 1."""
    unit = scheme(kind, "outputs", attnres_impl="reference", attnres_gain="unit")
    assert "routing_gain" not in dict(unit.named_parameters()) and "routing_gain" not in unit.state_dict()
    learned = scheme(kind, "outputs", attnres_impl="reference", attnres_gain="per_channel", attnres_gain_init=1.0)
    with torch.no_grad():  # the same queries and key norms
        for name, p in unit.named_parameters():
            dict(learned.named_parameters())[name].copy_(p)
    x = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got_inputs, got = run(unit, x)
    h_std = x + sum(f(h) for f, h in zip(sublayers(), got_inputs, strict=True))
    torch.testing.assert_close(got_inputs[0], x, rtol=0, atol=0)
    torch.testing.assert_close(got, h_std, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        learned.routing_gain.fill_(1.0)
        learned.routing_gain[0] = learned.routing_gain[L] = 0.0
    want_inputs, want = run(learned, x)
    for a, b in zip(got_inputs, want_inputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gain", ["per_channel", "scalar"])
def test_the_learned_gain_starts_at_its_init(gain):
    s = FullAttnRes(D, L, attnres_routing="additive", attnres_gain=gain, attnres_gain_init=0.5)
    assert s.routing_gain.shape == (L + 1, D if gain == "per_channel" else 1)
    assert torch.equal(s.routing_gain, torch.full_like(s.routing_gain, 0.5))
    assert s.gain_stats() == {"gain_rms": 0.5, "gain_shift_rms": 0.0}
    model = tiny_model("block", attnres_routing="additive", attnres_gain=gain)
    extra = model.num_params() - tiny_model("block").num_params()
    assert extra == model.residual.routing_gain.numel()


@pytest.mark.parametrize("case", ["fused_block", "two_phase_block", "two_phase_full_grouped"])
def test_gradcheck_through_the_custom_backwards_with_a_gain(case):
    kind, variants, _ = FORMS[case]
    torch.manual_seed(0)
    n = 4
    if kind == "full":
        s = FullAttnRes(4, n, attnres_routing="additive", attnres_gain_init=0.7, **variants)
    else:
        s = BlockAttnRes(4, n, attnres_block_size=2, attnres_routing="additive", attnres_gain_init=0.7, **variants)
    s = randomize(s.double(), seed=3)
    w = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) / 2

    del s.routing_gain  # the gain as an input of the function gradcheck differentiates

    def forward(x, gain):
        s.routing_gain = gain
        stream = s.begin(x)
        for _ in range(n):
            stream.write(None, torch.tanh(stream.read() @ w))
        return stream.end()

    x = torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
    gain = (0.7 + 0.3 * torch.randn(n + 1, 4, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(forward, (x, gain), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("gain", ["per_channel", "scalar"])
@pytest.mark.parametrize("kind", ["full", "block"])
def test_a_fresh_zero_init_gain_is_prenorm_exactly(kind, gain):
    """Nothing zeroed by hand: the default init alone makes the model PreNorm, whatever its queries."""
    prenorm = tiny_model("prenorm")
    geometry = {"attnres_block_size": 2} if kind == "block" else {}
    model = tiny_model(kind, attnres_routing="additive", attnres_gain=gain, **geometry)
    model.load_state_dict(prenorm.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in model.residual.named_parameters():
            if name != "routing_gain":
                p.add_(torch.randn_like(p))
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(model(x), prenorm(x), rtol=0, atol=0)


def test_a_nonzero_gain_init_is_not_prenorm():
    """The test above can fail: a gain of 1 at init reads h_std + the mixture."""
    prenorm = tiny_model("prenorm")
    model = tiny_model("full", attnres_routing="additive", attnres_gain_init=1.0)
    model.load_state_dict(prenorm.state_dict(), strict=False)
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
    assert (model(x) - prenorm(x)).abs().max() > 1e-6


def test_the_gain_lr_gets_its_own_groups_and_rate():
    from attnres.train.optim import build_optimizer
    from attnres.train.schedule import set_lr

    model = tiny_model("block", attnres_routing="additive", attnres_gain_lr=10.0)
    gain = model.residual.routing_gain
    groups = param_groups(model, weight_decay=0.1)
    (scaled,) = [g for g in groups if g["lr_scale"] != 1.0]
    assert scaled["params"] == [gain] and scaled["kind"] == "no_decay@lr*10" and scaled["weight_decay"] == 0.0
    assert all(p is not gain for g in groups if g is not scaled for p in g["params"])
    for name in ("adamw", "muon"):
        opt = build_optimizer(model, name, lr=1e-3, weight_decay=0.1)
        by_name = {g["name"]: g for g in opt.param_groups}
        (only,) = by_name["no_decay@lr*10"]["params"]
        assert only is gain
        set_lr(opt, 0.5)  # a schedule keeps the ratio
        assert by_name["no_decay@lr*10"]["lr"] == pytest.approx(10 * by_name["no_decay"]["lr"])
        assert by_name["no_decay"]["lr"] == pytest.approx(5e-4)
    # one AdamW step moves each gain entry by about the rate: 10x the others'
    moved = {}
    for lr_mult in (1.0, 10.0):
        model = tiny_model("block", attnres_routing="additive", attnres_gain_lr=lr_mult)
        opt = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1)
        x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
        model(x).logsumexp(-1).sum().backward()
        opt.step()
        moved[lr_mult] = model.residual.routing_gain.detach().abs().max().item()
    assert moved[1.0] == pytest.approx(1e-3, rel=1e-3) and moved[10.0] == pytest.approx(1e-2, rel=1e-3)


def test_without_a_multiplier_the_groups_are_as_before():
    model = tiny_model("block", attnres_routing="additive")
    assert [g["kind"] for g in param_groups(model, weight_decay=0.1)] == ["matrix", "decay", "no_decay"]


@pytest.mark.parametrize(
    ("saved", "loaded", "named"),
    [
        ({"attnres_gain": "unit"}, {"attnres_gain": "per_channel"}, "attnres_gain"),
        ({"attnres_gain": "scalar"}, {}, "attnres_gain"),
    ],
)
def test_a_checkpoint_of_one_gain_variant_refuses_another(saved, loaded, named):
    from attnres.residual.record import SchemeMismatch

    source = tiny_model("full", attnres_routing="additive", **saved)
    target = tiny_model("full", attnres_routing="additive", **loaded)
    with pytest.raises(SchemeMismatch, match=named):
        target.load_state_dict(source.state_dict(), strict=False)
    tiny_model("full", attnres_routing="additive", **saved).load_state_dict(source.state_dict())


def test_the_gains_init_and_rate_are_no_setting():
    """They only start and train the gain, whose value the weights carry: a model built with other ones
    loads the checkpoint and computes the same function."""
    source = tiny_model("full", attnres_routing="additive", attnres_gain_init=1.0, attnres_gain_lr=10.0)
    target = tiny_model("full", attnres_routing="additive")
    x = torch.randint(0, 61, (2, 5))
    assert not torch.equal(target(x), source(x))
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


def test_a_record_from_before_the_gain_settings_reads_as_their_defaults():
    from attnres.residual.record import RECORD_KEY, decode, encode

    source = tiny_model("block", attnres_routing="additive")
    state = source.state_dict()
    key = f"residual.{RECORD_KEY}"
    record = decode(state[key])
    del record["settings"]["attnres_gain"]
    state[key] = encode(record)
    tiny_model("block", attnres_routing="additive").load_state_dict(state)
    with pytest.raises(ValueError, match="attnres_gain"):
        tiny_model("block", attnres_routing="additive", attnres_gain="scalar").load_state_dict(state)


def test_the_gain_is_logged_in_the_metrics_and_the_probes(tmp_path, monkeypatch):
    import json

    from corpora import write_pseudo_english

    from attnres.experiments.probes import gain_probe
    from attnres.residual.attnres import routing_gain_stats
    from attnres.train.config import build_configs
    from attnres.train.trainer import Trainer

    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus").mkdir()
    corpus = write_pseudo_english(tmp_path / "corpus", works=4, words_per_work=800)
    overrides = {"steps": 4, "eval_every": 4, "checkpoint_every": 4, "progress": False}
    model_cfg, train_cfg = build_configs(
        "tiny",
        {
            "data": corpus,
            "out_dir": str(tmp_path / "run"),
            "residual": "block",
            "attnres_routing": "additive",
            "attnres_gain_init": 1.0,
            "attnres_gain_lr": 10.0,
            **overrides,
        },
    )
    trainer = Trainer(model_cfg, train_cfg)
    trainer.run()
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if r]
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == 4 and all("gain_rms" in r and "gain_shift_rms" in r for r in train)
    assert 0 < train[0]["gain_shift_rms"] < train[-1]["gain_shift_rms"]  # it moves away from 1
    assert train[-1]["gain_shift_rms"] == pytest.approx(routing_gain_stats(trainer.model)["gain_shift_rms"])
    probe = gain_probe(trainer.model)
    assert probe is not None and probe["gain_init"] == 1.0 and len(probe["per_read_rms"]) == model_cfg.n_sublayers + 1
    assert gain_probe(tiny_model("block")) is None and routing_gain_stats(tiny_model("block")) == {}
    assert gain_probe(tiny_model("block", attnres_routing="additive", attnres_gain="unit")) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attnres_gain_init": 1.0}, r"attnres_gain_init=1.0 is invalid: applies to attnres_routing='additive' only"),
        ({"attnres_gain_lr": 10.0}, r"attnres_gain_lr=10.0 is invalid: applies to attnres_routing='additive' only"),
        ({"attnres_gain": "scalar"}, r"attnres_gain='scalar' is invalid: applies to attnres_routing='additive' only"),
        ({"attnres_routing": "additive", "attnres_gain": "vector"}, r"attnres_gain='vector' is invalid: choose one of"),
        (
            {"attnres_routing": "additive", "attnres_gain": "unit", "attnres_gain_init": 1.0},
            r"attnres_gain_init=1.0 is invalid: attnres_gain='unit' has no learned gain",
        ),
        (
            {"attnres_routing": "additive", "attnres_gain": "unit", "attnres_gain_lr": 3.0},
            r"attnres_gain_lr=3.0 is invalid: attnres_gain='unit' has no learned gain",
        ),
        (
            {"attnres_routing": "additive", "attnres_gain_lr": 0.0},
            r"attnres_gain_lr=0.0 is invalid: must be a positive",
        ),
        (
            {"attnres_routing": "additive", "attnres_gain_init": 1.0, "attnres_scale_norm_eps": True},
            r"attnres_gain_init=1.0 is invalid: .*drop attnres_scale_norm_eps",
        ),
        ({"residual": "prenorm", "attnres_gain_init": 1.0}, r"applies to residual='full' or 'block' only"),
    ],
)
def test_bad_gain_settings_are_named_with_their_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{"residual": "block", **overrides})
