"""The checks of a bench's options, before anything is built: what ``attnres train`` does for its own.

``coerce(config_class, key, value)`` turns a ``--set`` value into the field's type where the text
form is unambiguous (a comma list for a list field, yes / no for a yes/no field); ``check_fields``
then refuses any field of the wrong type or range, and each bench's own check (``CHECKS``) the values
only it knows: variant names against the scheme registry, choices, the compile backend and its
compiler, and for ``bench train`` and ``bench graph`` the memory the models and a training step need.
Every refusal is one ValueError naming ``<Config>.<field>``, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any

import torch

from attnres.model import ModelConfig
from attnres.model.checkpointing import CHECKPOINTING
from attnres.model.compile import GRANULARITIES, check_compile_setting, check_compiler
from attnres.residual import RESIDUALS
from attnres.residual.options import bad_option
from attnres.train.config import BOOL_WORDS, parse_bool, parse_value
from attnres.train.memory import check_models_memory
from attnres.train.optim import OPTIMIZER_NAMES

# counts that may be 0 (no warm-up, no profiled rounds) or are seeds; every other int field counts
# something that must happen at least once
_MAY_BE_ZERO = frozenset({"warmup", "profile_rounds", "seed"})


def _hints(config_class: type) -> dict[str, Any]:
    return typing.get_type_hints(config_class)


def coerce(config_class: type, key: str, value: Any) -> Any:
    """``value`` (as ``--set`` parsed it) in the type of ``config_class``'s field ``key`` where its text
    says so unambiguously: "block,full" -> ["block", "full"] for a list, "no" -> False for a yes/no."""
    hint = _hints(config_class)[key]
    if hint in (list[str], list[int]):
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
            if hint == list[int]:
                value = [parse_value(part) for part in value]
        elif isinstance(value, (tuple, list)):
            value = list(value)
        elif hint == list[int] and isinstance(value, int) and not isinstance(value, bool):
            value = [value]
    elif hint is bool:
        value = parse_bool(value, f"{config_class.__name__}.{key}")
    elif hint == (bool | str) and isinstance(value, (str, int)) and str(value).strip().lower() in BOOL_WORDS:
        value = parse_bool(value, f"{config_class.__name__}.{key}")  # compile=no: off, not a backend named "no"
    elif hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_fields(cfg: Any) -> None:
    """Every field of the bench config ``cfg`` has its type and range (see the module docstring)."""
    owner = type(cfg).__name__
    for name, hint in _hints(type(cfg)).items():
        value = getattr(cfg, name)

        def bad(allowed: str, value=value, name=name) -> ValueError:
            return bad_option(name, value, allowed, owner)

        if hint in (int, int | None):
            if value is None and hint is not int:
                continue
            low = 0 if name in _MAY_BE_ZERO else 1
            if not (_is_int(value) and value >= low):
                raise bad("must be a non-negative integer" if low == 0 else "must be a positive integer")
        elif hint is float:
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
                raise bad("must be a finite number")
            if value < 0:
                raise bad("must not be negative")
        elif hint is bool:
            if not isinstance(value, bool):
                raise bad("use true or false")
        elif hint == (bool | str):
            check_compile_setting(value, f"{owner}.{name}")
        elif hint is str:
            if not isinstance(value, str):
                raise bad("must be text")
        elif hint in (list[str], list[int]):
            item_ok: Callable[[Any], bool] = (
                (lambda v: isinstance(v, str) and bool(v)) if hint == list[str] else (lambda v: _is_int(v) and v >= 1)
            )
            if not (isinstance(value, list) and value and all(item_ok(v) for v in value)):
                kind = "names" if hint == list[str] else "positive integers"
                raise bad(f"must be a comma list of one or more {kind}, e.g. --set {name}={_example(cfg, name)}")


def _example(cfg: Any, name: str) -> str:
    field = next(f for f in dataclasses.fields(cfg) if f.name == name)
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return ",".join(str(v) for v in default) if isinstance(default, list) else str(default)


def check_choice(cfg: Any, name: str, choices) -> None:
    if getattr(cfg, name) not in choices:
        raise bad_option(name, getattr(cfg, name), f"choose one of {tuple(choices)}", type(cfg).__name__)


def check_device(cfg: Any) -> torch.device:
    """The bench's device, refused in one line when it is not one this machine has."""
    owner = type(cfg).__name__
    try:
        device = torch.device(cfg.device)
    except (RuntimeError, TypeError):
        raise bad_option("device", cfg.device, "use cpu, cuda or cuda:N", owner) from None
    if device.type not in ("cpu", "cuda"):
        raise bad_option("device", cfg.device, "use cpu, cuda or cuda:N", owner)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise bad_option("device", cfg.device, "no CUDA device is visible here; use --device cpu", owner)
        if device.index is not None and device.index >= count:
            raise bad_option("device", cfg.device, f"this machine has {count} CUDA device(s): cuda:0..", owner)
    return device


def variant_configs(cfg: Any, build: Callable[[Any, str], ModelConfig]) -> dict[str, ModelConfig]:
    """Each variant's model (``build(cfg, variant)``), its scheme checked against the registry; any
    other error of the variant's model is named with the variant."""
    owner = type(cfg).__name__
    configs = {}
    for variant in cfg.variants:
        residual = variant.split(":", 1)[0]
        if residual not in RESIDUALS:
            raise bad_option(
                "variants",
                variant,
                f"{residual!r} is not a residual scheme; choose from {sorted(RESIDUALS)} (see `attnres schemes`)",
                owner,
            )
        try:
            configs[variant] = build(cfg, variant)
        except TypeError as e:  # an option ModelConfig does not have
            raise bad_option(
                "variants", variant, f"{e}; a :FIELD=VALUE part names a ModelConfig option (attnres options)", owner
            ) from None
        except ValueError as e:
            raise ValueError(f"{owner}.variants: variant {variant!r}: {e}") from None
    return configs


# ----------------------------------------------------------------------------- the benches' own checks


def check_train(cfg) -> None:
    from attnres.bench.train import (
        AUTOCAST,
        check_clock,
        model_config,
        parse_forced,
        rows_of,
        split_compiled,
    )

    check_choice(cfg, "dtype", AUTOCAST)
    check_clock(cfg.clock)
    check_choice(cfg, "optimizer", OPTIMIZER_NAMES)
    check_choice(cfg, "activation_checkpointing", CHECKPOINTING)
    check_choice(cfg, "compile_granularity", GRANULARITIES)
    parse_forced(cfg.forced)
    device = check_device(cfg)
    check_compiler(cfg.compile, device, "BenchConfig.compile")
    variants = ["prenorm"] + [v for v in cfg.variants if v != "prenorm"]  # the baseline run() adds
    configs = variant_configs(dataclasses.replace(cfg, variants=variants), model_config)
    # every row is built before the first is timed: all their weights and optimizers, one step at a time
    rows = [configs[split_compiled(row)[0]] for row in rows_of(dataclasses.replace(cfg, variants=variants))]
    check_models_memory(
        rows, cfg.batch_size, cfg.seq_len, device, checkpointing=cfg.activation_checkpointing, owner="BenchConfig"
    )


def check_graph(cfg) -> None:
    from attnres.bench.train import model_config

    device = check_device(cfg)
    for config in variant_configs(cfg, model_config).values():  # one variant's step at a time
        check_models_memory([config], cfg.batch_size, cfg.seq_len, device, owner="GraphBenchConfig")


def check_decode(cfg) -> None:
    from attnres.bench.decode import model_config

    device = check_device(cfg)
    check_compiler(cfg.compile, device, "DecodeBenchConfig.compile")
    variant_configs(cfg, model_config)


def check_op(cfg) -> None:
    check_device(cfg)
    check_choice(cfg, "dtype", ("float32", "float64", "bfloat16", "float16"))


def check_pipeline(cfg) -> None:
    from attnres.parallel import PIPELINE_SCHEDULES

    check_device(cfg)
    check_choice(cfg, "residual", sorted(RESIDUALS))
    check_choice(cfg, "schedule", PIPELINE_SCHEDULES)


def check_kimi(cfg) -> None:
    from attnres.bench.kimi import CASES

    check_device(cfg)
    for case in cfg.cases:
        if case not in CASES:
            raise bad_option(
                "cases",
                case,
                f"choose from {sorted(CASES)} (names with a comma as a list: --set \"cases=['3:1, MoE']\")",
                type(cfg).__name__,
            )


def check_roofline(cfg: Any) -> None:
    from attnres.bench.roofline import train_config

    if cfg.head_dim < 1:
        raise bad_option("head_dim", cfg.head_dim, "must be a positive integer", type(cfg).__name__)
    for width in cfg.widths:  # each width is a bench train run: the same checks, memory included
        check_train(train_config(cfg, width))


def check_compile(cfg: Any) -> None:
    from attnres.bench.compile import _train_config

    for variant in ["prenorm"] + [v for v in cfg.variants if v != "prenorm"]:  # each start is a bench train row
        check_train(dataclasses.replace(_train_config(cfg, variant), variants=[variant]))


CHECKS: dict[str, Callable[[Any], None]] = {
    "train": check_train,
    "compile": check_compile,
    "roofline": check_roofline,
    "op": check_op,
    "graph": check_graph,
    "decode": check_decode,
    "pipeline": check_pipeline,
    "kimi": check_kimi,
}


def check_config(name: str, cfg: Any) -> None:
    """Bench ``name``'s config ``cfg``, field by field and then as the bench needs it."""
    check_fields(cfg)
    if name in CHECKS:  # a bench without checks of its own has its fields' types and ranges checked
        CHECKS[name](cfg)
