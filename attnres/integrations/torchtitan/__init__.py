"""attnres models in torchtitan: every residual scheme, on the LLaMA or the Kimi Linear backbone, as a
torchtitan model spec (needs ``pip install 'attnres[torchtitan]'``; torchtitan 0.3 API).

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module attnres.integrations.torchtitan --config block_debugmodel

``--module`` names this package; ``--config`` one of the functions of
``attnres.integrations.torchtitan.config_registry``: ``<scheme>_<flavor>`` for every scheme of
``attnres.residual.RESIDUALS`` (``block``, ``full``, ``prenorm``, ``mhc``, ...) and every flavor of
:data:`FLAVORS`; the rest of the Trainer's config comes from torchtitan's command line as usual
(``--training.steps 100 --parallelism.data_parallel_shard_degree 8``).

- :func:`model_registry` (flavor, scheme) -> ``ModelSpec``: the model (``AttnResTitanModel``, an
  ``AttnResLM``), the parallelize function (``parallelize.parallelize_attnres``: a tensor-parallel
  plan, activation checkpointing at depth-block boundaries, compile, FSDP2). torchtitan's Trainer
  runs FSDP/HSDP and tensor parallelism (LLaMA backbone, without sequence parallelism) with it;
- ``parallelize.post_optimizer_build``: after each optimizer step, the model's per-step updates
  (Kimi Linear's router-bias balancing from the expert loads summed over data-parallel ranks);
- ``parallelize.adamw_param_groups``: the optimizer's parameter groups, the AttnRes parameters (and
  norms) without weight decay, as ``attnres.param_groups`` has it.

torchtitan trains on CUDA; docs/distributed.md has the command for a GPU node and what the CPU tests
(tests/integrations/) check.
"""

from __future__ import annotations

import dataclasses

from torchtitan.protocols.model_spec import ModelSpec

from attnres.integrations.torchtitan.model import AttnResTitanModel
from attnres.integrations.torchtitan.parallelize import (
    adamw_param_groups,
    parallelize_attnres,
    post_optimizer_build,
)
from attnres.model.config import ModelConfig
from attnres.residual import RESIDUALS

# the sizes of torchtitan's llama3 flavors of the same names (its debugmodel's 2048-token vocabulary is
# its test tokenizer's, tests/assets/tokenizer), and a Kimi Linear model at debug size
FLAVORS: dict[str, ModelConfig] = {
    "debugmodel": ModelConfig(
        vocab_size=2048, d_model=256, n_layers=6, n_heads=16, d_ff=768, max_seq_len=2048, rope_theta=500000.0
    ),
    "1B": ModelConfig(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "8B": ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "kimi_debugmodel": ModelConfig(
        backbone="kimi_linear", vocab_size=2048, d_model=256, n_layers=8, n_heads=4, max_seq_len=2048, moe_experts=8
    ),
}


def model_config(flavor: str, residual: str = "block", **overrides) -> ModelConfig:
    """The attnres ``ModelConfig`` of a flavor with the residual scheme ``residual`` (and any other
    ``ModelConfig`` fields in ``overrides``)."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor={flavor!r} is unknown; choose one of {sorted(FLAVORS)}")
    if residual not in RESIDUALS:
        raise ValueError(f"residual={residual!r} is not a residual scheme; choose one of {sorted(RESIDUALS)}")
    return dataclasses.replace(FLAVORS[flavor], residual=residual, **overrides)


def model_spec(config: ModelConfig, flavor: str = "custom") -> ModelSpec:
    """The torchtitan ``ModelSpec`` of an attnres model of ``config``."""
    config.validate()
    return ModelSpec(
        name=f"attnres_{config.residual}",
        flavor=flavor,
        model=AttnResTitanModel.Config(lm=config),
        parallelize_fn=parallelize_attnres,
        pipelining_fn=None,
        post_optimizer_build_fn=post_optimizer_build,
        state_dict_adapter=None,
    )


def model_registry(flavor: str, residual: str = "block", **overrides) -> ModelSpec:
    """torchtitan's model-registry entry point: the spec of ``flavor`` with scheme ``residual``."""
    return model_spec(model_config(flavor, residual, **overrides), flavor)


__all__ = [
    "FLAVORS",
    "AttnResTitanModel",
    "adamw_param_groups",
    "model_config",
    "model_registry",
    "model_spec",
    "parallelize_attnres",
]
