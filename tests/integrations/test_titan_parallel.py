"""attnres' torchtitan parallelize function on 2 (or 4) gloo ranks equals one process: tensor parallel (the
plan of attnres.integrations.torchtitan.parallelize, AttnRes parameters replicated) and FSDP2 over
data-parallel ranks, with activation checkpointing and compile, within 1e-5 (float32)."""

import importlib.util
import os
import sys

import pytest
import torch

pytest.importorskip("torchtitan")

sys.path.insert(0, os.path.dirname(__file__))  # the spawned workers import titan_workers by name

import titan_workers
from distributed_workers import spawn

KIMI = dict(backbone="kimi_linear", n_heads=2, moe_experts=4, moe_top_k=2)


def reference(residual, options=None):
    from attnres.model import AttnResLM
    from attnres.model.llama import lm_loss

    model = AttnResLM(titan_workers.model_config(residual, options))
    model.load_state_dict(titan_workers.reference_state(residual, options))
    x, y = titan_workers.batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "case",
    [
        dict(residual="block", tp=2, ac=True, compile=None),
        dict(residual="full", tp=2, ac=False, compile=None),
        # 4 processes: mesh (fsdp 2, tp 2), FSDP2 over the tp-replicated parameters as well
        dict(residual="block", tp=2, ac=True, compile=None, world=4),
        # several processes compiling (aot_eager): the repo's compile_heavy set, `pytest -m compile_heavy`
        pytest.param(dict(residual="block", tp=1, ac=True, compile="aot_eager"), marks=pytest.mark.compile_heavy),
        dict(residual="mhc", tp=1, ac=False, compile=None),
        pytest.param(
            dict(residual="block", tp=1, ac=True, compile=None, options=KIMI),
            marks=pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
        ),
    ],
    ids=[
        "tp2-block-ac",
        "tp2-full",
        "fsdp2-tp2-block-ac",
        "fsdp2-block-ac-compile",
        "fsdp2-mhc",
        "fsdp2-kimi_linear-block-ac",
    ],
)
def test_two_ranks_equal_one_process(tmp_path, case):
    state = titan_workers.reference_state(case["residual"], case.get("options"))
    out = tmp_path / "rank0.pt"
    spawn(titan_workers.titan_case, case.get("world", 2), {**case, "state": state}, str(out))
    got = torch.load(out)
    want_loss, want_grads = reference(case["residual"], case.get("options"))
    grad_difference = max((got["grads"][n] - g).abs().max().item() for n, g in want_grads.items())
    # docs/distributed.md quotes these (pytest -s prints them)
    loss_difference = abs(got["loss"] - want_loss)
    print(f"{case}: loss difference {loss_difference:.1e}, largest gradient difference {grad_difference:.1e}")
    assert abs(got["loss"] - want_loss) <= 1e-5
    assert got["grads"].keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5, msg=name)
    # what was sharded: the projections over both ranks (tensor parallel: by heads, with FSDP2 by
    # rows); the AttnRes pseudo-queries only by FSDP2, Replicate DTensors on the tp axis of the same
    # mesh (torchtitan's gradient clipping wants every parameter on one mesh)
    if case["tp"] == 2:  # mesh (fsdp, tp)
        assert got["placements"]["blocks.0.attn.q_proj.weight"].endswith(", Shard(dim=0))")
        assert got["placements"]["residual.queries"] == "(Shard(dim=0), Replicate())"
    else:
        assert got["placements"]["blocks.0.attn.q_proj.weight"] == "(Shard(dim=0),)"
    # the AttnRes parameters took part: their gradients are not zero
    assert any(want_grads[n].abs().sum() > 0 for n in want_grads if n.startswith("residual."))
