"""Model directories: what one holds, and converting it into another format (``attnres convert``).

A source directory is one of three kinds (:data:`SOURCE_KINDS`):

``native``      a run or checkpoint directory of ``attnres train`` (``state.json``)
``attnres``     a Hugging Face directory of an ``AttnResForCausalLM`` (``model_type = "attnres"``)
``pretrained``  any other Hugging Face causal-LM directory: a LLaMA / Mistral / Qwen2 model to
                retrofit (``convert_to_attnres`` rejects the architectures it cannot express)

:func:`convert_directory` writes native sources as Hugging Face directories, AttnRes
Hugging Face directories as native checkpoints, and retrofits pretrained models into
either format. Its errors name the ``attnres convert`` flags, since that is where the
options come from.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from attnres.checkpoint import STATE_FILE, load_model
from attnres.files import CHECKPOINT_DIR, TOKENIZER_FILE
from attnres.hf.configuration import AttnResConfig
from attnres.hf.convert import (ConversionError, conversion_error, convert_to_attnres, copy_tokenizer_files,
                                hf_tokenizer)
from attnres.hf.modeling import AttnResForCausalLM, hf_to_native

SOURCE_KINDS = ("native", "attnres", "pretrained")
HF_CONFIG_FILE = "config.json"  # Hugging Face's name; a native run has one too, beside its checkpoint
# retrofit options with a flag of their own; every other one is a ModelConfig field given with --set
RETROFIT_FLAGS = {"residual": "--residual", "attnres_blocks": "--attnres-blocks",
                  "attnres_block_size": "--attnres-block-size", "max_seq_len": "--max-seq-len"}
DEFAULT_RETROFIT_RESIDUAL = "block"


def source_kind(path) -> str:
    """Which of :data:`SOURCE_KINDS` the directory ``path`` is; ConversionError when it is none."""
    path = Path(path)
    if (path / STATE_FILE).is_file() or (path / CHECKPOINT_DIR / STATE_FILE).is_file():
        return "native"
    if (path / HF_CONFIG_FILE).is_file():
        model_type = json.loads((path / HF_CONFIG_FILE).read_text()).get("model_type")
        return "attnres" if model_type == AttnResConfig.model_type else "pretrained"
    raise ConversionError(f"{path} is neither a Hugging Face model directory ({HF_CONFIG_FILE}) nor a run or "
                          f"checkpoint directory of attnres train ({STATE_FILE})")


def _check_request(src: Path, out: Path, kind: str, to: str, retrofit: Dict[str, Any], force: bool) -> None:
    """The combinations ``attnres convert`` refuses, before anything is loaded."""
    if kind != "pretrained" and retrofit:
        flags = [flag for key, flag in RETROFIT_FLAGS.items() if key in retrofit]
        if set(retrofit) - set(RETROFIT_FLAGS):
            flags.append("--set")
        what = "a native checkpoint" if kind == "native" else "already AttnRes"
        raise ConversionError(f"{', '.join(flags)} apply only when retrofitting a pretrained "
                              f"LLaMA / Mistral / Qwen2 directory; {src} is {what}")
    if (kind, to) in (("native", "native"), ("attnres", "hf")):
        raise ConversionError(f"{src} is already in the {to} format; pick --to {'hf' if to == 'native' else 'native'}")
    if to == "hf" and out.exists() and any(out.iterdir()) and not force:
        raise ConversionError(f"{out} exists and is not empty; pass --force to write into it")


def convert_directory(source, out, *, to: Optional[str] = None, retrofit: Optional[Dict[str, Any]] = None,
                      dtype: Optional[str] = None, verify: bool = True, force: bool = False,
                      log: Callable[[str], None] = print) -> Path:
    """Convert the model directory ``source`` into ``out``; returns the directory written.

    ``to``: "hf" or "native" (default: native for an AttnRes Hugging Face source, else hf).
    ``retrofit``: options for :func:`convert_to_attnres` (``residual``, default "block";
    ``attnres_blocks``, ``attnres_block_size``, ``max_seq_len`` and other ModelConfig fields), only
    for pretrained sources. ``dtype``: a torch dtype name for the weights ("auto" or None: the
    source's). ``verify``: load the pretrained source as well and report the largest logit
    difference. ``force``: write a Hugging Face directory into a non-empty ``out``. The tokenizer
    travels along. Progress lines go to ``log``.
    """
    src, out = Path(source), Path(out)
    retrofit = dict(retrofit or {})
    kind = source_kind(src)
    to = to or ("native" if kind == "attnres" else "hf")
    _check_request(src, out, kind, to, retrofit, force)
    dtype = None if dtype in (None, "auto") else getattr(torch, dtype)

    if kind == "native":
        lm, tokenizer, _ = load_model(str(src))
        model = AttnResForCausalLM.from_attnres_lm(lm)
        if dtype is not None:
            model = model.to(dtype)
        model.save_pretrained(str(out))
        if tokenizer is not None:
            hf_tokenizer(tokenizer).save_pretrained(str(out))
        log(f"native checkpoint {src} -> Hugging Face AttnResForCausalLM in {out}"
            f"{'' if tokenizer is None else ' (with its tokenizer)'}")
        return out

    from transformers import AutoModelForCausalLM

    load_kw = {"local_files_only": True, **({} if dtype is None else {"dtype": dtype})}
    if kind == "attnres":
        model = AutoModelForCausalLM.from_pretrained(str(src), **load_kw)
    else:
        retrofit.setdefault("residual", DEFAULT_RETROFIT_RESIDUAL)
        if verify:
            pretrained = AutoModelForCausalLM.from_pretrained(str(src), **load_kw).eval()
            model = convert_to_attnres(pretrained, copy_weights=False, **retrofit)
            err = conversion_error(pretrained, model)
            log(f"max |logit difference| source vs AttnRes on random tokens: {err:.3g} "
                f"({model.dtype}; zero queries make them equal up to RMSNorm eps, see attnres.hf.convert)")
        else:
            model = convert_to_attnres(str(src), dtype=dtype, **retrofit)
        c = model.config
        blocks = f", {c.model_config().num_blocks} depth blocks" if c.residual == "block" else ""
        log(f"{src}: {c.n_layers} layers, d_model={c.d_model} -> residual={c.residual}{blocks}")
        if to == "hf":
            model.save_pretrained(str(out))
            copied = copy_tokenizer_files(src, out)
            log(f"written {out}{' with ' + ', '.join(copied) if copied else ''}")
            return out
    path = hf_to_native(model, out)
    if (src / TOKENIZER_FILE).is_file():
        shutil.copy2(src / TOKENIZER_FILE, path / TOKENIZER_FILE)
    log(f"written native weights-only checkpoint {path} (attnres sample / load_model read it)")
    return path
