"""The parallelize function of attnres' torchtitan model spec, and its optimizer's parameter groups.

Order (torchtitan's, and PyTorch's advice for composing them): tensor parallel, activation
checkpointing, compile, then FSDP2.

- **Tensor parallel** (``parallelism.tensor_parallel_degree``, a backbone whose ``tensor_plan`` splits
  every sublayer: LLaMA's): the backbone's plan (``attnres.model.backbones``); for LLaMA, per Transformer block
  the attention's q/k/v projections and the MLP's gate/up projections are column-parallel (each rank
  computes its own heads and its slice of the hidden width), o_proj and down_proj row-parallel
  (their partial sums are all-reduced into the full hidden state). Everything else is replicated:
  the embedding, the norms, the head, and every residual-scheme parameter (AttnRes pseudo-queries
  and key norms are a few vectors of width D; the depth attention runs on the full hidden state each
  rank holds after the row-parallel all-reduce, and the gradients of replicated parameters are
  equal on every tensor-parallel rank). No sequence parallelism: the stream stays whole per rank.
  The replicated parameters are Replicate DTensors on the tp mesh (torchtitan's gradient clipping
  takes the norm over all parameters as DTensors of one mesh), but every module computes on their
  local tensors (:func:`compute_on_local_views`): the depth attention's fused ops never see a DTensor.
- **Activation checkpointing** (any of torchtitan's ``full`` / ``selective`` policies): attnres' own
  ``"block"`` mode (``AttnResLM.set_activation_checkpointing``): between depth blocks only the
  embedding and the completed block representations are kept, everything inside a segment is
  recomputed. Parameter names do not change (no wrapper module), so the weight-decay groups below
  match before and after.
- **Compile** (``compile.enable`` with "model" in ``compile.components``): every attention and MLP
  sublayer's ``forward`` (``attnres.model.compile``, granularity "sublayer"): FSDP2's hooks stay
  outside the graphs, and the block index (a Python int that would make one graph per block) never
  enters one.
- **FSDP2**: ``fully_shard`` per Transformer block, then the root (embedding, head, final norm and
  the residual scheme's parameters, gathered once per step), over the ``fsdp`` mesh (with
  ``dp_replicate``: HSDP), with torchtitan's mixed-precision dtypes.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from attnres.model.backbones import BACKBONES
from attnres.model.compile import compile_model
from attnres.model.config import ModelConfig
from attnres.model.lm import AttnResLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_tensor_parallel(config: ModelConfig, parallelism: Any) -> None:
    """A one-line error for a tensor-parallel layout this model cannot take (before anything is built)."""
    tp = parallelism.tensor_parallel_degree
    if tp <= 1:
        return
    plan = BACKBONES[config.backbone].tensor_plan
    if not plan.whole_sublayers:  # this integration shards every entry of the plan in every block
        raise ValueError(
            f"parallelism.tensor_parallel_degree={tp} is not supported for backbone={config.backbone!r}: "
            "its tensor-parallel plan leaves sublayers replicated, which this integration does not shard; use "
            "FSDP (data_parallel_shard_degree) for it"
        )
    for name, value, width in plan.widths(config):
        if width is not None and width % tp:
            raise ValueError(
                f"ModelConfig.{name}={value} is not divisible by parallelism.tensor_parallel_degree={tp}: "
                "each rank takes an equal share; choose a degree that divides it"
            )
    if parallelism.enable_sequence_parallel:
        raise ValueError(
            "parallelism.enable_sequence_parallel=True is not supported for attnres models: the residual "
            "stream stays whole on every tensor-parallel rank; pass --parallelism.no-enable-sequence-parallel"
        )
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelism.spmd_backend={parallelism.spmd_backend!r} is not supported for attnres models with "
            "tensor parallelism: their plan is DTensor's parallelize_module; pass "
            "--parallelism.spmd_backend partial_dtensor"
        )


def apply_tensor_parallel(model: AttnResLM, tp_mesh) -> None:
    """Shard every block's projections over ``tp_mesh`` (the plan in the module docstring); the
    modules keep their names, and their inputs and outputs stay plain, replicated tensors."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = BACKBONES[model.config.backbone].tensor_plan.block
    for block in model.blocks.children():
        parallelize_module(block, tp_mesh, {name: styles[style]() for name, style in plan.items()})


def replicate_on_tp_mesh(model: AttnResLM, tp_mesh) -> None:
    """Make every parameter the plan does not shard a Replicate DTensor on ``tp_mesh``, so that
    (after FSDP2) all parameters are DTensors of one mesh, as torchtitan's gradient clipping needs.
    The modules still compute on plain tensors: :func:`compute_on_local_views` hands them local views."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = DTensor.from_local(param.data, tp_mesh, [Replicate()], run_check=False)
                module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _local_views(modules: list[nn.Module]):
    """A forward pre-hook: each tp-replicated parameter of ``modules`` is shadowed, for attribute
    access only, by its local tensor (``module.__dict__`` comes before ``_parameters`` in lookup),
    so norms, the embedding, the head and the residual scheme's (fused) ops see plain tensors, while
    ``parameters()``, the state dict and the optimizer keep the DTensor. The view is taken after
    FSDP2's own pre-forward hook (registered first) has put the unsharded parameter in place, and
    stays until the next forward, so activation checkpointing's recomputation in backward reads it
    too; its gradient comes back as a Replicate DTensor (the same on every tensor-parallel rank:
    each rank computes the whole stream)."""

    def hook(*_: Any) -> None:
        for module in modules:
            # typed as Tensor: torch's stub types the values as Parameter, which mypy takes as
            # disjoint from DTensor, while FSDP2 + TP's unsharded parameters are both
            params: dict[str, torch.Tensor | None] = dict(module._parameters)
            for name, param in params.items():
                if isinstance(param, DTensor) and param.placements == (Replicate(),):
                    module.__dict__[name] = param.to_local(grad_placements=(Replicate(),))

    return hook


def compute_on_local_views(model: AttnResLM) -> None:
    """After FSDP2: a forward pre-hook per FSDP unit (each block, and the root for everything outside
    the blocks) that installs the local views of :func:`_local_views`."""
    blocks = list(model.blocks.children())
    inside = {id(m) for block in blocks for m in block.modules()}
    for block in blocks:
        block.register_forward_pre_hook(_local_views(list(block.modules())))
    model.register_forward_pre_hook(_local_views([m for m in model.modules() if id(m) not in inside]))


def apply_fsdp(model: AttnResLM, dp_mesh, *, param_dtype, reduce_dtype, reshard_after_forward: bool) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.blocks.children())
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by backward: keep them gathered
        fully_shard(
            block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """torchtitan's ``parallelism.fsdp_reshard_after_forward``: "default" reshards unless pipelining."""
    if policy not in ("default", "always", "never"):
        raise ValueError(f"parallelism.fsdp_reshard_after_forward={policy!r} is invalid: use default, always or never")
    return policy == "always" or (policy == "default" and not pp_enabled)


def parallelize_attnres(
    model: AttnResLM,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str = "",
) -> AttnResLM:
    """torchtitan's ``parallelize_fn`` for attnres models (the order and the choices are in the
    module docstring); returns the model, parallelized in place."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if parallel_dims.pp_enabled or parallel_dims.cp_enabled:
        raise ValueError(
            "attnres' torchtitan spec has no pipeline or context parallelism; use FSDP here, or "
            "attnres train --pp for pipeline parallelism"
        )
    if parallel_dims.tp_enabled:
        check_tensor_parallel(model.config, parallelism)
        apply_tensor_parallel(model, parallel_dims.get_mesh("tp"))
        replicate_on_tp_mesh(model, parallel_dims.get_mesh("tp"))
    if ac_config is not None:
        if not isinstance(ac_config, (FullAC.Config, SelectiveAC.Config)):
            raise ValueError(
                f"activation_checkpoint={type(ac_config).__qualname__} is not supported for attnres models: "
                "use full or selective (both run attnres' depth-block checkpointing) or none"
            )
        model.set_activation_checkpointing("block")
    if compile_config.enable and "model" in compile_config.components:
        compile_model(model, compile_config.backend, granularity="sublayer")
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp(
        model,
        parallel_dims.get_mesh(names),
        param_dtype=_DTYPES[training.mixed_precision_param],
        reduce_dtype=_DTYPES[training.mixed_precision_reduce],
        reshard_after_forward=_reshard_after_forward(parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled),
    )
    if parallel_dims.tp_enabled:
        compute_on_local_views(model)
    return model


def post_optimizer_build(optimizers, model_parts: list, parallel_dims) -> None:
    """torchtitan's ``post_optimizer_build_fn``: after every optimizer step, the model's per-step
    updates (``AttnResLM.end_step``: Kimi Linear's aux-loss-free router-bias balancing), from the
    expert loads summed over the data-parallel ranks, as ``attnres train`` does. Nothing for models
    without step counters (dense blocks)."""
    import torch.distributed as dist

    models = [m for m in model_parts if m.step_counters()]
    if not models:
        return
    group = parallel_dims.get_mesh("batch").get_group() if parallel_dims.dp_enabled else None

    def end_step(*args, **kwargs) -> None:
        for model in models:
            if group is not None:
                for counter in model.step_counters():
                    dist.all_reduce(counter, group=group)
            model.end_step()

    optimizers.register_step_post_hook(end_step)


def no_decay_names(config: ModelConfig) -> list[str]:
    """The parameter names ``attnres.param_groups`` keeps out of weight decay for a model of ``config``:
    every residual-scheme parameter, norms and other vectors (``AttnResLM.param_kinds`` "no_decay"),
    from a copy built on the meta device (no memory, no initialisation)."""
    with torch.device("meta"):
        model = AttnResLM(config)
    return sorted(name for name, kind in model.param_kinds().items() if kind == "no_decay")


def adamw_param_groups(config: ModelConfig, *, lr: float, weight_decay: float, **adamw: Any) -> list:
    """torchtitan ``ParamGroupConfig`` s for AdamW over a model of ``config``: the no-decay names
    (:func:`no_decay_names`) with weight decay 0 first (torchtitan assigns each parameter to the first
    pattern that matches it), then every other parameter with ``weight_decay``."""
    from torchtitan.components.optimizer import ParamGroupConfig

    names = no_decay_names(config)
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, **adamw}
    return [
        ParamGroupConfig(
            pattern="^(?:" + "|".join(re.escape(n) for n in names) + ")$",
            optimizer_name="AdamW",
            optimizer_kwargs={**kwargs, "weight_decay": 0.0},
        ),
        ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={**kwargs, "weight_decay": weight_decay}
        ),
    ]
