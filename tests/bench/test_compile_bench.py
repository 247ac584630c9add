"""`attnres bench compile`: each start is a fresh process over the variant's own cache directory, the first
cold and the next warm; ratios are to prenorm's start of the same number; bad input is one clear error."""

from __future__ import annotations

import pytest

from attnres.bench import BENCHES, bench_config, compile, run_bench

TINY = {
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 1,
    "seq_len": 8,
    "batch_size": 2,
    "vocab_size": 64,
    "blocks": 2,
    "warmup": 1,
    "steps": 1,
}


def test_a_start_times_the_compiled_steps_in_this_process():
    cfg = compile.CompileBenchConfig(**TINY, backend="aot_eager")
    got = compile.start(cfg, "block")
    assert got["build_s"] > 0 and got["warmup_s"] > 0 and got["step_s"] > 0


def test_starts_run_in_fresh_processes_over_their_own_cache(monkeypatch):
    seen = []

    def fake(cfg, variant, cache, threads):
        seen.append((variant, cache))
        first = sum(v == variant for v, _ in seen) == 1
        return {"build_s": 0.1, "warmup_s": (10.0 if first else 1.0) * (2 if variant == "block" else 1), "step_s": 0.01}

    monkeypatch.setattr(compile, "_fresh_start", fake)
    result = compile.run(compile.CompileBenchConfig(**TINY, variants=["block"], starts=2))
    assert [v for v, _ in seen] == ["prenorm", "prenorm", "block", "block"]  # prenorm added, first
    assert seen[0][1] == seen[1][1] != seen[2][1] == seen[3][1]  # one directory per variant, kept across starts
    assert result["rows"]["block"]["warmup_ratio"] == [2.0, 2.0]
    assert result["rows"]["prenorm"]["warmup_s"] == [10.0, 1.0]
    table = BENCHES["compile"].format_table(result)
    assert "start 1 (cold) s" in table and "start 2 (warm) s" in table
    assert "| block | 20.0 | 2.00 | 2.0 | 2.00 |" in table


def test_one_real_start_in_a_fresh_process():
    cfg = bench_config("compile", **{**TINY, "backend": "aot_eager", "variants": ["prenorm"], "starts": 1})
    result = run_bench("compile", cfg)
    (row,) = result["rows"].values()
    assert row["warmup_ratio"] == [1.0] and row["warmup_s"][0] > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"starts": 0}, "starts=0"),
        ({"variants": ["nonsense"]}, "not a residual scheme"),
        ({"blocks": 9}, "attnres_blocks=9"),
    ],
)
def test_bad_input_is_one_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        run_bench("compile", bench_config("compile", **{**TINY, **options}))
