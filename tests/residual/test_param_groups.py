"""attnres.param_groups: torch-style groups for any model with AttnRes parts. AttnRes parameters never
reach Muon and are never decayed; the assignment equals AttnResLM.param_kinds() (what the trainer used);
the groups drive torch.optim.Muon + AdamW; bad arguments fail clearly."""

import copy
import math

import pytest
import torch
from torch import nn

from attnres import AttnResLM, FullAttnRes, ModelConfig, param_groups
from attnres.residual.param_groups import parameter_kinds

TINY = dict(vocab_size=50, d_model=32, n_layers=4, n_heads=2, max_seq_len=16)
GROUP_OF = {"matrix": "matrix", "embedding": "decay", "head": "decay", "no_decay": "no_decay"}


def check_partition(model, groups):
    """Every trainable parameter in exactly one group; names and params line up."""
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen)), "a parameter sits in two groups"
    assert set(seen) == {id(p) for p in model.parameters() if p.requires_grad}
    params = dict(model.named_parameters())
    for g in groups:
        assert [id(params[n]) for n in g["names"]] == [id(p) for p in g["params"]]
        assert g["optimizer"] == ("muon" if g["kind"] == "matrix" else "adamw")


def assert_same_assignment(model, groups, kinds, prefix=""):
    got = {n: g["kind"] for g in groups for n in g["names"]}
    want = {prefix + n: GROUP_OF[k] for n, k in kinds.items()}
    assert got == want


LM_CASES = [
    dict(residual="full"),
    dict(residual="block", attnres_blocks=2),
    dict(residual="prenorm"),
    dict(residual="full", attnres_weights="input_query"),
    dict(residual="full", attnres_weights="low_rank_query", attnres_query_rank=2),
    dict(residual="block", attnres_weights="scalar"),
    dict(residual="full", attnres_heads=2),
    dict(residual="mudd"),
    dict(residual="hyper"),
    dict(residual="gated"),
    dict(residual="highway"),
    dict(residual="full", backbone="kimi_linear", moe_experts=4),
    dict(residual="block", backbone="kimi_linear", moe_experts=4, attnres_blocks=2),
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("case", LM_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_attnreslm_assignment_equals_param_kinds(case, tied):
    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(**TINY, **case, tie_embeddings=tied))
    assert parameter_kinds(model) == model.param_kinds()
    groups = param_groups(model, weight_decay=0.05)
    check_partition(model, groups)
    assert_same_assignment(model, groups, model.param_kinds())
    residual = {id(p) for p in model.residual.parameters()}
    for g in groups:
        assert g["weight_decay"] == (0.0 if g["kind"] == "no_decay" else 0.05)
        if g["optimizer"] == "muon":
            assert residual.isdisjoint(id(p) for p in g["params"]), "an AttnRes parameter went to Muon"
    if case.get("backbone") == "kimi_linear":  # the experts' stacks [n, rows, cols] are Muon's
        muon = next(g for g in groups if g["optimizer"] == "muon")
        assert any(p.dim() == 3 for p in muon["params"])


def test_attnres_for_causal_lm():
    from attnres.hf import AttnResConfig, AttnResForCausalLM

    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig.from_model_config(ModelConfig(**TINY, residual="block", attnres_blocks=2)))
    groups = param_groups(model)
    check_partition(model, groups)
    assert_same_assignment(model, groups, model.model.param_kinds(), prefix="model.")


class Experts(nn.Module):
    """A mixture-of-experts weight stack in transformers' layout ([experts, rows, cols], num_experts)."""

    def __init__(self, d, n=3):
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * d, d) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(n, d, d) * 0.02)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.gate = nn.Parameter(torch.zeros(1, d))  # a vector stored as [1, D]: never Muon's
        self.experts = Experts(d)


class OwnGPT(nn.Module):
    """A nanoGPT-style model with AttnRes in its own code: learned positions, LayerNorm with biases,
    an untied head, a scheme as a submodule, a timm-style no_weight_decay()."""

    def __init__(self, vocab=64, d=16, n_layers=2, tied=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(8, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.scale = nn.Parameter(torch.ones(d, d))  # 2-D, but named by no_weight_decay()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.attnres = FullAttnRes(d, 2 * n_layers)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def no_weight_decay(self):
        return {"cls_token", "scale"}


@pytest.mark.parametrize("tied", [False, True])
def test_own_model(tied):
    model = OwnGPT(tied=tied)
    kinds = parameter_kinds(model)
    groups = param_groups(model, weight_decay=0.1)
    check_partition(model, groups)
    assert kinds["wte.weight"] == kinds["wpe.weight"] == "embedding"
    assert ("lm_head.weight" not in kinds) if tied else kinds["lm_head.weight"] == "head"
    assert kinds["attnres.queries"] == kinds["attnres.key_norm_weight"] == "no_decay"
    assert kinds["cls_token"] == kinds["scale"] == "no_decay"
    for i in range(2):
        b = f"blocks.{i}."
        for name in (
            "attn.weight",
            "proj.weight",
            "mlp.0.weight",
            "mlp.2.weight",
            "experts.gate_up_proj",
            "experts.down_proj",
        ):
            assert kinds[b + name] == "matrix", name
        for name in ("ln_1.weight", "ln_1.bias", "attn.bias", "mlp.2.bias", "gate"):
            assert kinds[b + name] == "no_decay", name
    by_kind = {g["kind"]: g for g in groups}
    assert by_kind["matrix"]["weight_decay"] == by_kind["decay"]["weight_decay"] == 0.1
    assert by_kind["no_decay"]["weight_decay"] == 0.0


def test_head_rules():
    """get_output_embeddings() names the head; an explicit head= wins; a frozen parameter is left out."""
    model = OwnGPT()
    model.get_output_embeddings = lambda: model.blocks[1].proj
    kinds = parameter_kinds(model)
    assert kinds["blocks.1.proj.weight"] == "head" and kinds["lm_head.weight"] == "matrix"
    assert parameter_kinds(model, head=[model.lm_head, model.blocks[0].proj])["blocks.0.proj.weight"] == "head"
    model.wpe.weight.requires_grad_(False)
    groups = param_groups(model)
    check_partition(model, groups)
    assert "wpe.weight" not in [n for g in groups for n in g["names"]]


def loss_of(model, ids):
    x = model.wte(ids) + model.wpe(torch.arange(ids.shape[1]))
    stream = model.attnres.begin(x)
    for block in model.blocks:
        h = stream.read()
        stream.write(None, model.proj_of(block, h))
        h = stream.read()
        stream.write(None, block.mlp(block.ln_2(h)) + block.gate)
    logits = model.lm_head(model.ln_f(stream.end()))
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def test_muon_and_adamw_train_with_the_groups():
    torch.manual_seed(0)
    model = OwnGPT()
    model.proj_of = lambda block, h: block.proj(block.attn(block.ln_1(h))[..., :16])
    for b in model.blocks:  # torch's Muon takes 2-D parameters: this model keeps its experts out of training
        b.experts.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.1)
    muon = torch.optim.Muon([g for g in groups if g["optimizer"] == "muon"], lr=0.02, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([g for g in groups if g["optimizer"] == "adamw"], lr=3e-3)
    assert {n for g in muon.param_groups for n in g["names"]}.isdisjoint(
        n for n, _ in model.attnres.named_parameters(prefix="attnres")
    )
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for _ in range(30):
        loss = loss_of(model, ids)
        losses.append(loss.item())
        muon.zero_grad(), adamw.zero_grad()
        loss.backward()
        muon.step(), adamw.step()
    assert losses[-1] < 0.7 * losses[0], losses
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {"attnres.queries", "attnres.key_norm_weight", "blocks.0.attn.weight", "wte.weight"} <= changed
    # AdamW alone, over every group
    adamw_only = torch.optim.AdamW(param_groups(model), lr=1e-3)
    assert sum(len(g["params"]) for g in adamw_only.param_groups) == sum(p.requires_grad for p in model.parameters())


def test_build_optimizer_takes_any_model():
    """attnres.train.build_optimizer uses the same rule for a model without param_kinds()."""
    from attnres.train import build_optimizer

    model = OwnGPT()
    for b in model.blocks:
        b.experts.requires_grad_(False)
    opt = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.1)
    groups = {g["kind"]: g for g in param_groups(model, weight_decay=0.1)}
    muon_ids = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert muon_ids == {id(p) for p in groups["matrix"]["params"]}


def test_errors():
    with pytest.raises(ValueError, match=r"Identity has no parameters: there is nothing to optimize"):
        param_groups(nn.Identity())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"Linear has no trainable parameters \(all 2 have requires_grad=False\)"):
        param_groups(frozen)
    model = OwnGPT()
    for bad in (-0.1, "0.1", True, math.nan, math.inf, None):
        with pytest.raises(ValueError, match=rf"weight_decay={bad!r} is invalid: give a finite number >= 0"):
            param_groups(model, weight_decay=bad)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module; got dict"):
        param_groups({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"matrix_stacks names parameters OwnGPT does not have: \['blocks.9.w'\]"):
        param_groups(model, matrix_stacks=["blocks.9.w"])
    with pytest.raises(ValueError, match=r"3-D stacks.*blocks.0.attn.weight has shape \(48, 16\)"):
        param_groups(model, matrix_stacks=["blocks.0.attn.weight"])
    with pytest.raises(TypeError, match="head must be a module or a sequence of modules; got str"):
        param_groups(model, head=["lm_head"])


def test_a_head_outside_the_model_is_refused():
    """A head module that is not the model's (a copy, a new layer) would leave the real head to Muon."""
    model = OwnGPT()
    for stray in (copy.deepcopy(model.lm_head), nn.Linear(4, 4), nn.Identity()):
        for head in (stray, [model.lm_head, stray]):
            with pytest.raises(ValueError, match=r"head=\w+\(\.\.\.\) (is not part of the model|has no weight)"):
                param_groups(model, head=head)
    assert parameter_kinds(model, head=model.lm_head)["lm_head.weight"] == "head"
