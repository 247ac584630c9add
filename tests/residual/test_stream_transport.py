"""stream.export() / scheme.resume(): a stream handed over between any two Transformer blocks (as a
pipeline stage boundary does) computes exactly what the uninterrupted stream computes."""

import pytest
import torch
from reference import randomize

from attnres import AttnResLM, ModelConfig
from attnres.model.llama import output_logits, run_blocks
from attnres.residual import RESIDUALS, DepthState


def model(residual):
    torch.manual_seed(0)
    options = {"attnres_block_size": 3} if residual == "block" else {}  # boundaries inside depth blocks
    m = AttnResLM(
        ModelConfig(vocab_size=40, d_model=16, n_layers=4, n_heads=2, max_seq_len=8, residual=residual, **options)
    ).double()
    randomize(m.residual)
    return m


@pytest.mark.parametrize("residual", sorted(RESIDUALS))
def test_handover_at_every_block_boundary_is_exact(residual):
    m = model(residual)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(3))
    want = m(ids)
    cos, sin = m.rope_cos[:8], m.rope_sin[:8]
    depth = m.residual.start(m.embed(ids))
    for i, block in enumerate(m.blocks):
        depth = run_blocks(depth, m.residual, [(i, block)], cos, sin)
        history, state = depth.history, depth.state
        # what a receiving stage sees: fresh leaves with the same values
        history = [t.detach().clone() for t in history]
        state = [t.detach().clone() for t in state]
        depth = DepthState(2 * (i + 1), tuple(history), tuple(state))
    got = output_logits(m.norm, m.lm_head, m.residual.finish(depth))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_export_between_read_and_write_is_refused():
    m = model("block")
    stream = m.residual.begin(m.embed(torch.zeros(1, 4, dtype=torch.long)))
    stream.read(0)
    with pytest.raises(RuntimeError, match="between read"):
        stream.export()
