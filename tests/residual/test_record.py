"""A residual scheme's state dict records what defines its function: loading it into a scheme with other
settings is one ValueError naming both, same settings round-trip exactly, eps (the scheme's own and the
pre-norm eps match_prenorm_eps set) comes back on load, and state dicts saved before the record load as
before. Also: a stream driven past its sublayers fails with one error."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from attnres import match_prenorm_eps
from attnres.residual import RESIDUALS, BlockAttnRes, FullAttnRes, residual_scheme
from attnres.residual.record import RECORD_KEY, SchemeMismatch

D, L = 16, 8


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter away from its init, so that a load that takes nothing would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return module


def embedding(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def run(scheme, x):
    """Drive the stream with fixed sublayers (a tanh of a channel shift: the same function for every scheme)."""
    stream = scheme.begin(x)
    for l in range(scheme.n_sublayers):
        stream.apply(lambda h, l=l: torch.tanh(h.roll(l + 1, dims=-1)))
    return stream.end()


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- other settings fail


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    "saved,into,names",
    [
        (
            lambda: BlockAttnRes(D, L, attnres_blocks=2),
            lambda: FullAttnRes(D, L),
            ["block (attnres_block_sizes=[4, 4], attnres_blocks=2)", "full (attnres_block_sizes=[1] * 8"],
        ),
        (
            lambda: BlockAttnRes(D, L, attnres_blocks=2),
            lambda: BlockAttnRes(D, L, attnres_blocks=4),
            ["attnres_blocks=2", "attnres_blocks=4"],
        ),
        (lambda: FullAttnRes(D, L, attnres_heads=4), lambda: FullAttnRes(D, L), ["attnres_heads=4", "attnres_heads=1"]),
        (
            lambda: FullAttnRes(D, L, attnres_kernel="sigmoid"),
            lambda: FullAttnRes(D, L),
            ["attnres_kernel='sigmoid'", "attnres_kernel='softmax'"],
        ),
        (
            lambda: FullAttnRes(D, L, attnres_routing="additive"),
            lambda: FullAttnRes(D, L),
            ["attnres_routing='additive'"],
        ),
        (
            lambda: FullAttnRes(D, L, attnres_sources="states"),
            lambda: FullAttnRes(D, L),
            ["attnres_sources='states'", "attnres_sources='outputs'"],
        ),
        (
            lambda: FullAttnRes(D, L, attnres_window=2),
            lambda: FullAttnRes(D, L),
            ["attnres_window=2", "attnres_window=None"],
        ),
        (
            lambda: residual_scheme("hyper", D, L, hyper_streams=2),
            lambda: residual_scheme("hyper", D, L, hyper_streams=4),
            ["hyper_streams=2", "hyper_streams=4"],
        ),
        (
            lambda: residual_scheme("hyper", D, L, hyper_dynamic=False),
            lambda: residual_scheme("mhc", D, L),
            ["the checkpoint has hyper, this model has mhc"],
        ),
        (lambda: FullAttnRes(D, L), lambda: residual_scheme("prenorm", D, L), ["has full", "has prenorm"]),
    ],
    ids=[
        "block-to-full",
        "N2-to-N4",
        "heads4-to-1",
        "kernel",
        "routing",
        "sources",
        "window",
        "streams",
        "hyper-mhc",
        "full-to-prenorm",
    ],
)
def test_loading_into_other_settings_is_one_error_naming_both(saved, into, names, strict):
    source, target = randomize(saved()), into()
    before = {k: v.clone() for k, v in target.state_dict().items() if k != RECORD_KEY}
    with pytest.raises(ValueError) as error:
        target.load_state_dict(source.state_dict(), strict=strict)
    message = one_line(error)
    assert message.startswith("residual scheme mismatch: the checkpoint has ")
    assert all(name in message for name in names), message
    assert "build this model's scheme with the checkpoint's settings" in message
    after = target.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the record is read before any weight


def test_block_with_n_equal_l_and_full_share_settings_and_load_into_each_other():
    full, block = randomize(FullAttnRes(D, L)), BlockAttnRes(D, L, attnres_blocks=L)
    block.load_state_dict(full.state_dict())
    x = embedding()
    torch.testing.assert_close(run(block.double(), x), run(full.double(), x), rtol=1e-12, atol=1e-12)


def test_how_it_is_computed_is_no_setting():
    """attnres_impl and the group size change the arithmetic's order, not the function: they load."""
    source = randomize(FullAttnRes(D, L, attnres_impl="fused", attnres_group_size=2)).double()
    target = FullAttnRes(D, L, attnres_impl="reference").double()
    target.load_state_dict(source.state_dict())
    x = embedding()
    torch.testing.assert_close(run(target, x), run(source, x), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- same settings round-trip


def every_scheme(name: str) -> nn.Module:
    return residual_scheme(name, D, L, gated_heads=2) if name == "gated" else residual_scheme(name, D, L)


@pytest.mark.parametrize("name", sorted(RESIDUALS))
def test_same_settings_round_trip_exactly_through_safetensors(name, tmp_path):
    source = randomize(every_scheme(name)).double()
    save_file(source.state_dict(), tmp_path / "scheme.safetensors")
    target = every_scheme(name).double()
    assert target.load_state_dict(load_file(tmp_path / "scheme.safetensors"), strict=True)
    x = embedding()
    assert torch.equal(run(target, x), run(source, x))


@pytest.mark.parametrize("name", sorted(set(RESIDUALS) - {"prenorm", "full"}))
def test_every_rival_rejects_the_paper_schemes_weights(name):
    """Every kind of scheme names itself: Full AttnRes' state dict never loads into another kind."""
    with pytest.raises(SchemeMismatch, match=f"the checkpoint has full, this model has {name}|attnres_"):
        every_scheme(name).load_state_dict(FullAttnRes(D, L).state_dict(), strict=False)


def test_a_record_cast_to_a_float_dtype_still_reads():
    """Loaders that cast a whole state dict (a bfloat16 from_pretrained) turn the record's bytes into floats."""
    source = randomize(FullAttnRes(D, L, attnres_heads=2))
    state = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    FullAttnRes(D, L, attnres_heads=2).load_state_dict(state)
    with pytest.raises(SchemeMismatch, match="attnres_heads=2"):
        FullAttnRes(D, L).load_state_dict(state)


def test_an_unreadable_record_is_one_error():
    state = FullAttnRes(D, L).state_dict()
    state[RECORD_KEY] = torch.tensor(list(b"not json"), dtype=torch.uint8)
    with pytest.raises(SchemeMismatch, match="record .* cannot be read: not JSON") as error:
        FullAttnRes(D, L).load_state_dict(state)
    one_line(error)


# ----------------------------------------------------------------------------- eps comes back


def test_the_key_norm_eps_is_restored():
    source = randomize(FullAttnRes(D, L, norm_eps=1e-2)).double()
    target = FullAttnRes(D, L).double()
    target.load_state_dict(source.state_dict())
    assert target.eps == 1e-2
    x = embedding() * 0.05  # small reads: the key norm's eps shows
    assert torch.equal(run(target, x), run(source, x))


class OwnModel(nn.Module):
    """Your own model: pre-norms (LayerNorm), tanh sublayers, a final norm and an AttnRes scheme."""

    def __init__(self, scheme, eps: float = 1e-5, match: bool = True, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.sublayers = nn.ModuleList(nn.Linear(D, D) for _ in range(L))
        self.norms = nn.ModuleList(nn.LayerNorm(D, eps=eps) for _ in range(L))
        self.final_norm = nn.LayerNorm(D, eps=eps)
        self.residual = scheme
        if match:
            match_prenorm_eps([*self.norms, self.final_norm], scheme)
        self.double()

    def forward(self, x):
        stream = self.residual.begin(x)
        for f, norm in zip(self.sublayers, self.norms, strict=True):
            stream.apply(lambda h, f=f, norm=norm: torch.tanh(f(norm(h))))
        return self.final_norm(stream.end())

    def eps(self) -> list[float]:
        return [n.eps for n in [*self.norms, self.final_norm]]


def test_match_prenorm_eps_survives_a_save_and_load(tmp_path):
    """The base eps a checkpoint's norms were matched from comes back, whatever the new model was built with."""
    source = OwnModel(BlockAttnRes(D, L, attnres_blocks=4), eps=1e-3)
    save_file(source.state_dict(), tmp_path / "model.safetensors")
    target = OwnModel(BlockAttnRes(D, L, attnres_blocks=4), eps=1e-6, seed=1)
    assert target.eps() != source.eps()
    target.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert target.eps() == source.eps()
    x = embedding() * 0.01  # small reads: the pre-norms' eps shows
    assert torch.equal(target(x), source(x))
    match_prenorm_eps([*target.norms, target.final_norm], target.residual)  # idempotent from the restored base
    assert target.eps() == source.eps()


@pytest.mark.parametrize("matched", ["checkpoint", "model"])
def test_pre_norms_matched_on_one_side_only_fail(matched):
    source = OwnModel(FullAttnRes(D, L), match=matched == "checkpoint")
    target = OwnModel(FullAttnRes(D, L), match=matched == "model")
    with pytest.raises(SchemeMismatch, match="pre-norm eps were .*match_prenorm_eps") as error:
        target.load_state_dict(source.state_dict())
    one_line(error)


# ----------------------------------------------------------------------------- state dicts without a record


@pytest.mark.parametrize("name", sorted(RESIDUALS))
def test_a_state_dict_saved_before_the_record_loads_with_the_models_settings(name):
    source = randomize(every_scheme(name)).double()
    state = {k: v for k, v in source.state_dict().items() if k != RECORD_KEY}
    target = every_scheme(name).double()
    result = target.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = embedding()
    assert torch.equal(run(target, x), run(source, x))


def test_a_prenorm_state_dict_still_starts_an_attnres_model():
    """strict=False from a model whose scheme has no weights (PreNorm): the scheme keeps its own settings."""
    prenorm = OwnModel(residual_scheme("prenorm", D, L), match=False)
    model = OwnModel(FullAttnRes(D, L, norm_eps=1e-3), match=False)
    missing, unexpected = model.load_state_dict(prenorm.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"residual.queries", "residual.key_norm_weight"}
    assert model.residual.eps == 1e-3


# ----------------------------------------------------------------------------- a stream past its sublayers


@pytest.mark.parametrize("name", sorted(RESIDUALS))
def test_applying_more_sublayers_than_the_scheme_has_is_one_error(name):
    scheme = every_scheme(name).double()
    stream = scheme.begin(embedding())
    for _ in range(L):
        stream.apply(torch.tanh)
    with pytest.raises(ValueError, match=f"call {L + 1} for a scheme built with n_sublayers={L}") as error:
        stream.apply(torch.tanh)
    one_line(error)
    assert stream.end().shape == (2, 5, D)  # the stream is left as it was: the L sublayers run


@pytest.mark.parametrize("name", sorted(RESIDUALS))
def test_every_scheme_records_its_registry_name_and_its_options(name):
    """A new scheme that forgot its name or settings would record too little to be told apart."""
    scheme = every_scheme(name)
    assert scheme.scheme_name == name
    # how it is computed, or how a parameter starts and trains, is no setting: the weights carry the rest
    no_setting = {"attnres_impl", "attnres_group_size", "layerscale_init", "attnres_gain_init", "attnres_gain_lr"}
    options = set(RESIDUALS[name].options) - no_setting
    options -= {"attnres_block_size"}  # recorded as the block sizes it gives (attnres_block_sizes)
    assert options <= set(scheme.settings()), options - set(scheme.settings())
