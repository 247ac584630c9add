"""Benchmark commands run end to end on tiny configs (the numbers themselves are for humans)."""

import json

import pytest

from attnres.cli import main
from attnres.ops.two_phase import library

TINY_SIZES = [
    "--set",
    "d_model=32",
    "--set",
    "n_layers=2",
    "--set",
    "seq_len=16",
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
]
TINY_TRAIN = [*TINY_SIZES, "--set", "blocks=2"]


def test_bench_train_table_json_and_memory(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert (
        main(
            [
                "bench",
                "train",
                *TINY_TRAIN,
                "--set",
                "profile_rounds=1",
                "--variants",
                "block,full:reference",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| prenorm |" in text and "| block |" in text and "| full:reference |" in text
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"prenorm", "block", "full:reference"}  # prenorm is always the baseline
    assert rows["prenorm"]["step_ratio"] == 1.0
    for r in rows.values():
        assert r["step_ms_median"] > 0 and r["peak_mib"] > 0 and r["peak_ratio"] > 0
        assert r["compiler_mib"] == 0 and r["tensor_step_peak_mib"] > 0  # eager rows compile nothing
        assert len(r["times_ms"]) == 2
        assert r["repeat_ratio_p25"] <= r["repeat_ratio_median"] <= r["repeat_ratio_p75"]
        b = r["breakdown"]
        assert b["generated_ms"] == b["generated_backward_ms"] == 0 and b["matmul_ms"] > 0 and b["optimizer_ms"] > 0
        assert b["matmul_ms"] + b["kernels_ms"] + b["optimizer_ms"] + b["rest_ms"] == pytest.approx(b["step_ms"])
    assert rows["prenorm"]["repeat_ratio_median"] == 1.0
    assert rows["prenorm"]["breakdown"]["ratio_at_equal_matmul"] == 1.0
    # with the compiled CPU kernel, eager Block AttnRes makes exactly PreNorm's matmuls (its depth attention
    # runs in the kernel), so its equal-matmul ratio is given; without it (and in the reference form) the
    # depth attention's matrix-vector products are matmuls of its own and no equal-matmul ratio applies
    from attnres.ops.two_phase import cpu

    block, base = rows["block"]["breakdown"], rows["prenorm"]["breakdown"]
    if cpu.kernel() is not None:
        assert block["matmul_calls"] == base["matmul_calls"] and block["ratio_at_equal_matmul"] > 0
    else:
        assert block["matmul_calls"] > base["matmul_calls"] and "ratio_at_equal_matmul" not in block
        assert "- (other matmuls)" in text
    assert block["kernels_ms"] > 0 and base["kernels_ms"] == 0  # the two-phase autograd Functions' own time
    assert "Where a step goes" in text
    assert rows["block"]["params"] > rows["prenorm"]["params"]


def test_tensor_step_peak_follows_the_allocators_events(monkeypatch):
    """The tensor step peak is the most bytes alive at once beyond what was alive before the step:
    allocations and frees in order, exactly."""
    import torch

    from attnres.bench import train

    def step(model, opt, x, y):
        a = torch.ones(2 * 2**20)  # 8 MiB
        b = torch.ones(2**20)  # 4 MiB: 12 alive
        del a
        c = torch.ones(2 * 2**20)  # 12 again
        del b, c
        return torch.ones(2**18)  # 1 MiB, freed by the caller

    monkeypatch.setattr(train, "_step", step)
    assert train.tensor_step_peak_mib(None, None, None, None) == pytest.approx(12.0, abs=0.01)


def test_step_breakdown_sorts_the_profilers_self_time(monkeypatch):
    """Matmuls outside the optimizer, a compiled graph's own time, and the optimizer (Muon's
    Newton-Schulz matmuls included) are told apart, and the parts add up to the profiled step."""
    import torch
    from torch.profiler import record_function

    from attnres.bench import train

    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.Muon([w], lr=1e-3)
    a = torch.randn(256, 256)

    def step(model, opt_, x, y):
        h = a @ a  # one matmul
        with record_function("## Call CompiledFxGraph fake ##"):  # what inductor's wrapper records
            for _ in range(20):
                h = torch.tanh(h) * 0.5  # the graph's own loops: its self time
            h = h @ a  # a library matmul called from the graph: still a matmul
        library.phase1_op(list(h[:, :64].reshape(4, 8, 8, 64)), [], a[:3, :64], None, "softmax")
        (w * h[:64, :64]).sum().backward()
        opt.step()
        opt.zero_grad()

    monkeypatch.setattr(train, "_step", step)
    b = train.step_breakdown(None, opt, None, None, steps=3)
    assert b["matmul_calls"] == 2  # Muon's Newton-Schulz matmuls count as the optimizer's
    assert b["generated_ms"] > 0 and b["optimizer_ms"] > 0 and b["matmul_ms"] > 0 and b["rest_ms"] >= 0
    assert b["kernels_ms"] > 0  # the attnres:: custom op, whatever runs inside it
    parts = b["matmul_ms"] + b["generated_ms"] + b["kernels_ms"] + b["optimizer_ms"] + b["rest_ms"]
    assert parts == pytest.approx(b["step_ms"])


@pytest.mark.compile_heavy
def test_compiled_rows_break_down_into_generated_code_and_the_same_matmuls(tmp_path):
    """Compiled, Block and Full AttnRes make exactly prenorm's matmul calls (so the equal-matmul
    ratio applies to them) and spend the rest in inductor's generated code."""
    out = tmp_path / "train.json"
    assert (
        main(
            ["bench", "train", "--no-memory", "--compile", *TINY_TRAIN, "--variants", "block,full", "--json", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    base = rows["prenorm compiled"]["breakdown"]
    for v in ("prenorm compiled", "block compiled", "full compiled"):
        b = rows[v]["breakdown"]
        assert b["generated_ms"] > b["generated_backward_ms"] > 0 and b["matmul_calls"] == base["matmul_calls"]
        assert b["ratio_at_equal_matmul"] == pytest.approx(
            (b["step_ms"] - b["matmul_ms"] + base["matmul_ms"]) / base["step_ms"]
        )


def test_bench_train_times_any_scheme_under_the_trainers_optimizer(capsys):
    """The arena calibrates its equal-time budgets with this: rival schemes, Muon, default Block N
    (and no profiled rounds: it needs the step times only)."""
    import torch

    from attnres.bench.train import BenchConfig, _setup

    assert (
        main(
            [
                "bench",
                "train",
                "--no-memory",
                *TINY_SIZES,
                "--set",
                "blocks=none",
                "--set",
                "optimizer=muon",
                "--set",
                "profile_rounds=0",
                "--variants",
                "block,mhc,hyper",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "block N=default, muon" in text and "Where a step goes" not in text
    assert main(["bench", "train", "--no-memory", *TINY_TRAIN, "--set", "profile_rounds=-1"]) == 2
    assert "profile_rounds=-1 is invalid" in capsys.readouterr().err
    for v in ("prenorm", "block", "mhc", "hyper"):
        assert f"| {v} |" in text
    cfg = BenchConfig(d_model=32, n_layers=2, seq_len=16, batch_size=2, vocab_size=64, blocks=None, optimizer="muon")
    model, opt, _, _ = _setup(cfg, "block")
    assert model.config.attnres_blocks is None
    assert any(isinstance(o, torch.optim.Muon) for o in opt.optimizers.values())


def test_bench_op_table(capsys):
    assert (
        main(
            [
                "bench",
                "op",
                "--set",
                "batch_size=1",
                "--set",
                "seq_len=8",
                "--set",
                "d_model=16",
                "--set",
                "sources=[3]",
                "--set",
                "repeats=2",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for impl in ("fused", "reference", "two_phase"):
        assert f"| 3 | {impl}" in text


def test_bench_op_interleaves_rows_with_the_copy():
    """Every round runs each function once, in turn, so the op and its copy ceiling are timed under
    the same machine conditions."""
    from attnres.bench.op import _interleaved_times

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("copy", "a fwd", "a fwd+bwd")}
    times = _interleaved_times(fns, repeats=3, device="cpu")
    assert calls == ["copy", "a fwd", "a fwd+bwd"] * 4  # one warm-up round, then three timed
    assert {name: len(t) for name, t in times.items()} == {"copy": 3, "a fwd": 3, "a fwd+bwd": 3}


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


def test_bench_decode_table_and_io_counts(capsys, tmp_path):
    out = tmp_path / "decode.json"
    assert (
        main(
            [
                "bench",
                "decode",
                "--set",
                "d_model=32",
                "--set",
                "n_layers=2",
                "--set",
                "prompt_len=8",
                "--set",
                "decode_tokens=3",
                "--set",
                "repeats=1",
                "--set",
                "prefill_repeats=3",
                "--set",
                "vocab_size=64",
                "--set",
                "blocks=2",
                "--variants",
                "block,block:fused,full",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for v in ("prenorm", "block", "block:fused", "full"):
        assert f"| {v} |" in text
    assert "2.00 + 1.00 = 3.00 | 3 |" in text  # the plain residual: read h and f, write h
    assert "medians over 1 repeats (3 prefills each)" in text
    rows = json.loads(out.read_text())["rows"]
    for row in rows.values():
        assert row["prefill_ms_p25"] <= row["prefill_ms"] <= row["prefill_ms_p75"]
        b = row["prefill_breakdown"]  # 3 profiled rounds of 3 prefills each
        assert b["matmul_ms"] > 0 and b["optimizer_ms"] == b["generated_ms"] == 0
        assert b["matmul_ms"] + b["rest_ms"] == pytest.approx(b["step_ms"])
    assert rows["prenorm"]["prefill_breakdown"]["ratio_at_equal_matmul"] == 1.0
    assert "Where a prefill goes" in text
    assert main(["bench", "decode", "--set", "profile_rounds=true"]) == 2
    assert "profile_rounds=True is invalid" in capsys.readouterr().err
    assert main(["bench", "decode", "--set", "prefill_repeats=0"]) == 2
    assert "DecodeBenchConfig.prefill_repeats=0 is invalid: must be a positive integer" in capsys.readouterr().err


def test_residual_io_counts_follow_the_schedule():
    import torch

    from attnres import AttnResLM, ModelConfig
    from attnres.bench.decode import residual_io

    x = torch.zeros(1, 4, dtype=torch.long)
    base = dict(vocab_size=16, d_model=16, n_layers=2, n_heads=2)
    # Block, L=4, S=2: per block Phase 1 reads n (1, then 2) and writes 2; the second sublayer merges
    # (2 reads, 1 write) and updates the partial sum (2 reads, 1 write); the block sum is stored (1 + 1)
    io = residual_io(AttnResLM(ModelConfig(**base, residual="block", attnres_block_size=2)), x)
    assert io["reads"] == (1 + 2 + 2 + 1 + 2 + 2 + 2 + 1) / 4
    assert io["writes"] == (2 + 1 + 1 + 1 + 2 + 1 + 1 + 1) / 4
    # per-sublayer attention reads every source (1, 2, 3, 4) and writes h
    io = residual_io(AttnResLM(ModelConfig(**base, residual="full", attnres_impl="fused")), x)
    assert io["reads"] == (1 + 2 + 3 + 4) / 4 + 4 / 4  # + storing each output in the buffer


def test_every_bench_has_the_registry_interface():
    import dataclasses

    from attnres.bench import BENCHES, bench_config
    from attnres.cli import build_parser

    assert set(BENCHES) == {"train", "roofline", "op", "graph", "decode", "pipeline", "kimi", "compile"}
    for name, bench in BENCHES.items():
        assert build_parser().parse_args(["bench", name]).what == name  # the command offers the registry
        quick = bench.config.quick()
        assert isinstance(quick, bench.config) and quick != bench.config(), name
        assert callable(bench.run) and callable(bench.format_table)
        assert bench.options == {f.name for f in dataclasses.fields(bench.config)} and "device" in bench.options
        cfg = bench_config(name, quick=True, device="cuda")
        assert cfg.device == "cuda" and dataclasses.replace(cfg, device=quick.device) == quick
    with pytest.raises(ValueError, match=r"--set widgets: unknown benchmark option; known: \[.*'d_model'"):
        bench_config("op", widgets=3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "op", "--variants", "block"], "unrecognized arguments: --variants block"),
        (["bench", "decode", "--no-memory"], "unrecognized arguments: --no-memory"),
    ],
)
def test_bench_flags_a_bench_does_not_have(argv, message, capsys):
    """Each bench is a subcommand with its own flags (and its own --help)."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err
    assert main(["bench", "op", "--set", "repeats"]) == 2
    assert "--set 'repeats': expected KEY=VALUE" in capsys.readouterr().err


def test_each_bench_has_its_own_help(capsys):
    from attnres.bench import BENCHES

    for name, bench in BENCHES.items():
        with pytest.raises(SystemExit):
            main(["bench", name, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        assert bench.example in shown and ("--variants" in shown) == ("variants" in bench.options)
    assert "torchrun" in BENCHES["pipeline"].summary and "torchrun" in BENCHES["pipeline"].example


def test_bench_graph_counts_the_traced_ops_and_sees_the_unstacked_form(monkeypatch):
    """`attnres bench graph` traces without breaks, and under torch.compile Block and Full AttnRes
    add no matrix product and no buffer copy to prenorm's graphs (the unstacked Phase 1); the
    eager form, traced as it is, has both. The saved column counts what backward keeps."""
    from attnres.bench import graph
    from attnres.residual import depth_streams

    cfg = graph.GraphBenchConfig(n_layers=2, blocks=2, variants=["prenorm", "block", "full"])
    rows = graph.run(cfg)["rows"]
    assert all(r["graphs"] == 1 and r["graph_breaks"] == 0 for r in rows.values())
    for name in ("block", "full"):
        assert rows[name]["forward_ops"] > rows["prenorm"]["forward_ops"]
        for kind in ("forward", "backward"):
            assert rows[name][f"{kind}_matmuls"] == rows["prenorm"][f"{kind}_matmuls"], (name, kind)
            assert rows[name][f"{kind}_copies"] == 0, (name, kind)
    # what the backward keeps (d-vectors per token): Block and Full recompute Phase 1 in backward,
    # so they keep about what prenorm keeps (kept, Phase 1's outputs cost Block 5.2 more at L = 4 with
    # torch 2.13); the buffered form, which keeps Full's Phase-1 and in-group outputs, several more
    assert rows["prenorm"]["saved_per_token"] > 10
    for name in ("block", "full"):
        assert rows[name]["saved_per_token"] < rows["prenorm"]["saved_per_token"] + 1, rows
    monkeypatch.setattr(depth_streams, "compiled_form", lambda embedding: False)
    buffered = graph.trace(cfg, "full")
    assert buffered["forward_matmuls"] > rows["full"]["forward_matmuls"]
    assert buffered["forward_copies"] > 0
    assert buffered["saved_per_token"] > rows["full"]["saved_per_token"] + 5, buffered
    table = graph.format_table({"config": cfg.__dict__, "torch": "x", "rows": rows})
    assert "| full | 1 | 0 |" in table and f"| {rows['full']['saved_per_token']:.1f} |" in table
