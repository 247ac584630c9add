"""The configs of a resumed run: its own, from its checkpoint's ``state.json``; options given with
``--resume`` either match them or (for what may change on resume: steps, devices, layout, ...) replace
them. A resumed run needs no retyped preset or flag, and a contradicting one is refused by name."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from attnres.model import ModelConfig
from attnres.train.config import (
    PRESETS,
    RESUMABLE_CHANGES,
    TrainConfig,
    build_configs,
    capped_warmup,
    split_overrides,
)

# derived from the others when a run starts (max_seq_len is raised to seq_len), so a preset's own value
# says nothing about the run
_DERIVED_PRESET_FIELDS = frozenset({"max_seq_len"})


def _resume_fix(out_dir: Path) -> str:
    return (
        f"Fix: drop it (a resumed run takes its settings from {out_dir}), or start a new run with these "
        "settings in another --out"
    )


# how a run is spread over processes: the saved layout is kept only when it fits this launch
_LAYOUT_FIELDS = ("dp", "fsdp", "tp", "sequence_parallel", "pp", "vpp", "pp_schedule", "microbatches")


def resumed_configs(
    out_dir: str | Path, overrides: dict[str, Any], notes: list[str] | None = None
) -> tuple[ModelConfig, TrainConfig]:
    """The run in ``out_dir``'s model and training configs, with ``overrides`` (a ``preset`` key, the
    --config file, --set and the flags) checked against them: a field that may not change on resume
    (``RESUMABLE_CHANGES``) must equal the run's value. Everything is read from ``state.json`` and the
    weights' header: nothing is built."""
    from attnres.checkpoint import (
        CheckpointError,
        find_checkpoint,
        read_checkpoint_state,
    )
    from attnres.checkpoint.trained import check_config_fits_weights

    out_dir = Path(out_dir)
    ckpt = find_checkpoint(out_dir)
    if ckpt is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out_dir}; start over with --force (deletes what is there) "
            "or pass the --out of the run to continue"
        )
    state = read_checkpoint_state(ckpt)
    saved_model, saved_train = state.get("model_config"), state.get("train_config")
    if not isinstance(saved_model, dict) or not isinstance(saved_train, dict) or not saved_train:
        raise CheckpointError(
            f"{ckpt}/state.json holds no model_config and train_config: it was not written by attnres train. "
            "Fix: resume a run directory of attnres train"
        )
    try:
        model_config = ModelConfig.from_dict(saved_model)
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        saved_train = {k: v for k, v in saved_train.items() if k in known}
        TrainConfig(**saved_train)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the config in {ckpt}/state.json is invalid: {e}") from e
    check_config_fits_weights(ckpt, model_config)  # a hostile n_layers fails here, before any model is built

    overrides = dict(overrides)
    preset = overrides.pop("preset", None)
    given: dict[str, tuple[Any, str]] = {}  # field -> (value, where it came from)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        for table in PRESETS[preset].values():
            for key, value in table.items():
                if key not in _DERIVED_PRESET_FIELDS:
                    given[key] = (value, f"--preset {preset}")
    for key, value in overrides.items():
        given[key] = (value, "given")
    if "warmup_steps" in given and "warmup_steps" not in overrides:
        # a preset's warmup longer than the run was capped when the run started (build_configs); the same
        # flags cap it alike now, as do the run's own settings once a resume has changed its steps
        value, source = given["warmup_steps"]
        now = {k: v for k, (v, _) in given.items()}
        if saved_train.get("warmup_steps") in (
            capped_warmup(now),
            capped_warmup({**saved_train, "warmup_steps": value}),
        ):
            given["warmup_steps"] = (saved_train["warmup_steps"], source)
    model_given, train_given = split_overrides({k: v for k, (v, _) in given.items()})
    saved = {**saved_model, **saved_train}  # vocab_size: the training option (the model's follows the tokenizer)
    wrong = []
    for key in [*model_given, *train_given]:
        value, source = given[key]
        if key in RESUMABLE_CHANGES or value == saved.get(key):
            continue
        wrong.append(f"{key}={value!r} ({source}), but the run has {key}={saved.get(key)!r}")
    if wrong:
        raise ValueError(
            f"--resume: the options differ from the run in {out_dir}: {'; '.join(wrong)}. {_resume_fix(out_dir)}"
        )
    merged = {k: v for k, v in saved_model.items() if k != "vocab_size"}
    merged.update(saved_train)
    merged.update({k: v for k, (v, _) in given.items()})
    merged["out_dir"] = str(out_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    saved_world = saved_train.get("dp", 1) * saved_train.get("tp", 1) * saved_train.get("pp", 1)
    if saved_world != world and not any(k in given for k in _LAYOUT_FIELDS):
        # checkpoints move between layouts: the run continues in the processes it has now
        defaults = TrainConfig()
        merged.update({k: getattr(defaults, k) for k in _LAYOUT_FIELDS})
        if notes is not None and world == 1:
            layout = ", ".join(f"{k}={saved_train[k]}" for k in ("dp", "tp", "pp") if saved_train.get(k, 1) > 1)
            notes.append(f"the run was laid out over {saved_world} processes ({layout}); it continues in this one")
    return build_configs(None, merged)
