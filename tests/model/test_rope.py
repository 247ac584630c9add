"""The rotary tables: built for the first positions with the model, grown when an input first reaches
further, so that a long max_seq_len (a long-context config) costs nothing until it is used, and every
way of running the model reads the same rows."""

import pytest
import torch
from reference import randomize

import attnres.model.lm
from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache
from attnres.model.llama import rope_tables


def small_tables(monkeypatch, rows=8):
    monkeypatch.setattr(attnres.model.lm, "ROPE_PREBUILT", rows)


def model(max_seq_len, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=3, n_heads=2, max_seq_len=max_seq_len, **overrides)
    m = AttnResLM(cfg).double().eval()
    randomize(m.residual, seed=seed + 1, scale=0.3)
    return m


def test_a_billion_positions_builds_no_billion_row_table(tokens):
    m = model(10**9, residual="block")
    assert m.rope_cos.shape == m.rope_sin.shape == (attnres.model.lm.ROPE_PREBUILT, m.config.rope_dim)
    assert m(tokens(t=5)).shape == (2, 5, 50)  # and it runs
    assert m.rope_cos.shape[0] == attnres.model.lm.ROPE_PREBUILT


def test_grown_tables_are_the_full_tables(monkeypatch):
    small_tables(monkeypatch)
    m = model(40, residual="full")
    assert m.rope_cos.shape[0] == 8
    cos, sin = m.rope(21)  # doubling would give 16: grown to what is asked
    assert cos.shape[0] == 21 and m.rope_cos.shape[0] == 21
    m.rope(23)
    assert m.rope_cos.shape[0] == 40  # doubled, capped at max_seq_len
    full_cos, full_sin = rope_tables(m.config.rope_dim, 40, m.config.rope_theta)
    torch.testing.assert_close(m.rope_cos, full_cos.double(), rtol=0, atol=1e-7)
    torch.testing.assert_close(m.rope_sin, full_sin.double(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("residual", ["prenorm", "block"])
def test_forward_past_the_prebuilt_rows_equals_a_model_with_them_prebuilt(monkeypatch, residual):
    x = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(0))
    whole = model(32, residual=residual)(x)
    small_tables(monkeypatch)
    grown = model(32, residual=residual)
    torch.testing.assert_close(grown(x), whole, rtol=0, atol=1e-12)


def test_decoding_past_the_prebuilt_rows_equals_the_full_forward(monkeypatch):
    """Token by token from position 3 to 29: the table grows twice during decoding, and every step reads
    the rows the full forward read."""
    small_tables(monkeypatch, rows=4)
    m = model(32, residual="block")
    x = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = KVCache.for_model(m, batch_size=2)
        steps = [m(x[:, :3], cache=cache)] + [m(x[:, i : i + 1], cache=cache) for i in range(3, 30)]
        full = model(32, residual="block")(x)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


def test_compiled_forward_grows_the_tables_without_a_graph_break(monkeypatch):
    small_tables(monkeypatch)
    eager = model(32, residual="block")
    compiled = model(32, residual="block")
    compiled.compile(backend="aot_eager", fullgraph=True)
    x = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=1e-12)
    assert compiled.rope_cos.shape[0] == 20


def test_a_hugging_face_config_of_a_billion_positions_builds_cheaply():
    """max_position_embeddings becomes max_seq_len: the HF model's tables (recomputed at init) are the
    rows built so far, not a billion."""
    pytest.importorskip("transformers")
    from attnres.hf.configuration import AttnResConfig
    from attnres.hf.modeling import AttnResForCausalLM

    cfg = AttnResConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=10**9
    )
    lm = AttnResForCausalLM(cfg).model
    assert lm.config.max_seq_len == 10**9 and lm.rope_cos.shape[0] == attnres.model.lm.ROPE_PREBUILT
    full_cos, _ = rope_tables(lm.config.rope_dim, attnres.model.lm.ROPE_PREBUILT, lm.config.rope_theta)
    torch.testing.assert_close(lm.rope_cos, full_cos, rtol=0, atol=0)
