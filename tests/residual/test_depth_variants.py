"""Variants of Full/Block AttnRes beyond the paper: state sources, uneven depth blocks, low-rank queries.

Every variant is checked against a float64 reference written token by token from the
definitions in docs/method.md §4-5 (block sums / running sums computed from scratch, not
incrementally as the stream does), under every implementation; the fast paths against the
plain one on gradients; zero-query equivalence with PreNorm where it holds (and its failure
where it cannot hold); cached decoding, chunked prefill and pipeline hand-over.
"""

import math

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache, chunked_prefill
from attnres.model.llama import output_logits, run_blocks
from attnres.ops.common import DepthStats
from attnres.ops.token_queries import (
    low_rank_queries,
    merge_partial_token,
    phase1_token_queries,
)
from attnres.residual import RESIDUALS, DepthState, IOCounter, observing, source_plan
from attnres.residual.depth_streams import FusedStream, TokenQueryTwoPhaseStream

BASE = dict(vocab_size=50, d_model=16, n_layers=3, n_heads=2, max_seq_len=16)  # L = 6

# (residual, overrides): every new option, alone and combined with the old ones
VARIANTS = [
    ("block", {"attnres_block_sizes": [1, 3, 2]}),
    ("block", {"attnres_block_sizes": [4, 2], "attnres_heads": 2, "attnres_kernel": "sigmoid"}),
    ("block", {"attnres_block_sizes": [2, 1, 1, 2], "attnres_weights": "scalar"}),
    ("full", {"attnres_sources": "states"}),
    ("full", {"attnres_sources": "states", "attnres_group_size": 4}),
    ("full", {"attnres_sources": "states", "attnres_window": 2}),
    ("full", {"attnres_sources": "states", "attnres_weights": "input_query"}),
    ("block", {"attnres_sources": "states"}),
    ("block", {"attnres_sources": "states", "attnres_block_sizes": [3, 1, 2], "attnres_key_norm": False}),
    ("block", {"attnres_sources": "states", "attnres_weights": "scalar", "attnres_blocks": 2}),
    ("full", {"attnres_weights": "low_rank_query", "attnres_query_rank": 3}),
    ("full", {"attnres_weights": "low_rank_query", "attnres_query_rank": 2, "attnres_heads": 2}),
    ("block", {"attnres_weights": "low_rank_query", "attnres_query_rank": 3}),
    (
        "block",
        {
            "attnres_weights": "low_rank_query",
            "attnres_query_rank": 2,
            "attnres_block_sizes": [1, 3, 2],
            "attnres_heads": 4,
        },
    ),
    (
        "block",
        {
            "attnres_weights": "low_rank_query",
            "attnres_query_rank": 2,
            "attnres_kernel": "sigmoid",
            "attnres_key_norm": False,
            "attnres_sources": "states",
        },
    ),
]
IDS = [f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for r, o in VARIANTS]
IMPLS = ("two_phase", "fused", "reference")


def make(residual, dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    return AttnResLM(ModelConfig(**{**BASE, **overrides, "residual": residual})).to(dtype)


def tokens(seed=0, b=2, t=5):
    return torch.randint(0, BASE["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- float64 reference


def _rms_unit(v, eps):
    return v / torch.sqrt((v * v).mean() + eps)


def reference_inputs(scheme, emb, outs):
    """Every sublayer input h_l and the final aggregation, one token at a time, from the definitions:

    outputs: b_m = sum of the outputs of block m, partial = outputs of the current block so far;
    states:  s^(j) = v_0 + f_1 + … + f_j, sources = s^(end of block m), partial = s^(l − 1);
    queries: w_l; W_l h (h the newest source); w_l + U_l V_l h (h the newest completed source).
    """
    L, sizes, P = scheme.n_sublayers, scheme.block_sizes, dict(scheme.named_parameters())
    ends = [sum(sizes[: m + 1]) for m in range(len(sizes))]
    B, T, D = emb.shape
    H = scheme.heads
    result = [torch.zeros(B, T, D, dtype=torch.float64) for _ in range(L + 1)]
    for b in range(B):
        for t in range(T):
            v0, f = emb[b, t], [o[b, t] for o in outs]

            def state(j, v0=v0, f=f):  # v_0 + the first j outputs
                return v0 + sum(f[:j], torch.zeros_like(v0))

            for l in range(L + 1):
                done = len(sizes) if l == L else next(m for m, e in enumerate(ends) if l < e)
                start = ends[done - 1] if done else 0
                if scheme.source_form.name == "states":
                    complete = [v0] + [state(ends[m]) for m in range(done)]
                    partial = state(l) if l > start else None
                else:
                    complete = [v0] + [sum(f[ends[m] - sizes[m] : ends[m]]) for m in range(done)]
                    partial = sum(f[start:l]) if l > start else None
                if scheme.window is not None and len(complete) - 1 > scheme.window:
                    complete = [complete[0]] + complete[-scheme.window :]
                srcs = complete + ([partial] if partial is not None else [])
                if scheme.query_form.name == "scalar":
                    z = P[f"mix_logits.{l}"].detach()
                    a = torch.softmax(z, 0) if scheme.kernel == "softmax" else torch.sigmoid(z)
                    result[l][b, t] = sum(a[i] * srcs[i] for i in range(len(srcs)))
                    continue
                if scheme.query_form.name == "pseudo_query":
                    q = P["queries"][l].detach()
                elif scheme.query_form.name == "input_query":
                    q = P[f"query_proj.{l}"].detach() @ srcs[-1]
                else:  # low rank, from the newest completed source
                    q = P["queries"][l].detach() + P["query_up"][l].detach() @ (
                        P["query_down"][l].detach() @ complete[-1]
                    )
                dh = D // H
                for head in range(H):
                    ch = slice(head * dh, (head + 1) * dh)
                    logits = []
                    for v in srcs:
                        key = _rms_unit(v, scheme.eps) * P["key_norm_weight"][l].detach() if scheme.key_norm else v
                        logits.append((q[ch] * key[ch]).sum())
                    z = torch.stack(logits)
                    a = torch.softmax(z, 0) if scheme.kernel == "softmax" else torch.sigmoid(z)
                    result[l][b, t, ch] = sum(a[i] * srcs[i][ch] for i in range(len(srcs)))
    return result


def drive(scheme, emb, outs):
    stream = scheme.begin(emb)
    got = []
    for l in range(scheme.n_sublayers):
        got.append(stream.read(l))
        stream.write(l, outs[l])
    return got + [stream.end()]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("residual,overrides", VARIANTS, ids=IDS)
def test_stream_matches_float64_reference(residual, overrides, impl):
    model = make(residual, attnres_impl=impl, **overrides)
    randomize(model.residual)
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(2, 3, BASE["d_model"], generator=g, dtype=torch.float64)
    outs = [torch.randn(2, 3, BASE["d_model"], generator=g, dtype=torch.float64) for _ in range(6)]
    got = drive(model.residual, emb, outs)
    want = reference_inputs(model.residual, emb, outs)
    for l, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{impl}: consumer {l}")


def test_low_rank_block_runs_two_phase_and_full_falls_back_to_fused():
    block = make("block", attnres_weights="low_rank_query", attnres_query_rank=2)
    full = make("full", attnres_weights="low_rank_query", attnres_query_rank=2)
    x = torch.zeros(1, 2, BASE["d_model"], dtype=torch.float64)
    assert isinstance(block.residual.begin(x), TokenQueryTwoPhaseStream)
    assert type(full.residual.begin(x)) is FusedStream
    with observing(block.residual, IOCounter()) as counter, torch.no_grad():
        block(tokens())
    # Block with S = 2 (3 blocks): Phase 1 reads the n completed sources once per block
    assert counter.reads[0] == 1 and counter.reads[2] == 2 and counter.reads[4] == 3


@pytest.mark.parametrize(
    "residual,overrides",
    [v for v in VARIANTS if "attnres_window" not in v[1]],
    ids=[i for i, v in zip(IDS, VARIANTS, strict=True) if "attnres_window" not in v[1]],
)
def test_fast_paths_agree_with_plain_autograd_on_gradients(residual, overrides):
    grads = {}
    for impl in IMPLS:
        model = make(residual, attnres_impl=impl, **overrides)
        randomize(model.residual)
        model(tokens()).logsumexp(-1).mean().backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    for impl in ("two_phase", "fused"):
        for name, g in grads["reference"].items():
            torch.testing.assert_close(grads[impl][name], g, rtol=1e-9, atol=1e-12, msg=f"{impl}: {name}")
    for name, g in grads["reference"].items():  # every residual parameter is trained
        if name.startswith("residual.") and not name.endswith(".0"):  # (consumer 0: softmax over one source)
            assert g is not None and g.abs().sum() > 0, name


# ----------------------------------------------------------------------------- zero queries vs PreNorm

HOLDS = [
    ("block", {"attnres_block_sizes": [1, 3, 2]}),
    ("block", {"attnres_block_sizes": [5, 1], "attnres_heads": 4}),
    ("full", {"attnres_weights": "low_rank_query", "attnres_query_rank": 3}),
    ("block", {"attnres_weights": "low_rank_query", "attnres_query_rank": 3, "attnres_block_sizes": [2, 4]}),
    ("block", {"attnres_weights": "low_rank_query", "attnres_query_rank": 2, "attnres_kernel": "sigmoid"}),
]


@pytest.mark.parametrize("residual,overrides", HOLDS)
def test_zero_initialised_variant_equals_prenorm(residual, overrides):
    """Uneven blocks and low-rank queries (U = 0, V random) keep docs/method.md §3's equivalence: exact up to eps,
    and to rounding with attnres_scale_norm_eps."""
    base = make("prenorm", norm_eps=1e-20)
    model = make(residual, norm_eps=1e-20, **overrides)
    model.load_state_dict(base.state_dict(), strict=False)
    x = tokens()
    torch.testing.assert_close(model(x), base(x), rtol=1e-9, atol=1e-9)
    base, model = make("prenorm"), make(residual, attnres_scale_norm_eps=True, **overrides)
    model.load_state_dict(base.state_dict(), strict=False)
    torch.testing.assert_close(model(x), base(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("residual,overrides", [("full", {}), ("block", {}), ("block", {"attnres_block_size": 6})])
def test_zero_initialised_states_variant_is_not_prenorm(residual, overrides):
    """States sources cannot keep the equivalence: with zero queries sublayer l reads the mean of running
    sums, sum_i c_i v_i with c_i decreasing in i, not a multiple of the PreNorm sum. Only the first
    sublayer (one source, the embedding) reads what PreNorm reads."""
    base = make("prenorm", norm_eps=1e-20)
    model = make(residual, norm_eps=1e-20, attnres_sources="states", **overrides)
    model.load_state_dict(base.state_dict(), strict=False)
    x = tokens()
    assert (model(x) - base(x)).abs().max() > 1e-3

    def inputs(m):
        seen = []
        hooks = [blk.attn_norm.register_forward_pre_hook(lambda mod, a: seen.append(a[0])) for blk in m.blocks]
        m(x)
        for h in hooks:
            h.remove()
        return seen

    got, want = inputs(model), inputs(base)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    unit = lambda v: v / v.pow(2).mean(-1, keepdim=True).sqrt()  # noqa: E731 (what the pre-norm sees)
    assert (unit(got[1]) - unit(want[1])).abs().max() > 1e-3


def test_states_with_scale_norm_eps_is_refused():
    with pytest.raises(ValueError, match="ModelConfig.attnres_sources='states' is invalid: .*attnres_scale_norm_eps"):
        ModelConfig(**BASE, residual="full", attnres_sources="states", attnres_scale_norm_eps=True)


# ----------------------------------------------------------------------------- geometry and parameters


def test_source_plan_accepts_sizes_and_equals_the_equal_blocks_form():
    for L, S in ((6, 1), (6, 2), (7, 3), (10, 4), (5, 5)):
        sizes = [S] * (L // S) + ([L % S] if L % S else [])
        assert source_plan(L, sizes) == source_plan(L, S)
    # blocks of 1, 3, 2: complete sources and partial flags per consumer
    assert source_plan(6, [1, 3, 2]) == [
        (1, False),
        (2, False),
        (2, True),
        (2, True),
        (3, False),
        (3, True),
        (4, False),
    ]
    with pytest.raises(ValueError, match="do not add up"):
        source_plan(6, [2, 2])


def test_block_sizes_geometry():
    cfg = ModelConfig(**BASE, residual="block", attnres_block_sizes=[1, 3, 2])
    assert (cfg.block_sizes, cfg.num_blocks, cfg.block_size) == ([1, 3, 2], 3, 3)
    assert ModelConfig(**BASE, residual="block", attnres_blocks=3).block_sizes == [2, 2, 2]
    assert ModelConfig(**{**BASE, "n_layers": 5}, residual="block", attnres_blocks=4).block_sizes == [3, 3, 3, 1]
    assert ModelConfig(**BASE, residual="full").block_sizes == [1] * 6
    assert ModelConfig(**BASE, residual="prenorm").block_sizes == [6]
    assert RESIDUALS["block"].depth_state(cfg) == 4  # the embedding and 3 block representations
    # a tuple (what a literal parser may give) works as a list
    assert ModelConfig(**BASE, residual="block", attnres_block_sizes=(3, 3)).block_sizes == [3, 3]
    # the K3 release: 186 sublayers in blocks of 24 and a last one of 18
    k3 = ModelConfig(d_model=16, n_heads=2, n_layers=93, residual="block", attnres_block_sizes=[24] * 7 + [18])
    assert source_plan(186, k3.block_sizes) == source_plan(186, 24)


def test_parameter_counts():
    d, L = BASE["d_model"], 6
    prenorm = make("prenorm").num_params()
    r = 3
    assert make("full", attnres_weights="low_rank_query", attnres_query_rank=r).num_params() - prenorm == (
        2 * d + 2 * r * d
    ) * (L + 1)
    assert make(
        "block", attnres_weights="low_rank_query", attnres_query_rank=r, attnres_key_norm=False
    ).num_params() - prenorm == (d + 2 * r * d) * (L + 1)
    # scalar mixing over blocks of 2, 1, 1, 2: consumers read 1, 2, 2, 3, 4, 5 sources, the final 5
    assert (
        make("block", attnres_weights="scalar", attnres_block_sizes=[2, 1, 1, 2]).num_params() - prenorm
        == 1 + 2 + 2 + 3 + 4 + 5 + 5
    )
    for residual, overrides in VARIANTS:
        model = make(residual, **overrides)
        assert model.num_params() - prenorm == RESIDUALS[residual].extra_params(model.config), (residual, overrides)


def test_low_rank_initialisation():
    model = make(
        "block", dtype=torch.float32, d_model=64, n_heads=2, attnres_weights="low_rank_query", attnres_query_rank=8
    )
    res = model.residual
    assert res.queries.abs().sum() == 0 and res.query_up.abs().sum() == 0
    assert res.query_down.shape == (7, 8, 64)
    assert abs(res.query_down.std().item() - 1 / math.sqrt(64)) < 0.01


BAD = [
    ({"attnres_block_sizes": [2, 2]}, "attnres_block_sizes", "sums to 4, not to the L=6"),
    ({"attnres_block_sizes": [2, 0, 4]}, "attnres_block_sizes", "list of positive integers"),
    ({"attnres_block_sizes": []}, "attnres_block_sizes", "non-empty list"),
    ({"attnres_block_sizes": 6}, "attnres_block_sizes", "list of positive integers"),
    ({"attnres_block_sizes": [3, 3], "attnres_blocks": 2}, "attnres_blocks", "not both"),
    ({"attnres_block_sizes": [3, 3], "attnres_block_size": 3}, "attnres_block_size", "not both"),
    ({"residual": "full", "attnres_block_sizes": [3, 3]}, "attnres_block_sizes", "residual='block' only"),
    ({"attnres_sources": "hidden"}, "attnres_sources", "choose one of ('outputs', 'states')"),
    ({"attnres_weights": "low_rank_query"}, "attnres_weights", "needs attnres_query_rank"),
    ({"attnres_query_rank": 4}, "attnres_query_rank", "attnres_weights='low_rank_query' only"),
    ({"attnres_weights": "low_rank_query", "attnres_query_rank": 16}, "attnres_query_rank", "in [1, 15]"),
    ({"attnres_weights": "low_rank_query", "attnres_query_rank": 0}, "attnres_query_rank", "in [1, 15]"),
]


@pytest.mark.parametrize("overrides,field,fix", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_invalid_option_raises_naming_field_value_and_fix(overrides, field, fix):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**BASE, "residual": "block", **overrides})
    msg = str(err.value)
    assert f"ModelConfig.{field}={overrides[field]!r} is invalid: " in msg and fix in msg
    assert "\n" not in msg


def test_shared_options_apply_to_a_whole_comparison():
    """Like attnres_kernel, the new behaviour options are ignored (not rejected) by other schemes."""
    options = dict(attnres_sources="states", attnres_weights="low_rank_query", attnres_query_rank=2)
    for residual in ("prenorm", "mhc", "full", "block"):
        assert ModelConfig(**BASE, residual=residual, **options).attnres_sources == "states"


def test_new_options_round_trip():
    cfg = ModelConfig(
        **BASE,
        residual="block",
        attnres_block_sizes=[1, 3, 2],
        attnres_sources="states",
        attnres_weights="low_rank_query",
        attnres_query_rank=2,
    )
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ----------------------------------------------------------------------------- inference and pipelines


@pytest.mark.parametrize("residual,overrides", VARIANTS, ids=IDS)
def test_cached_decoding_equals_the_full_forward(residual, overrides):
    model = make(residual, **{**overrides, "max_seq_len": 24}).eval()
    randomize(model.residual, seed=3, scale=0.3)
    x = torch.randint(0, BASE["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        cache = KVCache.for_model(model, batch_size=2)
        steps = [model(x[:, :5], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(5, 14)]
        chunked = chunked_prefill(model, x, KVCache.for_model(model, 2), 4, all_logits=True)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(chunked, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual,overrides", VARIANTS, ids=IDS)
def test_handover_at_every_transformer_block_is_exact(residual, overrides):
    model = make(residual, **overrides)
    randomize(model.residual)
    x = tokens(seed=4)
    want = model(x)
    cos, sin = model.rope_cos[:5], model.rope_sin[:5]
    depth = model.residual.start(model.embed(x))
    for i, block in enumerate(model.blocks):
        depth = run_blocks(depth, model.residual, [(i, block)], cos, sin)
        history, state = depth.history, depth.state
        depth = DepthState(
            2 * (i + 1), tuple(h.detach().clone() for h in history), tuple(s.detach().clone() for s in state)
        )
    torch.testing.assert_close(
        output_logits(model.norm, model.lm_head, model.residual.finish(depth)), want, rtol=0, atol=1e-12
    )


def test_pipeline_layout_counts_uneven_blocks():
    """Chunks of 2 Transformer blocks (4 sublayers) over depth blocks of 1, 5, 2: chunk 0 closes block 1,
    chunk 1 closes blocks 2 and 3 (sublayer 6 and 8), so histories hold 1 + 1 and 1 + 3 entries; the
    running partial sum of block 2 (sublayers 2-5) crosses the first cut as the state."""
    from attnres.parallel.pipeline import probe_layout

    model = AttnResLM(
        ModelConfig(
            vocab_size=20,
            d_model=8,
            n_layers=4,
            n_heads=2,
            max_seq_len=4,
            residual="block",
            attnres_block_sizes=[1, 5, 2],
        )
    )
    layout = probe_layout(model, 2, 1, 1, 4, cache=False)
    assert [len(h) for h in layout.history] == [2, 4] and [len(s) for s in layout.state] == [1, 0]
    assert [r["blocks"] for r in layout.traffic()] == [1]


# ----------------------------------------------------------------------------- the per-token ops


def _reference_token_phase(sources, queries, key_weights, eps, kernel, partial=None, lse_from=None):
    """Per token, per query s: attention over the sources (and the partial), from the definitions."""
    B, T, S = queries.shape[:3]
    D = sources[0].shape[-1]
    H = 1 if queries.dim() == 4 else queries.shape[3]
    out = torch.zeros(B, T, S, D, dtype=torch.float64)
    lse = torch.zeros(B, T, S, H, dtype=torch.float64)
    dh = D // H
    for b in range(B):
        for t in range(T):
            for s in range(S):
                q = queries[b, t, s].reshape(D)
                srcs = [v[b, t] for v in sources] + ([partial[b, t]] if partial is not None else [])
                for h in range(H):
                    ch = slice(h * dh, (h + 1) * dh)
                    zs = []
                    for v in srcs:
                        key = _rms_unit(v, eps) * key_weights[s] if key_weights is not None else v
                        zs.append((q[ch] * key[ch]).sum())
                    z = torch.stack(zs)
                    a = torch.softmax(z, 0) if kernel == "softmax" else torch.sigmoid(z)
                    lse[b, t, s, h] = torch.logsumexp(z, 0)
                    out[b, t, s, ch] = sum(a[i] * srcs[i][ch] for i in range(len(srcs)))
    return out, lse


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
def test_token_query_ops_match_the_definitions_and_merge_exactly(heads, kernel, key_norm):
    g = torch.Generator().manual_seed(5)
    B, T, n, S, D = 2, 3, 3, 2, 8
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    sources, partial = [rnd(B, T, D) for _ in range(n)], rnd(B, T, D)
    queries = rnd(B, T, S, D) if heads == 1 else rnd(B, T, S, heads, D // heads)
    kw = 1 + 0.3 * rnd(S, D) if key_norm else None
    h1, lse = phase1_token_queries(sources, queries, kw, eps=1e-6, kernel=kernel)
    want, want_lse = _reference_token_phase(sources, queries, kw, 1e-6, kernel)
    torch.testing.assert_close(torch.stack(h1, 2), want, rtol=1e-12, atol=1e-12)
    if kernel == "softmax":
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    # merging the partial sum equals attending over sources + partial at once
    both, _ = _reference_token_phase(sources, queries, kw, 1e-6, kernel, partial=partial)
    for s in range(S):
        merged = merge_partial_token(
            DepthStats(h1[s], lse[:, :, s]), partial, queries[:, :, s], kw[s] if kw is not None else None, 1e-6, kernel
        )
        torch.testing.assert_close(merged, both[:, :, s], rtol=1e-12, atol=1e-12)


def test_token_query_ops_gradcheck():
    g = torch.Generator().manual_seed(6)
    B, T, n, S, D = 1, 2, 2, 2, 4
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    sources, partial, queries, kw = [rnd(B, T, D) for _ in range(n)], rnd(B, T, D), rnd(B, T, S, D), rnd(S, D)

    def f(q, k, p, *srcs):
        h1, lse = phase1_token_queries(list(srcs), q, k, eps=1e-6)
        return merge_partial_token(DepthStats(h1[1], lse[:, :, 1]), p, q[:, :, 1], k[1], 1e-6)

    assert torch.autograd.gradcheck(f, (queries, kw, partial, *sources))


def test_low_rank_queries_all_at_once_equal_one_by_one():
    g = torch.Generator().manual_seed(7)
    S, D, r = 3, 8, 2
    base, up, down = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((S, D), (S, D, r), (S, r, D)))
    h = torch.randn(2, 3, D, generator=g, dtype=torch.float64)
    q = low_rank_queries(base, up, down, h)
    for s in range(S):
        torch.testing.assert_close(q[:, :, s], base[s] + (h @ down[s].t()) @ up[s].t(), rtol=1e-12, atol=1e-12)
