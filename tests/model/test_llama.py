"""The LLaMA-style decoder (attnres/model/llama.py) around any residual scheme: causality, parameter
kinds for the optimizer, input checks, and the shared initialisation that paired comparisons need."""

import pytest
import torch
from reference import randomize

from attnres.residual import RESIDUALS


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
    base = dict(make("prenorm").state_dict().items())
    for residual in RESIDUALS:
        extra = {"highway_rank": 4} if residual == "highway" else {}
        state = make(residual, **extra).state_dict()
        for name, value in base.items():
            if name.startswith("residual."):  # the scheme's own state (its settings record included)
                continue
            assert torch.equal(state[name], value), (residual, name)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("residual", sorted(RESIDUALS))
def test_padded_rows_equal_each_prompt_run_alone(residual, side, make, pad):
    """Full forward with an attention mask: every real position of a padded row has the logits of its
    prompt run alone (float64, every scheme, padding on either side)."""
    model = make(residual)
    randomize(model.residual)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (n,), generator=g) for n in (5, 9, 2)]
    ids, mask = pad(prompts, pad_id=7, side=side)
    out = model(ids, attention_mask=mask)
    assert torch.isfinite(out).all()  # padding queries too
    for row, p in enumerate(prompts):
        alone = model(p[None])[0]
        torch.testing.assert_close(out[row][mask[row].bool()], alone, rtol=1e-10, atol=1e-10)
    # an all-ones mask is no mask at all
    assert torch.equal(model(ids, attention_mask=torch.ones_like(ids)), model(ids))


def test_attention_mask_of_the_wrong_shape_is_a_clear_error(make, tokens):
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 6\); expected \(2, 7\)"):
        make("block")(tokens(t=7), attention_mask=torch.ones(2, 6))
