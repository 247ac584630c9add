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

Modules: ``format`` (file names, ``state.json``, the file-system steps), ``save``, ``load``,
``discovery`` (``latest_checkpoint``, ``find_checkpoint``) and ``trained`` (``load_model``).
"""

from attnres.checkpoint.discovery import find_checkpoint, latest_checkpoint
from attnres.checkpoint.format import (
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIM_FILE,
    RNG_FILE,
    STATE_FILE,
    CheckpointError,
    read_checkpoint_state,
)
from attnres.checkpoint.load import load_checkpoint
from attnres.checkpoint.save import save_checkpoint
from attnres.checkpoint.trained import load_model, resolve_device

__all__ = [
    "FORMAT_VERSION",
    "MODEL_FILE",
    "OPTIM_FILE",
    "RNG_FILE",
    "STATE_FILE",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "find_checkpoint",
    "read_checkpoint_state",
    "load_model",
    "resolve_device",
]
