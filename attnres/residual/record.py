"""The settings a residual scheme saves beside its weights, so that they are never loaded into another one.

Two schemes can hold parameters of the same names and shapes and compute different functions: Block
AttnRes with N = 2 or N = 4 depth blocks, Full AttnRes, 4 query heads or 1. A state dict of one would
load into the other with ``strict=True`` and without a word. So every scheme's state dict carries a
record of what defines its function (``ResidualScheme.settings()``: the kind, the block geometry, the
heads, kernel, routing, eps ...; not ``attnres_impl`` or ``attnres_group_size``, which choose only how
it is computed), and loading it into a scheme with other settings is one ``ValueError`` naming both.
The record is the scheme's ``get_extra_state()``: a small uint8 tensor holding JSON, because a state dict
travels through safetensors (attnres checkpoints, ``save_pretrained``), which stores tensors only.

Two settings are restored rather than compared: the scheme's own ``eps`` (the key norm's, the rivals'
norms'), and the pre-norm eps ``attnres.match_prenorm_eps`` set on the model's norms (the record keeps
their base eps; the scheme that was matched knows its norms and sets them again). A state dict saved
before schemes kept a record loads as it always did, with the model's own settings.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class ResidualScheme(Protocol):
    """What this module reads of a scheme (``attnres.residual.base.ResidualScheme``, which imports this
    module to save and check its record: naming the class here would make the two import each other)."""

    scheme_name: str

    def settings(self) -> dict[str, Any]: ...

    def prenorm_read_scale(self, l: int) -> float | None: ...


RECORD_VERSION = 1
RECORD_KEY = "_extra_state"  # torch's name for a module's get_extra_state() in its state dict
MATCHED_NORMS = "_attnres_matched_norms"  # on a scheme: [(norm, eps attribute)] from match_prenorm_eps
BASE_EPS = "_attnres_base_eps"  # on a norm: its eps before match_prenorm_eps (attnres.residual.norms)
_RESTORED = {"norm_eps": "eps"}  # settings a load sets on the scheme (setting -> attribute) instead of comparing
# Full AttnRes is Block AttnRes with one sublayer per block: equal settings compute the same function
_SAME_FAMILY = {"full": "depth_attention", "block": "depth_attention"}


class SchemeMismatch(ValueError):
    """A state dict's residual scheme settings differ from those of the scheme it is loaded into."""


def record_of(scheme: ResidualScheme) -> dict[str, Any]:
    """The record ``scheme`` saves: its kind, its settings and the base eps of the norms it matched."""
    matched = getattr(scheme, MATCHED_NORMS, None)
    record = {
        "version": RECORD_VERSION,
        "residual": scheme.scheme_name,
        "settings": scheme.settings(),
        "prenorm_base_eps": None if matched is None else [float(getattr(n, BASE_EPS)) for n, _ in matched],
    }
    return json.loads(json.dumps(record, allow_nan=False))  # as a load reads it back: lists, not tuples


def encode(record: dict[str, Any]) -> Tensor:
    """The record as a 1-D uint8 tensor of its JSON (on the CPU whatever the default device: the record is
    never computed with)."""
    data = json.dumps(record, sort_keys=True, allow_nan=False).encode()
    return torch.tensor(list(data), dtype=torch.uint8, device="cpu")


def decode(state: Any, where: str = "the state dict") -> dict[str, Any]:
    """The record held by ``state`` (what ``encode`` wrote; a loader may have cast it to a float dtype)."""
    problem = None
    if not isinstance(state, Tensor) or state.dim() != 1:
        problem = f"expected a 1-D tensor of bytes, got {type(state).__name__}"
    else:
        values = state.detach().to("cpu", torch.float64)
        if values.numel() and (values.min() < 0 or values.max() > 255 or not torch.equal(values, values.round())):
            problem = "its values are not bytes"
        else:
            try:
                record = json.loads(bytes(values.to(torch.uint8).tolist()).decode())
            except (UnicodeDecodeError, ValueError) as e:
                record, problem = None, f"not JSON ({e})"
            if problem is None and not (isinstance(record, dict) and isinstance(record.get("settings"), dict)):
                problem = "it has no settings"
    if problem is None and record.get("version") != RECORD_VERSION:
        problem = (
            f"record version {record.get('version')!r}, this attnres reads version {RECORD_VERSION}; load it with "
            "the attnres version that wrote it"
        )
    if problem is not None:
        raise SchemeMismatch(f"the residual scheme record in {where} cannot be read: {problem}")
    return record


def _show(value: Any) -> str:
    if isinstance(value, list) and len(value) > 4 and len(set(map(repr, value))) == 1:
        return f"[{value[0]!r}] * {len(value)}"  # Full AttnRes' L blocks of one sublayer
    return repr(value)


def _describe(record: dict[str, Any], names: list[str]) -> str:
    settings = record["settings"]
    shown = ", ".join(f"{n}={_show(settings[n])}" for n in names if n in settings)
    return f"{record['residual']} ({shown})" if shown else str(record["residual"])


# settings Full and Block AttnRes record since after records existed: a record of theirs without one was
# written with its default
_LATER_DEFAULTS = {"attnres_gain": "per_channel"}


def _with_defaults(record: dict[str, Any]) -> dict[str, Any]:
    if _SAME_FAMILY.get(record["residual"]) != "depth_attention":
        return record
    return {**record, "settings": {**_LATER_DEFAULTS, **record["settings"]}}


def mismatch(scheme: ResidualScheme, saved: dict[str, Any]) -> str | None:
    """One line naming both settings where the ``saved`` record and ``scheme`` compute different functions
    (eps aside: a load restores it); None where they agree."""
    own, saved = record_of(scheme), _with_defaults(saved)
    kinds = [_SAME_FAMILY.get(r["residual"], r["residual"]) for r in (saved, own)]
    a, b = saved["settings"], own["settings"]
    differ = sorted(n for n in set(a) | set(b) if n not in _RESTORED and a.get(n, "<absent>") != b.get(n, "<absent>"))
    fix = "build this model's scheme with the checkpoint's settings"
    if kinds[0] != kinds[1] or differ:
        names = [] if kinds[0] != kinds[1] else differ
        return (
            f"residual scheme mismatch: the checkpoint has {_describe(saved, names)}, this model has "
            f"{_describe(own, names)}; {fix}"
        )
    base, matched = saved.get("prenorm_base_eps"), own["prenorm_base_eps"]
    if (base is None) != (matched is None) or (base is not None and len(base) != len(matched)):

        def say(eps):
            return "not matched" if eps is None else f"matched on {len(eps)} norms"

        fix = (
            "build this model without match_prenorm_eps, as the checkpoint's was"
            if base is None
            else f"call attnres.match_prenorm_eps on this model's {len(base)} norms before loading, as the "
            "checkpoint's model did"
        )
        return (
            f"residual scheme mismatch: the checkpoint's pre-norm eps were {say(base)} by attnres.match_prenorm_eps, "
            f"this model's are {say(matched)}; {fix}"
        )
    return None


def restore(scheme: ResidualScheme, saved: dict[str, Any]) -> None:
    """Set what the record restores: the scheme's eps and its matched norms' eps (``mismatch`` passed)."""
    for name, attribute in _RESTORED.items():
        if name in saved["settings"] and hasattr(scheme, attribute):
            setattr(scheme, attribute, saved["settings"][name])
    matched = getattr(scheme, MATCHED_NORMS, None)
    base = saved.get("prenorm_base_eps")
    if matched is None or base is None:
        return
    for l, ((norm, attribute), eps) in enumerate(zip(matched, base, strict=True)):
        c = scheme.prenorm_read_scale(l)  # match_prenorm_eps' factor c_l² (attnres.residual.norms)
        setattr(norm, BASE_EPS, float(eps))
        setattr(norm, attribute, float(eps) * (1.0 if c is None else float(c) ** 2))


def remember_matched_norms(scheme: ResidualScheme, norms: list[tuple[nn.Module, str]]) -> None:
    """What ``match_prenorm_eps`` tells the scheme: the norms it set (and their eps attribute), whose base
    eps the scheme's record saves and a load restores. Kept outside the module tree (a plain list), so
    the norms stay where the model registered them."""
    setattr(scheme, MATCHED_NORMS, list(norms))
