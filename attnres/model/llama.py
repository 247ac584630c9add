"""A LLaMA-style decoder whose residual connections are a pluggable scheme.

Read top to bottom: rotary embeddings, attention, SwiGLU MLP, the Transformer
block (which holds its sublayers but no residual arithmetic), then what the model
(``attnres.model.lm.AttnResLM``, which drives the residual stream) runs them with:
padded batches, running blocks, the logits and the loss. Submodule names are part of the API:
analysis tools and tests hook ``attn_norm`` (its input is the sublayer input
h_l) and ``attn`` (its output is f_l), and likewise ``mlp_norm`` / ``mlp``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from attnres.residual import DepthState, ResidualScheme

if TYPE_CHECKING:  # annotations only: the config imports the backbones, which import these blocks
    from attnres.model.config import ModelConfig


# ----------------------------------------------------------------------------- rotary


def rope_tables(head_dim: int, max_seq_len: int, theta: float, start: int = 0) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_seq_len - start, head_dim] of positions start..max_seq_len-1 in the
    rotate-half convention (as HF LLaMA)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(start, max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, hd]; cos/sin: [T, hd], or [B, 1, T, hd] for per-row positions (padded batches)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


# ----------------------------------------------------------------------------- sublayers


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and RoPE."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.n_kv_heads is not None  # ModelConfig.__post_init__ resolves None to n_heads
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        d, kv = config.d_model, config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache=None, layer: int = 0) -> Tensor:
        """x [B, t, D]; cos/sin for the t positions. ``cache`` (e.g. a KVCache) stores this step's
        keys and values and attends over all cached positions; without one, plain causal attention."""
        b, t, _ = x.shape
        # -1 heads: all of them, or this rank's share when tensor parallelism splits the projections
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeat = self.n_heads // self.n_kv_heads
        if cache is not None:
            y = cache.attend(layer, q, k, v, repeat)
        else:
            if repeat > 1:
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.d_ff is not None  # ModelConfig.__post_init__ resolves None to about 8d/3
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Two sublayers with their pre-norms; the residual arithmetic lives in the stream."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config)
        # activation checkpointing, under the names transformers' activation_checkpointing_enable()
        # sets: while training, each sublayer (norm included) keeps only its input h_l and recomputes
        # the rest in backward. The stream's reads and writes stay outside: recomputing them would
        # write the stream twice.
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = None

    def forward(
        self, depth: DepthState, residual: ResidualScheme, index: int, cos: Tensor, sin: Tensor, cache=None
    ) -> DepthState:
        """Block ``index``: its two sublayers read their inputs from the depth state and write their
        outputs to it. Tensors in, tensors out, so per-block wrappers (FSDP2's ``fully_shard``,
        ``checkpoint_wrapper``, ``torch.compile``) see an ordinary module."""
        stream = residual.stream(depth)
        self._sublayer(stream, self.attn_norm, lambda x: self.attn(x, cos, sin, cache=cache, layer=index))
        self._sublayer(stream, self.mlp_norm, self.mlp)
        return stream.depth()

    def _sublayer(self, stream, norm: nn.Module, run) -> None:
        """f = run(norm(h)) through the stream. Eagerly the stream computes norm(h) with its read (one
        pass where it can: attnres.ops.rms_norm); checkpointed, the norm runs inside the checkpoint."""
        # never under no_grad (decoding, whose KV cache must be written once): nothing to save there
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            stream.apply(run, norm=norm)
            return
        checkpoint = self._gradient_checkpointing_func or partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        )
        stream.apply(lambda h: checkpoint(lambda x: run(norm(x)), h))


# ----------------------------------------------------------------------------- running the blocks


def padding_mask(attention_mask: Tensor, t: int) -> tuple[Tensor, Tensor]:
    """For a padded batch whose last ``t`` columns are being run: (positions [B, t], allowed [B, 1, t, S]).

    ``attention_mask`` [B, S] marks real tokens 1 and padding 0 (left or right), over the cached
    columns and the new ones. A real token's position counts only the real tokens before it, and
    it attends to the real tokens up to itself: each row computes exactly what its unpadded
    sequence computes alone. A padding query attends to itself only (a row with no allowed key
    would give NaN); what it computes is never read.
    """
    real = attention_mask.bool()
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
    s = real.shape[1]
    query_col = torch.arange(s - t, s, device=real.device)[:, None]
    key_col = torch.arange(s, device=real.device)[None, :]
    allowed = ((key_col <= query_col) & real[:, None, :]) | (key_col == query_col)
    return positions, allowed[:, None]


class PaddedAttention:
    """The attention context of a padded batch (what :class:`Attention` calls as ``cache.attend``):
    keys at padding positions are masked on top of causality. ``cache``: the KV cache it stores
    keys and values in (None: the whole sequence is in this call)."""

    def __init__(self, allowed: Tensor, cache=None):
        self.allowed, self.cache = allowed, cache

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, repeat: int) -> Tensor:
        if self.cache is not None:
            return self.cache.attend(layer, q, k, v, repeat, mask=self.allowed)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed)


def run_blocks(
    depth: DepthState,
    residual: ResidualScheme,
    blocks: Iterable[tuple[int, nn.Module]],
    cos: Tensor,
    sin: Tensor,
    cache=None,
) -> DepthState:
    """Run the depth state through Transformer blocks given as (index, block): the model's forward
    runs all of them, a pipeline chunk runs its own slice."""
    for i, block in blocks:
        depth = block(depth, residual, i, cos, sin, cache)
    return depth


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy; half-precision logits are upcast, float64 stays float64."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def output_logits(norm: nn.Module, lm_head: nn.Module, y: Tensor) -> Tensor:
    """Final norm and LM head, in at least float32 (the loss wants full-precision logits)."""
    logits = lm_head(norm(y))
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
