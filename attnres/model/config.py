"""ModelConfig: every knob of the decoder and its residual scheme, validated on creation."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

ATTNRES_WEIGHTS = ("pseudo_query", "input_query", "scalar")
ATTNRES_KERNELS = ("softmax", "sigmoid")
IMPLS = ("two_phase", "fused", "reference")
DEFAULT_TARGET_BLOCKS = 8  # the paper's N ≈ 8
# options of the rival residual schemes -> the one scheme each applies to
RIVAL_OPTIONS = {
    "layerscale_init": "layerscale", "highway_rank": "highway",
    "denseformer_dilation": "denseformer", "denseformer_period": "denseformer",
    "hyper_streams": "hyper", "hyper_dynamic": "hyper",
    "mhc_streams": "mhc", "mhc_sinkhorn_iters": "mhc",
}


def _positive_int(value) -> bool:
    """An int >= 1 (bools are ints to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _bad(field: str, value, allowed: str) -> ValueError:
    return ValueError(f"ModelConfig.{field}={value!r} is invalid: {allowed}")


@dataclass
class ModelConfig:
    """A LLaMA-style decoder with a pluggable residual stream.

    Sizes count Transformer blocks (``n_layers`` = L_b); the residual schemes
    count sublayers (L = 2 * n_layers: one attention and one MLP each).

    Residual options (SPEC §3-5):
    - ``residual``: a name from ``attnres.residual.RESIDUALS``
      ("prenorm", "full", "block", and the rival schemes "rezero",
      "layerscale", "highway", "denseformer", "mudd", "hyper", "mhc").
    - ``attnres_blocks`` (N) or ``attnres_block_size`` (S, in sublayers) for
      "block". Give at most one. With neither, S is the smallest even size
      that yields at most 8 depth blocks (boundaries before attention, the
      paper's default). With N, S = ceil(L / N) and the last block is shorter
      when L is not divisible; an N that no such S can produce is an error.
    - ``attnres_weights``: "pseudo_query" (the method), "input_query"
      (q_l = W_l h from the most recent source, W zero-init), or "scalar"
      (input-independent mixing: a learned logit per (sublayer, source)).
    - ``attnres_kernel``: "softmax" or "sigmoid".
    - ``attnres_key_norm``: RMSNorm on the keys (on by default).
    - ``attnres_heads``: per-head channel groups with their own weights.
    - ``attnres_window``: Full AttnRes over the embedding plus the last W
      sources only ("full" alone).
    - ``attnres_group_size``: for "full" with the two-phase implementation, the
      number G of consecutive sublayers whose queries share one Phase-1 pass
      over the sources completed before them (SPEC §6's grouping; exact, it only
      changes speed). Default: round(sqrt(L)).
    - ``attnres_scale_norm_eps``: scale the eps of each sublayer's pre-norm (and
      of the final norm) by c^2, where c S is what it reads at init (c = 1/K_l
      for softmax over K_l sources, 1/2 for sigmoid). A zero-query model then
      equals its PreNorm counterpart exactly instead of up to eps
      (RMSNorm(c S) with eps c^2 is RMSNorm(S) with eps); the retrofit of
      pretrained models turns it on. Full and Block only.
    - ``attnres_impl``: "two_phase" (default: SPEC §6's batched Phase 1 per depth
      block, in training too; falls back to "fused" where queries depend on
      the input), "fused" (one memory-lean custom-autograd op per sublayer) or
      "reference" (plain autograd over a stacked source list).

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
    """

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

    layerscale_init: Optional[float] = None
    highway_rank: Optional[int] = None
    denseformer_dilation: int = 1
    denseformer_period: int = 1
    hyper_streams: int = 4
    hyper_dynamic: bool = True
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
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
    def block_size(self) -> int:
        """S: sublayers per depth block ("full" is S = 1; "prenorm" has no blocks, returns L)."""
        L = self.n_sublayers
        if self.residual == "full":
            return 1
        if self.residual != "block":
            return L
        if self.attnres_block_size is not None:
            return self.attnres_block_size
        if self.attnres_blocks is not None:
            return math.ceil(L / self.attnres_blocks)
        s = 2
        while math.ceil(L / s) > DEFAULT_TARGET_BLOCKS:
            s += 2
        return min(s, L)

    @property
    def group_size(self) -> int:
        """G: sublayers sharing one Phase-1 pass in Full AttnRes' two-phase schedule (1 otherwise)."""
        if self.residual != "full":
            return 1
        if not isinstance(self.attnres_scale_norm_eps, bool):
            raise _bad("attnres_scale_norm_eps", self.attnres_scale_norm_eps, "must be True or False")
        if self.attnres_scale_norm_eps and self.residual not in ("full", "block"):
            raise _bad("attnres_scale_norm_eps", self.attnres_scale_norm_eps,
                       "applies to residual='full' or 'block' only")
        if self.attnres_group_size is not None:
            return self.attnres_group_size
        return max(1, round(math.sqrt(self.n_sublayers)))

    @property
    def num_blocks(self) -> int:
        """N: depth blocks, the last one possibly shorter."""
        return math.ceil(self.n_sublayers / self.block_size)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        from attnres.residual import RESIDUALS  # late import: the registry imports this module

        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                    "max_seq_len", "attnres_heads")
        for name in positive:
            value = getattr(self, name)
            if not _positive_int(value):
                raise _bad(name, value, "must be a positive integer")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _bad(name, value, "must be a positive number")
        if self.d_model % self.n_heads:
            raise _bad("n_heads", self.n_heads,
                       f"must divide d_model={self.d_model}; pick a divisor of {self.d_model}")
        if self.head_dim % 2:
            raise _bad("n_heads", self.n_heads,
                       f"gives odd head_dim={self.head_dim}; RoPE needs an even head dimension")
        if self.n_heads % self.n_kv_heads:
            raise _bad("n_kv_heads", self.n_kv_heads,
                       f"must divide n_heads={self.n_heads} (grouped-query attention)")
        if self.residual not in RESIDUALS:
            raise _bad("residual", self.residual, f"choose one of {sorted(RESIDUALS)}")
        if self.attnres_weights not in ATTNRES_WEIGHTS:
            raise _bad("attnres_weights", self.attnres_weights, f"choose one of {ATTNRES_WEIGHTS}")
        if self.attnres_kernel not in ATTNRES_KERNELS:
            raise _bad("attnres_kernel", self.attnres_kernel, f"choose one of {ATTNRES_KERNELS}")
        if self.attnres_impl not in IMPLS:
            raise _bad("attnres_impl", self.attnres_impl, f"choose one of {IMPLS}")
        if not isinstance(self.attnres_key_norm, bool):
            raise _bad("attnres_key_norm", self.attnres_key_norm, "must be True or False")
        if not isinstance(self.tie_embeddings, bool):
            raise _bad("tie_embeddings", self.tie_embeddings, "must be True or False")
        if self.d_model % self.attnres_heads:
            raise _bad("attnres_heads", self.attnres_heads,
                       f"must divide d_model={self.d_model}")
        if self.attnres_heads > 1 and self.attnres_weights == "scalar":
            raise _bad("attnres_heads", self.attnres_heads,
                       "scalar mixing has no query to split into heads; use attnres_heads=1")
        L = self.n_sublayers
        if self.attnres_blocks is not None and self.attnres_block_size is not None:
            raise _bad("attnres_blocks", self.attnres_blocks,
                       "give either attnres_blocks (N) or attnres_block_size (S), not both")
        if self.attnres_blocks is not None:
            n = self.attnres_blocks
            if not _positive_int(n):
                raise _bad("attnres_blocks", n, "must be a positive integer")
            if n > L:
                raise _bad("attnres_blocks", n,
                           f"exceeds the number of sublayers L={L} (2 * n_layers); use at most {L}")
            s = math.ceil(L / n)
            if math.ceil(L / s) != n:
                raise _bad("attnres_blocks", n,
                           f"cannot split L={L} sublayers into {n} blocks of {s} with only the last "
                           f"one shorter; set attnres_block_size instead (S={s} gives "
                           f"{math.ceil(L / s)} blocks)")
        if self.attnres_block_size is not None:
            s = self.attnres_block_size
            if not _positive_int(s):
                raise _bad("attnres_block_size", s, "must be an integer >= 1 (sublayers per block)")
            if s > L:
                raise _bad("attnres_block_size", s,
                           f"exceeds the number of sublayers L={L}; use at most {L}")
        if (self.attnres_blocks is not None or self.attnres_block_size is not None) \
                and self.residual != "block":
            raise _bad("residual", self.residual,
                       "attnres_blocks / attnres_block_size only apply to residual='block'")
        if not isinstance(self.attnres_scale_norm_eps, bool):
            raise _bad("attnres_scale_norm_eps", self.attnres_scale_norm_eps, "must be True or False")
        if self.attnres_scale_norm_eps and self.residual not in ("full", "block"):
            raise _bad("attnres_scale_norm_eps", self.attnres_scale_norm_eps,
                       "applies to residual='full' or 'block' only")
        if self.attnres_group_size is not None:
            g = self.attnres_group_size
            if not _positive_int(g):
                raise _bad("attnres_group_size", g, "must be a positive integer (sublayers per group)")
            if self.residual != "full":
                raise _bad("attnres_group_size", g,
                           "the two-phase grouping applies to residual='full' only (Block AttnRes "
                           "groups by its depth blocks)")
        if self.attnres_window is not None:
            w = self.attnres_window
            if not _positive_int(w):
                raise _bad("attnres_window", w, "must be a positive integer (sources kept)")
            if self.residual != "full":
                raise _bad("attnres_window", w,
                           "the sliding window applies to residual='full' only")
        self._validate_rival_options()

    def _validate_rival_options(self) -> None:
        """Options of the rival schemes: well formed, and set only for their own scheme."""
        def positive_int(name, what, upper=None):
            value = getattr(self, name)
            bad = not _positive_int(value)
            if upper is None and bad:
                raise _bad(name, value, f"must be a positive integer ({what})")
            if upper is not None and (bad or value > upper):
                raise _bad(name, value, f"must be an integer in [1, {upper}] ({what})")

        v = self.layerscale_init
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 < v < math.inf):
            raise _bad("layerscale_init", v,
                       "must be a positive number (or None for CaiT's depth rule)")
        r = self.highway_rank
        if r is not None and (isinstance(r, bool) or not isinstance(r, int)
                              or not 1 <= r < self.d_model):
            raise _bad("highway_rank", r,
                       f"must be an integer in [1, {self.d_model - 1}] (below d_model="
                       f"{self.d_model}); use None for a full-rank gate")
        positive_int("denseformer_dilation", "blocks between connected outputs, at most "
                     f"n_layers={self.n_layers}", upper=self.n_layers)
        positive_int("denseformer_period", "blocks between two averagings, at most "
                     f"n_layers={self.n_layers}", upper=self.n_layers)
        positive_int("hyper_streams", "number of residual streams")
        if not isinstance(self.hyper_dynamic, bool):
            raise _bad("hyper_dynamic", self.hyper_dynamic, "must be True or False")
        positive_int("mhc_streams", "number of residual streams")
        positive_int("mhc_sinkhorn_iters", "Sinkhorn-Knopp iterations")

        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, scheme in RIVAL_OPTIONS.items():
            value = getattr(self, name)
            if self.residual != scheme and value != defaults[name]:
                raise _bad(name, value,
                           f"applies to residual='{scheme}' only (residual={self.residual!r}); "
                           f"drop it or set residual='{scheme}'")

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
