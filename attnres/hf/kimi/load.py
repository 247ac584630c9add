"""Kimi Linear checkpoints (directories or transformers models) as our models: ``convert_kimi_linear``,
and ``kimi_conversion_error``, which checks a conversion against transformers' own model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from attnres.hf.convert import (
    ConversionError,
    check_state_fits,
    read_safetensors_dir,
    read_source_config,
)
from attnres.hf.errors import check_loading_info, quiet_load_report
from attnres.hf.kimi.k3 import read_k3_config
from attnres.hf.kimi.k3_layout import k3_model_fields, runtime_names
from attnres.hf.kimi.layout import (
    MULTIMODAL_PREFIX,
    attn_res_block_size,
    kimi_model_fields,
    layout_residual,
    map_weights,
    strip_prefix,
    text_config,
)
from attnres.hf.kimi.mxfp4 import dequantize_packed
from attnres.hf.modeling import AttnResForCausalLM
from attnres.model.config import ModelConfig
from attnres.model.llama import rope_tables
from attnres.model.lm import AttnResLM
from attnres.residual import build_residual


def _runtime_name(name: str) -> str:
    """A stored tensor name under transformers' module names, by the pure renames of transformers'
    kimi_linear conversion mapping (merged tensors such as the expert stacks keep their stored name)."""
    import re

    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    for rule in get_checkpoint_conversion_mapping("kimi_linear") or []:
        if isinstance(rule, WeightRenaming):
            for source, target in zip(rule.source_patterns, rule.target_patterns, strict=False):
                name = re.sub(source, target, name)
    return name


def _load_directory(path: Path, config) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory under transformers' runtime names.

    Released Kimi Linear checkpoints store the original layout (per-expert ``w1``/``w2``/``w3`` under
    ``block_sparse_moe``, three short convolutions, the forget gate beside the attention); transformers
    turns it into its modules' layout while loading (its conversion mapping for ``kimi_linear``), so
    the text model is loaded by ``KimiLinearForCausalLM.from_pretrained``, in float64 (exact for every
    float checkpoint) and without its float32-pinned modules, which would round float64 weights. What
    transformers does not take (the §10 depth-attention weights, and anything the model has no place
    for) comes back under its stored name, for :func:`map_weights` to place or reject."""
    from transformers import KimiLinearForCausalLM

    raw = read_safetensors_dir(path)
    if raw is None:
        raise ConversionError(
            f"{path} holds no model.safetensors (or sharded index); Kimi Linear "
            "checkpoints convert from safetensors only"
        )
    for name, t in raw.items():
        if not t.is_floating_point():
            raise ConversionError(
                f"cannot convert: {name} is a {t.dtype} tensor (quantised weights); only "
                "float checkpoints convert, dequantise first"
            )
    prefixed = any(k.startswith(MULTIMODAL_PREFIX) for k in raw)
    raw = strip_prefix(raw)

    class Float64Loader(KimiLinearForCausalLM):
        _keep_in_fp32_modules_strict = None  # type: ignore[assignment]  # float64 throughout: keep nothing float32

    text = text_config(config)
    text._experts_implementation = "eager"
    with quiet_load_report():
        loaded: Any = Float64Loader.from_pretrained(
            str(path),
            config=text,
            dtype=torch.float64,
            local_files_only=True,
            output_loading_info=True,
            # a tensor of another shape comes back in the report, named, instead of a RuntimeError pointing at a log
            ignore_mismatched_sizes=True,
            key_mapping={"^" + MULTIMODAL_PREFIX.replace(".", r"\."): ""} if prefixed else None,
        )
    model, info = loaded  # with output_loading_info: (model, {missing_keys: ..., ...})
    # unexpected tensors come back below under their stored names, for map_weights to place or refuse
    check_loading_info(path, {**info, "unexpected_keys": []}, "Kimi Linear model")
    # transformers builds the router and dt_bias in float32 whatever the dtype: those are plain renames,
    # taken from the files as stored (through transformers' own renaming rules) so nothing is rounded
    stored = {_runtime_name(k): v for k, v in raw.items()}
    tensors = {k: stored[k] if k in stored and stored[k].shape == v.shape else v for k, v in model.state_dict().items()}
    dtype = raw["model.embed_tokens.weight"].dtype  # the checkpoint's: float64 loading rounds nothing
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors.update({k: v for k, v in raw.items() if k in set(info.get("unexpected_keys") or [])})
    return tensors


def _load_k3_directory(path: Path, config) -> dict[str, torch.Tensor]:
    """The tensors of a K3 directory under transformers' runtime names (pure renames and splits of
    the released names, ``attnres.hf.kimi.k3_layout``; nothing is rounded)."""
    raw = read_safetensors_dir(path)
    if raw is None:
        raise ConversionError(
            f"{path} holds no model.safetensors (or sharded index); K3 checkpoints convert from safetensors only"
        )
    raw = dequantize_packed(raw)  # K3's MXFP4 experts, to float32 exactly
    for name, t in raw.items():
        if not t.is_floating_point():
            raise ConversionError(
                f"cannot convert: {name} is a {t.dtype} tensor (quantised weights other than MXFP4 "
                "weight_packed / weight_scale pairs); dequantise first"
            )
    fields = k3_model_fields(config.k3_text)
    return runtime_names(strip_prefix(raw), ModelConfig(**fields))


def _model_fields(config, max_seq_len: int | None = None) -> dict[str, Any]:
    """ModelConfig fields of a Kimi Linear config, or of a K3 one (``read_k3_config``'s)."""
    text = getattr(config, "k3_text", None)
    return k3_model_fields(text, max_seq_len) if text is not None else kimi_model_fields(config, max_seq_len)


def _load_source(source) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, tensors under transformers' runtime names) of a checkpoint directory or a transformers
    model object."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        config = read_k3_config(path) or read_source_config(
            path, "a kimi_linear checkpoint directory (config.json + safetensors)"
        )
        _model_fields(config)  # what the backbone cannot express fails before anything is loaded
        if getattr(config, "k3_text", None) is not None:
            return config, _load_k3_directory(path, config)
        return config, _load_directory(path, config)
    config = getattr(source, "config", None)
    if config is None or not hasattr(source, "state_dict"):
        raise ConversionError(
            f"cannot convert a {type(source).__name__}: pass a KimiLinearForCausalLM or a checkpoint directory"
        )
    return config, {k: v.detach() for k, v in source.state_dict().items()}


def build_lm(
    model_config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> AttnResLM:
    """An AttnResLM holding ``weights`` (our names, non-residual) and, if given, the depth-attention
    ``queries`` / ``key_norm_weight``; other residual parameters at their initialisation (zero
    queries). The tensors are copied (a source model object is never shared)."""
    dtype = dtype or weights["embed.weight"].dtype
    state = {k: v.detach().to(dtype=dtype).clone() for k, v in weights.items()}
    if "lm_head.weight" not in state:
        if not model_config.tie_embeddings:
            raise ConversionError("the checkpoint has no lm_head.weight and does not tie its embeddings")
    elif model_config.tie_embeddings:
        del state["lm_head.weight"]
    for k, v in build_residual(model_config).state_dict().items():
        state[f"residual.{k}"] = (residual[k] if residual is not None and k in residual else v).to(dtype).clone()
    with torch.device("meta"):
        lm = AttnResLM(model_config)
    expected = lm.state_dict()
    if model_config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    check_state_fits(state, expected, "checkpoint")
    # integer buffers keep their dtype; the routers' balancing bias is never below float32 (transformers
    # pins it there in 16-bit models), and float64 where the weights are (bit-exact round trips)
    for k, v in expected.items():
        if not v.is_floating_point():
            state[k] = state[k].to(v.dtype)
        elif k.endswith("e_score_correction_bias"):
            state[k] = weights[k].to(torch.promote_types(dtype, torch.float32)).clone()
    lm.load_state_dict(state, strict=not model_config.tie_embeddings, assign=True)
    if model_config.tie_embeddings:
        lm.lm_head.weight = lm.embed.weight
    cos, sin = rope_tables(model_config.rope_dim, model_config.max_seq_len, model_config.rope_theta)
    lm.rope_cos, lm.rope_sin = cos, sin
    return lm.eval()


def convert_kimi_linear(
    source,
    residual: str | None = None,
    *,
    attnres_blocks: int | None = None,
    attnres_block_size: int | None = None,
    max_seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    **model_options,
) -> AttnResForCausalLM:
    """A ``kimi_linear`` checkpoint (directory or ``KimiLinearForCausalLM``) as our
    :class:`AttnResForCausalLM` with ``backbone="kimi_linear"``.

    A §10 checkpoint (``attn_res_block_size`` set) loads as the Block AttnRes it is; ``residual``
    and the block options must then be left unset. A plain checkpoint is retrofitted: ``residual``
    "block" (default; ``attnres_blocks`` = N or ``attnres_block_size`` = S, default ModelConfig's
    rule), "full" or "prenorm"; zero queries and ``attnres_scale_norm_eps=True`` (override it in
    ``model_options``) keep the logits equal to the source's to rounding. ``max_seq_len``: the
    longest input (default: the source's ``max_position_embeddings``). ``dtype``: cast (default: keep).
    ``model_options``: other ModelConfig fields (``attnres_impl``, ``moe_bias_update_rate``, ...).
    """
    config, tensors = _load_source(source)
    fields = _model_fields(config, max_seq_len)
    b = attn_res_block_size(config)
    options = dict(model_options)
    if b is not None:
        given = [
            k
            for k, v in (
                ("residual", residual),
                ("attnres_blocks", attnres_blocks),
                ("attnres_block_size", attnres_block_size),
            )
            if v is not None
        ]
        given += [k for k in ("attnres_scale_norm_eps",) if k in options]
        if given:
            raise ConversionError(
                f"{given} cannot be set: the checkpoint is already Block AttnRes "
                f"(attn_res_block_size={b}, docs/method.md §10)"
            )
        options.update(layout_residual(fields["n_layers"], b))
    else:
        residual = residual or "block"
        if residual not in ("block", "full", "prenorm"):
            raise ConversionError(
                f"residual={residual!r}: a retrofit keeps the model's outputs only for block, full or prenorm"
            )
        options["residual"] = residual
        if residual in ("block", "full"):
            options.setdefault("attnres_scale_norm_eps", True)
        if attnres_blocks is not None:
            options["attnres_blocks"] = attnres_blocks
        if attnres_block_size is not None:
            options["attnres_block_size"] = attnres_block_size
    fixed = sorted(set(model_options) & set(fields))
    if fixed:
        raise ConversionError(f"{fixed} come from the checkpoint and cannot be set")
    weights, res = map_weights(tensors, fields["n_layers"], fields["d_model"], has_residual=b is not None)
    fields["tie_embeddings"] = "lm_head.weight" not in weights and bool(
        getattr(text_config(config), "tie_word_embeddings", False)
    )
    try:
        model_config = ModelConfig(**{**fields, **options})
    except (TypeError, ValueError) as e:
        raise ConversionError(f"cannot build the AttnRes model: {e}") from e
    lm = build_lm(model_config, weights, res, dtype)
    special = {k: getattr(text_config(config), k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return AttnResForCausalLM.from_attnres_lm(lm, **{k: v for k, v in special.items() if v is not None}).eval()


@torch.no_grad()
def kimi_conversion_error(
    source, converted: AttnResForCausalLM, input_ids: torch.Tensor | None = None, seed: int = 0
) -> float:
    """Max |logit difference| between transformers' Kimi Linear model of ``source`` (a directory or a
    model object) and ``converted``, on ``input_ids`` (default 2 x 16 random tokens)."""
    from transformers import KimiLinearForCausalLM

    reference = (
        source
        if not isinstance(source, (str, os.PathLike))
        else KimiLinearForCausalLM.from_pretrained(str(source), local_files_only=True, dtype=converted.dtype).eval()
    )
    reference.config._experts_implementation = "eager"
    if input_ids is None:
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(
            0, converted.config.vocab_size, (2, min(16, converted.config.max_seq_len)), generator=gen
        )
    a = reference(input_ids).logits.double()
    b = converted(input_ids).logits.double()
    return (a - b).abs().max().item()
