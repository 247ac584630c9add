"""What a Kimi Linear checkpoint means in our terms: its config as ModelConfig fields (what our blocks
cannot express is a ConversionError naming the field), the §10 block size, and its tensor names
against ours (the depth-attention weights of the §10 layout included).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from attnres.hf.convert import ConversionError
from attnres.hf.kimi.k3 import check_k3_features
from attnres.model.backbones import KDA, MLA

MULTIMODAL_PREFIX = "language_model."
_LAYER_TYPES = {"linear_attention": KDA, "full_attention": MLA}
# the sublayer input each pair of depth-attention weights serves, per decoder layer (docs/method.md §10)
_RES_SITES = ("self_attention_res", "mlp_res")
_OUTPUT_RES = "model.output_attn_res"


def _source_error(feature: str, field: str, value, why: str) -> ConversionError:
    return ConversionError(f"cannot convert: unsupported {feature} ({field}={value!r}): {why}")


def text_config(config):
    """The kimi_linear text config of a checkpoint (multimodal releases nest it as ``text_config``)."""
    if getattr(config, "model_type", None) == "kimi_linear":
        return config
    text = getattr(config, "text_config", None)
    if text is not None and getattr(text, "model_type", None) == "kimi_linear":
        return text
    raise ConversionError(
        f"cannot convert model_type={getattr(config, 'model_type', None)!r}: expected a "
        "kimi_linear checkpoint (or a multimodal one whose text_config is kimi_linear)"
    )


def _shortest_period(kinds) -> str:
    """The shortest prefix whose repetition gives the per-layer pattern (``kimi_layer_pattern``)."""
    text = "".join(kinds)
    for p in range(1, len(text) + 1):
        if all(text[i] == text[i % p] for i in range(len(text))):
            return text[:p]
    return text


def kimi_model_fields(config, max_seq_len: int | None = None) -> dict[str, Any]:
    """The ModelConfig fields (backbone and sizes) of a ``KimiLinearConfig``; what our Kimi Linear
    blocks cannot express is a :class:`ConversionError` naming the config field."""
    c = text_config(config)
    check_k3_features(c)  # Kimi K3's additions, by name (attnres.hf.kimi.k3)
    if getattr(c, "hidden_act", "silu") != "silu":
        raise _source_error(
            f"activation '{c.hidden_act}'",
            "hidden_act",
            c.hidden_act,
            "the Kimi Linear backbone here uses SiLU (SwiGLU experts and MLPs, KDA gates)",
        )
    router_act = getattr(c, "moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        raise _source_error(
            f"router activation '{router_act}'",
            "moe_router_activation_func",
            router_act,
            "transformers' Kimi Linear router scores experts with a sigmoid",
        )
    if getattr(c, "attention_bias", False):
        raise _source_error(
            "attention projection biases",
            "attention_bias",
            True,
            "the Kimi Linear backbone here is built without MLA biases",
        )
    quant = getattr(c, "quantization_config", None) or getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", quant) if isinstance(quant, Mapping) else quant
        raise _source_error(
            f"quantised weights ('{method}')",
            "quantization_config",
            method,
            "only unquantised (float) checkpoints convert; dequantise first",
        )
    groups, topk_groups = getattr(c, "n_group", 1) or 1, getattr(c, "topk_group", 1) or 1
    if groups != 1 or topk_groups != 1:
        raise _source_error(
            "grouped expert routing",
            "num_expert_group",
            groups,
            "only ungrouped top-k routing (num_expert_group = topk_group = 1) is supported",
        )
    if c.num_key_value_heads != c.num_attention_heads:
        raise _source_error(
            "grouped MLA heads",
            "num_key_value_heads",
            c.num_key_value_heads,
            f"MLA here expands keys and values for all num_attention_heads={c.num_attention_heads}",
        )
    unknown = sorted(set(c.layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise _source_error(
            f"attention layer types {unknown}",
            "layer_types",
            list(c.layer_types),
            f"only {sorted(_LAYER_TYPES)} exist in Kimi Linear",
        )
    mlp = list(c.mlp_layer_types)
    dense = mlp.index("sparse") if "sparse" in mlp else len(mlp)
    if set(mlp) - {"dense", "sparse"} or any(t != "sparse" for t in mlp[dense:]):
        raise _source_error(
            "an MLP layout other than dense layers then MoE layers",
            "mlp_layer_types",
            mlp,
            "the backbone keeps the dense MLP in the first moe_dense_layers layers only",
        )
    moe = dense < len(mlp)
    fields = dict(
        backbone="kimi_linear",
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_attention_heads,
        d_ff=c.intermediate_size,
        max_seq_len=int(max_seq_len if max_seq_len is not None else c.max_position_embeddings),
        norm_eps=float(c.rms_norm_eps),
        init_std=float(getattr(c, "initializer_range", 0.02) or 0.02),
        kimi_layer_pattern=_shortest_period(_LAYER_TYPES[t] for t in c.layer_types),
        kda_heads=c.linear_num_heads,
        kda_head_dim=c.linear_head_dim,
        kda_conv_kernel=c.linear_conv_kernel_dim,
        mla_kv_rank=c.kv_lora_rank,
        mla_q_rank=c.q_lora_rank,
        mla_qk_nope_dim=c.qk_nope_head_dim,
        mla_qk_rope_dim=c.qk_rope_head_dim,
        mla_v_dim=c.v_head_dim,
    )
    if moe:
        fields.update(
            moe_experts=c.num_local_experts,
            moe_top_k=c.num_experts_per_tok,
            moe_shared_experts=c.n_shared_experts,
            moe_d_ff=c.moe_intermediate_size,
            moe_dense_layers=dense,
            moe_routed_scale=float(c.routed_scaling_factor),
            moe_renormalize=bool(c.norm_topk_prob),
        )
    return fields


def attn_res_block_size(config) -> int | None:
    """B of the §10 layout (``attn_res_block_size``), or None for a plain PreNorm checkpoint."""
    b = getattr(text_config(config), "attn_res_block_size", None)
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        raise _source_error("attn_res_block_size", "attn_res_block_size", b, "must be a positive integer")
    return b


def layout_residual(n_layers: int, b: int) -> dict[str, Any]:
    """The ModelConfig residual fields of the §10 layout with block size B: Block AttnRes with
    S = min(2B, L) sublayers per depth block (boundaries before attention) and unscaled norm eps."""
    return dict(residual="block", attnres_block_size=min(2 * b, 2 * n_layers), attnres_scale_norm_eps=False)


def strip_prefix(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Text-model names: a multimodal release's ``language_model.`` prefix removed. Anything else
    outside the text model (vision tower, projector) keeps its name and is rejected later."""
    if not any(k.startswith(MULTIMODAL_PREFIX) for k in tensors):
        return dict(tensors)
    return {(k[len(MULTIMODAL_PREFIX) :] if k.startswith(MULTIMODAL_PREFIX) else k): v for k, v in tensors.items()}


def _native_name(name: str, n_layers: int) -> tuple[str | None, tuple[int, str] | None] | None:
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
    index, _, rest = name[len("model.layers.") :].partition(".")
    if not index.isdigit() or int(index) >= n_layers:
        return None
    i = int(index)
    for site, offset in zip(_RES_SITES, (0, 1), strict=True):
        for kind in ("proj", "norm"):
            if rest == f"{site}_{kind}.weight":
                return None, (2 * i + offset, kind)
    for theirs, ours in (
        ("input_layernorm.", "attn_norm."),
        ("post_attention_layernorm.", "mlp_norm."),
        ("self_attn.", "attn."),
        ("mlp.", "mlp."),
    ):
        if rest.startswith(theirs):
            return f"blocks.{i}.{ours}{rest[len(theirs) :]}", None
    return None


def checkpoint_name(ours: str) -> str:
    """Our (non-residual) name -> the checkpoint's."""
    if ours in ("embed.weight", "norm.weight", "lm_head.weight"):
        return {
            "embed.weight": "model.embed_tokens.weight",
            "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight",
        }[ours]
    _, index, rest = ours.split(".", 2)
    for theirs, mine in (
        ("input_layernorm.", "attn_norm."),
        ("post_attention_layernorm.", "mlp_norm."),
        ("self_attn.", "attn."),
        ("mlp.", "mlp."),
    ):
        if rest.startswith(mine):
            return f"model.layers.{index}.{theirs}{rest[len(mine) :]}"
    raise KeyError(ours)


def residual_name(sublayer: int, n_layers: int, kind: str) -> str:
    if sublayer == 2 * n_layers:
        return f"{_OUTPUT_RES}_{kind}.weight"
    return f"model.layers.{sublayer // 2}.{_RES_SITES[sublayer % 2]}_{kind}.weight"


def map_weights(
    tensors: Mapping[str, torch.Tensor], n_layers: int, d: int, has_residual: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Checkpoint tensors -> (our non-residual state dict, the §10 depth-attention weights as
    ``queries`` / ``key_norm_weight`` [L + 1, d], or None for a plain checkpoint)."""
    ours: dict[str, torch.Tensor] = {}
    queries: dict[int, torch.Tensor] = {}
    key_norms: dict[int, torch.Tensor] = {}
    unknown = []
    for name, t in strip_prefix(tensors).items():
        if t.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise ConversionError(
                f"cannot convert: {name} is a {t.dtype} tensor (quantised weights); only "
                "float checkpoints convert, dequantise first"
            )
        mapped = _native_name(name, n_layers)
        if mapped is None:
            unknown.append(name)
            continue
        native, res = mapped
        if native is not None:
            ours[native] = t
        elif not has_residual or res is None:
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
            f"{' ...' if len(unknown) > 8 else ''} ({len(unknown)} in all)"
        )
    if not has_residual:
        return ours, None
    L = 2 * n_layers
    missing = [
        residual_name(j, n_layers, k)
        for j in range(L + 1)
        for k, got in (("proj", queries), ("norm", key_norms))
        if j not in got
    ]
    if missing:
        raise ConversionError(
            f"attn_res_block_size is set but the checkpoint lacks depth-attention weights: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    return ours, {
        "queries": torch.stack([queries[j] for j in range(L + 1)]),
        "key_norm_weight": torch.stack([key_norms[j] for j in range(L + 1)]),
    }


def is_residual_name(name: str) -> bool:
    """A depth-attention weight of the §10 layout (``*_res_proj`` / ``*_res_norm``, ``output_attn_res_*``)."""
    return name.startswith(_OUTPUT_RES) or any(f".{site}_" in name for site in _RES_SITES)
