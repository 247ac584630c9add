"""Per-block wrappers under torch.distributed, for examples/own_gpt.py (tests/examples/test_own_gpt.py) and
AttnResLM (tests/model/test_block_wrappers.py); importable by spawned children (tests/ is on sys.path).
Each rank writes its loss and full gradients with torch.save."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import own_gpt

BATCH, SEQ = 4, 16


def config(residual: str) -> own_gpt.GPTConfig:
    options = {"attnres_blocks": 3} if residual == "block" else {}
    return own_gpt.GPTConfig(
        vocab_size=64, block_size=SEQ, n_layer=3, n_head=4, n_embd=32, residual=residual, residual_options=options
    )


def model_and_batch(residual: str, kind: str = "own_gpt") -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The same model and batch in every process: seeded, with random (non-zero) AttnRes queries so that
    the depth weights are not uniform. ``kind``: "own_gpt" (examples/own_gpt.py) or "attnres_lm"."""
    torch.manual_seed(0)
    if kind == "own_gpt":
        model = own_gpt.GPT(config(residual))
    else:
        from attnres import AttnResLM, ModelConfig

        options = {"attnres_blocks": 3} if residual == "block" else {}
        model = LMLoss(
            AttnResLM(
                ModelConfig(
                    vocab_size=64, d_model=32, n_layers=3, n_heads=4, max_seq_len=SEQ, residual=residual, **options
                )
            )
        )
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
    return model, ids[:, :-1], ids[:, 1:]


class LMLoss(torch.nn.Module):
    """AttnResLM with the GPT's call convention: model(x, y) -> mean cross-entropy."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def h(self) -> torch.nn.ModuleList:  # the blocks, under the GPT's name
        return self.lm.blocks

    @property
    def residual(self) -> torch.nn.Module:
        return self.lm.residual

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from attnres.model.llama import lm_loss

        return lm_loss(self.lm(x), y)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a plain full tensor (DTensor shards gathered)."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out[name] = grad.detach().clone()
    return out


def single_process(residual: str, kind: str = "own_gpt") -> dict:
    model, x, y = model_and_batch(residual, kind)
    loss = model(x, y)
    loss.backward()
    return {"loss": loss.detach(), "grads": full_grads(model)}


def fsdp_per_block(rank: int, world: int, residual: str, out: str, kind: str = "own_gpt") -> None:
    """fully_shard on every block (default reshard_after_forward=True) and on the root; each rank runs
    its share of the batch."""
    from torch.distributed.fsdp import fully_shard

    model, x, y = model_and_batch(residual, kind)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    share = BATCH // world
    loss = model(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share])
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    result = {"loss": mean / world, "grads": full_grads(model)}
    if rank == 0:
        torch.save(result, out)


# per-block tensor-parallel plans: attention heads and the MLP's hidden units split over the ranks
TP_PLANS = {
    "own_gpt": {
        "attn.q_proj": "col",
        "attn.k_proj": "col",
        "attn.v_proj": "col",
        "attn.o_proj": "row",
        "mlp.fc": "col",
        "mlp.proj": "row",
    },
    "attnres_lm": {
        "attn.q_proj": "col",
        "attn.k_proj": "col",
        "attn.v_proj": "col",
        "attn.o_proj": "row",
        "mlp.gate_proj": "col",
        "mlp.up_proj": "col",
        "mlp.down_proj": "row",
    },
}


def tensor_parallel(rank: int, world: int, residual: str, out: str, kind: str = "own_gpt") -> None:
    """Attention heads and the MLP split over the ranks (column-wise in, row-wise out); the depth
    attention, the norms and the embeddings replicated. Every rank runs the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    model, x, y = model_and_batch(residual, kind)
    plan = {name: ColwiseParallel() if how == "col" else RowwiseParallel() for name, how in TP_PLANS[kind].items()}
    for block in model.h:
        parallelize_module(block, mesh, plan)
    loss = model(x, y)
    loss.backward()
    result = {"loss": loss.detach(), "grads": full_grads(model)}
    if rank == 0:
        torch.save(result, out)


def tensor_parallel_strategy(
    rank: int, world: int, cases: list[tuple[str, dict | None]], dp: int, out: str, sequence_parallel: bool = False
) -> None:
    """The trainer's TensorParallel layout (attnres.parallel.tensor: blocks, embedding and head sharded,
    optionally the depth state split by position) on a (dp, world/dp) mesh, in float64, for each
    (residual scheme, ModelConfig options): the global-batch loss, the gradients after the reduction,
    gathered whole, the clipped ones, and which parameters were sharded."""
    from contextlib import nullcontext

    from distributed_workers import batch, reference_model

    from attnres.parallel.runtime import TensorParallel
    from attnres.train.optim import build_optimizer

    results = []
    for residual, options in cases:
        model = reference_model(residual, 4, options)
        strategy = TensorParallel(model, nullcontext, tp=world // dp, dp=dp, sequence_parallel=sequence_parallel)
        sharded = sorted(n for n, p in model.named_parameters() if hasattr(p, "device_mesh"))
        # torch's foreach kernels (its default on GPUs) refuse DTensors beside plain tensors
        foreach = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1).optimizers["adamw"].defaults["foreach"]
        positions: list[int] = []  # how many positions of the depth state this rank holds (the final norm's input)
        model.norm.register_forward_hook(partial(_count_positions, positions))
        x, y = batch()
        loss = strategy.forward_backward(x, y, 1.0)
        strategy.reduce_gradients()
        grads = full_grads(model)
        strategy.clip_grad_norm(0.1)  # below every test model's gradient norm: clipping acts
        clipped = full_grads(model)
        results.append(
            dict(loss=loss, grads=grads, clipped=clipped, sharded=sharded, positions=positions, foreach=foreach)
        )
    if rank == 0:
        torch.save(results, out)


def _count_positions(positions: list[int], module, inputs, output) -> None:
    positions.append(inputs[0].shape[1])


def pipeline_tensor_parallel(rank: int, world: int, residual: str, out_dir: str) -> None:
    """The trainer's PipelineParallel layout on a (pp 2, tp world/2) mesh in float64: each rank writes the
    loss, its stage's gradients (gathered over tp) before and after clipping, and which were sharded."""
    from contextlib import nullcontext

    from distributed_workers import BATCH, SEQ, batch, reference_model

    from attnres.parallel.runtime import PipelineParallel

    model = reference_model(residual, 4)
    strategy = PipelineParallel(
        model, nullcontext, pp=2, vpp=1, schedule="1F1B", microbatches=2, batch_size=BATCH, seq_len=SEQ, tp=world // 2
    )
    sharded = sorted(n for n, p in strategy.model.named_parameters() if hasattr(p, "device_mesh"))
    x, y = batch()
    loss = strategy.forward_backward(x, y, 1.0)
    strategy.reduce_gradients()
    grads = full_grads(strategy.model)
    strategy.clip_grad_norm(0.1)  # below every test model's gradient norm: clipping acts
    clipped = full_grads(strategy.model)
    result = {"loss": loss, "grads": grads, "clipped": clipped, "sharded": sharded}
    torch.save(result, f"{out_dir}/rank{rank}.pt")
