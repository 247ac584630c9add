"""Kimi K3 checkpoints as files: the text config's keys as ``ModelConfig`` fields, and the released
tensor names (what mlx-lm's ``kimi_k3`` and the Hugging Face release read) against ours.

The tensor names go through transformers' runtime names (``attnres.hf.kimi.layout.checkpoint_name``,
which ``map_weights`` reads back): the released layout differs from them by pure renames and splits,
so both directions here are lossless.

Per decoder layer ``model.layers.{i}.``: KDA keeps q/k/v projections and three short convolutions
``{q,k,v}_conv1d.weight`` [P, 1, K] (ours: one ``conv1d`` [3P, 1, K]), the forget gate's
``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log`` beside them (ours: under ``forget_gate.``), its
output gate as ``g_a_proj`` / ``g_b_proj`` or, full rank, ``g_proj`` (ours: ``g_b_proj`` behind an
identity). MLA's names are ours (``g_proj`` is its output gate). A dense MLP is ``mlp.*``; a
mixture of experts ``block_sparse_moe.*`` with per-expert ``experts.{e}.w1`` (gate) / ``w3`` (up) /
``w2`` (down) (ours: stacked ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F]).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from attnres.hf.convert import ConversionError
from attnres.hf.kimi.k3 import SWIGLU_SITU_MIN_BETA
from attnres.model.kimi_layout import KDA, MLA

# what a K3 release holds besides the text model: the vision tower and projector, and the multi-token
# prediction layers (mlx-lm's kimi_k3 drops the same; none of them enters the logits)
SKIPPED_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.", "mm_projector.", "model.mtp", "mtp.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
_FORGET_GATE = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")
# the depth-attention weights' other spelling (``self_attention_res.proj_weight``), which mlx-lm also reads
_RES_SPELLING = re.compile(r"(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)_weight$")


def _error(key: str, value, why: str) -> ConversionError:
    return ConversionError(f"cannot convert: Kimi K3's {key}={value!r}: {why}")


def _shortest_period(kinds: list[str]) -> str:
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return "".join(kinds[:p])
    return "".join(kinds)


def _situ_fields(text: Mapping[str, Any]) -> dict[str, Any]:
    """SiTU as ``situ_beta`` / ``situ_linear_beta``; None (SwiGLU) where SiTU equals it exactly (a
    power-of-two beta >= 2^60 and no linear beta: what our writers put there for SwiGLU)."""
    act = text.get("hidden_act", "situ")
    if act != "situ":
        raise _error("hidden_act", act, "K3's MLPs and experts use 'situ' (mlx-lm's kimi_k3 reads nothing else)")
    beta, linear = text.get("activation_situ_beta"), text.get("activation_situ_linear_beta")
    beta = 1.0 if beta is None else float(beta)  # mlx-lm's and llama.cpp's default
    if linear is None and beta >= SWIGLU_SITU_MIN_BETA and math.frexp(beta)[0] == 0.5:
        return {}
    return dict(situ_beta=beta, situ_linear_beta=None if linear is None else float(linear))


def k3_model_fields(text: Mapping[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """The ModelConfig fields (backbone, sizes, K3 options) of a K3 ``text_config``; what the backbone
    cannot express is a :class:`ConversionError` naming the key."""
    quant = text.get("quantization_config")
    if quant and "mxfp4" not in json.dumps(quant).lower():  # MXFP4 experts dequantise on loading
        method = quant.get("quant_method", quant) if isinstance(quant, Mapping) else quant
        raise _error(
            "quantization_config",
            method,
            "only float weights and MXFP4 ones (K3's experts, compressed-tensors' weight_packed / "
            "weight_scale) convert here; dequantise to a float checkpoint first",
        )
    if not text.get("mla_use_nope", True):
        raise _error("mla_use_nope", False, "MLA here has no rotary positions (mlx-lm's kimi_k3 refuses it too)")
    router = text.get("moe_router_activation_func", "sigmoid")
    if router != "sigmoid":
        raise _error("moe_router_activation_func", router, "K3's router scores experts with a sigmoid")
    L = int(text["num_hidden_layers"])
    linear = dict(text.get("linear_attn_config") or {})
    kda_layers = set(linear.get("kda_layers") or [])
    kinds = [KDA if i + 1 in kda_layers else MLA for i in range(L)]
    fields: dict[str, Any] = dict(
        backbone="kimi_linear",
        vocab_size=int(text["vocab_size"]),
        d_model=int(text["hidden_size"]),
        n_layers=L,
        n_heads=int(text["num_attention_heads"]),
        n_kv_heads=int(text["num_attention_heads"]),
        d_ff=int(text["intermediate_size"]),
        max_seq_len=int(max_seq_len if max_seq_len is not None else text.get("max_position_embeddings", 1048576)),
        norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        kimi_layer_pattern=_shortest_period(kinds),
        mla_kv_rank=text.get("kv_lora_rank"),
        mla_q_rank=text.get("q_lora_rank"),
        mla_qk_nope_dim=text.get("qk_nope_head_dim"),
        mla_qk_rope_dim=text.get("qk_rope_head_dim"),
        mla_v_dim=text.get("v_head_dim"),
        mla_output_gate=bool(text.get("mla_use_output_gate", False)),
        **_situ_fields(text),
    )
    if KDA in kinds:
        bound = linear.get("gate_lower_bound")
        fields.update(
            kda_heads=linear.get("num_heads"),
            kda_head_dim=linear.get("head_dim"),
            kda_conv_kernel=int(linear.get("short_conv_kernel_size", 4)),
            kda_full_rank_gate=bool(linear.get("use_full_rank_gate", False)),
            kda_gate_lower_bound=None if bound is None else float(bound),
        )
    experts = int(text.get("num_experts") or 0)
    if experts:
        top_k = int(text.get("num_experts_per_token", 16))
        shared = int(text.get("num_shared_experts", 0))
        if shared < 1:
            raise _error("num_shared_experts", shared, "the mixture of experts here has at least one shared expert")
        fields.update(
            moe_experts=experts,
            moe_top_k=top_k,
            moe_shared_experts=shared,
            moe_d_ff=text.get("moe_intermediate_size"),
            moe_dense_layers=min(int(text.get("first_k_dense_replace", 0)), L),
            moe_layer_freq=int(text.get("moe_layer_freq", 1)),
            # K3 renormalises only with two or more experts; one expert keeps its sigmoid score
            moe_renormalize=bool(text.get("moe_renormalize", True)) and top_k > 1,
            moe_routed_scale=float(text.get("routed_scaling_factor", 1.0)),
            moe_groups=int(text.get("num_expert_group") or 1),
            moe_topk_groups=int(text.get("topk_group") or 1),
            moe_latent_dim=text.get("routed_expert_hidden_size"),
            moe_latent_norm=bool(text.get("latent_moe_use_norm", False))
            and text.get("routed_expert_hidden_size") is not None,
        )
    return fields


def released_names(runtime: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Tensors under transformers' runtime names (``kimi_state_dict``) -> the released K3 names."""
    from attnres.model.kimi_layout import layer_kinds, moe_layers

    kinds, sparse = layer_kinds(config), moe_layers(config)
    out: dict[str, torch.Tensor] = {}
    for name, t in runtime.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        i, rest = int(m.group(1)), m.group(2)
        p = f"model.layers.{i}."
        if rest == "self_attn.conv1d.weight":
            for conv, part in zip(_CONVS, t.chunk(3, dim=0), strict=True):
                out[f"{p}self_attn.{conv}.weight"] = part
        elif rest.startswith("self_attn.forget_gate."):
            out[p + "self_attn." + rest[len("self_attn.forget_gate.") :]] = t
        elif rest == "self_attn.g_b_proj.weight" and kinds[i] == KDA and config.kda_full_rank_gate:
            out[p + "self_attn.g_proj.weight"] = t
        elif rest.startswith("mlp.experts."):
            ff = t.shape[-1] if rest.endswith("down_proj") else t.shape[1] // 2
            for e in range(t.shape[0]):
                if rest.endswith("down_proj"):
                    out[f"{p}block_sparse_moe.experts.{e}.w2.weight"] = t[e]
                else:
                    out[f"{p}block_sparse_moe.experts.{e}.w1.weight"] = t[e, :ff]
                    out[f"{p}block_sparse_moe.experts.{e}.w3.weight"] = t[e, ff:]
        elif rest.startswith("mlp.") and sparse[i]:
            out[p + "block_sparse_moe." + rest[len("mlp.") :]] = t
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


def runtime_names(released: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The released K3 names -> transformers' runtime names (what ``map_weights`` places). The
    vision tower, projector and multi-token-prediction layers are dropped (:data:`SKIPPED_PREFIXES`)."""
    from attnres.model.kimi_layout import layer_kinds

    kinds = layer_kinds(config)
    out: dict[str, torch.Tensor] = {}
    convs: dict[int, dict[str, torch.Tensor]] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in released.items():
        if name.startswith(SKIPPED_PREFIXES):
            continue
        name = _RES_SPELLING.sub(r"\1_\2.weight", name)
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        i, rest = int(m.group(1)), m.group(2)
        if i >= config.n_layers:
            continue  # multi-token-prediction layers stored after the text model's
        p = f"model.layers.{i}."
        if rest.startswith("block_sparse_moe."):
            rest = "mlp." + rest[len("block_sparse_moe.") :]
        e = re.fullmatch(r"mlp\.experts\.(\d+)\.(w[123])\.weight", rest)
        if e is not None:
            experts.setdefault((i, e.group(2)), {})[int(e.group(1))] = t
        elif rest == "mlp.e_score_correction_bias":
            out[p + "mlp.gate.e_score_correction_bias"] = t
        elif rest.startswith("self_attn.") and rest[len("self_attn.") :].split(".")[0] in _CONVS:
            convs.setdefault(i, {})[rest.split(".")[1]] = t
        elif kinds[i] == KDA and rest[len("self_attn.") :] in _FORGET_GATE:
            part = rest[len("self_attn.") :]
            if part in ("A_log", "dt_bias"):  # stored flat or as [1, 1, heads, 1]: ours is the latter / flat
                t = t.reshape(1, 1, -1, 1) if part == "A_log" else t.reshape(-1)
            out[p + "self_attn.forget_gate." + part] = t
        elif kinds[i] == KDA and rest == "self_attn.g_proj.weight":
            out[p + "self_attn.g_b_proj.weight"] = t
        else:
            out[p + rest] = t
    for i, parts in convs.items():
        if set(parts) != set(_CONVS):
            raise ConversionError(f"cannot convert: layer {i} has short convolutions {sorted(parts)}; K3 has {_CONVS}")
        out[f"model.layers.{i}.self_attn.conv1d.weight"] = torch.cat([parts[c] for c in _CONVS])
    stacked = {}
    for (i, w), per_expert in experts.items():
        if sorted(per_expert) != list(range(config.moe_experts)):
            raise ConversionError(
                f"cannot convert: layer {i} has experts {sorted(per_expert)} of {w}; config.json says "
                f"num_experts={config.moe_experts}"
            )
        stacked[(i, w)] = torch.stack([per_expert[e] for e in range(config.moe_experts)])
    for (i, w), stack in stacked.items():
        if w == "w1":  # transformers' gate_up_proj: the gate rows, then the up rows
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([stack, stacked[(i, "w3")]], dim=1)
        elif w == "w2":
            out[f"model.layers.{i}.mlp.experts.down_proj"] = stack
    return out
