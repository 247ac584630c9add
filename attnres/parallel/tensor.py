"""How tensor parallelism (``attnres train --tp N``) splits a model; ``TensorParallel`` and
``PipelineParallel`` in ``attnres.parallel.runtime`` run it on a (dp, tp) or (dp, pp, tp) device mesh.

What is sharded over the ``tp`` ranks (``torch.distributed.tensor.parallel.parallelize_module``):

Each backbone declares its plan (``attnres.model.backbones.BACKBONES[name].tensor_plan``):

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

Checkpoints stay in the single-process format (``attnres.parallel.state`` gathers and re-shards DTensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnres.model.backbones import BACKBONES
from attnres.model.lm import AttnResLM
from attnres.parallel.state import full_tensor, local_shard


def check_tensor_parallel(config, tp: int, sequence_parallel: bool = False) -> None:
    """The widths ``tp`` ranks split must divide evenly (the backbone's ``TensorPlan.widths``: heads of
    LLaMA attention, MLP hidden units); sequence parallelism needs a plan that splits every sublayer
    (LLaMA's) and an untied head. Raises a ValueError naming the
    field, its value and the fix."""
    if tp == 1:
        return
    plan = BACKBONES[config.backbone].tensor_plan
    if sequence_parallel and not plan.whole_sublayers:
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
    split: list[tuple[str, int | None, int | None]] = plan.widths(config)
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
    tokens each, and ``TensorParallel.reduce_gradients`` (``attnres.parallel.runtime``) sums their
    gradients over tp."""
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
        "colwise": ColwiseParallel,
        "rowwise": lambda: RowwiseParallel(output_layouts=stream),
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
        block_plan = BACKBONES[model.config.backbone].tensor_plan.block
        splits = {k: styles[how]() for k, how in block_plan.items() if k in names}
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


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a mix of DTensor (sharded) and plain (replicated)
    gradients, which torch's foreach norm refuses to mix: each DTensor's norm is its global one."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [full_tensor(torch.linalg.vector_norm(g)) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local_shard(g).mul_(coef)
    return total
