"""examples/own_gpt.py: a GPT of the user's own with AttnRes. At init it is the plain PreNorm GPT; per-block
FSDP2, per-block activation checkpointing, torch.compile(fullgraph=True) and tensor parallelism wrap its
blocks like any other and compute what one plain process computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed_workers import spawn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from wrapper_workers import (
    BATCH,
    config,
    fsdp_per_block,
    model_and_batch,
    own_gpt,
    single_process,
    tensor_parallel,
)

SCHEMES = ["block", "full"]


def prenorm_logits(model: own_gpt.GPT, idx: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The plain GPT's forward, x = x + f(LayerNorm(x)), written out with the model's own weights and the
    LayerNorms' original eps."""

    def ln(norm, x):
        return torch.nn.functional.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, eps)

    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    for block in model.h:
        x = x + block.attn(ln(block.ln_1, x))
        x = x + block.mlp(ln(block.ln_2, x))
    return model.lm_head(ln(model.ln_f, x))


@pytest.mark.parametrize("residual", SCHEMES)
def test_attnres_gpt_is_the_prenorm_gpt_at_init(residual):
    torch.manual_seed(0)
    model = own_gpt.GPT(config(residual))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    want = prenorm_logits(model, idx)
    torch.testing.assert_close(model(idx), want, rtol=0, atol=1e-6)
    # the eps compensation is what makes it exact: without it the LayerNorms see 1/K of the sum
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = 1e-5
    assert (model(idx) - want).abs().max() > 1e-4


@pytest.mark.parametrize("residual", SCHEMES)
def test_per_block_checkpoint_wrapper_gives_the_same_gradients(residual):
    want = single_process(residual)
    model, x, y = model_and_batch(residual)
    for i, block in enumerate(model.h):
        model.h[i] = checkpoint_wrapper(block)
    loss = model(x, y)
    loss.backward()
    torch.testing.assert_close(loss, want["loss"], rtol=0, atol=1e-6)
    for name, p in model.named_parameters():
        key = name.replace("._checkpoint_wrapped_module", "")
        torch.testing.assert_close(p.grad, want["grads"][key], rtol=0, atol=1e-6, msg=key)


def test_torch_utils_checkpoint_per_block_recomputes_the_same_state():
    """The block is a function of tensors: torch.utils.checkpoint re-runs it in backward."""
    want = single_process("block")
    model, x, y = model_and_batch("block")
    inner = model.h
    model.h = torch.nn.ModuleList()
    h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
    depth = model.residual.start(h)
    for block in inner:
        depth = torch.utils.checkpoint.checkpoint(block, depth, model.residual, use_reentrant=False)
    logits = model.lm_head(model.ln_f(model.residual.finish(depth)))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    torch.testing.assert_close(loss, want["loss"], rtol=0, atol=1e-6)
    model.h = inner
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want["grads"][name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("residual", SCHEMES)
def test_compiles_without_graph_breaks(residual):
    """fullgraph=True: a graph break is an error. aot_eager traces forward and backward as inductor
    would, without its code generation (`pytest -m compile_heavy` runs inductor elsewhere)."""
    torch._dynamo.reset()
    want = single_process(residual)
    model, x, y = model_and_batch(residual)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(x, y)
    loss.backward()
    torch.testing.assert_close(loss, want["loss"], rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want["grads"][name], rtol=1e-5, atol=1e-6, msg=name)


def _compare(got: dict, want: dict, tol: float) -> None:
    torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=tol)
    assert set(got["grads"]) == set(want["grads"])
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=tol, msg=name)


@pytest.mark.parametrize("residual", SCHEMES)
def test_fully_shard_per_block_on_two_ranks_equals_one_process(residual, tmp_path):
    out = tmp_path / "fsdp.pt"
    spawn(fsdp_per_block, 2, residual, str(out))
    _compare(torch.load(out, weights_only=True), single_process(residual), 1e-5)


@pytest.mark.parametrize("residual", SCHEMES)
def test_tensor_parallel_on_two_ranks_equals_one_process(residual, tmp_path):
    out = tmp_path / "tp.pt"
    spawn(tensor_parallel, 2, residual, str(out))
    _compare(torch.load(out, weights_only=True), single_process(residual), 1e-5)


def test_trains_on_the_bundled_corpus():
    result = own_gpt.train(dataclasses.replace(config("block"), vocab_size=256), steps=3, batch_size=BATCH)
    assert result["val_loss"] < 6.0 and result["train_loss"] < 6.0  # ln 256 = 5.55 at chance


def test_param_groups_route_the_attnres_parameters_to_adamw_without_decay():
    model, x, y = model_and_batch("block")
    groups = own_gpt.attnres.param_groups(model, weight_decay=0.1)
    names = {g["kind"]: set(g["names"]) for g in groups}
    attnres_names = {n for n, _ in model.named_parameters() if n.startswith("residual.")}
    assert attnres_names and attnres_names <= names["no_decay"]
    assert "h.0.attn.q_proj.weight" in names["matrix"] and "wte.weight" in names["decay"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    muon = torch.optim.Muon([g for g in groups if g["optimizer"] == "muon"], lr=0.02)
    adamw = torch.optim.AdamW([g for g in groups if g["optimizer"] == "adamw"], lr=1e-3)
    before = model.residual.queries.detach().clone()
    model(x, y).backward()
    muon.step()
    adamw.step()
    assert not torch.equal(model.residual.queries, before)  # the queries learn, through AdamW
