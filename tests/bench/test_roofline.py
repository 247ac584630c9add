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
