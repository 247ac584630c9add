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
    assert names - set(src.state_dict()) == {"attnres.queries", "attnres.key_norm_weight", "attnres._extra_state"}
    assert isinstance(AutoConfig.from_pretrained(tmp_path), type(model.config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is type(model)
    assert max_logit_difference(model, loaded, ids()) == 0.0
    x = ids()
    assert torch.equal(greedy(loaded, x[:, :PROMPT]), greedy(model, x[:, :PROMPT]))


def _randomized(model, seed: int = 1):
    """Queries and key norms away from their initialisation, so that a round trip tests them for real."""
    with torch.no_grad():
        for p in model.attnres.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed), dtype=p.dtype) * 0.5)
    return model


def assert_reloads_exactly(model, directory):
    """AutoModelForCausalLM.from_pretrained(directory) computes what ``model`` computes: logits to 1e-5
    and the same greedy tokens through the KV cache."""
    loaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert type(loaded) is type(model)
    x = ids()
    assert max_logit_difference(model, loaded, x) <= 1e-5
    assert torch.equal(greedy(loaded, x[:, :PROMPT]), greedy(model, x[:, :PROMPT]))
    return loaded


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_round_trips_through_save_pretrained(case, tmp_path):
    """The contract of a saved retrofit: it reloads as the model that was saved. transformers converts some
    families' weights between checkpoint and modules by the source's class name or model_type (MoE experts
    stacked on load, split on save; GPT-NeoX's head embed_out <-> lm_head); the retrofit saves its modules'
    own names, so that nothing needs converting back and nothing reloads freshly drawn."""
    model = _randomized(retrofit(source(case), "block", attnres_blocks=2, **retrofit_options(case)))
    model.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    state = model.state_dict()
    pointers = [t.data_ptr() for t in state.values()]
    tied = {k for k, t in state.items() if pointers.count(t.data_ptr()) > 1}  # a tied head is stored once
    assert names <= set(state) and set(state) - names <= tied  # every module's weight under its own name
    assert_reloads_exactly(model, tmp_path)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "gpt_neox"])
def test_convert_cli_round_trips_moe_and_gpt_neox(case, tmp_path, capsys):
    """`attnres convert SRC OUT --residual block` on a directory saved by transformers (MoE experts split per
    expert, GPT-NeoX's head as embed_out: what a downloaded checkpoint holds) reloads exactly."""
    from attnres.cli import main

    source(case).save_pretrained(tmp_path / "src")
    stored = set(load_file(tmp_path / "src" / "model.safetensors"))
    assert any(".experts.0." in k or k.startswith("embed_out.") for k in stored)  # the layouts at stake
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--residual", "block"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out
    expected = retrofit(tmp_path / "src", "block")  # zero queries: what convert wrote, built here
    loaded = assert_reloads_exactly(expected, tmp_path / "out")
    assert max_logit_difference(source(case), loaded, ids()) <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_round_trips_through_the_convert_cli(case, tmp_path, capsys):
    """The same contract through `attnres convert SRC OUT`, from the directory transformers saves (the
    layout a downloaded checkpoint has), for every family the retrofit claims."""
    from attnres.cli import main

    source(case).save_pretrained(tmp_path / "src")
    options = retrofit_options(case)
    flags = [a for key, value in options.items() for a in ("--set", f"{key}={value}")]
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--residual", "block", *flags]) == 0
    assert f"family {CASES[case][0]}, wrapped layout" in capsys.readouterr().out
    expected = retrofit(tmp_path / "src", "block", **options)  # zero queries: what convert wrote, built here
    loaded = assert_reloads_exactly(expected, tmp_path / "out")
    assert max_logit_difference(source(case), loaded, ids()) <= TOL


def _doctored(tmp_path, change):
    """A saved Llama retrofit whose weight file ``change`` edits in place."""
    from safetensors.torch import save_file

    _randomized(retrofit(source("llama"), "block", attnres_blocks=2)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("attnres.queries"), r"1 missing .*: attnres\.queries\."),
        (lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2)}), r"1 unexpected .*layers\.7\.mlp"),
        (lambda t: t.update({"attnres.queries": torch.zeros(2, 3)}), r"1 of another shape .*: attnres\.queries\."),
    ],
    ids=["missing", "unexpected", "mismatched"],
)
def test_loading_a_checkpoint_that_does_not_match_is_an_error_naming_the_keys(tmp_path, change, message):
    directory = _doctored(tmp_path, change)
    for load in (AutoModelForCausalLM.from_pretrained, type(retrofit(source("llama"), "full")).from_pretrained):
        with pytest.raises(ConversionError, match=message):
            load(directory)


def test_a_checkpoint_in_the_source_layout_is_refused_not_reloaded_at_random(tmp_path):
    """What save_pretrained wrote before it kept the modules' names (the experts split per expert, as the
    source family's own checkpoints are) reloaded with the experts freshly drawn; now it names them."""
    from transformers import PreTrainedModel

    model = retrofit(source("qwen3_moe"), "block", attnres_blocks=2)
    PreTrainedModel.save_pretrained(model, tmp_path)  # transformers' own save: the source's layout
    assert any(".experts.0." in k for k in load_file(tmp_path / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"missing .*mlp\.experts\.(down|gate_up)_proj.*unexpected"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ConversionError, match="save_original_format=True"):
        model.save_pretrained(tmp_path / "again", save_original_format=True)


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


def test_rescale_reads_is_read_strictly(tmp_path, capsys):
    """bool("no") is True: `--set rescale_reads=no` turned rescaling on."""
    from attnres.cli import main

    src = source("olmo2")
    for off in (False, "no", "false", "0", 0):  # off: OLMo-2 is refused (its sublayers read un-normalised)
        with pytest.raises(ConversionError, match=r"olmo2 exactly.*rescale_reads=True"):
            retrofit(src, "block", rescale_reads=off)
    for on in (True, "yes", "TRUE", 1):
        assert retrofit(src, "block", rescale_reads=on).config.attnres_retrofit["rescale_reads"] is True
    for bad in ("maybe", "", 2, None):
        with pytest.raises(ConversionError, match=r"rescale_reads=.* is invalid: use true or false"):
            retrofit(src, "block", rescale_reads=bad)
    src.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--set", "rescale_reads=no"]) == 2
    assert "cannot retrofit olmo2 exactly" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--set", "rescale_reads=nah"]) == 2
    assert "rescale_reads='nah' is invalid" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--set", "rescale_reads=yes"]) == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_attention_heads=5), r"not a multiple of the number of attention heads"),
        (dict(num_hidden_layers="3"), "expected int"),
    ],
    ids=["heads", "layers-as-text"],
)
def test_a_saved_retrofit_with_an_invalid_config_is_one_error(tmp_path, changes, message):
    retrofit(source("llama"), "block").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConversionError, match=f"config.json is invalid: .*{message}"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
