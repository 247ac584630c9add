"""Backbones: the Transformer blocks a residual stream runs through, behind one registry.

Each entry says how to build a block and the final norm, which ``ModelConfig`` fields belong to the
backbone (each with its check, as ``attnres.residual.RESIDUALS`` does for schemes), how many
parameters the PreNorm model has, and what the backbone needs beyond the generic parts of
``AttnResLM`` (rotary tables, the kind of decoding cache, extra initialisation, per-step updates).
``ModelConfig`` names no backbone itself: it validates through each entry's options and checks, which
``attnres.model.backbone_args`` declares apart from the blocks, and tensor parallelism reads each
entry's ``tensor_plan``.

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
from dataclasses import dataclass

from attnres.model.backbone_args import BACKBONE_RULES, BackboneRules, validate_backbone
from attnres.model.kimi_layout import KDA, MLA, kimi_sizes, layer_kinds, moe_layers
from attnres.residual.options import Option

__all__ = [  # the Kimi layout's names too: they were importable from here before it had its module
    "BACKBONES",
    "KDA",
    "MLA",
    "BackboneInfo",
    "TensorPlan",
    "kimi_params",
    "kimi_sizes",
    "layer_kinds",
    "moe_layers",
    "validate_backbone",
]


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
class TensorPlan:
    """How tensor parallelism splits a backbone's Transformer blocks (``attnres.parallel.tensor`` and
    the torchtitan integration both apply it).

    ``block``: submodule of a block -> "colwise" (output features split) or "rowwise" (input features
    split); a submodule a block does not have is skipped (Kimi Linear's dense and MoE layers differ).
    ``widths(config)``: (field, its value, the width split over the ranks) for every width the plan
    divides, which must be a multiple of tp. ``whole_sublayers``: the plan splits every sublayer of every
    block (attention by heads), so the block's input may be gathered from a sequence-parallel stream and
    torchtitan's plan, which shards every entry of every block, applies; False where some sublayers stay
    replicated."""

    block: Mapping[str, str]
    widths: Callable
    whole_sublayers: bool


@dataclass(frozen=True)
class BackboneInfo:
    """A registry entry.

    ``block(config, index)``: Transformer block ``index`` (holds its two sublayers and pre-norms as
    ``attn_norm``/``attn``/``mlp_norm``/``mlp`` and reads/writes the stream, like
    ``attnres.model.llama.TransformerBlock``). ``norm(config)``: the final norm. ``params(config)``:
    parameters of the PreNorm model. ``cache``: the kind of decoding cache the blocks read and write,
    a key of ``attnres.inference.CACHE_KINDS`` ("kv": keys and values; "hybrid": Kimi Linear's MLA
    latents and KDA states); the inference layer builds it. ``tensor_plan``: how tensor parallelism
    splits its blocks (``TensorPlan``).
    ``init_weights(model)``: initialisation of parameters the generic rule of
    ``AttnResLM.reset_parameters`` does not cover. ``matrix_stacks(model)``: names of parameters that
    are stacks of independent matrices (MoE experts: Muon treats each matrix on its own).
    ``step_counters(model)`` / ``end_step(model)``: statistics accumulated over a training step
    (summed over data-parallel replicas) and the per-step update and report that consume them.
    ``padded_batches``: whether ``AttnResLM`` may run batches with padding (an ``attention_mask``).

    ``options`` (the ModelConfig fields only this backbone reads), ``check(config)`` (its cross-field
    rules) and ``rope_dim(config)`` (width of the rotary tables; 0: no rotary positions) are its
    ``BackboneRules`` of ``attnres.model.backbone_args``, which validation reads without importing a block.
    """

    name: str
    description: str
    block: Callable
    norm: Callable
    params: Callable
    cache: str
    tensor_plan: TensorPlan
    init_weights: Callable = _nothing
    matrix_stacks: Callable = _no_stacks
    step_counters: Callable = _no_counters
    end_step: Callable = _no_report
    padded_batches: bool = True

    @property
    def rules(self) -> BackboneRules:
        return BACKBONE_RULES[self.name]

    @property
    def options(self) -> Mapping[str, Option]:
        return self.rules.options

    @property
    def check(self) -> Callable:
        return self.rules.check

    @property
    def rope_dim(self) -> Callable:
        return self.rules.rope_dim


# ----------------------------------------------------------------------------- llama


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


def _llama_widths(config) -> list[tuple[str, int | None, int | None]]:
    return [
        ("n_heads", config.n_heads, config.n_heads),
        ("n_kv_heads", config.n_kv_heads, config.n_kv_heads),
        ("d_ff", config.d_ff, config.d_ff),
    ]


# q/k/v split by heads (n_heads/tp and n_kv_heads/tp per rank), the SwiGLU by hidden units
LLAMA_TENSOR_PLAN = TensorPlan(
    block={
        "attn.q_proj": "colwise",
        "attn.k_proj": "colwise",
        "attn.v_proj": "colwise",
        "attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    },
    widths=_llama_widths,
    whole_sublayers=True,
)


# ----------------------------------------------------------------------------- kimi_linear


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


def _kimi_widths(config) -> list[tuple[str, int | None, int | None]]:
    widths: list[tuple[str, int | None, int | None]] = [("d_ff", config.d_ff, config.d_ff)]
    if any(moe_layers(config)) and config.moe_shared_experts:
        moe_d_ff = kimi_sizes(config)["moe_d_ff"]  # the shared experts are one MLP this many times as wide
        widths.append(("moe_d_ff", moe_d_ff, moe_d_ff * config.moe_shared_experts))
    return widths


# The dense MLPs and the MoE's shared experts only. KDA, MLA and the routed experts stay replicated:
# transformers' KDA feeds q, k and v through one short convolution split by the full head count, MLA
# reshapes by its configured head count, and the routed experts are 3-D stacks behind transformers' own
# dispatch, none of which a column-wise nn.Linear split can reach (transformers' own TP plan for Kimi
# Linear covers the MLPs only).
KIMI_TENSOR_PLAN = TensorPlan(
    block={
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
        "mlp.shared_experts.gate_proj": "colwise",
        "mlp.shared_experts.up_proj": "colwise",
        "mlp.shared_experts.down_proj": "rowwise",
    },
    widths=_kimi_widths,
    whole_sublayers=False,
)


# ----------------------------------------------------------------------------- registry

BACKBONES: dict[str, BackboneInfo] = {
    "llama": BackboneInfo(
        "llama",
        "LLaMA-style decoder: GQA attention with RoPE, SwiGLU MLP (attnres.model.llama)",
        block=_llama_block,
        norm=_llama_norm,
        params=_llama_params,
        cache="kv",
        tensor_plan=LLAMA_TENSOR_PLAN,
    ),
    "kimi_linear": BackboneInfo(
        "kimi_linear",
        "Kimi Linear: transformers' KDA and MLA sublayers (3:1 by default), dense MLP in "
        "the first layers, then a mixture of experts with shared experts (attnres.model.kimi_linear)",
        block=_lazy("attnres.model.kimi_linear", "KimiLinearBlock"),
        norm=_lazy("attnres.model.kimi_linear", "final_norm"),
        params=kimi_params,
        cache="hybrid",
        tensor_plan=KIMI_TENSOR_PLAN,
        init_weights=_lazy("attnres.model.kimi_linear", "init_kimi_weights"),
        matrix_stacks=_lazy("attnres.model.kimi_linear", "matrix_stacks"),
        step_counters=_lazy("attnres.model.kimi_linear", "expert_load_counters"),
        end_step=_lazy("attnres.model.kimi_linear", "end_step"),
        padded_batches=False,
    ),
}
