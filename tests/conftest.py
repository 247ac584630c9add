"""Fixtures shared by the whole suite. Helper modules (reference.py: float64 references written
loop by loop; stand_in.py: a tiny LM for the training parts) are importable by name because
pyproject.toml puts tests/ on the path."""

import os

# nothing may download at run time: Hugging Face libraries stay offline in every test (set before
# anything imports huggingface_hub, which reads them once)
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

from pathlib import Path

# Triton's interpreter (CPU runs of the kernel tests) must be on before anything imports triton
# (torch.compile tests do); otherwise the kernel tests skip themselves in a full run
import interpreted_triton  # noqa: F401 -- imported for its side effect (TRITON_INTERPRET=1)
import pytest
import torch

from attnres import AttnResLM, ModelConfig

# `make test` runs one pytest-xdist worker per core: each computes on one thread (two workers of
# two OpenMP threads on two cores would spin against each other); a plain `pytest` keeps torch's default
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# reference comparisons must never run under TF32
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

# the tiny decoder the scheme tests share: 3 Transformer blocks = 6 sublayers
TINY = dict(vocab_size=50, d_model=16, n_layers=3, n_heads=2, max_seq_len=16)


# `make test-fast` (pytest -m fast): the float64 op, stream and model tests at tiny sizes, under a
# minute on 2 cores. Marked here by folder and name, so that a new test in these folders joins by
# itself; left out: the Triton kernels (the interpreter is slow), torch.compile, two ranks, a training run
FAST_DIRS = {"ops", "residual", "model"}
NOT_FAST_FILES = {"test_compile.py", "test_block_wrappers.py"}  # torch.compile; two ranks (FSDP)
NOT_FAST_TESTS = {"test_muon_and_adamw_train_with_the_groups"}  # trains, about 10 s
_TESTS = Path(__file__).parent


def _fast(item: pytest.Item) -> bool:
    path = Path(item.path)
    if path.relative_to(_TESTS).parts[0] not in FAST_DIRS or path.name in NOT_FAST_FILES:
        return False
    name = getattr(item, "originalname", item.name)
    return "triton" not in path.name and "compile" not in name and name not in NOT_FAST_TESTS


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _fast(item):
            item.add_marker(pytest.mark.fast)


def tiny_config(residual: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides, "residual": residual})


def tiny_model(residual: str, dtype=torch.float64, seed: int = 0, **overrides) -> AttnResLM:
    """A seeded tiny model with ``residual`` and ``overrides`` on top of TINY (float64 by default)."""
    torch.manual_seed(seed)
    return AttnResLM(tiny_config(residual, **overrides)).to(dtype)


def tiny_tokens(seed: int = 0, b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def pad_batch(prompts, pad_id: int, side: str):
    """Pad the 1-D ``prompts`` to one length on ``side``: (ids [B, T], attention_mask [B, T])."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[row, cols], mask[row, cols] = p, 1
    return ids, mask


@pytest.fixture
def config():
    """Factory fixture: ``config(residual, **overrides)`` -> the tiny ModelConfig."""
    return tiny_config


@pytest.fixture
def make():
    """Factory fixture: ``make(residual, dtype=float64, seed=0, **overrides)`` -> a tiny AttnResLM."""
    return tiny_model


@pytest.fixture
def tokens():
    """Factory fixture: ``tokens(seed=0, b=2, t=7)`` -> random ids below TINY's vocabulary."""
    return tiny_tokens


@pytest.fixture
def pad():
    """Factory fixture: ``pad(prompts, pad_id, side)`` -> (ids [B, T], attention_mask [B, T]) of the 1-D
    ``prompts`` padded on ``side`` ("left" or "right")."""
    return pad_batch
