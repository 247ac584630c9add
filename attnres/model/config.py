"""ModelConfig: every knob of the decoder and its residual scheme, validated on creation."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Union

from attnres.model.backbone_args import (
    BACKBONE_RULES,
    KimiLinearArgs,
    validate_backbone,
)
from attnres.residual.args import SCHEME_RULES, SchemeArgs, validate_scheme
from attnres.residual.options import bad_option as _bad
from attnres.residual.options import is_positive_int as _positive_int

_TYPE_NAMES = {int: "an integer", float: "a finite number", str: "a string", bool: "True or False"}


def _has_type(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # bools are ints to Python, not to a config
        return False
    if kind is int:
        return isinstance(value, int)
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def check_field_types(config) -> None:
    """Every field of the dataclass ``config`` holds a value of its annotated type (int, float, str,
    bool, or Optional of one; floats finite), before anything is derived from it: a wrong type is a
    one-line ValueError naming the field, never a TypeError from the arithmetic that would follow.
    Fields of other types are left to the config's own checks."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, kind = getattr(config, f.name), hints[f.name]
        optional = False
        if typing.get_origin(kind) in (Union, types.UnionType):  # Optional[int] and int | None
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            optional = len(args) < len(typing.get_args(kind))
            if len(args) != 1:
                continue
            kind = args[0]
        if kind not in _TYPE_NAMES or (optional and value is None) or _has_type(value, kind):
            continue
        raise ValueError(
            f"{type(config).__name__}.{f.name}={value!r} is invalid: must be {_TYPE_NAMES[kind]}"
            + (" or None" if optional else "")
        )


@dataclass
class _DecoderArgs:
    """The decoder's own fields (the first fields of ``ModelConfig``, in this order)."""

    backbone: str = "llama"
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    residual: str = "block"


# Fields come base by base from the last base listed: the decoder's, every scheme family's
# (``attnres.residual.args``), then Kimi Linear's (``attnres.model.backbone_args``); each is declared
# once, there, with the name ``--set``, TOML specs, config.json and docs/options.md use.
@dataclass
class ModelConfig(KimiLinearArgs, SchemeArgs, _DecoderArgs):
    """A decoder (LLaMA-style, or Kimi Linear) with a pluggable residual stream.

    Sizes count Transformer blocks (``n_layers`` = L_b); the residual schemes count sublayers
    (L = 2 * n_layers: one attention and one MLP each). Which fields the chosen backbone
    (``attnres.model.backbones.BACKBONES``) and residual scheme (``attnres.residual.RESIDUALS``)
    read, and how each is checked, is their registries' business (validation reads their rules in
    ``attnres.model.backbone_args`` and ``attnres.residual.args``, which declare those fields); every
    field's one-line description is in ``FIELD_DOCS`` below. ``attnres options`` prints them all as
    one table (docs/options.md).
    """

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None and _positive_int(self.d_model):  # else validate() names d_model
            # SwiGLU with ~8/3 * d hidden units, rounded up to a multiple of 32
            self.d_ff = 32 * math.ceil(8 * self.d_model / 3 / 32)
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Width of the rotary tables: head_dim for "llama", 0 for a backbone without RoPE."""
        return BACKBONE_RULES[self.backbone].rope_dim(self)

    @property
    def block_sizes(self) -> list[int]:
        """Sublayers of each depth block, in order ("full": all 1; schemes without depth blocks: [L])."""
        return SCHEME_RULES[self.residual].block_sizes(self)

    @property
    def block_size(self) -> int:
        """S: sublayers per depth block ("full" is S = 1; schemes without depth blocks: L); with
        uneven blocks (``attnres_block_sizes``) the largest."""
        return max(self.block_sizes)

    @property
    def group_size(self) -> int:
        """G: sublayers sharing one Phase-1 pass in Full AttnRes' two-phase schedule (1 otherwise)."""
        return SCHEME_RULES[self.residual].group_size(self)

    @property
    def num_blocks(self) -> int:
        """N: depth blocks (equal ones with the last possibly shorter, or ``attnres_block_sizes``)."""
        return len(self.block_sizes)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """The decoder's own fields here; the backbone and the residual scheme, each with its options,
        by their registries; last, every field's type (the checks above give the more specific
        messages first)."""
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")
        for name in positive:
            value = getattr(self, name)
            if not _positive_int(value):
                raise _bad(name, value, "must be a positive integer")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _bad(name, value, "must be a positive number")
        if not isinstance(self.tie_embeddings, bool):
            raise _bad("tie_embeddings", self.tie_embeddings, "must be True or False")
        validate_backbone(self)
        validate_scheme(self)
        check_field_types(self)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)


# One line per field: what it means. ``attnres options`` (attnres.model.options_table) prints them with
# each field's type, default and the scheme or backbone that reads it (docs/options.md).
FIELD_DOCS: dict[str, str] = {
    "backbone": "the decoder's sublayers: a BACKBONES entry",
    "vocab_size": "tokens in the vocabulary",
    "d_model": "width d of the residual stream",
    "n_layers": "Transformer blocks L_b (L = 2 L_b sublayers: attention and MLP)",
    "n_heads": "attention heads",
    "n_kv_heads": "key/value heads of grouped-query attention (None: n_heads)",
    "d_ff": "hidden width of the dense SwiGLU MLP (None: about 8d/3, rounded up to a multiple of 32)",
    "max_seq_len": "longest sequence (rotary tables, caches)",
    "rope_theta": "RoPE base (the llama backbone only; Kimi Linear's MLA has no rotary positions)",
    "norm_eps": "eps of every RMSNorm",
    "tie_embeddings": "share the embedding and the output head (not under pipeline parallelism)",
    "init_std": "standard deviation of the initial weights",
    "residual": "the residual scheme: a RESIDUALS entry (`attnres schemes`)",
    "attnres_blocks": "Block AttnRes: N depth blocks (S = ceil(L / N), the last block shorter); "
    "give at most one of N, S, the sizes",
    "attnres_block_size": "Block AttnRes: S sublayers per depth block (None with N unset: the smallest "
    "even S giving at most 8 blocks)",
    "attnres_weights": "the depth query: pseudo_query (the method), input_query (q = W h, W zero-init), "
    "low_rank_query (q = w + U V h, U zero-init) or scalar (one logit per sublayer and source)",
    "attnres_kernel": "softmax (normalised depth weights) or sigmoid (independent ones)",
    "attnres_key_norm": "RMSNorm on the keys",
    "attnres_heads": "per-head channel groups with their own depth weights (the key norm spans all of d)",
    "attnres_window": "Full AttnRes over the embedding and the last W sources only",
    "attnres_group_size": "Full AttnRes, two-phase: G sublayers share one Phase-1 pass (exact; None: round(sqrt L))",
    "attnres_scale_norm_eps": "scale each pre-norm's eps by c^2 (c: the init weight of a source) so that a "
    "zero-query model equals PreNorm exactly; the retrofit turns it on",
    "attnres_impl": "two_phase (batched Phase 1 per depth block, docs/method.md §6), fused (one op per "
    "sublayer) or reference (plain autograd over a stacked history)",
    "attnres_sources": "outputs (the paper: sublayer outputs, block sums) or states (running residual sums; "
    "docs/method.md §5)",
    "attnres_block_sizes": "Block AttnRes: explicit, possibly uneven depth blocks, sublayers per block, summing to L",
    "attnres_query_rank": "rank r of low_rank_query, 1 <= r < d",
    "attnres_values": "raw (the paper, Kimi K3: mix the sources) or normalized (mix RMSNorm(source): Inkling-2)",
    "attnres_score_scale": "factor on every depth logit (Inkling-2: d_model ** -0.5); none: the paper's "
    "unscaled logits",
    "attnres_read_queries": "queries per read, L + 1 entries: a read with Q > 1 returns Q mixtures [Q, B, T, D] "
    "(Inkling-2: 3 before full attention, for its q, k and v inputs)",
    "attnres_routing": "replacement (the paper: a sublayer reads sum_i alpha_i v_i) or additive (Delta AttnRes: it "
    "reads the PreNorm stream plus g_l * sum_i alpha_i v_i, g_l a gain: attnres_gain; zero at init: PreNorm at step 0)",
    "attnres_gain": "additive routing's gain g_l: per_channel (a learned D-vector per read), scalar (a learned "
    "number per read) or unit (Delta AttnRes as published: g = 1, no parameter; its first and final reads are h_std)",
    "attnres_gain_init": "additive routing: the learned gain's initial value (0: PreNorm exactly at step 0; 1: "
    "h_std + the mixture, as Delta AttnRes)",
    "attnres_gain_lr": "additive routing: the learned gain's learning rate as a multiple of the optimizer's",
    "layerscale_init": "LayerScale's initial lambda (None: CaiT's rule by depth: 0.1 up to 18 blocks, "
    "1e-5 up to 24, 1e-6 beyond)",
    "highway_rank": "rank r of the Highway gate W_g = U V (None: a full d x d matrix)",
    "denseformer_dilation": "DenseFormer: the average after block I reads block outputs j <= I with j = I (mod k)",
    "denseformer_period": "DenseFormer: an average after every p-th block",
    "hyper_streams": "Hyper-Connections: n residual streams",
    "hyper_dynamic": "Hyper-Connections: input-dependent (DHC) or static (SHC) weights",
    "mhc_streams": "mHC: n residual streams",
    "mhc_sinkhorn_iters": "mHC: Sinkhorn iterations of the doubly stochastic mixer",
    "gated_heads": "heads H of the gated rival's depth attention",
    "kimi_layer_pattern": "each layer's attention, K (Kimi Delta Attention) or M (multi-head latent "
    "attention), repeated over the layers",
    "kda_heads": "KDA heads (None: n_heads)",
    "kda_head_dim": "KDA head width (None: d_model // n_heads)",
    "kda_conv_kernel": "KDA short-convolution width",
    "mla_kv_rank": "MLA latent key/value rank (None: d_model // 2)",
    "mla_q_rank": "MLA query rank (None: uncompressed queries)",
    "mla_qk_nope_dim": "MLA per-head query-key width without position (None: d_model // n_heads)",
    "mla_qk_rope_dim": "MLA key part shared by all heads (None: half the head width; no rotation applied)",
    "mla_v_dim": "MLA per-head value width (None: d_model // n_heads)",
    "moe_experts": "routed experts (0: a dense SwiGLU MLP of width d_ff everywhere)",
    "moe_top_k": "experts each token is routed to",
    "moe_shared_experts": "experts every token passes through",
    "moe_d_ff": "expert width (None: ceil(d_ff / (top_k + shared)))",
    "moe_dense_layers": "leading layers that keep the dense MLP",
    "moe_routed_scale": "scale of the routed experts' sum (transformers' routed_scaling_factor)",
    "moe_renormalize": "renormalise the top-k routing weights (transformers' norm_topk_prob)",
    "moe_bias_update_rate": "aux-loss-free balancing: after each step every routing bias moves this much "
    "toward the mean load (0: off)",
    "situ_beta": "Kimi K3's SiTU activation beta·tanh(gate/beta)·sigmoid(gate)·up in every MLP and expert "
    "(K3's activation_situ_beta; None: SwiGLU)",
    "situ_linear_beta": "SiTU's up branch squashed to b·tanh(up/b) (K3's activation_situ_linear_beta; "
    "needs situ_beta; None: off)",
    "kda_full_rank_gate": "KDA output gate as one d_model x heads·head_dim projection (K3's "
    "use_full_rank_gate; False: Kimi Linear's low-rank pair)",
    "kda_gate_lower_bound": "KDA decay exp(bound·sigmoid(exp(A_log)·(f + dt_bias))), a negative bound "
    "(K3's gate_lower_bound; None: Kimi Linear's exp(-exp(A_log)·softplus(f + dt_bias)))",
    "mla_output_gate": "MLA output times sigmoid of a projection of the layer input (K3's mla_use_output_gate)",
    "moe_layer_freq": "after the dense layers, every moe_layer_freq-th layer (index divisible by it) is MoE "
    "(K3's moe_layer_freq)",
    "moe_groups": "expert groups for routing (K3's num_expert_group; 1: ungrouped top-k)",
    "moe_topk_groups": "groups, best by their top-2 scores, a token's experts are chosen from (K3's topk_group)",
    "moe_latent_dim": "latent MoE: routed experts run at this width between a down and an up projection "
    "(K3's routed_expert_hidden_size; None: at d_model)",
    "moe_latent_norm": "RMSNorm on the routed experts' latent sum (K3's latent_moe_use_norm; needs moe_latent_dim)",
}
