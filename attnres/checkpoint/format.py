"""The checkpoint directory's file names, its ``state.json`` and the file-system steps every reader
and writer shares (fsync, sha256, the hidden temp / backup directories of a save).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from attnres.files import fsync_path

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
TMP_TAG = ".tmp-"
OLD_TAG = ".old-"
ALIAS_KEY = "attnres_aliases"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model."""


def unparsable(fpath, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{fpath} cannot be parsed as safetensors ({type(error).__name__}: {error}). "
        "Fix: copy the file again or resume from an older checkpoint"
    )


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path  # a checkpoint directory made durable after its files are renamed into it


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hidden_prefix(name: str, tag: str) -> str:
    return f".{name}{tag}"


def siblings(target: Path, tag: str) -> list[Path]:
    parent = target.parent
    if not parent.is_dir():
        return []
    prefix = hidden_prefix(target.name, tag)
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


def jsonable(obj: Any, what: str) -> Any:
    """Round-trip through JSON (tuples -> lists) and fail early with a clear message."""
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable: {e}") from e


def resolve(path: Path) -> Path:
    """``path``, or the whole backup left by a crash between the two renames of a save."""
    if path.exists():
        return path
    whole = [o for o in siblings(path, OLD_TAG) if (o / STATE_FILE).is_file()]
    if whole:
        return max(whole, key=lambda o: (o / STATE_FILE).stat().st_mtime)
    return path


def read_checkpoint_state(path_dir: str | os.PathLike) -> dict:
    """Parse and return ``state.json`` of a checkpoint (cheap; no weights read)."""
    path = resolve(Path(path_dir))
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
