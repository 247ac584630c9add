"""Model directories: what one holds, and converting it into another format (``attnres convert``).

A source directory is one of four kinds (:data:`SOURCE_KINDS`):

``native``       a run or checkpoint directory of ``attnres train`` (``state.json``)
``attnres``      a Hugging Face directory of an ``AttnResForCausalLM`` (``model_type = "attnres"``)
``kimi_linear``  a Kimi Linear checkpoint (``model_type = "kimi_linear"``, or a multimodal one whose
                 text model is): plain PreNorm, retrofitted like a pretrained model, or the released
                 AttnRes layout of docs/method.md §10, loaded as the Block AttnRes it is
                 (``attnres.hf.kimi``)
``pretrained``   any other Hugging Face causal-LM directory, retrofitted by ``convert_to_attnres``:
                 into our own model where AttnResLM expresses it, else by wrapping its own layers
                 (``attnres.hf.retrofit``: the families of docs/hf.md); others are refused by name

:func:`convert_directory` writes native sources as Hugging Face directories, AttnRes
Hugging Face directories as native checkpoints, and retrofits pretrained models into
either format; every model with the Kimi Linear backbone can also be written as a Kimi
Linear checkpoint (``to="kimi_linear"``: §10 layout for Block AttnRes). Its errors name the
``attnres convert`` flags, since that is where the options come from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnres.checkpoint import STATE_FILE
from attnres.data import load_tokenizer
from attnres.files import (
    CHECKPOINT_DIR,
    LOCK_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    TOKENIZER_FILE,
    atomic_directory,
    nested_paths,
)
from attnres.hf.configuration import AttnResConfig
from attnres.hf.convert import ConversionError, convert_to_attnres, reading_model
from attnres.hf.modeling import (
    AttnResForCausalLM,
    hf_to_native,
    native_to_hf_with_tokenizer,
)
from attnres.hf.remote_code import refuse_remote_code
from attnres.hf.retrofit import check_family
from attnres.hf.tokenizer import copy_tokenizer_files, hf_tokenizer
from attnres.residual.options import is_positive_int

SOURCE_KINDS = ("native", "attnres", "kimi_linear", "pretrained")
OUTPUT_FORMATS = ("hf", "native", "kimi_linear")
RETROFIT_KINDS = ("pretrained", "kimi_linear")
HF_CONFIG_FILE = "config.json"  # Hugging Face's name; a native run has one too, beside its checkpoint
# retrofit options with a flag of their own; every other one is a ModelConfig field given with --set
RETROFIT_FLAGS = {
    "residual": "--residual",
    "attnres_blocks": "--attnres-blocks",
    "attnres_block_size": "--attnres-block-size",
    "max_seq_len": "--max-seq-len",
}
DEFAULT_RETROFIT_RESIDUAL = "block"


def source_kind(path) -> str:
    """Which of :data:`SOURCE_KINDS` the directory ``path`` is; ConversionError when it is none."""
    path = Path(path)
    if (path / STATE_FILE).is_file() or (path / CHECKPOINT_DIR / STATE_FILE).is_file():
        return "native"
    if (path / HF_CONFIG_FILE).is_file():
        try:
            config = json.loads((path / HF_CONFIG_FILE).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversionError(
                f"{path / HF_CONFIG_FILE} is not valid JSON ({e}); restore the model directory's config.json"
            ) from None
        if not isinstance(config, dict):
            raise ConversionError(
                f"{path / HF_CONFIG_FILE} holds a JSON {type(config).__name__}, not an "
                "object; restore the model directory's config.json"
            )
        if config.get("model_type") == AttnResConfig.model_type:
            _check_attnres_config(path / HF_CONFIG_FILE)
            return "attnres"
        if "model_type" not in config and ({"model", "train"} <= set(config) or (path / METRICS_FILE).is_file()):
            raise ConversionError(
                f"{path} is a run directory of attnres train without a checkpoint ({CHECKPOINT_DIR}/{STATE_FILE} "
                "is missing: the run stopped before it saved one); resume it to write one (attnres train --out "
                f"{path} --resume) or convert a run that has a checkpoint"
            )
        text_config = config.get("text_config")
        text = text_config if isinstance(text_config, dict) else {}
        return "kimi_linear" if "kimi_linear" in (config.get("model_type"), text.get("model_type")) else "pretrained"
    raise ConversionError(
        f"{path} is neither a Hugging Face model directory ({HF_CONFIG_FILE}) nor a run or "
        f"checkpoint directory of attnres train ({STATE_FILE})"
    )


def _check_attnres_config(file: Path) -> None:
    """An AttnRes config.json that ModelConfig refuses (heads not dividing the width, a layer count written
    as text) is named as such before any weight is read: the load would fail with the advice to copy the
    weight files again, which cannot help."""
    try:
        AttnResConfig.from_json_file(str(file))
    except ValueError as e:
        detail = " ".join(str(e).split()).rstrip(".")
        raise ConversionError(
            f"{file} is invalid: {detail}. Fix: correct that value (or restore the model directory's own config.json)"
        ) from None


def _check_request(src: Path, out: Path, kind: str, to: str, retrofit: dict[str, Any], force: bool) -> None:
    """The combinations ``attnres convert`` refuses, before anything is loaded."""
    if kind not in RETROFIT_KINDS and retrofit:
        flags = [flag for key, flag in RETROFIT_FLAGS.items() if key in retrofit]
        if set(retrofit) - set(RETROFIT_FLAGS):
            flags.append("--set")
        what = "a native checkpoint" if kind == "native" else "already AttnRes"
        raise ConversionError(
            f"{', '.join(flags)} apply only when retrofitting a pretrained "
            f"Hugging Face or Kimi Linear directory; {src} is {what}"
        )
    if to not in OUTPUT_FORMATS:
        raise ConversionError(f"--to {to}: choose one of {', '.join(OUTPUT_FORMATS)}")
    if (kind, to) in (("native", "native"), ("attnres", "hf")):
        raise ConversionError(f"{src} is already in the {to} format; pick --to {'hf' if to == 'native' else 'native'}")
    check_output_dir(src, out, force)


# what a directory written by attnres train holds besides its checkpoint (a run is never an output)
RUN_FILES = (CHECKPOINT_DIR, METRICS_FILE, SUMMARY_FILE, LOCK_FILE)
# what marks a directory as a model written earlier (by convert or save_pretrained), which --force replaces
MODEL_FILES = (HF_CONFIG_FILE, STATE_FILE)


def check_output_dir(src, out, force: bool) -> None:
    """ConversionError unless the output directory ``out`` may be written (and, with ``force``, replaced
    whole once the new one is complete; :func:`attnres.files.atomic_directory`): it does not exist or is
    empty, or ``force`` is given and it holds a model written earlier. A run directory of attnres train
    is never an output (its checkpoint would sit beside another model's config.json and tokenizer.json,
    and eval would read them), and --force never deletes a directory of other files."""
    src, out = Path(src), Path(out)
    nested = nested_paths(src, out)
    if nested is not None:
        raise ConversionError(f"{nested}; write the converted model to a directory outside {src}")
    check_writable(out, "directory")
    if not out.exists():
        return
    if not out.is_dir():
        raise ConversionError(f"{out} is a file, not a directory; choose a directory for the converted model")
    run = [name for name in RUN_FILES if (out / name).exists()]
    if run:
        raise ConversionError(
            f"{out} is a run directory of attnres train ({', '.join(run)}): converting into it would mix another "
            f"model's files with the run's; write to a new directory (such as {out}-converted)"
        )
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not force:
        raise ConversionError(
            f"{out} exists and is not empty; pass --force to replace it, or choose another output directory"
        )
    if not any((out / name).is_file() for name in MODEL_FILES):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ConversionError(
            f"{out} holds {shown} but no model ({' or '.join(MODEL_FILES)}): --force replaces a model directory "
            "written earlier, whole, and never deletes other files; choose a new or empty directory"
        )


def check_writable(out, what: str) -> None:
    """ConversionError unless a new ``what`` ("directory" or "file") can be created beside ``out``, where
    the output is staged before it is renamed into place: checked before the model is loaded, since a
    large source takes minutes to read and the write would fail only then, naming the hidden staging path."""
    import tempfile

    out = Path(out).absolute()
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the staging step creates the missing folders below the nearest one that exists
    fix = f"choose an output {what} in a folder you can write to"
    if not parent.is_dir():
        raise ConversionError(f"{out} cannot be written: {parent} is a file, not a directory; {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".attnres-write-check-", dir=parent))
    except OSError as e:
        raise ConversionError(f"{out} cannot be written: {parent}: {e.strerror or e}; {fix}") from None


LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


def check_layer_count(src: Path) -> None:
    """A Hugging Face directory whose config.json claims more (or fewer) decoder layers than its safetensors
    weights hold is refused from the headers alone, before a model of that size is built (a config claiming
    20,000 layers took minutes to fail). pytorch_model*.bin weights are read with torch.load(weights_only=True,
    mmap=True): tensors only, their data mapped, not read."""
    import re

    config = json.loads((src / HF_CONFIG_FILE).read_text(encoding="utf-8"))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    field = next((f for f in LAYER_COUNT_FIELDS if isinstance(text.get(f), int)), None)
    files = sorted(src.glob("*.safetensors"))
    bins = [] if files else sorted(src.glob("pytorch_model*.bin"))
    if field is None or not (files or bins):
        return
    names: list[str] = []
    for path in bins:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # a legacy (non-zip) file, or objects other than tensors: the loader names the file
            return
        names += [str(k) for k in state] if isinstance(state, dict) else []
    for path in files:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= 100_000_000:
                return  # not a safetensors header: the loader names the file
            try:
                names += [k for k in json.loads(f.read(size)) if k != "__metadata__"]
            except ValueError:
                return
    # the decoder's own stack only (a multimodal release's vision tower has layers of its own)
    stack = re.compile(
        r"^(?:model\.|transformer\.|gpt_neox\.|language_model\.model\.|model\.language_model\.)"
        r"(?:layers|h)\.(\d+)\."
    )
    found = {int(m.group(1)) for name in names if (m := stack.match(name))}
    if found and max(found) + 1 != text[field]:
        raise ConversionError(
            f"{src / HF_CONFIG_FILE} says {field}={text[field]}, but the weights hold {max(found) + 1} layers; "
            "restore the model directory's config.json (or copy its weights again)"
        )


def convert_directory(
    source,
    out,
    *,
    to: str | None = None,
    retrofit: dict[str, Any] | None = None,
    dtype: str | None = None,
    verify: bool = True,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Convert the model directory ``source`` into ``out``; returns the directory written.

    ``to``: "hf", "native" or "kimi_linear" (default: native for an AttnRes Hugging Face source, else
    hf); "kimi_linear" takes models with the Kimi Linear backbone (prenorm, or Block AttnRes in the
    released layout of docs/method.md §10). ``retrofit``: options for :func:`convert_to_attnres` /
    :func:`attnres.hf.kimi.convert_kimi_linear` (``residual``, default "block"; ``attnres_blocks``,
    ``attnres_block_size``, ``max_seq_len`` and other ModelConfig fields), only for pretrained and
    plain Kimi Linear sources. ``dtype``: a torch dtype name for the weights ("auto" or None: the
    source's). ``verify``: load the pretrained source as well and report the largest logit
    difference. ``force``: replace an ``out`` that holds a model written earlier (:func:`check_output_dir`).
    The whole output is written into a hidden sibling of ``out`` and renamed to it once complete, so a
    failure leaves no partial ``out`` and an old one intact. The tokenizer travels along. Progress lines
    go to ``log``.
    """
    src, out = Path(source), Path(out)
    retrofit = dict(retrofit or {})
    kind = source_kind(src)
    to = to or ("native" if kind == "attnres" else "hf")
    _check_request(src, out, kind, to, retrofit, force)
    if kind in ("pretrained", "kimi_linear", "attnres"):
        refuse_remote_code(src)
        refuse_retrofit(src)
        check_layer_count(src)
    dtype = None if dtype in (None, "auto") else getattr(torch, dtype)

    tokenizer = None
    if kind == "native":
        model, tokenizer = native_to_hf_with_tokenizer(src)
        if dtype is not None:
            model = model.to(dtype)
    elif kind == "attnres":
        from transformers import AutoModelForCausalLM

        with reading_model(src):
            model = AutoModelForCausalLM.from_pretrained(
                str(src), local_files_only=True, trust_remote_code=False, **({} if dtype is None else {"dtype": dtype})
            )
    elif kind == "kimi_linear":
        with reading_model(src):
            model = _convert_kimi_linear(src, retrofit, dtype, verify, log)
    else:
        model = _retrofit(src, retrofit, dtype, verify, log, to)

    with atomic_directory(out, replace=True) as tmp:
        message = _write(model, tmp, src, out, kind, to, tokenizer)
    log(message)
    return out


def _write(model, tmp: Path, src: Path, out: Path, kind: str, to: str, tokenizer) -> str:
    """Write ``model`` in the format ``to`` into the staging directory ``tmp`` (renamed to ``out`` once
    complete); returns the line that says what was written."""
    if to == "hf":
        model.save_pretrained(str(tmp))
        if kind == "native":
            if tokenizer is not None:
                hf_tokenizer(tokenizer).save_pretrained(str(tmp))
            return (
                f"native checkpoint {src} -> Hugging Face AttnResForCausalLM in {out}"
                f"{'' if tokenizer is None else ' (with its tokenizer)'}"
            )
        copied = copy_tokenizer_files(src, tmp)
        return f"written {out}{' with ' + ', '.join(copied) if copied else ''}"
    if to == "kimi_linear":
        from attnres.hf.kimi import save_kimi_linear

        save_kimi_linear(model, tmp)
        if kind == "native":  # the run's own tokenizer, as for --to hf: llama.cpp and mlx-lm need the vocabulary
            copied = []
            if tokenizer is not None:
                hf_tokenizer(tokenizer).save_pretrained(str(tmp))
                copied = ["its tokenizer"]
        else:
            copied = copy_tokenizer_files(src, tmp)
        c = model.config.model_config()
        layout = "plain (PreNorm)" if c.residual == "prenorm" else "the AttnRes layout of docs/method.md §10"
        return f"written Kimi Linear checkpoint {out}, {layout}{' with ' + ', '.join(copied) if copied else ''}"
    tokenizer = load_tokenizer(src / TOKENIZER_FILE) if (src / TOKENIZER_FILE).is_file() else None
    hf_to_native(model, tmp, tokenizer)
    return f"written native weights-only checkpoint {out} (attnres sample / load_model read it)"


def refuse_retrofit(src: Path) -> None:
    """A wrapped retrofit (``model_type = "attnres_retrofit"``) is AttnRes already, around its source
    family's own layers: nothing converts it further (its layers have no native or Kimi Linear form)."""
    config = json.loads((src / HF_CONFIG_FILE).read_text(encoding="utf-8"))  # source_kind read it already
    options = config.get("attnres_retrofit")
    if config.get("model_type") != "attnres_retrofit" and not isinstance(options, dict):
        return
    family = options.get("source_model_type", "?") if isinstance(options, dict) else "?"
    raise ConversionError(
        f"{src} is already retrofitted: AttnRes around a {family} model's own layers (model_type "
        "'attnres_retrofit', the wrapped layout), which has no native, Kimi Linear, GGUF or MLX form; load it "
        "with AutoModelForCausalLM.from_pretrained to train, evaluate or serve it (docs/hf.md)"
    )


def _check_before_loading(src: Path, retrofit: dict[str, Any]) -> None:
    """What config.json and the flags alone decide, before any weight is read: the depth-block counts,
    and (for the wrapped layout, the default) whether the source's family can be wrapped at all."""
    for key, flag in (("attnres_blocks", "--attnres-blocks"), ("attnres_block_size", "--attnres-block-size")):
        value = retrofit.get(key)
        if value is not None and not is_positive_int(value):
            raise ConversionError(f"{flag} {value!r}: must be a positive integer (depth blocks / sublayers per block)")
    native_only = retrofit.get("max_seq_len") is not None or retrofit.get("attnres_scale_norm_eps") is False
    if retrofit.get("layout", "auto") == "wrapped" or (retrofit.get("layout", "auto") == "auto" and not native_only):
        config = json.loads((src / HF_CONFIG_FILE).read_text(encoding="utf-8"))  # source_kind read it already
        if config.get("attnres_retrofit") is None:
            check_family(str(config.get("model_type")))


def _retrofit(src: Path, retrofit: dict[str, Any], dtype, verify: bool, log, to: str = "hf"):
    """A pretrained directory as AttnRes (``convert_to_attnres``): wrapped or native (``--set layout=...``;
    ``--to native`` needs the native layout, our own AttnResLM)."""
    from transformers import AutoModelForCausalLM

    from attnres.hf.retrofit import family_name, max_logit_difference

    retrofit.setdefault("residual", DEFAULT_RETROFIT_RESIDUAL)
    if to == "native":
        if retrofit.get("layout", "native") != "native":
            raise ConversionError(
                f"--to native takes the native layout (our own AttnResLM), not "
                f"--set layout={retrofit['layout']}; write --to hf for the wrapped one"
            )
        retrofit["layout"] = "native"
    _check_before_loading(src, retrofit)
    load_kw = {
        "local_files_only": True,
        "output_loading_info": True,
        "trust_remote_code": False,
        **({} if dtype is None else {"dtype": dtype}),
    }
    with reading_model(src):
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(src), **load_kw)
    pretrained, info = loaded  # with output_loading_info: (model, {"missing_keys": ..., ...})
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would start these at random: a config and weights of different models
        raise ConversionError(
            f"{src / HF_CONFIG_FILE} describes a {pretrained.config.model_type} model whose weights are not in "
            f"{src} ({len(missing)} missing, e.g. {missing[0]}): config.json and the weights come from different "
            "models; restore the model directory's own config.json"
        )
    model = convert_to_attnres(pretrained.eval(), copy_weights=False, **retrofit)
    err, family = None, None
    if verify:
        err = max_logit_difference(pretrained, model)
        family = family_name(pretrained.config)
    c = model.config
    if isinstance(model, AttnResForCausalLM):
        blocks = f", {c.model_config().num_blocks} depth blocks" if c.residual == "block" else ""
        what = f"native layout (AttnResLM), {c.n_layers} layers, d_model={c.d_model} -> residual={c.residual}{blocks}"
    else:
        options = c.attnres_retrofit
        family = options["source_model_type"]
        scheme = model.attnres
        blocks = f", {scheme.num_blocks} depth blocks" if options["residual"] == "block" else ""
        what = (
            f"wrapped layout (its own layers), {c.num_hidden_layers} layers, {scheme.n_sublayers} sublayers, "
            f"hidden_size={c.hidden_size} -> residual={options['residual']}{blocks}"
        )
    log(f"{src}: family {family or c.model_type}, {what}")
    if err is not None:
        log(
            f"max |logit difference| source vs AttnRes on random tokens: {err:.3g} ({model.dtype}; family "
            f"{family}; zero queries and eps scaled by c_l^2 make them equal to rounding, docs/hf.md)"
        )
    return model


def _convert_kimi_linear(src: Path, retrofit: dict[str, Any], dtype, verify: bool, log) -> AttnResForCausalLM:
    """A Kimi Linear directory: a plain one retrofitted (``residual`` default "block"), a §10 one as is."""
    from transformers import AutoConfig

    from attnres.hf.kimi import (
        attn_res_block_size,
        convert_kimi_linear,
        kimi_conversion_error,
    )
    from attnres.hf.kimi.k3 import read_k3_config
    from attnres.model.backbones import layer_kinds

    refuse_remote_code(src)
    config = read_k3_config(src) or AutoConfig.from_pretrained(str(src), local_files_only=True, trust_remote_code=False)
    released = attn_res_block_size(config) is not None
    if not released:
        retrofit.setdefault("residual", DEFAULT_RETROFIT_RESIDUAL)
    residual = retrofit.pop("residual", None)
    model = convert_kimi_linear(src, residual, dtype=dtype, **retrofit)
    c = model.config.model_config()
    blocks = f", {c.num_blocks} depth blocks of S={c.block_size}" if c.residual == "block" else ""
    log(
        f"{src}: kimi_linear{' (AttnRes layout, docs/method.md §10)' if released else ''}, {c.n_layers} layers "
        f"({''.join(layer_kinds(c))}), d_model={c.d_model}{f', {c.moe_experts} experts' if c.moe_experts else ''}"
        f" -> residual={c.residual}{blocks}"
    )
    if verify and not released:
        err = kimi_conversion_error(src, model)
        log(
            f"max |logit difference| transformers' KimiLinearForCausalLM vs converted, random tokens: {err:.3g} "
            f"({model.dtype}; transformers' RMSNorm computes in float32)"
        )
    return model
