"""Nothing lost, nothing silently wrong: the README's Reliability guarantees, one regression test per
case of an adversarial probe, on tiny runs through the command line (seconds each). The
library-level cases sit beside their modules: FIFOs and corrupt token caches in tests/data, the
memory estimate in tests/train/test_memory.py, convert's in tests/hf/test_native.py."""

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from corpora import write_pseudo_english
from safetensors.torch import load_file

import attnres.cli
from attnres.checkpoint import load_model
from attnres.cli import main
from attnres.data import load_tokenizer, prepare_data
from attnres.inference.sampling import generate
from attnres.model import ModelConfig
from attnres.train.config import TrainConfig, build_configs
from attnres.train.evaluation import evaluate
from attnres.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_pseudo_english(tmp_path_factory.mktemp("corpus"), works=6, words_per_work=1500)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))


def cli(*argv):
    return main([str(a) for a in argv])


def train(corpus, out, *flags, steps=4):
    return cli(
        "train",
        "--preset",
        "tiny",
        "--data",
        corpus,
        "--out",
        out,
        "--steps",
        steps,
        "--set",
        "warmup_steps=1",
        "--set",
        "threads=1",
        "--no-progress",
        *flags,
    )


def one_line_error(err, verb="train"):
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"attnres {verb}: error: ") and "Traceback" not in err, err
    assert lines[1:] == ["(set ATTNRES_DEBUG=1 for the full traceback)"], err
    return lines[0]


def train_rows(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if r["kind"] == "train"]


def strict_json(path):
    def refuse(constant):
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    return json.loads(Path(path).read_text(), parse_constant=refuse)


# ----------------------------------------------------------------------------- silent loss or corruption


@pytest.mark.parametrize("lr", ["1e4", "1e8"])
def test_a_diverged_run_never_checkpoints_a_state_that_cannot_continue(corpus, tmp_path, capsys, lr):
    out = tmp_path / "run"
    assert train(corpus, out, "--lr", lr, "--set", "warmup_steps=0", "--set", "checkpoint_every=1", steps=60) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "--set warmup_steps" in err and "--set grad_clip" in err  # --set keys, not flags
    if not (out / "checkpoint").exists():
        assert "no checkpoint was written" in err
        return
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert f"the last good checkpoint, step {state['step']}, is kept" in err
    weights = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    model, _, _ = load_model(out)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 256, (2, 32)))).all()


def test_a_nan_before_any_checkpoint_says_none_was_kept(corpus, tmp_path, monkeypatch):
    import attnres.parallel.runtime as runtime

    real = runtime.lm_loss
    monkeypatch.setattr(runtime, "lm_loss", lambda logits, y: real(logits, y) * float("nan"))
    model_cfg, train_cfg = build_configs("tiny", {"data": corpus, "out_dir": str(tmp_path / "run"), "progress": False})
    with pytest.raises(Exception, match="loss is nan at step 0 .*no checkpoint was written"):
        Trainer(model_cfg, train_cfg).run()


def test_training_into_an_existing_run_is_refused_unless_resumed_or_forced(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out, steps=6) == 0
    before = (out / "checkpoint" / "state.json").read_text(), (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert train(corpus, out, "--seed", 5) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "already holds a run" in err and "--resume" in err and "--force" in err
    assert ((out / "checkpoint" / "state.json").read_text(), (out / "metrics.jsonl").read_text()) == before
    assert train(corpus, out, "--seed", 5, "--force") == 0  # start over: only the new run's rows
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4


def test_a_second_trainer_on_a_run_directory_is_refused(corpus, tmp_path):
    configs = build_configs(
        "tiny", {"data": corpus, "out_dir": str(tmp_path / "run"), "steps": 3, "warmup_steps": 1, "progress": False}
    )
    first = Trainer(*configs)
    with pytest.raises(ValueError, match=r"is in use by another trainer \(pid \d+"):
        Trainer(
            *build_configs(
                "tiny",
                {"data": corpus, "out_dir": str(tmp_path / "run"), "steps": 3, "warmup_steps": 1, "progress": False},
            )
        )
    first.run()
    assert [r["step"] for r in train_rows(tmp_path / "run")] == [1, 2, 3]
    Trainer(*configs, resume=True).close()  # released when the run ended


def test_a_second_trainer_process_is_refused(corpus, tmp_path):
    out = tmp_path / "run"
    configs = build_configs("tiny", {"data": corpus, "out_dir": str(out), "progress": False})
    holder = Trainer(*configs)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "attnres",
                "train",
                "--preset",
                "tiny",
                "--data",
                corpus,
                "--out",
                str(out),
                "--steps",
                "2",
                "--set",
                "warmup_steps=1",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        holder.close()
    assert done.returncode == 2 and "is in use by another trainer" in done.stderr
    assert "Traceback" not in done.stderr and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("tokenizer", ["bpe"])
def test_a_resumed_run_keeps_its_tokenizer_and_refuses_changed_data(tmp_path, capsys, tokenizer):
    text = tmp_path / "f.txt"
    text.write_text(Path(write_pseudo_english(tmp_path, works=1, words_per_work=3000), "work_0.txt").read_text())
    out = tmp_path / "run"
    flags = ("--tokenizer", tokenizer, "--set", "vocab_size=262")
    assert train(text, out, *flags) == 0
    saved = (out / "tokenizer.json").read_bytes()
    text.write_text(text.read_text() + "entirely different words appended zyx qwv\n" * 50)
    capsys.readouterr()
    assert train(text, out, *flags, "--resume", steps=6) == 2
    assert "changed since the run" in one_line_error(capsys.readouterr().err)
    assert (out / "tokenizer.json").read_bytes() == saved
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4


def test_eval_on_other_data_uses_the_runs_tokenizer(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out, "--tokenizer", "bpe", "--set", "vocab_size=300") == 0
    other = tmp_path / "other.txt"
    other.write_text("completely other text, with other words: zebra yak xylophone\n" * 300)
    capsys.readouterr()
    assert cli("eval", out, "--data", other, "--batches", 2) == 0
    reported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, _, _ = load_model(out)
    val = prepare_data(other, tokenizer=load_tokenizer(out / "tokenizer.json"), cache_dir=tmp_path / "c").val
    expected = evaluate(model, val, batch_size=4, seq_len=32, max_batches=2)
    assert reported["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)


def test_the_cli_recovers_a_checkpoint_left_in_the_crash_window(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out) == 0
    (out / "checkpoint").rename(out / ".checkpoint.old-0123456789ab")  # crash between the two renames
    capsys.readouterr()
    assert cli("eval", out, "--batches", 1) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    assert cli("sample", out, "--prompt", "the", "--max-new-tokens", 3) == 0
    assert train(corpus, out, "--resume", steps=6) == 0
    assert "resumed" in capsys.readouterr().out
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 6
    assert not list(out.glob(".checkpoint.old-*"))


def test_resuming_a_finished_run_says_so_and_keeps_its_summary(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out) == 0
    summary = (out / "summary.json").read_bytes()
    capsys.readouterr()
    assert train(corpus, out, "--resume") == 0
    assert "already complete at step 4" in capsys.readouterr().out
    assert (out / "summary.json").read_bytes() == summary
    strict_json(out / "summary.json")
    # interrupted after the last checkpoint but before the summary: a valid one is written
    (out / "summary.json").unlink()
    assert train(corpus, out, "--resume") == 0
    assert strict_json(out / "summary.json")["steps"] == 4


def test_resuming_with_fewer_steps_than_done_says_the_run_is_past_them(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out, steps=6) == 0
    capsys.readouterr()
    assert train(corpus, out, "--resume", steps=5) == 2
    assert "already at step 6, past steps=5" in one_line_error(capsys.readouterr().err)


# ----------------------------------------------------------------------------- hangs and resource exhaustion


def test_a_batch_that_cannot_fit_is_refused_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    import attnres.train.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 1000)
    assert train(corpus, tmp_path / "run") == 2
    assert "not even batch_size=1 fits" in one_line_error(capsys.readouterr().err)


def test_a_device_or_directory_given_as_a_file_is_named_as_such(tmp_path, capsys):
    assert cli("train", "--preset", "tiny", "--data", "/dev/null", "--out", tmp_path / "x") == 2
    assert "'/dev/null' is a character device" in one_line_error(capsys.readouterr().err)
    assert cli("train", "--config", tmp_path, "--out", tmp_path / "y") == 2
    assert "is a directory; pass a .toml file" in one_line_error(capsys.readouterr().err)


def test_a_hostile_state_json_is_refused_before_the_model_is_allocated(corpus, tmp_path, capsys, monkeypatch):
    import attnres.checkpoint.trained as checkpoint

    out = tmp_path / "run"
    assert train(corpus, out) == 0
    path = out / "checkpoint" / "state.json"
    state = json.loads(path.read_text())
    state["model_config"].update(d_model=65536, n_layers=64, d_ff=None)
    path.write_text(json.dumps(state))
    real = checkpoint.AttnResLM

    def only_on_meta(config):  # a real 16 GiB model would be built before any check without the fix
        if config.d_model == 65536 and torch.get_default_device().type != "meta":
            raise AssertionError("the hostile model is being allocated")
        return real(config)

    monkeypatch.setattr(checkpoint, "AttnResLM", only_on_meta)
    capsys.readouterr()
    assert cli("sample", out, "--max-new-tokens", 2) == 2
    err = one_line_error(capsys.readouterr().err, "sample")
    assert "does not match the tensors in" in err and "embed.weight" in err
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("verb", ["eval", "sample", "resume"])
def test_a_state_json_claiming_100000_layers_fails_in_seconds(corpus, tmp_path, capsys, monkeypatch, verb):
    import attnres.checkpoint.trained as checkpoint
    import attnres.model as model_package

    out = tmp_path / "run"
    assert train(corpus, out) == 0
    path = out / "checkpoint" / "state.json"
    state = json.loads(path.read_text())
    state["model_config"]["n_layers"] = 100000
    path.write_text(json.dumps(state))
    real = checkpoint.AttnResLM

    def never_that_deep(config):  # building 100,000 blocks, even on the meta device, takes minutes
        assert config.n_layers != 100000, "the claimed model is being built"
        return real(config)

    monkeypatch.setattr(checkpoint, "AttnResLM", never_that_deep)
    monkeypatch.setattr(model_package, "AttnResLM", never_that_deep)
    capsys.readouterr()
    argv = {"eval": ["eval", out], "sample": ["sample", out, "--max-new-tokens", 2]}.get(verb)
    assert (cli(*argv) if argv else train(corpus, out, "--resume", steps=6)) == 2
    err = one_line_error(capsys.readouterr().err, "train" if verb == "resume" else verb)
    assert "n_layers=100000, but the weights hold 2 blocks" in err and "state.json" in err


# ----------------------------------------------------------------------------- one clear line, never a traceback


WRONG = {
    int: ["'abc'", "1.5", "None", "[1]", "True", "{}"],
    float: ["'abc'", "None", "[1]", "True", "inf", "nan"],
    str: ["5", "1.5", "[1]", "True", "None", "{}"],
    bool: ["1", "'yes'", "None", "[1]", "0.5"],
}


def _wrong_values():
    """For every ModelConfig and TrainConfig field, three random values of a wrong type."""
    import typing

    rng = random.Random(19)
    cases = []
    for cls in (ModelConfig, TrainConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, optional = hints[f.name], False
            if typing.get_origin(kind) is typing.Union:
                kind, optional = [a for a in typing.get_args(kind) if a is not type(None)][0], True
            if kind not in WRONG:
                continue
            pool = [v for v in WRONG[kind] if not (optional and v == "None")]
            cases += [(f.name, v) for v in rng.sample(pool, 3)]
    return cases


@pytest.mark.parametrize("field,value", _wrong_values())
def test_fuzz_wrong_types_for_every_config_field_are_one_line(field, value, tmp_path, capsys):
    out = [] if field == "out_dir" else ["--out", tmp_path / "x"]  # --out would override the field
    assert cli("train", "--preset", "tiny", "--set", f"{field}={value}", *out) == 2
    assert f".{field}=" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["train", "--preset", "tiny", "--set", "d_model=abc"],
            "ModelConfig.d_model='abc' is invalid: must be a positive integer",
        ),
        (["schemes", "--set", "d_model=abc"], "ModelConfig.d_model='abc'"),
        (["schemes", "--preset", "bogus"], "unknown preset 'bogus'"),
        (["train", "--preset", "tiny", "--set", "threads=-3"], "TrainConfig.threads=-3"),
        (["train", "--preset", "tiny", "--lr", "inf"], "TrainConfig.lr=inf is invalid: must be a finite number"),
        (["train", "--preset", "tiny", "--lr", "0"], "TrainConfig.lr=0.0 is invalid: must be a positive"),
        (["train", "--preset", "tiny", "--out", "/sys/attnres-probe"], "cannot be written"),
    ],
)
def test_bad_values_are_one_line(argv, message, tmp_path, capsys):
    if argv[0] == "train" and "--out" not in argv:
        argv = argv + ["--out", str(tmp_path / "x")]
    if "/sys/attnres-probe" in argv:
        try:
            os.mkdir("/sys/attnres-probe")
        except OSError:
            pass
        else:
            os.rmdir("/sys/attnres-probe")
            pytest.skip("/sys is writable here")
    assert cli(*argv) == 2
    assert message in one_line_error(capsys.readouterr().err, argv[0])


def test_toml_with_a_wrong_type_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('preset = "tiny"\n[model]\nd_model = "big"\n')
    assert cli("train", "--config", cfg, "--out", tmp_path / "x") == 2
    assert "ModelConfig.d_model='big'" in one_line_error(capsys.readouterr().err)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    assert train(corpus, out, "--set", f"cache_dir={out.parent / 'cache'}") == 0
    return out


@pytest.mark.parametrize("batches", [0, -1])
def test_eval_with_no_batches_is_one_line(trained, capsys, batches):
    assert cli("eval", trained, "--batches", batches) == 2
    assert f"max_batches={batches} is invalid" in one_line_error(capsys.readouterr().err, "eval")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--temperature", "nan"], "temperature=nan"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--top-p", "0"], "top_p=0.0"),
        (["--top-p", "2"], "top_p=2.0"),
        (["--top-p", "-0.5"], "top_p=-0.5"),
        (["--top-k", "-5"], "top_k=-5"),
        (["--max-new-tokens", "-5"], "max_new_tokens=-5"),
    ],
)
def test_bad_sampling_options_are_refused_before_the_prompt_is_echoed(trained, capsys, flags, message):
    assert cli("sample", trained, "--prompt", "the", *flags) == 2
    captured = capsys.readouterr()
    assert message in one_line_error(captured.err, "sample") and captured.out == ""


@pytest.mark.parametrize("verb", ["eval", "sample"])
@pytest.mark.parametrize("device", ["banana", "cuda:x"])
def test_a_bad_device_for_eval_or_sample_is_one_line(trained, capsys, verb, device):
    assert cli(verb, trained, "--device", device) == 2
    err = one_line_error(capsys.readouterr().err, verb)
    assert f"device={device!r} is invalid" in err and "--device cpu" in err


def _plot_run(tmp_path, metrics: bytes, depth: bytes | None = None):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_bytes(metrics)
    if depth is not None:
        (run / "depth_weights.json").write_bytes(depth)
    return run


ROWS = (
    b'{"step": 1, "kind": "train", "loss": 5.0, "tokens": 128}\n'
    b'{"step": 2, "kind": "train", "loss": 4.0, "tokens": 256}\n'
    b'{"step": 2, "kind": "eval", "val_loss": 4.5, "tokens": 256}\n'
)


def test_plot_skips_a_torn_last_line_and_says_so(tmp_path, capsys):
    run = _plot_run(tmp_path, ROWS + b'{"step": 3, "kind": "tra')
    assert cli("plot", run) == 0
    captured = capsys.readouterr()
    assert "skipped the torn last line 4" in captured.err and "metrics.jsonl" in captured.err
    assert (run / "loss.png").stat().st_size > 0


def test_plot_draws_records_without_tokens_by_step(tmp_path, capsys):
    run = _plot_run(
        tmp_path, b'{"step": 1, "kind": "train", "loss": 5.0}\n{"step": 2, "kind": "eval", "val_loss": 4}\n'
    )
    assert cli("plot", run) == 0
    assert (run / "loss.png").stat().st_size > 0


@pytest.mark.parametrize(
    "metrics,depth,message",
    [
        (b"", None, "metrics.jsonl holds no loss yet"),
        (b"\n\n", None, "metrics.jsonl holds no loss yet"),
        (b'{"step": 1, "kind": "x"}\n', None, "metrics.jsonl holds no loss yet"),
        (b"\xff\xfe not utf-8\n" + ROWS, None, "metrics.jsonl is not UTF-8"),
        (b"{broken\n" + ROWS, None, "metrics.jsonl line 1 is not a JSON record"),
        (b"[1, 2]\n" + ROWS, None, "metrics.jsonl line 1 is not a JSON record"),
        (ROWS, b"garbage", "depth_weights.json is not a depth-weights file"),
        (ROWS, b'{"weights": [[1, 2]], "sources": 5}', "depth_weights.json is not a depth-weights file"),
        (ROWS, b"\xff\xfe", "depth_weights.json is not a depth-weights file"),
    ],
)
def test_plot_on_a_corrupt_run_names_the_file(tmp_path, capsys, metrics, depth, message):
    run = _plot_run(tmp_path, metrics, depth)
    assert cli("plot", run) == 2
    assert message in one_line_error(capsys.readouterr().err, "plot")


def test_a_tiny_temperature_samples_greedily(trained, capsys):
    model, tokenizer, _ = load_model(trained)
    prompt = torch.tensor([tokenizer.encode("the quick")])
    greedy = list(generate(model, prompt, 8, temperature=0))
    assert list(generate(model, prompt, 8, temperature=1e-45, seed=0)) == greedy
    assert cli("sample", trained, "--prompt", "the quick", "--temperature", "1e-45", "--max-new-tokens", 8) == 0
    assert capsys.readouterr().out.startswith("the quick")


def test_ctrl_c_while_the_libraries_load_is_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(attnres.cli, "_verbs", interrupted)
    assert main(["schemes"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    # and importing the command loads no PyTorch, so the console script reaches main() at once
    done = subprocess.run(
        [sys.executable, "-c", "import sys, attnres.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.stdout.strip() == "False", done.stderr


# ----------------------------------------------------------------------------- a second adversarial round


@pytest.mark.parametrize("signum,code", [("SIGTERM", 143), ("SIGUSR1", 138)])
def test_sigterm_and_sigusr1_checkpoint_like_ctrl_c(corpus, tmp_path, capsys, monkeypatch, signum, code):
    import signal

    number = getattr(signal, signum)
    out = tmp_path / "my run"  # a space: the printed command must be quoted
    original = Trainer.train_step

    def signalled(self):
        loss = original(self)
        if self.step == 3:
            os.kill(os.getpid(), number)  # what timeout, kill, SLURM and Kubernetes send
        return loss

    def unhandled(*_):  # without the trainer's own handler this one runs: no checkpoint, rc 0
        pass

    monkeypatch.setattr(Trainer, "train_step", signalled)
    previous = signal.signal(number, unhandled)
    try:
        assert train(corpus, out, steps=8) == code
        assert signal.getsignal(number) is unhandled  # restored after the run
    finally:
        signal.signal(number, previous)
    err = capsys.readouterr()
    assert f"{signum}: finishing this step" in err.out
    assert f"continue with attnres train --out '{out}' --resume" in err.err
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3
    monkeypatch.setattr(Trainer, "train_step", original)
    assert cli("train", "--out", out, "--resume", "--no-progress") == 0  # nothing retyped
    assert [r["step"] for r in train_rows(out)] == list(range(1, 9))


def test_resume_takes_the_runs_own_settings(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out, "--residual", "full", "--lr", "2e-3", "--set", "d_model=48", steps=4) == 0
    saved = json.loads((out / "checkpoint" / "state.json").read_text())
    capsys.readouterr()
    assert cli("train", "--out", out, "--resume", "--steps", 6, "--no-progress") == 0
    assert "resumed" in capsys.readouterr().out
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 6 and state["model_config"] == saved["model_config"]
    assert {k: v for k, v in state["train_config"].items() if k != "steps"} == {
        k: v for k, v in saved["train_config"].items() if k != "steps"
    }


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lr", "1e-3"], "lr=0.001 (given), but the run has lr=0.002"),
        (["--set", "d_model=64"], "d_model=64 (given), but the run has d_model=48"),
        (["--preset", "demo"], "(--preset demo), but the run has"),
        (["--seq-len", "16"], "seq_len=16 (given), but the run has seq_len=32"),
    ],
)
def test_resume_refuses_a_contradicting_flag_by_name(corpus, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert train(corpus, out, "--lr", "2e-3", "--set", "d_model=48", steps=4) == 0
    before = (out / "checkpoint" / "state.json").read_text()
    capsys.readouterr()
    assert cli("train", "--out", out, "--resume", "--steps", 6, *flags) == 2
    err = one_line_error(capsys.readouterr().err)
    assert message in err and "Fix: drop it" in err and "read_checkpoint_state" not in err
    assert (out / "checkpoint" / "state.json").read_text() == before


def test_a_runs_config_json_starts_a_new_run_with_its_settings(corpus, tmp_path, capsys):
    first = tmp_path / "first"
    assert train(corpus, first, "--residual", "full", "--set", "d_model=48", "--lr", "2e-3", steps=3) == 0
    capsys.readouterr()
    second = tmp_path / "second"
    assert cli("train", "--config", first / "config.json", "--out", second, "--seed", 7, "--no-progress") == 0
    assert "sets no preset" not in capsys.readouterr().err
    a, b = (json.loads((d / "config.json").read_text()) for d in (first, second))
    assert a["model"] == b["model"]
    assert {**a["train"], "seed": 7, "out_dir": str(second)} == b["train"]


def test_a_toml_without_a_preset_says_which_preset_fills_the_rest(tmp_path, capsys, monkeypatch):
    import attnres.cli.train as train_verb

    cfg = tmp_path / "run.toml"
    cfg.write_text("[model]\nd_model = 48\n")
    built = {}

    class Stop(Exception):
        pass

    def stop(model_config, train_config, **kwargs):
        built.update(model=model_config, train=train_config)
        raise Stop

    monkeypatch.setattr(train_verb, "Trainer", stop)
    with pytest.raises(Stop):
        cli("train", "--config", cfg, "--out", tmp_path / "x")
    err = capsys.readouterr().err
    assert f"{cfg} sets no preset: the demo preset fills what it does not set" in err and "n_layers" in err
    assert built["model"].d_model == 48 and built["model"].n_layers == 8  # the demo preset's


@pytest.mark.parametrize("preset,steps", [("tiny", 1), ("tiny", 2), ("tiny", 3), ("kimi-tiny", 2)])
def test_a_smoke_run_shorter_than_the_presets_warmup_trains(corpus, tmp_path, capsys, preset, steps):
    out = tmp_path / "run"
    argv = ["train", "--preset", preset, "--data", corpus, "--out", out, "--steps", steps, "--no-progress"]
    assert cli(*argv, "--set", "threads=1") == 0
    err = capsys.readouterr().err
    assert (
        f"warmup_steps=3 (the {preset} preset's) is longer than the run: capped to {min(steps, 2)} (steps={steps}"
        in err
    )
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == steps
    # an explicit warmup longer than the run is still an error
    assert cli(*argv, "--warmup-steps", 5, "--force") == 2
    assert f"warmup_steps=5 is invalid: must not exceed steps={steps}" in one_line_error(capsys.readouterr().err)


def test_an_explicit_max_seq_len_below_seq_len_is_refused(tmp_path, capsys):
    argv = ["train", "--preset", "tiny", "--out", tmp_path / "x", "--set", "max_seq_len=8", "--seq-len", 32]
    assert cli(*argv) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "ModelConfig.max_seq_len=8 is below seq_len=32" in err and "--set max_seq_len" in err


def test_a_moved_run_reports_where_it_is_now_and_hints_are_shell_quoted(corpus, tmp_path, capsys):
    out = tmp_path / "first run"
    assert train(corpus, out) == 0
    assert f"(redraw: attnres plot '{out}')" in capsys.readouterr().out
    moved = tmp_path / "moved"
    out.rename(moved)
    assert cli("train", "--out", moved, "--resume", "--no-progress") == 0
    said = capsys.readouterr().out
    assert "already complete at step 4" in said and f"-> {moved}\n" in said and str(out) not in said


def test_the_summary_names_its_validation_sample(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out) == 0
    said = capsys.readouterr().out
    assert "on 2 validation batches (`attnres eval` takes the whole split)" in said  # the tiny preset: 2
    assert strict_json(out / "summary.json")["val_batches"] == 2
    assert cli("eval", out) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_batches"] > 2


def test_a_run_laid_out_over_processes_resumes_in_one(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out) == 0
    path = out / "checkpoint" / "state.json"
    state = json.loads(path.read_text())
    state["train_config"]["dp"] = 2  # as a torchrun --nproc-per-node 2 ... --dp 2 run writes it
    path.write_text(json.dumps(state))
    capsys.readouterr()
    assert cli("train", "--out", out, "--resume", "--steps", 6, "--no-progress") == 0
    assert "the run was laid out over 2 processes (dp=2); it continues in this one" in capsys.readouterr().err
    assert json.loads(path.read_text())["train_config"]["dp"] == 1


def test_the_resume_command_of_a_torchrun_run_relaunches_it(monkeypatch, tmp_path):
    import signal

    import attnres.train.trainer as trainer

    monkeypatch.setattr(trainer.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer.dist, "get_world_size", lambda: 2)
    stop = trainer._interrupted(7, tmp_path / "r 1" / "checkpoint", tmp_path / "r 1", signal.SIGTERM)
    assert f"continue with torchrun --nproc-per-node 2 -m attnres train --out '{tmp_path / 'r 1'}' --resume" in str(
        stop
    )
    assert stop.exit_code == 143


# ----------------------------------------------------------------------------- conversions and exports


@pytest.fixture
def quiet_transformers():
    """transformers' progress bars off (they share stderr with the one-line errors checked here)."""
    logging = pytest.importorskip("transformers.utils.logging")
    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


def kimi_checkpoint(path, seed=0):
    """A native weights-only checkpoint of a tiny Kimi Linear-backbone Block AttnRes model with the byte
    tokenizer, as `attnres convert HF OUT --to native` writes one: every export takes it."""
    from attnres.checkpoint import save_checkpoint
    from attnres.data import ByteTokenizer
    from attnres.model import AttnResLM

    config = ModelConfig(
        backbone="kimi_linear",
        vocab_size=256,
        d_model=32,
        n_layers=4,
        n_heads=2,
        d_ff=64,
        max_seq_len=32,
        moe_experts=4,
        moe_top_k=2,
        residual="block",
        attnres_block_size=4,
    )
    torch.manual_seed(seed)
    lm = AttnResLM(config)
    save_checkpoint(
        path,
        model=lm,
        optimizer=None,
        step=0,
        train_state={},
        model_config=config.to_dict(),
        train_config={"tokenizer": "byte", "vocab_size": 256},
    )
    ByteTokenizer().save(path / "tokenizer.json")
    return path


def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def custom_code_source(path, marker):
    """A tiny LLaMA directory whose config.json asks for custom code (auto_map, a model type transformers
    lacks); its python files leave ``marker`` when imported."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, max_position_embeddings=32)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="evilmodel",
        auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilLM"},
    )
    (path / "config.json").write_text(json.dumps(config))
    leave = f"import pathlib\n\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (path / "configuration_evil.py").write_text(
        f"{leave}from transformers import LlamaConfig\n\n\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evilmodel'\n"
    )
    (path / "modeling_evil.py").write_text(
        f"{leave}from transformers import LlamaForCausalLM\n\nfrom .configuration_evil import EvilConfig\n\n\n"
        "class EvilLM(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    return path


@pytest.mark.parametrize(
    "flags",
    [["--to", "native"], ["--set", "layout=native"], [], ["--to", "kimi_linear"], ["--to", "gguf"], ["--to", "mlx"]],
    ids=["native", "layout-native", "hf", "kimi_linear", "gguf", "mlx"],
)
def test_convert_never_runs_a_sources_own_code(tmp_path, capsys, monkeypatch, quiet_transformers, flags):
    monkeypatch.setattr("builtins.input", lambda *args: "y")  # a user who answers transformers' prompt
    marker = tmp_path / "MARKER"
    src = custom_code_source(tmp_path / "evil", marker)
    out = tmp_path / "out"
    assert cli("convert", src, out, *flags) == 2
    err = one_line_error(capsys.readouterr().err, "convert")
    assert "asks to run custom code" in err and "modeling_evil.py" in err and "never runs code" in err
    assert not marker.exists() and not out.exists()


def test_a_conversion_cut_short_leaves_no_output_and_keeps_the_old_one(
    tmp_path, capsys, monkeypatch, quiet_transformers
):
    from attnres.hf import AttnResForCausalLM

    run = kimi_checkpoint(tmp_path / "run")
    out = tmp_path / "hf"
    save_pretrained = AttnResForCausalLM.save_pretrained

    def dies_midway(self, path, *args, **kwargs):
        save_pretrained(self, path, *args, **kwargs)  # config.json and the weights are there...
        raise OSError(28, "No space left on device")  # ...the tokenizer never comes

    monkeypatch.setattr(AttnResForCausalLM, "save_pretrained", dies_midway)
    assert cli("convert", run, out) == 2
    assert "No space left on device" in one_line_error(capsys.readouterr().err, "convert")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no out, no hidden leftovers
    monkeypatch.setattr(AttnResForCausalLM, "save_pretrained", save_pretrained)
    assert cli("convert", run, out) == 0
    before = tree(out)
    assert "tokenizer.json" in before
    monkeypatch.setattr(AttnResForCausalLM, "save_pretrained", dies_midway)
    assert cli("convert", kimi_checkpoint(tmp_path / "other", seed=1), out, "--force") == 2
    one_line_error(capsys.readouterr().err, "convert")
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "other", "run"]
    monkeypatch.setattr(AttnResForCausalLM, "save_pretrained", save_pretrained)
    (out / "notes.txt").write_text("from the old output")
    assert cli("convert", tmp_path / "other", out, "--force") == 0  # replaced whole
    assert "notes.txt" not in tree(out) and tree(out)["model.safetensors"] != before["model.safetensors"]


def test_a_training_run_is_never_a_conversion_output(trained, tmp_path, capsys, quiet_transformers):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    assert cli("eval", run, "--batches", 1) == 0
    loss = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"]
    before = tree(run)
    other = kimi_checkpoint(tmp_path / "other")
    assert cli("convert", other, tmp_path / "other-hf") == 0
    for source, flags in ((other, []), (other, ["--force"]), (tmp_path / "other-hf", ["--to", "native", "--force"])):
        assert cli("convert", source, run, *flags) == 2
        err = one_line_error(capsys.readouterr().err, "convert")
        assert f"{run} is a run directory of attnres train" in err and "write to a new directory" in err
    assert tree(run) == before
    assert cli("eval", run, "--batches", 1) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"] == loss


def test_force_never_deletes_a_directory_that_holds_no_model(tmp_path, capsys, quiet_transformers):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("mine")
    assert cli("convert", kimi_checkpoint(tmp_path / "run"), notes, "--force") == 2
    err = one_line_error(capsys.readouterr().err, "convert")
    assert "holds a.txt but no model" in err and "never deletes other files" in err
    assert tree(notes) == {"a.txt": b"mine"}


def test_every_exported_file_gets_the_umasks_mode(tmp_path, capsys, quiet_transformers):
    pytest.importorskip("gguf")
    run = kimi_checkpoint(tmp_path / "run")
    umask = os.umask(0o022)
    try:
        assert cli("convert", run, tmp_path / "hf") == 0
        assert cli("convert", tmp_path / "hf", tmp_path / "native") == 0
        assert cli("convert", run, tmp_path / "kimi", "--to", "kimi_linear") == 0
        assert cli("convert", run, tmp_path / "mlx", "--to", "mlx") == 0
        assert cli("convert", run, tmp_path / "m.gguf", "--to", "gguf") == 0
    finally:
        os.umask(umask)
    written = [tmp_path / "m.gguf"]
    written += [p for d in ("hf", "native", "kimi", "mlx") for p in sorted((tmp_path / d).rglob("*"))]
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written}
    assert "hf/model.safetensors" in modes and "mlx/model.safetensors" in modes
    assert modes == {name: "0o755" if (tmp_path / name).is_dir() else "0o644" for name in modes}
    assert all(oct((tmp_path / d).stat().st_mode & 0o777) == "0o755" for d in ("hf", "native", "kimi", "mlx"))


def test_mlx_export_writes_the_dtype_asked_for(tmp_path, capsys, quiet_transformers):
    from safetensors import safe_open

    run = kimi_checkpoint(tmp_path / "run")
    for dtype, stored in (("bfloat16", "BF16"), ("float16", "F16"), ("auto", "F32")):
        out = tmp_path / dtype
        assert cli("convert", run, out, "--to", "mlx", "--dtype", dtype) == 0
        with safe_open(out / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {stored}, dtype  # noqa: SIM118
    assert cli("convert", run, tmp_path / "f64", "--to", "mlx", "--dtype", "float64") == 2
    err = one_line_error(capsys.readouterr().err, "convert")
    assert "--dtype float64: mlx-lm runs weights in float32, float16, bfloat16" in err
    assert not (tmp_path / "f64").exists()


@pytest.mark.parametrize("to", ["hf", "kimi_linear", "gguf", "mlx"])
def test_an_unwritable_output_is_refused_before_the_source_is_loaded(tmp_path, capsys, monkeypatch, to):
    """The output is staged beside OUT: a parent that is a file (or a folder nobody may write) failed only
    after the whole model was read, naming the hidden staging path."""
    import attnres.hf.directories
    import attnres.serving.gguf

    def refuse(*args, **kwargs):
        raise AssertionError("the source was loaded")

    run = kimi_checkpoint(tmp_path / "run")
    monkeypatch.setattr(attnres.hf.directories, "native_to_hf_with_tokenizer", refuse)
    monkeypatch.setattr(attnres.serving.gguf, "load_for_serving", refuse)
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "deeper" / ("m.gguf" if to == "gguf" else "out")
    assert cli("convert", run, out, "--to", to) == 2
    err = one_line_error(capsys.readouterr().err, "convert")
    assert f"{out} cannot be written: {blocker} is a file, not a directory" in err, err
    assert "in a folder you can write to" in err and ".partial" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run"]


@pytest.mark.parametrize("change", ["missing", "mismatched"])
def test_a_kimi_linear_checkpoint_missing_a_weight_is_one_line_naming_it(tmp_path, capsys, quiet_transformers, change):
    """A tensor of another shape ended in transformers' RuntimeError pointing at its log, naming no key."""
    from safetensors.torch import save_file

    assert cli("convert", kimi_checkpoint(tmp_path / "run"), tmp_path / "kimi", "--to", "kimi_linear") == 0
    capsys.readouterr()
    tensors = load_file(tmp_path / "kimi" / "model.safetensors")
    name = "model.layers.0.input_layernorm.weight"
    if change == "missing":
        del tensors[name]
    else:
        tensors[name] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "kimi" / "model.safetensors", metadata={"format": "pt"})
    assert cli("convert", tmp_path / "kimi", tmp_path / "hf") == 2
    err = one_line_error(capsys.readouterr().err, "convert")
    meaning = "missing (they would start at random)" if change == "missing" else "of another shape"
    assert f"does not hold the weights of the Kimi Linear model its config.json describes: 1 {meaning}" in err
    assert name in err and not (tmp_path / "hf").exists()


def test_a_run_exported_as_kimi_linear_keeps_its_tokenizer_and_exports_on(tmp_path, capsys, quiet_transformers):
    """--to kimi_linear from a run dropped the run's tokenizer, so the GGUF export of that directory was
    refused for want of a vocabulary; and reading it printed transformers' table of "UNEXPECTED" keys for
    the depth-attention weights the conversion places itself."""
    pytest.importorskip("gguf")
    assert cli("convert", kimi_checkpoint(tmp_path / "run"), tmp_path / "kimi", "--to", "kimi_linear") == 0
    assert "with its tokenizer" in capsys.readouterr().out
    assert (tmp_path / "kimi" / "tokenizer.json").is_file()
    import logging

    reports: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    try:
        assert cli("convert", tmp_path / "kimi", tmp_path / "k.gguf", "--to", "gguf") == 0
    finally:
        logger.removeHandler(handler)
    assert "written" in capsys.readouterr().out and not [r for r in reports if "LOAD REPORT" in r]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_heads=5), "ModelConfig.n_kv_heads=2 is invalid: must equal n_heads=5"),
        (dict(n_layers="4"), "ModelConfig.n_layers='4' is invalid: must be a positive integer"),
    ],
    ids=["heads", "layers-as-text"],
)
@pytest.mark.parametrize("to", ["native", "gguf"])
def test_an_attnres_directory_with_an_invalid_config_is_named_as_such(
    tmp_path, capsys, quiet_transformers, changes, message, to
):
    """The advice was to copy the weight files again, which cannot fix a config.json."""
    assert cli("convert", kimi_checkpoint(tmp_path / "run"), tmp_path / "hf") == 0
    file = tmp_path / "hf" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    capsys.readouterr()
    assert cli("convert", tmp_path / "hf", tmp_path / "out", "--to", to) == 2
    err = one_line_error(capsys.readouterr().err, "convert")
    assert f"{file} is invalid: {message}" in err and "Fix: correct that value" in err
    assert "copy the complete model directory" not in err
