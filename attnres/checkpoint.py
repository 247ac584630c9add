"""Crash-safe training checkpoints, and rebuilding a trained model from one.

A checkpoint is a directory::

    <ckpt>/model.safetensors   model.state_dict() (tied tensors stored once, see below)
    <ckpt>/optimizer.pt        optimizer.state_dict() via torch.save (weights_only-loadable)
    <ckpt>/rng.pt              torch CPU / CUDA, numpy (legacy global) and python `random` states
    <ckpt>/state.json          step, train_state, model_config, train_config, format version,
                               sha256 and size of every other file (written last)

Atomicity: everything is written into a hidden temp directory beside the
target (``.<name>.tmp-<pid>-<id>``), each file and the directory are fsynced,
then the temp dir is renamed into place. An existing checkpoint is first
renamed to ``.<name>.old-<id>``, the new one renamed in, the parent directory
fsynced, and only then the old one deleted. A crash at any moment therefore
leaves either the old or the new checkpoint whole; hidden temp/old directories
are never reported by :func:`latest_checkpoint`. If a crash hits the short
window between the two renames, only ``.<name>.old-<id>`` exists:
:func:`load_checkpoint` and :func:`latest_checkpoint` transparently use it and
the next :func:`save_checkpoint` to that path renames it back / cleans up.
One writer per checkpoint path is assumed (``attnres train`` holds a lock on its run directory,
``attnres.train.run_dir``).

A run directory of ``attnres train`` holds its latest checkpoint in
``checkpoint/`` (``attnres.files.CHECKPOINT_DIR``); :func:`load_model` takes
either and rebuilds the model (and the run's tokenizer) for evaluation,
sampling and conversion, without the trainer.

Tied weights: safetensors refuses tensors that share storage, and a tied
embedding / LM head appears twice in ``state_dict()``. Entries that are the
same view of the same storage are saved once, under the first name in
``state_dict()`` order; the other names are recorded as aliases in the file's
metadata (``attnres_aliases``: JSON ``{alias: saved_name}``) and re-expanded on
load, so the file loads into tied and untied models alike. Tensors that merely
overlap another tensor's storage are saved as independent copies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from attnres.files import CHECKPOINT_DIR, TOKENIZER_FILE
from attnres.model import AttnResLM, ModelConfig
from attnres.parallel.state import unwrap

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "find_checkpoint",
    "read_checkpoint_state",
    "load_model",
    "resolve_device",
]

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
_TMP_TAG = ".tmp-"
_OLD_TAG = ".old-"
_ALIAS_KEY = "attnres_aliases"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model."""


def _unparsable(fpath, error: Exception) -> CheckpointError:
    return CheckpointError(f"{fpath} cannot be parsed as safetensors ({type(error).__name__}: {error}). "
                           "Fix: copy the file again or resume from an older checkpoint")


# --------------------------------------------------------------------------- fs helpers


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hidden_prefix(name: str, tag: str) -> str:
    return f".{name}{tag}"


def _siblings(target: Path, tag: str) -> list[Path]:
    parent = target.parent
    if not parent.is_dir():
        return []
    prefix = _hidden_prefix(target.name, tag)
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


# --------------------------------------------------------------------------- model weights


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
    return _jsonable(cfg, "the model's config")


def _jsonable(obj: Any, what: str) -> Any:
    """Round-trip through JSON (tuples -> lists) and fail early with a clear message."""
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable: {e}") from e


# --------------------------------------------------------------------------- save


def _write_model(path: Path, model: nn.Module) -> None:
    tensors, aliases = _model_tensors(model)
    save_file(tensors, str(path), metadata={"format": "pt", _ALIAS_KEY: json.dumps(aliases, sort_keys=True)})


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
        old = parent / f"{_hidden_prefix(target.name, _OLD_TAG)}{uuid.uuid4().hex[:12]}"
        _rename(target, old)
    try:
        _rename(tmp, target)
    except BaseException:
        if old is not None and not target.exists():
            _rename(old, target)  # put the previous checkpoint back
        raise
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _repair(target: Path) -> None:
    """Undo the traces of an interrupted save to ``target`` (writer side only)."""
    olds = _siblings(target, _OLD_TAG)
    if olds and not target.exists():
        whole = [o for o in olds if (o / STATE_FILE).is_file()]
        if whole:
            best = max(whole, key=lambda o: (o / STATE_FILE).stat().st_mtime)
            _rename(best, target)
            _fsync_dir(target.parent)
            olds.remove(best)
    for o in olds:
        shutil.rmtree(o, ignore_errors=True)
    for t in _siblings(target, _TMP_TAG):
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
        "train_state": _jsonable(train_state, "train_state"),
        "model_config": _jsonable(model_config, "model_config"),
        "train_config": _jsonable(train_config, "train_config"),
    }
    if target.exists() and not (target / STATE_FILE).is_file():
        if not target.is_dir() or any(target.iterdir()):
            raise CheckpointError(
                f"{target} exists and is not a checkpoint (no {STATE_FILE}); refusing to replace it. "
                "Fix: pass a dedicated checkpoint directory path, e.g. <run_dir>/ckpt_last"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    _repair(target)

    tmp = target.parent / f"{_hidden_prefix(target.name, _TMP_TAG)}{os.getpid()}-{uuid.uuid4().hex[:12]}"
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
            _fsync_file(tmp / name)
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        meta.update(files=files, created_unix=time.time(), torch_version=torch.__version__)
        _write_json(tmp / STATE_FILE, meta)
        _fsync_file(tmp / STATE_FILE)
        _fsync_dir(tmp)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# --------------------------------------------------------------------------- load


def _resolve(path: Path) -> Path:
    """``path``, or the whole backup left by a crash between the two renames of a save."""
    if path.exists():
        return path
    whole = [o for o in _siblings(path, _OLD_TAG) if (o / STATE_FILE).is_file()]
    if whole:
        return max(whole, key=lambda o: (o / STATE_FILE).stat().st_mtime)
    return path


def read_checkpoint_state(path_dir: str | os.PathLike) -> dict:
    """Parse and return ``state.json`` of a checkpoint (cheap; no weights read)."""
    path = _resolve(Path(path_dir))
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint directory {path} does not exist. Fix: pass a directory written by "
            "save_checkpoint (holding state.json, model.safetensors, ...), or find one with latest_checkpoint(run_dir)"
        )
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(
            f"{state_path} is missing: {path} is not a complete checkpoint. Fix: resume from another checkpoint "
            "(latest_checkpoint(run_dir) skips incomplete ones)"
        )
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        if not isinstance(state, dict) or "step" not in state or "files" not in state:
            raise ValueError("missing 'step' or 'files'")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{state_path} is corrupt ({e}). Fix: resume from an older checkpoint or restore this one from a backup"
        ) from e
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{state_path} has format_version {version!r}; this attnres reads version {FORMAT_VERSION}. "
            "Fix: load it with the attnres version that wrote it"
        )
    return state


def _check_file(path: Path, name: str, state: dict, verify: bool) -> Path:
    info = state["files"].get(name)
    fpath = path / name
    if info is None:
        raise CheckpointError(f"checkpoint {path} has no {name} (it was saved without it); load with that part disabled")
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
        digest = _sha256(fpath)
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
        aliases = json.loads(meta.get(_ALIAS_KEY, "{}"))
    except Exception as e:  # safetensors raises its own error types
        raise _unparsable(fpath, e) from e
    for alias, src in aliases.items():
        tensors[alias] = tensors[src]
    expected = unwrap(model).state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [
        f"{k}: checkpoint {tuple(tensors[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in tensors and tuple(tensors[k].shape) != tuple(v.shape)
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
            f"{fpath} does not fit the model ({'; '.join(parts)}). Fix: build the model from the checkpoint's model_config"
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
    path = _resolve(Path(path_dir))
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

    if weights is not None:
        unwrap(model).load_state_dict(weights, strict=True)
    if optim_state is not None:
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


# --------------------------------------------------------------------------- discovery


def _looks_whole(path: Path) -> dict | None:
    """Parsed state.json if every listed file exists with its recorded size, else None."""
    try:
        state = read_checkpoint_state(path)
        for name, info in state["files"].items():
            if (path / name).stat().st_size != info["bytes"]:
                return None
        return state
    except (CheckpointError, OSError, KeyError, TypeError):
        return None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: the one with the highest step.

    Looks at ``run_dir`` itself and its immediate subdirectories, plus those of
    ``run_dir/checkpoints``. Hidden temp/backup directories of interrupted saves
    are never returned (a backup is reported under its checkpoint's own name,
    which :func:`load_checkpoint` resolves). Checkpoints whose files are missing
    or have the wrong size are skipped with a warning (hashes are checked by
    :func:`load_checkpoint`). Ties on step go to the newest. Returns None when
    there is none.
    """
    run_dir = Path(run_dir)
    roots = [run_dir, run_dir / "checkpoints"]
    candidates: set[Path] = set()
    if (run_dir / STATE_FILE).is_file():
        candidates.add(run_dir)
    for root in roots:
        if not root.is_dir():
            continue
        for child in root.iterdir():
            if not child.is_dir():
                continue
            if child.name.startswith("."):
                if _OLD_TAG in child.name:
                    logical = root / child.name[1:].rsplit(_OLD_TAG, 1)[0]
                    if not logical.exists():
                        candidates.add(logical)
                continue
            if (child / STATE_FILE).exists():
                candidates.add(child)
    best: tuple | None = None
    for cand in candidates:
        real = _resolve(cand)
        state = _looks_whole(real)
        if state is None:
            warnings.warn(f"skipping incomplete or unreadable checkpoint {real}", stacklevel=2)
            continue
        step = state.get("step", -1)
        key = (step if isinstance(step, (int, float)) and math.isfinite(step) else -1, (real / STATE_FILE).stat().st_mtime)
        if best is None or key > best[0]:
            best = (key, cand)
    return None if best is None else best[1]


# --------------------------------------------------------------------------- trained models


def resolve_device(name: str) -> torch.device:
    """A device from ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device={name!r} but no CUDA device is available; use --device cpu")
    return torch.device(name)


def find_checkpoint(run_or_checkpoint: str | os.PathLike) -> Path | None:
    """The checkpoint of a run directory (``<run>/checkpoint``) or the checkpoint directory itself,
    also when a crash between the two renames of a save left only its backup
    (``.checkpoint.old-*``, which :func:`load_checkpoint` reads under the checkpoint's own name).
    None when there is none."""
    path = Path(run_or_checkpoint)
    for candidate in (path / CHECKPOINT_DIR, path):
        if (_resolve(candidate) / STATE_FILE).is_file():
            return candidate
    return None


def _check_config_fits_weights(ckpt: Path, config: ModelConfig) -> None:
    """Compare the shapes ``config`` implies (a model built on the meta device: no memory) with the
    tensor shapes in the safetensors header, before the real model is allocated: ``state.json`` is
    not covered by a hash, and a hostile or edited one must not make us allocate a huge model."""
    fpath = _resolve(ckpt) / MODEL_FILE
    try:
        with safe_open(str(fpath), framework="pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            aliases = json.loads((f.metadata() or {}).get(_ALIAS_KEY, "{}"))
    except Exception as e:  # safetensors raises its own error types
        raise _unparsable(fpath, e) from e
    for alias, src in aliases.items():
        if src in saved:
            saved[alias] = saved[src]
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in AttnResLM(config).state_dict().items()}
    wrong = [f"{k}: weights {saved.get(k)}, model_config {v}" for k, v in expected.items() if saved.get(k) != v]
    wrong += [f"{k}: weights {v}, not in model_config's model" for k, v in saved.items() if k not in expected]
    if wrong:
        raise CheckpointError(
            f"model_config in {ckpt / STATE_FILE} does not match the tensors in {fpath} ({len(wrong)} differ, "
            f"e.g. {wrong[0]}); state.json was edited or belongs to another checkpoint. Fix: restore the "
            "checkpoint's own state.json from a backup"
        )


def load_model(run_or_checkpoint: str | os.PathLike, device: str = "cpu"):
    """Rebuild a trained model (and its tokenizer when present) from a run or checkpoint directory.

    Returns ``(model, tokenizer or None, state)``: an ``AttnResLM`` in eval mode on ``device``, the
    run's tokenizer, and the checkpoint's parsed ``state.json``. The model config in ``state.json``
    is checked against the weights' shapes before the model is allocated."""
    path = Path(run_or_checkpoint)
    ckpt = find_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(
            f"no checkpoint found at {path}; pass a run directory (holding {CHECKPOINT_DIR}/) or a "
            "checkpoint directory"
        )
    state = read_checkpoint_state(ckpt)
    try:
        config = ModelConfig.from_dict(state["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"model_config in {ckpt / STATE_FILE} is invalid: {e}") from e
    _check_config_fits_weights(ckpt, config)
    model = AttnResLM(config)
    load_checkpoint(ckpt, model=model, restore_rng=False)
    model.to(resolve_device(device)).eval()
    tokenizer = None
    run_dir = ckpt.parent if ckpt.name == CHECKPOINT_DIR else ckpt
    if (run_dir / TOKENIZER_FILE).exists():
        from attnres.data import load_tokenizer

        tokenizer = load_tokenizer(str(run_dir / TOKENIZER_FILE))
    return model, tokenizer, state
