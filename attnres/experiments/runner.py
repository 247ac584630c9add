"""Run an experiment: every planned run is a normal Trainer run in ``<runs>/NAME/<hash>/``.

A run directory holds what ``attnres train`` writes (config.json, metrics.jsonl,
tokenizer.json, checkpoint/) plus:

``run.json``      the experiment, labels, seed, hash, the hashed payload, and one
                  entry per invocation that worked on it (command, machine, commit,
                  wall time)
``probes.json``   measurements of the final model (``attnres.experiments.probes``)
``summary.json``  the Trainer's summary plus ``config_hash``: written last, so a run
                  is finished exactly when its summary carries the hash
``diverged.json`` when the loss became NaN/inf (a result too: not retried unless asked)

States: ``done``; ``partial`` (a checkpoint at step k < steps: resumed); ``missing``;
``reusable`` (the same hash finished in another experiment's directory: copied, no
training); ``diverged``. Runs execute sequentially in one process; several processes may work on
the same suites side by side: a process trains a config only while it holds that config hash's lock
(``<runs>/.locks/<hash>``, an flock the kernel releases when the process dies) and skips what
another process holds.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attnres.checkpoint import STATE_FILE
from attnres.experiments.env import git_commit, machine
from attnres.experiments.spec import (
    ExperimentSpec,
    PlannedRun,
    expand,
    hash_payload,
    payload_compatible,
)
from attnres.files import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    SUMMARY_FILE,
    atomic_write_json,
    exclusive_lock,
    read_json,
    this_command,
)
from attnres.train.trainer import TrainingInterrupted

# inside the repository: finished runs (everything but checkpoints and the tokenizer, see .gitignore)
# are committed, so every report regenerates from a fresh clone
DEFAULT_RUNS_ROOT = "experiments/runs"
RUN_FILE = "run.json"
PROBES_FILE = "probes.json"
SPLIT_EVAL = "val_split"  # summary.json: the final model on the whole validation split
DIVERGED_FILE = "diverged.json"
MANIFEST_FILE = "manifest.json"
LOCK_DIR = ".locks"
STATES = ("done", "diverged", "partial", "reusable", "missing")


@dataclass
class RunStatus:
    run: PlannedRun
    dir: Path
    state: str
    step: int = 0  # steps done (partial), or steps at divergence
    source: Path | None = None  # reusable: the finished directory to copy

    @property
    def finished(self) -> bool:
        return self.state in ("done", "diverged")


class LabelledRuns(str):
    """A runs directory that holds one experiment's runs under their labels (``runs/demo/block``) instead
    of ``NAME/<hash>``: for a spec with one run per label (``attnres demo``). A label's directory
    holding a run of another configuration is trained afresh."""


def experiment_dir(runs_root, name: str) -> Path:
    return Path(runs_root) if isinstance(runs_root, LabelledRuns) else Path(runs_root) / name


def planned_run_dir(runs_root, name: str, run: PlannedRun) -> Path:
    if isinstance(runs_root, LabelledRuns):
        return Path(runs_root) / "-".join(run.labels.values())
    return experiment_dir(runs_root, name) / run.hash


def is_done(run_dir: Path, hash_: str) -> bool:
    summary = read_json(run_dir / SUMMARY_FILE)
    return isinstance(summary, dict) and summary.get("config_hash") == hash_ and (run_dir / PROBES_FILE).is_file()


def _checkpoint_step(run_dir: Path) -> int | None:
    state = read_json(run_dir / CHECKPOINT_DIR / STATE_FILE)
    return state.get("step") if isinstance(state, dict) else None


def is_diverged(run_dir: Path, hash_: str) -> bool:
    div = read_json(run_dir / DIVERGED_FILE)
    return isinstance(div, dict) and div.get("config_hash") == hash_


def _diverged_status(run: PlannedRun, run_dir: Path) -> RunStatus:
    """A run that diverged in ``run_dir``, at the step its record names."""
    return RunStatus(run, run_dir, "diverged", int((read_json(run_dir / DIVERGED_FILE) or {}).get("step", 0)))


def _finished_index(exp_dir: Path) -> list[tuple]:
    """(hashed payload, directory, outcome) of every run in an experiment directory that has one: "done",
    or "diverged"."""
    out = []
    if exp_dir.is_dir():
        for d in sorted(exp_dir.iterdir()):
            info = read_json(d / RUN_FILE) if d.is_dir() else None
            if not info:
                continue
            outcome = "done" if is_done(d, d.name) else "diverged" if is_diverged(d, d.name) else None
            if outcome:
                out.append((info.get("hashed_config"), d, outcome))
    return out


def _compatible_run(
    exp_dir: Path,
    payload: dict,
    skip: str,
    indexes: dict[Path, list[tuple]] | None,
    outcome: str = "done",
):
    """A run in ``exp_dir`` (other than directory ``skip``) with this ``outcome`` that computed what
    ``payload`` asks for under an older hash (the library has since added config fields, at their
    defaults), or None. ``indexes`` memoises each directory's index across the runs of one plan."""
    index = indexes.get(exp_dir) if indexes is not None else None
    if index is None:
        index = _finished_index(exp_dir)
        if indexes is not None:
            indexes[exp_dir] = index
    return next(
        (d for stored, d, o in index if o == outcome and d.name != skip and payload_compatible(stored, payload)), None
    )


def status_of(
    run: PlannedRun, runs_root, name: str, indexes: dict[Path, list[tuple]] | None = None, *, reuse: bool = True
) -> RunStatus:
    """The state of one planned run. A finished run whose hash differs only because the library has
    since added config fields (at their defaults) counts as done (or diverged), in its own directory; one in another
    experiment is reusable (copied under its own name, which the first rule then finds) unless ``reuse``
    is off (the spec's ``reuse = false``)."""
    run_dir = planned_run_dir(runs_root, name, run)
    if is_done(run_dir, run.hash):
        return RunStatus(run, run_dir, "done", run.train.steps)
    payload = hash_payload(run.model, run.train)
    if not run_dir.exists():
        alias = _compatible_run(run_dir.parent, payload, run.hash, indexes)
        if alias is not None:
            return RunStatus(run, alias, "done", run.train.steps)
        alias = _compatible_run(run_dir.parent, payload, run.hash, indexes, outcome="diverged")
        if alias is not None:  # a divergence is an outcome too: the same config would diverge again
            return _diverged_status(run, alias)
    if is_diverged(run_dir, run.hash):
        return _diverged_status(run, run_dir)
    step = _checkpoint_step(run_dir)
    if step is not None and (read_json(run_dir / RUN_FILE) or {}).get("config_hash", run.hash) == run.hash:
        return RunStatus(run, run_dir, "partial", int(step))
    root = Path(runs_root)
    if reuse and root.is_dir() and not isinstance(runs_root, LabelledRuns):  # its neighbours are runs
        found = []  # (when it was trained, its experiment, this run's directory, the source)
        for other in sorted(root.iterdir()):
            if other.name == name:
                continue
            cand = other / run.hash
            if is_done(cand, run.hash):
                found.append((_trained_at(cand), other.name, run_dir, cand))
                continue
            alias = _compatible_run(other, payload, run.hash, indexes)
            if alias is not None:
                found.append((_trained_at(alias), other.name, run_dir.parent / alias.name, alias))
        if found:
            # the first trained of the identical runs: a later experiment's copy of the same config (trained
            # again, at another commit) never displaces the run an experiment's report already reads
            _, _, where, source = min(found, key=lambda f: (f[0], f[1]))
            return RunStatus(run, where, "reusable", run.train.steps, source=source)
    return RunStatus(run, run_dir, "missing")


def trained_invocations(info: dict) -> list[dict]:
    """The invocations of a run.json that trained the run: its own, or for a copy those of the run it copies
    (kept under ``source_invocations``), never the copying itself."""
    return info.get("source_invocations") or [i for i in info.get("invocations", []) if "reused_from" not in i]


def _trained_at(run_dir: Path) -> str:
    """When the run was first trained ('YYYY-MM-DD HH:MM:SS' of its first training invocation, through any
    copies), or '~' (after every date) where its run.json does not say."""
    info = read_json(run_dir / RUN_FILE) or {}
    trained = trained_invocations(info)
    starts = [i["started"] for i in trained if isinstance(i, dict) and isinstance(i.get("started"), str)]
    return min(starts, default="~")


def plan_status(spec: ExperimentSpec, runs_root=DEFAULT_RUNS_ROOT) -> list[RunStatus]:
    """The state of every planned run (entries sharing a hash share a directory)."""
    indexes: dict[Path, list[tuple]] = {}  # each experiment directory read once for the whole plan
    return [status_of(run, runs_root, spec.name, indexes, reuse=spec.reuse) for run in expand(spec)]


def matches(run: PlannedRun, pattern: str | None) -> bool:
    """--only: a glob over ``run.name`` and the hash; plain text matches as a substring."""
    if not pattern:
        return True
    if not any(c in pattern for c in "*?["):
        pattern = f"*{pattern}*"
    return fnmatch.fnmatch(run.name, pattern) or fnmatch.fnmatch(run.hash, pattern)


def _unique(statuses: list[RunStatus]) -> list[RunStatus]:
    seen, out = set(), []
    for s in statuses:
        if s.run.hash not in seen:
            seen.add(s.run.hash)
            out.append(s)
    return out


def estimated_seconds(s: RunStatus) -> float:
    if s.state in ("done", "diverged", "reusable"):
        return 0.0
    return s.run.estimated_seconds(s.step)


def planned_elsewhere(spec: ExperimentSpec) -> dict[str, list[str]]:
    """hash -> the other experiments (specs beside this one) that plan a run with that config."""
    from attnres.experiments.spec import ExperimentError, available, load_spec

    out: dict[str, list[str]] = {}
    for name in available(spec.path.parent):
        if name == spec.name:
            continue
        try:
            runs = expand(load_spec(name, spec.path.parent))
        except ExperimentError:
            continue  # reported when that experiment is run
        for r in runs:
            names = out.setdefault(r.hash, [])
            if name not in names:
                names.append(name)
    return out


def format_plan(
    spec: ExperimentSpec,
    statuses: list[RunStatus],
    pattern: str | None = None,
    shared: dict[str, list[str]] | None = None,
) -> str:
    """The --dry-run table: every unique run, its state and the CPU time it still needs. ``shared``
    (from ``planned_elsewhere``) marks missing runs that other experiments plan too."""
    shared = shared or {}
    unique = [s for s in _unique(statuses) if matches(s.run, pattern)]
    lines = [
        f"experiment {spec.name}: {spec.description}".rstrip(": "),
        f"spec {spec.path}; runs in {unique[0].dir.parent if unique else '-'}",
        "",
    ]
    width = max([len(s.run.name) for s in unique] + [3])
    states = []
    for s in unique:
        state = s.state if s.state != "partial" else f"partial {s.step}/{s.run.train.steps}"
        if s.state == "reusable":
            assert s.source is not None  # a reusable status names the directory it copies
            state = f"reusable ({s.source.parent.name})"
        elif s.state in ("missing", "partial") and s.run.hash in shared:
            state += f" (also in {', '.join(shared[s.run.hash])})"
        if s.state in ("missing", "partial"):
            holder = lock_holder(s.dir.parent.parent, s.run.hash)
            if holder:
                state += f" (training now: {holder.split(':')[0]})"
        states.append(state)
    sw = max([len(x) for x in states] + [5])
    lines.append(f"{'run':<{width}}  {'hash':<12}  {'state':<{sw}}  {'tokens':>10}  {'est. min':>8}")
    for s, state in zip(unique, states, strict=True):
        lines.append(
            f"{s.run.name:<{width}}  {s.run.hash:<12}  {state:<{sw}}  {s.run.tokens:>10,}  "
            f"{estimated_seconds(s) / 60:>8.1f}"
        )
    counts = {k: sum(1 for s in unique if s.state == k) for k in STATES}
    total = sum(s.run.estimated_seconds(0) for s in unique)
    left = sum(estimated_seconds(s) for s in unique)
    lines += [
        "",
        f"{len(unique)} unique runs ({len(statuses)} planned entries, identical configs share "
        "a run): " + ", ".join(f"{v} {k}" for k, v in counts.items() if v),
        f"estimated CPU time: {left / 3600:.2f} h still to run, {total / 3600:.2f} h for the whole "
        f"experiment" + (f" (stated budget {spec.budget_cpu_hours:g} h)" if spec.budget_cpu_hours else ""),
    ]
    common = [s for s in unique if s.state in ("missing", "partial") and s.run.hash in shared]
    if common:
        others = sorted({n for s in common for n in shared[s.run.hash]})
        lines.append(
            f"{len(common)} of the runs still to run ({sum(estimated_seconds(s) for s in common) / 3600:.2f} h) "
            f"are also planned by {', '.join(others)}: whichever experiment trains them first, the "
            "others copy them"
        )
    factor = _measured_speed_factor(unique)
    if factor is not None and left > 0:
        lines.append(
            f"the finished runs trained at {factor:.2f}x the stated throughput: at that pace the "
            f"rest takes about {left / factor / 3600:.2f} h"
        )
    if spec.budget_note:
        lines.append(f"budget: {spec.budget_note}")
    return "\n".join(lines)


def _measured_speed_factor(statuses: list[RunStatus]) -> float | None:
    """Measured over stated throughput, from the optimizer-step time of the finished runs."""
    stated = measured = 0.0
    for s in statuses:
        if s.state != "done":
            continue
        summary = read_json(s.dir / SUMMARY_FILE) or {}
        secs = summary.get("train_seconds")
        if secs:
            stated += s.run.tokens / s.run.tokens_per_second
            measured += float(secs)
    return stated / measured if measured > 0 else None


# ----------------------------------------------------------------------------- execution


def config_lock(runs_root, hash_: str):
    """Hold the lock of one config hash (every experiment's copy of it): a context that yields None
    when this process holds it, else who does ("pid N: command"), and then this process must leave
    the run alone."""
    return exclusive_lock(Path(runs_root) / LOCK_DIR / hash_, holder=_command())


def lock_holder(runs_root, hash_: str) -> str | None:
    """Who trains this config right now, or None. Reads the lock file without taking the lock (a probe
    that took it could make a training process skip the run)."""
    try:
        text = (Path(runs_root) / LOCK_DIR / hash_).read_text().strip()
        pid = int(text.split(":")[0].split()[1])
        os.kill(pid, 0)  # the lock dies with its process; a stale file names a process that is gone
    except PermissionError:  # alive, another user's
        return text
    except (OSError, ValueError, IndexError):
        return None
    return text


def remove_runs(spec: ExperimentSpec, runs_root) -> list[Path]:
    """Delete the directories of ``spec``'s planned runs in its experiment directory (to train them
    afresh); finished runs of other experiments are left alone. Returns the directories deleted."""
    exp_dir = experiment_dir(runs_root, spec.name)
    removed = []
    for s in _unique(plan_status(spec, runs_root)):
        if s.dir.parent == exp_dir and s.dir.is_dir():
            shutil.rmtree(s.dir)
            removed.append(s.dir)
    return removed


def write_manifest(spec: ExperimentSpec, statuses: list[RunStatus], runs_root) -> Path:
    d = experiment_dir(runs_root, spec.name)
    d.mkdir(parents=True, exist_ok=True)
    manifest = {
        "experiment": spec.name,
        "spec": str(spec.path),
        "spec_sha256": spec.sha256,
        "updated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": [
            {"hash": s.run.hash, "labels": s.run.labels, "seed": s.run.seed, "state": s.state, "dir": s.dir.name}
            for s in statuses
        ],
    }
    atomic_write_json(d / MANIFEST_FILE, manifest)
    return d / MANIFEST_FILE


def _command() -> str:
    """The command line of this process (the CLI passes its own reconstruction instead)."""
    return this_command()


def _record_invocation(run_dir: Path, spec: ExperimentSpec, run: PlannedRun, entry: dict) -> None:
    info = read_json(run_dir / RUN_FILE) or {}
    info.update(
        {
            "experiment": spec.name,
            "labels": run.labels,
            "seed": run.seed,
            "config_hash": run.hash,
            "hashed_config": hash_payload(run.model, run.train),
        }
    )
    info.setdefault("invocations", []).append(entry)
    atomic_write_json(run_dir / RUN_FILE, info)


def _clear_outputs(run_dir: Path) -> None:
    """Before a fresh start: drop files of an older attempt so metrics do not mix."""
    for p in list(run_dir.iterdir()) if run_dir.is_dir() else []:
        if p.name == RUN_FILE:
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def train_seconds(run_dir: Path) -> float:
    """Sum of optimizer-step times in metrics.jsonl (resumes included, evaluation excluded)."""
    total = 0.0
    path = run_dir / METRICS_FILE
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("kind") == "train":
                total += float(row.get("step_seconds", 0.0))
    return total


def _reuse(s: RunStatus, spec: ExperimentSpec, log, command: str) -> None:
    assert s.source is not None  # a reusable status names the directory it copies
    if s.dir.exists():
        shutil.rmtree(s.dir)
    shutil.copytree(s.source, s.dir, ignore=shutil.ignore_patterns(CHECKPOINT_DIR, ".*"))
    # the copy's own history is the copy; where and how the run was trained moves to source_invocations
    info = read_json(s.dir / RUN_FILE) or {}
    origin = trained_invocations(info)
    info.update(source_invocations=origin, invocations=[])
    atomic_write_json(s.dir / RUN_FILE, info)
    _record_invocation(
        s.dir,
        spec,
        s.run,
        {"reused_from": str(s.source), "command": command, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
    )
    log(f"[{s.run.name}] reused the finished run {s.source} (same config)")


def execute_one(
    s: RunStatus,
    spec: ExperimentSpec,
    *,
    progress: bool = True,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    command: str | None = None,
) -> str:
    """Train (or resume) one run, probe the final model, write the summary. Returns the new state."""
    from attnres.checkpoint import CheckpointError
    from attnres.experiments.probes import run_probes
    from attnres.train.trainer import Trainer, TrainingDiverged

    run, run_dir = s.run, s.dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model_cfg = copy.deepcopy(run.model)
    train_cfg = copy.deepcopy(run.train)
    train_cfg.out_dir = str(run_dir)
    train_cfg.progress = progress
    if threads:
        train_cfg.threads = threads
    started = time.time()
    entry = {
        "command": command or _command(),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "from_step": 0,
    }
    resume = s.state == "partial"
    if resume:
        try:
            trainer = Trainer(model_cfg, train_cfg, resume=True, log=log, name=run.name)
            entry["from_step"] = trainer.step
        except (CheckpointError, ValueError) as e:
            log(f"[{run.name}] cannot resume ({e}); training from scratch")
            resume = False
    if not resume:
        _clear_outputs(run_dir)
        model_cfg, train_cfg = copy.deepcopy(run.model), train_cfg
        trainer = Trainer(model_cfg, train_cfg, resume=False, log=log, name=run.name)
    entry["machine"] = machine()  # only now: the Trainer applies train_cfg.threads
    log(
        f"[{run.name}] {trainer.model.num_params():,} parameters, {run.train.steps} steps x "
        f"{run.train.batch_size}x{run.train.seq_len} tokens -> {run_dir}"
        + (f" (resuming at step {trainer.step})" if resume else "")
    )
    try:
        result = trainer.run()
    except TrainingDiverged as e:
        atomic_write_json(run_dir / DIVERGED_FILE, {"config_hash": run.hash, "step": trainer.step, "error": str(e)})
        entry["wall_seconds"] = time.time() - started
        entry["outcome"] = "diverged"
        _record_invocation(run_dir, spec, run, entry)
        log(f"[{run.name}] diverged at step {trainer.step}: recorded, moving on")
        return "diverged"
    except BaseException:
        entry["wall_seconds"] = time.time() - started
        entry["outcome"] = "interrupted"
        _record_invocation(run_dir, spec, run, entry)
        raise
    probes = run_probes(trainer.model, trainer.data.val, seq_len=run.train.seq_len)
    atomic_write_json(run_dir / PROBES_FILE, probes)
    whole = whole_split_eval(trainer) if spec.eval_split else None
    entry["wall_seconds"] = time.time() - started
    entry["outcome"] = "done"
    _record_invocation(run_dir, spec, run, entry)
    info = read_json(run_dir / RUN_FILE) or {}
    summary = {
        **result.__dict__,
        "config_hash": run.hash,
        "experiment": spec.name,
        "labels": run.labels,
        "seed": run.seed,
        "train_seconds": train_seconds(run_dir),
        "wall_seconds_total": sum(i.get("wall_seconds", 0.0) for i in info.get("invocations", [])),
        # the trainer's last evaluation read this many tokens: the first eval_batches batches of the split
        "val_tokens": _slice_tokens(trainer),
    }
    if whole is not None:
        summary[SPLIT_EVAL] = whole
    atomic_write_json(run_dir / SUMMARY_FILE, summary)
    if not spec.keep_checkpoint:
        shutil.rmtree(run_dir / CHECKPOINT_DIR, ignore_errors=True)
    log(f"[{run.name}] val loss {result.val_loss:.4f} in {summary['train_seconds']:.0f} s of training")
    return "done"


def whole_split_eval(trainer) -> dict:
    """The final model's loss on every window of the validation split (``attnres.train.evaluation``),
    with how many tokens that is: the same text for every run of one data and tokenizer."""
    from attnres.train.evaluation import evaluate

    c = trainer.cfg
    ev = evaluate(
        trainer.model,
        trainer.data.val,
        batch_size=c.batch_size,
        seq_len=c.seq_len,
        max_batches=None,
        loss_of=trainer.strategy.eval_loss,
    )
    return {**ev, "split_tokens": len(trainer.data.val.tokens)}


def _slice_tokens(trainer) -> int:
    from attnres.data import count_eval_batches

    c = trainer.cfg
    windows = (len(trainer.data.val.tokens) - 1) // c.seq_len
    batches = count_eval_batches(len(trainer.data.val.tokens), c.batch_size, c.seq_len, c.eval_batches)
    return min(windows, batches * c.batch_size) * c.seq_len


def run_experiment(
    spec: ExperimentSpec,
    runs_root=DEFAULT_RUNS_ROOT,
    *,
    max_runs: int | None = None,
    only: str | None = None,
    retry_diverged: bool = False,
    progress: bool = True,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    command: str | None = None,
    resume_with: str | None = None,
) -> dict[str, int]:
    """Execute the missing runs (sequentially), at most ``max_runs`` trainings. Returns counts of
    what happened: trained, resumed, reused, diverged, skipped (already finished), busy (another process
    holds it), left. ``command`` is recorded with each run; ``resume_with`` is the command an
    interruption tells the user to run again (default ``attnres experiment NAME``)."""
    command = command or _command()
    resume_with = resume_with or f"attnres experiment {spec.name}"
    statuses = plan_status(spec, runs_root)
    counts = {"trained": 0, "resumed": 0, "reused": 0, "diverged": 0, "skipped": 0, "busy": 0, "left": 0}
    write_manifest(spec, statuses, runs_root)
    trained = 0
    for s in _unique(statuses):
        if not matches(s.run, only):
            continue
        with config_lock(runs_root, s.run.hash) as holder:
            if holder is not None:
                log(f"[{s.run.name}] {holder} is training this config: left to it")
                counts["busy"] += 1
                continue
            outcome = _advance(
                s,
                spec,
                runs_root,
                may_train=max_runs is None or trained < max_runs,
                retry_diverged=retry_diverged,
                progress=progress,
                threads=threads,
                log=log,
                command=command,
                resume_with=resume_with,
            )
            counts[outcome] += 1
            trained += outcome in ("trained", "resumed", "diverged")
    return counts


def _advance(
    s: RunStatus,
    spec: ExperimentSpec,
    runs_root,
    *,
    may_train: bool,
    retry_diverged: bool,
    progress: bool,
    threads: int | None,
    log,
    command: str,
    resume_with: str,
) -> str:
    """One planned run, under its config lock: skip, copy or train it. Returns what happened (a key of
    run_experiment's counts)."""
    # fresh: an earlier entry or another process may have made it
    s = status_of(s.run, runs_root, spec.name, reuse=spec.reuse)
    if s.state == "done" or (s.state == "diverged" and not retry_diverged):
        return "skipped"
    source = s.source if s.state == "reusable" else None
    if source is not None and spec.keep_checkpoint and not (source / CHECKPOINT_DIR).is_dir():
        # a spec that keeps checkpoints (to measure the models later) trains the same config again
        log(f"[{s.run.name}] {s.source} has no checkpoint to keep: training the same config here")
        s = RunStatus(s.run, planned_run_dir(runs_root, spec.name, s.run), "missing")
    if s.state == "reusable":
        _reuse(s, spec, log, command)
        return "reused"
    if not may_train:
        return "left"
    if s.state == "diverged":  # a retry starts from scratch: resuming would diverge again
        shutil.rmtree(s.dir, ignore_errors=True)
        s = status_of(s.run, runs_root, spec.name, reuse=spec.reuse)
    try:
        outcome = execute_one(s, spec, progress=progress, threads=threads, log=log, command=command)
    except TrainingInterrupted as e:
        stop = TrainingInterrupted(
            f"{s.run.name}: {str(e).split(';')[0]}; its checkpoint is in {s.dir}. Run "
            f"`{resume_with}` again to resume it and continue the suite"
        )
        stop.exit_code = e.exit_code  # 143 after SIGTERM
        raise stop from None
    finally:
        write_manifest(spec, plan_status(spec, runs_root), runs_root)
    if outcome == "diverged":
        return "diverged"
    return "resumed" if s.state == "partial" else "trained"
