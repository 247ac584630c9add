"""TrainConfig.retrofit_step: PreNorm for S steps, then the configured residual with the same function
(zero queries, eps scaled) and a fresh optimizer; what experiments/retrofit.toml measures."""

import json
from pathlib import Path

import pytest
from corpora import write_pseudo_english

from attnres.train.config import build_configs
from attnres.train.trainer import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_pseudo_english(tmp_path_factory.mktemp("corpus"), works=8, words_per_work=3000)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))


def rows(run_dir, kind):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def run(corpus, out, **overrides):
    model, train = build_configs(
        "tiny",
        {
            "data": corpus,
            "out_dir": str(out),
            "progress": False,
            "steps": 20,
            "eval_every": 5,
            "retrofit_step": 10,
            **overrides,
        },
    )
    trainer = Trainer(model, train)
    return trainer, trainer.run()


def test_the_switch_keeps_the_function_and_the_first_steps(corpus, tmp_path):
    trainer, _ = run(corpus, tmp_path / "block", residual="block", attnres_scale_norm_eps=True)
    assert trainer.model_config.residual == "block" and trainer.model.residual.queries.abs().sum() > 0
    (switch,) = rows(tmp_path / "block", "retrofit")
    assert switch["step"] == 10 and switch["max_logit_change"] < 1e-4 and switch["routing_entropy"] > 0.999
    after = [r for r in rows(tmp_path / "block", "eval") if r["step"] > 10]
    assert after and all("query_norm" in r and 0 < r["routing_entropy"] <= 1 for r in after)
    _, _ = run(corpus, tmp_path / "prenorm", residual="prenorm")
    first = [r["loss"] for r in rows(tmp_path / "block", "train")][:10]
    assert first == [r["loss"] for r in rows(tmp_path / "prenorm", "train")][:10]  # the same PreNorm model
    assert not rows(tmp_path / "prenorm", "eval")[-1].get("query_norm")


def test_bad_retrofit_requests(corpus, tmp_path):
    with pytest.raises(ValueError, match="retrofit_step=20 is invalid: must be below steps=20"):
        build_configs("tiny", {"steps": 20, "retrofit_step": 20})
    with pytest.raises(ValueError, match="attnres_scale_norm_eps=true"):
        run(corpus, tmp_path / "x", residual="full")
