"""Backbones: the Transformer blocks a residual stream runs through, behind one registry.

Each entry says how to build a block and the final norm, which ``ModelConfig`` fields belong to the
backbone (each with its check, as ``attnres.residual.RESIDUALS`` does for schemes), how many
parameters the PreNorm model has, and what the backbone needs beyond the generic parts of
``AttnResLM`` (rotary tables, the kind of decoding cache, extra initialisation, per-step updates).
``ModelConfig`` validates through this registry and names no backbone itself.

- ``"llama"``: the LLaMA-style decoder of ``attnres.model.llama`` (GQA attention with RoPE, SwiGLU).
- ``"kimi_linear"``: Kimi Linear, the backbone of the paper's models (``attnres.model.kimi_linear``):
  transformers' Kimi Delta Attention (KDA) and multi-head latent attention (MLA) sublayers in a
  configurable pattern (3 KDA : 1 MLA by default), a dense SwiGLU MLP in the first layers and a
  mixture of experts after them. Needs transformers >= 5 (``pip install 'attnres[hf]'``); this
  module imports it only when such a model is built.

Every field of one backbone is rejected, with a one-line error, when set for another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from attnres.model.kimi_layout import KDA, MLA, kimi_sizes, layer_kinds, moe_layers
from attnres.residual.options import (
    Option,
    bad_option,
    boolean,
    check_scheme_options,
    is_positive_int,
)


def _lazy(module: str, name: str) -> Callable:
    """``module.name``, imported on first call (the Kimi Linear blocks need transformers)."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = name
    return call


def _nothing(*args, **kwargs):
    return None


def _no_report(model) -> dict[str, float]:
    return {}


def _no_counters(model) -> list:
    return []


def _no_stacks(model) -> list[str]:
    return []


@dataclass(frozen=True)
class BackboneInfo:
    """A registry entry.

    ``block(config, index)``: Transformer block ``index`` (holds its two sublayers and pre-norms as
    ``attn_norm``/``attn``/``mlp_norm``/``mlp`` and reads/writes the stream, like
    ``attnres.model.llama.TransformerBlock``). ``norm(config)``: the final norm. ``options``: the
    ModelConfig fields only this backbone reads; ``check(config)``: its cross-field rules.
    ``rope_dim(config)``: width of the rotary tables (0: no rotary positions). ``params(config)``:
    parameters of the PreNorm model. ``cache``: the kind of decoding cache the blocks read and write,
    a key of ``attnres.inference.CACHE_KINDS`` ("kv": keys and values; "hybrid": Kimi Linear's MLA
    latents and KDA states); the inference layer builds it.
    ``init_weights(model)``: initialisation of parameters the generic rule of
    ``AttnResLM.reset_parameters`` does not cover. ``matrix_stacks(model)``: names of parameters that
    are stacks of independent matrices (MoE experts: Muon treats each matrix on its own).
    ``step_counters(model)`` / ``end_step(model)``: statistics accumulated over a training step
    (summed over data-parallel replicas) and the per-step update and report that consume them.
    ``padded_batches``: whether ``AttnResLM`` may run batches with padding (an ``attention_mask``).
    """

    name: str
    description: str
    block: Callable
    norm: Callable
    params: Callable
    cache: str
    rope_dim: Callable
    options: Mapping[str, Option] = field(default_factory=dict)
    check: Callable = _nothing
    init_weights: Callable = _nothing
    matrix_stacks: Callable = _no_stacks
    step_counters: Callable = _no_counters
    end_step: Callable = _no_report
    padded_batches: bool = True


# ----------------------------------------------------------------------------- llama


def _llama_check(config) -> None:
    if config.d_model % config.n_heads:
        raise bad_option(
            "n_heads", config.n_heads, f"must divide d_model={config.d_model}; pick a divisor of {config.d_model}"
        )
    if config.head_dim % 2:
        raise bad_option(
            "n_heads", config.n_heads, f"gives odd head_dim={config.head_dim}; RoPE needs an even head dimension"
        )
    if config.n_heads % config.n_kv_heads:
        raise bad_option(
            "n_kv_heads", config.n_kv_heads, f"must divide n_heads={config.n_heads} (grouped-query attention)"
        )


def _llama_params(config) -> int:
    d, V = config.d_model, config.vocab_size
    kv = config.n_kv_heads * config.head_dim
    attn = 2 * d * d + 2 * d * kv
    mlp = 3 * d * config.d_ff
    per_block = attn + mlp + 2 * d  # two pre-norms
    head = 0 if config.tie_embeddings else V * d
    return V * d + head + config.n_layers * per_block + d  # + final norm


def _llama_block(config, index: int):
    from attnres.model.llama import TransformerBlock

    return TransformerBlock(config)


def _llama_norm(config):
    from torch import nn

    return nn.RMSNorm(config.d_model, eps=config.norm_eps)


# ----------------------------------------------------------------------------- kimi_linear


def _pattern(value, config) -> str | None:
    if not isinstance(value, str) or not value or set(value) - {KDA, MLA}:
        return (
            f"must be a non-empty string of {KDA!r} (KDA) and {MLA!r} (MLA) layers, repeated over the "
            "layers, e.g. 'KKKM' (3:1, the paper's) or 'KM'"
        )
    if len(value) > config.n_layers:
        return f"is longer than n_layers={config.n_layers}; give at most one letter per layer"
    return None


def _positive_or_none(what: str) -> Callable:
    def check(value, config):
        return None if value is None or is_positive_int(value) else f"must be a positive integer ({what}) or None"

    return check


def _positive(what: str) -> Callable:
    def check(value, config):
        return None if is_positive_int(value) else f"must be a positive integer ({what})"

    return check


def _experts(value, config):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value == 1:
        return "must be 0 (a dense MLP in every layer) or at least 2 (transformers' router scores experts in pairs)"
    return None


def _dense_layers(value, config):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= config.n_layers:
        return f"must be an integer in [0, n_layers={config.n_layers}] (leading layers with a dense MLP)"
    return None


def _positive_number(value, config):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return "must be a positive number"
    return None


def _non_negative_number(value, config):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return "must be a non-negative number (0 turns the router-bias balancing off)"
    return None


def _positive_number_or_none(what: str) -> Callable:
    def check(value, config):
        if value is None or _positive_number(value, config) is None:
            return None
        return f"must be a positive number ({what})"

    return check


def _negative_number_or_none(value, config):
    if value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and value < 0):
        return None
    return "must be a negative number (the log of the smallest decay per step, e.g. -5) or None (Kimi Linear's decay)"


KIMI_OPTIONS = {
    "kimi_layer_pattern": Option(_pattern),
    "kda_heads": Option(_positive_or_none("KDA heads; default n_heads")),
    "kda_head_dim": Option(_positive_or_none("KDA head width; default d_model // n_heads")),
    "kda_conv_kernel": Option(_positive("KDA short-convolution width")),
    "mla_kv_rank": Option(_positive_or_none("MLA latent key/value rank; default d_model // 2")),
    "mla_q_rank": Option(_positive_or_none("MLA query rank; None: uncompressed queries")),
    "mla_qk_nope_dim": Option(_positive_or_none("MLA per-head query/key width")),
    "mla_qk_rope_dim": Option(_positive_or_none("MLA key width shared by all heads")),
    "mla_v_dim": Option(_positive_or_none("MLA per-head value width")),
    "moe_experts": Option(_experts),
    "moe_top_k": Option(_positive("experts per token")),
    "moe_shared_experts": Option(_positive("shared experts")),
    "moe_d_ff": Option(_positive_or_none("expert hidden width")),
    "moe_dense_layers": Option(_dense_layers),
    "moe_routed_scale": Option(_positive_number),
    "moe_renormalize": Option(boolean),
    "moe_bias_update_rate": Option(_non_negative_number),
    "situ_beta": Option(_positive_number_or_none("SiTU's beta; None: SwiGLU")),
    "situ_linear_beta": Option(_positive_number_or_none("SiTU's up-branch beta; None: off")),
    "kda_full_rank_gate": Option(boolean),
    "kda_gate_lower_bound": Option(_negative_number_or_none),
    "mla_output_gate": Option(boolean),
    "moe_layer_freq": Option(_positive("period of the MoE layers after the dense ones")),
    "moe_groups": Option(_positive("expert groups")),
    "moe_topk_groups": Option(_positive("expert groups a token's experts come from")),
    "moe_latent_dim": Option(_positive_or_none("latent width of the routed experts; None: d_model")),
    "moe_latent_norm": Option(boolean),
}
_MOE_ONLY = (
    "moe_top_k",
    "moe_shared_experts",
    "moe_d_ff",
    "moe_dense_layers",
    "moe_routed_scale",
    "moe_renormalize",
    "moe_bias_update_rate",
    "moe_layer_freq",
    "moe_groups",
    "moe_topk_groups",
    "moe_latent_dim",
    "moe_latent_norm",
)


def _kimi_check(config) -> None:
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    if config.n_kv_heads != config.n_heads:
        raise bad_option(
            "n_kv_heads",
            config.n_kv_heads,
            f"must equal n_heads={config.n_heads} for backbone='kimi_linear' (MLA expands one "
            "latent into keys and values for every head)",
        )
    if config.rope_theta != defaults["rope_theta"]:
        raise bad_option(
            "rope_theta",
            config.rope_theta,
            "applies to backbone='llama' only: Kimi Linear's MLA has no positional encoding "
            "(KDA carries position); drop it",
        )
    if config.situ_linear_beta is not None and config.situ_beta is None:
        raise bad_option(
            "situ_linear_beta", config.situ_linear_beta, "squashes SiTU's up branch: set situ_beta too, or drop it"
        )
    if config.moe_experts == 0:
        for name in _MOE_ONLY:
            if getattr(config, name) != defaults[name]:
                raise bad_option(
                    name,
                    getattr(config, name),
                    "applies to the mixture of experts only; set moe_experts >= 2 or drop it",
                )
        return
    if config.moe_top_k > config.moe_experts:
        raise bad_option("moe_top_k", config.moe_top_k, f"must be at most moe_experts={config.moe_experts}")
    _check_moe_k3(config)


def _check_moe_k3(config) -> None:
    """Kimi K3's routing and MoE-layout rules (grouped top-k, the latent norm, MoE layers exist)."""
    groups, chosen = config.moe_groups, config.moe_topk_groups
    if config.moe_experts % groups or config.moe_experts // groups < 2:
        raise bad_option(
            "moe_groups",
            groups,
            f"must divide moe_experts={config.moe_experts} into groups of at least 2 experts (a group "
            "scores by its top two)",
        )
    if chosen > groups:
        raise bad_option("moe_topk_groups", chosen, f"must be at most moe_groups={groups}")
    if config.moe_top_k > chosen * (config.moe_experts // groups):
        raise bad_option(
            "moe_top_k",
            config.moe_top_k,
            f"exceeds the {chosen * (config.moe_experts // groups)} experts of moe_topk_groups={chosen} groups",
        )
    if config.moe_latent_norm and config.moe_latent_dim is None:
        raise bad_option("moe_latent_norm", True, "normalises the latent MoE's sum: set moe_latent_dim too")
    if config.moe_layer_freq != 1 and not any(moe_layers(config)):
        raise bad_option(
            "moe_layer_freq",
            config.moe_layer_freq,
            f"with moe_dense_layers={config.moe_dense_layers} leaves no MoE layer among n_layers="
            f"{config.n_layers}; lower either, or set moe_experts=0",
        )


def kimi_params(config) -> int:
    """Parameters of the PreNorm Kimi Linear model (checked against the real modules in the tests)."""
    d, V = config.d_model, config.vocab_size
    s = kimi_sizes(config)
    heads, hd, k = s["kda_heads"], s["kda_head_dim"], config.kda_conv_kernel
    inner = heads * hd
    kda = (
        3 * d * inner
        + 3 * inner * k  # q/k/v projections, depthwise short convolution
        + d * hd
        + hd * inner
        + inner
        + heads  # forget gate: low-rank projection, dt bias, A_log
        + d * heads  # beta
        + (d * inner if config.kda_full_rank_gate else d * hd + hd * inner)
        + hd  # output gate (full or low rank) and its gated norm
        + inner * d
    )  # output projection
    nh, nope, rope, v, rank = (
        config.n_heads,
        s["mla_qk_nope_dim"],
        s["mla_qk_rope_dim"],
        s["mla_v_dim"],
        s["mla_kv_rank"],
    )
    q = (
        d * nh * (nope + rope)
        if config.mla_q_rank is None
        else d * config.mla_q_rank + config.mla_q_rank + config.mla_q_rank * nh * (nope + rope)
    )
    mla = q + d * (rank + rope) + rank + rank * nh * (nope + v) + nh * v * d
    mla += d * nh * v if config.mla_output_gate else 0
    dense = 3 * d * config.d_ff
    w, e, r = s["moe_d_ff"], config.moe_experts, config.moe_latent_dim
    moe = 3 * e * w * (r or d) + e * d + 3 * d * w * config.moe_shared_experts
    moe += 0 if r is None else 2 * d * r + (r if config.moe_latent_norm else 0)
    total = V * d + (0 if config.tie_embeddings else V * d) + d
    for kind, sparse in zip(layer_kinds(config), moe_layers(config), strict=True):
        total += 2 * d + (kda if kind == KDA else mla) + (moe if sparse else dense)
    return total


# ----------------------------------------------------------------------------- registry

BACKBONES: dict[str, BackboneInfo] = {
    "llama": BackboneInfo(
        "llama",
        "LLaMA-style decoder: GQA attention with RoPE, SwiGLU MLP (attnres.model.llama)",
        block=_llama_block,
        norm=_llama_norm,
        params=_llama_params,
        cache="kv",
        rope_dim=lambda config: config.head_dim,
        check=_llama_check,
    ),
    "kimi_linear": BackboneInfo(
        "kimi_linear",
        "Kimi Linear: transformers' KDA and MLA sublayers (3:1 by default), dense MLP in "
        "the first layers, then a mixture of experts with shared experts (attnres.model.kimi_linear)",
        block=_lazy("attnres.model.kimi_linear", "KimiLinearBlock"),
        norm=_lazy("attnres.model.kimi_linear", "final_norm"),
        params=kimi_params,
        cache="hybrid",
        rope_dim=lambda config: 0,
        options=KIMI_OPTIONS,
        check=_kimi_check,
        init_weights=_lazy("attnres.model.kimi_linear", "init_kimi_weights"),
        matrix_stacks=_lazy("attnres.model.kimi_linear", "matrix_stacks"),
        step_counters=_lazy("attnres.model.kimi_linear", "expert_load_counters"),
        end_step=_lazy("attnres.model.kimi_linear", "end_step"),
        padded_batches=False,
    ),
}


def validate_backbone(config) -> None:
    """``config.backbone`` names a registered backbone, its fields pass their checks, and no field of
    another backbone is set."""
    if not isinstance(config.backbone, str) or config.backbone not in BACKBONES:
        raise bad_option("backbone", config.backbone, f"choose one of {sorted(BACKBONES)}")
    check_scheme_options(config, BACKBONES, selector="backbone")
    BACKBONES[config.backbone].check(config)
