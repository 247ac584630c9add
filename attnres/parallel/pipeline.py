"""Pipeline parallelism on ``torch.distributed.pipelining`` with cross-stage caching (docs/method.md §7).

The model is cut at Transformer-block boundaries into C = P·V chunks; chunk c
runs on rank c mod P (the looped placement of Interleaved1F1B and LoopedBFS).
Chunk 0 also holds the embedding, chunk C-1 the final aggregation, norm, head
and loss. Between chunks the residual stream travels as its ``export()``:
the depth *history* (embedding and completed block representations,
append-only) and the running *state* (e.g. a partial block sum).

Cross-stage caching: rank r keeps, per microbatch, the history its chunk c
received; when it runs chunk c + P it already holds that prefix, so the
transition into chunk c + P carries only the increment produced since (the
rank's own earlier chunk included, exactly as docs/method.md §7 counts). Cached tensors
are the autograd leaves chunk c received, so the gradient that chunk c + P
sends into them accumulates in their ``.grad``, and chunk c's backward, which
runs later, sends the sum upstream to their producers.

Gradient flow relies on full backward accumulating into ``.grad``; split
backward schedules (InterleavedZeroBubble, ZBV, DualPipeV) compute input
gradients with ``autograd.grad`` instead, so they are rejected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnres.model.llama import lm_loss, output_logits, run_blocks
from attnres.model.lm import AttnResLM
from attnres.parallel import PIPELINE_SCHEDULES as SCHEDULES
from attnres.parallel.state import full_tensor, local_shard
from attnres.residual import DepthState

if TYPE_CHECKING:  # torch.distributed.pipelining is imported when a pipeline is built
    from torch.distributed.pipelining import PipelineStage as _StageBase
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )
else:
    _StageBase = object  # CountingStage is mixed into PipelineStage by _stage_class

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _schedule_class(name: str):
    from torch.distributed.pipelining import schedules

    return {
        "GPipe": schedules.ScheduleGPipe,
        "1F1B": schedules.Schedule1F1B,
        "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
        "LoopedBFS": schedules.ScheduleLoopedBFS,
    }[name]


def check_pipeline_options(
    pp: int,
    vpp: int,
    schedule: str,
    microbatches: int,
    n_layers: int | None,
    batch_size: int,
    where: str = "TrainConfig",
) -> None:
    """Every way a pipeline request can be wrong, as one clear error before any process group work
    (``n_layers`` None: the model is not known yet)."""

    def bad(name, value, fix):
        return ValueError(f"{where}.{name}={value!r} is invalid: {fix}")

    for name, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, value, "must be a positive integer")
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        raise bad(
            "pp_schedule",
            schedule,
            "split-backward schedules compute input gradients with autograd.grad, which bypasses the "
            "gradient accumulation that cross-stage caching relies on; choose one of "
            f"{SCHEDULES}",
        )
    if schedule not in SCHEDULES:
        raise bad("pp_schedule", schedule, f"choose one of {SCHEDULES}")
    if schedule in SINGLE_STAGE_SCHEDULES and vpp != 1:
        raise bad(
            "vpp", vpp, f"{schedule} runs one stage per rank; use vpp=1 or the Interleaved1F1B / LoopedBFS schedule"
        )
    if n_layers is not None and pp * vpp > n_layers:
        raise bad(
            "pp",
            pp,
            f"pp * vpp = {pp * vpp} chunks but the model has only n_layers={n_layers} "
            "Transformer blocks; lower pp or vpp",
        )
    if batch_size % microbatches:
        raise bad("microbatches", microbatches, f"must divide the batch size {batch_size}")
    if schedule not in SINGLE_STAGE_SCHEDULES and microbatches % pp:
        raise bad("microbatches", microbatches, f"{schedule} needs a multiple of pp={pp}")


# ----------------------------------------------------------------------------- layout


def split_layers(n_layers: int, n_chunks: int) -> list[range]:
    """Contiguous Transformer-block ranges, sizes differing by at most one (larger ones first)."""
    base, extra = divmod(n_layers, n_chunks)
    out, start = [], 0
    for c in range(n_chunks):
        size = base + (c < extra)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def meta(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta", requires_grad=self.dtype.is_floating_point)


@dataclass
class PipelineLayout:
    """Which chunk holds what, and what each transition carries, for one microbatch shape.

    ``history[c]`` / ``state[c]``: TensorSpecs of the stream exported after chunk c.
    """

    pp: int
    vpp: int
    cache: bool
    layers: list[range]
    history: list[list[TensorSpec]]
    state: list[list[TensorSpec]]

    @property
    def n_chunks(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def chunks_of(self, rank: int) -> list[int]:
        return list(range(rank, self.n_chunks, self.pp))

    def held(self, chunk: int) -> int:
        """History entries chunk ``chunk`` already holds before its input arrives: what its rank's
        previous chunk received (docs/method.md §7), nothing without caching or in the first virtual stage."""
        prev = chunk - self.pp
        if not self.cache or prev < 1:
            return 0
        return len(self.history[prev - 1])

    def sent_history(self, chunk: int) -> range:
        """History indices carried by the transition chunk -> chunk + 1."""
        return range(self.held(chunk + 1), len(self.history[chunk]))

    def inputs(self, chunk: int) -> list[TensorSpec]:
        prev = chunk - 1
        return [self.history[prev][i] for i in self.sent_history(prev)] + self.state[prev]

    def traffic(self) -> list[dict[str, int]]:
        """Per transition c -> c+1: history entries and bytes sent, split into the embedding (history
        entry 0), block representations and running state, per microbatch."""
        rows = []
        for c in range(self.n_chunks - 1):
            sent = self.sent_history(c)
            row = {
                "transition": c,
                "src_rank": self.rank_of(c),
                "dst_rank": self.rank_of(c + 1),
                "embedding": int(0 in sent),
                "blocks": sum(1 for i in sent if i > 0),
                "state": len(self.state[c]),
            }
            row["embedding_bytes"] = self.history[c][0].bytes if 0 in sent else 0
            row["block_bytes"] = sum(self.history[c][i].bytes for i in sent if i > 0)
            row["state_bytes"] = sum(s.bytes for s in self.state[c])
            row["bytes"] = row["embedding_bytes"] + row["block_bytes"] + row["state_bytes"]
            rows.append(row)
        return rows


def spec_block_traffic(pp: int, vpp: int, blocks_per_chunk: float) -> tuple[float, float]:
    """docs/method.md §7, in block representations per token (multiply by d for d-vectors):
    naive C(C-1)/2 · N_p, cached P(P-1)/2 · N_p + (V-1) · P² · N_p."""
    c = pp * vpp
    naive = c * (c - 1) / 2 * blocks_per_chunk
    cached = pp * (pp - 1) / 2 * blocks_per_chunk + (vpp - 1) * pp * pp * blocks_per_chunk
    return naive, cached


@torch.no_grad()
def probe_layout(
    model: AttnResLM,
    pp: int,
    vpp: int,
    microbatch: int,
    seq_len: int,
    *,
    cache: bool,
    autocast: Callable = contextlib.nullcontext,
) -> PipelineLayout:
    """Run the full model once on a dummy microbatch and record what each chunk boundary exports."""
    layers = split_layers(model.config.n_layers, pp * vpp)
    device = next(model.parameters()).device
    ids = torch.zeros(microbatch, seq_len, dtype=torch.long, device=device)
    cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
    history, state = [], []
    with autocast():
        depth = model.residual.start(model.embed(ids))
        for rng in layers:
            depth = run_blocks(depth, model.residual, ((i, model.blocks[i]) for i in rng), cos, sin)
            history.append([TensorSpec(tuple(t.shape), t.dtype) for t in depth.history])
            state.append([TensorSpec(tuple(t.shape), t.dtype) for t in depth.state])
    return PipelineLayout(pp, vpp, cache, layers, history, state)


# ----------------------------------------------------------------------------- chunks


class HistoryCache:
    """Per (chunk, microbatch): the history a chunk received, for its rank's next chunk. Keyed by the
    chunk too, never by microbatch alone: every local chunk stores its own entry."""

    def __init__(self):
        self._held: dict[tuple[int, int], list[Tensor]] = {}

    def put(self, chunk: int, microbatch: int, history: list[Tensor]) -> None:
        self._held[(chunk, microbatch)] = history

    def take(self, chunk: int, microbatch: int) -> list[Tensor]:
        try:
            return self._held.pop((chunk, microbatch))
        except KeyError:
            raise RuntimeError(
                f"cross-stage cache: no history of chunk {chunk} for microbatch {microbatch}; the schedule "
                "ran a later virtual stage before an earlier one, which docs/method.md §7's caching cannot serve"
            ) from None

    def clear(self) -> None:
        self._held.clear()


class PipelineChunk(nn.Module):
    """One chunk of AttnResLM: its Transformer blocks, the shared residual scheme, and the embedding
    (first chunk) or the final norm and head (last chunk). Parameter names match the full model's."""

    embed: nn.Embedding | None  # the first chunk's
    norm: nn.Module | None  # the last chunk's, with lm_head
    lm_head: nn.Linear | None

    def __init__(
        self,
        model: AttnResLM,
        chunk: int,
        layout: PipelineLayout,
        cache: HistoryCache,
        autocast: Callable = contextlib.nullcontext,
    ):
        super().__init__()
        self.chunk, self.layout, self.cache, self.autocast = chunk, layout, cache, autocast
        self.is_first, self.is_last = chunk == 0, chunk == layout.n_chunks - 1
        self.layer_ids = list(layout.layers[chunk])
        self.embed = model.embed if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in self.layer_ids})
        self.residual = model.residual
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.rope = (model.rope_cos, model.rope_sin)  # not buffers here: the model owns them

    def forward(self, *inputs: Tensor, microbatch: Tensor):
        mb = int(microbatch.reshape(-1)[0])
        layout, c = self.layout, self.chunk
        with self.autocast():
            if self.is_first:
                assert self.embed is not None
                (ids,) = inputs
                depth = self.residual.start(self.embed(ids))
                seq_len = ids.shape[1]
            else:
                n_hist = len(layout.sent_history(c - 1))
                held = self.cache.take(c - layout.pp, mb) if layout.held(c) else []
                history = held + list(inputs[:n_hist])
                if c + layout.pp < layout.n_chunks and layout.held(c + layout.pp):
                    self.cache.put(c, mb, history)
                depth = DepthState(2 * self.layer_ids[0], tuple(history), tuple(inputs[n_hist:]))
                seq_len = inputs[0].shape[-2]
            cos, sin = self.rope[0][:seq_len], self.rope[1][:seq_len]
            depth = run_blocks(depth, self.residual, ((i, self.blocks[str(i)]) for i in self.layer_ids), cos, sin)
            if self.is_last:
                assert self.norm is not None and self.lm_head is not None
                return output_logits(self.norm, self.lm_head, self.residual.finish(depth))
        sent = [depth.history[i] for i in layout.sent_history(c)] + list(depth.state)
        # gloo sends only contiguous buffers (a multi-stream state may be an expanded view)
        return tuple(t.contiguous() for t in sent)


# ----------------------------------------------------------------------------- stages


@torch.no_grad()
def all_reduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None, divide: int = 1) -> None:
    """Sum (then divide) the gradients of ``params`` over ``group`` in one flat all-reduce; a missing
    gradient takes part as zeros."""
    if not params:
        return
    local = []  # DTensor gradients (tensor parallel, FSDP2) take part by this rank's shard, in place
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local.append(local_shard(p.grad))
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat /= divide
    offset = 0
    for g in local:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class CountingStage(_StageBase):
    """Mixin over PipelineStage: tallies the bytes of every P2P send, per transition and direction."""

    bytes_sent: dict[tuple[int, str], int]  # (transition, direction) -> bytes; build_pipeline sets it

    def _tally(self, ops, direction: str, transition: int):
        if not ops:
            return ops
        sent = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        key = (transition, direction)
        self.bytes_sent[key] = self.bytes_sent.get(key, 0) + sent
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return self._tally(super().get_fwd_send_ops(fwd_chunk_id), "forward", self.stage_index)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return self._tally(super().get_bwd_send_ops(bwd_chunk_id), "backward", self.stage_index - 1)


def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    return type("CountingPipelineStage", (CountingStage, PipelineStage), {})


@dataclass
class Pipeline:
    """The local side of a pipeline: this rank's chunks, their stages and the schedule."""

    model: AttnResLM  # pruned: only this rank's blocks (others are None), embedding/head where local
    layout: PipelineLayout
    chunks: list[PipelineChunk]
    schedule: PipelineScheduleSingle | PipelineScheduleMulti | None  # None until build_pipeline sets it
    microbatches: int
    cache: HistoryCache
    group: dist.ProcessGroup | None = None
    stages: list[CountingStage] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def has_first(self) -> bool:
        return self.chunks[0].is_first

    @property
    def has_last(self) -> bool:
        return self.chunks[-1].is_last

    loss_scale: float = 1.0  # the loss function's factor (gradient accumulation)
    steps_run: int = 0  # training forward/backward passes (what the traffic counters cover)

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        # mean over the microbatch / M: the microbatch losses sum to the batch mean, and so do the
        # gradients (the schedule's own scaling would divide shared parameters once per local stage)
        return lm_loss(logits, targets) * (self.loss_scale / self.microbatches)

    def _run(self, x: Tensor, y: Tensor, train: bool, scale: float = 1.0) -> float:
        self.cache.clear()
        self.loss_scale = scale
        losses: list[Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.has_last else {}
        mb_ids = torch.arange(self.microbatches, device=x.device)
        assert self.schedule is not None  # set by build_pipeline
        try:
            (self.schedule.step if train else self.schedule.eval)(*args, microbatch=mb_ids, **kwargs)
        finally:
            self.cache.clear()
            self.loss_scale = 1.0
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        if self.has_last:
            total += sum(float(loss.detach()) for loss in losses) / scale
        # the last rank knows the loss: share it (a sum, since only one rank contributes)
        dist.all_reduce(total, group=self.group)
        return float(total)

    def train_step(self, x: Tensor, y: Tensor, scale: float = 1.0) -> float:
        """Forward and backward of one batch split into microbatches; returns the batch mean loss and
        adds ``scale`` x its gradient to each local parameter's ``.grad`` (shared ones: this rank's
        part; ``reduce_shared_gradients`` sums them)."""
        self.steps_run += 1
        return self._run(x, y, train=True, scale=scale)

    @torch.no_grad()
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        counts = [dict(stage.bytes_sent) for stage in self.stages]  # traffic counts training steps only
        try:
            return self._run(x, y, train=False)
        finally:
            for stage, saved in zip(self.stages, counts, strict=True):
                stage.bytes_sent = saved

    def shared_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds: the residual scheme's (each rank trains its sublayers' rows)."""
        return list(self.model.residual.parameters())

    @torch.no_grad()
    def reduce_shared_gradients(self) -> None:
        """Sum the shared parameters' gradients over the ranks, so every copy takes the same step."""
        all_reduce_gradients(self.shared_parameters(), self.group)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the norm over the whole model's gradient (shared parameters counted once); call after
        ``reduce_shared_gradients``. Returns the norm before clipping."""
        shared = {id(p) for p in self.shared_parameters()}
        with_grad = [(p.grad, id(p) in shared) for p in self.model.parameters() if p.grad is not None]
        device = local_shard(with_grad[0][0]).device
        own = sum(
            (_squares(g) for g, is_shared in with_grad if not is_shared),
            torch.zeros((), dtype=torch.float64, device=device),
        )
        dist.all_reduce(own, group=self.group)
        common = sum(_squares(p.grad) for p in self.shared_parameters() if p.grad is not None)
        norm = float((own + common).sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for g, _ in with_grad:
                local_shard(g).mul_(coef)
        return norm

    def bytes_sent(self) -> dict[tuple[int, str], int]:
        """(transition, direction) -> bytes this rank sent, summed over its stages."""
        out: dict[tuple[int, str], int] = {}
        for stage in self.stages:
            for k, v in stage.bytes_sent.items():
                out[k] = out.get(k, 0) + v
        return out

    def reset_counters(self) -> None:
        self.steps_run = 0
        for stage in self.stages:
            stage.bytes_sent.clear()


def _squares(grad: Tensor) -> Tensor:
    """The sum of squares of a gradient in float64, over all of it when it is a DTensor (tensor parallel)."""
    return full_tensor(grad.double().pow(2).sum())


def prune_to_chunks(model: AttnResLM, layout: PipelineLayout, rank: int) -> AttnResLM:
    """Drop what this rank does not run, in place: other chunks' blocks become None, the embedding
    stays only with chunk 0 and the norm and head only with the last chunk."""
    mine = layout.chunks_of(rank)
    keep = {i for c in mine for i in layout.layers[c]}
    # register_module(name, None) keeps the slot, so every kept module keeps its full-model name
    for i in range(len(model.blocks)):
        if i not in keep:
            model.blocks.register_module(str(i), None)
    if 0 not in mine:
        model.register_module("embed", None)
    if layout.n_chunks - 1 not in mine:
        model.register_module("norm", None)
        model.register_module("lm_head", None)
    return model


def build_pipeline(
    model: AttnResLM,
    *,
    pp: int,
    vpp: int,
    schedule: str,
    microbatches: int,
    batch_size: int,
    seq_len: int,
    cache: bool = True,
    group: dist.ProcessGroup | None = None,
    autocast: Callable = contextlib.nullcontext,
) -> Pipeline:
    """Split ``model`` (identical on every rank of ``group``, which has ``pp`` ranks) into chunks,
    keep this rank's and wire them into a pipeline schedule. Modifies ``model`` in place."""
    check_pipeline_options(pp, vpp, schedule, microbatches, model.config.n_layers, batch_size)
    if model.config.tie_embeddings:
        raise ValueError(
            "ModelConfig.tie_embeddings=True is not supported with pipeline parallelism: the "
            "embedding and the head live on different ranks; use tie_embeddings=False"
        )
    world = dist.get_world_size(group)
    if world != pp:
        raise ValueError(
            f"pipeline parallelism with pp={pp} needs a process group of {pp} ranks, got "
            f"{world}; launch with torchrun --nproc-per-node {pp}"
        )
    rank = dist.get_rank(group)
    device = next(model.parameters()).device
    mb = batch_size // microbatches
    layout = probe_layout(model, pp, vpp, mb, seq_len, cache=cache, autocast=autocast)
    prune_to_chunks(model, layout, rank)
    history_cache = HistoryCache()
    stage_cls = _stage_class()
    chunks, stages = [], []
    vocab = model.config.vocab_size
    for c in layout.chunks_of(rank):
        chunk = PipelineChunk(model, c, layout, history_cache, autocast)
        inputs: tuple[Tensor, ...]
        outputs: tuple[Tensor, ...]
        if c == 0:
            inputs = (torch.empty(mb, seq_len, dtype=torch.long, device="meta"),)
        else:
            inputs = tuple(s.meta() for s in layout.inputs(c))
        if c == layout.n_chunks - 1:
            outputs = (torch.empty(mb, seq_len, vocab, dtype=torch.float32, device="meta", requires_grad=True),)
        else:
            outputs = tuple(layout.history[c][i].meta() for i in layout.sent_history(c)) + tuple(
                s.meta() for s in layout.state[c]
            )
        stage = stage_cls(chunk, c, layout.n_chunks, device, input_args=inputs, output_args=outputs, group=group)
        stage.bytes_sent = {}
        chunks.append(chunk)
        stages.append(stage)

    pipe = Pipeline(model, layout, chunks, None, microbatches, history_cache, group, stages)
    cls = _schedule_class(schedule)
    pipe.schedule = cls(
        stages[0] if schedule in SINGLE_STAGE_SCHEDULES else stages,
        microbatches,
        loss_fn=pipe.loss_fn,
        scale_grads=False,
    )
    return pipe
