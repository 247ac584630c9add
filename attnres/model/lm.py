"""``AttnResLM``: the decoder-only LM every backbone and residual scheme runs in.

Embedding, the Transformer blocks of the backbone (``attnres.model.backbones``: the LLaMA-style
blocks of ``attnres.model.llama``, or Kimi Linear's), driven through the residual stream, the final
norm and the head.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnres.model.backbones import BACKBONES
from attnres.model.checkpointing import (
    check_checkpointing,
    run_segments,
    segment_layers,
)
from attnres.model.config import ModelConfig
from attnres.model.llama import (
    PaddedAttention,
    output_logits,
    padding_mask,
    rope_tables,
    run_blocks,
)
from attnres.residual import DepthRecord, DepthRecorder, build_residual, observing
from attnres.residual.param_groups import parameter_kinds


def set_norm_eps(norm: nn.Module, eps: float) -> None:
    """torch's RMSNorm keeps its eps in ``eps``, transformers' RMSNorms (Kimi Linear) in ``variance_epsilon``."""
    setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", eps)


# the positions whose rotary rows are built with the model; a longer max_seq_len (a long-context
# config) gets the rest when an input first reaches them, so that building it costs no more
ROPE_PREBUILT = 1 << 14


@dataclass
class LMOutput:
    logits: Tensor
    record: DepthRecord | None = None


class AttnResLM(nn.Module):
    """Decoder-only LM: embedding, n_layers blocks driven through a residual stream, norm, head.

    The blocks come from the backbone registry (``attnres.model.backbones``): the TransformerBlock
    of ``attnres.model.llama`` for "llama", transformers' Kimi Linear sublayers for "kimi_linear"; the embedding, the
    residual stream, the final norm and the head are the same for every backbone."""

    blocks: nn.ModuleList
    norm: nn.Module
    rope_cos: Tensor  # [positions built so far (at most max_seq_len), rope_dim] buffers, not saved with the weights
    rope_sin: Tensor

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
            set_norm_eps(block.get_submodule("attn_norm"), config.norm_eps * self.residual.norm_eps_scale(2 * i))
            set_norm_eps(block.get_submodule("mlp_norm"), config.norm_eps * self.residual.norm_eps_scale(2 * i + 1))
        set_norm_eps(self.norm, config.norm_eps * self.residual.norm_eps_scale(config.n_sublayers))
        # width 0 for a backbone without rotary positions (Kimi Linear): the blocks get empty tables
        cos, sin = rope_tables(config.rope_dim, min(config.max_seq_len, ROPE_PREBUILT), config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = "none"  # a training setting, not part of the model's function
        self.reset_parameters()

    def rope(self, length: int) -> tuple[Tensor, Tensor]:
        """The rotary tables of positions 0..length-1 ([length, rope_dim] each), grown first if they
        are shorter: rows already built never change, so cached decoding reads the very values the
        full forward read."""
        have = self.rope_cos.shape[0]
        if length > have:
            c = self.config
            # doubling: decoding past the table one token at a time grows it a few times, not per token
            grown = min(c.max_seq_len, max(length, 2 * have))
            cos, sin = rope_tables(c.rope_dim, grown, c.rope_theta, start=have)
            self.rope_cos = torch.cat([self.rope_cos, cos.to(self.rope_cos)])
            self.rope_sin = torch.cat([self.rope_sin, sin.to(self.rope_sin)])
        return self.rope_cos[:length], self.rope_sin[:length]

    def set_activation_checkpointing(self, mode: str | None) -> None:
        """What backward recomputes instead of keeping (``attnres.model.checkpointing``): "none",
        "block" (keep only the embedding and completed depth-block representations between depth
        blocks) or "sublayer" (recompute inside each attention and MLP sublayer). Results are unchanged."""
        mode = "none" if mode is None else mode  # `--set activation_checkpointing=none` reads as None
        check_checkpointing(mode)
        if mode == "sublayer" and not all(hasattr(block, "gradient_checkpointing") for block in self.blocks):
            raise ValueError(
                f"activation_checkpointing='sublayer' is invalid for backbone={self.config.backbone!r}: "
                "its blocks have no per-sublayer checkpointing; use 'block' or 'none'"
            )
        self.activation_checkpointing = mode
        on = mode == "sublayer"  # transformers' per-layer flag, which TransformerBlock mirrors
        for block in self.blocks:
            if hasattr(block, "gradient_checkpointing"):
                block.gradient_checkpointing = on  # type: ignore[assignment]  # torch's stub: Tensor | Module only

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

    def forward(
        self, input_ids: Tensor, *, cache=None, attention_mask: Tensor | None = None, return_record: bool = False
    ):
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
        # every position this call can read (a static cache's: all of its slots)
        self.rope(positions.stop if isinstance(positions, slice) else cache.max_len)
        attention = cache
        if attention_mask is not None:
            if not isinstance(positions, slice):
                raise ValueError(
                    "attention_mask with a StaticKVCache (compiled decoding) is not supported: "
                    "decode padded batches with a KVCache"
                )
            start = positions.start
            if tuple(attention_mask.shape) != (b, start + t):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(b, start + t)} "
                    "(batch, cached + new positions): pass the mask of the whole sequence so far"
                )
            if bool(attention_mask.all()):
                attention_mask = None
            elif not BACKBONES[self.config.backbone].padded_batches:
                raise ValueError(
                    f"attention_mask with padding: backbone={self.config.backbone!r} does not run padded batches "
                    "(its recurrent layers would carry the padding's state); run each sequence alone, unpadded"
                )
        record = DepthRecord() if return_record else None
        if attention_mask is None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            positions, allowed = padding_mask(attention_mask.to(input_ids.device), t)
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
            attention = PaddedAttention(allowed, cache)
        with observing(self.residual, DepthRecorder(record)) if record is not None else nullcontext():
            depth = self.residual.start(self.embed(input_ids))
            if (
                self.activation_checkpointing == "block"
                and self.training
                and torch.is_grad_enabled()
                and cache is None
                and record is None
            ):
                depth = run_segments(
                    depth, self.residual, self.blocks, segment_layers(self.config), cos, sin, attention
                )
            else:
                depth = run_blocks(depth, self.residual, enumerate(self.blocks), cos, sin, cache=attention)
            if cache is not None:
                cache.advance(t)
            logits = output_logits(self.norm, self.lm_head, self.residual.finish(depth))
        return LMOutput(logits, record) if return_record else logits

    # ------------------------------------------------------------------ decoding and training steps
    def step_counters(self) -> list[Tensor]:
        """Statistics the blocks accumulate over a training step (MoE expert loads; none for dense
        blocks). Data-parallel runs sum them over replicas, in place, before ``end_step``."""
        return BACKBONES[self.config.backbone].step_counters(self)

    def end_step(self) -> dict[str, object]:
        """After each optimizer step: the blocks' per-step updates (MoE: the aux-loss-free router-bias
        balancing) and what they report (MoE: expert load and imbalance per layer); {} for dense
        blocks. The trainer logs the report with the step's metrics."""
        return BACKBONES[self.config.backbone].end_step(self)

    # ------------------------------------------------------------------ bookkeeping
    def param_kinds(self) -> dict[str, str]:
        """Every parameter name -> "matrix" (hidden weight matrices, and stacks of them such as MoE
        experts: Muon, decayed), "embedding", "head", or "no_decay" (norms, biases, convolution
        filters, every residual-scheme parameter): ``attnres.param_groups``' rule, with the
        backbone's expert stacks and this model's head named."""
        return parameter_kinds(
            self, matrix_stacks=BACKBONES[self.config.backbone].matrix_stacks(self), head=self.lm_head
        )

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed.weight.numel()
        return n
