"""Optimizer parameter groups for any model with AttnRes parts: which parameters Muon may take, which
get weight decay.

    groups = attnres.param_groups(model, weight_decay=0.1)
    muon = torch.optim.Muon([g for g in groups if g["optimizer"] == "muon"], lr=0.02)
    adamw = torch.optim.AdamW([g for g in groups if g["optimizer"] == "adamw"], lr=3e-4)

The rule (the one ``attnres.train.build_optimizer`` and ``AttnResLM`` use), for every parameter:

1. ``"no_decay"`` (AdamW, weight decay 0): every parameter of a residual scheme (an
   ``attnres.residual.ResidualScheme`` anywhere in the model: AttnRes pseudo-queries, key-norm
   weights, query projections, scalar mixes, gates), and every name a module's ``no_weight_decay()``
   returns (names relative to that module, as timm's convention has it; a module name covers its
   parameters).
2. ``"embedding"`` (AdamW, decayed): the weights of ``nn.Embedding`` modules.
3. ``"head"`` (AdamW, decayed): the output head's weight: ``head`` if given, else the module
   ``model.get_output_embeddings()`` returns (transformers' models), else the last ``nn.Linear`` whose
   weight has an embedding's shape [vocab, D]. A head tied to the embedding is the embedding's one
   parameter and counts once.
4. ``"matrix"`` (Muon, decayed): other 2-D weights with both sizes above 1 (hidden matrices), and
   stacks of independent matrices [n, rows, cols]: the names in ``matrix_stacks``, those a
   ``model.matrix_stacks()`` method returns, and the 3-D parameters of a module whose ``num_experts``
   equals their first size (transformers' mixture-of-experts weights). Muon orthogonalises each matrix
   of a stack on its own (torch's Muon takes 2-D parameters only: ``attnres.train.StackedMuon`` takes
   stacks).
5. ``"no_decay"``: everything else: norm weights, biases, scalars, vectors stored as [1, D] or [D, 1],
   convolution filters and other tensors of 3 or more dimensions.

Frozen parameters (``requires_grad=False``) are left out of the groups.

A scheme may ask for a learning-rate multiplier on some of its parameters (additive routing's gain with
``attnres_gain_lr``: its ``lr_scales()``); ``lr_scales(model)`` collects them, ``param_groups`` puts
them in groups of their own with an ``"lr_scale"`` key, and ``attnres.train.build_optimizer`` scales
those groups' rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from attnres.residual.base import ResidualScheme

PARAM_KINDS = ("matrix", "embedding", "head", "no_decay")
# kind -> (group name, optimizer, decayed)
_GROUPS = (
    ("matrix", "muon", True, ("matrix",)),
    ("decay", "adamw", True, ("embedding", "head")),
    ("no_decay", "adamw", False, ("no_decay",)),
)


def _names_under(model: nn.Module, prefix: str, module: nn.Module, names: Iterable[str]) -> set[str]:
    """Parameter names (relative to ``model``) that ``names`` (relative to ``module``) denote: a parameter
    name itself, or a submodule name standing for all of its parameters."""
    params = {n for n, _ in module.named_parameters()}
    out = set()
    for name in names:
        name = name.strip(".")
        matched = {n for n in params if n == name or n.startswith(name + ".")} if name else params
        out |= {prefix + n for n in matched}
    return out


def _head_modules(model: nn.Module, head) -> list[nn.Module]:
    if head is not None:
        heads = [head] if isinstance(head, nn.Module) else list(head)
        owned = {id(p) for p in model.parameters()}
        for h in heads:
            if not isinstance(h, nn.Module):
                raise TypeError(f"head must be a module or a sequence of modules; got {type(h).__name__}")
            weight = getattr(h, "weight", None)
            if not isinstance(weight, nn.Parameter) or id(weight) not in owned:
                # the model's real head would then pass for a hidden matrix and go to Muon
                why = "has no weight parameter" if not isinstance(weight, nn.Parameter) else "is not part of the model"
                raise ValueError(
                    f"head={type(h).__name__}(...) {why}: {type(model).__name__}'s parameters do not include its "
                    "weight; pass the model's own output head module (e.g. head=model.lm_head, the module "
                    "itself, not a copy or a new layer), or leave head out to find it by its shape"
                )
        return heads
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        out = get()
        if isinstance(out, nn.Module):
            return [out]
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Embedding)}
    candidates: list[nn.Module] = [
        m for m in model.modules() if isinstance(m, nn.Linear) and tuple(m.weight.shape) in shapes
    ]
    return candidates[-1:]


def _stack_names(model: nn.Module, matrix_stacks: Iterable[str] | None) -> set[str]:
    names = set(matrix_stacks or ())
    method = getattr(model, "matrix_stacks", None)
    if callable(method):
        names |= set(method())
    for prefix, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if isinstance(experts, int) and not isinstance(experts, bool):
            for n, p in module.named_parameters(recurse=False):
                if p.dim() == 3 and p.shape[0] == experts:
                    names.add(f"{prefix}.{n}" if prefix else n)
    return names


def parameter_kinds(
    model: nn.Module, *, matrix_stacks: Iterable[str] | None = None, head: nn.Module | Sequence[nn.Module] | None = None
) -> dict[str, str]:
    """Every name of ``model.named_parameters()`` (frozen ones too) -> its kind, one of
    :data:`PARAM_KINDS` (the rule in the module docstring)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    named = list(model.named_parameters())
    if not named:
        raise ValueError(
            f"{type(model).__name__} has no parameters: there is nothing to optimize "
            "(build the model, with its AttnRes scheme, before its optimizer)"
        )
    params = dict(named)
    ids = {id(p): n for n, p in named}

    no_decay: set[str] = set()
    for prefix, module in model.named_modules():
        prefix = prefix + "." if prefix else ""
        if isinstance(module, ResidualScheme):
            no_decay |= {prefix + n for n, _ in module.named_parameters()}
        method = getattr(module, "no_weight_decay", None)
        if callable(method):
            no_decay |= _names_under(model, prefix, module, method())
    no_decay &= set(params)  # tied aliases: one name per parameter

    stacks = _stack_names(model, matrix_stacks)
    unknown = sorted(stacks - set(params))
    if unknown:
        raise ValueError(
            f"matrix_stacks names parameters {type(model).__name__} does not have: {unknown} "
            "(give names as model.named_parameters() spells them)"
        )
    not_stacks = sorted(n for n in stacks if params[n].dim() != 3)
    if not_stacks:
        raise ValueError(
            "matrix_stacks must name 3-D stacks of matrices [n, rows, cols]; "
            + ", ".join(f"{n} has shape {tuple(params[n].shape)}" for n in not_stacks)
        )

    embeddings = {ids[id(m.weight)] for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) in ids}
    heads = {
        ids[id(m.weight)]
        for m in _head_modules(model, head)
        if isinstance(getattr(m, "weight", None), nn.Parameter) and id(m.weight) in ids
    }

    kinds = {}
    for name, p in named:
        if name in no_decay:
            kinds[name] = "no_decay"
        elif name in embeddings:
            kinds[name] = "embedding"
        elif name in heads:
            kinds[name] = "head"
        elif name in stacks or (p.dim() == 2 and min(p.shape) > 1):
            kinds[name] = "matrix"
        else:
            kinds[name] = "no_decay"
    return kinds


def lr_scales(model: nn.Module) -> dict[str, float]:
    """Parameter name (as ``model.named_parameters()`` spells it) -> its learning-rate multiplier, for the
    parameters whose residual scheme asks for one other than 1 (its ``lr_scales()``)."""
    out: dict[str, float] = {}
    for prefix, module in model.named_modules():
        method = getattr(module, "lr_scales", None)
        if isinstance(module, ResidualScheme) and callable(method):
            prefix = prefix + "." if prefix else ""
            out |= {prefix + n: float(scale) for n, scale in method().items()}
    return out


def param_groups(
    model: nn.Module,
    weight_decay: float = 0.1,
    *,
    matrix_stacks: Iterable[str] | None = None,
    head: nn.Module | Sequence[nn.Module] | None = None,
) -> list[dict[str, Any]]:
    """torch-style parameter groups for ``model`` (any ``nn.Module``: your own model, ``AttnResLM``,
    ``AttnResForCausalLM``), by the rule of the module docstring.

    Returns up to three groups (empty ones are left out), each a dict with ``"params"`` (the
    parameters), ``"names"`` (their names in ``model.named_parameters()``), ``"weight_decay"``,
    ``"optimizer"`` ("muon" or "adamw") and ``"kind"``:

    - ``"matrix"``: hidden matrices and stacks of them; ``optimizer="muon"``, decayed;
    - ``"decay"``: embeddings and the output head; ``optimizer="adamw"``, decayed;
    - ``"no_decay"``: AttnRes parameters, norms, biases, scalars; ``optimizer="adamw"``, weight decay 0.

    A parameter with a learning-rate multiplier (``lr_scales``) goes to a group of its own kind whose
    ``"kind"`` ends in ``@lr*<scale>`` and whose ``"lr_scale"`` key holds it (every other group's is 1): give
    that group ``lr * lr_scale``. Every trainable parameter is in exactly one group. Pass the "muon" groups
    to ``torch.optim.Muon`` (or, with stacks, ``attnres.train.StackedMuon``) and the "adamw" ones to
    ``torch.optim.AdamW``; for AdamW alone pass them all (the "matrix" group then is a decayed AdamW
    group). torch keeps the extra keys in ``optimizer.param_groups``.

    ``matrix_stacks``: names of further 3-D parameters that are stacks of matrices. ``head``: the
    output head module(s), when the rule above does not find it.
    """
    if (
        isinstance(weight_decay, bool)
        or not isinstance(weight_decay, (int, float))
        or not math.isfinite(weight_decay)
        or weight_decay < 0
    ):
        raise ValueError(
            f"weight_decay={weight_decay!r} is invalid: give a finite number >= 0 (0.1 is usual; "
            "0 turns weight decay off)"
        )
    kinds = parameter_kinds(model, matrix_stacks=matrix_stacks, head=head)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (all {len(kinds)} have "
            "requires_grad=False): unfreeze what should train"
        )
    scales = lr_scales(model)
    groups = []
    for group, optimizer, decayed, members in _GROUPS:
        chosen = [(n, p) for n, p in trainable if kinds[n] in members]
        for scale in [1.0] + sorted({scales[n] for n, _ in chosen if n in scales}):
            part = [(n, p) for n, p in chosen if scales.get(n, 1.0) == scale]
            if part:
                groups.append(
                    {
                        "params": [p for _, p in part],
                        "names": [n for n, _ in part],
                        "weight_decay": float(weight_decay) if decayed else 0.0,
                        "optimizer": optimizer,
                        "kind": group if scale == 1.0 else f"{group}@lr*{scale:g}",
                        "lr_scale": scale,
                    }
                )
    return groups
