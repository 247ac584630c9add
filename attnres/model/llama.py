"""A LLaMA-style decoder whose residual connections are a pluggable scheme.

Read top to bottom: rotary embeddings, attention, SwiGLU MLP, the Transformer
block (which holds its sublayers but no residual arithmetic), and the model,
which drives the residual stream. Submodule names are part of the API:
analysis tools and tests hook ``attn_norm`` (its input is the sublayer input
h_l) and ``attn`` (its output is f_l), and likewise ``mlp_norm`` / ``mlp``.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from attnres.model.backbones import BACKBONES
from attnres.model.checkpointing import check_checkpointing, run_segments, segment_layers
from attnres.model.config import ModelConfig
from attnres.residual import DepthRecord, DepthRecorder, DepthState, ResidualScheme, build_residual, observing
from attnres.residual.param_groups import parameter_kinds


# ----------------------------------------------------------------------------- rotary


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_seq_len, head_dim] in the rotate-half convention (as HF LLaMA)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
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
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
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

    def forward(self, depth: DepthState, residual: ResidualScheme, index: int, cos: Tensor, sin: Tensor,
                cache=None) -> DepthState:
        """Block ``index``: its two sublayers read their inputs from the depth state and write their
        outputs to it. Tensors in, tensors out, so per-block wrappers (FSDP2's ``fully_shard``,
        ``checkpoint_wrapper``, ``torch.compile``) see an ordinary module."""
        stream = residual.stream(depth)
        stream.apply(lambda h: self._sublayer(lambda x: self.attn(self.attn_norm(x), cos, sin, cache=cache,
                                                                  layer=index), h))
        stream.apply(lambda h: self._sublayer(lambda x: self.mlp(self.mlp_norm(x)), h))
        return stream.depth()

    def _sublayer(self, run, h: Tensor) -> Tensor:
        # never under no_grad (decoding, whose KV cache must be written once): nothing to save there
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return run(h)
        checkpoint = self._gradient_checkpointing_func or partial(torch.utils.checkpoint.checkpoint,
                                                                  use_reentrant=False)
        return checkpoint(run, h)


# ----------------------------------------------------------------------------- model


def padding_mask(attention_mask: Tensor, t: int) -> Tuple[Tensor, Tensor]:
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


def run_blocks(depth: DepthState, residual: ResidualScheme, blocks: Iterable[Tuple[int, TransformerBlock]],
               cos: Tensor, sin: Tensor, cache=None) -> DepthState:
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


def set_norm_eps(norm: nn.Module, eps: float) -> None:
    """torch's RMSNorm keeps its eps in ``eps``, transformers' RMSNorms (Kimi Linear) in ``variance_epsilon``."""
    if hasattr(norm, "variance_epsilon"):
        norm.variance_epsilon = eps
    else:
        norm.eps = eps


@dataclass
class LMOutput:
    logits: Tensor
    record: Optional[DepthRecord] = None


class AttnResLM(nn.Module):
    """Decoder-only LM: embedding, n_layers blocks driven through a residual stream, norm, head.

    The blocks come from the backbone registry (``attnres.model.backbones``): the TransformerBlock
    above for "llama", transformers' Kimi Linear sublayers for "kimi_linear"; the embedding, the
    residual stream, the final norm and the head are the same for every backbone."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        backbone = BACKBONES[config.backbone]
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(backbone.block(config, i) for i in range(config.n_layers))
        # the scheme may draw random numbers (e.g. MUDD, low-rank Highway); on a forked RNG so that,
        # for one seed, every scheme gets the same embedding and sublayer weights as prenorm
        with torch.random.fork_rng(devices=[]):
            self.residual = build_residual(config)
        self.norm = backbone.norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # a scheme that rescales what a norm reads says by how much its eps must follow (AttnRes'
        # attnres_scale_norm_eps: exact PreNorm equivalence at init); 1 for every other scheme
        for i, block in enumerate(self.blocks):
            set_norm_eps(block.attn_norm, config.norm_eps * self.residual.norm_eps_scale(2 * i))
            set_norm_eps(block.mlp_norm, config.norm_eps * self.residual.norm_eps_scale(2 * i + 1))
        set_norm_eps(self.norm, config.norm_eps * self.residual.norm_eps_scale(config.n_sublayers))
        # width 0 for a backbone without rotary positions (Kimi Linear): the blocks get empty tables
        cos, sin = rope_tables(config.rope_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = "none"  # a training setting, not part of the model's function
        self.reset_parameters()

    def set_activation_checkpointing(self, mode: str) -> None:
        """What backward recomputes instead of keeping (``attnres.model.checkpointing``): "none",
        "block" (keep only the embedding and completed depth-block representations between depth
        blocks) or "sublayer" (recompute inside each attention and MLP sublayer). Results are unchanged."""
        mode = "none" if mode is None else mode  # `--set activation_checkpointing=none` reads as None
        check_checkpointing(mode)
        if mode == "sublayer" and not all(hasattr(block, "gradient_checkpointing") for block in self.blocks):
            raise ValueError(f"activation_checkpointing='sublayer' is invalid for backbone={self.config.backbone!r}: "
                             "its blocks have no per-sublayer checkpointing; use 'block' or 'none'")
        self.activation_checkpointing = mode
        for block in self.blocks:
            if hasattr(block, "gradient_checkpointing"):
                block.gradient_checkpointing = mode == "sublayer"  # transformers' per-layer flag

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; the two projections that write into the residual
        stream are scaled by 1/sqrt(2 n_layers) (GPT-2). Residual-scheme parameters keep
        their own initialisation (zero queries, unit key norms)."""
        std = self.config.init_std
        for name, module in self.named_modules():
            if name.startswith("residual"):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scale = 1.0
                if name.endswith(("o_proj", "down_proj")):
                    scale = 1.0 / math.sqrt(2 * self.config.n_layers)
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        BACKBONES[self.config.backbone].init_weights(self)  # what the rule above does not cover

    def forward(self, input_ids: Tensor, *, cache=None, attention_mask: Optional[Tensor] = None,
                return_record: bool = False):
        """input_ids [B, T] -> logits [B, T, V] (at least float32, under autocast too).

        ``cache`` (``attnres.inference.make_cache(model, batch_size)``: a ``KVCache``, or for
        Kimi Linear a ``HybridCache``): the tokens continue the cached
        sequence (positions ``cache.length`` onwards) and their keys/values are
        appended; prefill, chunked prefill and decoding are all this call. The
        residual stream needs no cache: depth attention is per token.

        ``attention_mask`` [B, cache.length + T] (the Hugging Face convention: cached and new
        columns): 1 for real tokens, 0 for padding, on either side. Each row's real tokens then get
        exactly the logits of that row run alone (positions count real tokens only, padding keys are
        masked); the logits at padding positions are meaningless. An all-ones mask is no mask.

        With ``return_record=True`` returns ``LMOutput(logits, record)`` where the
        DepthRecord holds, per sublayer, the depth weights (per token), the
        source names and the RMS of the sublayer inputs and outputs.
        """
        b, t = input_ids.shape
        # a slice of positions, or (a static cache, for compiled decoding) a tensor of them, so that
        # the position is data rather than a Python int a compiled step would specialise on
        positions = cache.positions(t) if cache is not None else slice(0, t)
        if isinstance(positions, slice) and positions.stop > self.config.max_seq_len:
            raise ValueError(
                f"positions {positions.start}..{positions.stop - 1} exceed ModelConfig.max_seq_len="
                f"{self.config.max_seq_len}; use shorter inputs or a model built with a larger max_seq_len"
            )
        attention = cache
        if attention_mask is not None:
            if not isinstance(positions, slice):
                raise ValueError("attention_mask with a StaticKVCache (compiled decoding) is not supported: "
                                 "decode padded batches with a KVCache")
            start = positions.start
            if tuple(attention_mask.shape) != (b, start + t):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(b, start + t)} "
                    "(batch, cached + new positions): pass the mask of the whole sequence so far")
            if bool(attention_mask.all()):
                attention_mask = None
            elif not BACKBONES[self.config.backbone].padded_batches:
                raise ValueError(
                    f"attention_mask with padding: backbone={self.config.backbone!r} does not run padded batches "
                    "(its recurrent layers would carry the padding's state); run each sequence alone, unpadded")
        record = DepthRecord() if return_record else None
        if attention_mask is None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            positions, allowed = padding_mask(attention_mask.to(input_ids.device), t)
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
            attention = PaddedAttention(allowed, cache)
        with observing(self.residual, DepthRecorder(record)) if record is not None else nullcontext():
            depth = self.residual.start(self.embed(input_ids))
            if (self.activation_checkpointing == "block" and self.training and torch.is_grad_enabled()
                    and cache is None and record is None):
                depth = run_segments(depth, self.residual, self.blocks, segment_layers(self.config), cos, sin,
                                     attention)
            else:
                depth = run_blocks(depth, self.residual, enumerate(self.blocks), cos, sin, cache=attention)
            if cache is not None:
                cache.advance(t)
            logits = output_logits(self.norm, self.lm_head, self.residual.finish(depth))
        return LMOutput(logits, record) if return_record else logits

    # ------------------------------------------------------------------ decoding and training steps
    def step_counters(self) -> List[Tensor]:
        """Statistics the blocks accumulate over a training step (MoE expert loads; none for dense
        blocks). Data-parallel runs sum them over replicas, in place, before ``end_step``."""
        return BACKBONES[self.config.backbone].step_counters(self)

    def end_step(self) -> Dict[str, object]:
        """After each optimizer step: the blocks' per-step updates (MoE: the aux-loss-free router-bias
        balancing) and what they report (MoE: expert load and imbalance per layer); {} for dense
        blocks. The trainer logs the report with the step's metrics."""
        return BACKBONES[self.config.backbone].end_step(self)

    # ------------------------------------------------------------------ bookkeeping
    def param_kinds(self) -> Dict[str, str]:
        """Every parameter name -> "matrix" (hidden weight matrices, and stacks of them such as MoE
        experts: Muon, decayed), "embedding", "head", or "no_decay" (norms, biases, convolution
        filters, every residual-scheme parameter): ``attnres.param_groups``' rule, with the
        backbone's expert stacks and this model's head named."""
        return parameter_kinds(self, matrix_stacks=BACKBONES[self.config.backbone].matrix_stacks(self),
                               head=self.lm_head)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed.weight.numel()
        return n
