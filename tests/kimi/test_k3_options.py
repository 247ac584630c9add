"""Kimi K3's options of the Kimi Linear backbone, piece by piece in float64 against plain references
written here (attnres.model.k3, attnres.model.k3_blocks); the whole models are checked against mlx-lm's
kimi_k3 in tests/serving/test_mlx.py and round-trip through K3 directories in tests/kimi/test_k3.py."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from attnres.model import AttnResLM, ModelConfig
from attnres.model.backbones import kimi_params
from attnres.model.k3 import bounded_log_decay, situ
from attnres.model.k3_blocks import (
    BoundedForgetGate,
    GatedLatentAttention,
    K3MoE,
    SiTUMLP,
)
from attnres.model.kimi_linear import kimi_linear_config

F64 = torch.float64


def config(**options) -> ModelConfig:
    fields = dict(backbone="kimi_linear", vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16)
    return ModelConfig(**{**fields, **options})


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * 2


def scalar_situ(u: float, g: float, beta: float, linear_beta: float | None) -> float:
    if linear_beta is not None:
        u = linear_beta * math.tanh(u / linear_beta)
    return beta * math.tanh(g / beta) / (1 + math.exp(-g)) * u


@pytest.mark.parametrize("beta, linear_beta", [(1.0, None), (0.5, 2.0), (4.0, 0.75)])
def test_situ_matches_the_scalar_formula_and_its_gradients(beta, linear_beta):
    up, gate = randn(5, 7, seed=1), randn(5, 7, seed=2)
    got = situ(up, gate, beta, linear_beta)
    want = torch.tensor(
        [
            [scalar_situ(u, g, beta, linear_beta) for u, g in zip(ur, gr, strict=True)]
            for ur, gr in zip(up.tolist(), gate.tolist(), strict=True)
        ],
        dtype=F64,
    )
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    assert got.dtype == F64 and situ(up.float(), gate.float(), beta, linear_beta).dtype == torch.float32
    assert torch.autograd.gradcheck(
        lambda u, g: situ(u, g, beta, linear_beta), (up.requires_grad_(), gate.requires_grad_())
    )


def test_bounded_log_decay_matches_the_scalar_formula_and_stays_in_its_bounds():
    f, dt, A_log = randn(3, 4, 2, 5, seed=3), randn(2, 5, seed=4), randn(1, 1, 2, 1, seed=5) / 4
    got = bounded_log_decay(f, A_log, dt, -5.0)
    a = A_log.flatten().tolist()
    want = torch.empty_like(f)
    for b, t, h, ch in torch.cartesian_prod(*(torch.arange(n) for n in f.shape)).tolist():
        z = math.exp(a[h]) * (f[b, t, h, ch].item() + dt[h, ch].item())
        want[b, t, h, ch] = -5.0 / (1 + math.exp(-z))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    assert bool((got > -5.0).all() and (got < 0).all())
    assert torch.autograd.gradcheck(lambda x: bounded_log_decay(x, A_log, dt, -5.0), (f.requires_grad_(),))


def test_bounded_forget_gate_is_the_formula_on_its_projections():
    c = config(kda_gate_lower_bound=-3.0)
    hf = kimi_linear_config(c)
    gate = BoundedForgetGate(hf, -3.0).to(F64)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(randn(*p.shape, seed=p.numel()) / 4)
    x = randn(2, 3, 16, seed=6)
    f = (x @ gate.f_a_proj.weight.T @ gate.f_b_proj.weight.T).view(2, 3, -1, gate.head_dim)
    want = -3.0 * torch.sigmoid(gate.A_log.exp() * (f + gate.dt_bias.view(-1, gate.head_dim)))
    torch.testing.assert_close(gate(x), want, rtol=1e-14, atol=1e-14)


def test_situ_mlp_is_down_of_situ():
    c = config(situ_beta=2.0, situ_linear_beta=1.5)
    mlp = SiTUMLP(kimi_linear_config(c), 2.0, 1.5).to(F64)
    x = randn(2, 3, 16, seed=7)
    want = situ(x @ mlp.up_proj.weight.T, x @ mlp.gate_proj.weight.T, 2.0, 1.5) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), want, rtol=1e-14, atol=1e-14)


def reference_moe(moe, x, c) -> torch.Tensor:
    """K3's MoE for each token on its own: sigmoid scores, the biased scores choose (within the
    moe_topk_groups groups whose two best biased scores sum highest), the unbiased ones weigh
    (renormalised, scaled); the experts run in the latent; norm, up, plus the shared experts."""
    E, G, k = c.moe_experts, c.moe_groups, c.moe_top_k
    out = []
    tokens = x.reshape(-1, x.shape[-1])
    # the router computes in float32 (transformers' and K3's), whatever the model's dtype; one product
    # for all tokens, so that its float32 sums run in the module's order
    router = torch.sigmoid(torch.nn.functional.linear(tokens.float(), moe.gate.weight.float()))
    for token, scores in zip(tokens, router, strict=True):
        biased = scores + moe.gate.e_score_correction_bias.float()
        groups = biased.view(G, E // G)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        keep = set(group_score.argsort(descending=True)[: c.moe_topk_groups].tolist())
        allowed = [e for e in range(E) if e // (E // G) in keep]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:k]
        w = scores[chosen]
        w = ((w / (w.sum() + 1e-20) if c.moe_renormalize else w) * c.moe_routed_scale).to(F64)
        h = moe.routed_expert_down_proj.weight @ token if c.moe_latent_dim else token
        y = torch.zeros_like(h)
        for e, we in zip(chosen, w, strict=True):
            gate, up = (moe.experts.gate_up_proj[e] @ h).chunk(2)
            y = y + we * (moe.experts.down_proj[e] @ situ(up, gate, c.situ_beta, c.situ_linear_beta))
        if c.moe_latent_norm:
            y32 = y.float()  # Kimi Linear's RMSNorm normalises in float32 (as mlx-lm's does)
            y = (y32 * torch.rsqrt(y32.pow(2).mean() + c.norm_eps)).to(F64) * moe.routed_expert_norm.weight
        if c.moe_latent_dim:
            y = moe.routed_expert_up_proj.weight @ y
        out.append(y + moe.shared_experts(token))
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize(
    "options",
    [
        dict(situ_beta=1.0),
        dict(situ_beta=3.0, situ_linear_beta=2.0, moe_latent_dim=8),
        dict(situ_beta=1.0, moe_latent_dim=8, moe_latent_norm=True, moe_groups=4, moe_topk_groups=2, moe_top_k=3),
        dict(situ_beta=0.5, moe_groups=2, moe_topk_groups=1, moe_renormalize=False, moe_routed_scale=2.0),
    ],
    ids=["situ", "latent", "latent-norm-grouped", "grouped-unnormalised"],
)
def test_k3_moe_matches_a_per_token_reference(options):
    c = config(moe_experts=8, moe_dense_layers=0, **options)
    moe = K3MoE(kimi_linear_config(c), c).to(F64)
    with torch.no_grad():
        for i, p in enumerate(moe.parameters()):
            p.copy_(randn(*p.shape, seed=10 + i) / 3)
        moe.gate.e_score_correction_bias.copy_(randn(8, seed=9) / 10)
    x = randn(2, 5, 16, seed=8)
    torch.testing.assert_close(moe(x), reference_moe(moe, x, c), rtol=1e-12, atol=1e-12)


def test_mla_output_gate_multiplies_the_heads_before_o_proj():
    c = config(mla_output_gate=True, kimi_layer_pattern="M")
    hf = kimi_linear_config(c)
    attn = GatedLatentAttention(hf, 0).to(F64)
    with torch.no_grad():
        for i, p in enumerate(attn.parameters()):
            p.copy_(randn(*p.shape, seed=20 + i) / 3)
    x = randn(2, 6, 16, seed=21)
    plain = type(attn).__mro__[1](hf, 0).to(F64)  # transformers' MLA, the same weights, o_proj = identity
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("g_proj")})
    plain.o_proj = torch.nn.Identity()
    heads = plain(x, attention_mask=None)[0]
    want = (heads * torch.sigmoid(x @ attn.g_proj.weight.T)) @ attn.o_proj.weight.T
    torch.testing.assert_close(attn(x, attention_mask=None)[0], want, rtol=1e-13, atol=1e-13)
    assert attn.o_proj.gate is None  # nothing stays behind after the call


def test_full_rank_kda_gate_is_one_projection():
    torch.manual_seed(0)
    low = AttnResLM(config(kimi_layer_pattern="K", residual="prenorm", kda_head_dim=16)).to(F64).eval()
    full = AttnResLM(config(kimi_layer_pattern="K", residual="prenorm", kda_head_dim=16, kda_full_rank_gate=True))
    full = full.to(F64).eval()
    state = full.state_dict()
    for k, v in low.state_dict().items():
        if k in state and state[k].shape == v.shape:
            state[k] = v
    full.load_state_dict(state)
    # the low-rank pair with an identity first factor (head_dim = d_model here) is the full-rank gate
    with torch.no_grad():
        for lb, fb in zip(low.blocks, full.blocks, strict=True):
            lb.attn.g_a_proj.weight.copy_(torch.eye(16, dtype=F64))
            lb.attn.g_b_proj.weight.copy_(fb.attn.g_b_proj.weight)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(full(ids), low(ids), rtol=1e-13, atol=1e-13)
    assert set(full.state_dict()) == set(low.state_dict()) - {f"blocks.{i}.attn.g_a_proj.weight" for i in range(2)}


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(kda_full_rank_gate=True, kda_head_dim=4),
        dict(mla_output_gate=True, mla_q_rank=8),
        dict(moe_experts=4, moe_latent_dim=6, moe_latent_norm=True, moe_layer_freq=2, moe_dense_layers=0, n_layers=3),
    ],
)
def test_parameter_count_matches_the_modules(options):
    lm = AttnResLM(config(residual="prenorm", kimi_layer_pattern="KM", **options))
    assert sum(p.numel() for p in lm.parameters()) == kimi_params(lm.config)


def test_defaults_build_transformers_modules_unchanged():
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from attnres.model import k3_blocks as k3

    lm = AttnResLM(config(moe_experts=4, kimi_layer_pattern="KM"))
    types = {type(b.attn) for b in lm.blocks} | {type(b.mlp) for b in lm.blocks}
    # KDA is transformers' class with its forward called past the kernels hub's routing (dynamo cannot trace it)
    assert types == {k3.DeltaAttention, kimi.KimiLinearAttention, kimi.KimiLinearMLP, kimi.KimiLinearMoE}
    assert k3.DeltaAttention.__bases__ == (kimi.KimiLinearDeltaAttention,) and set(vars(k3.DeltaAttention)) <= {
        "forward",
        "__doc__",
        "__module__",
        "__qualname__",
        "__firstlineno__",
        "__static_attributes__",
    }


def test_cached_decoding_with_every_k3_option_matches_the_full_forward():
    """Prefill, then one token at a time through the hybrid cache (KDA's recurrent step with the bounded
    decay and the full-rank gate, MLA's gated output over cached latents) = the full forward."""
    from attnres.inference import make_cache

    options = dict(
        situ_beta=1.0,
        situ_linear_beta=2.0,
        kda_full_rank_gate=True,
        kda_gate_lower_bound=-5.0,
        mla_output_gate=True,
        moe_experts=8,
        moe_latent_dim=8,
        moe_latent_norm=True,
        moe_layer_freq=2,
        moe_dense_layers=0,
        moe_groups=4,
        moe_topk_groups=2,
    )
    torch.manual_seed(3)
    lm = AttnResLM(config(n_layers=4, kimi_layer_pattern="KM", residual="block", attnres_block_size=4, **options))
    lm = lm.to(F64).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = lm(ids)
        cache = make_cache(lm, batch_size=2)
        steps = [lm(ids[:, :5], cache=cache)] + [lm(ids[:, t : t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-6, atol=1e-6)
