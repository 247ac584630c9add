"""The backbones' options, declared once, with their checks: what validation needs of a backbone.

``KimiLinearArgs`` declares the fields only the Kimi Linear backbone reads (``ModelConfig`` inherits
them); ``BACKBONE_RULES`` says, per backbone, which fields are its own (each with its check), its
rule over the whole config and the width of its rotary tables. ``validate_backbone`` validates
through it. This module imports no block, so ``ModelConfig`` validates without importing what builds
a model (``attnres.model.backbones.BACKBONES`` reads its entries from here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from attnres.model.kimi_layout import KDA, MLA, moe_layers
from attnres.residual.options import (
    Option,
    bad_option,
    boolean,
    check_scheme_options,
    is_positive_int,
)


@dataclass
class KimiLinearArgs:
    """Kimi Linear (and Kimi K3) options (every field is described in docs/options.md)."""

    kimi_layer_pattern: str = "KKKM"
    kda_heads: int | None = None
    kda_head_dim: int | None = None
    kda_conv_kernel: int = 4
    mla_kv_rank: int | None = None
    mla_q_rank: int | None = None
    mla_qk_nope_dim: int | None = None
    mla_qk_rope_dim: int | None = None
    mla_v_dim: int | None = None
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 1
    moe_d_ff: int | None = None
    moe_dense_layers: int = 1
    moe_routed_scale: float = 1.0
    moe_renormalize: bool = True
    moe_bias_update_rate: float = 1e-3
    situ_beta: float | None = None
    situ_linear_beta: float | None = None
    kda_full_rank_gate: bool = False
    kda_gate_lower_bound: float | None = None
    mla_output_gate: bool = False
    moe_layer_freq: int = 1
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_latent_dim: int | None = None
    moe_latent_norm: bool = False


def _nothing(config) -> None:
    return None


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


# ----------------------------------------------------------------------------- per backbone


@dataclass(frozen=True)
class BackboneRules:
    """What validation knows of a backbone: ``options`` (the config fields only it reads, each with
    its check), ``check(config)`` (its cross-field rules) and ``rope_dim(config)`` (the width of the
    rotary tables; 0: no rotary positions)."""

    rope_dim: Callable
    options: Mapping[str, Option] = field(default_factory=dict)
    check: Callable = _nothing


BACKBONE_RULES: dict[str, BackboneRules] = {
    "llama": BackboneRules(rope_dim=lambda config: config.head_dim, check=_llama_check),
    "kimi_linear": BackboneRules(rope_dim=lambda config: 0, options=KIMI_OPTIONS, check=_kimi_check),
}


def validate_backbone(config) -> None:
    """``config.backbone`` names a registered backbone, its fields pass their checks, and no field of
    another backbone is set."""
    if not isinstance(config.backbone, str) or config.backbone not in BACKBONE_RULES:
        raise bad_option("backbone", config.backbone, f"choose one of {sorted(BACKBONE_RULES)}")
    check_scheme_options(config, BACKBONE_RULES, selector="backbone")
    BACKBONE_RULES[config.backbone].check(config)
