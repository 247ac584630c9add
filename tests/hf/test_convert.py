"""Retrofitting LLaMA / Mistral / Qwen2 into our own AttnRes model (the native layout): equal logits at
conversion, clear rejections.

Tiny random models are built locally from transformers configs (nothing is downloaded). A
zero-query conversion differs from its source only through RMSNorm eps (eps acts as K^2 eps when
a norm reads the mean of K sources): tests either use a negligible eps, or undo that effect with
``compensate_eps`` to show it is the only difference.
"""

import functools
import json

import pytest
import torch
from hf_sources import SMALL, compensate_eps, source_counts, tiny_source

import attnres.hf
from attnres.hf import AttnResForCausalLM, ConversionError
from attnres.hf.convert import conversion_error

# this file tests the native layout (our own AttnResForCausalLM); the wrapped one: tests/hf/test_retrofit.py
convert_to_attnres = functools.partial(attnres.hf.convert_to_attnres, layout="native")

ARCHS = ("llama", "mistral", "qwen2")
# float32: rounding; float64: transformers computes RMSNorm and the RoPE tables in float32 even in
# a float64 model, which limits the agreement with the source to ~1e-7
TOL = {torch.float32: 1e-5, torch.float64: 3e-7}


def ids(n=2, t=32, vocab=SMALL["vocab_size"], seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_err(a, b, x):
    return (a(x).logits.double() - b(x).logits.double()).abs().max().item()


# ----------------------------------------------------------------------------- equality


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("residual,blocks", [("block", 2), ("block", None), ("full", None)])
@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_keeps_logits(arch, residual, blocks, dtype):
    # eps negligible against the hidden states: the conversion is exact up to rounding
    source = tiny_source(arch, seed=ARCHS.index(arch), rms_norm_eps=1e-12).to(dtype)
    model = convert_to_attnres(source, residual=residual, attnres_blocks=blocks)
    assert isinstance(model, AttnResForCausalLM) and model.dtype == dtype
    assert model.config.residual == residual and model.config.n_kv_heads == 2
    assert torch.count_nonzero(model.model.residual.queries) == 0
    assert max_err(source, model, ids()) < TOL[dtype]
    # the default eps too: the conversion scales each norm's eps by 1 / K^2 (attnres_scale_norm_eps)
    source = tiny_source(arch, seed=ARCHS.index(arch)).to(dtype)
    model = convert_to_attnres(source, residual=residual, attnres_blocks=blocks)
    assert model.config.attnres_scale_norm_eps
    assert max_err(source, model, ids()) < TOL[dtype]


@pytest.mark.parametrize("residual", ["block", "full"])
def test_eps_is_the_only_difference(residual):
    """float64 against our own PreNorm conversion (no transformers float32 internals)."""
    source = tiny_source("llama").double()
    prenorm = convert_to_attnres(source, residual="prenorm")
    model = convert_to_attnres(source, residual=residual, attnres_scale_norm_eps=False)
    x = ids()
    plain = max_err(prenorm, model, x)
    assert plain > 1e-4  # eps 1e-6 against hidden states of RMS ~0.02: the K^2 eps effect shows
    assert max_err(prenorm, compensate_eps(model), x) < 1e-12
    assert max_err(prenorm, convert_to_attnres(source, residual=residual), x) < 1e-12  # the default
    counts = source_counts(model.model.config)
    assert counts[0] == 1 and max(counts) > 1  # the first sublayer reads the embedding alone


def test_prenorm_conversion_and_options():
    source = tiny_source("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    x = ids()
    assert max_err(source, convert_to_attnres(source, residual="prenorm"), x) < TOL[torch.float32]
    model = convert_to_attnres(
        source, residual="block", attnres_block_size=3, max_seq_len=32, attnres_impl="fused", attnres_heads=2
    )
    assert (model.config.rope_theta, model.config.max_seq_len, model.config.model_config().block_size) == (
        500000.0,
        32,
        3,
    )
    assert max_err(source, compensate_eps(model), x) < TOL[torch.float32]


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_tied_embeddings_and_attention_heads(kv_heads):
    source = tiny_source("llama", tie_word_embeddings=True, num_key_value_heads=kv_heads, rms_norm_eps=1e-12)
    assert source.lm_head.weight is source.model.embed_tokens.weight
    model = convert_to_attnres(source, residual="full")
    assert model.config.tie_embeddings and model.model.lm_head.weight is model.model.embed.weight
    assert model.config.n_kv_heads == kv_heads
    assert max_err(source, model, ids()) < TOL[torch.float32]


def test_directory_source_sharded_and_copies(tmp_path):
    source = tiny_source("qwen2")
    source.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    from_dir = convert_to_attnres(tmp_path, residual="block", attnres_blocks=3)
    from_obj = convert_to_attnres(source, residual="block", attnres_blocks=3)
    x = ids()
    assert max_err(from_dir, from_obj, x) == 0.0
    # by default the result owns its weights: training it leaves the source alone
    before = source.model.embed_tokens.weight.clone()
    with torch.no_grad():
        from_obj.model.embed.weight.add_(1.0)
    assert torch.equal(source.model.embed_tokens.weight, before)
    assert conversion_error(source, from_dir, x) == max_err(source, from_dir, x)


def test_converted_model_round_trips_and_keeps_special_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_source("llama", bos_token_id=1, eos_token_id=2)
    source.generation_config.update(do_sample=True, top_k=7)
    model = convert_to_attnres(source)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)
    assert model.generation_config.top_k == 7 and model.generation_config is not source.generation_config
    model.save_pretrained(tmp_path / "a")
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert max_err(model, loaded, ids()) == 0.0
    source.save_pretrained(tmp_path / "src")
    assert convert_to_attnres(tmp_path / "src").generation_config.top_k == 7


# ----------------------------------------------------------------------------- rejections


def test_qwen3_qk_norm_is_rejected_by_the_native_layout_and_wrapped_by_default():
    qwen3 = tiny_source("qwen3", head_dim=16)
    with pytest.raises(ConversionError, match=r"QK-norm.*model_type='qwen3'.*layout='wrapped'"):
        convert_to_attnres(qwen3, layout="native")
    model = convert_to_attnres(qwen3, layout="auto")  # auto: wrapped (attnres.hf.retrofit)
    assert not isinstance(model, AttnResForCausalLM) and model.config.attnres_retrofit["source_model_type"] == "qwen3"
    assert max_err(qwen3, model, ids()) < TOL[torch.float32]
    assert not isinstance(convert_to_attnres(tiny_source("llama"), layout="auto"), AttnResForCausalLM)
    assert isinstance(convert_to_attnres(tiny_source("llama"), layout="auto", max_seq_len=16), AttnResForCausalLM)
    assert not isinstance(convert_to_attnres(tiny_source("llama"), layout="wrapped"), AttnResForCausalLM)
    with pytest.raises(ConversionError, match=r"max_seq_len=16 applies to the native layout only"):
        convert_to_attnres(qwen3, layout="wrapped", max_seq_len=16)
    with pytest.raises(ConversionError, match=r"layout='tree'"):
        convert_to_attnres(qwen3, layout="tree")


def test_biases_only_when_zero():
    qwen2 = tiny_source("qwen2")  # q/k/v biases exist, initialised to zero: dropped exactly
    assert any(n.endswith("q_proj.bias") for n, _ in qwen2.named_parameters())
    convert_to_attnres(qwen2, layout="native")
    with torch.no_grad():
        qwen2.model.layers[1].self_attn.k_proj.bias.fill_(0.1)
    with pytest.raises(
        ConversionError, match=r"attention projection biases \(qwen2 always has q/k/v biases\).*k_proj\.bias"
    ):
        convert_to_attnres(qwen2, layout="native")
    llama = tiny_source("llama", attention_bias=True, mlp_bias=True)
    convert_to_attnres(llama, layout="native")
    with torch.no_grad():
        llama.model.layers[0].mlp.up_proj.bias.fill_(0.1)
    with pytest.raises(ConversionError, match=r"MLP biases \(mlp_bias=True\)"):
        convert_to_attnres(llama, layout="native")
    with torch.no_grad():
        llama.model.layers[0].mlp.up_proj.bias.zero_()
        llama.model.layers[2].self_attn.o_proj.bias.fill_(-0.1)
    with pytest.raises(ConversionError, match=r"attention projection biases \(attention_bias=True\).*o_proj"):
        convert_to_attnres(llama, layout="native")


def test_sliding_window():
    mistral = tiny_source("mistral", sliding_window=16)
    with pytest.raises(ConversionError, match=r"sliding-window attention \(sliding_window=16\).*max_seq_len <= 16"):
        convert_to_attnres(mistral, layout="native")
    # within the window both attend to everything: accepted with a short enough max_seq_len
    model = compensate_eps(convert_to_attnres(mistral, max_seq_len=16))
    assert max_err(mistral, model, ids(t=16)) < TOL[torch.float32]
    assert convert_to_attnres(tiny_source("mistral", sliding_window=None)).config.max_seq_len == 48
    qwen2 = tiny_source("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ConversionError, match="sliding_window=8"):
        convert_to_attnres(qwen2, layout="native")


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
            r"RoPE scaling 'linear' \(rope_parameters\['rope_type'\]",
        ),
        (
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "rope_theta": 10000.0,
                }
            ),
            r"RoPE scaling 'llama3'",
        ),
        (dict(head_dim=32), r"head dimension other than hidden_size / num_attention_heads \(head_dim=32\)"),
        (dict(hidden_act="gelu"), r"MLP activation 'gelu' \(hidden_act='gelu'\)"),
    ],
)
def test_unsupported_architecture_features(overrides, match):
    with pytest.raises(ConversionError, match=match):
        convert_to_attnres(tiny_source("llama", **overrides), layout="native")


def test_bad_requests():
    source = tiny_source("llama")
    with pytest.raises(ConversionError, match="residual='rezero'"):
        convert_to_attnres(source, residual="rezero")
    with pytest.raises(ConversionError, match="attnres_window"):
        convert_to_attnres(source, residual="full", attnres_window=2)
    with pytest.raises(ConversionError, match=r"\['d_model'\] come from the source"):
        convert_to_attnres(source, d_model=128)
    with pytest.raises(ConversionError, match="attnres_blocks=4"):
        convert_to_attnres(source, attnres_blocks=4)  # 6 sublayers cannot make 4 blocks
    with pytest.raises(ConversionError, match="no config.json"):
        convert_to_attnres("/nonexistent/model")
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ConversionError, match=r"model_type='gpt2'.*llama, mistral, qwen2"):
        convert_to_attnres(gpt2, layout="native")
    with pytest.raises(ConversionError, match=r"cannot retrofit model_type='bert'.*Supported: arcee"):
        attnres.hf.convert_to_attnres(
            transformers.BertForMaskedLM(
                transformers.BertConfig(
                    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50
                )
            )
        )


def test_a_state_that_does_not_fit_the_model_is_named():
    """One check for both loaders (LLaMA-family sources, Kimi Linear checkpoints): missing tensors and
    wrong shapes are listed by name."""
    from attnres.hf.convert import ConversionError, check_state_fits

    expected = {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(4)}
    check_state_fits(
        {"a.weight": torch.ones(2, 3), "b.weight": torch.ones(4), "extra": torch.ones(1)}, expected, "source"
    )
    with pytest.raises(ConversionError, match=r"the checkpoint lacks tensors the model needs: \['b.weight'\]"):
        check_state_fits({"a.weight": torch.ones(2, 3)}, expected, "checkpoint")
    with pytest.raises(ConversionError, match=r"a.weight: source \(3, 2\), expected \(2, 3\)"):
        check_state_fits({"a.weight": torch.ones(3, 2), "b.weight": torch.ones(4)}, expected, "source")


# ----------------------------------------------------------------------------- no remote code


def custom_code_source(path, marker, model_type="evilmodel"):
    """A tiny LLaMA directory whose config.json names custom code (auto_map) for ``model_type``; its python
    files leave ``marker`` when imported."""
    tiny_source("llama").save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(config))
    leave = f"import pathlib\n\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (path / "configuration_evil.py").write_text(
        f"{leave}from transformers import LlamaConfig\n\n\nclass EvilConfig(LlamaConfig):\n"
        f"    model_type = {model_type!r}\n"
    )
    (path / "modeling_evil.py").write_text(
        f"{leave}from transformers import LlamaForCausalLM\n\nfrom .configuration_evil import EvilConfig\n\n\n"
        "class EvilForCausalLM(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    return path


def test_a_source_asking_for_custom_code_is_refused_before_transformers_sees_it(tmp_path, monkeypatch):
    from attnres.hf import convert_directory, retrofit

    monkeypatch.setattr("builtins.input", lambda *args: "y")  # a user who answers transformers' prompt
    marker = tmp_path / "MARKER"
    src = custom_code_source(tmp_path / "evil", marker)
    calls = {
        "convert_to_attnres": lambda: attnres.hf.convert_to_attnres(src),
        "convert_to_attnres native": lambda: convert_to_attnres(src),
        "retrofit": lambda: retrofit(src),
        "convert_directory": lambda: convert_directory(src, tmp_path / "out", to="native"),
    }
    for name, call in calls.items():
        with pytest.raises(ConversionError, match=r"asks to run custom code.*configuration_evil\.py"):
            call()
        assert not marker.exists(), name
    assert not (tmp_path / "out").exists()
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), "auto_map": {}}))
    with pytest.raises(ConversionError, match=r"model_type='evilmodel', which transformers .* does not implement"):
        convert_to_attnres(src)


def test_custom_code_named_for_a_type_transformers_implements_is_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    marker = tmp_path / "MARKER"
    src = custom_code_source(tmp_path / "llama", marker, model_type="llama")
    model = convert_to_attnres(src)  # transformers' own LlamaForCausalLM reads the weights
    assert isinstance(model, AttnResForCausalLM) and not marker.exists()


def test_the_model_types_attnres_reads_itself_are_its_own():
    from attnres.hf.configuration import AttnResConfig
    from attnres.hf.kimi.k3 import K3_MODEL_TYPE
    from attnres.hf.remote_code import OWN_MODEL_TYPES
    from attnres.hf.retrofit.model import MODEL_TYPE

    assert (AttnResConfig.model_type, MODEL_TYPE, K3_MODEL_TYPE) == OWN_MODEL_TYPES
