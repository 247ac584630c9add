"""Kimi Linear checkpoints <-> attnres: retrofit, and the released AttnRes layout (docs/method.md §10).

A ``kimi_linear`` checkpoint directory (config.json + safetensors) is one of two things:

- a plain Kimi Linear model (no ``attn_res_block_size``): PreNorm residuals. It converts into our
  ``backbone="kimi_linear"`` model with the residual of your choice; "block" and "full" start with
  zero queries and ``attnres_scale_norm_eps``, so the logits equal the source's to rounding
  (docs/method.md §3, as ``attnres.hf.convert_to_attnres`` does for LLaMA), and "prenorm" is the same
  function exactly (transformers' own sublayers and norms, the same additions).
- the released AttnRes layout (Kimi K3): ``attn_res_block_size`` = B in config.json and, per layer
  i, ``model.layers.{i}.self_attention_res_proj.weight`` [1, d] / ``..._res_norm.weight`` [d] for
  the attention input and ``mlp_res_*`` for the MLP input, plus ``model.output_attn_res_*`` for the
  final norm's input (all possibly under ``language_model.``). It is our Block AttnRes with
  S = min(2B, L) and plain norm eps (docs/method.md §10), and loads exactly.

``save_kimi_linear`` writes our models back: prenorm as a plain Kimi Linear checkpoint (loads in
transformers' ``KimiLinearForCausalLM``), Block AttnRes with even S (or one depth block) in the §10
layout. After ``import attnres.hf``, ``AutoModelForCausalLM.from_pretrained`` on a §10 directory
returns our model (``AttnResForCausalLM``); plain Kimi Linear directories still get transformers'
own class.

Everything a checkpoint may hold that these models do not implement (another activation, grouped
or differently activated routing, attention biases, quantised weights, vision towers or other
unknown tensors) is rejected with a :class:`ConversionError` naming it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from attnres.hf.configuration import AttnResConfig
from attnres.hf.convert import ConversionError, _read_safetensors_dir, check_state_fits, read_source_config
from attnres.hf.modeling import AttnResForCausalLM
from attnres.model.backbones import KDA, MLA
from attnres.model.config import ModelConfig
from attnres.model.llama import AttnResLM, rope_tables
from attnres.residual import build_residual

MULTIMODAL_PREFIX = "language_model."
_LAYER_TYPES = {"linear_attention": KDA, "full_attention": MLA}
# the sublayer input each pair of depth-attention weights serves, per decoder layer (docs/method.md §10)
_RES_SITES = ("self_attention_res", "mlp_res")
_OUTPUT_RES = "model.output_attn_res"


def _source_error(feature: str, field: str, value, why: str) -> ConversionError:
    return ConversionError(f"cannot convert: unsupported {feature} ({field}={value!r}): {why}")


# ----------------------------------------------------------------------------- config


def _text_config(config):
    """The kimi_linear text config of a checkpoint (multimodal releases nest it as ``text_config``)."""
    if getattr(config, "model_type", None) == "kimi_linear":
        return config
    text = getattr(config, "text_config", None)
    if text is not None and getattr(text, "model_type", None) == "kimi_linear":
        return text
    raise ConversionError(f"cannot convert model_type={getattr(config, 'model_type', None)!r}: expected a "
                          "kimi_linear checkpoint (or a multimodal one whose text_config is kimi_linear)")


def _shortest_period(kinds) -> str:
    """The shortest prefix whose repetition gives the per-layer pattern (``kimi_layer_pattern``)."""
    text = "".join(kinds)
    for p in range(1, len(text) + 1):
        if all(text[i] == text[i % p] for i in range(len(text))):
            return text[:p]
    return text


def kimi_model_fields(config, max_seq_len: Optional[int] = None) -> Dict[str, Any]:
    """The ModelConfig fields (backbone and sizes) of a ``KimiLinearConfig``; what our Kimi Linear
    blocks cannot express is a :class:`ConversionError` naming the config field."""
    c = _text_config(config)
    if getattr(c, "hidden_act", "silu") != "silu":
        raise _source_error(f"activation '{c.hidden_act}'", "hidden_act", c.hidden_act,
                            "the Kimi Linear backbone here uses SiLU (SwiGLU experts and MLPs, KDA gates)")
    router_act = getattr(c, "moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        raise _source_error(f"router activation '{router_act}'", "moe_router_activation_func", router_act,
                            "transformers' Kimi Linear router scores experts with a sigmoid")
    if getattr(c, "attention_bias", False):
        raise _source_error("attention projection biases", "attention_bias", True,
                            "the Kimi Linear backbone here is built without MLA biases")
    quant = getattr(c, "quantization_config", None) or getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", quant) if isinstance(quant, Mapping) else quant
        raise _source_error(f"quantised weights ('{method}')", "quantization_config", method,
                            "only unquantised (float) checkpoints convert; dequantise first")
    groups, topk_groups = getattr(c, "n_group", 1) or 1, getattr(c, "topk_group", 1) or 1
    if groups != 1 or topk_groups != 1:
        raise _source_error("grouped expert routing", "num_expert_group", groups,
                            "only ungrouped top-k routing (num_expert_group = topk_group = 1) is supported")
    if c.num_key_value_heads != c.num_attention_heads:
        raise _source_error("grouped MLA heads", "num_key_value_heads", c.num_key_value_heads,
                            f"MLA here expands keys and values for all num_attention_heads={c.num_attention_heads}")
    unknown = sorted(set(c.layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise _source_error(f"attention layer types {unknown}", "layer_types", list(c.layer_types),
                            f"only {sorted(_LAYER_TYPES)} exist in Kimi Linear")
    mlp = list(c.mlp_layer_types)
    dense = mlp.index("sparse") if "sparse" in mlp else len(mlp)
    if set(mlp) - {"dense", "sparse"} or any(t != "sparse" for t in mlp[dense:]):
        raise _source_error("an MLP layout other than dense layers then MoE layers", "mlp_layer_types", mlp,
                            "the backbone keeps the dense MLP in the first moe_dense_layers layers only")
    moe = dense < len(mlp)
    fields = dict(
        backbone="kimi_linear", vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads, n_kv_heads=c.num_attention_heads, d_ff=c.intermediate_size,
        max_seq_len=int(max_seq_len if max_seq_len is not None else c.max_position_embeddings),
        norm_eps=float(c.rms_norm_eps), init_std=float(getattr(c, "initializer_range", 0.02) or 0.02),
        kimi_layer_pattern=_shortest_period(_LAYER_TYPES[t] for t in c.layer_types),
        kda_heads=c.linear_num_heads, kda_head_dim=c.linear_head_dim, kda_conv_kernel=c.linear_conv_kernel_dim,
        mla_kv_rank=c.kv_lora_rank, mla_q_rank=c.q_lora_rank, mla_qk_nope_dim=c.qk_nope_head_dim,
        mla_qk_rope_dim=c.qk_rope_head_dim, mla_v_dim=c.v_head_dim,
    )
    if moe:
        fields.update(moe_experts=c.num_local_experts, moe_top_k=c.num_experts_per_tok,
                      moe_shared_experts=c.n_shared_experts, moe_d_ff=c.moe_intermediate_size,
                      moe_dense_layers=dense, moe_routed_scale=float(c.routed_scaling_factor),
                      moe_renormalize=bool(c.norm_topk_prob))
    return fields


def attn_res_block_size(config) -> Optional[int]:
    """B of the §10 layout (``attn_res_block_size``), or None for a plain PreNorm checkpoint."""
    b = getattr(_text_config(config), "attn_res_block_size", None)
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        raise _source_error("attn_res_block_size", "attn_res_block_size", b, "must be a positive integer")
    return b


def layout_residual(n_layers: int, b: int) -> Dict[str, Any]:
    """The ModelConfig residual fields of the §10 layout with block size B: Block AttnRes with
    S = min(2B, L) sublayers per depth block (boundaries before attention) and unscaled norm eps."""
    return dict(residual="block", attnres_block_size=min(2 * b, 2 * n_layers), attnres_scale_norm_eps=False)


# ----------------------------------------------------------------------------- weights


def _strip_prefix(tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Text-model names: a multimodal release's ``language_model.`` prefix removed. Anything else
    outside the text model (vision tower, projector) keeps its name and is rejected later."""
    if not any(k.startswith(MULTIMODAL_PREFIX) for k in tensors):
        return dict(tensors)
    return {(k[len(MULTIMODAL_PREFIX):] if k.startswith(MULTIMODAL_PREFIX) else k): v for k, v in tensors.items()}


def _native_name(name: str, n_layers: int) -> Optional[Tuple[str, Optional[Tuple[int, str]]]]:
    """A checkpoint name -> (our name, None), or for depth-attention weights (None, (consumer l, kind)),
    kind "proj" (the query) or "norm" (the key-norm weight); None if the name is not ours."""
    if name == "model.embed_tokens.weight":
        return "embed.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    for kind in ("proj", "norm"):
        if name == f"{_OUTPUT_RES}_{kind}.weight":
            return None, (2 * n_layers, kind)
    if not name.startswith("model.layers."):
        return None
    index, _, rest = name[len("model.layers."):].partition(".")
    if not index.isdigit() or int(index) >= n_layers:
        return None
    i = int(index)
    for site, offset in zip(_RES_SITES, (0, 1)):
        for kind in ("proj", "norm"):
            if rest == f"{site}_{kind}.weight":
                return None, (2 * i + offset, kind)
    for theirs, ours in (("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "mlp_norm."),
                         ("self_attn.", "attn."), ("mlp.", "mlp.")):
        if rest.startswith(theirs):
            return f"blocks.{i}.{ours}{rest[len(theirs):]}", None
    return None


def _checkpoint_name(ours: str) -> str:
    """Our (non-residual) name -> the checkpoint's."""
    if ours in ("embed.weight", "norm.weight", "lm_head.weight"):
        return {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "lm_head.weight": "lm_head.weight"}[ours]
    _, index, rest = ours.split(".", 2)
    for theirs, mine in (("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "mlp_norm."),
                         ("self_attn.", "attn."), ("mlp.", "mlp.")):
        if rest.startswith(mine):
            return f"model.layers.{index}.{theirs}{rest[len(mine):]}"
    raise KeyError(ours)


def _residual_name(l: int, n_layers: int, kind: str) -> str:
    if l == 2 * n_layers:
        return f"{_OUTPUT_RES}_{kind}.weight"
    return f"model.layers.{l // 2}.{_RES_SITES[l % 2]}_{kind}.weight"


def _map_weights(tensors: Mapping[str, torch.Tensor], n_layers: int, d: int, has_residual: bool
                 ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, torch.Tensor]]]:
    """Checkpoint tensors -> (our non-residual state dict, the §10 depth-attention weights as
    ``queries`` / ``key_norm_weight`` [L + 1, d], or None for a plain checkpoint)."""
    ours: Dict[str, torch.Tensor] = {}
    queries: Dict[int, torch.Tensor] = {}
    key_norms: Dict[int, torch.Tensor] = {}
    unknown = []
    for name, t in _strip_prefix(tensors).items():
        if t.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise ConversionError(f"cannot convert: {name} is a {t.dtype} tensor (quantised weights); only "
                                  "float checkpoints convert, dequantise first")
        mapped = _native_name(name, n_layers)
        if mapped is None:
            unknown.append(name)
            continue
        native, res = mapped
        if native is not None:
            ours[native] = t
        elif not has_residual:
            unknown.append(name)  # depth-attention weights without attn_res_block_size
        elif res[1] == "proj":
            if tuple(t.shape) != (1, d):
                raise ConversionError(f"{name} has shape {tuple(t.shape)}; the §10 layout stores [1, {d}]")
            queries[res[0]] = t[0]
        else:
            key_norms[res[0]] = t
    if unknown:
        raise ConversionError(
            "cannot convert: the checkpoint has tensors the Kimi Linear backbone has no place for (vision "
            f"towers, extra layers, quantisation scales, ...): {sorted(unknown)[:8]}"
            f"{' ...' if len(unknown) > 8 else ''} ({len(unknown)} in all)")
    if not has_residual:
        return ours, None
    L = 2 * n_layers
    missing = [_residual_name(l, n_layers, k) for l in range(L + 1) for k, got in (("proj", queries),
                                                                               ("norm", key_norms))
               if l not in got]
    if missing:
        raise ConversionError(f"attn_res_block_size is set but the checkpoint lacks depth-attention weights: "
                              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return ours, {"queries": torch.stack([queries[l] for l in range(L + 1)]),
                  "key_norm_weight": torch.stack([key_norms[l] for l in range(L + 1)])}


# ----------------------------------------------------------------------------- loading


def _is_residual_name(name: str) -> bool:
    """A depth-attention weight of the §10 layout (``*_res_proj`` / ``*_res_norm``, ``output_attn_res_*``)."""
    return name.startswith(_OUTPUT_RES) or any(f".{site}_" in name for site in _RES_SITES)


def _runtime_name(name: str) -> str:
    """A stored tensor name under transformers' module names, by the pure renames of transformers'
    kimi_linear conversion mapping (merged tensors such as the expert stacks keep their stored name)."""
    import re

    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    for rule in get_checkpoint_conversion_mapping("kimi_linear") or []:
        if isinstance(rule, WeightRenaming):
            for source, target in zip(rule.source_patterns, rule.target_patterns):
                name = re.sub(source, target, name)
    return name


def _load_directory(path: Path, config) -> Dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory under transformers' runtime names.

    Released Kimi Linear checkpoints store the original layout (per-expert ``w1``/``w2``/``w3`` under
    ``block_sparse_moe``, three short convolutions, the forget gate beside the attention); transformers
    turns it into its modules' layout while loading (its conversion mapping for ``kimi_linear``), so
    the text model is loaded by ``KimiLinearForCausalLM.from_pretrained``, in float64 (exact for every
    float checkpoint) and without its float32-pinned modules, which would round float64 weights. What
    transformers does not take (the §10 depth-attention weights, and anything the model has no place
    for) comes back under its stored name, for :func:`_map_weights` to place or reject."""
    from transformers import KimiLinearForCausalLM

    raw = _read_safetensors_dir(path)
    if raw is None:
        raise ConversionError(f"{path} holds no model.safetensors (or sharded index); Kimi Linear "
                              "checkpoints convert from safetensors only")
    for name, t in raw.items():
        if not t.is_floating_point():
            raise ConversionError(f"cannot convert: {name} is a {t.dtype} tensor (quantised weights); only "
                                  "float checkpoints convert, dequantise first")
    prefixed = any(k.startswith(MULTIMODAL_PREFIX) for k in raw)
    raw = _strip_prefix(raw)

    class Float64Loader(KimiLinearForCausalLM):
        _keep_in_fp32_modules_strict = None

    text = _text_config(config)
    text._experts_implementation = "eager"
    model, info = Float64Loader.from_pretrained(
        str(path), config=text, dtype=torch.float64, local_files_only=True, output_loading_info=True,
        key_mapping={"^" + MULTIMODAL_PREFIX.replace(".", r"\."): ""} if prefixed else None)
    problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise ConversionError(f"cannot convert {path}: transformers' Kimi Linear model reports {problems}")
    # transformers builds the router and dt_bias in float32 whatever the dtype: those are plain renames,
    # taken from the files as stored (through transformers' own renaming rules) so nothing is rounded
    stored = {_runtime_name(k): v for k, v in raw.items()}
    tensors = {k: stored[k] if k in stored and stored[k].shape == v.shape else v
               for k, v in model.state_dict().items()}
    dtype = raw["model.embed_tokens.weight"].dtype  # the checkpoint's: float64 loading rounds nothing
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors.update({k: v for k, v in raw.items() if k in set(info.get("unexpected_keys") or [])})
    return tensors


def _load_source(source) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(config, tensors under transformers' runtime names) of a checkpoint directory or a transformers
    model object."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        config = read_source_config(path, "a kimi_linear checkpoint directory (config.json + safetensors)")
        kimi_model_fields(config)  # what the backbone cannot express fails before anything is loaded
        return config, _load_directory(path, config)
    config = getattr(source, "config", None)
    if config is None or not hasattr(source, "state_dict"):
        raise ConversionError(f"cannot convert a {type(source).__name__}: pass a KimiLinearForCausalLM or a "
                              "checkpoint directory")
    return config, {k: v.detach() for k, v in source.state_dict().items()}


def build_lm(model_config: ModelConfig, weights: Mapping[str, torch.Tensor],
             residual: Optional[Mapping[str, torch.Tensor]] = None,
             dtype: Optional[torch.dtype] = None) -> AttnResLM:
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


def convert_kimi_linear(source, residual: Optional[str] = None, *, attnres_blocks: Optional[int] = None,
                        attnres_block_size: Optional[int] = None, max_seq_len: Optional[int] = None,
                        dtype: Optional[torch.dtype] = None, **model_options) -> AttnResForCausalLM:
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
    fields = kimi_model_fields(config, max_seq_len)
    b = attn_res_block_size(config)
    options = dict(model_options)
    if b is not None:
        given = [k for k, v in (("residual", residual), ("attnres_blocks", attnres_blocks),
                                ("attnres_block_size", attnres_block_size)) if v is not None]
        given += [k for k in ("attnres_scale_norm_eps",) if k in options]
        if given:
            raise ConversionError(f"{given} cannot be set: the checkpoint is already Block AttnRes "
                                  f"(attn_res_block_size={b}, docs/method.md §10)")
        options.update(layout_residual(fields["n_layers"], b))
    else:
        residual = residual or "block"
        if residual not in ("block", "full", "prenorm"):
            raise ConversionError(f"residual={residual!r}: a retrofit keeps the model's outputs only for "
                                  "block, full or prenorm")
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
    weights, res = _map_weights(tensors, fields["n_layers"], fields["d_model"], has_residual=b is not None)
    fields["tie_embeddings"] = "lm_head.weight" not in weights and bool(
        getattr(_text_config(config), "tie_word_embeddings", False))
    try:
        model_config = ModelConfig(**{**fields, **options})
    except (TypeError, ValueError) as e:
        raise ConversionError(f"cannot build the AttnRes model: {e}") from e
    lm = build_lm(model_config, weights, res, dtype)
    special = {k: getattr(_text_config(config), k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return AttnResForCausalLM.from_attnres_lm(lm, **{k: v for k, v in special.items() if v is not None}).eval()


# ----------------------------------------------------------------------------- writing


def _layout_block_size(model_config: ModelConfig) -> Optional[int]:
    """B for the §10 layout (None: prenorm, written as a plain checkpoint); or a ConversionError
    naming the option the layout cannot store."""
    c = model_config
    if c.residual == "prenorm":
        return None
    if c.residual != "block":
        raise ConversionError(f"ModelConfig.residual={c.residual!r} cannot be written in the released layout "
                              "(docs/method.md §10): it stores Block AttnRes only; use residual='block' or 'prenorm'")
    for name, value, allowed in (("attnres_weights", c.attnres_weights, "pseudo_query"),
                                 ("attnres_kernel", c.attnres_kernel, "softmax"),
                                 ("attnres_key_norm", c.attnres_key_norm, True),
                                 ("attnres_heads", c.attnres_heads, 1),
                                 ("attnres_scale_norm_eps", c.attnres_scale_norm_eps, False)):
        if value != allowed:
            fix = (" (a retrofit: --set attnres_scale_norm_eps=false; the logits then move from the source's "
                   "by the eps term only)") if name == "attnres_scale_norm_eps" else ""
            raise ConversionError(f"ModelConfig.{name}={value!r} cannot be written in the released layout "
                                  f"(docs/method.md §10), which has {name}={allowed!r} only{fix}")
    S, L = c.block_size, c.n_sublayers
    if S == L:
        return c.n_layers  # one depth block: any B >= the layer count
    if S % 2:
        raise ConversionError(f"ModelConfig.attnres_block_size={S} is odd; the released layout counts depth "
                              "blocks in whole decoder layers (S = 2B): use an even S or a single block")
    return S // 2


@torch.no_grad()
def kimi_state_dict(lm: AttnResLM, *, language_model: bool = False) -> Dict[str, torch.Tensor]:
    """Our model's tensors under the names of transformers' Kimi Linear modules, plus the §10
    depth-attention weights for Block AttnRes (what :func:`save_kimi_linear` writes, before
    transformers turns the module names into the released checkpoint layout)."""
    c = lm.config
    b = _layout_block_size(c)
    out = {}
    for name, t in lm.state_dict().items():
        if name.startswith("residual.") or (name == "lm_head.weight" and c.tie_embeddings):
            continue
        out[_checkpoint_name(name)] = t
    if c.tie_embeddings:  # transformers' Kimi Linear never ties: store the head explicitly
        out["lm_head.weight"] = lm.embed.weight
    if b is not None:
        for l in range(c.n_sublayers + 1):
            out[_residual_name(l, c.n_layers, "proj")] = lm.residual.queries[l].detach().reshape(1, -1)
            out[_residual_name(l, c.n_layers, "norm")] = lm.residual.key_norm_weight[l].detach()
    if language_model:
        out = {MULTIMODAL_PREFIX + k: v for k, v in out.items()}
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def kimi_config_dict(model_config: ModelConfig) -> Dict[str, Any]:
    """config.json of the checkpoint: transformers' KimiLinearConfig plus ``attn_res_block_size``."""
    from attnres.model.kimi_linear import kimi_linear_config

    if model_config.backbone != "kimi_linear":
        raise ConversionError(f"ModelConfig.backbone={model_config.backbone!r}: only kimi_linear models are "
                              "written as Kimi Linear checkpoints")
    b = _layout_block_size(model_config)
    hf = kimi_linear_config(model_config, tie_word_embeddings=False)
    data = hf.to_dict()
    data["architectures"] = ["KimiLinearForCausalLM"]
    if b is not None:
        data["attn_res_block_size"] = b
    return data


def save_kimi_linear(model, out_dir, *, language_model: bool = False, dtype: Optional[torch.dtype] = None) -> Path:
    """Write ``model`` (an AttnResLM or AttnResForCausalLM, backbone="kimi_linear") as a Kimi Linear
    checkpoint directory; Block AttnRes in the §10 layout.

    The Kimi Linear part is written by transformers (``KimiLinearForCausalLM.save_pretrained``), so the
    files hold the layout released checkpoints use (per-expert ``w1``/``w2``/``w3``, separate short
    convolutions), sharded as transformers shards; the depth-attention weights and
    ``attn_res_block_size`` are then added. ``language_model``: prefix every tensor name with
    ``language_model.`` (multimodal releases). ``dtype``: cast the weights (the routers' balancing
    bias stays float32, as in transformers)."""
    from safetensors.torch import load_file, save_file
    from transformers import KimiLinearForCausalLM

    from attnres.model.kimi_linear import kimi_linear_config

    lm = model.model if isinstance(model, AttnResForCausalLM) else model
    data = kimi_config_dict(lm.config)
    tensors = kimi_state_dict(lm)
    if dtype is not None:
        tensors = {k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)) for k, v in tensors.items()}
    residual = {k: tensors.pop(k) for k in list(tensors) if _is_residual_name(k)}
    with torch.device("meta"):
        text_model = KimiLinearForCausalLM(kimi_linear_config(lm.config, tie_word_embeddings=False))
    text_model.load_state_dict(tensors, strict=True, assign=True)
    out = Path(out_dir)
    text_model.save_pretrained(str(out))
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    if residual:
        extra = "model-attn-res.safetensors" if index else "model.safetensors"
        if index:
            files.append(extra)
            save_file(residual, str(out / extra), metadata={"format": "pt"})
            index["weight_map"].update({k: extra for k in residual})
        else:
            save_file({**load_file(str(out / extra)), **residual}, str(out / extra), metadata={"format": "pt"})
    if language_model:
        for name in files:
            shard = load_file(str(out / name))
            save_file({MULTIMODAL_PREFIX + k: v for k, v in shard.items()}, str(out / name), metadata={"format": "pt"})
        if index:
            index["weight_map"] = {MULTIMODAL_PREFIX + k: v for k, v in index["weight_map"].items()}
    if index:
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    written = json.loads((out / "config.json").read_text())
    if "attn_res_block_size" in data:
        written["attn_res_block_size"] = data["attn_res_block_size"]
    (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True))
    return out


# ----------------------------------------------------------------------------- checking a conversion


@torch.no_grad()
def kimi_conversion_error(source, converted: AttnResForCausalLM, input_ids: Optional[torch.Tensor] = None,
                          seed: int = 0) -> float:
    """Max |logit difference| between transformers' Kimi Linear model of ``source`` (a directory or a
    model object) and ``converted``, on ``input_ids`` (default 2 x 16 random tokens)."""
    from transformers import KimiLinearForCausalLM

    reference = source if not isinstance(source, (str, os.PathLike)) else \
        KimiLinearForCausalLM.from_pretrained(str(source), local_files_only=True,
                                              dtype=converted.dtype).eval()
    reference.config._experts_implementation = "eager"
    if input_ids is None:
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, converted.config.vocab_size, (2, min(16, converted.config.max_seq_len)),
                                  generator=gen)
    a = reference(input_ids).logits.double()
    b = converted(input_ids).logits.double()
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- AutoModelForCausalLM


class KimiLinearAutoModel:
    """What ``AutoModelForCausalLM`` builds for a ``kimi_linear`` config once ``attnres.hf`` is
    imported: a §10 checkpoint (``attn_res_block_size`` set) becomes our ``AttnResForCausalLM``;
    any other Kimi Linear checkpoint goes to transformers' own ``KimiLinearForCausalLM``, unchanged."""

    from transformers import KimiLinearConfig as config_class

    @classmethod
    def from_pretrained(cls, path, *args, config=None, **kwargs):
        from transformers import AutoConfig, KimiLinearForCausalLM

        if config is None:
            config = AutoConfig.from_pretrained(path, local_files_only=kwargs.get("local_files_only", False))
        if attn_res_block_size(config) is None:
            return KimiLinearForCausalLM.from_pretrained(path, *args, config=config, **kwargs)
        if not Path(path).is_dir():
            raise ConversionError(f"{path}: attnres reads the §10 layout from a local directory only")
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        return convert_kimi_linear(path, dtype=dtype if isinstance(dtype, torch.dtype) else None)

    @classmethod
    def _from_config(cls, config, **kwargs):
        from transformers import KimiLinearForCausalLM

        b = attn_res_block_size(config)
        if b is None:
            return KimiLinearForCausalLM._from_config(config, **kwargs)
        fields = kimi_model_fields(config)
        model_config = ModelConfig(**fields, **layout_residual(fields["n_layers"], b))
        return AttnResForCausalLM(AttnResConfig.from_model_config(model_config))


def register_auto_model() -> None:
    from transformers import AutoModelForCausalLM, KimiLinearConfig

    AutoModelForCausalLM.register(KimiLinearConfig, KimiLinearAutoModel, exist_ok=True)


__all__ = ["KimiLinearAutoModel", "attn_res_block_size", "build_lm",
           "convert_kimi_linear", "kimi_config_dict", "kimi_conversion_error", "kimi_model_fields",
           "kimi_state_dict", "layout_residual", "register_auto_model", "save_kimi_linear"]
