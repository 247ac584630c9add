"""``load_model``: a trained model (and its run's tokenizer) rebuilt from a run or checkpoint directory."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from attnres.checkpoint.discovery import find_checkpoint
from attnres.checkpoint.format import (
    ALIAS_KEY,
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    read_checkpoint_state,
    resolve,
    unparsable,
)
from attnres.checkpoint.load import load_checkpoint
from attnres.files import CHECKPOINT_DIR, TOKENIZER_FILE
from attnres.model import AttnResLM, ModelConfig
from attnres.residual.base import record_keys


def resolve_device(name: str) -> torch.device:
    """A device from ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(name, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"device={name!r} is invalid: use auto, cpu, cuda or cuda:N, e.g. --device cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device={name!r} but no CUDA device is available; use --device cpu")
    return torch.device(name)


def _check_counts(ckpt: Path, fpath: Path, config: ModelConfig, saved: dict[str, tuple]) -> None:
    """The fields that decide how many modules a model has (layers) and the embedding's shape, read
    off the safetensors header: a hostile ``n_layers=100000`` fails here in milliseconds, not after
    building 100,000 blocks (even on the meta device that takes minutes)."""
    layers = {int(k.split(".")[1]) for k in saved if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    n_layers = max(layers) + 1 if layers else 0
    wrong = []
    if config.n_layers != n_layers:
        wrong.append(f"n_layers={config.n_layers!r}, but the weights hold {n_layers} blocks")
    embed = saved.get("embed.weight")
    if embed is not None and embed != (config.vocab_size, config.d_model):
        wrong.append(f"vocab_size={config.vocab_size!r}, d_model={config.d_model!r}, but embed.weight is {embed}")
    if wrong:
        raise CheckpointError(
            f"model_config in {ckpt / STATE_FILE} does not match the tensors in {fpath}: {'; '.join(wrong)}; "
            "state.json was edited or belongs to another checkpoint. Fix: restore the checkpoint's own "
            "state.json from a backup"
        )


def check_config_fits_weights(ckpt: Path, config: ModelConfig) -> None:
    """Public name of :func:`_check_config_fits_weights` (the trainer's ``--resume`` checks with it too)."""
    _check_config_fits_weights(ckpt, config)


def _check_config_fits_weights(ckpt: Path, config: ModelConfig) -> None:
    """Compare the shapes ``config`` implies (a model built on the meta device: no memory) with the
    tensor shapes in the safetensors header, before the real model is allocated: ``state.json`` is
    not covered by a hash, and a hostile or edited one must not make us allocate a huge model."""
    fpath = resolve(ckpt) / MODEL_FILE
    try:
        with safe_open(str(fpath), framework="pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118  # a safe_open handle, not a dict
            aliases = json.loads((f.metadata() or {}).get(ALIAS_KEY, "{}"))
    except Exception as e:  # safetensors raises its own error types
        raise unparsable(fpath, e) from e
    for alias, src in aliases.items():
        if src in saved:
            saved[alias] = saved[src]
    _check_counts(ckpt, fpath, config, saved)  # before building anything: a model's size is bounded by the file's
    with torch.device("meta"):
        model = AttnResLM(config)
    records = set(record_keys(model))  # checked on load; absent from checkpoints saved before schemes kept one
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in records}
    saved = {k: v for k, v in saved.items() if k not in records}
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
    target = resolve_device(device)  # a bad --device before any work
    path = Path(run_or_checkpoint)
    ckpt = find_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(
            f"no checkpoint found at {path}; pass a run directory (holding {CHECKPOINT_DIR}/) or a checkpoint directory"
        )
    state = read_checkpoint_state(ckpt)
    try:
        config = ModelConfig.from_dict(state["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"model_config in {ckpt / STATE_FILE} is invalid: {e}") from e
    _check_config_fits_weights(ckpt, config)
    model = AttnResLM(config)
    load_checkpoint(ckpt, model=model, restore_rng=False)
    model.to(target).eval()
    tokenizer = None
    run_dir = ckpt.parent if ckpt.name == CHECKPOINT_DIR else ckpt
    if (run_dir / TOKENIZER_FILE).exists():
        from attnres.data import load_tokenizer

        tokenizer = load_tokenizer(str(run_dir / TOKENIZER_FILE))
    return model, tokenizer, state
