"""`attnres bench train --variants`: NAME[:IMPL][:FIELD=VALUE]... selects any ModelConfig option."""

import pytest

from attnres.bench.train import parse_variant, variant_config
from attnres.cli import main

SIZES = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)


def test_parse_variant():
    assert parse_variant("block") == ("block", "two_phase", {})
    assert parse_variant("full:reference") == ("full", "reference", {})
    assert parse_variant("full:attnres_weights=low_rank_query:attnres_query_rank=8") == (
        "full",
        "two_phase",
        {"attnres_weights": "low_rank_query", "attnres_query_rank": 8},
    )
    assert parse_variant("block:fused:attnres_sources=states:attnres_key_norm=false") == (
        "block",
        "fused",
        {"attnres_sources": "states", "attnres_key_norm": False},
    )


def test_variant_config_keeps_its_own_depth_blocks():
    assert variant_config("block", blocks=2, **SIZES).num_blocks == 2
    assert variant_config("block:attnres_block_size=1", blocks=2, **SIZES).num_blocks == 4
    cfg = variant_config("full:attnres_weights=low_rank_query:attnres_query_rank=4", blocks=2, **SIZES)
    assert (cfg.residual, cfg.attnres_weights, cfg.attnres_query_rank) == ("full", "low_rank_query", 4)
    with pytest.raises(ValueError, match="ModelConfig.attnres_query_rank=64 is invalid"):
        variant_config("full:attnres_weights=low_rank_query:attnres_query_rank=64", blocks=2, **SIZES)


def test_bench_train_runs_option_variants(capsys):
    assert (
        main(
            [
                "bench",
                "train",
                "--no-memory",
                "--set",
                "d_model=32",
                "--set",
                "n_layers=2",
                "--set",
                "seq_len=16",
                "--set",
                "batch_size=2",
                "--set",
                "repeats=1",
                "--set",
                "steps_per_repeat=1",
                "--set",
                "warmup=1",
                "--set",
                "vocab_size=64",
                "--set",
                "blocks=2",
                "--variants",
                "block:attnres_weights=low_rank_query:attnres_query_rank=4,gated",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| block:attnres_weights=low_rank_query:attnres_query_rank=4 |" in text and "| gated |" in text


def test_bench_train_process_clock_is_stated_and_checked(capsys):
    """clock=process times CPU time (for a shared machine); the table says so; a bad clock is one line."""
    args = [
        "bench",
        "train",
        "--no-memory",
        "--threads",
        "1",
        "--set",
        "d_model=32",
        "--set",
        "n_layers=1",
        "--set",
        "seq_len=8",
        "--set",
        "batch_size=2",
        "--set",
        "repeats=2",
        "--set",
        "steps_per_repeat=1",
        "--set",
        "warmup=1",
        "--set",
        "vocab_size=64",
        "--set",
        "blocks=2",
        "--variants",
        "block",
    ]
    assert main(args + ["--set", "clock=process"]) == 0
    text = capsys.readouterr().out
    assert "; step time is process CPU time" in text and "| block |" in text
    assert main(args + ["--set", "clock=cpu"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "attnres bench: error: clock='cpu' is invalid: choose one of ('wall', 'process') "
        "(wall: elapsed time; process: CPU time, for a shared machine at --threads 1)"
    )
