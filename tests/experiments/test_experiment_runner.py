"""The runner: finished runs are skipped, interrupted ones resume exactly, identical configs run once."""

import io
import json
import os
import signal

import pytest
import torch

from attnres.experiments import load_spec, plan_status, run_experiment
from attnres.experiments.reports import shares_sublayer_init, write_report
from attnres.experiments.runner import DIVERGED_FILE, PROBES_FILE, RUN_FILE
from attnres.files import SUMMARY_FILE
from attnres.parallel import runtime as runtime_module
from attnres.train.trainer import Trainer, TrainingInterrupted


def quiet(_msg):
    pass


@pytest.fixture
def two_by_two(tmp_path, write_spec, tiny_base):
    write_spec(
        tmp_path / "specs",
        "pair",
        f"""
        [experiment]
        name = "pair"
        seeds = [0, 1]
        {tiny_base(steps=6)}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "block"
        residual = "block"
    """,
    )
    return load_spec("pair", tmp_path / "specs"), tmp_path / "runs"


def states(spec, root):
    return [s.state for s in plan_status(spec, root)]


def train_losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_runs_in_slices_then_skips_what_is_finished(two_by_two):
    spec, root = two_by_two
    counts = run_experiment(spec, root, max_runs=1, progress=False, log=quiet)
    assert counts["trained"] == 1 and counts["left"] == 3
    assert states(spec, root) == ["done", "missing", "missing", "missing"]
    counts = run_experiment(spec, root, only="scheme=block", progress=False, log=quiet)
    assert counts["trained"] == 2 and counts["skipped"] == 0
    assert states(spec, root) == ["done", "missing", "done", "done"]
    counts = run_experiment(spec, root, progress=False, log=quiet)
    assert counts["trained"] == 1 and counts["skipped"] == 3
    counts = run_experiment(spec, root, progress=False, log=quiet)
    assert counts["trained"] == 0 and counts["skipped"] == 4

    status = plan_status(spec, root)[0]
    run_dir = status.dir
    assert run_dir == root / "pair" / status.run.hash
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    assert summary["config_hash"] == status.run.hash and summary["labels"] == {"scheme": "prenorm"}
    assert summary["train_seconds"] > 0 and summary["steps"] == 6
    info = json.loads((run_dir / RUN_FILE).read_text())
    assert info["hashed_config"]["train"]["seed"] == 0 and info["invocations"][0]["commit"]
    probes = json.loads((run_dir / PROBES_FILE).read_text())
    assert len(probes["output_rms"]) == 4 and len(probes["block_grad_norm"]) == 2
    assert probes["depth_weights"] is None and probes["mixing"][1][:2] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert not (run_dir / "checkpoint").exists()  # keep_checkpoint = false
    manifest = json.loads((root / "pair" / "manifest.json").read_text())
    assert [r["state"] for r in manifest["runs"]] == ["done"] * 4


def test_the_run_record_names_the_thread_count_it_trained_with(two_by_two, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    spec, root = two_by_two
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the process default; --threads 1 applies when the Trainer starts
        run_experiment(spec, root, only="prenorm/seed=0", threads=1, progress=True, log=quiet)
    finally:
        torch.set_num_threads(before)
    info = json.loads((plan_status(spec, root)[0].dir / RUN_FILE).read_text())
    assert "(1 threads)" in info["invocations"][0]["machine"]
    # the progress bar is named by the run, not by its directory (the config hash)
    status = plan_status(spec, root)[0]
    assert f"{status.run.name}: " in terminal.getvalue() and status.run.hash not in terminal.getvalue()


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_resumes_from_its_checkpoint_exactly(two_by_two, monkeypatch, signum, code):
    spec, root = two_by_two
    original = Trainer.train_step

    def interrupting(self):
        loss = original(self)
        if self.step == 3:
            os.kill(os.getpid(), signum)  # a real Ctrl-C (or kill), handled between steps
        return loss

    monkeypatch.setattr(Trainer, "train_step", interrupting)
    with pytest.raises(
        TrainingInterrupted,
        match=r"scheme=block/seed=1: interrupted at step 3.*"
        r"`attnres experiment pair` again to resume",
    ) as stopped:
        run_experiment(spec, root, only="block/seed=1", progress=False, log=quiet)
    assert stopped.value.exit_code == code  # what `attnres experiment` exits with
    monkeypatch.setattr(Trainer, "train_step", original)
    status = [s for s in plan_status(spec, root) if s.run.name == "scheme=block/seed=1"][0]
    assert status.state == "partial" and status.step == 3
    assert len(train_losses(status.dir)) == 3

    counts = run_experiment(spec, root, only="block/seed=1", progress=False, log=quiet)
    assert counts["resumed"] == 1
    resumed = train_losses(status.dir)
    info = json.loads((status.dir / RUN_FILE).read_text())
    assert [i["outcome"] for i in info["invocations"]] == ["interrupted", "done"]
    assert info["invocations"][1]["from_step"] == 3

    other = root.parent / "uninterrupted"
    run_experiment(spec, other, only="block/seed=1", progress=False, log=quiet)
    assert train_losses(other / "pair" / status.run.hash) == resumed  # bitwise


def test_identical_configs_share_a_run_and_other_experiments_reuse_it(tmp_path, write_spec, tiny_base):
    specs, root = tmp_path / "specs", tmp_path / "runs"
    write_spec(
        specs,
        "first",
        f"""
        [experiment]
        name = "first"
        {tiny_base()}
        [[axis.budget]]
        label = "short"
        [[axis.budget]]
        label = "same"
    """,
    )
    first = load_spec("first", specs)
    assert len({s.run.hash for s in plan_status(first, root)}) == 1
    counts = run_experiment(first, root, progress=False, log=quiet)
    assert counts["trained"] == 1 and states(first, root) == ["done", "done"]

    write_spec(
        specs,
        "second",
        f"""
        [experiment]
        name = "second"
        {tiny_base()}
    """,
    )
    second = load_spec("second", specs)
    assert states(second, root) == ["reusable"]
    counts = run_experiment(second, root, progress=False, log=quiet)
    assert counts == {**counts, "reused": 1, "trained": 0}
    (s,) = plan_status(second, root)
    assert s.state == "done" and s.dir.parent.name == "second"
    info = json.loads((s.dir / RUN_FILE).read_text())
    assert "first" in info["invocations"][-1]["reused_from"]

    # the copy's time counts in the experiment that trained it, optimizer steps and wall time alike
    summary = json.loads((s.dir / SUMMARY_FILE).read_text())
    (s.dir / SUMMARY_FILE).write_text(json.dumps({**summary, "train_seconds": 7200.0}))
    text = write_report(second, root, tmp_path / "report").read_text()
    assert "Wall time of the finished runs: 0.00 h in all (0.00 h in optimizer steps" in text
    assert "1 run comes from identical runs of first (their time counts there)" in text

    # reuse = false: the same config is trained afresh, never copied (one code version per experiment)
    write_spec(
        specs,
        "fresh",
        f"""
        [experiment]
        name = "fresh"
        reuse = false
        {tiny_base()}
    """,
    )
    fresh = load_spec("fresh", specs)
    assert states(fresh, root) == ["missing"]


def test_divergence_is_recorded_and_not_retried_unless_asked(two_by_two, monkeypatch):
    spec, root = two_by_two

    def nan_loss(logits, targets):
        return logits.sum() * float("nan")

    monkeypatch.setattr(runtime_module, "lm_loss", nan_loss)
    counts = run_experiment(spec, root, only="prenorm/seed=0", progress=False, log=quiet)
    assert counts["diverged"] == 1
    status = plan_status(spec, root)[0]
    assert status.state == "diverged"
    assert json.loads((status.dir / DIVERGED_FILE).read_text())["step"] == 0
    assert run_experiment(spec, root, only="prenorm/seed=0", progress=False, log=quiet)["skipped"] == 1
    monkeypatch.undo()
    counts = run_experiment(spec, root, only="prenorm/seed=0", retry_diverged=True, progress=False, log=quiet)
    assert counts["trained"] == 1 and plan_status(spec, root)[0].state == "done"


def test_keep_checkpoint_and_same_seed_same_sublayer_init(tmp_path, write_spec, tiny_base):
    write_spec(
        tmp_path,
        "keep",
        f"""
        [experiment]
        name = "keep"
        keep_checkpoint = true
        {tiny_base(steps=2)}
        [[axis.scheme]]
        label = "prenorm"
        residual = "prenorm"
        [[axis.scheme]]
        label = "full"
        residual = "full"
    """,
    )
    spec = load_spec("keep", tmp_path)
    run_experiment(spec, tmp_path / "runs", progress=False, log=quiet)
    statuses = plan_status(spec, tmp_path / "runs")
    assert all((s.dir / "checkpoint" / "state.json").exists() for s in statuses)
    # one seed: the same sublayer initialisation for every scheme (schemes that draw random numbers,
    # like mudd, do so on a forked RNG)
    prenorm, full = (s.run.model.to_dict() for s in statuses)
    assert shares_sublayer_init(prenorm, full)
    assert shares_sublayer_init(prenorm, {**prenorm, "residual": "mudd"})


def test_runs_stay_finished_when_the_library_adds_config_fields(two_by_two):
    """A run made before a new ModelConfig/TrainConfig field existed (its payload lacks the field) still
    counts as done while the new field is at its default; a missing field set otherwise does not."""
    spec, root = two_by_two
    run_experiment(spec, root, only="prenorm/seed=0", progress=False, log=quiet)
    status = plan_status(spec, root)[0]

    def as_older_library(dropped, name):
        old_dir = status.dir.parent / name
        status.dir.rename(old_dir)
        info = json.loads((old_dir / RUN_FILE).read_text())
        del info["hashed_config"]["model"][dropped]
        (old_dir / RUN_FILE).write_text(json.dumps(info))
        summary = json.loads((old_dir / SUMMARY_FILE).read_text())
        (old_dir / SUMMARY_FILE).write_text(json.dumps({**summary, "config_hash": name}))
        return old_dir

    old_dir = as_older_library("highway_rank", "0123456789ab")  # None: the default
    first = plan_status(spec, root)[0]
    assert first.state == "done" and first.dir == old_dir
    assert run_experiment(spec, root, only="prenorm/seed=0", progress=False, log=quiet)["skipped"] == 1

    old_dir.rename(status.dir)
    info = json.loads((status.dir / RUN_FILE).read_text())
    info["hashed_config"]["model"]["highway_rank"] = None
    (status.dir / RUN_FILE).write_text(json.dumps(info))
    as_older_library("d_model", "ba9876543210")  # 32 here, not the default 128: a different run
    assert plan_status(spec, root)[0].state == "missing"


def test_a_run_that_diverged_under_an_older_hash_stays_diverged(two_by_two):
    """A divergence is an outcome: recorded before the library added a config field (at its default), the
    run still counts as diverged, so a report sees a rate that diverged and not one still to train."""
    spec, root = two_by_two
    run_experiment(spec, root, only="prenorm/seed=0", progress=False, log=quiet)
    status = plan_status(spec, root)[0]
    old_dir = status.dir.parent / "0123456789ab"
    status.dir.rename(old_dir)
    (old_dir / SUMMARY_FILE).unlink()
    info = json.loads((old_dir / RUN_FILE).read_text())
    del info["hashed_config"]["model"]["highway_rank"]  # None, the default: the same run
    (old_dir / RUN_FILE).write_text(json.dumps(info))
    (old_dir / DIVERGED_FILE).write_text(json.dumps({"config_hash": "0123456789ab", "step": 3, "error": "nan"}))
    first = plan_status(spec, root)[0]
    assert (first.state, first.dir, first.step) == ("diverged", old_dir, 3)
    assert run_experiment(spec, root, only="prenorm/seed=0", progress=False, log=quiet)["skipped"] == 1


def test_another_experiments_run_under_an_older_hash_is_reused(tmp_path, write_spec, tiny_base):
    """A run another experiment finished before a config field existed is copied, not trained again,
    and the copy keeps the older name under which the alias lookup finds it done."""
    specs, root = tmp_path / "specs", tmp_path / "runs"
    for name in ("first", "second"):
        write_spec(
            specs,
            name,
            f"""
            [experiment]
            name = "{name}"
            {tiny_base()}
        """,
        )
    first, second = load_spec("first", specs), load_spec("second", specs)
    run_experiment(first, root, progress=False, log=quiet)
    (done,) = plan_status(first, root)
    old_dir = done.dir.parent / "0123456789ab"
    done.dir.rename(old_dir)
    info = json.loads((old_dir / RUN_FILE).read_text())
    del info["hashed_config"]["model"]["highway_rank"]  # None, the default: the same run
    (old_dir / RUN_FILE).write_text(json.dumps(info))
    summary = json.loads((old_dir / SUMMARY_FILE).read_text())
    (old_dir / SUMMARY_FILE).write_text(json.dumps({**summary, "config_hash": "0123456789ab"}))

    (s,) = plan_status(second, root)
    assert s.state == "reusable" and s.source == old_dir
    counts = run_experiment(second, root, progress=False, log=quiet)
    assert counts == {**counts, "reused": 1, "trained": 0}
    (s,) = plan_status(second, root)
    assert s.state == "done" and s.dir == root / "second" / "0123456789ab"


def test_a_config_another_process_trains_is_left_to_it(two_by_two):
    """Two `attnres experiment` processes side by side: each config hash trains in one process only."""
    import subprocess
    import sys

    from attnres.experiments.runner import config_lock, format_plan

    spec, root = two_by_two
    first = plan_status(spec, root)[0].run
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from attnres.experiments.runner import config_lock\n"
                f"with config_lock({str(root)!r}, {first.hash!r}) as h:\n"
                "    assert h is None; print('held', flush=True); sys.stdin.readline()"
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert f"training now: pid {holder.pid}" in format_plan(spec, plan_status(spec, root))
        with config_lock(root, first.hash) as h:  # what a second process sees
            assert h.startswith(f"pid {holder.pid}: ")
        logged = []
        counts = run_experiment(spec, root, only="scheme=prenorm", progress=False, log=logged.append)
        assert counts["busy"] == 1 and counts["trained"] == 1
        assert states(spec, root) == ["missing", "done", "missing", "missing"]
        assert any("is training this config: left to it" in m for m in logged)
    finally:
        holder.communicate("\n", timeout=60)
    assert "training now" not in format_plan(spec, plan_status(spec, root))  # released with its holder
    counts = run_experiment(spec, root, only="scheme=prenorm", progress=False, log=quiet)
    assert counts["busy"] == 0 and counts["trained"] == 1 and counts["skipped"] == 1


def test_the_final_loss_covers_the_whole_validation_split(tmp_path, write_spec, tiny_base):
    """summary.json's val_split is the final model's loss over every window of the validation split (the
    trainer's own evaluations read only eval_batches batches); a report reads it only when every finished
    run has it, so no comparison sets one run's whole split against another's first batches."""
    from attnres.checkpoint import load_model
    from attnres.data import eval_batches, prepare_data
    from attnres.experiments.results import collect
    from attnres.model.llama import lm_loss

    write_spec(
        tmp_path / "specs",
        "split",
        f"""
        [experiment]
        name = "split"
        seeds = [0, 1]
        keep_checkpoint = true
        {tiny_base(steps=4)}
        [[axis.scheme]]
        label = "block"
        residual = "block"
    """,
    )
    spec, root = load_spec("split", tmp_path / "specs"), tmp_path / "runs"
    run_experiment(spec, root, progress=False, log=quiet)
    statuses = plan_status(spec, root)
    run_dir, t = statuses[0].dir, statuses[0].run.train
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    whole = summary["val_split"]
    windows = (whole["split_tokens"] - 1) // t.seq_len
    assert whole["val_tokens"] == windows * t.seq_len
    assert summary["val_tokens"] == min(windows, t.eval_batches * t.batch_size) * t.seq_len < whole["val_tokens"]

    model, tokenizer, _ = load_model(run_dir)
    val = prepare_data(t.data, tokenizer=tokenizer, vocab_size=t.vocab_size, val_fraction=t.val_fraction).val
    total = n = 0
    with torch.no_grad():
        model.eval()
        for x, y in eval_batches(val.tokens, t.batch_size, t.seq_len):
            total += lm_loss(model(x), y).item() * y.numel()
            n += y.numel()
    assert n == whole["val_tokens"] and whole["val_loss"] == pytest.approx(total / n, rel=1e-6)

    col = collect(spec, root)
    assert col.scope == "split" and col.results[0].loss == whole["val_loss"]
    assert col.results[0].eval_tokens == whole["val_tokens"]
    other = statuses[1].dir / SUMMARY_FILE  # a run that predates the whole-split evaluation
    old = json.loads(other.read_text())
    del old["val_split"], old["val_tokens"]
    other.write_text(json.dumps(old))
    col = collect(spec, root)
    assert col.scope == "slice" and all(
        r.loss == json.loads((r.dir / SUMMARY_FILE).read_text())["val_loss"] for r in col.results
    )
    assert col.results[1].eval_tokens == t.eval_batches * t.batch_size * t.seq_len


def test_the_first_trained_of_identical_runs_is_the_one_reused(tmp_path, write_spec, tiny_base):
    """Two experiments hold the same config, trained at different times: a third reuses the first trained,
    whatever the experiments' names, so a later experiment never changes what an existing report reads."""
    specs, root = tmp_path / "specs", tmp_path / "runs"
    for name in ("zeta", "alpha", "third"):
        write_spec(
            specs,
            name,
            f"""
            [experiment]
            name = "{name}"
            reuse = false
            {tiny_base()}
        """,
        )
    zeta, alpha = load_spec("zeta", specs), load_spec("alpha", specs)
    run_experiment(zeta, root, progress=False, log=quiet)
    run_experiment(alpha, root, progress=False, log=quiet)

    def trained(spec, started: str) -> None:
        (done,) = plan_status(spec, root)
        info = json.loads((done.dir / RUN_FILE).read_text())
        info["invocations"][0]["started"] = started
        (done.dir / RUN_FILE).write_text(json.dumps(info))

    trained(zeta, "2026-01-01 00:00:00")
    trained(alpha, "2026-02-01 00:00:00")
    third = load_spec("third", specs)
    third.reuse = True
    (s,) = plan_status(third, root)
    assert s.state == "reusable" and s.source.parent.name == "zeta"  # trained first, though named last
    trained(zeta, "2026-03-01 00:00:00")
    (s,) = plan_status(third, root)
    assert s.source.parent.name == "alpha"
