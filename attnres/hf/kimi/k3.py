"""Kimi K3 checkpoints (``model_type = "kimi_k3"``): reading their config.json.

The released K3 is a Kimi Linear text model (``text_config``, model_type ``kimi_linear``) with
docs/method.md §10's attention residuals and additions of its own, each a ``ModelConfig`` option of
the Kimi Linear backbone (``attnres.model.k3_blocks``); a K3 directory loads through
``attnres.hf.kimi.k3_layout`` (its keys as fields, its tensor names as ours).

A checkpoint of ``model_type = "kimi_linear"`` is read by transformers' ``KimiLinearConfig``, which
knows none of K3's keys: :func:`check_k3_features` refuses them there by name (write such a model as
``kimi_k3``), rather than silently dropping them:

- ``hidden_act = "situ"`` (beta·tanh(gate/beta)·sigmoid(gate)·up) loads as SwiGLU only with no
  ``activation_situ_linear_beta`` and an ``activation_situ_beta`` that is a power of two >= 2^60,
  where beta·tanh(gate/beta) = gate exactly for 2^-66 <= |gate| < 2^33 (attnres.serving.k3);
- ``linear_attn_config.use_full_rank_gate`` / ``gate_lower_bound`` (K3's KDA output gate and decay),
  ``mla_use_output_gate``, ``mla_use_nope = false``, the latent MoE (``routed_expert_hidden_size``),
  ``moe_layer_freq`` other than 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from attnres.hf.convert import ConversionError

K3_MODEL_TYPE = "kimi_k3"
SWIGLU_SITU_MIN_BETA = 2.0**60


def read_k3_text(path) -> dict[str, Any] | None:
    """The text config (a dict) of a K3 directory's config.json; None when ``path`` holds another model type."""
    file = Path(path) / "config.json"
    data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    if not isinstance(data, dict) or data.get("model_type") != K3_MODEL_TYPE:
        return None
    text = dict(data.get("text_config") or data)
    if "quantization_config" in data:  # a multimodal release says it beside text_config
        text.setdefault("quantization_config", data["quantization_config"])
    return {k: v for k, v in text.items() if k not in ("model_type", "architectures", "transformers_version")}


def read_k3_config(path) -> Any:
    """The text model of a K3 directory as a ``KimiLinearConfig`` (None for another model type), for
    what it says besides the model's fields (``attn_res_block_size``, special token ids); transformers
    reads K3's own key names (``linear_attn_config``, ``num_experts``, ...). The model's fields come
    from :func:`attnres.hf.kimi.k3_layout.k3_model_fields`."""
    text = read_k3_text(path)
    if text is None:
        return None
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(**{**text, "hidden_act": "silu"})  # SiTU is ours to read, not transformers'
    config.k3_text = text
    return config


def _error(field: str, value, why: str) -> ConversionError:
    return ConversionError(
        f"cannot convert: Kimi K3's {field}={value!r} has no counterpart in the Kimi Linear "
        f"backbone here: {why} (docs/serving.md lists what remains)"
    )


def check_k3_features(c) -> None:
    """ConversionError for the first K3 addition in the text config ``c`` that the backbone lacks."""
    if getattr(c, "hidden_act", "silu") == "situ":
        beta, linear = getattr(c, "activation_situ_beta", None), getattr(c, "activation_situ_linear_beta", None)
        if linear is not None and linear > 0:
            raise _error("activation_situ_linear_beta", linear, "SiTU's squashed up branch is not SwiGLU")
        if beta is None or beta < SWIGLU_SITU_MIN_BETA or math.frexp(beta)[0] != 0.5:
            raise _error(
                "activation_situ_beta", beta, "SiTU equals SwiGLU exactly only for beta a power of two >= 2^60"
            )
    linear_attn = getattr(c, "linear_attn_config", None) or {}
    checks = [
        (
            "linear_attn_config.use_full_rank_gate",
            linear_attn.get("use_full_rank_gate", False),
            False,
            "KDA's output gate here is the low-rank g_a / g_b pair",
        ),
        (
            "linear_attn_config.gate_lower_bound",
            linear_attn.get("gate_lower_bound"),
            None,
            "KDA's decay here is -exp(A_log)·softplus(·), not the bounded sigmoid form",
        ),
        ("mla_use_output_gate", getattr(c, "mla_use_output_gate", False), False, "MLA here has no output gate"),
        ("mla_use_nope", getattr(c, "mla_use_nope", True), True, "MLA here has no rotary positions"),
        (
            "routed_expert_hidden_size",
            getattr(c, "routed_expert_hidden_size", None),
            None,
            "the experts here run at the model width (no latent MoE)",
        ),
        ("moe_layer_freq", getattr(c, "moe_layer_freq", 1), 1, "every layer after the dense ones is MoE here"),
    ]
    for field, value, allowed, why in checks:
        if value != allowed:
            raise _error(field, value, why)
