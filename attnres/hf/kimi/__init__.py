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

Kimi K3 directories (``model_type = "kimi_k3"``) load too, with K3's additions as the backbone's
options (``attnres.model.k3_blocks``); ``attnres.serving.mlx.save_mlx`` writes them.

Everything a checkpoint may hold that these models do not implement (another activation, grouped
routing in a kimi_linear checkpoint, another router activation, attention biases, quantised weights,
unknown tensors) is rejected with a :class:`ConversionError` naming it.

Modules: ``layout`` (config fields and tensor names), ``k3`` (K3's config.json), ``k3_layout`` (K3's
keys as fields, its tensor names as ours), ``load`` (``convert_kimi_linear``,
``kimi_conversion_error``), ``save`` (``save_kimi_linear``), ``auto`` (the ``AutoModelForCausalLM`` hook).
"""

from attnres.hf.kimi.auto import KimiLinearAutoModel, register_auto_model
from attnres.hf.kimi.layout import (
    attn_res_block_size,
    kimi_model_fields,
    layout_residual,
)
from attnres.hf.kimi.load import build_lm, convert_kimi_linear, kimi_conversion_error
from attnres.hf.kimi.save import kimi_config_dict, kimi_state_dict, save_kimi_linear

__all__ = [
    "KimiLinearAutoModel",
    "attn_res_block_size",
    "build_lm",
    "convert_kimi_linear",
    "kimi_config_dict",
    "kimi_conversion_error",
    "kimi_model_fields",
    "kimi_state_dict",
    "layout_residual",
    "register_auto_model",
    "save_kimi_linear",
]
