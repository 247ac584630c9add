"""Routing mass against causal importance (arXiv 2606.13168's question).

For a trained Full or Block AttnRes model: at one consumer l (a sublayer's read, or the final
aggregation) knock out one source i and measure how much the validation loss rises, for every (l, i)
with more than one source. Two knockouts:

- ``zero``: source i leaves the read; the other weights are renormalised (the softmax over the
  remaining sources: the same as a weight of zero followed by renormalisation);
- ``mean``: v_i is replaced by its mean over batch and tokens (per channel), its key too, so that
  the weights are recomputed from what is left of it.

Every other consumer reads as trained. The mean depth weight alpha_{l,i} comes from the same batches
(the model's depth record). ``knockout_table`` returns it all; ``cached_knockouts`` keeps it in a
small JSON file in the run directory, so that a report needs the checkpoint only once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch

from attnres.files import atomic_write_json, read_json
from attnres.residual.depth_streams import DepthAttentionStream

KNOCKOUT_FILE = "knockout.json"
KNOCKOUT_VERSION = 1
MODES = ("zero", "mean")


def knockout_form(consumer: int, source: int, mode: str) -> type:
    """The reference stream with source ``source`` of read ``consumer`` knocked out (``mode``)."""
    if mode not in MODES:
        raise ValueError(f"knockout mode {mode!r} is invalid: choose one of {MODES}")

    class KnockoutStream(DepthAttentionStream):
        def _producers(self, read: int) -> list[torch.Tensor]:
            out = super()._producers(read)
            if read != consumer:
                return out
            if mode == "zero":
                return out[:source] + out[source + 1 :]
            v = out[source]
            out[source] = v.mean(dim=(0, 1), keepdim=True).expand_as(v)
            return out

    return KnockoutStream


def _loss(model, batches) -> float:
    from attnres.model.llama import lm_loss

    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            total += lm_loss(model(x), y).item() * x.numel()
            n += x.numel()
    return total / n


def knockout_table(model, batches: list[tuple[torch.Tensor, torch.Tensor]], log: Callable[[str], None] = print) -> dict:
    """Mean depth weights and the loss increase of each knockout, on ``batches`` [(x, y)].

    Returns ``{"base_loss", "consumers": [{"sources": names, "weight": [...], "zero": [...],
    "mean": [...]}]}``: per consumer (sublayers 0 … L-1, then the final aggregation) the mean weight of
    each source and the loss increase (nats/token) when it is knocked out; consumers that read a
    single source have no knockouts (empty lists)."""
    scheme = model.residual
    if not hasattr(scheme, "plan"):
        raise ValueError(f"knockouts need a Full or Block AttnRes model, not {type(scheme).__name__}")
    model.eval()
    weights: list[list[float]] = []
    names: list[list[str]] = []
    with torch.no_grad():
        sums: list[torch.Tensor] | None = None
        for x, _ in batches:
            record = model(x, return_record=True).record
            means = [w.double().flatten(1).mean(1) for w in record.weights]
            sums = means if sums is None else [a + b for a, b in zip(sums, means, strict=True)]
            names = [list(n) for n in record.sources]
        assert sums is not None  # at least one batch
        weights = [(s / len(batches)).tolist() for s in sums]
    base = _loss(model, batches)
    consumers = []
    for read, (w, n) in enumerate(zip(weights, names, strict=True)):
        row: dict = {"sources": n, "weight": w, "zero": [], "mean": []}
        if len(n) > 1:
            for mode in MODES:
                for i in range(len(n)):
                    form = knockout_form(read, i, mode)
                    scheme.stream_form = lambda e, form=form: form  # this instance only
                    try:
                        row[mode].append(_loss(model, batches) - base)
                    finally:
                        del scheme.stream_form
        consumers.append(row)
        log(f"knockouts: consumer {read + 1}/{len(weights)} done")
    return {"base_loss": base, "consumers": consumers}


def cached_knockouts(run_dir: Path, compute: Callable[[], dict]) -> dict:
    """The run's knockout table from ``run_dir/knockout.json``, computed (and written) if absent."""
    path = Path(run_dir) / KNOCKOUT_FILE
    stored = read_json(path)
    if isinstance(stored, dict) and stored.get("version") == KNOCKOUT_VERSION:
        return stored
    table = _rounded({"version": KNOCKOUT_VERSION, **compute()})
    atomic_write_json(path, table)
    return table


def _rounded(obj):
    """Floats to 6 significant digits (loss increases of 1e-5 nats keep their two leading digits): the
    cache is committed, and the report reads the rounded values the first time too."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def knockouts_of_run(run, run_dir: Path, batches: int, log: Callable[[str], None] = print) -> dict:
    """Load a finished run's kept checkpoint (``keep_checkpoint = true``) and measure its knockouts on
    the first ``batches`` validation batches (the run's batch size and sequence length)."""
    from attnres.data import eval_batches
    from attnres.train.trainer import Trainer

    train_cfg = copy.deepcopy(run.train)
    train_cfg.out_dir = str(run_dir)
    train_cfg.progress = False
    trainer = Trainer(copy.deepcopy(run.model), train_cfg, resume=True, log=lambda _: None, name=run.name)
    data = list(eval_batches(trainer.data.val.tokens, train_cfg.batch_size, train_cfg.seq_len, max_batches=batches))
    table = knockout_table(trainer.model, data, log=log)
    table["batches"] = len(data)
    table["step"] = trainer.step
    return table
