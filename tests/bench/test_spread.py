"""attnres bench --processes: min / median / max over fresh processes (attnres.bench.spread)."""

import json

import pytest

from attnres.bench import run_bench
from attnres.bench.op import OpBenchConfig
from attnres.bench.spread import aggregate, format_spread, min_median_max, rotated
from attnres.cli import main


def _train_run(prenorm_ms, block_ms, warmup):
    rows = {
        "prenorm": {"step_ms_median": prenorm_ms, "step_ratio": 1.0, "warmup_s": warmup, "params": 10},
        "block": {
            "step_ms_median": block_ms,
            "step_ratio": block_ms / prenorm_ms,
            "warmup_s": warmup + 1,
            "params": 11,
        },
    }
    return {"config": {"repeats": 3}, "rows": rows}


def test_min_median_max():
    assert min_median_max([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0, "n": 4}
    with pytest.raises(ValueError, match="at least one"):
        min_median_max([])


def test_rotated_turns_the_round_robin_order():
    v = ["prenorm", "block", "full"]
    assert [rotated(v, i) for i in range(4)] == [v, ["block", "full", "prenorm"], ["full", "prenorm", "block"], v]


def test_aggregate_takes_each_ratio_within_its_process():
    # process 1 ran at half speed: medians of times move, but its ratio is taken inside it
    runs = [_train_run(100.0, 110.0, 5.0), _train_run(200.0, 206.0, 1.0), _train_run(120.0, 126.0, 2.0)]
    merged = aggregate("train", runs)
    assert merged["processes"] == 3 and merged["runs"] == runs
    block = merged["spread"]["block"]
    assert block["step_ratio"]["min"] == pytest.approx(1.03)
    assert block["step_ratio"]["median"] == pytest.approx(1.05)
    assert block["step_ratio"]["max"] == pytest.approx(1.10)
    assert merged["rows"]["block"]["step_ratio"] == pytest.approx(1.05)  # the median of the ratios
    assert merged["rows"]["block"]["step_ms_median"] == 126.0
    # the compile warm-up is a figure of its own
    assert block["warmup_s"] == {"min": 2.0, "median": 3.0, "max": 6.0, "n": 3}
    assert merged["rows"]["block"]["params"] == 11  # not a headline number: the first run's
    assert runs[0]["rows"]["block"]["step_ratio"] == pytest.approx(1.10)  # the inputs are not modified
    table = format_spread(merged)
    assert "| block | step_ratio | 1.03 | 1.05 | 1.1 |" in table


def test_aggregate_refuses_runs_with_other_rows_and_unknown_benches():
    a, b = _train_run(1.0, 1.0, 0.0), _train_run(1.0, 1.0, 0.0)
    del b["rows"]["block"]
    with pytest.raises(ValueError, match="process 1 measured rows"):
        aggregate("train", [a, b])
    with pytest.raises(ValueError, match="no headline numbers"):
        aggregate("graph", [a])
    with pytest.raises(ValueError, match="at least one"):
        aggregate("train", [])


def test_op_rows_are_matched_by_k_and_impl():
    def run(bwd):
        return {"rows": [{"K": 8, "impl": "fused", "fwd_ms": 1.0, "bwd_ms": bwd, "bwd_frac_of_copy": 1 / bwd}]}

    merged = aggregate("op", [run(2.0), run(4.0)])
    assert merged["spread"]["K=8 fused"]["bwd_ms"] == {"min": 2.0, "median": 3.0, "max": 4.0, "n": 2}
    assert merged["rows"][0]["bwd_ms"] == 3.0


def test_processes_run_fresh_interpreters(tmp_path, capsys):
    out = tmp_path / "op.json"
    argv = ["bench", "op", "--processes", "2", "--threads", "1", "--json", str(out)]
    sizes = ["batch_size=1", "seq_len=4", "d_model=8", "sources=[2]", "repeats=2", "queries=2"]
    for s in sizes:
        argv += ["--set", s]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "over 2 processes" in text and "| K=2 fused | bwd_ms |" in text
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and len(result["runs"]) == 2
    assert result["spread"]["K=2 reference"]["fwd_ms"]["n"] == 2


def test_processes_must_be_positive_and_benches_that_support_them():
    with pytest.raises(ValueError, match="at least 1"):
        run_bench("op", OpBenchConfig(), processes=0)
    with pytest.raises(ValueError, match="runs in one process only"):
        run_bench("kimi", None, processes=2)
