"""The retrofit wrapper (attnres.hf.retrofit): every family wrapped is exact at init, generates as the source
does (KV cache, beyond the sliding window, past the context, padded batches, beams), saves under the source's
weight names and loads back through the Auto classes; what it cannot keep exact is refused with the fix."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from retrofit_families import CASES, VOCAB, WINDOW, retrofit_options, tiny_model
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import attnres.hf  # noqa: F401  (registers the Auto classes)
from attnres.hf import ConversionError
from attnres.hf.retrofit import (
    FAMILIES,
    MODEL_TYPE,
    family_of,
    max_logit_difference,
    retrofit,
)

TOL = 1e-4
PROMPT, NEW = 5, 7  # 12 tokens: past the sliding window of WINDOW = 8


@functools.cache
def source(case: str, dtype: torch.dtype = torch.float32):
    return tiny_model(case, dtype=dtype)


def ids(length: int = 20, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt: torch.Tensor, new: int = NEW, **kw) -> torch.Tensor:
    mask = kw.pop("attention_mask", torch.ones_like(prompt))
    return model.generate(prompt, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=True, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_is_exact_at_init_block_and_full(case):
    """float32, 20 tokens (past the sliding window), greedy decoding through the KV cache."""
    src = source(case)
    x = ids()
    expected = greedy(src, x[:, :PROMPT])
    for residual, kw in (("block", dict(attnres_blocks=2)), ("full", {})):
        model = retrofit(src, residual, **kw, **retrofit_options(case))
        assert family_of(model) == CASES[case][0]
        assert max_logit_difference(src, model, x) <= TOL, (case, residual)
        assert torch.equal(greedy(model, x[:, :PROMPT]), expected), (case, residual)


# transformers' RMSNorms compute in float32 whatever the input dtype, so float64 is exact to float32
# rounding of the norms there; GPT-NeoX's nn.LayerNorm computes in float64
@pytest.mark.parametrize("case, tol", [("llama3", 1e-6), ("gemma2", 1e-6), ("olmo2", 1e-6), ("gpt_neox", 1e-12)])
def test_float64(case, tol):
    src = source(case, torch.float64)
    model = retrofit(src, "block", attnres_blocks=3, **retrofit_options(case))
    assert model.dtype == torch.float64
    assert max_logit_difference(src, model, ids()) < tol


def test_the_queries_act_and_train():
    src = source("llama3")
    model = retrofit(src, "full")
    x = ids()
    with torch.no_grad():
        model.attnres.queries.normal_()
    assert max_logit_difference(src, model, x) > 1e-2  # the depth stream is really in the loop
    model.train()
    model(x, labels=x).loss.backward()
    assert model.attnres.queries.grad.abs().sum() > 0
    assert all(p.grad is None or p.grad.abs().sum() > 0 for p in model.parameters())
    # the source was copied, not changed
    assert src.model.layers[0].input_layernorm.variance_epsilon == src.config.rms_norm_eps


def test_shared_weights_and_prenorm():
    src = source("qwen2")
    model = retrofit(src, "prenorm", copy_weights=False)
    assert model.model.embed_tokens.weight is src.model.embed_tokens.weight
    assert max_logit_difference(src, model, ids()) <= TOL
    assert retrofit(src, "block").model.embed_tokens.weight is not src.model.embed_tokens.weight


@pytest.mark.parametrize("case", ["llama_tied", "gemma3_text"])
def test_save_keeps_source_names_and_loads_back(case, tmp_path):
    src = source(case)
    model = retrofit(src, "block", attnres_blocks=2)
    with torch.no_grad():
        model.attnres.queries.normal_()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE and config["attnres_retrofit"]["source_model_type"] == CASES[case][0]
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names - set(src.state_dict()) == {"attnres.queries", "attnres.key_norm_weight"}
    assert isinstance(AutoConfig.from_pretrained(tmp_path), type(model.config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is type(model)
    assert max_logit_difference(model, loaded, ids()) == 0.0
    x = ids()
    assert torch.equal(greedy(loaded, x[:, :PROMPT]), greedy(model, x[:, :PROMPT]))


def test_a_directory_source(tmp_path):
    src = source("mistral_window")
    src.save_pretrained(tmp_path / "src")
    model = retrofit(tmp_path / "src", "full")
    assert max_logit_difference(src, model, ids(3 * WINDOW)) <= TOL


# ----------------------------------------------------------------------------- generation parity


@pytest.mark.parametrize("case", ["llama", "mistral_window"])
def test_generation_past_the_context_is_the_sources(case):
    src = source(case)
    model = retrofit(src, "block", attnres_blocks=2)
    prompt = ids(src.config.max_position_embeddings - 4, batch=1)
    out = greedy(model, prompt, new=10)
    assert out.shape[1] == src.config.max_position_embeddings + 6  # no silent crop
    assert torch.equal(out, greedy(src, prompt, new=10))


@pytest.mark.parametrize("case", ["llama3", "gemma2", "gpt2"])
def test_padded_batches_and_beam_search(case):
    src = source(case)
    model = retrofit(src, "full")
    prompt = ids(6, batch=3)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    prompt = prompt.masked_fill(mask == 0, src.config.pad_token_id)
    padded = greedy(model, prompt, attention_mask=mask)
    assert torch.equal(padded, greedy(src, prompt, attention_mask=mask))
    alone = greedy(model, prompt[:1, 3:])  # row 0 alone, unpadded
    assert torch.equal(padded[0, 3:], alone[0])
    beams = greedy(model, prompt, attention_mask=mask, num_beams=3)
    assert torch.equal(beams, greedy(src, prompt, attention_mask=mask, num_beams=3))


# ----------------------------------------------------------------------------- refusals


def test_unnormalised_sublayers_are_refused_with_the_exact_alternative():
    with pytest.raises(ConversionError, match=r"olmo2 exactly.*un-normalised.*rescale_reads=True"):
        retrofit(source("olmo2"), "block")
    assert max_logit_difference(source("olmo2"), retrofit(source("olmo2"), "prenorm"), ids()) <= TOL


def test_refusals_name_the_problem():
    src = source("llama")
    with pytest.raises(ConversionError, match=r"residual='hyper'"):
        retrofit(src, "hyper")
    with pytest.raises(ConversionError, match=r"attnres_window drops sources"):
        retrofit(src, "full", attnres_window=2)
    with pytest.raises(ConversionError, match=r"already retrofitted"):
        retrofit(retrofit(src, "full"), "full")
    with pytest.raises(ConversionError, match=r"bare decoder"):
        retrofit(src.model, "full")
    with pytest.raises(ConversionError, match=r"cannot build the residual scheme.*attnres_blocks"):
        retrofit(src, "block", attnres_blocks=4)  # 6 sublayers cannot form 4 blocks
    for enable in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        with pytest.raises(NotImplementedError, match="gradient checkpointing"):
            getattr(retrofit(src, "full"), enable)()
    kimi = type("KimiConfig", (), {"model_type": "kimi_linear"})()
    fake = torch.nn.Linear(1, 1)
    fake.config = kimi
    with pytest.raises(ConversionError, match=r"kimi_linear.*attnres.hf.kimi"):
        retrofit(fake, "block")


def test_every_family_has_a_case():
    assert {model_type for model_type, _, _ in CASES.values()} == set(FAMILIES)
