"""experiments/kimi-linear.toml: its budget, and `attnres experiment` / `attnres report` on a one-step
smoke version of it (kimi-tiny sizes, one seed, a small synthetic corpus)."""

import re
from pathlib import Path

from corpora import write_pseudo_english

from attnres.cli import main
from attnres.experiments import load_spec
from attnres.experiments.spec import expand

SPEC = Path(__file__).resolve().parents[2] / "experiments" / "kimi-linear.toml"


def test_the_spec_fits_its_budget_and_pairs_three_seeds():
    spec = load_spec(str(SPEC))
    runs = expand(spec)
    assert spec.budget_cpu_hours <= 2.0 and spec.report == "kimi-linear"
    estimate = sum(r.estimated_seconds() for r in runs) / 3600
    assert 0.8 * spec.budget_cpu_hours <= estimate <= 1.1 * spec.budget_cpu_hours, estimate
    groups = {}
    for r in runs:
        groups.setdefault((r.labels["backbone"], r.labels["scheme"]), set()).add(r.seed)
        assert r.model.backbone == r.labels["backbone"]
        assert r.train.steps == runs[0].train.steps and r.train.seq_len == runs[0].train.seq_len  # equal tokens
    assert set(groups) == {(b, s) for b in ("kimi_linear", "llama") for s in ("prenorm", "block", "full")}
    assert all(seeds == {0, 1, 2} for seeds in groups.values())


def test_smoke_experiment_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus").mkdir()
    corpus = write_pseudo_english(tmp_path / "corpus", works=6, words_per_work=400)
    text = SPEC.read_text()
    smoke = {
        "preset": '"kimi-tiny"',
        "steps": "1",
        "warmup_steps": "0",
        "eval_every": "1",
        "eval_batches": "1",
        "checkpoint_every": "1",
    }
    for key, value in smoke.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert n == 1, key
    text = text.replace("\nseeds = [0, 1, 2]", "\nseeds = [0]").replace(
        "\nthreads = 1\n", f'\nthreads = 1\ndata = "{corpus}"\nseq_len = 16\nbatch_size = 2\n'
    )
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "kimi-linear.toml").write_text(text)
    args = ["--specs", str(tmp_path / "specs"), "--runs", str(tmp_path / "runs")]
    assert main(["experiment", "kimi-linear", *args, "--no-progress"]) == 0
    assert main(["report", "kimi-linear", *args, "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "REPORT.md").read_text()
    assert "## Kimi Linear (KDA + MLA, MoE)" in report and "## LLaMA (GQA + RoPE, SwiGLU)" in report
    assert "## Does the backbone change the verdict?" in report
    assert (
        "depth_weights_kimi_linear_block.png" in report
        and (tmp_path / "report" / "depth_weights_kimi_linear_full.png").is_file()
    )
    kimi_rows = report.split("## Kimi Linear")[1].split("## LLaMA")[0]
    assert re.search(r"\| prenorm \| [\d,]+ \| 1 \| ", kimi_rows)  # a finished run with its parameters
    assert re.search(r"\| block \|.*\| \d\.\d{3} \|", kimi_rows)  # the MoE balance column is filled
