"""Retrofit-by-fine-tuning in a training run (``TrainConfig.retrofit_step``): the run trains the PreNorm
model first, and at step S swaps in the configured residual scheme with the same sublayer weights, zero
queries and eps-scaled norms, so the model's function does not change at the switch (docs/method.md §3).
After it, how far the queries move from zero and how uniform the routing stays are logged."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from attnres.model import AttnResLM, ModelConfig


def prenorm_of(model_config: ModelConfig) -> ModelConfig:
    """The PreNorm model a retrofit run trains first: the same model with residual="prenorm" and every
    residual-scheme option at its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("attnres_")}
    return ModelConfig(**{**model_config.to_dict(), **defaults, "residual": "prenorm"})


def check_retrofit(retrofit_step: int, model_config: ModelConfig, resume: bool, out_dir: Path) -> None:
    """A retrofit run starts fresh, and its scheme must keep the PreNorm function at the switch."""
    if resume:
        raise ValueError(
            f"{out_dir}: a run with retrofit_step={retrofit_step} cannot resume (its architecture "
            "changes mid-run); start it again with force"
        )
    if model_config.residual in ("block", "full") and not model_config.attnres_scale_norm_eps:
        raise ValueError(
            "retrofit_step needs attnres_scale_norm_eps=true, so that the retrofit keeps the PreNorm "
            "model's function (docs/method.md §3)"
        )


def retrofitted(old: torch.nn.Module, target: ModelConfig, device: torch.device, x: torch.Tensor):
    """(the ``target`` model with ``old``'s sublayer weights, the largest logit change on ``x``: rounding)."""
    model = AttnResLM(target).to(device)
    missing, unexpected = model.load_state_dict(old.state_dict(), strict=False)
    if unexpected or any(not k.startswith("residual.") for k in missing):
        raise RuntimeError(f"retrofit: the PreNorm state does not fit ({sorted(unexpected)[:4]}, {missing[:4]})")
    with torch.no_grad():
        old.eval(), model.eval()
        change = (old(x) - model(x)).abs().max().item()
    model.train()
    return model, change


def depth_stats(model: AttnResLM, x: torch.Tensor) -> dict:
    """How far the queries are from zero (mean L2 norm per consumer) and how uniform the routing is on
    ``x`` (mean entropy / log K_l: 1 = uniform); {} for schemes without pseudo-queries."""
    from attnres.analysis.depth import record_on_batch, routing_sharpness

    queries = getattr(model.residual, "queries", None)
    if queries is None:
        return {}
    was_training = model.training
    sharp = routing_sharpness(record_on_batch(model, x))
    model.train(was_training)
    if sharp is None:  # a scheme with queries has depth weights; say so if one ever has not
        raise ValueError(f"{type(model.residual).__name__} has queries but records no depth weights")
    ratios = [e / math.log(k) for e, k in zip(sharp["entropy"], sharp["n_sources"], strict=True) if k > 1]
    return {"query_norm": queries.detach().norm(dim=-1).mean().item(), "routing_entropy": sum(ratios) / len(ratios)}
