"""The run's process layout, as the trainer builds it from ``TrainConfig`` (``attnres.parallel.runtime``:
a pipeline, data parallel, or one process; ``attnres.parallel.tensor``: tensor parallel, alone or on a
(dp, tp) mesh), how it is described, and what a pipeline sent."""

from __future__ import annotations

from collections.abc import Callable

from attnres.model import AttnResLM
from attnres.model.compile import compile_backend
from attnres.parallel.runtime import (
    DataParallel,
    PipelineParallel,
    SingleProcess,
    TensorParallel,
)
from attnres.train.config import TrainConfig


def build_layout(model: AttnResLM, c: TrainConfig, autocast: Callable):
    """``model`` laid out over the processes ``c`` asks for; ``autocast()``: the forward's precision."""
    if c.pp > 1:
        return PipelineParallel(
            model,
            autocast,
            pp=c.pp,
            vpp=c.vpp,
            schedule=c.pp_schedule,
            microbatches=c.pipeline_microbatches,
            batch_size=c.batch_size,
            seq_len=c.seq_len,
            cache=c.pp_cache,
            dp=c.dp,
            tp=c.tp,
        )
    if c.tp > 1:
        return TensorParallel(model, autocast, tp=c.tp, dp=c.dp, shard=c.fsdp, sequence_parallel=c.sequence_parallel)
    if c.dp > 1:
        return DataParallel(model, autocast, shard=c.fsdp)
    return SingleProcess(model, autocast)


def describe_layout(c: TrainConfig, compiled: str | None) -> str:
    """The layout, compilation and activation checkpointing of a run, as "; ..." parts ("" for none)."""
    layout = ""
    if c.pp > 1:
        layout = (
            f"; pipeline pp={c.pp} vpp={c.vpp} {c.pp_schedule}, {c.pipeline_microbatches} microbatches, "
            f"caching {'on' if c.pp_cache else 'off'}"
            + (f", {c.dp} replicas" if c.dp > 1 else "")
            + (f", each stage tensor parallel tp={c.tp}" if c.tp > 1 else "")
        )
    elif c.tp > 1:
        layout = f"; tensor parallel tp={c.tp}{' (sequence parallel)' if c.sequence_parallel else ''}" + (
            f" x data parallel dp={c.dp} ({'FSDP2' if c.fsdp else 'all-reduce'})" if c.dp > 1 else ""
        )
    elif c.dp > 1:
        layout = f"; data parallel dp={c.dp} ({'FSDP2' if c.fsdp else 'DDP'})"
    if compiled:
        layout += f"; torch.compile {compile_backend(c.compile)} ({compiled})"
    if c.activation_checkpointing != "none":
        layout += f"; activation checkpointing: {c.activation_checkpointing}"
    return layout


def pipeline_traffic(strategy, c: TrainConfig) -> str | None:
    """The pipeline's bytes on the wire next to docs/method.md §7 (``attnres.parallel.report``); None without
    a pipeline or before any step. Collective: every rank of a pipeline run calls it."""
    if c.pp == 1:
        return None
    from attnres.parallel.report import gather_traffic, traffic_table

    pipe = strategy.pipeline
    mode = "cached" if c.pp_cache else "naive"
    measured = gather_traffic(pipe)
    if not pipe.steps_run:
        return None
    return traffic_table({mode: pipe.layout}, {mode: measured}, steps=pipe.steps_run, microbatches=pipe.microbatches)
