"""AttnResLM's Transformer blocks take and return a DepthState of tensors, so per-block FSDP2 (with its default
reshard_after_forward=True) and per-block checkpoint_wrapper wrap them like any other block and compute what
the plain model computes."""

from __future__ import annotations

import pytest
import torch
from distributed_workers import spawn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from wrapper_workers import (
    fsdp_per_block,
    model_and_batch,
    single_process,
    tensor_parallel,
)

SCHEMES = ["block", "full", "prenorm", "hyper"]


@pytest.mark.parametrize("residual", SCHEMES)
def test_per_block_checkpoint_wrapper_gives_the_same_gradients(residual):
    want = single_process(residual, "attnres_lm")
    model, x, y = model_and_batch(residual, "attnres_lm")
    for i, block in enumerate(model.lm.blocks):
        model.lm.blocks[i] = checkpoint_wrapper(block)
    loss = model(x, y)
    loss.backward()
    torch.testing.assert_close(loss, want["loss"], rtol=0, atol=1e-6)
    for name, p in model.named_parameters():
        key = name.replace("._checkpoint_wrapped_module", "")
        torch.testing.assert_close(p.grad, want["grads"][key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("residual", ["block", "full"])
def test_fully_shard_per_block_on_two_ranks_equals_one_process(residual, tmp_path):
    out = tmp_path / "fsdp.pt"
    spawn(fsdp_per_block, 2, residual, str(out), "attnres_lm")
    got, want = torch.load(out, weights_only=True), single_process(residual, "attnres_lm")
    torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=1e-5)
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("residual", ["block", "full"])
def test_tensor_parallel_on_two_ranks_equals_one_process(residual, tmp_path):
    """The LLaMA blocks' heads and SwiGLU units split over 2 ranks; the depth attention replicated."""
    out = tmp_path / "tp.pt"
    spawn(tensor_parallel, 2, residual, str(out), "attnres_lm")
    got, want = torch.load(out, weights_only=True), single_process(residual, "attnres_lm")
    torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=1e-5)
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=1e-5, msg=name)
