"""Native checkpoints (attnres train) <-> Hugging Face format, tokenizers, and `attnres convert`."""

import json
import re
import time

import pytest
import torch
from hf_sources import SMALL, compensate_eps, tiny_source
from transformers import AutoModelForCausalLM, AutoTokenizer

import attnres.hf
from attnres import AttnResLM, ModelConfig
from attnres.checkpoint import load_model, read_checkpoint_state, save_checkpoint
from attnres.cli import main
from attnres.data import ByteTokenizer, train_bpe
from attnres.hf import (
    AttnResForCausalLM,
    ConversionError,
    convert_directory,
    hf_to_native,
    hf_tokenizer,
    native_to_hf,
    source_kind,
)

TEXT = "ROMEO: But soft, what light through yonder window breaks?\n\tÜber naïve café — 東京 ✓\n"


def error_line(err: str) -> str:
    """The command's one error line: a library's progress bar or load report may share stderr with it."""
    lines = [line for line in err.splitlines() if line.startswith("attnres convert: error:")]
    assert len(lines) == 1, err
    return lines[0]


def native_run(tmp_path, tie=False, residual="block"):
    """A run directory laid out like the trainer's: checkpoint/ + tokenizer.json."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=256, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, residual=residual, tie_embeddings=tie
    )
    lm = AttnResLM(config)
    with torch.no_grad():
        lm.residual.queries.normal_()
    run = tmp_path / "run"
    save_checkpoint(
        run / "checkpoint",
        model=lm,
        optimizer=None,
        step=7,
        train_state={},
        model_config=config.to_dict(),
        train_config={"tokenizer": "byte"},
    )
    ByteTokenizer().save(run / "tokenizer.json")
    return run, lm.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_native_hf_round_trip(tmp_path, tie):
    run, lm = native_run(tmp_path, tie=tie)
    x = torch.randint(0, 256, (2, 20))
    model = AttnResForCausalLM.from_native(run)
    assert model.config.model_config() == lm.config
    with torch.no_grad():
        assert torch.equal(model(x).logits, lm(x))
    model.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    path = loaded.to_native(tmp_path / "native")
    assert read_checkpoint_state(path)["model_config"] == lm.config.to_dict()
    back, _, _ = load_model(str(path))
    assert back.state_dict().keys() == lm.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in lm.state_dict().items())
    assert (back.lm_head.weight is back.embed.weight) is tie
    # functions and methods are the same thing
    again = native_to_hf(path)
    with torch.no_grad():
        assert torch.equal(again(x).logits, lm(x))
    assert hf_to_native(again, tmp_path / "native") == path  # replaces the checkpoint in place


def test_tokenizers_match_native():
    for native in (ByteTokenizer(), train_bpe([TEXT * 20, "the quick brown fox " * 50], vocab_size=300)):
        tok = hf_tokenizer(native)
        ids = tok(TEXT)["input_ids"]
        assert ids == native.encode(TEXT)
        assert tok.decode(ids) == TEXT


def test_source_kind_tells_the_three_kinds_apart(tmp_path):
    run, _ = native_run(tmp_path)
    (run / "config.json").write_text(json.dumps({"model": {}, "train": {}}))  # as the trainer writes it
    assert source_kind(run) == "native" and source_kind(run / "checkpoint") == "native"
    AttnResForCausalLM.from_native(run).save_pretrained(tmp_path / "hf")
    assert source_kind(tmp_path / "hf") == "attnres"
    tiny_source("llama").save_pretrained(tmp_path / "llama")
    assert source_kind(tmp_path / "llama") == "pretrained"
    with pytest.raises(ConversionError, match="is neither a Hugging Face model directory"):
        source_kind(tmp_path)


def test_convert_directory_reports_through_log(tmp_path, capsys):
    run, lm = native_run(tmp_path)
    lines = []
    assert convert_directory(run, tmp_path / "hf", log=lines.append) == tmp_path / "hf"
    assert len(lines) == 1 and lines[0].startswith(f"native checkpoint {run} -> ")
    assert capsys.readouterr().out == ""
    back = convert_directory(tmp_path / "hf", tmp_path / "back", log=lines.append)
    assert back == tmp_path / "back" and load_model(back)[0].config == lm.config
    with pytest.raises(ConversionError, match="--residual, --set apply only when retrofitting"):
        convert_directory(run, tmp_path / "x", retrofit={"residual": "full", "attnres_impl": "fused"})


# ----------------------------------------------------------------------------- CLI


def test_cli_retrofits_a_llama_directory(tmp_path, capsys):
    source = tiny_source("llama", rms_norm_eps=1e-12)
    source.save_pretrained(tmp_path / "llama")
    hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")  # any tokenizer rides along
    out = tmp_path / "llama-attnres"
    assert (
        main(
            [
                "convert",
                str(tmp_path / "llama"),
                str(out),
                "--residual",
                "block",
                "--attnres-blocks",
                "3",
                "--set",
                "attnres_impl=fused",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "max |logit difference|" in printed and "3 depth blocks" in printed and "family llama" in printed
    model = AutoModelForCausalLM.from_pretrained(out)  # the wrapped layout (the default): Llama's own layers
    assert model.config.attnres_retrofit["scheme"] == {"attnres_blocks": 3, "attnres_impl": "fused"}
    x = torch.randint(0, SMALL["vocab_size"], (2, 24))
    with torch.no_grad():
        assert (model(x).logits - source(x).logits).abs().max() < 1e-5
    assert AutoTokenizer.from_pretrained(out)("abc")["input_ids"] == [97, 98, 99]
    # straight to a native checkpoint, without loading the source to verify
    assert (
        main(
            [
                "convert",
                str(tmp_path / "llama"),
                str(tmp_path / "native"),
                "--to",
                "native",
                "--residual",
                "full",
                "--no-verify",
            ]
        )
        == 0
    )
    lm, tokenizer, _ = load_model(str(tmp_path / "native"))
    assert lm.config.residual == "full" and tokenizer is not None
    with torch.no_grad():
        assert (lm(x) - source(x).logits).abs().max() < 1e-5


def test_cli_native_and_hf_directions(tmp_path, capsys):
    run, lm = native_run(tmp_path)
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "attnres"
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(TEXT)["input_ids"] == ByteTokenizer().encode(TEXT)
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0  # default: to native
    back, tokenizer, _ = load_model(str(tmp_path / "back"))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in lm.state_dict().items())
    assert tokenizer.encode(TEXT) == ByteTokenizer().encode(TEXT)
    capsys.readouterr()
    # user errors: one line, exit status 2
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["convert", str(run), str(tmp_path / "x"), "--residual", "full"]) == 2
    assert "only when retrofitting" in capsys.readouterr().err
    (tmp_path / "nothing").mkdir()
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "y")]) == 2
    assert "neither" in capsys.readouterr().err
    qwen3 = tmp_path / "qwen3"
    tiny_source("qwen3", head_dim=16).save_pretrained(qwen3)
    assert main(["convert", str(qwen3), str(tmp_path / "z"), "--to", "native"]) == 2
    assert "QK-norm" in capsys.readouterr().err
    # to Hugging Face: the wrapped layout (attnres.hf.retrofit), which says the family and the check
    assert main(["convert", str(qwen3), str(tmp_path / "z"), "--residual", "full"]) == 0
    printed = capsys.readouterr().out
    assert "family qwen3, wrapped layout" in printed and "max |logit difference|" in printed
    assert json.loads((tmp_path / "z" / "config.json").read_text())["model_type"] == "attnres_retrofit"
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "z")).__name__ == "AttnResQwen3ForCausalLM"
    assert main(["convert", str(tmp_path / "z"), str(tmp_path / "zz")]) == 2
    assert "already retrofitted" in capsys.readouterr().err


def test_cli_mistral_with_window(tmp_path, capsys):
    mistral = tiny_source("mistral", sliding_window=16)
    mistral.save_pretrained(tmp_path / "m")
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--to", "native"]) == 2
    assert "--max-seq-len 16" in capsys.readouterr().err
    # without --max-seq-len: the wrapped layout, exact beyond the window through Mistral's own attention
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "wrapped")]) == 0
    assert "family mistral, wrapped layout" in capsys.readouterr().out
    wrapped = AutoModelForCausalLM.from_pretrained(tmp_path / "wrapped")
    x = torch.randint(0, SMALL["vocab_size"], (1, 40))
    with torch.no_grad():
        assert (wrapped(x).logits - mistral(x).logits).abs().max() < 1e-4
    assert (
        main(
            [
                "convert",
                str(tmp_path / "m"),
                str(tmp_path / "out"),
                "--max-seq-len",
                "16",
                "--residual",
                "full",
                "--dtype",
                "float64",
            ]
        )
        == 0
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.float64 and model.config.max_seq_len == 16
    x = torch.randint(0, SMALL["vocab_size"], (1, 16))
    with torch.no_grad():
        err = (compensate_eps(model)(x).logits - mistral.double()(x).logits).abs().max()
    assert err < 3e-7


def test_exported_tokenizer_names_bos_eos_pad_and_generation_config(tmp_path):
    """The document separator is the eos (and bos) when it is one token; padding is the NUL byte;
    encoding is unchanged; the Hugging Face directory's generation_config.json carries them."""
    from attnres.data import DOC_SEPARATOR

    bpe = train_bpe([TEXT * 20] + ["the quick brown fox\n\n"] * 50, vocab_size=300)
    (separator,) = bpe.encode(DOC_SEPARATOR)
    tok = hf_tokenizer(bpe)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (separator, separator, bpe.encode("\0")[0])
    assert tok.padding_side == "left"
    assert tok("a\n\nb" + TEXT)["input_ids"] == bpe.encode("a\n\nb" + TEXT)  # special tokens do not split text
    byte = hf_tokenizer(ByteTokenizer())
    assert byte.pad_token_id == 0 and byte.eos_token_id is None  # two newlines are two byte tokens
    run, _ = native_run(tmp_path)
    bpe.save(run / "tokenizer.json")  # pretend the run used the BPE tokenizer
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == separator and generation["pad_token_id"] == tok.pad_token_id
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id == separator


def test_native_checkpoints_written_from_hf_are_complete_runs(tmp_path, capsys, monkeypatch):
    """to_native / convert --to native write the tokenizer and a train config that attnres eval and
    attnres sample accept: for a model that never was a native run (default train config) and for one
    that was (its own train config comes back)."""
    from attnres.hf import AttnResConfig
    from attnres.train.config import TrainConfig

    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    fresh = AttnResForCausalLM(AttnResConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, max_seq_len=32))
    path = hf_to_native(fresh, tmp_path / "fresh", tokenizer=ByteTokenizer())
    assert read_checkpoint_state(path)["train_config"]["seq_len"] == 32
    # a run of attnres train, through Hugging Face and back
    run, lm = native_run(tmp_path)
    trained = TrainConfig(tokenizer="byte", seq_len=16, batch_size=2, out_dir=str(run)).to_dict()
    save_checkpoint(
        run / "checkpoint",
        model=lm,
        optimizer=None,
        step=7,
        train_state={},
        model_config=lm.config.to_dict(),
        train_config=trained,
    )
    back = AttnResForCausalLM.from_native(run).to_native(tmp_path / "back")
    assert read_checkpoint_state(back)["train_config"] == trained
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "cli-back"), "--to", "native"]) == 0
    assert read_checkpoint_state(tmp_path / "cli-back")["train_config"] == trained
    capsys.readouterr()
    for directory in (path, back, tmp_path / "cli-back"):
        assert main(["eval", str(directory), "--batches", "1"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 0
        assert main(["sample", str(directory), "--prompt", "ab", "--max-new-tokens", "3"]) == 0
        assert capsys.readouterr().out.startswith("ab")


def test_convert_never_replaces_a_training_checkpoint_without_force(tmp_path, capsys):
    run, _ = native_run(tmp_path)
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    state = (run / "checkpoint" / "state.json").read_text()
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), str(run / "checkpoint")]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err
    assert (run / "checkpoint" / "state.json").read_text() == state
    assert main(["convert", str(tmp_path / "hf"), str(run / "checkpoint"), "--force"]) == 0


def test_convert_names_the_file_it_cannot_read(tmp_path, capsys):
    config_only = tmp_path / "config-only"
    tiny_source("llama").config.save_pretrained(config_only)
    not_json = tmp_path / "not-json"
    not_json.mkdir()
    (not_json / "config.json").write_text("{model_type: llama")
    run, _ = native_run(tmp_path)
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    truncated = tmp_path / "hf"
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4000])
    capsys.readouterr()
    for source, message in [
        (config_only, "no *.safetensors or *.bin weight files"),
        (not_json, f"{not_json / 'config.json'} is not valid JSON"),
        (truncated, "(model.safetensors): SafetensorError"),
    ]:
        for extra in ([], ["--no-verify"]):
            assert main(["convert", str(source), str(tmp_path / "out"), *extra]) == 2
            err = capsys.readouterr().err
            assert message in err and str(source) in err and "Traceback" not in err, err
            assert len(err.strip().splitlines()) == 2, err


def test_convert_never_writes_into_its_own_source(tmp_path, capsys):
    """`attnres convert RUN RUN --force` replaced the run's config.json and tokenizer.json with the Hugging
    Face ones; the output may be neither the source, nor inside it, nor around it."""
    run, _ = native_run(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for out, why in ((run, "is the source itself"), (run / "hf", "lies inside the source"), (tmp_path, "lies inside")):
        capsys.readouterr()
        assert main(["convert", str(run), str(out), "--force"]) == 2
        err = capsys.readouterr().err
        first = error_line(err)
        assert why in first and "outside" in first, err
    assert main(["convert", str(run), str(run / ".." / run.name / "x.gguf"), "--to", "gguf", "--force"]) == 2
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_convert_refuses_a_pickle_that_is_not_tensors_in_one_line(tmp_path, capsys):
    """A pytorch_model.bin whose pickle would run code: torch.load(weights_only=True) refuses it, and
    convert says so in one line (it printed 35 lines of traceback) without running anything."""
    import os
    import pickle

    source = tmp_path / "evil"
    tiny_source("llama").config.save_pretrained(source)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (source / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload()}))
    assert main(["convert", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres convert: error: refused to load the weights") and "Nothing was executed" in err
    assert len(err.splitlines()) == 2, err  # the error and the ATTNRES_DEBUG hint
    assert not marker.exists()


def test_a_config_claiming_20000_layers_is_refused_from_the_weights_header(tmp_path, capsys):
    """The layer count of config.json against the safetensors header, before a model is built: a config
    claiming 20,000 layers took minutes to fail (also with --no-verify)."""
    import time

    source = tmp_path / "llama"
    tiny_source("llama").save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    layers, config["num_hidden_layers"] = config["num_hidden_layers"], 20000
    (source / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    capsys.readouterr()  # save_pretrained's progress bar is not the command's output
    assert main(["convert", str(source), str(tmp_path / "out"), "--no-verify"]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert f"num_hidden_layers=20000, but the weights hold {layers} layers" in error_line(err)


def test_a_config_of_another_family_over_the_weights_is_refused(tmp_path, capsys):
    """A gpt2 config.json over LLaMA weights was converted: transformers started the GPT-2 at random and the
    check compared that random model with itself. Missing weights are refused by name."""
    source = tmp_path / "llama"
    tiny_source("llama").save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (source / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # save_pretrained's progress bar is not the command's output
    assert main(["convert", str(source), str(tmp_path / "out")]) == 2
    first = error_line(capsys.readouterr().err)
    assert "describes a gpt2 model whose weights are not in" in first and "different models" in first
    assert not (tmp_path / "out").exists()


def test_bad_flags_and_an_unwrappable_family_are_refused_before_the_weights_are_read(tmp_path, capsys, monkeypatch):
    """`--attnres-blocks 0` and a model type the wrapped layout has no spec for were found only after every
    weight had been loaded; now from config.json and the flags alone."""
    import transformers

    loads = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a) or real(*a, **k)
    )
    source = tmp_path / "llama"
    tiny_source("llama").save_pretrained(source)
    assert main(["convert", str(source), str(tmp_path / "out"), "--attnres-blocks", "0"]) == 2
    assert "--attnres-blocks 0: must be a positive integer" in capsys.readouterr().err
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    assert main(["convert", str(source), str(tmp_path / "out")]) == 2
    assert "cannot retrofit model_type='falcon'" in capsys.readouterr().err
    assert loads == []


def _edited_source(tmp_path, name, weights="safetensors", **config_changes):
    """A tiny Llama directory saved by transformers, its config.json edited; ``weights="bin"``: the weights
    as pytorch_model.bin (torch.save of the state dict) instead of model.safetensors."""
    source = tmp_path / name
    model = tiny_source("llama")
    model.save_pretrained(source)
    if weights == "bin":
        (source / "model.safetensors").unlink()
        torch.save(model.state_dict(), source / "pytorch_model.bin")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **config_changes}))
    return source


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_attention_heads=5), r"is not a multiple of the number of attention heads \(5\)"),
        (dict(num_hidden_layers="3"), r"num_hidden_layers.*expected int, got str"),
    ],
    ids=["heads", "layers-as-text"],
)
def test_an_invalid_config_is_one_line(tmp_path, capsys, changes, message):
    """transformers' config validation raises huggingface_hub's StrictDataclassError (no ValueError): convert
    and retrofit ended in its traceback."""
    from attnres.hf.retrofit import retrofit

    source = _edited_source(tmp_path, "src", **changes)
    for extra in ([], ["--to", "native"], ["--no-verify"]):
        capsys.readouterr()  # save_pretrained's progress bar is not the command's output
        assert main(["convert", str(source), str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert f"{source / 'config.json'} is invalid" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 2 and re.search(message, err), err
    for convert in (retrofit, attnres.hf.convert_to_attnres):
        with pytest.raises(ConversionError, match=f"config.json is invalid: .*{message}"):
            convert(source)


def test_a_layer_count_beyond_pytorch_model_bin_weights_is_refused_quickly(tmp_path, capsys):
    """The layer-count check read safetensors headers only: 100,000 layers beside pytorch_model.bin built
    for minutes; the .bin's names come from torch.load(weights_only=True, mmap=True), no data read."""
    source = _edited_source(tmp_path, "src", weights="bin", num_hidden_layers=100_000)
    start = time.perf_counter()
    assert main(["convert", str(source), str(tmp_path / "out"), "--no-verify"]) == 2
    assert time.perf_counter() - start < 10
    err = capsys.readouterr().err
    assert "says num_hidden_layers=100000, but the weights hold 3 layers" in err, err
    fine = _edited_source(tmp_path, "fine", weights="bin")  # the .bin weights themselves convert
    assert main(["convert", str(fine), str(tmp_path / "out"), "--residual", "full"]) == 0


def test_a_huge_context_allocates_no_giant_rotary_table(tmp_path):
    """max_position_embeddings=10**9 in a Hugging Face config: the native model's RoPE table is built for
    the positions used, not up front (tens of GB), through convert and through from_pretrained."""
    source = _edited_source(tmp_path, "src", max_position_embeddings=10**9)
    assert main(["convert", str(source), str(tmp_path / "native-hf"), "--set", "layout=native", "--no-verify"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "native-hf")
    assert isinstance(model, AttnResForCausalLM) and model.config.max_seq_len == 10**9
    assert model.model.rope_cos.numel() < 10**7
    x = torch.randint(0, SMALL["vocab_size"], (1, 12))
    with torch.no_grad():
        assert torch.isfinite(model(x).logits).all()
