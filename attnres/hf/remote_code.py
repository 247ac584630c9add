"""Model directories are read, never run: no python file of a source directory is ever imported.

transformers' Auto classes import a directory's own python files when its config.json names them
(``auto_map``) for a model type transformers does not implement, and on a terminal they ask "Do you
wish to run the custom code? [y/N]" first. :func:`refuse_remote_code` refuses such a directory before
transformers is asked; every call into transformers on a user's directory passes
``trust_remote_code=False`` as well, so a config.json that names custom code for a type transformers
does implement loads with transformers' own class.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnres.hf.errors import ConversionError

CONFIG_FILE = "config.json"
# the model types attnres implements itself: AttnResConfig's, the wrapped retrofit's (registered with
# transformers by ``import attnres.hf``) and Kimi K3's (read by attnres.hf.kimi); spelled out here because
# those modules import this one (tests/hf/test_convert.py checks that they agree)
OWN_MODEL_TYPES = ("attnres", "attnres_retrofit", "kimi_k3")


def _known(model_type: object) -> bool:
    """Whether loading ``model_type`` runs code of transformers or attnres only."""
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and (model_type in CONFIG_MAPPING or model_type in OWN_MODEL_TYPES)


def refuse_remote_code(path) -> None:
    """ConversionError, in one line, when loading the model directory ``path`` through transformers could
    run code from it: config.json names no model type, or one that neither transformers nor attnres
    implements (its ``auto_map`` python files would be the model). A missing or unreadable config.json
    is left to the caller, which says what it expected."""
    path = Path(path)
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        return
    model_type = config.get("model_type")
    if _known(model_type):
        return
    auto_map = config.get("auto_map")
    if auto_map:
        targets = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
        modules = sorted({str(t).split("--")[-1].rsplit(".", 1)[0] + ".py" for t in targets if isinstance(t, str)})
        raise ConversionError(
            f"{file} asks to run custom code: model_type={model_type!r} is not a model transformers implements, "
            f"and its auto_map points at python files of {path} ({', '.join(modules) or 'auto_map'}); attnres never "
            "runs code from a model directory (no trust_remote_code). Use a checkpoint of a model type transformers "
            "ships (docs/hf.md lists the families)"
        )
    import transformers

    if model_type is None:  # transformers would guess the model from the directory's name
        raise ConversionError(
            f"{file} names no model_type, so transformers cannot tell which model it is; restore the model "
            "directory's config.json"
        )
    raise ConversionError(
        f"{file} has model_type={model_type!r}, which transformers {transformers.__version__} does not implement "
        "(a model from custom code, or a newer transformers); restore the model directory's config.json or "
        "upgrade transformers"
    )
