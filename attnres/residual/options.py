"""How an option is checked: ``Option``, the common checks, and the one validation loop.

The options themselves are declared with their checks once, apart from anything that builds a model:
the scheme families' in ``attnres.residual.args`` (``SCHEME_RULES``: per scheme, the options it reads),
the backbones' in ``attnres.model.backbone_args`` (``BACKBONE_RULES``). An option shared by several
schemes (Full and Block AttnRes share most of theirs) is listed by each of them.
``check_scheme_options(config, rules)`` is all validation needs: an option left at its default is
never checked; a set option must belong to the chosen scheme (unless it is marked ``exclusive=False``:
then the other schemes ignore it) and pass its check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def bad_option(field: str, value: Any, allowed: str, owner: str = "ModelConfig") -> ValueError:
    """The one error format of config validation: field, value, and what would be valid. ``owner``:
    the class whose field it is (``ResidualConfig`` for a scheme built without a model)."""
    return ValueError(f"{owner}.{field}={value!r} is invalid: {allowed}")


def is_positive_int(value) -> bool:
    """An int >= 1 (bools are ints to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Option:
    """``check(value, config)`` returns None when the value is valid, else what would be valid."""

    check: Callable[[Any, Any], str | None]
    exclusive: bool = True  # set for another scheme: an error (False: the other schemes ignore it)


# ----------------------------------------------------------------------------- common checks


def boolean(value, config) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def one_of(*choices: str) -> Callable:
    def check(value, config):
        return None if value in choices else f"choose one of {choices}"

    return check


def positive_int(what: str, upper: Callable[[Any], int] | None = None, upper_name: str = "") -> Callable:
    """A positive integer; with ``upper(config)`` at most that (``upper_name`` says what it is)."""

    def check(value, config):
        if upper is None:
            return None if is_positive_int(value) else f"must be a positive integer ({what})"
        top = upper(config)
        if is_positive_int(value) and value <= top:
            return None
        return f"must be an integer in [1, {top}] ({what}, at most {upper_name}={top})"

    return check


# ----------------------------------------------------------------------------- validation


def check_scheme_options(config, registry: Mapping[str, Any], selector: str = "residual") -> None:
    """Every scheme option of ``config`` that is set: it belongs to the entry of ``registry`` (each with
    ``options``) that ``config.<selector>`` names (or is not exclusive) and passes its check. Raises the
    ValueError of ``bad_option``. The backbones' rules (``attnres.model.backbone_args``) check their
    options the same way, with ``selector="backbone"``."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    chosen = getattr(config, selector)
    owners: dict = {}
    for name, info in registry.items():
        for option_name, option in info.options.items():
            owners.setdefault(option_name, ([], option))[0].append(name)
    for option_name, (schemes, option) in owners.items():
        value = getattr(config, option_name)
        if value == defaults[option_name] and type(value) is type(defaults[option_name]):
            continue
        if chosen not in schemes and option.exclusive:
            names = " or ".join(repr(s) for s in schemes)
            raise bad_option(
                option_name,
                value,
                f"applies to {selector}={names} only ({selector}={chosen!r}); "
                f"drop it or set {selector}={names.split(' or ')[0]}",
                owner=type(config).__name__,
            )
        problem = option.check(value, config)
        if problem is not None:
            raise bad_option(option_name, value, problem, owner=type(config).__name__)
