"""Your pre-norms' eps, matched to what a residual scheme reads at init (docs/method.md §3).

Why. A zero-initialised AttnRes read is a uniform mixture: read l returns c_l · S_l, where S_l is
what the PreNorm residual stream would hold there (the embedding plus every earlier sublayer output)
and c_l = 1/K_l for a softmax over K_l sources (1/2 for the sigmoid kernel). Every consumer of a read
is a norm, and a norm is scale-invariant except for its eps:

    RMSNorm(c·x) with eps c²·ε  =  RMSNorm(x) with eps ε          (RMS(c·x)² = c²·RMS(x)²)
    LayerNorm(c·x) with eps c²·ε  =  LayerNorm(x) with eps ε      (the mean scales by c too)

So multiplying the eps of the norm that reads sublayer l by c_l² makes a freshly initialised AttnRes
model compute exactly the PreNorm model with the same weights, instead of the PreNorm model with each
eps grown by K_l². It is the own-model form of ``ModelConfig.attnres_scale_norm_eps``:

    scheme = attnres.FullAttnRes(d_model=256, n_sublayers=24)
    attnres.match_prenorm_eps([norm for block in blocks for norm in (block.ln_1, block.ln_2)] + [ln_f], scheme)

Call it once after building the model, before training or loading a checkpoint. It is idempotent:
the first call remembers each norm's own eps, and every call sets eps = that base eps · c_l², so
calling it again (with the same scheme) changes nothing. The scheme remembers the norms it matched:
its state dict saves their base eps, and loading it into a scheme matched the same way sets them
again, while loading it into a model whose norms were not matched (or the other way round) fails
(``attnres.residual.record``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from attnres.residual.base import ResidualScheme
from attnres.residual.record import (
    BASE_EPS as _BASE,  # the eps a norm had before the first call
)
from attnres.residual.record import remember_matched_norms


def _eps_attribute(norm: nn.Module, where: str) -> str:
    """Where ``norm`` keeps its eps: ``variance_epsilon`` (transformers' RMSNorms) or ``eps`` (torch's
    RMSNorm and LayerNorm, and most others)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            value = getattr(norm, name)
            if name == "eps" and value is None and isinstance(norm, nn.RMSNorm):
                return name  # torch's RMSNorm without an eps: resolved in _base_eps
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return name
            raise TypeError(
                f"{where} ({type(norm).__name__}) has {name}={value!r}, not a number; "
                "match_prenorm_eps scales a float eps"
            )
    raise TypeError(
        f"{where} is a {type(norm).__module__}.{type(norm).__qualname__}, which has no float `eps` or "
        "`variance_epsilon` attribute; match_prenorm_eps takes the norms that read each sublayer's input "
        "(nn.RMSNorm, nn.LayerNorm, transformers' RMSNorms or any norm with a float eps)"
    )


def _base_eps(norm: nn.Module, attribute: str) -> float:
    if hasattr(norm, _BASE):
        return getattr(norm, _BASE)
    eps = getattr(norm, attribute)
    if eps is None:  # torch's RMSNorm(eps=None) uses finfo(input dtype).eps: fix the value it has now
        weight = getattr(norm, "weight", None)
        eps = torch.finfo(weight.dtype if weight is not None else torch.get_default_dtype()).eps
    return float(eps)


def prenorm_eps_scales(scheme: ResidualScheme, final: bool = True) -> list[float]:
    """The factor c_l² on the eps of the norm reading sublayer l, for l = 0 … L-1 (and the final norm,
    l = L, when ``final``): ``scheme.prenorm_read_scale(l)`` squared, 1 where the scheme reads no
    multiple of the PreNorm sum at init (PreNorm itself: c = 1; the rivals; a sliding window)."""
    n = scheme.n_sublayers + int(final)
    scales = []
    for l in range(n):
        c = scheme.prenorm_read_scale(l)
        scales.append(1.0 if c is None else float(c) ** 2)
    return scales


def match_prenorm_eps(norms: Iterable[nn.Module], scheme: ResidualScheme) -> list[float]:
    """Scale each pre-norm's eps so that the zero-initialised ``scheme`` computes the PreNorm function.

    norms: the norms that read sublayers 0 … L-1 (L = ``scheme.n_sublayers``), in order, optionally
    followed by the final norm (the one reading ``stream.end()``): L or L + 1 modules. Each keeps its
    eps in ``eps`` (torch's ``nn.RMSNorm``, ``nn.LayerNorm``, ``nn.GroupNorm``) or ``variance_epsilon``
    (transformers' RMSNorms). Sets eps = base eps · c_l², where c_l = ``scheme.prenorm_read_scale(l)``
    (1/K_l for softmax AttnRes) and the base eps is the norm's eps before the first call (idempotent).

    Returns the eps set, one per norm. Raises TypeError for a module without a numeric eps, ValueError
    for a wrong number of norms or one module at two positions that need different eps.
    """
    if not isinstance(scheme, ResidualScheme):
        raise TypeError(
            f"scheme must be an attnres ResidualScheme (FullAttnRes, BlockAttnRes, residual_scheme(...)); "
            f"got {type(scheme).__name__}"
        )
    if not isinstance(norms, (nn.ModuleList, nn.Sequential)) and isinstance(norms, nn.Module):
        raise TypeError(
            f"norms must be a sequence of norm modules (one per sublayer, then the final norm); "
            f"got one {type(norms).__name__}"
        )
    norms = list(norms)
    L = scheme.n_sublayers
    if len(norms) not in (L, L + 1):
        raise ValueError(
            f"norms has {len(norms)} modules but the scheme has {L} sublayers: give the {L} pre-norms "
            f"(one per sublayer, in order), optionally followed by the final norm ({L + 1} in all)"
        )
    scales = prenorm_eps_scales(scheme, final=len(norms) == L + 1)
    where = [f"norms[{i}]" + (" (the final norm)" if i == L else f" (sublayer {i})") for i in range(len(norms))]
    attributes = [_eps_attribute(norm, w) for norm, w in zip(norms, where, strict=True)]
    seen: dict[int, int] = {}
    for i, norm in enumerate(norms):  # a norm shared by several positions needs one eps for all of them
        j = seen.setdefault(id(norm), i)
        if j != i and scales[j] != scales[i]:
            raise ValueError(
                f"{where[i]} is the same module as {where[j]}, but they need eps scales {scales[i]:.6g} "
                f"and {scales[j]:.6g}: give each sublayer its own norm"
            )
    set_to = []
    for norm, attribute, scale in zip(norms, attributes, scales, strict=True):
        base = _base_eps(norm, attribute)
        setattr(norm, _BASE, base)
        setattr(norm, attribute, base * scale)
        set_to.append(base * scale)
    if any(scale != 1.0 for scale in scales):  # a scheme that changes no eps computes the same function either way
        remember_matched_norms(scheme, list(zip(norms, attributes, strict=True)))
    return set_to
