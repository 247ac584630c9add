"""The roofline overhead: the paper's Table-1 byte counts, and a lower bound on what our streams move."""

import pytest
import torch

from attnres import AttnResLM, ModelConfig
from attnres.bench.roofline import (
    BACKWARD_FACTOR,
    copy_bandwidth,
    forward_vectors_per_token,
    roofline,
)
from attnres.residual import IOCounter, observing

SIZES = dict(vocab_size=64, d_model=32, n_layers=8, n_heads=2, max_seq_len=16)


def test_table_1_counts_per_sublayer():
    # Block, N = 8 blocks of S = 2 (L = 16): (N/S + 5) d against the standard 3 d -> 6 d per sublayer
    block = ModelConfig(**SIZES, residual="block", attnres_blocks=8)
    assert forward_vectors_per_token(block) == pytest.approx(16 * (8 / 2 + 2))
    # Full on the two-phase schedule, G = 4 (L = 16): (G + L/G) d against 3 d -> 5 d per sublayer
    full = ModelConfig(**SIZES, residual="full", attnres_group_size=4)
    assert forward_vectors_per_token(full) == pytest.approx(16 * (4 + 16 / 4 - 3))
    # uneven blocks: each block's sublayers read the N sources once per block, plus 2 d each
    uneven = ModelConfig(**SIZES, residual="block", attnres_block_sizes=[4, 4, 6, 2])
    assert forward_vectors_per_token(uneven) == pytest.approx(4 * 4 + 2 * 16)


def test_roofline_turns_bytes_into_time_and_ratio():
    config = ModelConfig(**SIZES, residual="block", attnres_blocks=8)
    r = roofline(config, batch_size=2, seq_len=16, bandwidth=1e9, prenorm_step_s=0.01)
    vectors = 16 * 6 * (1 + BACKWARD_FACTOR)
    assert r.extra_bytes == pytest.approx(vectors * 2 * 16 * 32 * 4)
    assert r.ratio == pytest.approx(1 + r.extra_bytes / 1e9 / 0.01)


@pytest.mark.parametrize(
    "overrides",
    [{"residual": "block", "attnres_blocks": 4}, {"residual": "full"}, {"residual": "block", "attnres_impl": "fused"}],
)
def test_the_limit_is_below_what_the_streams_move(overrides):
    """The limit is a lower bound: our streams' counted forward traffic (IOCounter, d-vectors per token,
    PreNorm's 3 per sublayer taken off) never falls under it."""
    config = ModelConfig(**SIZES, **overrides)
    model = AttnResLM(config)
    with observing(model.residual, IOCounter()) as counter, torch.no_grad():
        model(torch.randint(0, 64, (1, 3)))
    moved = sum(counter.reads) + sum(counter.writes) - 3 * config.n_sublayers
    assert forward_vectors_per_token(config) <= moved


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="residual='prenorm' has no roofline"):
        forward_vectors_per_token(ModelConfig(**SIZES, residual="prenorm"))
    config = ModelConfig(**SIZES, residual="full")
    with pytest.raises(ValueError, match="bandwidth=0"):
        roofline(config, batch_size=1, seq_len=1, bandwidth=0, prenorm_step_s=1.0)


def test_copy_bandwidth_is_a_plausible_measurement():
    bandwidth = copy_bandwidth(n_bytes=4 * 2**20, rounds=3)
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s


def test_the_sweep_prints_measured_beside_the_limit_and_draws_it(tmp_path):
    from attnres.bench import bench_config, format_result, run_bench

    plot = tmp_path / "roofline.png"
    cfg = bench_config(
        "roofline",
        widths=[16, 32],
        n_layers=2,
        seq_len=8,
        batch_size=2,
        vocab_size=64,
        blocks=2,
        warmup=1,
        repeats=2,
        steps_per_repeat=1,
        plot=str(plot),
    )
    result = run_bench("roofline", cfg)
    points = result["points"]
    assert [(p["width"], p["residual"], p["mode"]) for p in points] == [
        (w, r, "eager") for w in (16, 32) for r in ("block", "full")
    ]
    for p in points:
        config = ModelConfig(
            vocab_size=64,
            d_model=p["width"],
            n_layers=2,
            n_heads=1,
            max_seq_len=8,
            residual=p["residual"],
            **({"attnres_blocks": 2} if p["residual"] == "block" else {}),
        )
        vectors = forward_vectors_per_token(config) * (1 + BACKWARD_FACTOR)
        least_ms = vectors * 2 * 8 * p["width"] * 4 / (result["bandwidth_gbs"] * 1e9) * 1e3
        assert p["limit_extra_ms"] == pytest.approx(least_ms)
        assert p["extra_over_limit"] == pytest.approx(p["extra_ms"] / p["limit_extra_ms"])
    table = format_result("roofline", result)
    assert "| 32 | eager | full |" in table and "least extra ms" in table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sweep_checks_every_width_like_bench_train():
    from attnres.bench import bench_config, run_bench

    with pytest.raises(ValueError, match="widths"):
        bench_config("roofline", widths="0,128")
    # the memory of the widest point is checked before anything is built
    with pytest.raises(ValueError, match="batch_size"):
        run_bench("roofline", bench_config("roofline", widths=[64, 4096], batch_size=10**5, seq_len=4096))


def _point(width, residual, ratio, limit, extra_ms, least_ms, warmup=None, mode="eager"):
    return {
        "width": width,
        "mode": mode,
        "residual": residual,
        "measured_ratio": ratio,
        "ratio_p25": ratio - 0.01,
        "ratio_p75": ratio + 0.01,
        "limit_ratio": limit,
        "extra_ms": extra_ms,
        "limit_extra_ms": least_ms,
        "extra_over_limit": extra_ms / least_ms,
        "warmup_ratio": warmup,
    }


def _process(bandwidth, block_ratio, full_ratio, warmup):
    config = {"n_layers": 8, "seq_len": 128, "batch_size": 4, "head_dim": 64, "blocks": 8, "device": "cpu"}
    return {
        "config": {**config, "repeats": 3, "clock": "process", "plot": ""},
        "bandwidth_gbs": bandwidth,
        "threads": 1,
        "torch": "2",
        "points": [
            _point(128, "block", block_ratio, 1.02, 10 * (block_ratio - 1), 0.2),
            _point(128, "full", full_ratio, 1.01, 10 * (full_ratio - 1), 0.1),
            _point(128, "block", block_ratio - 0.05, 1.04, 1.0, 0.2, warmup, mode="compiled"),
        ],
    }


def test_processes_are_aggregated_point_by_point(tmp_path):
    """Each point's numbers over processes: the median of the per-process ones, with min / max; the copy
    bandwidth likewise; the table shows median [min-max] and the plot draws it."""
    from attnres.bench import format_result
    from attnres.bench.roofline import draw
    from attnres.bench.spread import aggregate

    runs = [_process(5.0, 1.20, 1.30, 3.0), _process(4.0, 1.10, 1.40, 2.0), _process(6.0, 1.30, 1.35, 4.0)]
    runs[1]["points"].reverse()  # points are matched by width, mode and scheme, not position
    merged = aggregate("roofline", runs)
    assert merged["processes"] == 3 and merged["runs"] == runs
    block = merged["spread"]["d=128 eager block"]
    assert block["measured_ratio"] == pytest.approx({"min": 1.10, "median": 1.20, "max": 1.30, "n": 3})
    assert block["extra_ms"]["median"] == pytest.approx(2.0)
    assert block["extra_over_limit"]["median"] == pytest.approx(10.0)
    assert "warmup_ratio" not in block  # eager points have no warm-up
    compiled = merged["spread"]["d=128 compiled block"]
    assert compiled["warmup_ratio"] == {"min": 2.0, "median": 3.0, "max": 4.0, "n": 3}
    assert merged["spread"]["run"]["bandwidth_gbs"] == {"min": 4.0, "median": 5.0, "max": 6.0, "n": 3}
    assert merged["bandwidth_gbs"] == 5.0
    full = next(p for p in merged["points"] if p["residual"] == "full")
    assert full["measured_ratio"] == pytest.approx(1.35) and full["limit_ratio"] == pytest.approx(1.01)
    assert runs[0]["points"][0]["measured_ratio"] == 1.20  # the inputs are not modified

    table = format_result("roofline", merged)
    assert "| 128 | eager | block | 1.200x [1.100-1.300] | 1.020x [1.020-1.020] |" in table
    assert "copy bandwidth 5.0 [4.0-6.0] GB/s" in table and "over 3 fresh processes" in table
    assert "| row | number |" not in table  # the spread is in the table itself, not a second one
    plot = draw(merged, str(tmp_path / "roofline.png"))
    assert (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.endswith(".png")


def test_the_round_robin_order_may_rotate_but_times_each_scheme_once():
    from attnres.bench import bench_config
    from attnres.bench.roofline import train_config

    cfg = bench_config("roofline", quick=True, variants="full,prenorm,block")
    assert train_config(cfg, 64).variants == ["full", "prenorm", "block"]
    with pytest.raises(ValueError, match="RooflineBenchConfig.variants"):
        train_config(bench_config("roofline", quick=True, variants="prenorm,block"), 64)


def test_processes_run_the_sweep_in_fresh_interpreters(tmp_path, capsys):
    import json

    from attnres.cli import main

    out, plot = tmp_path / "roofline.json", tmp_path / "roofline.png"
    argv = ["bench", "roofline", "--processes", "2", "--threads", "1", "--json", str(out)]
    for s in ("widths=16,32", "n_layers=2", "seq_len=8", "batch_size=2", "vocab_size=64", "blocks=2"):
        argv += ["--set", s]
    argv += ["--set", "warmup=1", "--set", "repeats=2", "--set", "steps_per_repeat=1", "--set", f"plot={plot}"]
    assert main(argv) == 0
    assert "| 32 | eager | full |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and len(result["runs"]) == 2
    assert [run["config"]["variants"] for run in result["runs"]] == [
        ["prenorm", "block", "full"],
        ["block", "full", "prenorm"],
    ]
    assert result["spread"]["d=32 eager full"]["measured_ratio"]["n"] == 2
    assert result["config"]["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
