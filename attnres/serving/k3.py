"""Our Kimi Linear-backbone models as the released Kimi K3 architecture sees them.

Two serving stacks run K3: llama.cpp (architecture ``kimi-k3``, :mod:`attnres.serving.gguf`) and
mlx-lm (``kimi_k3``, :mod:`attnres.serving.mlx`). Both implement docs/method.md §10's Block AttnRes
around Kimi Linear's KDA / MLA / MoE sublayers, plus what K3 adds. What we write, and how:

- **activation**: K3 replaces SwiGLU by SiTU,
  ``situ(gate, up) = beta·tanh(gate/beta)·sigmoid(gate) · up`` (``up`` optionally squashed by a
  second ``linear_beta``). As beta grows, ``beta·tanh(gate/beta)`` -> ``gate``, so SiTU
  -> ``silu(gate)·up``, our SwiGLU. With beta a power of two large enough
  (:data:`SWIGLU_SITU_BETA` = 2^60) the division and product by beta are exact in binary floating
  point, and a faithful tanh returns a tiny argument unchanged (its cubic term is under half an
  ulp): beta·tanh(gate/beta) = gate bit for bit in float32 and float64 for every |gate| from
  :data:`SWIGLU_EXACT_ABOVE` = 2^-66 (float32: below it gate/beta underflows and SiTU gives 0 where
  SwiGLU gives about gate/2·up, under 1e-20·|up|) to :data:`SWIGLU_EXACT_BELOW` = 2^33, and there
  SiTU = gate·sigmoid(gate)·up, SwiGLU (``tests/serving/test_gguf.py`` checks both dtypes).
- **the depth attention**: §10's per-sublayer pseudo-query w and key-norm weight g are only ever used
  as their product, which llama.cpp stores fused: ``*_res_score = g ⊙ w`` (computed in float64).
- **MoE**: the router (sigmoid scores, balancing bias for the choice only, top-k, renormalised,
  scaled), routed and shared experts: as in Kimi Linear; the bias is written even when zero.
- **K3's own additions** are options of our backbone (``attnres.model.k3_blocks``): SiTU with any
  beta and ``linear_beta`` (``situ_beta`` / ``situ_linear_beta``), the full-rank KDA gate, the KDA
  gate lower bound, the MLA output gate, the latent MoE (with its norm), ``moe_layer_freq`` and
  grouped routing. :func:`k3_text_config` writes each under K3's key (mlx-lm's ``kimi_k3`` agrees
  with our logits to 1e-4 in float32 with every one of them, ``tests/serving/test_mlx.py``);
  ``attnres.hf.kimi.k3_layout`` reads K3 configs and checkpoints back into them. For GGUF,
  :mod:`attnres.serving.gguf` writes what llama.cpp's kimi-k3 reads and refuses ``moe_layer_freq`` != 1,
  which it has no key for.

What a K3 stack cannot express at all raises :class:`ServingError` naming the field: a LLaMA
backbone (no llama.cpp / mlx-lm architecture has AttnRes around LLaMA blocks), Full AttnRes or any
Block AttnRes variant the §10 layout cannot store (``attnres.hf.kimi``'s rules, with their fixes),
and for the K3 checkpoint one routed expert with renormalisation (K3 renormalises two or more only).
"""

from __future__ import annotations

from typing import Any

from attnres.model.backbones import KDA, MLA, kimi_sizes, layer_kinds, moe_layers
from attnres.model.k3 import (
    situ as situ,  # K3's activation, re-exported beside the SwiGLU constants
)

# SiTU's beta that makes it SwiGLU (see the module docstring): a power of two, so x/beta and
# beta·y are exact
SWIGLU_SITU_BETA = 2.0**60
# below it, (gate / beta)^2 / 3 < 2^-56: under half an ulp of float64 (and float32), so tanh(y) = y
SWIGLU_EXACT_BELOW = 2.0**33
# above it, gate / beta is a normal float32 (>= 2^-126): the division loses no bits
SWIGLU_EXACT_ABOVE = 2.0**-66


class ServingError(ValueError):
    """A model a serving format cannot express; the message names the field, its value and the fix."""


def check_kimi_backbone(config, target: str) -> None:
    """ServingError unless ``config`` (a ModelConfig) has the Kimi Linear backbone."""
    if config.backbone != "kimi_linear":
        raise ServingError(
            f"ModelConfig.backbone={config.backbone!r} cannot be written as {target}: the only AttnRes "
            "architecture llama.cpp and mlx-lm know is Kimi K3 (a Kimi Linear model); LLaMA-backbone AttnRes "
            "models have none there. Serve them with attnres sample / generate or through transformers "
            "(attnres convert RUN out/hf), or train with --set backbone=kimi_linear"
        )


def layout_block_size(config, target: str) -> int | None:
    """§10's B (``attn_res_block_size``) for ``config``, None for a PreNorm model; ServingError
    (naming the field and the fix) for residual schemes the layout cannot store."""
    from attnres.hf.convert import ConversionError
    from attnres.hf.kimi.save import released_block_size

    try:  # the released layout's rules decide what Block AttnRes it stores
        return released_block_size(config)
    except ConversionError as e:
        raise ServingError(f"cannot write {target}: {e}") from None


def k3_text_config(config) -> dict[str, Any]:
    """The text config of a K3 checkpoint (``config.json``'s ``text_config``, the fields mlx-lm's
    ``kimi_k3`` and vLLM / SGLang read) describing ``config``'s model: Kimi Linear's sizes, the
    activation (SiTU with ``situ_beta``, or with :data:`SWIGLU_SITU_BETA` for SwiGLU), §10's
    ``attn_res_block_size`` and K3's options (``attnres.model.k3_blocks``)."""
    check_kimi_backbone(config, "a Kimi K3 checkpoint")
    b = layout_block_size(config, "a Kimi K3 checkpoint")
    s, kinds, sparse = kimi_sizes(config), layer_kinds(config), moe_layers(config)
    moe = any(sparse)
    if moe and config.moe_top_k == 1 and config.moe_renormalize:
        raise ServingError(
            "ModelConfig.moe_top_k=1 with moe_renormalize=True (every routing weight 1) cannot be written as "
            "Kimi K3, which renormalises only two or more experts (one keeps its sigmoid score); train with "
            "--set moe_renormalize=false or moe_top_k >= 2"
        )
    linear_attn: dict[str, Any] = {
        "num_heads": s["kda_heads"],
        "head_dim": s["kda_head_dim"],
        "short_conv_kernel_size": config.kda_conv_kernel,
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == KDA],
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == MLA],
        "use_full_rank_gate": bool(config.kda_full_rank_gate),
    }
    if config.kda_gate_lower_bound is not None:
        linear_attn["gate_lower_bound"] = float(config.kda_gate_lower_bound)
    swiglu = config.situ_beta is None
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "intermediate_size": config.d_ff,
        "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": False,
        "pad_token_id": None,  # the tokenizer's files name the special tokens
        "bos_token_id": None,
        "eos_token_id": None,
        "linear_attn_config": linear_attn,
        "hidden_act": "situ",
        "activation_situ_beta": SWIGLU_SITU_BETA if swiglu else float(config.situ_beta),
        "activation_situ_linear_beta": None if swiglu else config.situ_linear_beta,
        "attn_res_block_size": b,
        "q_lora_rank": config.mla_q_rank,
        "kv_lora_rank": s["mla_kv_rank"],
        "qk_nope_head_dim": s["mla_qk_nope_dim"],
        "qk_rope_head_dim": s["mla_qk_rope_dim"],
        "v_head_dim": s["mla_v_dim"],
        "mla_use_nope": True,
        "mla_use_output_gate": bool(config.mla_output_gate),
        "num_experts": config.moe_experts if moe else 0,
        "num_experts_per_token": config.moe_top_k,
        "num_shared_experts": config.moe_shared_experts if moe else 0,
        "moe_intermediate_size": s["moe_d_ff"],
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": bool(config.moe_renormalize),
        "routed_scaling_factor": float(config.moe_routed_scale),
        "first_k_dense_replace": config.moe_dense_layers if moe else config.n_layers,
        "moe_layer_freq": config.moe_layer_freq,
        "use_grouped_topk": config.moe_groups > 1,
        "num_expert_group": config.moe_groups,
        "topk_group": config.moe_topk_groups,
        "routed_expert_hidden_size": config.moe_latent_dim,
        "latent_moe_use_norm": bool(config.moe_latent_norm),
    }
