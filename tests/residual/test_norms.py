"""match_prenorm_eps: with each pre-norm's eps scaled by c_l², a zero-initialised AttnRes network of
your own computes exactly the PreNorm network with the same weights (float64, 1e-12); without the call
it does not. Stand-in network: L small MLP sublayers, each behind its own pre-norm, and a final norm."""

import pytest
import torch
from torch import nn

from attnres import match_prenorm_eps
from attnres.residual import BlockAttnRes, FullAttnRes, residual_scheme

D, L, EPS = 16, 6, 1e-5


class VarianceEpsilonRMSNorm(nn.Module):
    """The shape of transformers' RMSNorms: eps in ``variance_epsilon`` (computed in the input dtype here)."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


NORMS = {
    "layernorm": lambda: nn.LayerNorm(D, eps=EPS),
    "rmsnorm": lambda: nn.RMSNorm(D, eps=EPS),
    "variance_epsilon": lambda: VarianceEpsilonRMSNorm(D, EPS),
}


class StandIn(nn.Module):
    """L sublayers f_l(x) = W2 tanh(W1 x) behind pre-norms, a final norm; run as PreNorm or through a scheme."""

    def __init__(self, norm: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.sublayers = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D)) for _ in range(L)
        )
        self.norms = nn.ModuleList(NORMS[norm]() for _ in range(L))
        self.final_norm = NORMS[norm]()
        with torch.no_grad():  # norms away from their identity init, so that the weights matter too
            for n in [*self.norms, self.final_norm]:
                for p in n.parameters():
                    p.add_(torch.rand_like(p) * 0.5)
        self.double()

    def prenorm(self, x):
        h = x
        for f, norm in zip(self.sublayers, self.norms, strict=True):
            h = h + f(norm(h))
        return self.final_norm(h)

    def attnres(self, x, scheme):
        stream = scheme.begin(x)
        for l, (f, norm) in enumerate(zip(self.sublayers, self.norms, strict=True)):
            stream.write(l, f(norm(stream.read(l))))
        return self.final_norm(stream.end())

    def all_norms(self):
        return [*self.norms, self.final_norm]


SCHEMES = {
    "full": lambda **kw: FullAttnRes(D, L, norm_eps=EPS, **kw),
    "block": lambda **kw: BlockAttnRes(D, L, attnres_block_size=2, norm_eps=EPS, **kw),
    "block_uneven": lambda **kw: BlockAttnRes(D, L, attnres_block_sizes=[1, 3, 2], norm_eps=EPS, **kw),
    "sigmoid": lambda **kw: FullAttnRes(D, L, norm_eps=EPS, attnres_kernel="sigmoid", **kw),
}


def embedding(seed=1):
    return torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.2


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_zero_init_attnres_equals_prenorm(norm, scheme_name):
    model, x = StandIn(norm), embedding()
    scheme = SCHEMES[scheme_name]().double()
    want = model.prenorm(x)
    # without the call every norm sees eps·K_l²: a visible difference (the test can fail)
    assert (model.attnres(x, scheme) - want).abs().max() > 1e-9
    set_to = match_prenorm_eps(model.all_norms(), scheme)
    assert len(set_to) == L + 1
    torch.testing.assert_close(model.attnres(x, scheme), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scheme_name", ["full", "block"])
def test_agrees_with_the_schemes_own_eps_scale(scheme_name):
    """The factors are those AttnResLM applies with attnres_scale_norm_eps (ResidualScheme.norm_eps_scale)."""
    model = StandIn("rmsnorm")
    scheme = SCHEMES[scheme_name](attnres_scale_norm_eps=True)
    set_to = match_prenorm_eps(model.all_norms(), scheme)
    assert set_to == pytest.approx([EPS * scheme.norm_eps_scale(l) for l in range(L + 1)], rel=1e-15)
    assert all(s < EPS for s in set_to[1:])


def test_idempotent_and_without_final_norm():
    model, x = StandIn("layernorm"), embedding(2)
    scheme = SCHEMES["full"]().double()
    want = model.prenorm(x)
    first = match_prenorm_eps(model.norms, scheme)  # the L pre-norms only
    assert model.final_norm.eps == EPS
    assert match_prenorm_eps(model.norms, scheme) == first  # a second call changes nothing
    assert [n.eps for n in model.norms] == first
    match_prenorm_eps(model.all_norms(), scheme)
    torch.testing.assert_close(model.attnres(x, scheme), want, rtol=1e-12, atol=1e-12)


def test_prenorm_scheme_and_rmsnorm_without_eps():
    """PreNorm reads the sum itself (c = 1): nothing changes. torch's RMSNorm(eps=None) gets the eps it
    used implicitly (finfo of its dtype), made explicit."""
    norms = [nn.RMSNorm(D) for _ in range(L + 1)]
    set_to = match_prenorm_eps(norms, residual_scheme("prenorm", D, L))
    assert set_to == [torch.finfo(torch.float32).eps] * (L + 1)
    set_to = match_prenorm_eps(norms, FullAttnRes(D, L))
    assert set_to[3] == pytest.approx(torch.finfo(torch.float32).eps / 16)


def test_errors():
    scheme = FullAttnRes(D, L)
    norms = [nn.LayerNorm(D) for _ in range(L + 1)]
    with pytest.raises(ValueError, match=r"norms has 5 modules but the scheme has 6 sublayers.*\(7 in all\)"):
        match_prenorm_eps(norms[:5], scheme)
    with pytest.raises(ValueError, match="norms has 8 modules"):
        match_prenorm_eps(norms + [nn.LayerNorm(D)], scheme)
    bad = norms[:2] + [nn.Identity()] + norms[3:]
    with pytest.raises(
        TypeError,
        match=r"norms\[2\] \(sublayer 2\) is a torch.nn.modules.linear.Identity, which has "
        r"no float `eps` or `variance_epsilon` attribute",
    ):
        match_prenorm_eps(bad, scheme)
    weird = nn.LayerNorm(D)
    weird.eps = "small"
    with pytest.raises(TypeError, match=r"norms\[6\] \(the final norm\) \(LayerNorm\) has eps='small', not a number"):
        match_prenorm_eps(norms[:6] + [weird], scheme)
    shared = nn.LayerNorm(D)
    with pytest.raises(ValueError, match=r"norms\[1\] \(sublayer 1\) is the same module as norms\[0\].*own norm"):
        match_prenorm_eps([shared] * L, scheme)
    with pytest.raises(TypeError, match="scheme must be an attnres ResidualScheme"):
        match_prenorm_eps(norms, "full")
    with pytest.raises(TypeError, match="norms must be a sequence of norm modules"):
        match_prenorm_eps(nn.LayerNorm(D), scheme)
    assert all(n.eps == 1e-5 and not hasattr(n, "_attnres_base_eps") for n in norms), "a refused call changed eps"
