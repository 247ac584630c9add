"""lm-evaluation-harness runs our Hugging Face model on the local validation task (attnres.hf.harness)."""

import json
import math

import pytest
import torch
from reference import randomize

from attnres.checkpoint import save_checkpoint
from attnres.data import Document, load_documents, split_documents, train_bpe
from attnres.hf import AttnResConfig, AttnResForCausalLM, hf_tokenizer
from attnres.hf.harness import (
    TASK,
    validation_documents,
    write_task,
    write_validation_task,
)
from attnres.train.config import TrainConfig

TEXTS = ["the quick brown fox jumps over the lazy dog. " * 3, "ROMEO: But soft, what light through yonder window?"]


def test_the_task_is_local_files_naming_the_run_validation_documents(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"work{i}.txt").write_text(f"work {i}: " + "some words here " * (20 + i))
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2))
    save_checkpoint(
        tmp_path / "run" / "checkpoint",
        model=model.model,
        optimizer=None,
        step=1,
        train_state={},
        model_config=model.config.model_config().to_dict(),
        train_config=TrainConfig(data=str(corpus), val_fraction=0.3).to_dict(),
    )
    expected = split_documents(load_documents(str(corpus)), 0.3)[1]
    assert [d.name for d in validation_documents(tmp_path / "run")] == [d.name for d in expected]
    task_dir = write_validation_task(tmp_path / "run", tmp_path / "task")
    rows = [json.loads(line) for line in (task_dir / f"{TASK}.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == [d.text for d in expected]
    task = json.loads((task_dir / f"{TASK}.yaml").read_text())
    assert task["dataset_path"] == "json" and task["dataset_kwargs"]["data_files"]["validation"].startswith("/")
    save_checkpoint(
        tmp_path / "bare",
        model=model.model,
        optimizer=None,
        step=0,
        train_state={},
        model_config=model.config.model_config().to_dict(),
        train_config={},
    )
    with pytest.raises(ValueError, match="records no train config"):
        validation_documents(tmp_path / "bare")


def test_harness_perplexity_equals_our_rolling_log_likelihood(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    bpe = train_bpe(TEXTS * 10 + ["x\n\n"] * 20, vocab_size=300)
    tokenizer = hf_tokenizer(bpe)
    torch.manual_seed(0)
    model = AttnResForCausalLM(
        AttnResConfig(vocab_size=bpe.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, residual="block")
    )
    randomize(model.model.residual)
    model = model.double().eval()
    task_dir = write_task(tmp_path / "task", [Document(name=f"d{i}", text=t) for i, t in enumerate(TEXTS)])
    harness = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1, device="cpu")
    result = simple_evaluate(
        model=harness, tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir)), log_samples=False
    )["results"][TASK]
    # each document fits one window: its tokens given the eos (the document separator) before them
    log_likelihood, n_bytes = 0.0, 0
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([[tokenizer.eos_token_id] + bpe.encode(text)])
            logp = torch.log_softmax(model(ids[:, :-1]).logits, dim=-1)
            log_likelihood += logp.gather(-1, ids[:, 1:, None]).sum().item()
            n_bytes += len(text.encode())
    assert result["bits_per_byte,none"] == pytest.approx(-log_likelihood / n_bytes / math.log(2), rel=1e-9)
    assert result["byte_perplexity,none"] == pytest.approx(math.exp(-log_likelihood / n_bytes), rel=1e-9)


def test_model_args_start_a_byte_tokenizer_run_with_its_newline(tmp_path, monkeypatch):
    """A byte-tokenizer run has no bos or eos: without prefix_token_id the harness has no token to start
    each document with (and needed ``prefix_token_id=10`` typed by hand)."""
    from attnres.data import ByteTokenizer
    from attnres.hf.harness import model_args

    assert model_args("out/x", tokenizer=hf_tokenizer(ByteTokenizer())) == "pretrained=out/x,prefix_token_id=10"
    bpe = train_bpe(TEXTS * 10 + ["x\n\n"] * 20, vocab_size=300)
    assert model_args("out/y", tokenizer=hf_tokenizer(bpe)) == "pretrained=out/y"  # its eos starts documents

    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from attnres.hf import convert_directory
    from attnres.model import AttnResLM, ModelConfig

    torch.manual_seed(0)
    lm = AttnResLM(ModelConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, max_seq_len=256))
    save_checkpoint(
        tmp_path / "run" / "checkpoint",
        model=lm,
        optimizer=None,
        step=1,
        train_state={},
        model_config=lm.config.to_dict(),
        train_config=TrainConfig(tokenizer="byte").to_dict(),
    )
    ByteTokenizer().save(str(tmp_path / "run" / "tokenizer.json"))
    convert_directory(tmp_path / "run", tmp_path / "hf", log=lambda line: None)
    task_dir = write_task(tmp_path / "task", [Document(name="d", text=TEXTS[1])])
    result = simple_evaluate(
        model="hf",
        model_args=model_args(tmp_path / "hf"),
        tasks=[TASK],
        device="cpu",
        task_manager=TaskManager(include_path=str(task_dir)),
    )["results"][TASK]
    assert result["bits_per_byte,none"] > 0
