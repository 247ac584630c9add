"""Optimizer and model state keyed by parameter name, so checkpoints move between layouts.

A checkpoint always holds the single-process format; parallel runs gather their
pieces into it (rank 0 writes) and every rank takes its own pieces back out on
resume. That is what lets a run resume with another ``--dp`` / ``--pp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

NamedOptimizerState = dict[str, dict[str, dict[str, object]]]  # optimizer key -> param name -> state


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch.compile / DistributedDataParallel wrappers: the one whose parameter
    names and ``param_kinds()`` checkpoints and optimizers use."""
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def full_tensor(t):
    """A DTensor's global value (collective: every rank of its mesh must call); other values as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_shard(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank (sharing its storage); other tensors as they are."""
    return t.to_local() if hasattr(t, "to_local") else t


def named_optimizer_state(optimizer) -> NamedOptimizerState:
    """The per-parameter state of a CombinedOptimizer, keyed by parameter name (DTensors gathered)."""
    out: NamedOptimizerState = {}
    for key, opt in optimizer.optimizers.items():
        sd = opt.state_dict()
        by_name = {}
        for group in sd["param_groups"]:
            for idx, name in zip(group["params"], group["param_names"], strict=True):
                if idx in sd["state"]:
                    by_name[name] = {k: full_tensor(v) for k, v in sd["state"][idx].items()}
        out[key] = by_name
    return out


def load_named_optimizer_state(optimizer, named: NamedOptimizerState, model: nn.Module) -> None:
    """Load the entries of ``named`` that belong to ``optimizer``'s parameters; a value shaped like a
    sharded (DTensor) parameter is sharded the same way."""
    params = dict(model.named_parameters())
    for key, opt in optimizer.optimizers.items():
        sd = opt.state_dict()
        state = {}
        for group in sd["param_groups"]:
            for idx, name in zip(group["params"], group["param_names"], strict=True):
                saved = named.get(key, {}).get(name)
                if saved is not None:
                    state[idx] = {k: _like_param(v, params[name]) for k, v in saved.items()}
        sd["state"] = state
        opt.load_state_dict(sd)


def _dtensor(t: Tensor) -> DTensor | None:
    """``t`` if it is a DTensor (an FSDP2 shard), else None. torch.distributed.tensor is imported only
    for a tensor with a device mesh."""
    if not hasattr(t, "device_mesh"):
        return None
    from torch.distributed.tensor import DTensor

    return t if isinstance(t, DTensor) else None


def _like_param(value, param: Tensor):
    """``value`` sharded as ``param`` is when that is a DTensor of the same shape, else ``value``."""
    shard = _dtensor(param)
    if shard is None or not isinstance(value, Tensor) or value.shape != shard.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(shard.device_mesh.device_type), shard.device_mesh, shard.placements)


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """state_dict with DTensors gathered (collective under FSDP2), on CPU."""
    return {k: full_tensor(v).detach().cpu() for k, v in model.state_dict().items()}


@torch.no_grad()
def load_full_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy the entries of a full state dict into ``model``'s parameters and buffers (which may be a
    pipeline rank's subset or FSDP2-sharded); every entry of ``model`` must be present."""
    for name, t in model.state_dict().items():
        if name not in state:
            raise KeyError(f"checkpoint lacks {name}")
        shard = _dtensor(t)
        if shard is not None:
            shard.to_local().copy_(_like_param(state[name], shard).to_local())
        else:
            t.copy_(state[name])
