"""Activation checkpointing recomputes exactly: gradients equal the plain path's, for every scheme."""

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.model.checkpointing import segment_layers
from attnres.residual import RESIDUALS


def model_for(residual, impl="two_phase", **extra):
    torch.manual_seed(0)
    sizes = {"vocab_size": 61, "d_model": 16, "n_layers": 3, "n_heads": 2, "max_seq_len": 16, **extra}
    model = AttnResLM(ModelConfig(residual=residual, attnres_impl=impl, **sizes)).double()
    randomize(model.residual, seed=1, scale=0.5)
    return model


def gradients(model, x, mode):
    model.zero_grad()
    model.set_activation_checkpointing(mode)
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# "block" with every scheme and every AttnRes implementation; "sublayer" with the three main schemes
CASES = (
    [(r, "two_phase", "block") for r in sorted(RESIDUALS)]
    + [(r, impl, "block") for r in ("block", "full") for impl in ("fused", "reference")]
    + [(r, "two_phase", "sublayer") for r in ("prenorm", "block", "full")]
)


@pytest.mark.parametrize("residual,impl,mode", CASES)
def test_checkpointed_gradients_equal_the_plain_path_in_float64(residual, impl, mode):
    extra = {"attnres_blocks": 2} if residual == "block" else {}
    model = model_for(residual, impl, **extra)
    x = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    plain = gradients(model, x, "none")
    again = gradients(model, x, mode)
    assert plain.keys() == again.keys() and len(plain) == len(list(model.parameters()))
    for name, g in again.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-12, atol=1e-12, msg=name)


def test_block_checkpointing_under_compile_equals_eager():
    torch._dynamo.reset()
    model = model_for("block", attnres_blocks=2)
    x = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    plain = gradients(model, x, "none")
    model.set_activation_checkpointing("block")
    compiled = torch.compile(model, backend="aot_eager")
    model.zero_grad()
    compiled(x).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "residual,extra,want",
    [
        ("block", {"attnres_blocks": 6}, [[0], [1], [2], [3], [4], [5]]),  # S = 2: one Transformer block each
        ("block", {"attnres_block_size": 4}, [[0, 1], [2, 3], [4, 5]]),
        ("block", {"attnres_block_size": 3}, [[0, 1, 2], [3, 4, 5]]),  # odd S: boundaries every lcm(S, 2)
        ("full", {}, [[i] for i in range(6)]),
        ("prenorm", {}, [[0], [1], [2], [3], [4], [5]]),  # Block's default: S = 2 for L = 12 (6 blocks <= 8)
    ],
)
def test_segments_end_at_depth_block_boundaries(residual, extra, want):
    config = ModelConfig(d_model=16, n_layers=6, n_heads=2, residual=residual, **extra)
    assert [list(r) for r in segment_layers(config)] == want


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"activation_checkpointing='blocks' is invalid: choose one of"):
        model_for("prenorm").set_activation_checkpointing("blocks")
