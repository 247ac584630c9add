"""A rough, deliberately low estimate of a training step's memory, checked before anything is allocated.

A batch that cannot fit should be refused in one line that says what would fit, not found out by an
allocator error many gigabytes in. The estimate counts what a step cannot avoid holding (fp32
weights, gradients and the optimizer's two moments; per token the sublayers' saved inputs, the
attention scores and the logits with their softmax and gradient) and nothing it might avoid, so it
errs low: it refuses only batches that clearly do not fit. With activation checkpointing it counts
what the mode keeps (one d-vector per token at each checkpoint boundary) and the largest piece
recomputed at once (a segment of Transformer blocks for "block", one sublayer for "sublayer").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attnres.model import ModelConfig
from attnres.model.checkpointing import segment_layers

__all__ = ["available_memory", "estimate_step_memory", "check_memory", "check_models_memory"]

_GIB = 1 << 30
_FLOAT = 4  # bytes of an fp32 value


def _fixed_and_per_token(model: ModelConfig, seq_len: int, checkpointing: str = "none") -> tuple[int, int]:
    d, ff, layers = model.d_model, model.d_ff, model.n_layers
    if ff is None:  # ModelConfig sets it from d_model when it is built
        raise ValueError("ModelConfig.d_ff is unset")
    per_layer = 4 * d * d + 3 * d * ff  # attention and SwiGLU projections (GQA only shrinks K, V)
    params = layers * per_layer + model.vocab_size * d * (1 if model.tie_embeddings else 2)
    fixed = 4 * params * _FLOAT  # weights, gradients, two optimizer moments
    attention = 4 * d + model.n_heads * seq_len  # saved per token by one attention sublayer
    mlp = 4 * d + 2 * ff  # ... and by one SwiGLU sublayer
    if checkpointing == "block":
        segments = segment_layers(model)
        activations = max(len(s) for s in segments) * (attention + mlp) + len(segments) * d
    elif checkpointing == "sublayer":
        activations = 2 * layers * d + max(attention, mlp)
    else:
        activations = layers * (attention + mlp)
    per_token = _FLOAT * (activations + 3 * model.vocab_size)
    return fixed, per_token


def estimate_step_memory(model: ModelConfig, batch_size: int, seq_len: int, checkpointing: str = "none") -> int:
    """Bytes one optimizer step holds at least (a low estimate; see the module docstring);
    ``checkpointing``: the ``activation_checkpointing`` mode."""
    fixed, per_token = _fixed_and_per_token(model, seq_len, checkpointing)
    return fixed + batch_size * seq_len * per_token


def available_memory(device: torch.device) -> int | None:
    """Free bytes on ``device``: CUDA's free memory, or the kernel's MemAvailable for the CPU; None
    where that cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        pass
    return None


def _largest_batch(model: ModelConfig, train, available: int, checkpointing: str) -> int:
    fixed, per_token = _fixed_and_per_token(model, train.seq_len, checkpointing)
    return max(0, (available - fixed) // (per_token * train.seq_len)) * train.dp


def check_memory(model: ModelConfig, train, device: torch.device, available: int | None = None) -> None:
    """Refuse a single-pipeline-stage run whose step clearly does not fit on ``device`` (ValueError
    naming batch_size, the estimate and the largest batch size that fits). ``train`` is a TrainConfig;
    its batch is split over ``dp`` ranks. Pipeline and tensor-parallel runs (``pp > 1``, ``tp > 1``)
    spread the model, which the estimate holds whole on one rank: they are not checked."""
    if train.pp > 1 or train.tp > 1:
        return
    available = available_memory(device) if available is None else available
    if available is None:
        return
    rank_batch = math.ceil(train.batch_size / train.dp)
    mode = train.activation_checkpointing
    need = estimate_step_memory(model, rank_batch, train.seq_len, mode)
    if need <= available:
        return
    fits = _largest_batch(model, train, available, mode)
    advice = (
        f"batch_size <= {fits} fits (use grad_accum for a larger effective batch)"
        if fits >= 1
        else "not even batch_size=1 fits: use a smaller model or seq_len"
    )
    if mode == "none" and (with_checkpointing := _largest_batch(model, train, available, "block")) > fits:
        advice += f", or activation_checkpointing='block' fits batch_size <= {with_checkpointing}"
    raise ValueError(
        f"TrainConfig.batch_size={train.batch_size} needs about {need / _GIB:,.1f} GiB for one training step "
        f"(a low estimate) but {available / _GIB:,.1f} GiB is free on {device}; {advice}"
    )


def check_models_memory(
    models: Sequence[ModelConfig],
    batch_size: int,
    seq_len: int,
    device: torch.device,
    *,
    checkpointing: str = "none",
    owner: str = "BenchConfig",
    available: int | None = None,
) -> None:
    """Refuse ``models`` that clearly do not fit on ``device`` when all are built at once, each with
    its optimizer, and they take training steps one at a time (``attnres bench train``: every variant
    is timed round-robin in one process): every model's fixed part, and the largest step's
    activations. The ValueError names ``{owner}.batch_size``, the estimate and what fits."""
    available = available_memory(device) if available is None else available
    if available is None or not models:
        return
    parts = [_fixed_and_per_token(model, seq_len, checkpointing) for model in models]
    fixed, per_token = sum(f for f, _ in parts), max(p for _, p in parts)
    need = fixed + batch_size * seq_len * per_token
    if need <= available:
        return
    fits = max(0, (available - fixed) // (per_token * seq_len))
    advice = (
        f"batch_size <= {fits} fits"
        if fits >= 1
        else "not even batch_size=1 fits: use a smaller model or seq_len, or fewer variants"
    )
    raise ValueError(
        f"{owner}.batch_size={batch_size} needs about {need / _GIB:,.1f} GiB for {len(models)} models with their "
        f"optimizers and one training step (a low estimate) but {available / _GIB:,.1f} GiB is free on {device}; "
        f"{advice}"
    )
