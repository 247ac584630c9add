"""Shared fixtures: a small synthetic corpus, a private cache, spec files written on the fly, and a run
stripped of its whole-split evaluation."""

import json
import textwrap

import pytest
import torch
from corpora import write_pseudo_english


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Six small 'works' of pseudo-English text, deterministic."""
    return write_pseudo_english(tmp_path_factory.mktemp("corpus"), works=6, words_per_work=1500)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models train 10x faster on one thread, and far more so on a busy machine (two spinning
    OpenMP threads on two shared cores stall); the previous setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNRES_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def _toml(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\") + '"'
    return repr(v)


@pytest.fixture(scope="session")
def tiny_base(corpus):
    """tiny_base(steps=4, **fields) -> a [base] table for runs of about a second: the tiny preset on
    the synthetic corpus."""

    def make(steps=4, **extra):
        fields = {
            "preset": "tiny",
            "data": corpus,
            "steps": steps,
            "warmup_steps": 1,
            "eval_every": 2,
            "eval_batches": 1,
            "checkpoint_every": 2,
            **extra,
        }
        return "[base]\n" + "\n".join(f"{k} = {_toml(v)}" for k, v in fields.items()) + "\n"

    return make


@pytest.fixture
def write_spec():
    """write_spec(directory, name, body) -> path of directory/name.toml (body dedented)."""

    def write(directory, name, body):
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.toml"
        path.write_text(textwrap.dedent(body))
        return path

    return write


@pytest.fixture
def drop_split_eval():
    """drop_split_eval(run_dir): make a finished run look as if it predated the whole-split evaluation."""
    from attnres.experiments.runner import SPLIT_EVAL, SUMMARY_FILE

    def drop(run_dir):
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        del summary[SPLIT_EVAL]
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary))

    return drop
