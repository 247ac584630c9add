"""ModelConfig: every knob of the decoder and its residual scheme, validated on creation."""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from attnres.model.backbones import BACKBONES, validate_backbone
from attnres.residual import RESIDUALS, validate_scheme
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
        if typing.get_origin(kind) is Union:
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            optional = len(args) < len(typing.get_args(kind))
            if len(args) != 1:
                continue
            kind = args[0]
        if kind not in _TYPE_NAMES or (optional and value is None) or _has_type(value, kind):
            continue
        raise ValueError(f"{type(config).__name__}.{f.name}={value!r} is invalid: must be {_TYPE_NAMES[kind]}"
                         + (" or None" if optional else ""))


@dataclass
class ModelConfig:
    """A decoder (LLaMA-style, or Kimi Linear) with a pluggable residual stream.

    Sizes count Transformer blocks (``n_layers`` = L_b); the residual schemes
    count sublayers (L = 2 * n_layers: one attention and one MLP each).

    ``backbone``: a name from ``attnres.model.backbones.BACKBONES``: "llama" (GQA
    attention with RoPE, SwiGLU MLP) or "kimi_linear" (transformers' Kimi Linear
    sublayers; needs ``pip install 'attnres[hf]'``). The Kimi Linear fields apply to
    "kimi_linear" only (setting one for "llama" is an error), and ``rope_theta`` to
    "llama" only:
    - ``kimi_layer_pattern``: each layer's attention, "K" (Kimi Delta Attention) or
      "M" (multi-head latent attention), repeated over the layers; "KKKM" (3:1, the
      paper's) by default.
    - ``kda_heads``, ``kda_head_dim``, ``kda_conv_kernel``: KDA heads (default
      n_heads), head width (default d_model // n_heads), short-convolution width.
    - ``mla_kv_rank`` (latent key/value rank, default d_model // 2), ``mla_q_rank``
      (None: uncompressed queries), ``mla_qk_nope_dim`` / ``mla_v_dim`` (per-head
      query-key and value widths, default d_model // n_heads), ``mla_qk_rope_dim``
      (the key part shared by all heads; half the head width by default; Kimi Linear
      applies no rotation to it). MLA uses ``n_heads``; ``n_kv_heads`` must equal it.
    - ``moe_experts`` (0: a dense SwiGLU MLP of width ``d_ff`` everywhere), ``moe_top_k``,
      ``moe_shared_experts``, ``moe_d_ff`` (expert width; default
      ceil(d_ff / (top_k + shared))), ``moe_dense_layers`` (leading layers that keep
      the dense MLP), ``moe_routed_scale`` and ``moe_renormalize`` (transformers'
      ``routed_scaling_factor`` / ``norm_topk_prob``), ``moe_bias_update_rate``
      (aux-loss-free balancing: after each training step every expert's routing
      bias moves by this much toward the mean load; 0: off).

    Residual options (docs/method.md §3-5):
    - ``residual``: a name from ``attnres.residual.RESIDUALS``
      ("prenorm", "full", "block", and the rival schemes "rezero",
      "layerscale", "highway", "denseformer", "mudd", "hyper", "mhc", "gated").
    - ``attnres_blocks`` (N) or ``attnres_block_size`` (S, in sublayers) for
      "block". Give at most one. With neither, S is the smallest even size
      that yields at most 8 depth blocks (boundaries before attention, the
      paper's default). With N, S = ceil(L / N) and the last block is shorter
      when L is not divisible; an N that no such S can produce is an error.
    - ``attnres_block_sizes``: explicit, possibly uneven, depth blocks for
      "block": a list of sizes in sublayers that sums to L (instead of N or S).
    - ``attnres_weights``: "pseudo_query" (the method), "input_query"
      (q_l = W_l h from the most recent source, W zero-init), "low_rank_query"
      (q_l = w_l + U_l V_l h, h the most recent completed source, rank
      ``attnres_query_rank``, U zero-init), or "scalar" (input-independent
      mixing: a learned logit per (sublayer, source)).
    - ``attnres_sources``: "outputs" (the paper: sublayer outputs / their block
      sums) or "states" (running residual sums at block boundaries; not from
      the paper, docs/method.md §5).
    - ``attnres_kernel``: "softmax" or "sigmoid".
    - ``attnres_key_norm``: RMSNorm on the keys (on by default).
    - ``attnres_heads``: per-head channel groups with their own weights.
    - ``attnres_window``: Full AttnRes over the embedding plus the last W
      sources only ("full" alone).
    - ``attnres_group_size``: for "full" with the two-phase implementation, the
      number G of consecutive sublayers whose queries share one Phase-1 pass
      over the sources completed before them (docs/method.md §6's grouping; exact, it only
      changes speed). Default: round(sqrt(L)).
    - ``attnres_scale_norm_eps``: scale the eps of each sublayer's pre-norm (and
      of the final norm) by c^2, where c S is what it reads at init (c = 1/K_l
      for softmax over K_l sources, 1/2 for sigmoid). A zero-query model then
      equals its PreNorm counterpart exactly instead of up to eps
      (RMSNorm(c S) with eps c^2 is RMSNorm(S) with eps); the retrofit of
      pretrained models turns it on. Full and Block only.
    - ``attnres_impl``: "two_phase" (default: docs/method.md §6's batched Phase 1 per depth
      block, in training too; falls back to "fused" where queries depend on
      the input or a window drops sources; scalar mixing is a plain weighted
      sum under every impl), "fused" (one memory-lean custom-autograd op per sublayer) or
      "reference" (plain autograd over a stacked source list).

    Which scheme reads which option, and how each is checked, is the registry's
    business (``attnres.residual.RESIDUALS``): this class validates the decoder's
    own fields and asks the registry about the rest.

    Rival-scheme options (each applies to its own scheme only; setting one for
    another scheme is an error):
    - ``layerscale_init``: LayerScale's initial lambda (default None: CaiT's
      rule on n_layers, 0.1 up to 18 blocks, 1e-5 up to 24, 1e-6 beyond).
    - ``highway_rank``: rank r of the Highway gate matrix W_g = U V
      (default None: a full d x d matrix); 1 <= r < d_model.
    - ``denseformer_dilation`` (k, default 1) and ``denseformer_period``
      (p, default 1): the DWA after Transformer block I exists when p divides I
      and reads the block outputs j <= I with j = I (mod k).
    - ``hyper_streams`` (n, default 4) and ``hyper_dynamic`` (default True:
      DHC; False: static SHC) for Hyper-Connections.
    - ``mhc_streams`` (n, default 4) and ``mhc_sinkhorn_iters`` (default 20).
    - ``gated_heads`` (H, default 8): heads of the "gated" rival's depth attention.
    """

    backbone: str = "llama"
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    residual: str = "block"
    attnres_blocks: Optional[int] = None
    attnres_block_size: Optional[int] = None
    attnres_weights: str = "pseudo_query"
    attnres_kernel: str = "softmax"
    attnres_key_norm: bool = True
    attnres_heads: int = 1
    attnres_window: Optional[int] = None
    attnres_group_size: Optional[int] = None
    attnres_scale_norm_eps: bool = False
    attnres_impl: str = "two_phase"
    attnres_sources: str = "outputs"
    attnres_block_sizes: Optional[Sequence[int]] = None
    attnres_query_rank: Optional[int] = None

    layerscale_init: Optional[float] = None
    highway_rank: Optional[int] = None
    denseformer_dilation: int = 1
    denseformer_period: int = 1
    hyper_streams: int = 4
    hyper_dynamic: bool = True
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20
    gated_heads: int = 8

    kimi_layer_pattern: str = "KKKM"
    kda_heads: Optional[int] = None
    kda_head_dim: Optional[int] = None
    kda_conv_kernel: int = 4
    mla_kv_rank: Optional[int] = None
    mla_q_rank: Optional[int] = None
    mla_qk_nope_dim: Optional[int] = None
    mla_qk_rope_dim: Optional[int] = None
    mla_v_dim: Optional[int] = None
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 1
    moe_d_ff: Optional[int] = None
    moe_dense_layers: int = 1
    moe_routed_scale: float = 1.0
    moe_renormalize: bool = True
    moe_bias_update_rate: float = 1e-3

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
        return BACKBONES[self.backbone].rope_dim(self)

    @property
    def block_sizes(self) -> List[int]:
        """Sublayers of each depth block, in order ("full": all 1; schemes without depth blocks: [L])."""
        return RESIDUALS[self.residual].block_sizes(self)

    @property
    def block_size(self) -> int:
        """S: sublayers per depth block ("full" is S = 1; schemes without depth blocks: L); with
        uneven blocks (``attnres_block_sizes``) the largest."""
        return max(self.block_sizes)

    @property
    def group_size(self) -> int:
        """G: sublayers sharing one Phase-1 pass in Full AttnRes' two-phase schedule (1 otherwise)."""
        return RESIDUALS[self.residual].group_size(self)

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
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)
