"""On a CUDA machine: whole Block and Full AttnRes models through the default (Triton) path against a float64 CPU
reference, under bf16 autocast, and a compiled training step against the eager one. Skipped without a GPU
(scripts/gpu_check.sh runs them on one)."""

from __future__ import annotations

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")

SCHEMES = {"block": {"attnres_blocks": 4}, "full": {}}


def model(residual: str) -> AttnResLM:
    torch.manual_seed(0)
    m = AttnResLM(
        ModelConfig(
            vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=256, residual=residual, **SCHEMES[residual]
        )
    )
    randomize(m.residual)  # non-uniform depth weights
    return m


def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("residual", sorted(SCHEMES))
def test_whole_model_on_the_gpu_path_matches_the_float64_reference(residual):
    m = model(residual)
    want = m.double()(ids()).float()
    got = m.float().cuda()(ids().cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        half = m(ids().cuda()).float().cpu()
    assert (half - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("residual", sorted(SCHEMES))
def test_compiled_training_step_equals_eager_on_the_gpu(residual):
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        m = model(residual).cuda()
        step = torch.compile(m) if compiled else m
        loss = torch.nn.functional.cross_entropy(step(ids().cuda()).flatten(0, 1), ids().cuda().flatten())
        loss.backward()
        results.append((loss.item(), {n: p.grad.detach().cpu() for n, p in m.named_parameters()}))
    (eager_loss, eager), (compiled_loss, compiled) = results
    assert abs(eager_loss - compiled_loss) < 1e-4
    for name, g in eager.items():
        torch.testing.assert_close(compiled[name], g, rtol=1e-3, atol=1e-4, msg=name)
