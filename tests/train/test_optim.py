"""attnres.train.optim: parameter grouping, Muon + AdamW, state round trips, learning-rate setting."""

from __future__ import annotations

import io

import pytest
import torch
from stand_in import TinyConfig, TinyLM, make_model, muon_opt, params_equal, train

from attnres.train import CombinedOptimizer, build_optimizer, make_schedule, set_lr


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize("tied", [False, True])
def test_param_grouping(name, tied):
    model = make_model(tie_embeddings=tied)
    kinds = model.param_kinds()
    opt = build_optimizer(model, name, lr=3e-3, weight_decay=0.1)
    assert isinstance(opt, CombinedOptimizer)

    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)), "a parameter sits in two groups"
    assert set(seen) == {id(p) for p in model.parameters()}
    by_id = {id(p): n for n, p in model.named_parameters()}

    for g in opt.param_groups:
        assert "initial_lr" in g and g["initial_lr"] == g["lr"]
        group_kinds = {kinds[by_id[id(p)]] for p in g["params"]}
        if "no_decay" in group_kinds:
            assert group_kinds == {"no_decay"} and g["weight_decay"] == 0.0
        else:
            assert g["weight_decay"] == 0.1

    matrices = {id(p) for n, p in model.named_parameters() if kinds[n] == "matrix"}
    if name == "muon":
        assert isinstance(opt.optimizers["muon"], torch.optim.Muon)
        muon_ids = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
        assert muon_ids == matrices
        adamw_ids = {id(p) for g in opt.optimizers["adamw"].param_groups for p in g["params"]}
        assert adamw_ids.isdisjoint(matrices)
        assert opt.optimizers["muon"].param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    else:
        assert list(opt.optimizers) == ["adamw"]
    if tied:
        assert not any(k == "head" for k in kinds.values())


def test_build_optimizer_errors():
    model = make_model()
    with pytest.raises(ValueError, match=r"'sgd'.*adamw.*muon"):
        build_optimizer(model, "sgd", lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="muon_adjust_lr_fn"):
        build_optimizer(model, "muon", lr=1e-3, weight_decay=0.0, muon_adjust_lr_fn="magic")

    class Missing(TinyLM):
        def param_kinds(self):
            k = super().param_kinds()
            del k["norm_f.weight"]
            return k

    class Invented(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "ghost.weight": "matrix"}

    class TiedAlias(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "head.weight": "head"}

    class BadKind(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "norm_f.weight": "bias"}

    class NotMatrix(TinyLM):
        def param_kinds(self):
            return {**super().param_kinds(), "norm_f.weight": "matrix"}

    with pytest.raises(ValueError, match=r"missing.*norm_f\.weight"):
        build_optimizer(Missing(TinyConfig()), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"ghost\.weight"):
        build_optimizer(Invented(TinyConfig()), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"head\.weight \(tied to embed\.weight"):
        build_optimizer(TiedAlias(TinyConfig(tie_embeddings=True)), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"unknown kinds.*'bias'"):
        build_optimizer(BadKind(TinyConfig()), "adamw", lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"norm_f\.weight is marked 'matrix'"):
        build_optimizer(NotMatrix(TinyConfig()), "muon", lr=1e-3, weight_decay=0.1)


def test_muon_adamw_step_changes_params_and_lowers_loss():
    model = make_model()
    opt = muon_opt(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = train(model, opt, 0, 1, fixed_batch=True)
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), f"{n} did not change after one step"
    losses += train(model, opt, 1, 40, fixed_batch=True)
    assert losses[-1] < 0.7 * losses[0], losses
    # Muon kept its own state for the matrices only
    assert all(p.ndim == 2 for p in opt.optimizers["muon"].state)
    assert len(opt.state) == sum(1 for _ in model.parameters())


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_dict_round_trip_is_bitwise(name):
    sched = make_schedule("wsd", total_steps=12, warmup_steps=3, decay_fraction=0.5)

    model = make_model()
    opt = build_optimizer(model, name, lr=5e-3, weight_decay=0.1)
    train(model, opt, 0, 4, sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, 4, 5, sched)  # uninterrupted run

    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    fresh = make_model(seed=123)  # different init, overwritten by the load
    fresh.load_state_dict(saved["model"])
    fresh_opt = build_optimizer(fresh, name, lr=5e-3, weight_decay=0.1)
    fresh_opt.load_state_dict(saved["opt"])
    train(fresh, fresh_opt, 4, 5, sched)

    assert params_equal(model, fresh)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in fresh_opt.param_groups]


def test_optimizer_load_mismatch_is_clear():
    model = make_model()
    adamw_state = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1).state_dict()
    with pytest.raises(ValueError, match=r"\['adamw'\].*\['adamw', 'muon'\]"):
        muon_opt(model).load_state_dict(adamw_state)
    other = make_model(n_layers=3)
    with pytest.raises(ValueError, match="parameter"):
        build_optimizer(other, "adamw", lr=1e-3, weight_decay=0.1).load_state_dict(adamw_state)


def test_set_lr_scales_every_group():
    model = make_model()
    opt = muon_opt(model, muon_lr=0.02)
    assert set_lr(opt, 0.5) == pytest.approx(0.01)
    assert sorted({g["lr"] for g in opt.param_groups}) == pytest.approx([0.005, 0.01])
    set_lr(opt, 1.0)
    assert all(g["lr"] == g["initial_lr"] for g in opt.param_groups)
    with pytest.raises(ValueError):
        set_lr(opt, float("nan"))
