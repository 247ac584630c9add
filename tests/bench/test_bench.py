"""Benchmark commands run end to end on tiny configs (the numbers themselves are for humans)."""
import json

from attnres.cli import main

TINY_TRAIN = ["--set", "d_model=32", "--set", "n_layers=2", "--set", "seq_len=16", "--set", "batch_size=2",
              "--set", "repeats=2", "--set", "steps_per_repeat=1", "--set", "warmup=1",
              "--set", "vocab_size=64", "--set", "blocks=2"]


def test_bench_train_table_json_and_memory(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *TINY_TRAIN, "--variants", "block,full:reference", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| prenorm |" in text and "| block |" in text and "| full:reference |" in text
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"prenorm", "block", "full:reference"}  # prenorm is always the baseline
    assert rows["prenorm"]["step_ratio"] == 1.0
    for r in rows.values():
        assert r["step_ms_median"] > 0 and r["peak_mib"] > 0 and r["peak_ratio"] > 0
    assert rows["block"]["params"] > rows["prenorm"]["params"]


def test_bench_op_table(capsys):
    assert main(["bench", "op", "--set", "batch_size=1", "--set", "seq_len=8", "--set", "d_model=16",
                 "--set", "sources=[3]", "--set", "repeats=2"]) == 0
    text = capsys.readouterr().out
    for impl in ("fused", "reference", "two_phase"):
        assert f"| 3 | {impl}" in text


def test_bench_bad_option(capsys):
    assert main(["bench", "op", "--set", "widgets=3"]) == 2
    assert "unknown benchmark option" in capsys.readouterr().err


def test_memory_probe_is_not_inherited_from_the_parent():
    """A probe launched by a process that once held a lot of memory reports its own peak."""
    import torch

    from attnres.bench.train import BenchConfig, measure_memory

    cfg = BenchConfig(d_model=32, n_layers=2, seq_len=16, batch_size=2, vocab_size=64, blocks=2)
    small = measure_memory(cfg, "prenorm")["peak_mib"]
    hog = torch.ones(512 * 2**20 // 4)  # 512 MiB resident in this (parent) process
    hog += 1
    again = measure_memory(cfg, "prenorm")["peak_mib"]
    del hog
    assert again < small + 256, (small, again)
