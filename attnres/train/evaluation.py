"""Validation loss and bits per byte: of a model on a split (the trainer's evaluations), and of a
trained run on its own validation split (``attnres eval``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from attnres.checkpoint import CheckpointError, load_model
from attnres.files import TOKENIZER_FILE
from attnres.model.compile import compile_model
from attnres.model.llama import lm_loss
from attnres.train.progress import progress_bar


@torch.no_grad()
def evaluate(
    model,
    split,
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    autocast=nullcontext,
    loss_of: Callable | None = None,
    progress: bool = False,
) -> dict:
    """Validation loss (nats/token) and bits per byte over the split's first windows.

    ``loss_of(x, y) -> float`` (mean loss of a batch) replaces ``model(x)`` for parallel runs.
    ``progress``: a bar over the batches (on a terminal, see ``attnres.train.progress``)."""
    from attnres.data import bits_per_byte, eval_batches

    check_max_batches(max_batches)
    device = next(model.parameters()).device
    if loss_of is None:

        def loss_of(x, y):
            with autocast():
                return lm_loss(model(x), y).item()

    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    batches = -(-((len(split.tokens) - 1) // seq_len) // batch_size)
    total_batches = min(batches, max_batches or batches)
    bar = progress_bar(total=total_batches, desc="eval", unit="batch", log_lines=10) if progress else None
    count = 0
    for x, y in eval_batches(split.tokens, batch_size, seq_len, max_batches=max_batches):
        x, y = x.to(device), y.to(device)
        total += loss_of(x, y) * x.numel()
        n += x.numel()
        count += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    model.train(was_training)
    loss = total / n
    # val_tokens: the predicted tokens the loss averages over, so a report can say how much of the split it saw
    return {
        "val_loss": loss,
        "val_bpb": bits_per_byte(loss, split.bytes_per_token),
        "val_batches": count,
        "val_tokens": n,
    }


def evaluate_run(
    run_or_checkpoint: str,
    *,
    data: str | None = None,
    max_batches: int | None = None,
    device: str = "cpu",
    progress: bool = False,
    compile: bool | str = False,
) -> dict:
    """Validation loss of a trained run on its own validation split (or on ``data``'s): the
    checkpoint's step plus :func:`evaluate`'s numbers, with the run's batch shape and the run's own
    tokenizer (``tokenizer.json``: a tokenizer trained anew on other data would give other ids).
    ``compile``: torch.compile the model first (True: inductor, or a backend name)."""
    from attnres.data import prepare_data

    check_max_batches(max_batches)
    model, tokenizer, state = load_model(run_or_checkpoint, device=device)
    compile_model(model, compile)
    tc = state.get("train_config") or {}
    if not tc:
        raise CheckpointError(
            f"{run_or_checkpoint} is a weights-only checkpoint without the run's training "
            "config (batch shape, data); evaluate a run directory written by attnres train"
        )
    if tokenizer is None and tc["tokenizer"] != "byte":
        raise CheckpointError(
            f"{run_or_checkpoint} has no {TOKENIZER_FILE}, and a {tc['tokenizer']} tokenizer "
            "trained anew would give other token ids; restore the run's tokenizer.json"
        )
    split = prepare_data(
        data=data if data else tc["data"],
        tokenizer=tokenizer or tc["tokenizer"],
        vocab_size=tc["vocab_size"],
        val_fraction=tc["val_fraction"],
        cache_dir=tc.get("cache_dir"),
    ).val
    ev = evaluate(
        model, split, batch_size=tc["batch_size"], seq_len=tc["seq_len"], max_batches=max_batches, progress=progress
    )
    return {"step": state["step"], **ev}


def check_max_batches(max_batches) -> None:
    """``max_batches``: None (the whole split) or a positive integer."""
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    ):
        raise ValueError(
            f"max_batches={max_batches!r} is invalid: must be a positive number of batches "
            "(or None for the whole split)"
        )
