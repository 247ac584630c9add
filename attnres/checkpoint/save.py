"""``save_checkpoint``: write every file into a hidden temp directory, fsync, swap it into place."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from attnres.checkpoint.format import (
    ALIAS_KEY,
    FORMAT_VERSION,
    MODEL_FILE,
    OLD_TAG,
    OPTIM_FILE,
    RNG_FILE,
    STATE_FILE,
    TMP_TAG,
    CheckpointError,
    fsync_dir,
    fsync_file,
    hidden_prefix,
    jsonable,
    sha256,
    siblings,
)
from attnres.files import file_mode
from attnres.parallel.state import unwrap


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict without shared storage: (tensors to save, {alias: saved name})."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    same_view: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, t in unwrap(model).state_dict().items():
        t = t.detach()
        if t.numel() == 0:
            tensors[name] = t.contiguous()
            continue
        storage = (t.device, t.untyped_storage().data_ptr())
        view = (*storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in same_view:
            aliases[name] = same_view[view]
            continue
        if storage in storages:  # overlaps another saved tensor, but a different view
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            storages.add(storage)
            same_view[view] = name
        tensors[name] = t.contiguous()
    return tensors, aliases


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        # numpy arrays are not allowed by torch.load(weights_only=True): store a tensor + scalars
        "numpy": {
            "bit_generator": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": int(py_version), "state": [int(x) for x in py_state], "gauss_next": py_gauss},
    }


def _write_model(path: Path, model: nn.Module) -> None:
    tensors, aliases = _model_tensors(model)
    save_file(tensors, str(path), metadata={"format": "pt", ALIAS_KEY: json.dumps(aliases, sort_keys=True)})
    os.chmod(path, file_mode())  # safetensors writes 0600; every other file of a run follows the umask


def _write_torch(path: Path, obj: Any) -> None:
    torch.save(obj, path)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _swap_into_place(tmp: Path, target: Path) -> None:
    parent = target.parent
    old = None
    if target.exists():
        old = parent / f"{hidden_prefix(target.name, OLD_TAG)}{uuid.uuid4().hex[:12]}"
        _rename(target, old)
    try:
        _rename(tmp, target)
    except BaseException:
        if old is not None and not target.exists():
            _rename(old, target)  # put the previous checkpoint back
        raise
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _repair(target: Path) -> None:
    """Undo the traces of an interrupted save to ``target`` (writer side only)."""
    olds = siblings(target, OLD_TAG)
    if olds and not target.exists():
        whole = [o for o in olds if (o / STATE_FILE).is_file()]
        if whole:
            best = max(whole, key=lambda o: (o / STATE_FILE).stat().st_mtime)
            _rename(best, target)
            fsync_dir(target.parent)
            olds.remove(best)
    for o in olds:
        shutil.rmtree(o, ignore_errors=True)
    for t in siblings(target, TMP_TAG):
        shutil.rmtree(t, ignore_errors=True)


def save_checkpoint(
    path_dir: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: Any | None,
    step: int,
    train_state: dict,
    model_config: dict,
    train_config: dict,
) -> Path:
    """Atomically write (or replace) the checkpoint directory ``path_dir``; returns its path.

    ``train_state`` (e.g. data-loader position, best eval loss, tokens seen),
    ``model_config`` (``dataclasses.asdict(model.config)``) and ``train_config``
    must be JSON-serializable. ``optimizer`` may be None (weights-only
    checkpoint). Refuses to replace an existing directory that is not a
    checkpoint (so a run directory passed by mistake is never deleted).
    """
    target = Path(path_dir)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "train_state": jsonable(train_state, "train_state"),
        "model_config": jsonable(model_config, "model_config"),
        "train_config": jsonable(train_config, "train_config"),
    }
    if target.exists() and not (target / STATE_FILE).is_file() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"{target} exists and is not a checkpoint (no {STATE_FILE}); refusing to replace it. "
            "Fix: pass a dedicated checkpoint directory path, e.g. <run_dir>/ckpt_last"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    _repair(target)

    tmp = target.parent / f"{hidden_prefix(target.name, TMP_TAG)}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        written = [MODEL_FILE]
        _write_model(tmp / MODEL_FILE, model)
        if optimizer is not None:
            _write_torch(tmp / OPTIM_FILE, optimizer.state_dict())
            written.append(OPTIM_FILE)
        _write_torch(tmp / RNG_FILE, _rng_state())
        written.append(RNG_FILE)
        files = {}
        for name in written:
            fsync_file(tmp / name)
            files[name] = {"sha256": sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        meta.update(files=files, created_unix=time.time(), torch_version=torch.__version__)
        _write_json(tmp / STATE_FILE, meta)
        fsync_file(tmp / STATE_FILE)
        fsync_dir(tmp)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
