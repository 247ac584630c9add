"""The snippets of README.md and of every docs/*.md, run as written so that they cannot drift.

Every ```python block runs: the blocks of one file in order, in one namespace, as a reader pasting them
into one session would, with small stand-ins for the inputs the text leaves to the reader (the
``STAND_INS`` below; a file without stand-ins must be self-contained). A block that needs what a test
machine lacks (a GPU, several torchrun processes) is fenced ```python no-run and is only compiled.
The values the README's comments state are compared with what runs, and every ``attnres`` command of
the ```bash blocks parses with the real CLI parser."""

from __future__ import annotations

import ast
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from attnres.cli import build_parser

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the snippets load local directories only
ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def fenced(path: Path, language: str) -> list[tuple[str, str]]:
    """(info string after the language, code) of every block of ``language`` in ``path``."""
    return [(info.strip(), code) for lang, info, code in FENCE.findall(path.read_text()) if lang == language]


def blocks(path: Path, language: str = "python") -> list[str]:
    """The blocks of ``language`` that run (``no-run`` ones left out)."""
    return [code for info, code in fenced(path, language) if "no-run" not in info.split()]


def commands(path: Path) -> list[list[str]]:
    """Every ``attnres`` command of the bash blocks, as argv after ``attnres`` (torchrun ``-m attnres`` too)."""
    found = []
    for _, block in fenced(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index(";") if ";" in words else len(words)
                command, words = words[:cut], words[cut + 1 :]
                if command[:1] == ["attnres"]:
                    found.append(command[1:])
                elif command[:1] == ["torchrun"]:
                    found.append(command[command.index("attnres") + 1 :])
    return found


ALL_COMMANDS = [(rel(path), argv) for path in FILES for argv in commands(path)]


def comment_after(code: str, expression: str) -> str:
    """The comment the snippet writes after ``expression`` on its line."""
    match = re.search(re.escape(expression) + r"\s*#(.*)", code)
    assert match, f"the snippet no longer comments {expression}"
    return match.group(1)


# ----------------------------------------------------------------------------- the inputs of each file


def op_inputs() -> dict:
    """The op alone: sources [K, B, T, D] and the parameters of one sublayer."""
    g = torch.Generator().manual_seed(0)
    return {
        "sources": torch.randn(3, 2, 5, 16, generator=g),
        "query": torch.randn(16, generator=g),
        "key_norm_weight": 1 + 0.1 * torch.randn(16, generator=g),
    }


def inference_inputs() -> dict:
    """docs/inference.md: a model and the prompts the text leaves to the reader."""
    from attnres import AttnResLM, ModelConfig

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(vocab_size=4096, d_model=32, n_layers=2, n_heads=4, residual="block"))
    return {
        "model": model.eval(),
        "prompt": torch.randint(1, 4096, (1, 12), generator=g),
        "next_token": torch.tensor([[7]]),
        "long_prompt": torch.randint(1, 4096, (1, 200), generator=g),
        "padded_ids": torch.randint(1, 4096, (2, 9), generator=g),
        "padding_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9]),
    }


def test_every_python_block_is_accounted_for():
    """The files whose snippets need stand-ins have the blocks this test gives them; every block, run
    or not, at least compiles."""
    assert len(blocks(ROOT / "README.md")) == 4, "a new ```python block in README.md: give it its inputs here"
    assert len(blocks(ROOT / "docs" / "inference.md")) == 1
    assert len(blocks(ROOT / "docs" / "hf.md")) == 3
    for path in FILES:
        for info, code in fenced(path, "python"):
            compile(code, f"{rel(path)} ({info or 'python'})", "exec")
    assert len(ALL_COMMANDS) >= 40


@pytest.mark.parametrize("where, argv", ALL_COMMANDS, ids=[f"{w}: {' '.join(a)}" for w, a in ALL_COMMANDS])
def test_every_attnres_command_parses(where, argv):
    args = build_parser().parse_args(argv)
    assert callable(args.func)
    if getattr(args, "stop", None) is not None:
        assert args.stop == "\n\n"  # the shell passes backslash-n; the CLI turns it into a newline


def test_the_readme_snippets_run_and_state_what_they_compute():
    own_model, use_it, op, _ = blocks(ROOT / "README.md")
    namespace: dict = {}
    exec(own_model, namespace)  # self-contained
    shape = re.search(r"(\[[\d, ]+\])", comment_after(own_model, "residual.finish(depth)")).group(1)
    assert list(namespace["y"].shape) == ast.literal_eval(shape)
    namespace = op_inputs()
    torch.manual_seed(0)
    exec(use_it, namespace)
    # the values the comments state
    sources = ast.literal_eval(re.search(r"(\[.*\])", comment_after(use_it, "out.record.sources[5]")).group(1))
    assert namespace["out"].record.sources[5] == sources
    shape = re.search(r"= (\[[\d, ]+\])", comment_after(use_it, "out.record.weights[5]")).group(1)
    assert list(namespace["out"].record.weights[5].shape) == ast.literal_eval(shape)
    assert list(namespace["logits"].shape) == ast.literal_eval(comment_after(use_it, "(2, 64)))").strip())
    exec(op, namespace)
    assert namespace["h"].shape == (2, 5, 16)
    for merged, whole in zip(namespace["merged"], namespace["out"].stats, strict=True):
        torch.testing.assert_close(merged, whole)


def test_the_inference_snippet_runs(tmp_path, monkeypatch):
    import torch.distributed as dist

    (code,) = blocks(ROOT / "docs" / "inference.md")
    namespace = inference_inputs()
    # sharded_prefill runs under torch.distributed: one process is a group of one
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}")
    try:
        exec(code, namespace)
    finally:
        dist.destroy_process_group()
    assert namespace["logits"].shape == (2, 9, 4096)


SELF_CONTAINED = [rel(p) for p in FILES if p.name not in ("README.md", "inference.md", "hf.md") and blocks(p)]


@pytest.mark.parametrize("where", SELF_CONTAINED)
def test_the_snippets_of_the_other_docs_run(where, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    torch.manual_seed(0)
    for code in blocks(ROOT / where):
        exec(compile(code, where, "exec"), namespace)


def hf_directories(transformers):
    """In the current directory, what the Hugging Face snippets name: a local LLaMA with 8 sublayers,
    a run of attnres train (BPE tokenizer, a small local corpus) and its Hugging Face export."""
    from attnres import AttnResLM, ModelConfig
    from attnres.checkpoint import save_checkpoint
    from attnres.data import train_bpe
    from attnres.hf import convert_directory
    from attnres.train.config import TrainConfig

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=32,
        )
    ).save_pretrained("path/to/llama")
    transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=32,
        )
    ).save_pretrained("path/to/qwen3")
    Path("corpus").mkdir()
    for i in range(5):
        Path(f"corpus/work{i}.txt").write_text(f"ROMEO: work {i}, " + "soft light breaks. " * (10 + i))
    texts = [p.read_text() for p in sorted(Path("corpus").iterdir())]
    bpe = train_bpe(texts + ["x\n\n"] * 20, vocab_size=300)
    lm = AttnResLM(ModelConfig(vocab_size=bpe.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=64))
    save_checkpoint(
        "runs/block/checkpoint",
        model=lm,
        optimizer=None,
        step=5,
        train_state={},
        model_config=lm.config.to_dict(),
        train_config=TrainConfig(data="corpus", val_fraction=0.4, out_dir="runs/block").to_dict(),
    )
    bpe.save("runs/block/tokenizer.json")
    convert_directory("runs/block", "out/block-hf", log=lambda line: None)
    return lm


def test_the_hugging_face_snippets_run(tmp_path, monkeypatch):
    """README's tour stop and docs/hf.md's first block, in one set of local directories."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    lm = hf_directories(transformers)
    namespace = {"input_ids": torch.randint(0, 96, (1, 5))}
    exec(blocks(ROOT / "README.md")[3], namespace)
    assert namespace["out"].shape[0] == 1 and Path("llama-attnres/config.json").is_file()
    namespace = {"input_ids": torch.randint(0, 96, (1, 5))}
    exec(blocks(ROOT / "docs" / "hf.md")[0], namespace)
    assert namespace["greedy"].shape[0] == 2 and namespace["beams"].shape[0] == 2
    assert len(namespace["texts"]) == 2
    assert len(namespace["hidden"]) == 2 * lm.config.n_layers + 1
    assert Path("runs/block-native/state.json").is_file() and Path("runs/block-native/tokenizer.json").is_file()
    namespace = {"input_ids": torch.randint(0, 96, (1, 5))}
    exec(blocks(ROOT / "docs" / "hf.md")[2], namespace)  # the wrapped layout: a Qwen3
    assert namespace["out"].shape == (1, 25) and type(namespace["model"]).__name__ == "AttnResQwen3ForCausalLM"


def test_the_harness_snippet_runs(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    hf_directories(transformers)
    namespace: dict = {}
    exec("import attnres.hf\n" + blocks(ROOT / "docs" / "hf.md")[1], namespace)  # the block above imported it
    assert namespace["results"]["bits_per_byte,none"] > 0
