"""``AttnResTitanModel``: ``AttnResLM`` as a torchtitan model (``torchtitan.protocols.BaseModel``).

The class *is* an ``AttnResLM`` (same modules, same parameter names, same forward), so its state
dict is an attnres checkpoint's and ``param_kinds`` / ``attnres.param_groups`` apply unchanged. What
torchtitan adds around a model, and how this class answers it:

- it is built from a ``Config`` (``BaseModel.Config``: keyword-only, slotted dataclass) that holds
  the attnres ``ModelConfig`` as ``lm``;
- torchtitan builds it on the meta device, parallelizes it, moves it with ``to_empty`` and then
  calls ``init_weights``: :meth:`init_states` re-runs attnres' initialisation in place (the LM's
  rule, the residual scheme's own initial values, the rotary tables), on sharded parameters too;
- ``verify_module_protocol``: torchtitan wants every submodule to be one of its ``Module``
  configurables; ours are plain ``nn.Module`` s (the override torchtitan documents for that case).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.model import BaseModel

from attnres.integrations.torchtitan.parallelize import check_tensor_parallel
from attnres.model.config import ModelConfig
from attnres.model.llama import rope_tables
from attnres.model.lm import AttnResLM
from attnres.residual import build_residual


def _copy_into(target: Tensor, value: Tensor) -> None:
    """``target.copy_(value)`` where ``target`` may be a DTensor (FSDP2- or TP-sharded) and
    ``value`` the full tensor: each rank keeps its own shard of it."""
    value = value.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        value = distribute_tensor(value, target.device_mesh, target.placements)
    target.copy_(value)


class AttnResTitanModel(AttnResLM, BaseModel):
    """An ``AttnResLM`` (any backbone, any residual scheme) that torchtitan's Trainer can build,
    parallelize, initialise and train. ``forward(tokens)`` returns logits [B, T, V]."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        lm: ModelConfig = field(default_factory=ModelConfig)
        """The attnres model: backbone, sizes, residual scheme and its options."""

        def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
            """Read what the Trainer's config decides about the model: the rotary tables must cover
            ``training.seq_len``; and refuse parallelisms this model does not run under the Trainer,
            and tensor-parallel layouts its plan cannot shard (``check_tensor_parallel``), before
            anything is built."""
            seq_len = config.training.seq_len
            if seq_len > self.lm.max_seq_len:
                self.lm = dataclasses.replace(self.lm, max_seq_len=seq_len)
            parallelism = config.parallelism
            for name, degree in (
                ("context_parallel_degree", parallelism.context_parallel_degree),
                ("expert_parallel_degree", parallelism.expert_parallel_degree),
            ):
                if degree > 1:
                    raise ValueError(
                        f"parallelism.{name}={degree} is not supported for attnres models: the depth "
                        "attention reads every token's whole depth history on one rank; use data, "
                        "FSDP (or attnres train --pp / --tp for pipeline and tensor parallelism)"
                    )
            check_tensor_parallel(self.lm, parallelism)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            """(parameter count, training FLOPs per token): 6 per non-embedding parameter (forward and
            backward of every matrix) plus causal attention's 12 * layers * heads * head_dim * seq_len
            (torchtitan's estimate for its decoders, so MFU compares like with like). The depth
            attention adds about 6 * (sources read) * D per sublayer, under 1% at these widths, and is
            left out as torchtitan leaves out norms."""
            nparams = sum(p.numel() for p in model.parameters())
            embedding = self.lm.vocab_size * self.lm.d_model
            attention = 12 * self.lm.n_layers * self.lm.n_heads * self.lm.head_dim * seq_len
            return nparams, 6 * (nparams - embedding) + attention

    def __init__(self, config: Config):
        AttnResLM.__init__(self, config.lm)

    def forward(self, tokens: Tensor, positions: Tensor | None = None, **kwargs: Any) -> Tensor:  # type: ignore[override]  # torchtitan calls model(tokens, **extra)
        """tokens [B, T] -> logits [B, T, V].

        torchtitan passes the batch's extra fields as keyword arguments. ``positions`` (its text
        loaders' positions restarting at each packed document) is accepted and not used: an attnres
        model reads the window as one sequence, positions 0..T-1 and causal attention across the
        documents in it, as ``attnres train`` trains on windows of its corpus. Anything else
        (``attention_masks`` of document-masked attention) is refused rather than silently ignored."""
        extra = {k: v for k, v in kwargs.items() if v is not None}
        if extra:
            raise ValueError(
                f"AttnResTitanModel.forward got {sorted(extra)}: attnres models attend causally over the "
                "whole window (no document masks); use a dataloader and attention without them"
            )
        return AttnResLM.forward(self, tokens)

    def verify_module_protocol(self) -> None:
        """Every submodule is a plain ``nn.Module`` here (attnres' own), not a torchtitan ``Module``:
        nothing of torchtitan's per-module protocol (sharding configs, per-parameter init tables) is
        used, so there is nothing to verify."""

    @torch.no_grad()
    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """attnres' initialisation, in place, after torchtitan's ``to_empty``: the LM's rule
        (``AttnResLM.reset_parameters``), the residual scheme's own initial values (a fresh scheme
        built on the CPU: zero pseudo-queries, unit key norms, ...), copied into the possibly sharded
        parameters, and the rotary tables."""
        self.reset_parameters()
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            fresh = build_residual(self.config)
        fresh_state = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
        for name, tensor in list(self.residual.named_parameters()) + list(self.residual.named_buffers()):
            _copy_into(tensor, fresh_state[name])
        cos, sin = rope_tables(self.config.rope_dim, self.config.max_seq_len, self.config.rope_theta)
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
