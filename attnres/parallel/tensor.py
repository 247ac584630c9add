"""Tensor parallelism for the trainer (``attnres train --tp N``), alone or on a (dp, tp) device mesh.

What is sharded over the ``tp`` ranks (``torch.distributed.tensor.parallel.parallelize_module``):

- LLaMA blocks: the attention's q/k/v projections column-wise (each rank computes n_heads/tp heads and
  n_kv_heads/tp key-value heads), its output projection row-wise; the SwiGLU's gate and up projections
  column-wise, its down projection row-wise. The row-wise layers all-reduce, so every sublayer output
  is the full hidden state on every rank.
- Kimi Linear blocks: the dense MLPs and the MoE's shared experts as above. The attention (KDA, MLA)
  and the routed experts stay replicated: transformers' KDA feeds q, k and v through one short
  convolution split by the full head count, MLA reshapes by its configured head count, and the
  routed experts are 3-D stacks behind transformers' own dispatch, none of which a column-wise
  ``nn.Linear`` split can reach (transformers' own TP plan for Kimi Linear covers the MLPs only).
- The embedding (vocabulary rows, ``RowwiseParallel``) and the head (vocabulary columns,
  ``ColwiseParallel`` gathering the logits), unless they are tied: then both stay replicated.

What stays replicated and runs on the full hidden state on every rank: the residual scheme (the depth
attention with its pseudo-queries and key norms: 2d numbers per sublayer), the norms, and so the whole
depth state. Their gradients are equal on every rank without communication: every row-wise layer hands
each rank the full output, and every column-wise layer's input gradient is all-reduced.

With ``sequence_parallel`` (LLaMA blocks, untied head) the depth state is split by sequence position
instead: depth attention is per token, so each rank runs the residual scheme and the norms, on full
d-vectors, for its T/tp positions, and the whole parameters' gradients are summed over tp
(``parallelize_model``).

With ``dp > 1`` each tp group computes B/dp rows of the global batch; the dp replicas average their
gradients by all-reduce, or (``shard``) FSDP2 shards every sublayer over the dp dimension of the mesh.
Checkpoints stay in the single-process format (``attnres.parallel.state`` gathers and re-shards DTensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnres.model.llama import lm_loss
from attnres.model.lm import AttnResLM
from attnres.parallel.runtime import _Distributed
from attnres.parallel.state import full_model_state, full_tensor, named_optimizer_state

# per Transformer block: submodule -> how its weight is split ("col": output features, "row": input
# features); a submodule a block does not have is skipped (Kimi Linear's dense and MoE layers differ)
BLOCK_PLANS: dict[str, dict[str, str]] = {
    "llama": {
        "attn.q_proj": "col",
        "attn.k_proj": "col",
        "attn.v_proj": "col",
        "attn.o_proj": "row",
        "mlp.gate_proj": "col",
        "mlp.up_proj": "col",
        "mlp.down_proj": "row",
    },
    "kimi_linear": {
        "mlp.gate_proj": "col",
        "mlp.up_proj": "col",
        "mlp.down_proj": "row",
        "mlp.shared_experts.gate_proj": "col",
        "mlp.shared_experts.up_proj": "col",
        "mlp.shared_experts.down_proj": "row",
    },
}


def check_tensor_parallel(config, tp: int, sequence_parallel: bool = False) -> None:
    """The widths ``tp`` ranks split must divide evenly: heads (LLaMA attention) and MLP hidden units;
    sequence parallelism needs a LLaMA backbone and an untied head. Raises a ValueError naming the
    field, its value and the fix."""
    if tp == 1:
        return
    from attnres.model.kimi_layout import kimi_sizes, moe_layers

    if sequence_parallel and config.backbone != "llama":
        raise ValueError(
            f"sequence_parallel with backbone={config.backbone!r} and tp={tp} is not supported: its attention "
            "runs whole on every rank (see attnres.parallel.tensor), which would need the whole sequence. "
            "Fix: drop --sequence-parallel (plain --tp works)"
        )
    if sequence_parallel and config.tie_embeddings:
        raise ValueError(
            f"ModelConfig.tie_embeddings=True with sequence_parallel and tp={tp} is not supported: the tied "
            "embedding and head stay whole, and the head would read a sequence-sharded state. Fix: set "
            "tie_embeddings=false, or drop --sequence-parallel"
        )

    # (field, its value, the width split over the ranks)
    split: list[tuple[str, int | None, int | None]] = [("d_ff", config.d_ff, config.d_ff)]
    if config.backbone == "llama":
        split += [("n_heads", config.n_heads, config.n_heads), ("n_kv_heads", config.n_kv_heads, config.n_kv_heads)]
    elif config.backbone == "kimi_linear" and any(moe_layers(config)) and config.moe_shared_experts:
        moe_d_ff = kimi_sizes(config)["moe_d_ff"]  # the shared experts are one MLP this many times as wide
        split.append(("moe_d_ff", moe_d_ff, moe_d_ff * config.moe_shared_experts))
    for field, value, width in split:
        if width is not None and width % tp:
            what = field if value == width else f"the shared experts' width moe_d_ff * moe_shared_experts = {width}"
            raise ValueError(
                f"ModelConfig.{field}={value} is not divisible by tp={tp}: tensor parallelism splits {what} "
                f"evenly over the tp ranks. Fix: set {field} to a multiple of {tp}, or pick a --tp that divides it"
            )


def parallelize_model(model: AttnResLM, tp_mesh, sequence_parallel: bool = False) -> None:
    """Shard ``model`` over the 1-D ``tp_mesh`` in place (see the module docstring); names are unchanged.

    ``sequence_parallel``: the embedding reduce-scatters over T instead of all-reducing, so the depth
    state, the residual scheme and the norms run on each rank's T/tp positions; each LLaMA sublayer
    gathers its input over T once (``PrepareModuleInput``) and its row-wise projection reduce-scatters
    its output back; the head gathers the final state. The replicated parameters then see a share of the
    tokens each, and :meth:`TensorParallel.reduce_gradients` sums their gradients over tp."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    stream = Shard(1) if sequence_parallel else Replicate()  # where the residual stream lives: [B, T, d]
    styles: dict[str, Callable[[], ParallelStyle]] = {
        "col": ColwiseParallel,
        "row": lambda: RowwiseParallel(output_layouts=stream),
    }
    plan: dict = {}
    if sequence_parallel:  # Attention takes (x, cos, sin): x gathered over T once, the rope tables as given
        whole = Replicate()
        plan = {
            "attn": PrepareModuleInput(input_layouts=(stream, None, None), desired_input_layouts=(whole, None, None)),
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(whole,)),
        }
    for block in model.blocks:
        names = {name for name, _ in block.named_modules()}
        splits = {k: styles[how]() for k, how in BLOCK_PLANS[model.config.backbone].items() if k in names}
        parallelize_module(block, tp_mesh, {**plan, **splits})
    if not model.config.tie_embeddings:  # a tied weight cannot be split two ways: both stay whole
        parallelize_module(model.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=stream))
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(input_layouts=stream, output_layouts=Replicate()))


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters tensor parallelism leaves whole: plain tensors, or FSDP2 shards over dp only."""
    return [p for p in model.parameters() if not _split_over_tp(p)]


def _split_over_tp(p: Tensor) -> bool:
    mesh = getattr(p, "device_mesh", None)
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())


def _local(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank (sharing its storage); other tensors as they are."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a mix of DTensor (sharded) and plain (replicated)
    gradients, which torch's foreach norm refuses to mix: each DTensor's norm is its global one."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [full_tensor(torch.linalg.vector_norm(g)) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        _local(g).mul_(coef)
    return total


@torch.no_grad()
def average_gradients(params: list[nn.Parameter], group, world: int) -> None:
    """Every gradient summed over ``group`` and divided by ``world``, in one flat all-reduce of the local
    shards; a missing gradient takes part as zeros."""
    local = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local.append(_local(p.grad))
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for g in local:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class TensorParallel(_Distributed):
    """``model`` sharded over ``tp`` ranks, replicated ``dp`` times on a (dp, tp) mesh: tp group i is
    global ranks i*tp .. i*tp+tp-1 and computes rows [i B/dp, (i+1) B/dp) of every batch. ``shard``:
    FSDP2 over the dp dimension instead of all-reducing gradients."""

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

    def compile(self, setting) -> str:
        raise ValueError(
            "TrainConfig.compile with tp > 1 is not supported: the tensor-parallel sublayers run on DTensors, "
            "which this trainer does not compile. Fix: drop --compile, or train with --tp 1"
        )

    def _rows(self, x: Tensor) -> slice:
        n = x.shape[0] // self.dp
        return slice(self.dp_rank * n, (self.dp_rank + 1) * n)

    def _replica_mean(self, value: float) -> float:
        """The mean over dp replicas (every tp rank of a replica holds the same loss)."""
        if self.dp == 1:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=self._device())
        dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp

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
            average_gradients(replicated_parameters(self.model), self.mesh.get_group("tp"), 1)
        if self.dp > 1 and not self.shard:  # FSDP2 reduce-scatters in backward
            average_gradients(list(self.model.parameters()), self.dp_group, self.dp)

    def clip_grad_norm(self, max_norm: float) -> None:
        clip_grad_norm(list(self.model.parameters()), max_norm)

    def end_step(self) -> dict[str, object]:
        if self.dp > 1:  # MoE counts: equal over a tp group (the router is replicated), summed over replicas
            for counter in self.model.step_counters():
                dist.all_reduce(counter, group=self.dp_group)
        return self.model.end_step()

    def gather(self, optimizer):
        state = full_model_state(self.model), named_optimizer_state(optimizer)  # collective over the mesh
        return state if self.is_main else None
