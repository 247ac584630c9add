"""Optimizer construction: AdamW, or Muon for hidden matrices + AdamW for the rest.

The model tells us how to treat each parameter through ``model.param_kinds()``,
which maps every name in ``model.named_parameters()`` to one of
:data:`PARAM_KINDS`:

``"matrix"``     2-D hidden weight matrices inside the Transformer blocks, and 3-D
                 stacks of independent matrices [n, rows, cols] (MoE expert weights).
                 Weight-decayed; optimized by Muon when ``name="muon"`` (each matrix of
                 a stack on its own: :class:`StackedMuon`).
``"embedding"``  token embedding. Weight-decayed, always AdamW.
``"head"``       LM head (absent when tied to the embedding). Weight-decayed, AdamW.
``"no_decay"``   norm weights, AttnRes pseudo-queries, key-norm weights, scalars
                 and residual-scheme parameters. Never decayed, always AdamW.

:func:`build_optimizer` always returns a :class:`CombinedOptimizer` (even for
plain AdamW) so that the trainer, the LR schedule and checkpoints see one
uniform object and one ``state_dict`` layout.

Muon configuration
------------------
``torch.optim.Muon`` (torch >= 2.9) orthogonalizes the momentum with 5
Newton-Schulz iterations and then scales the step by a shape-dependent factor
chosen with ``adjust_lr_fn``:

* ``"match_rms_adamw"`` (our default, from Moonshot's "Muon is Scalable for LLM
  Training"): step size ``0.2 * lr * sqrt(max(rows, cols))``, which makes the
  update RMS match a typical AdamW update. With it Muon can reuse AdamW's
  learning rate and weight decay, so ``muon_lr`` defaults to ``lr`` and
  ``muon_weight_decay`` to ``weight_decay``.
* ``"original"`` (Keller Jordan's recipe, torch's default): step size
  ``lr * sqrt(max(1, rows / cols))``. Muon then wants its own, much larger
  learning rate (about 0.02) -- pass ``muon_lr`` -- and, because Muon's
  decoupled decay multiplies weights by ``1 - lr * weight_decay`` with the
  *unadjusted* lr, a correspondingly smaller ``muon_weight_decay``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from attnres.parallel.state import unwrap
from attnres.residual.param_groups import PARAM_KINDS, lr_scales, parameter_kinds

__all__ = ["PARAM_KINDS", "OPTIMIZER_NAMES", "CombinedOptimizer", "StackedMuon", "build_optimizer", "group_parameters"]

OPTIMIZER_NAMES = ("adamw", "muon")
MUON_ADJUST_LR_FNS = ("match_rms_adamw", "original")

_STATE_FORMAT = "attnres.CombinedOptimizer/1"


def group_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split the trainable parameters of ``model`` by kind: ``model.param_kinds()`` (validated) where the
    model has it, else the generic rule of ``attnres.param_groups`` (``parameter_kinds``), for any module.

    Returns ``{kind: [(name, param), ...]}`` for every kind in :data:`PARAM_KINDS`
    (possibly empty lists), in ``named_parameters()`` order. Frozen parameters
    (``requires_grad=False``) are left out. Raises ``ValueError`` when
    ``param_kinds()`` misses a parameter, names one that does not exist, uses an
    unknown kind, or marks a non-2-D tensor as ``"matrix"``.
    """
    base = unwrap(model)
    param_kinds = getattr(base, "param_kinds", None)  # a model's own grouping, else the default rule
    kinds = dict(param_kinds()) if callable(param_kinds) else parameter_kinds(base)
    named = list(base.named_parameters())
    names = {n for n, _ in named}

    problems = []
    missing = [n for n, _ in named if n not in kinds]
    if missing:
        problems.append(f"parameters missing from param_kinds(): {missing}")
    invented = [n for n in kinds if n not in names]
    if invented:
        # A name can be absent from named_parameters() because it is a tied alias.
        aliases = {}
        seen: dict[int, str] = {}
        for n, p in base.named_parameters(remove_duplicate=False):
            if id(p) in seen and n != seen[id(p)]:
                aliases[n] = seen[id(p)]
            seen.setdefault(id(p), n)
        details = [f"{n} (tied to {aliases[n]}; list a shared parameter once)" if n in aliases else n for n in invented]
        problems.append(f"param_kinds() names parameters the model does not have: {details}")
    bad_kind = {n: k for n, k in kinds.items() if k not in PARAM_KINDS}
    if bad_kind:
        problems.append(f"unknown kinds {bad_kind}; allowed kinds are {list(PARAM_KINDS)}")
    if problems:
        raise ValueError(
            f"{type(base).__name__}.param_kinds() does not match named_parameters(): " + "; ".join(problems)
        )

    groups: dict[str, list[tuple[str, nn.Parameter]]] = {k: [] for k in PARAM_KINDS}
    for n, p in named:
        if not p.requires_grad:
            continue
        if kinds[n] == "matrix" and p.ndim not in (2, 3):
            raise ValueError(
                f"parameter {n} is marked 'matrix' but has shape {tuple(p.shape)}; only 2-D hidden weight "
                "matrices (or 3-D stacks of them) may be 'matrix'; use 'no_decay' or another kind"
            )
        groups[kinds[n]].append((n, p))
    return groups


class StackedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` that also takes 3-D parameters holding a stack of independent matrices
    [n, rows, cols] (MoE expert weights): each matrix is one Muon parameter, with its own
    orthogonalisation and shape-adjusted learning rate, exactly as if it were a separate 2-D tensor.
    Momentum buffers keep the stack's shape. On 2-D parameters it is torch's Muon unchanged: the
    update is torch's own (``torch.optim._muon.muon``), fed the matrices as views."""

    def __init__(self, params, **kwargs):
        # torch validates the hyperparameters (and rejects 3-D tensors): let it do the former on a stand-in
        defaults = torch.optim.Muon([torch.zeros(1, 1, requires_grad=True)], **kwargs).defaults
        torch.optim.Optimizer.__init__(self, params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes matrices or stacks of them; got a parameter of size {p.size()}")

    def _init_group(self, group, params_with_grad, grads, muon_momentum_bufs):
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        for tensors in (params_with_grad, grads, muon_momentum_bufs):
            tensors[:] = [m for t in tensors for m in _matrices(t)]
        return has_complex


def _matrices(t: torch.Tensor) -> tuple:
    """The independent matrices of a parameter (or its gradient / momentum), as views that share its
    storage. FSDP2 shards dimension 0, which for a stack is the expert dimension: each rank holds whole
    matrices, so its local shard is unbound (the update needs no communication)."""
    if t.ndim != 3:
        return (t,)
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(t, DTensor):
        if any(not (p.is_replicate() or p == Shard(0)) for p in t.placements):
            raise ValueError(
                f"StackedMuon: a stack of matrices sharded as {t.placements} splits its matrices; "
                "shard the stack on dimension 0 (whole matrices per rank)"
            )
        t = t.to_local()
    return t.unbind(0)


class CombinedOptimizer:
    """Several torch optimizers driven as one (e.g. Muon for matrices + AdamW for the rest).

    ``param_groups`` is the concatenation of every inner optimizer's groups (the
    same dict objects, so writing ``group["lr"]`` changes the inner optimizer).
    Each group carries ``initial_lr`` (the base learning rate the schedule scales)
    and a ``name`` (``"matrix"``, ``"decay"`` or ``"no_decay"``).
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        merged: dict = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        # Only plain containers, tensors, numbers and strings: loadable with
        # torch.load(weights_only=True).
        return {"format": _STATE_FORMAT, "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or state_dict.get("format") != _STATE_FORMAT:
            got = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict)
            raise ValueError(f"not a CombinedOptimizer state_dict (expected format {_STATE_FORMAT!r}, got {got!r})")
        saved = state_dict["optimizers"]
        if set(saved) != set(self.optimizers):
            raise ValueError(
                f"optimizer state holds optimizers {sorted(saved)} but this optimizer has "
                f"{sorted(self.optimizers)}; resume with the same optimizer name (adamw / muon)"
            )
        # torch does not check parameter names; do it so a reordered or changed
        # model cannot silently receive another parameter's moments.
        for key, opt in self.optimizers.items():
            s_groups, c_groups = saved[key]["param_groups"], opt.param_groups
            if len(s_groups) != len(c_groups):
                raise ValueError(
                    f"{key}: saved state has {len(s_groups)} parameter groups, this optimizer has {len(c_groups)}"
                )
            for i, (sg, cg) in enumerate(zip(s_groups, c_groups, strict=True)):
                if "param_names" in sg and "param_names" in cg and list(sg["param_names"]) != list(cg["param_names"]):
                    only_saved = sorted(set(sg["param_names"]) - set(cg["param_names"]))
                    only_here = sorted(set(cg["param_names"]) - set(sg["param_names"]))
                    raise ValueError(
                        f"{key} group {i} ({cg.get('name')}): parameter names differ from the saved state "
                        f"(only in saved: {only_saved}; only in model: {only_here}; or a different order)"
                    )
        for key, opt in self.optimizers.items():
            opt.load_state_dict(saved[key])

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={type(o).__name__}({len(o.param_groups)} groups)" for k, o in self.optimizers.items())
        return f"CombinedOptimizer({inner})"


def _mixes_dtensors(groups: dict[str, list[tuple[str, nn.Parameter]]]) -> bool:
    """Whether some parameters are DTensors (sharded by tensor parallelism) and others plain tensors."""
    sharded = {hasattr(p, "device_mesh") for ps in groups.values() for _, p in ps}
    return len(sharded) == 2


def _named_group(name: str, params: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> dict:
    return {"params": list(params), "name": name, "lr": lr, "initial_lr": lr, "weight_decay": weight_decay}


def _scaled_groups(
    name: str, params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float, scales: dict[str, float]
) -> list[dict]:
    """``_named_group``, with the parameters a scheme gives a learning-rate multiplier (``lr_scales``:
    additive routing's gain) in a group of their own at ``lr * scale``."""
    out = []
    for scale in [1.0] + sorted({scales[n] for n, _ in params if n in scales}):
        part = [(n, p) for n, p in params if scales.get(n, 1.0) == scale]
        if part:
            out.append(_named_group(name if scale == 1.0 else f"{name}@lr*{scale:g}", part, lr * scale, weight_decay))
    return out


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    muon_lr: float | None = None,
    muon_momentum: float = 0.95,
    eps: float = 1e-8,
    *,
    muon_weight_decay: float | None = None,
    muon_adjust_lr_fn: str = "match_rms_adamw",
    muon_nesterov: bool = True,
    muon_ns_steps: int = 5,
    fused: bool | None = None,
) -> CombinedOptimizer:
    """Build the optimizer for ``model`` (see the module docstring for the grouping).

    ``name="adamw"``: one AdamW with a ``decay`` group (matrix, embedding, head)
    and a ``no_decay`` group (weight decay 0).

    ``name="muon"``: ``torch.optim.Muon`` (:class:`StackedMuon`) over the ``matrix`` parameters
    (lr ``muon_lr`` or ``lr``; weight decay ``muon_weight_decay`` or
    ``weight_decay``; ``adjust_lr_fn=muon_adjust_lr_fn``) plus AdamW over
    embedding/head (decayed) and no_decay parameters.

    ``fused`` is passed to AdamW (None lets torch choose).
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer name {name!r}; allowed: {list(OPTIMIZER_NAMES)}")
    for label, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if not (isinstance(value, (int, float)) and value >= 0):
            raise ValueError(f"{label} must be a non-negative number, got {value!r}")
    groups = group_parameters(model)
    if not any(groups.values()):
        raise ValueError("the model has no trainable parameters")
    scales = lr_scales(unwrap(model))

    adamw_kwargs: dict[str, Any] = {"lr": lr, "betas": tuple(betas), "eps": eps}
    if fused is not None:
        adamw_kwargs["fused"] = fused
    elif _mixes_dtensors(groups):  # tensor parallel: torch's foreach kernels refuse DTensors beside tensors
        adamw_kwargs["foreach"] = False

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if name == "adamw":
        decay = groups["matrix"] + groups["embedding"] + groups["head"]
        pg = [
            g
            for n, ps, wd in (("decay", decay, weight_decay), ("no_decay", groups["no_decay"], 0.0))
            for g in _scaled_groups(n, ps, lr, wd, scales)
        ]
        optimizers["adamw"] = torch.optim.AdamW(pg, **adamw_kwargs)
        return CombinedOptimizer(optimizers)

    if muon_adjust_lr_fn not in MUON_ADJUST_LR_FNS:
        raise ValueError(f"unknown muon_adjust_lr_fn {muon_adjust_lr_fn!r}; allowed: {list(MUON_ADJUST_LR_FNS)}")
    m_lr = lr if muon_lr is None else muon_lr
    m_wd = weight_decay if muon_weight_decay is None else muon_weight_decay
    if groups["matrix"]:
        optimizers["muon"] = StackedMuon(
            [_named_group("matrix", groups["matrix"], m_lr, m_wd)],
            lr=m_lr,
            weight_decay=m_wd,
            momentum=muon_momentum,
            nesterov=muon_nesterov,
            ns_steps=muon_ns_steps,
            adjust_lr_fn=muon_adjust_lr_fn,
        )
    decay = groups["embedding"] + groups["head"]
    pg = [
        g
        for n, ps, wd in (("decay", decay, weight_decay), ("no_decay", groups["no_decay"], 0.0))
        for g in _scaled_groups(n, ps, lr, wd, scales)
    ]
    if pg:
        optimizers["adamw"] = torch.optim.AdamW(pg, **adamw_kwargs)
    return CombinedOptimizer(optimizers)
