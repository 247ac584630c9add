"""AttnResConfig / AttnResForCausalLM: config, save/load, Auto classes, generate, training."""

import json

import pytest
import torch
from reference import randomize
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import attnres.hf  # (registers the model type)
from attnres import AttnResLM, ModelConfig
from attnres.hf import AttnResConfig, AttnResForCausalLM
from attnres.inference.sampling import generate as native_generate


def tiny_config(**kw):
    base = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=40)
    return AttnResConfig(**{**base, **kw})


def perturbed(model, seed=1):
    """Move the zero-initialised depth parameters so that round trips test them for real."""
    randomize(model.model.residual, seed=seed)
    return model


# ----------------------------------------------------------------------------- config


def test_config_carries_every_model_config_field():
    mc = ModelConfig(
        vocab_size=50, d_model=48, n_layers=2, n_heads=4, residual="full", attnres_heads=2, tie_embeddings=True
    )
    cfg = AttnResConfig.from_model_config(mc, eos_token_id=3)
    assert cfg.model_config() == mc
    assert cfg.model_type == "attnres" and cfg.eos_token_id == 3
    # the usual Hugging Face names are aliases
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (48, 2, 4)
    assert cfg.tie_word_embeddings is True and cfg.intermediate_size == mc.d_ff
    assert AttnResConfig(hidden_size=48, num_attention_heads=4, vocab_size=50).d_model == 48
    again = AttnResConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.model_config() == mc


def test_config_validates_like_model_config():
    with pytest.raises(ValueError, match="n_heads"):
        AttnResConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="alias"):
        AttnResConfig(d_model=32, hidden_size=64)


def test_fresh_model_is_initialised_exactly_like_attnres_lm():
    cfg = tiny_config(residual="block")
    torch.manual_seed(5)
    hf_model = AttnResForCausalLM(cfg)
    torch.manual_seed(5)
    lm = AttnResLM(cfg.model_config())
    a, b = hf_model.model.state_dict(), lm.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.count_nonzero(hf_model.model.residual.queries) == 0


# ----------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("residual", ["block", "full"])
def test_save_pretrained_round_trip(tmp_path, tie, residual):
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual=residual, tie_embeddings=tie))).eval()
    ids = torch.randint(0, 97, (2, 17))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "attnres" and saved["architectures"] == ["AttnResForCausalLM"]
    assert saved["residual"] == residual and saved["tie_embeddings"] is tie
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.residual.queries" in keys
    assert ("model.lm_head.weight" in keys) is not tie  # a tied head is stored once
    for loader in (AttnResForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path).eval()
        assert type(loaded) is AttnResForCausalLM
        assert (loaded.model.lm_head.weight is loaded.model.embed.weight) is tie
        assert torch.equal(loaded.model.rope_cos, model.model.rope_cos)
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), AttnResConfig)


# beyond the paper: uneven blocks, state sources and low-rank queries are config fields; gated has weights of
# its own (no queries): all round-trip through config.json and safetensors, and generate through the cache
VARIANTS_18 = [
    dict(
        residual="block",
        attnres_block_sizes=[1, 4, 1],
        attnres_sources="states",
        attnres_weights="low_rank_query",
        attnres_query_rank=3,
    ),
    dict(residual="gated", gated_heads=2),
]


@pytest.mark.parametrize("options", VARIANTS_18, ids=["block-uneven-states-low-rank", "gated"])
def test_issue_18_variants_round_trip_and_generate(tmp_path, options):
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(**options))).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert all(saved[k] == v for k, v in options.items())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.config == model.model.config
    ids = torch.randint(0, 97, (2, 17))
    prompt = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    out = loaded.generate(prompt, max_new_tokens=10, do_sample=False)
    assert out[0, 6:].tolist() == list(native_generate(model.model, prompt, 10, temperature=0))


def test_from_pretrained_dtype(tmp_path):
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config())).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert loaded.dtype == torch.float64
    assert torch.equal(loaded.model.residual.queries, model.model.residual.queries.double())


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t.pop("model.residual.queries"),
            r"1 missing \(they would start at random\): model\.residual\.queries\.",
        ),
        (lambda t: t.update({"model.blocks.5.mlp.up_proj.weight": torch.zeros(2)}), r"1 unexpected .*blocks\.5\.mlp"),
        (
            lambda t: t.update({"model.residual.queries": torch.zeros(2, 3)}),
            r"1 of another shape .*residual\.queries\.",
        ),
    ],
    ids=["missing", "unexpected", "mismatched"],
)
def test_a_checkpoint_that_does_not_match_is_an_error_naming_the_keys(tmp_path, change, message):
    """transformers only logs such keys and starts missing ones at random (a missing depth query became a
    zero one, silently another function); loading an attnres checkpoint refuses them by name."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    perturbed(AttnResForCausalLM(tiny_config())).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for loader in (AttnResForCausalLM, AutoModelForCausalLM):
        for kw in ({}, {"ignore_mismatched_sizes": True}, {"output_loading_info": True}):
            with pytest.raises(attnres.hf.ConversionError, match=message):
                loader.from_pretrained(tmp_path, **kw)


def test_output_loading_info_still_returns_the_report(tmp_path):
    AttnResForCausalLM(tiny_config()).save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(model, AttnResForCausalLM) and not info["missing_keys"] and not info["unexpected_keys"]


# ----------------------------------------------------------------------------- forward / generate


def test_forward_matches_attnres_lm_and_loss_follows_hf_convention():
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config())).eval()
    ids = torch.randint(0, 97, (2, 12))
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        out = model(ids, labels=labels, attention_mask=torch.ones_like(ids))
        logits = model.model(ids)
    assert torch.equal(out.logits, logits)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, expected)
    loss, tuple_logits = model(ids, labels=labels, return_dict=False)
    assert torch.equal(tuple_logits, logits)


def test_forward_rejects_what_attnres_lm_cannot_do():
    model = AttnResForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 97, (2, 8))
    with pytest.raises(NotImplementedError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 3, 32))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(ids, output_attentions=True)


def test_hidden_states_are_the_sublayer_inputs_and_the_stream_output():
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual="full"))).double().eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        record = model.model(ids, return_record=True).record
    n = model.model.config.n_sublayers
    assert len(out.hidden_states) == n + 1 and out.hidden_states[0].shape == (2, 9, 32)
    assert torch.equal(out.hidden_states[0], model.model.embed(ids))  # h_0 attends over the embedding alone
    # the record's RMS of each sublayer input is that of the hidden state
    for layer in range(n):
        rms = out.hidden_states[layer].float().pow(2).mean().sqrt().item()
        assert rms == pytest.approx(record.input_rms[layer], rel=1e-6)
    # the last one is what the final norm turns into logits
    torch.testing.assert_close(model.model.lm_head(model.model.norm(out.hidden_states[-1])), out.logits, rtol=0, atol=0)
    assert model(ids).hidden_states is None and len(model(ids, output_hidden_states=True, return_dict=False)) == 2


def test_gradient_checkpointing_through_the_hf_flag_gives_the_same_gradients():
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual="block", attnres_blocks=3))).double().train()
    ids = torch.randint(0, 97, (2, 12))

    def gradients():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []
    model.model.blocks[0].attn.register_forward_pre_hook(lambda *a: calls.append(1))
    plain = gradients()
    assert len(calls) == 1 and not model.is_activation_checkpointing
    model.activation_checkpointing_enable()  # formerly gradient_checkpointing_enable()
    assert model.is_activation_checkpointing and model.model.blocks[2].gradient_checkpointing
    checkpointed = gradients()
    assert len(calls) == 3  # the forward, and its recomputation in backward
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-10, atol=1e-12)
    model.activation_checkpointing_disable()
    assert not model.model.blocks[0].gradient_checkpointing


@pytest.mark.parametrize("residual", ["block", "full"])
def test_greedy_generate_equals_native_sampler(residual):
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual=residual))).eval()
    prompt = torch.randint(0, 97, (1, 6))
    # 6 + 44 tokens run past max_seq_len=40: both crop the context to the last 40 tokens
    out = model.generate(prompt, max_new_tokens=44, do_sample=False)
    ours = list(native_generate(model.model, prompt, 44, temperature=0))
    assert out.shape == (1, 50) and torch.equal(out[0, :6], prompt[0])
    assert out[0, 6:].tolist() == ours


def test_generate_runs_through_the_kv_cache():
    from attnres.inference import KVCache

    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual="block"))).eval()
    fed = []
    inner = model.model.forward
    model.model.forward = lambda ids, **kw: (fed.append(ids.shape[1]), inner(ids, **kw))[1]
    prompt = torch.randint(0, 97, (1, 6))
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert fed == [6, 1, 1, 1, 1]  # prefill once, then one token per step
    del model.model.forward
    uncached = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(out, uncached)
    # forward with a cache continues the sequence and returns the cache
    cache = KVCache.for_model(model.model, 1)
    first = model(prompt[:, :4], cache=cache)
    second = model(prompt[:, 4:], cache=cache)
    assert second.cache is cache and cache.get_seq_length() == 6
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), model(prompt).logits, rtol=1e-5, atol=1e-5)


def test_generate_batch_and_eos():
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config())).eval()
    prompts = torch.randint(0, 97, (3, 5))
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False)
    for row in range(3):
        ours = list(native_generate(model.model, prompts[row : row + 1], 8, temperature=0))
        assert out[row, 5:].tolist() == ours
    eos = int(out[0, 7])  # the third generated token: generation stops there
    stopped = model.generate(prompts[:1], max_new_tokens=8, do_sample=False, eos_token_id=eos)
    assert stopped[0, -1].item() == eos and stopped.shape[1] <= 8


@pytest.mark.parametrize("residual", ["block", "full"])
def test_padded_batch_generate_matches_each_prompt_alone(residual, pad):
    """Left-padded prompts of different lengths in one generate() call: each row generates exactly
    what its prompt generates alone (greedy), and the forward logits agree at every real position."""
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual=residual))).double().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g) for n in (4, 9, 6)]
    ids, mask = pad(prompts, pad_id=0, side="left")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=8, do_sample=False)
        assert out[row, ids.shape[1] :].tolist() == alone[0, len(p) :].tolist()
        with torch.no_grad():
            torch.testing.assert_close(logits[row, -len(p) :], model(p[None]).logits[0], rtol=1e-10, atol=1e-10)
    uncached = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=False
    )
    assert torch.equal(out, uncached)


def test_text_generation_pipeline_batches_padded_prompts():
    from transformers import pipeline

    from attnres.data import ByteTokenizer
    from attnres.hf import hf_tokenizer

    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(vocab_size=256, residual="block"))).eval()
    tokenizer = hf_tokenizer(ByteTokenizer())
    texts = ["To be", "or not to be, that", "is the question:"]
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    kw = dict(max_new_tokens=6, do_sample=False, return_full_text=False)
    batched = generator(texts, batch_size=2, **kw)
    alone = [generator(text, **kw) for text in texts]
    assert [b[0]["generated_text"] for b in batched] == [a[0]["generated_text"] for a in alone]
    assert all(len(tokenizer(a[0]["generated_text"])["input_ids"]) >= 1 for a in alone)


@pytest.mark.parametrize("residual", ["block", "full"])
def test_beam_search_with_the_cache_equals_without(residual):
    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual=residual))).double().eval()
    prompts = torch.randint(0, 97, (2, 5))
    kw = dict(max_new_tokens=7, num_beams=3, num_return_sequences=2, do_sample=False)
    cached = model.generate(prompts, **kw)
    assert torch.equal(cached, model.generate(prompts, use_cache=False, **kw))
    assert cached.shape == (4, 12)


@pytest.mark.parametrize("residual", ["block", pytest.param("full", marks=pytest.mark.compile_heavy)])
def test_compiled_generate_equals_eager_and_compiles_once(residual):
    """compile_decoding(): generate() through a compiled step over a static KV cache gives the eager
    tokens (greedy past max_seq_len, beam search), and a second call with the same batch size
    compiles nothing new."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = perturbed(AttnResForCausalLM(tiny_config(residual=residual))).eval()
    prompt = torch.randint(0, 97, (1, 6))
    eager = model.generate(prompt, max_new_tokens=38, do_sample=False)
    prompts = torch.randint(0, 97, (2, 5))
    beams = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
    eager_beams = model.generate(prompts, **beams)
    torch._dynamo.reset()
    model.compile_decoding("aot_eager")
    assert torch.equal(model.generate(prompt, max_new_tokens=38, do_sample=False), eager)
    counters.clear()
    assert torch.equal(model.generate(prompt, max_new_tokens=38, do_sample=False), eager)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert torch.equal(model.generate(prompts, **beams), eager_beams)  # in-place beam reorder
    with pytest.raises(ValueError, match="compiled decoding does not run padded batches"):
        model.generate(prompts, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"compile_decoding\(setting\)='nope' is not a torch.compile backend"):
        model.compile_decoding("nope")
    model.compile_decoding(False)
    assert torch.equal(model.generate(prompt, max_new_tokens=38, do_sample=False), eager)


# ----------------------------------------------------------------------------- training


def test_trains_with_adamw_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(residual="block", attnres_blocks=3)).train()
    ids = torch.randint(0, 97, (4, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    assert model.model.residual.queries.abs().max() > 0  # the depth queries learn too
    model.eval().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
