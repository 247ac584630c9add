"""How the Trainer runs a step: in one process, data parallel (DDP or FSDP2), tensor parallel (on a
(dp, tp) mesh; the sharding itself is ``attnres.parallel.tensor``), or pipeline parallel (on a
(dp, pp, tp) mesh).

Each strategy takes the *global* batch every rank samples alike (same seed) and
returns the global mean loss, so a run's numbers do not depend on its layout:

- ``SingleProcess``: the plain model.
- ``DataParallel``: rank r computes rows [r B/K, (r+1) B/K) of the batch; DDP
  (or FSDP2's reduce-scatter) averages gradients, which equals the gradient of
  the global-batch mean.
- ``PipelineParallel``: ``attnres.parallel.pipeline`` with cross-stage caching;
  residual-scheme parameters exist on every rank and their gradients are summed.
- ``TensorParallel``: ``attnres.parallel.tensor``'s sharding on a (dp, tp) mesh; the residual scheme
  runs replicated on the full hidden state (or, with sequence parallelism, on each rank's positions).

Checkpoints are always the single-process format (``attnres.parallel.state``):
``gather`` collects the pieces on rank 0, ``scatter`` hands each rank its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnres.model.compile import compile_backend as compile_model_backend
from attnres.model.compile import compile_model
from attnres.model.llama import lm_loss
from attnres.model.lm import AttnResLM
from attnres.parallel.pipeline import all_reduce_gradients, build_pipeline
from attnres.parallel.state import (
    full_model_state,
    load_full_model_state,
    load_named_optimizer_state,
    named_optimizer_state,
)
from attnres.parallel.tensor import (
    check_tensor_parallel,
    parallelize_model,
    replicated_parameters,
)
from attnres.parallel.tensor import clip_grad_norm as clip_mixed_grad_norm

# how a run compiled per sublayer describes its layout
SUBLAYER_GRAPHS = "per attention/MLP sublayer, one graph each reused by every block; the residual stream stays eager"


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_distributed(device: torch.device, timeout_s: float) -> None:
    """Join torchrun's process group (gloo on CPU, NCCL on GPUs) with a timeout, so a rank that dies
    leaves the others an error instead of a hang."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def leave_process_group() -> None:
    """Leave the process group, if any, while the interpreter is alive. FSDP and DDP state sits in
    reference cycles that still hold the group, so collect them first; otherwise the group's last
    reference, and gloo's worker threads with it, dies during interpreter shutdown, which can abort
    the process (pytorch/pytorch#190489)."""
    import gc

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def check_layout(dp: int, pp: int, tp: int = 1) -> int:
    """The world size this run needs (dp * tp * pp); raises a clear error when the launch does not provide it."""
    need = dp * tp * pp
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    if need > 1 and not launched_by_torchrun():
        flag = " ".join(f"--{k} {v}" for k, v in (("dp", dp), ("tp", tp), ("pp", pp)) if v > 1)
        raise ValueError(
            f"{flag} needs {need} processes: launch with `torchrun --nproc-per-node {need} -m attnres train ... {flag}`"
        )
    if world != need:
        raise ValueError(
            f"torchrun started {world} processes but dp * tp * pp = {need}; pass --nproc-per-node "
            f"{need} or set --dp / --tp / --pp to match"
        )
    return need


class SingleProcess:
    """One process, the whole model."""

    distributed = False

    def __init__(self, model: AttnResLM, autocast: Callable):
        self.model = model  # the parameters this rank optimizes, under their full-model names
        self.autocast = autocast

    @property
    def is_main(self) -> bool:
        return True

    def compile(self, setting, granularity: str = "model") -> str:
        """torch.compile what this strategy runs, in place (parameter names unchanged), one graph per
        ``granularity`` where the layout allows it; returns how."""
        compile_model(self.model, setting, granularity=granularity)
        return "whole model" if granularity == "model" else SUBLAYER_GRAPHS

    def forward_backward(self, x: Tensor, y: Tensor, scale: float) -> float:
        with self.autocast():
            loss = lm_loss(self.model(x), y)
        if torch.isfinite(loss):
            (loss * scale).backward()
        return loss.item()

    @torch.no_grad()
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        with self.autocast():
            return lm_loss(self.model(x), y).item()

    def reduce_gradients(self) -> None:
        pass

    def end_step(self) -> dict[str, object]:
        """After the optimizer step: the model's per-step update and report (``AttnResLM.end_step``:
        MoE router balancing and expert loads; {} for dense models)."""
        return self.model.end_step()

    def clip_grad_norm(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def any_rank(self, flag: bool) -> bool:
        return flag

    def gather(self, optimizer) -> tuple[dict[str, Tensor], dict] | None:
        return full_model_state(self.model), named_optimizer_state(optimizer)

    def scatter(self, model_state: dict[str, Tensor], optim_state: dict, optimizer) -> None:
        load_full_model_state(self.model, model_state)
        load_named_optimizer_state(optimizer, optim_state, self.model)

    def barrier(self) -> None:
        pass


class _Distributed(SingleProcess):
    distributed = True

    @property
    def is_main(self) -> bool:
        return dist.get_rank() == 0

    def _device(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    def _sum(self, value: float) -> float:
        t = torch.tensor(value, dtype=torch.float64, device=self._device())
        dist.all_reduce(t)
        return float(t)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is True on one (Ctrl-C reaches ranks at different steps)."""
        return self._sum(float(flag)) > 0

    def barrier(self) -> None:
        dist.barrier()


class DataParallel(_Distributed):
    """DDP, or FSDP2 (``fully_shard`` per attention and MLP sublayer, then the root) with ``shard``."""

    def __init__(self, model: AttnResLM, autocast: Callable, *, shard: bool = False):
        super().__init__(model, autocast)
        self.world, self.rank, self.shard = dist.get_world_size(), dist.get_rank(), shard
        if shard:
            from torch.distributed.fsdp import fully_shard

            # the sublayers are the tensor-in, tensor-out units; a Transformer block's forward takes the
            # residual stream, which FSDP's backward hooks cannot see
            for block in model.blocks:
                fully_shard(block.get_submodule("attn"))
                fully_shard(block.get_submodule("mlp"))
            fully_shard(model)
            self.wrapped: nn.Module = model
        else:
            self.wrapped = nn.parallel.DistributedDataParallel(model)

    def compile(self, setting, granularity: str = "model") -> str:
        if self.shard:  # per unit that fully_shard wraps, its hooks outside the graph
            compile_model(self.model, setting, granularity="sublayer")
            return "per attention/MLP sublayer (FSDP2 units; the residual stream stays eager)"
        if granularity == "sublayer":  # DDP's hooks are on the wrapper, outside every sublayer's graph
            compile_model(self.model, setting, granularity="sublayer")
            return SUBLAYER_GRAPHS + " under DDP"
        self.wrapped.compile(backend=compile_model_backend(setting))  # DDP: dynamo splits at buckets
        return "whole model under DDP"

    def end_step(self) -> dict[str, object]:
        for counter in self.model.step_counters():  # every replica updates from the global counts
            dist.all_reduce(counter)
        return self.model.end_step()

    def _rows(self, x: Tensor) -> slice:
        b = x.shape[0]
        if b % self.world:
            raise ValueError(f"TrainConfig.batch_size={b} is not divisible by dp={self.world}; use a multiple")
        n = b // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    def forward_backward(self, x: Tensor, y: Tensor, scale: float) -> float:
        rows = self._rows(x)
        with self.autocast():
            loss = lm_loss(self.wrapped(x[rows]), y[rows])
        (loss * scale).backward()  # every rank must join the gradient reduction, finite or not
        return self._sum(loss.item()) / self.world

    @torch.no_grad()
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        rows = self._rows(x)
        with self.autocast():
            loss = lm_loss(self.wrapped(x[rows]), y[rows])
        return self._sum(loss.item()) / self.world

    def gather(self, optimizer):
        state = full_model_state(self.model), named_optimizer_state(optimizer)  # collective under FSDP2
        return state if self.is_main else None


class _Replicas(_Distributed):
    """A layout of ``dp`` replicas on a device mesh (pipelines, tensor-parallel groups): replica i
    computes rows [i B/dp, (i+1) B/dp) of every batch, and every rank of a replica holds its loss."""

    dp: int
    dp_rank: int
    dp_group: Any

    def _rows(self, x: Tensor) -> slice:
        n = x.shape[0] // self.dp
        return slice(self.dp_rank * n, (self.dp_rank + 1) * n)

    def _replica_mean(self, value: float) -> float:
        if self.dp == 1:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=self._device())
        dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp


class PipelineParallel(_Replicas):
    """``attnres.parallel.pipeline`` on ``pp`` ranks, optionally replicated ``dp`` times (a (dp, pp)
    device mesh: replica i holds global ranks i*pp .. i*pp+pp-1 and computes rows
    [i B/dp, (i+1) B/dp) of every batch; gradients are averaged over replicas), and optionally each
    stage split over ``tp`` ranks (a (dp, pp, tp) mesh: ``attnres.parallel.tensor`` before the cut;
    the stages send the replicated residual stream between ranks of equal tp coordinate).
    ``self.model`` is this rank's part of the model."""

    def __init__(
        self,
        model: AttnResLM,
        autocast: Callable,
        *,
        pp: int,
        vpp: int,
        schedule: str,
        microbatches: int,
        batch_size: int,
        seq_len: int,
        cache: bool = True,
        dp: int = 1,
        tp: int = 1,
    ):
        self.dp, self.pp_group, self.dp_group, self.dp_rank = dp, None, None, 0
        if dp > 1 or tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            if batch_size % dp:
                raise ValueError(f"TrainConfig.batch_size={batch_size} is not divisible by dp={dp}; use a multiple")
            check_tensor_parallel(model.config, tp)
            device = next(model.parameters()).device
            mesh = init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
            self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
            self.dp_rank = mesh.get_local_rank("dp")
            if tp > 1:
                parallelize_model(model, mesh["tp"])
        self.pipeline = build_pipeline(
            model,
            pp=pp,
            vpp=vpp,
            schedule=schedule,
            microbatches=microbatches,
            batch_size=batch_size // dp,
            seq_len=seq_len,
            cache=cache,
            group=self.pp_group,
            autocast=autocast,
        )
        super().__init__(self.pipeline.model, autocast)

    def compile(self, setting, granularity: str = "model") -> str:
        # a stage's forward takes the microbatch index and a history cache (Python state, one graph
        # break each); its sublayers are the tensor-in, tensor-out part
        compile_model(self.model, setting, granularity="sublayer")
        return "per attention/MLP sublayer (pipeline stages; the residual stream stays eager)"

    def forward_backward(self, x: Tensor, y: Tensor, scale: float) -> float:
        rows = self._rows(x)
        return self._replica_mean(self.pipeline.train_step(x[rows], y[rows], scale=scale))

    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        rows = self._rows(x)
        return self._replica_mean(self.pipeline.eval_loss(x[rows], y[rows]))

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        self.pipeline.reduce_shared_gradients()
        if self.dp > 1:  # average over replicas: the gradient of the global-batch mean
            all_reduce_gradients(list(self.model.parameters()), self.dp_group, divide=self.dp)

    def clip_grad_norm(self, max_norm: float) -> None:
        self.pipeline.clip_grad_norm_(max_norm)  # replicas hold equal gradients: their norm is global

    def end_step(self) -> dict[str, object]:
        """Each rank updates its own blocks (from counts summed over replicas); rank 0 gets every
        rank's report."""
        if self.dp > 1:
            for counter in self.model.step_counters():
                dist.all_reduce(counter, group=self.dp_group)
        report = self.model.end_step()
        first = dist.get_rank(self.pp_group) == 0
        pieces: list[Any] | None = [None] * dist.get_world_size(self.pp_group) if first else None
        dist.gather_object(report, pieces, group=self.pp_group, group_dst=0)
        return {k: v for piece in pieces for k, v in piece.items()} if pieces is not None else {}

    def gather(self, optimizer):
        local = (full_model_state(self.model), named_optimizer_state(optimizer))
        first = dist.get_rank(self.pp_group) == 0
        pieces: list[Any] | None = [None] * dist.get_world_size(self.pp_group) if first else None
        dist.gather_object(local, pieces, group=self.pp_group, group_dst=0)
        if not self.is_main or pieces is None:  # rank 0 of the pipeline group holds the pieces
            return None
        model_state: dict[str, Tensor] = {}
        optim_state: dict[str, dict] = {}
        for m, o in pieces:  # shared (residual) entries are equal on every rank: any copy will do
            model_state.update(m)
            for key, by_name in o.items():
                optim_state.setdefault(key, {}).update(by_name)
        return model_state, optim_state


class TensorParallel(_Replicas):
    """``model`` sharded over ``tp`` ranks (``attnres.parallel.tensor``), replicated ``dp`` times on a
    (dp, tp) mesh: tp group i is global ranks i*tp .. i*tp+tp-1 and computes rows [i B/dp, (i+1) B/dp)
    of every batch; the replicas average their gradients by all-reduce, or (``shard``) FSDP2 shards
    every sublayer over the dp dimension. ``sequence_parallel``: the depth state split by position
    over tp, the whole parameters' gradients summed over tp."""

    def __init__(
        self,
        model: AttnResLM,
        autocast: Callable,
        *,
        tp: int,
        dp: int = 1,
        shard: bool = False,
        sequence_parallel: bool = False,
    ):
        from torch.distributed.device_mesh import init_device_mesh

        check_tensor_parallel(model.config, tp, sequence_parallel)
        super().__init__(model, autocast)
        self.dp, self.tp, self.shard, self.sequence_parallel = dp, tp, shard, sequence_parallel
        device = next(model.parameters()).device
        self.mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        self.dp_group, self.dp_rank = self.mesh.get_group("dp"), self.mesh.get_local_rank("dp")
        parallelize_model(model, self.mesh["tp"], sequence_parallel)
        if shard:
            from torch.distributed.fsdp import fully_shard

            # the sublayers are FSDP2's units, as in DataParallel: the residual stream passes between them
            for block in model.blocks:
                fully_shard(block.get_submodule("attn"), mesh=self.mesh["dp"])
                fully_shard(block.get_submodule("mlp"), mesh=self.mesh["dp"])
            fully_shard(model, mesh=self.mesh["dp"])

    def compile(self, setting, granularity: str = "model") -> str:
        # the sublayers are where the DTensors are (and FSDP2's units); the residual stream between them
        # holds plain tensors, as in the pipeline and FSDP2 layouts
        compile_model(self.model, setting, granularity="sublayer")
        return "per attention/MLP sublayer (tensor-parallel DTensor sublayers; the residual stream stays eager)"

    def forward_backward(self, x: Tensor, y: Tensor, scale: float) -> float:
        rows = self._rows(x)
        with self.autocast():
            loss = lm_loss(self.model(x[rows]), y[rows])
        (loss * scale).backward()  # every rank joins the collectives of backward, finite loss or not
        return self._replica_mean(loss.item())

    @torch.no_grad()
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        rows = self._rows(x)
        with self.autocast():
            loss = lm_loss(self.model(x[rows]), y[rows])
        return self._replica_mean(loss.item())

    def reduce_gradients(self) -> None:
        if self.sequence_parallel:  # each tp rank saw T/tp of the positions: the whole parameters sum them
            all_reduce_gradients(replicated_parameters(self.model), self.mesh.get_group("tp"))
        if self.dp > 1 and not self.shard:  # FSDP2 reduce-scatters in backward
            all_reduce_gradients(list(self.model.parameters()), self.dp_group, divide=self.dp)

    def clip_grad_norm(self, max_norm: float) -> None:
        clip_mixed_grad_norm(list(self.model.parameters()), max_norm)

    def end_step(self) -> dict[str, object]:
        if self.dp > 1:  # MoE counts: equal over a tp group (the router is replicated), summed over replicas
            for counter in self.model.step_counters():
                dist.all_reduce(counter, group=self.dp_group)
        return self.model.end_step()

    def gather(self, optimizer):
        state = full_model_state(self.model), named_optimizer_state(optimizer)  # collective over the mesh
        return state if self.is_main else None
