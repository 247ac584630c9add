"""The LLaMA-style decoder (attnres/model/llama.py) around any residual scheme: causality, parameter
kinds for the optimizer, input checks, and the shared initialisation that paired comparisons need."""
import pytest
import torch

from attnres.residual import RESIDUALS
from reference import randomize


@pytest.mark.parametrize("residual", sorted(RESIDUALS))
def test_causality(residual, make, tokens):
    """Changing token t changes the logits at t and never those before it, for every scheme (with its
    depth parameters moved off their initialisation so that every path carries signal)."""
    model = make(residual)
    randomize(model.residual)
    x = tokens(t=9)
    base = model(x)
    for t in (0, 4, 8):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % model.config.vocab_size
        out = model(y)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert (out[:, t] - base[:, t]).abs().max() > 0


def test_param_kinds_cover_every_parameter(make):
    for residual in ("prenorm", "block"):
        for tie in (False, True):
            model = make(residual, tie_embeddings=tie)
            kinds = model.param_kinds()
            assert set(kinds) == {n for n, _ in model.named_parameters()}
            assert all(kinds[n] == "no_decay" for n in kinds if n.startswith("residual."))
            assert all(kinds[n] == "no_decay" for n in kinds if "norm" in n)
            assert kinds["embed.weight"] == "embedding"
            assert ("lm_head.weight" in kinds) != tie
            assert kinds["blocks.0.attn.q_proj.weight"] == "matrix"


def test_sequence_longer_than_max_seq_len_is_a_clear_error(make, tokens):
    with pytest.raises(ValueError, match="max_seq_len=16"):
        make("block")(tokens(t=17))


def test_every_scheme_gets_the_same_sublayer_weights_for_one_seed(make):
    """Paired comparisons across schemes need the same init: the scheme's own draws must not shift it."""
    base = {k: v for k, v in make("prenorm").state_dict().items()}
    for residual in RESIDUALS:
        extra = {"highway_rank": 4} if residual == "highway" else {}
        state = make(residual, **extra).state_dict()
        for name, value in base.items():
            assert torch.equal(state[name], value), (residual, name)
