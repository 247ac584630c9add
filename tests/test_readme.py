"""The code blocks of README.md and of every docs/*.md, run as written so that they cannot drift.

Every block is accounted for (``test_every_block_runs_or_says_why``): it runs here, or ``NOT_RUN`` says
why not (a GPU, several processes, packages or programs a test machine lacks, minutes of benchmarks).

Every ```python block runs: the blocks of one file in order, in one namespace, as a reader pasting them
into one session would, with small stand-ins for the inputs the text leaves to the reader (a model and
prompts for docs/inference.md, local Hugging Face directories; a file without stand-ins must be
self-contained). A block that needs what a test
machine lacks (a GPU, several torchrun processes) is fenced ```python no-run and is only compiled.
The values the README's comments state are compared with what runs. Every shell line of the README's
blocks runs in one temporary directory, in the order printed, so that each line reads what the lines
before it wrote; a training line gets flags that shrink it to seconds (``TINY``) appended, and the
inputs the text leaves to the reader (a local Llama and Kimi Linear checkpoint, a text folder) are
made first. Every ``attnres`` command of every ```bash block parses with the real CLI parser."""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
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
    shape = re.search(r"(\[[\d, ]+\])", comment_after(own_model, "y = forward(x, residual)")).group(1)
    assert list(namespace["y"].shape) == ast.literal_eval(shape)
    # the snippet asserts the zero-query equivalence with the same blocks run as PreNorm, and the eps matching
    # is what makes it hold: without it the snippet's own assertion fails
    assert "torch.testing.assert_close(y, prenorm)" in own_model and 'residual_scheme("prenorm"' in own_model
    unmatched = own_model.replace("attnres.match_prenorm_eps(", "(lambda norms, scheme: None)(")
    assert unmatched != own_model, "the README's own-model snippet no longer calls attnres.match_prenorm_eps"
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        exec(unmatched, {})
    namespace = {}
    torch.manual_seed(0)
    exec(use_it, namespace)
    # the values the comments state
    sources = ast.literal_eval(re.search(r"(\[.*\])", comment_after(use_it, "out.record.sources[5]")).group(1))
    assert namespace["out"].record.sources[5] == sources
    shape = re.search(r"= (\[[\d, ]+\])", comment_after(use_it, "out.record.weights[5]")).group(1)
    assert list(namespace["out"].record.weights[5].shape) == ast.literal_eval(shape)
    assert list(namespace["logits"].shape) == ast.literal_eval(comment_after(use_it, "(2, 64)))").strip())
    namespace = {}
    exec(op, namespace)  # self-contained
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
    namespace = {}
    exec(blocks(ROOT / "README.md")[3], namespace)  # its prompt is its own
    assert namespace["out"].shape == (1, 24) and Path("llama-attnres/config.json").is_file()
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


# ----------------------------------------------------------------------------- every block, accounted for

CODE_LANGUAGES = ("python", "bash", "sh")  # ```text and bare fences are diagrams and sample output
# (file, the start of a block's first line) -> why the suite does not run that block
NOT_RUN = {
    ("README.md", "torchrun --nproc-per-node 4"): "4 torchrun processes; tests/parallel runs these layouts "
    "at 2 and 4 gloo processes, and every line parses here",
    ("docs/cli.md", "attnres train --preset demo"): "benchmarks and torch.compile (inductor) take minutes on "
    "CPU; the README's block runs the train / sample / eval lines, tests/bench and tests/train the rest",
    ("docs/cli.md", "attnres options"): "an experiment and a report over committed runs (minutes); the "
    "convert and bench kimi lines run in the README's blocks",
    ("docs/distributed.md", "# data parallel"): "8 GPUs",
    ("docs/distributed.md", "# on each of 2 nodes"): "2 nodes of 8 GPUs",
    ("docs/distributed.md", "torchrun --nproc-per-node 4"): "4 torchrun processes (tests/parallel)",
    ("docs/distributed.md", "torchrun --nproc-per-node 2"): "2 and 4 torchrun processes (tests/parallel)",
    ("docs/distributed.md", "pip install -e '.[torchtitan]'"): "installs packages",
    ("docs/distributed.md", "torchrun --nproc_per_node 8"): "8 GPUs",
    ("docs/distributed.md", "OMP_NUM_THREADS=1 pytest"): "runs tests/integrations, which the suite runs itself",
    ("docs/distributed.md", "python examples/hf_trainer.py"): "accelerate launch of 2 processes; "
    "tests/examples/test_hf_trainer.py runs the script",
    ("docs/experiments.md", "attnres experiment ablations"): "trains an experiment suite (hours)",
    ("docs/hf.md", "attnres convert path/to/llama"): "the same lines as the README's block, which runs",
    ("docs/hf.md", "attnres convert path/to/qwen3"): "sample output and families (OLMo-2) the test machine has "
    "no checkpoint of; tests/hf converts each family",
    ("docs/kimi_linear.md", "attnres train --preset kimi-demo"): "experiments over both backbones (hours); "
    "the README's Kimi block runs the train, sample, convert and bench lines",
    ("docs/performance.md", "attnres bench train --compile"): "the benchmarks behind the tables (minutes each)",
    ("docs/performance.md", "scripts/gpu_check.sh"): "a GPU; tests/test_gpu_check.py runs its --dry-run",
    ("docs/serving.md", "attnres bench decode"): "torch.compile warm-up: minutes on CPU",
    ("docs/serving.md", "pip install 'attnres[serving]'"): "installs packages; the convert line runs in the "
    "README's Kimi block",
    ("docs/serving.md", "python -m venv"): "builds llama-cpp-python from source (6-22 minutes, a C++ compiler)",
    ("docs/serving.md", "git clone"): "clones and builds llama.cpp (network, a C++ compiler, minutes)",
    ("docs/serving.md", "./build/bin/llama-completion"): "llama.cpp's programs, built as the block above says",
    ("docs/serving.md", "from llama_cpp import Llama"): "llama-cpp-python, which is not installable here (no "
    "wheel; a 6-22 minute source build); scripts/llama_cpp_parity.py makes the same calls where it is",
    ("docs/serving.md", "PYTHONPATH=/tmp/llamacpp-venv"): "llama-cpp-python, which is not installable here "
    "(no wheel; a source build)",
    ("docs/serving.md", "attnres train --preset kimi-tiny --residual block"): "llama-cpp-python's server",
    ("docs/serving.md", "pip install 'attnres[mlx]'"): "installs mlx; `make test-serving` runs tests/serving",
    ("docs/serving.md", "python -m pytest"): "runs tests/serving, which `make test-serving` runs",
    ("docs/serving.md", "attnres convert runs/kimi out/k3-layout"): "the convert verbs run in tests/serving "
    "and tests/kimi on tiny runs",
    ("docs/serving.md", "attnres train --preset kimi-tiny --set"): "the K3 options train in tests/kimi",
}


def code_blocks() -> list[tuple[str, str, str, str]]:
    """(file, language, info, code) of every fenced block of README.md and docs/*.md."""
    return [
        (rel(path), lang, info.strip(), code) for path in FILES for lang, info, code in FENCE.findall(path.read_text())
    ]


def not_run_reason(where: str, code: str) -> str | None:
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    return next((why for (f, start), why in NOT_RUN.items() if f == where and first.startswith(start)), None)


def test_every_block_runs_or_says_why():
    """A python block runs unless fenced no-run (and then NOT_RUN says why); the README's shell blocks run
    (test_the_readme_shell_lines_run); any other shell block is in NOT_RUN with its reason. A block of a new
    kind, or a shell block of the docs without a reason, fails here."""
    used = set()
    for where, lang, info, code in code_blocks():
        assert lang in CODE_LANGUAGES + ("text", ""), f"{where}: a ```{lang} block: run it here or call it text"
        if lang in ("text", ""):
            continue
        why = not_run_reason(where, code)
        if why is not None:
            used.add(next(k for k in NOT_RUN if k[0] == where and code.lstrip().startswith(k[1])))
        runs = (lang == "python" and "no-run" not in info.split()) or (lang != "python" and where == "README.md")
        assert runs or why, f"{where}: this block neither runs in tests/test_readme.py nor says why not:\n{code}"
        assert not (runs and why and where != "README.md"), f"{where}: a block that runs has a NOT_RUN reason"
    assert used == set(NOT_RUN), f"reasons for blocks that no longer exist: {set(NOT_RUN) - used}"


# ----------------------------------------------------------------------------- the README's shell lines

# appended to the README's lines so that each runs in seconds (the flags come last and so win); a
# warmup of its own keeps a shortened run from the cap a preset's warmup would get
TINY_TRAIN = [
    *("--steps", "4", "--warmup-steps", "1", "--batch-size", "2", "--seq-len", "16", "--tokenizer", "byte"),
    *("--set", "d_model=32", "--set", "n_layers=4", "--set", "eval_batches=1", "--set", "checkpoint_every=2"),
    "--no-progress",
]
TINY = {
    "train": TINY_TRAIN,
    "demo": TINY_TRAIN,
    "sample": ["--max-new-tokens", "4"],
    "eval": ["--batches", "2"],
}


def shell_lines(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(shlex.join(words))
    return out


def readme_shell_lines() -> list[str]:
    return [
        line
        for _, lang, _, code in [b for b in code_blocks() if b[0] == "README.md"]
        if lang in ("bash", "sh") and not not_run_reason("README.md", code)
        for line in shell_lines(code)
    ]


def kimi_linear_directory(path: str) -> None:
    """A tiny Kimi Linear checkpoint of transformers (KKKM, 4 experts), what `path/to/kimi-linear` stands for."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_num_heads=2,
        linear_head_dim=8,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=8,
        n_group=1,
        topk_group=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    KimiLinearForCausalLM(config).save_pretrained(path)


def run_shell_line(line: str, capsys) -> str:
    """One line of the README as the shell would run it (``make X``: its recipe, printed by ``make -n -B``);
    returns what it printed."""
    from attnres.cli import main

    words = shlex.split(line)
    if words[0] == "make":
        done = subprocess.run(["make", "-n", "-B", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{line}: {done.stderr}"
        return done.stdout
    if words[0] == "source":  # the virtualenv `make install` creates
        venv = Path(words[1]).parts[0]
        recipe = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert f"-m venv {venv}" in recipe.stdout and words[1] == f"{venv}/bin/activate", line
        return ""
    assert words[0] == "attnres", f"a README shell line this test cannot run: {line}"
    argv = words[1:] + TINY.get(words[1], [])
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{line} (run with {' '.join(TINY.get(words[1], []))}) failed:\n{err[-2000:]}"
    return out + err


def test_the_readme_shell_lines_run(tmp_path, monkeypatch, capsys):
    """Every shell line of the README, chained as printed (`make` lines through their recipes, which run
    `attnres demo`, also run here), at the TINY sizes, in one directory."""
    transformers = pytest.importorskip("transformers")  # the Hugging Face and Kimi Linear stops (the hf extra)
    pytest.importorskip("gguf")  # --to gguf (the serving extra)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    hf_directories(transformers)  # path/to/llama and a corpus/ folder; runs/block is the README's to make
    for d in ("runs", "out"):
        shutil.rmtree(d)
    kimi_linear_directory("path/to/kimi-linear")
    Path("my_texts").mkdir()
    for i in range(4):
        Path(f"my_texts/part{i}.txt").write_text(f"Part {i}. " + "To be, or not to be, that is the question. " * 30)
    lines = readme_shell_lines()
    assert lines[:2] == ["make demo", "make test"] and "source .venv/bin/activate" in lines
    printed = {}
    for line in lines:
        printed[line] = run_shell_line(line, capsys)
    assert "attnres demo" in printed["make demo"]  # what make demo runs, run here too
    run_shell_line("attnres demo", capsys)
    assert {d.name for d in Path("runs/demo").iterdir()} >= {"prenorm", "block", "full", "REPORT.md"}
    for run in ("runs/block", "runs/x", "runs/kimi"):
        assert Path(run, "summary.json").is_file(), run
    assert Path("out/kimi.gguf").stat().st_size > 0 and Path("out/llama-attnres/config.json").is_file()


def test_a_kimi_run_without_the_hf_extra_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    """The README's Kimi stop says it needs the hf extra; without transformers, training stops with one
    line that names the pip install, not a traceback."""
    import sys

    from attnres.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "attnres.model.kimi_linear", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    assert main(["train", "--preset", "kimi-tiny", "--out", "runs/kimi", *TINY_TRAIN]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "error" in line]
    assert line.startswith("attnres train: error: backbone='kimi_linear'") and "pip install -e '.[hf]'" in line
    assert "Traceback" not in err
