"""``load_checkpoint``: verify every file against ``state.json``, parse everything, then load it."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from attnres.checkpoint.format import (
    ALIAS_KEY,
    MODEL_FILE,
    OPTIM_FILE,
    RNG_FILE,
    STATE_FILE,
    CheckpointError,
    jsonable,
    read_checkpoint_state,
    resolve,
    sha256,
    unparsable,
)
from attnres.parallel.state import unwrap
from attnres.residual.base import check_records, record_keys


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda") or []
    if cuda_states and torch.cuda.is_available():
        for i in range(min(len(cuda_states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(cuda_states[i], i)
    n = state["numpy"]
    np.random.set_state(
        (n["bit_generator"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def _config_dict(model: nn.Module) -> dict | None:
    cfg = getattr(unwrap(model), "config", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = dataclasses.asdict(cfg)
    if not isinstance(cfg, dict):
        return None
    return jsonable(cfg, "the model's config")


def _check_file(path: Path, name: str, state: dict, verify: bool) -> Path:
    info = state["files"].get(name)
    fpath = path / name
    if info is None:
        raise CheckpointError(
            f"checkpoint {path} has no {name} (it was saved without it); load with that part disabled"
        )
    if not fpath.is_file():
        raise CheckpointError(
            f"{fpath} is missing: the checkpoint is incomplete (partially copied?). "
            "Fix: copy the whole directory again or resume from an older checkpoint"
        )
    if verify:
        size = fpath.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"{fpath} is truncated or corrupt: {size} bytes, expected {info['bytes']}. "
                "Fix: copy the file again or resume from an older checkpoint"
            )
        digest = sha256(fpath)
        if digest != info["sha256"]:
            raise CheckpointError(
                f"{fpath} is corrupt: sha256 {digest[:16]}... does not match {info['sha256'][:16]}... recorded in "
                f"{STATE_FILE}. Fix: copy the file again or resume from an older checkpoint"
            )
    return fpath


def _config_mismatch(saved: dict, current: dict) -> list[str]:
    absent = "<absent>"
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, absent), current.get(key, absent)
        if a != b:
            diffs.append(f"{key}: checkpoint={a!r}, model={b!r}")
    return diffs


def _load_weights(fpath: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(str(fpath), device="cpu")
        with safe_open(str(fpath), framework="pt") as f:
            meta = f.metadata() or {}
        aliases = json.loads(meta.get(ALIAS_KEY, "{}"))
    except Exception as e:  # safetensors raises its own error types
        raise unparsable(fpath, e) from e
    for alias, src in aliases.items():
        tensors[alias] = tensors[src]
    problem = check_records(unwrap(model), tensors)
    if problem is not None:
        raise CheckpointError(f"{fpath} does not fit the model: {problem}")
    expected = unwrap(model).state_dict()
    records = set(record_keys(unwrap(model)))  # a record's length is its settings' text, not a shape
    missing = sorted(set(expected) - set(tensors) - records)  # no record: saved before schemes kept one
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [
        f"{k}: checkpoint {tuple(tensors[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in tensors and k not in records and tuple(tensors[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing in checkpoint: {missing}")
        if unexpected:
            parts.append(f"not in model: {unexpected}")
        if shapes:
            parts.append(f"shape mismatch: {shapes}")
        raise CheckpointError(
            f"{fpath} does not fit the model ({'; '.join(parts)}). "
            "Fix: build the model from the checkpoint's model_config"
        )
    return tensors


def _torch_load(fpath: Path) -> Any:
    try:
        return torch.load(fpath, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{fpath} cannot be loaded ({type(e).__name__}: {e}). "
            "Fix: copy the file again or resume from an older checkpoint"
        ) from e


def load_checkpoint(
    path_dir: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    optimizer: Any | None = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> dict:
    """Load a checkpoint into ``model`` / ``optimizer`` and restore RNG states.

    Every file that is used is first checked against the size and sha256 in
    ``state.json`` (``verify=False`` skips the hashing); everything is parsed
    before anything is modified, so a failure leaves model, optimizer and RNGs
    untouched. When the model has a ``config``, it must equal the saved
    ``model_config``. Returns the parsed ``state.json`` (``step``,
    ``train_state``, ``model_config``, ``train_config``, ...) plus ``path``.
    Raises :class:`CheckpointError` on any problem.
    """
    path = resolve(Path(path_dir))
    state = read_checkpoint_state(path)

    weights = optim_state = rng = None
    if model is not None:
        current = _config_dict(model)
        if current is not None:
            diffs = _config_mismatch(state.get("model_config") or {}, current)
            if diffs:
                raise CheckpointError(
                    f"model_config in {path / STATE_FILE} does not match the model being loaded into: "
                    + "; ".join(diffs)
                    + ". Fix: build the model from the checkpoint's config "
                    "(read_checkpoint_state(path)['model_config']) or load a checkpoint of this architecture"
                )
        weights = _load_weights(_check_file(path, MODEL_FILE, state, verify), model)
    if optimizer is not None:
        optim_state = _torch_load(_check_file(path, OPTIM_FILE, state, verify))
    if restore_rng:
        rng = _torch_load(_check_file(path, RNG_FILE, state, verify))
        if not isinstance(rng, dict) or not {"torch_cpu", "numpy", "python"} <= set(rng):
            raise CheckpointError(f"{path / RNG_FILE} does not hold RNG states. Fix: resume from another checkpoint")

    if model is not None and weights is not None:
        unwrap(model).load_state_dict(weights, strict=True)
    if optimizer is not None and optim_state is not None:
        try:
            optimizer.load_state_dict(optim_state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(
                f"{path / OPTIM_FILE} does not fit this optimizer: {e}. Fix: resume with the same optimizer "
                "settings (name, parameter grouping) or load without optimizer=..."
            ) from e
    if rng is not None:
        _set_rng_state(rng)
    return {**state, "path": str(path)}
