"""A model of the user's own converted to AttnRes (docs/own_model.md), through its whole life: PreNorm at
init, activation checkpointing in both of torch's forms, FSDP2 per block without warnings, decoding token
by token with the model's own KV cache, the depth weights read from the top level, bfloat16, and the
one-line errors of the usual mistakes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnres
from attnres.residual.base import DepthState

D, HEADS, LAYERS = 32, 4, 3
SCHEMES = [
    pytest.param(lambda: attnres.BlockAttnRes(d_model=D, n_sublayers=2 * LAYERS, attnres_blocks=2), id="block"),
    pytest.param(lambda: attnres.FullAttnRes(d_model=D, n_sublayers=2 * LAYERS), id="full"),
]
IMPLS = ["two_phase", "fused", "reference"]


class Block(nn.Module):
    """A GPT block taking and returning the depth state, with a KV cache of its own attention."""

    def __init__(self, d: int = D, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def attention(self, x: torch.Tensor, cache: dict | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        if cache is not None:
            if cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t)  # the new queries see the past
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, depth, residual, cache: dict | None = None):
        stream = residual.stream(depth)
        stream.apply(lambda h: self.attention(self.ln_1(h), cache))
        stream.apply(lambda h: self.mlp(self.ln_2(h)))
        return stream.depth()


class Model(nn.Module):
    def __init__(self, residual: attnres.ResidualScheme, vocab: int = 50):
        super().__init__()
        self.wte = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.residual = residual
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab, bias=False)

    def norms(self) -> list[nn.Module]:
        return [n for b in self.blocks for n in (b.ln_1, b.ln_2)] + [self.ln_f]

    def forward(self, ids, residual=None, caches=None, run=None):
        residual = self.residual if residual is None else residual
        depth = residual.start(self.wte(ids))
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            depth = block(depth, residual, cache) if run is None else run(block, depth, residual)
        return self.head(self.ln_f(residual.finish(depth)))


def trained(scheme) -> Model:
    """A model whose depth weights are not uniform (random queries), as after some training."""
    torch.manual_seed(0)
    model = Model(scheme)
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


IDS = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))


def grads(model: Model, **forward) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(IDS, **forward).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- PreNorm at init


@pytest.mark.parametrize("scheme", SCHEMES)
def test_with_zero_queries_the_model_is_its_blocks_run_as_prenorm(scheme):
    torch.manual_seed(0)
    model = Model(scheme())
    prenorm = model(IDS, residual=attnres.residual_scheme("prenorm", d_model=D, n_sublayers=2 * LAYERS))
    assert (model(IDS) - prenorm).abs().max() > 1e-4  # each norm's eps grown by K_l^2: another function
    attnres.match_prenorm_eps(model.norms(), model.residual)
    torch.testing.assert_close(model(IDS), prenorm, rtol=0, atol=2e-6)


# ----------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_checkpoint_block_gives_the_gradients_of_no_checkpoint(scheme, use_reentrant, impl):
    model = trained(scheme())
    model.residual.impl = impl
    want = grads(model)
    got = grads(model, run=lambda b, d, r: attnres.checkpoint_block(b, d, r, use_reentrant=use_reentrant))
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_wrapper_takes_checkpoint_block(use_reentrant):
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrapping

    checkpoint_wrapper = wrapping.checkpoint_wrapper
    model = trained(attnres.BlockAttnRes(d_model=D, n_sublayers=2 * LAYERS, attnres_blocks=2))
    want = grads(model)
    blocks = model.blocks
    model.blocks = nn.ModuleList(
        checkpoint_wrapper(b, checkpoint_fn=attnres.checkpoint_block, use_reentrant=use_reentrant) for b in blocks
    )
    got = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in grads(model).items()}
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-5, msg=name)


def test_torch_reentrant_checkpoint_of_a_block_is_a_one_line_error():
    """torch's reentrant checkpoint returns the DepthState as a plain tuple (and would drop its gradients):
    the next block says so and names checkpoint_block."""
    model = trained(attnres.BlockAttnRes(d_model=D, n_sublayers=2 * LAYERS, attnres_blocks=2))
    run = lambda b, d, r: torch.utils.checkpoint.checkpoint(b, d, r, use_reentrant=True)  # noqa: E731 -- a one-liner
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "None of the inputs have requires_grad=True": the tensors are nested
        with pytest.raises(
            TypeError, match=r"depth is a plain tuple: a DepthState that .*use_reentrant=True.*attnres.checkpoint_block"
        ):
            model(IDS, run=run)


def test_checkpoint_block_refuses_block_keywords_in_the_reentrant_form():
    model = trained(attnres.FullAttnRes(d_model=D, n_sublayers=2 * LAYERS))
    depth = model.residual.start(model.wte(IDS))
    with pytest.raises(ValueError, match=r"use_reentrant=True\) got the keyword\(s\) \['cache'\]"):
        attnres.checkpoint_block(model.blocks[0], depth, model.residual, cache=None, use_reentrant=True)
    with pytest.raises(TypeError, match=r"checkpoint_block\(block, depth, ...\): depth is a tensor"):
        attnres.checkpoint_block(model.blocks[0], model.wte(IDS), model.residual)


# ----------------------------------------------------------------------------- FSDP2


@pytest.fixture
def group_of_one(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}")
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fully_shard_per_block_warns_nothing_and_gives_the_same_gradients(scheme, group_of_one):
    """FSDP2 warns for every view a wrapped module returns; a block returns its sublayers' outputs (views
    of nn.Linear's 2-D product) and the sources it received (which FSDP2's pre-forward hook views)."""
    from torch.distributed.fsdp import fully_shard

    model = trained(scheme())
    want = grads(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads(model)
    assert not [w for w in caught if "view" in str(w.message)], [str(w.message) for w in caught]
    for name, g in want.items():
        full = got[name].full_tensor() if hasattr(got[name], "full_tensor") else got[name]
        torch.testing.assert_close(full, g, rtol=0, atol=1e-6, msg=name)


def test_a_block_returns_no_views_that_require_grad():
    """What FSDP2 checks, without a process group: no tensor of a returned DepthState is an autograd view."""
    model = trained(attnres.FullAttnRes(d_model=D, n_sublayers=2 * LAYERS))
    depth = model.residual.start(model.wte(IDS))
    for block in model.blocks:
        depth = block(depth, model.residual)
        views = [t for t in (*depth.history, *depth.state, *depth.cache) if t.requires_grad and t._base is not None]
        assert not views, [tuple(t.shape) for t in views]


# ----------------------------------------------------------------------------- decoding with a KV cache


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_decoding_token_by_token_with_the_models_kv_cache_equals_the_whole_sequence(scheme, impl):
    """The depth state is per position: a step starts it from the new token's embedding, and only the
    attention keeps a cache."""
    model = trained(scheme()).eval()
    model.residual.impl = impl
    with torch.no_grad():
        whole = model(IDS)
        caches = [{} for _ in model.blocks]
        steps = [model(IDS[:, :5], caches=caches)]  # prefill
        steps += [model(IDS[:, t : t + 1], caches=caches) for t in range(5, IDS.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- depth weights


def test_record_depth_names_full_sources_by_their_row():
    """Read l is the input of sublayer l (from 0); source v<i> is row i of its weights and the output of
    sublayer i - 1. Checked with one sublayer's output aligned with the final read's query."""
    torch.manual_seed(0)
    L, target = 6, 2  # sublayer 2 writes v3
    residual = attnres.FullAttnRes(d_model=D, n_sublayers=L)
    query = torch.randn(D)
    with torch.no_grad():
        residual.queries[L] = query
    x = torch.randn(1, 4, D)
    with attnres.record_depth(residual) as record:
        stream = residual.begin(x)
        for l in range(L):
            stream.apply(lambda h, l=l: (query if l == target else -query).expand_as(h))
        stream.end()
    assert isinstance(record, attnres.DepthRecord) and len(record.weights) == L + 1
    for l in range(L + 1):
        assert record.sources[l] == ["emb"] + [f"v{i}" for i in range(1, l + 1)]
        assert record.weights[l].shape == (l + 1, 1, 4)
    final = record.weights[L].mean(dim=(1, 2))
    assert record.sources[L][int(final.argmax())] == f"v{target + 1}"
    matrix, labels = attnres.depth_weight_matrix(record), attnres.source_labels(record)
    assert matrix.shape == (L + 1, L + 1) and labels == ["emb"] + [f"v{i}" for i in range(1, L + 1)]
    assert int(matrix[L].argmax()) == target + 1


def test_record_depth_fills_one_record_across_blocks():
    model = trained(attnres.BlockAttnRes(d_model=D, n_sublayers=2 * LAYERS, attnres_blocks=2))
    with attnres.record_depth(model.residual) as record:
        model(IDS)
    assert len(record.weights) == 2 * LAYERS + 1 and len(record.input_rms) == 2 * LAYERS
    assert record.sources[4] == ["emb", "b1", "b2~"] and record.weights[4].shape == (3, 2, 12)
    for w in record.weights:
        torch.testing.assert_close(w.sum(0), torch.ones(2, 12))
    assert not model.residual.observers  # detached when the block ends
    model(IDS)
    assert len(record.weights) == 2 * LAYERS + 1


# ----------------------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_autocast_keeps_the_depth_state_in_float32_and_follows_float32(scheme):
    model = trained(scheme())
    want = model(IDS)
    depths = []
    run = lambda b, d, r: depths.append(b(d, r)) or depths[-1]  # noqa: E731 -- keeps each block's output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(IDS, run=run)
    assert {t.dtype for d in depths for t in (*d.history, *d.state) if t.is_floating_point()} == {torch.float32}
    assert (got.float() - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_bfloat16_model_trains(scheme):
    model = trained(scheme()).to(torch.bfloat16)
    out = model(IDS)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    assert model.residual.queries.grad.dtype == torch.bfloat16 and model.residual.queries.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- mistakes, one line each


def test_more_applies_than_sublayers_names_n_sublayers():
    residual = attnres.BlockAttnRes(d_model=D, n_sublayers=4, attnres_blocks=2)  # the model has 6
    model = Model(residual)
    with pytest.raises(ValueError, match=r"stream.read\(4\) / stream.apply: call 5 .* n_sublayers=4"):
        model(IDS)


def test_returning_the_stream_says_return_stream_depth():
    residual = attnres.FullAttnRes(d_model=D, n_sublayers=4)
    stream = residual.stream(residual.start(torch.randn(1, 3, D)))
    stream.apply(lambda h: h)
    stream.apply(lambda h: h)
    with pytest.raises(
        TypeError,
        match=r"depth is the stream itself \(\w+Stream\), not a DepthState; end each block with `return stream",
    ):
        residual.finish(stream)
    with pytest.raises(
        TypeError, match=r"depth is a tensor \[1, 3, 32\], not a DepthState; begin with depth = residual.start\(x\)"
    ):
        residual.stream(torch.randn(1, 3, D))


def test_a_wrong_width_names_d_model_or_the_sublayer():
    residual = attnres.BlockAttnRes(d_model=D, n_sublayers=4, attnres_blocks=2)
    with pytest.raises(ValueError, match=r"last dimension 16 is not d_model=32"):
        residual.start(torch.randn(1, 3, 16))
    stream = residual.stream(residual.start(torch.randn(1, 3, D)))
    with pytest.raises(ValueError, match=r"f has shape \(1, 3, 16\), the stream's tokens are \[1, 3, 32\]"):
        stream.apply(lambda h: h[..., :16])


def test_the_repr_shows_the_settings():
    assert repr(attnres.BlockAttnRes(d_model=64, n_sublayers=12, attnres_blocks=4)) == (
        "BlockAttnRes(d_model=64, n_sublayers=12, attnres_block_sizes=[3, 3, 3, 3])"
    )
    full = attnres.FullAttnRes(d_model=64, n_sublayers=8, attnres_kernel="sigmoid", attnres_impl="fused")
    assert repr(full) == "FullAttnRes(d_model=64, n_sublayers=8, attnres_kernel='sigmoid', attnres_impl='fused')"


def test_depth_state_is_what_a_block_returns():
    residual = attnres.FullAttnRes(d_model=D, n_sublayers=2 * LAYERS)
    assert isinstance(Block()(residual.start(torch.randn(1, 3, D)), residual), DepthState)
