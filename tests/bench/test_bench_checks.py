"""A bench's options are checked before anything runs, as train's are: each bad value is one line
naming the field, and a batch that clearly does not fit is refused by train's memory estimate."""

import dataclasses

import pytest
import torch

import attnres.bench
import attnres.train.memory
from attnres.bench import bench_config, run_bench
from attnres.bench.train import BenchConfig
from attnres.cli import main
from attnres.train.config import parse_bool

TINY = dict(d_model=32, n_layers=2, seq_len=16, batch_size=2, vocab_size=64, blocks=2, memory=False)


def one_line_error(err):
    lines = err.strip().splitlines()
    assert lines[0].startswith("attnres bench: error: ") and "Traceback" not in err, err
    assert lines[1:] == ["(set ATTNRES_DEBUG=1 for the full traceback)"], err
    return lines[0]


@pytest.fixture
def no_run(monkeypatch):
    """A bench that must not start: the check refuses first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the bench ran")

    for name, bench in attnres.bench.BENCHES.items():
        monkeypatch.setitem(attnres.bench.BENCHES, name, dataclasses.replace(bench, run=refuse))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--set", "steps_per_repeat=-1"], "BenchConfig.steps_per_repeat=-1 is invalid: must be a positive"),
        (["train", "--set", "repeats=0"], "BenchConfig.repeats=0 is invalid: must be a positive integer"),
        (["train", "--set", "warmup=-1"], "BenchConfig.warmup=-1 is invalid: must be a non-negative integer"),
        (["train", "--set", "seq_len=abc"], "BenchConfig.seq_len='abc' is invalid"),
        (["train", "--set", "d_model=2.5"], "BenchConfig.d_model=2.5 is invalid"),
        (["train", "--set", "variants=blok,full"], "'blok' is not a residual scheme; choose from ["),
        (["train", "--variants", "block:nope=3"], "unexpected keyword argument 'nope'"),
        (["train", "--variants", "block:bogus"], "variant 'block:bogus': ModelConfig.attnres_impl='bogus'"),
        (["train", "--set", "variants=[]"], "BenchConfig.variants=[] is invalid: must be a comma list"),
        (["train", "--set", "memory=maybe"], "BenchConfig.memory='maybe' is invalid: use true or false"),
        (["train", "--set", "compile=maybe"], "BenchConfig.compile='maybe' is not a torch.compile backend"),
        (["train", "--set", "dtype=int8"], "BenchConfig.dtype='int8' is invalid: choose one of"),
        (["train", "--set", "optimizer=sgd"], "BenchConfig.optimizer='sgd' is invalid: choose one of"),
        (["train", "--device", "tpu"], "BenchConfig.device='tpu' is invalid: use cpu, cuda or cuda:N"),
        (["train", "--threads", "-1"], "--threads -1: must be at least 1"),
        (["op", "--set", "sources=4,0"], "OpBenchConfig.sources=[4, 0] is invalid"),
        (["op", "--set", "repeats=0"], "OpBenchConfig.repeats=0 is invalid"),
        (["decode", "--set", "decode_tokens=-2"], "DecodeBenchConfig.decode_tokens=-2 is invalid"),
        (["graph", "--set", "variants=full,nope"], "'nope' is not a residual scheme"),
        (["kimi", "--set", "cases=bogus"], "KimiBenchConfig.cases='bogus' is invalid: choose from"),
        (["kimi", "--set", "weight_noise=-1"], "KimiBenchConfig.weight_noise=-1.0 is invalid: must not be negative"),
        (["pipeline", "--set", "schedule=fast"], "PipelineBenchConfig.schedule='fast' is invalid: choose one of"),
    ],
)
def test_bad_options_are_one_line_before_anything_runs(argv, message, capsys, no_run):
    assert main(["bench", *argv]) == 2
    assert message in one_line_error(capsys.readouterr().err)


def test_a_cuda_device_that_is_not_there_is_one_line(capsys, no_run):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["bench", "train", "--device", "cuda"]) == 2
    assert "BenchConfig.device='cuda' is invalid: no CUDA device is visible here" in one_line_error(
        capsys.readouterr().err
    )


def test_set_variants_is_a_comma_list_of_names():
    assert bench_config("train", variants="block, full:reference").variants == ["block", "full:reference"]
    assert bench_config("graph", variants="full").variants == ["full"]
    assert bench_config("op", sources="4,8").sources == [4, 8]
    assert bench_config("op", sources=16).sources == [16]


def test_bench_runs_the_variants_of_a_set_list(capsys):
    """`--set variants=block,full` times block and full (and the prenorm baseline), not b, l, o, c, k, ..."""
    sizes = [f"{k}={v}" for k, v in TINY.items()] + ["repeats=1", "steps_per_repeat=1", "warmup=0", "profile_rounds=0"]
    assert main(["bench", "train", *[a for s in sizes for a in ("--set", s)], "--set", "variants=block,full"]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:4] == ["prenorm", "block", "full"]


@pytest.mark.parametrize(
    "text, value",
    [("no", False), ("false", False), ("0", False), ("No", False), ("yes", True), ("true", True), ("1", True)],
)
def test_yes_no_options_are_read_strictly(text, value):
    assert parse_bool(text, "x") is value
    assert bench_config("train", memory=text).memory is value
    assert bench_config("train", compile=text).compile is value


@pytest.mark.parametrize("text", ["nah", "2", "", "off please"])
def test_a_yes_no_option_refuses_other_text(text):
    with pytest.raises(ValueError, match=r"x=.* is invalid: use true or false"):
        parse_bool(text, "x")
    with pytest.raises(ValueError, match="BenchConfig.memory="):
        bench_config("train", memory=text)


def test_a_batch_that_cannot_fit_is_refused_by_trains_estimate_before_allocating(monkeypatch, capsys, no_run):
    """Every variant's model and optimizer are held at once (and the compiled rows' too): the estimate counts
    them all, and names the batch that fits."""
    monkeypatch.setattr(attnres.train.memory, "available_memory", lambda device: 2**30)
    sizes = dict(d_model=256, n_layers=4, seq_len=256, vocab_size=4096)

    def bench(**options):
        return run_bench("train", bench_config("train", **sizes, **options))

    with pytest.raises(ValueError, match=r"BenchConfig.batch_size=64 needs about .* GiB for 5 models .* fits"):
        bench(batch_size=64)
    with pytest.raises(ValueError, match="for 2 models"):
        bench(batch_size=64, variants="block")  # and prenorm, the baseline
    with pytest.raises(ValueError, match="for 4 models"):
        bench(batch_size=64, variants="block", compile="aot_eager")
    with pytest.raises(AssertionError, match="the bench ran"):
        bench(batch_size=1, variants="block")  # fits
    args = [a for k, v in {**sizes, "batch_size": 10**4}.items() for a in ("--set", f"{k}={v}")]
    assert main(["bench", "train", *args]) == 2
    assert "BenchConfig.batch_size=10000 needs about" in one_line_error(capsys.readouterr().err)


def test_a_config_built_by_hand_is_checked_too(no_run):
    with pytest.raises(ValueError, match="BenchConfig.steps_per_repeat=-1 is invalid"):
        run_bench("train", BenchConfig(**TINY, steps_per_repeat=-1))


def test_an_unwritable_json_path_is_refused_before_the_bench_runs(tmp_path, capsys, no_run):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "op", "--quick", "--json", str(blocker / "out.json")]) == 2
    assert f"--json {blocker / 'out.json'} cannot be written" in one_line_error(capsys.readouterr().err)
    assert main(["bench", "op", "--quick", "--json", str(tmp_path)]) == 2
    assert "cannot be written (is a directory)" in one_line_error(capsys.readouterr().err)


def test_bench_compile_without_a_cpp_compiler_is_one_line(monkeypatch, capsys, no_run):
    monkeypatch.setattr("attnres.model.compile.shutil.which", lambda name: None)
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    assert main(["bench", "train", "--compile"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "BenchConfig.compile=True compiles with inductor, which on the CPU needs a C++ compiler" in err
    assert "install one" in err and "drop --compile" in err


def test_forced_backends_are_checked_and_pinned_for_every_row():
    """`--set forced=OP=BACKEND`: an A/B of one kernel through the same bench; a name outside the backend
    table is one line naming the choices."""
    from attnres.bench import train

    assert train.parse_forced("merge_norm=reference, rms_norm=reference") == [
        ("merge_norm", "reference"),
        ("rms_norm", "reference"),
    ]
    assert train.parse_forced("") == []
    with pytest.raises(ValueError, match=r"'merge_norm=triton' is not OP=BACKEND.*merge_norm: cpu_kernel\|reference"):
        train.parse_forced("merge_norm=triton")
    cfg = train.BenchConfig.quick()
    cfg = dataclasses.replace(
        cfg,
        d_model=32,
        n_layers=2,
        seq_len=8,
        batch_size=2,
        repeats=1,
        variants=["full"],
        memory=False,
        profile_rounds=0,
        forced="merge_norm=reference",
    )
    from attnres.ops.backends import record

    with record() as found:
        result = train.run(cfg)
    assert {c.backend for c in found if c.op == "merge_norm"} == {"reference"}
    assert "backends forced: merge_norm=reference" in train.format_table(result)
