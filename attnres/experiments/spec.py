"""Experiment specs: plain TOML data, expanded into fully resolved, hashed run configs.

A spec file ``experiments/NAME.toml``::

    [experiment]
    name = "NAME"                 # must equal the file name
    description = "..."
    report = "ablations"          # which report to build (default: the name, else "generic")
    seeds = [0, 1]                # default seeds of every run
    budget_cpu_hours = 1.5        # the planned CPU time, stated in the report
    budget_note = "..."           # how the budget was sized (measured throughput)
    tokens_per_second = 6000      # default throughput estimate for --dry-run
    keep_checkpoint = false       # keep each finished run's final checkpoint
    eval_split = true             # evaluate each final model on the whole validation split
    reuse = true                  # copy finished runs of the same config from other experiments

    [base]                        # preset + ModelConfig / TrainConfig fields
    preset = "demo"
    n_layers = 16

    [grid]                        # optional: one axis per key, one point per value
    lr = [1e-3, 3e-3]

    [[axis.scheme]]               # optional: named axes of labelled points
    label = "prenorm"
    residual = "prenorm"
    seeds = [0, 1, 2]             # this point's runs use these seeds instead

    [[runs]]                      # optional: the axis "run"

The planned runs are the Cartesian product of every axis (grid keys first,
then ``axis.*`` tables in file order, then ``runs``), each with each of its
seeds. A point holds a ``label`` and config overrides, plus these reserved
keys: ``seeds`` (the last axis that sets it wins), ``tags`` (extra labels for
the report), ``paper_loss`` (the paper's number for this row),
``tokens_per_second`` (throughput estimate: the last one wins), ``speed``
(a relative throughput factor: they multiply) and ``by`` (overrides that apply
only together with a point of another axis)::

    [[axis.budget]]
    label = "equal-time"
    [axis.budget.by.scheme]       # when the run's scheme is "mhc", also set steps = 154
    mhc = { steps = 154, warmup_steps = 15 }

Overrides apply in order: preset, ``[base]``, then each point in axis order
(its own overrides, then its matching ``by`` overrides), then the seed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnres.files import parse_toml
from attnres.model.config import ModelConfig
from attnres.train.config import (
    PARALLEL_FIELDS,
    TrainConfig,
    build_configs,
    split_overrides,
)

HASH_VERSION = 1
# TrainConfig fields that cannot change what a run computes; everything else is hashed.
UNHASHED_TRAIN_FIELDS = frozenset({"out_dir", "progress", "threads", "cache_dir", "checkpoint_every"}) | PARALLEL_FIELDS
RESERVED_POINT_KEYS = frozenset({"label", "seeds", "tags", "paper_loss", "tokens_per_second", "speed", "by"})
EXPERIMENT_KEYS = frozenset(
    {
        "name",
        "description",
        "report",
        "seeds",
        "budget_cpu_hours",
        "budget_note",
        "tokens_per_second",
        "keep_checkpoint",
        "eval_split",
        "reuse",
        "baseline",
        "headline",
    }
)
TOP_LEVEL_KEYS = ("experiment", "base", "grid", "axis", "runs")
# report kind -> the axes its sections read (attnres.experiments.reports)
REPORT_AXES = {
    "scaling": ("size", "scheme"),
    "ablations": (),
    "block-size": (),
    "arena": ("scheme", "budget"),
    "dynamics": ("scheme",),
    "arch-sweep": ("shape", "scheme"),
    "demo": ("scheme",),
    "kimi-linear": ("backbone", "scheme"),
    "retrofit": ("arm",),
    "routing": ("backbone", "scheme"),
    "importance": ("backbone", "scheme"),
    "kimi-scaling": ("size", "scheme"),
    "lr-sweep": ("lr", "backbone", "scheme"),
    "additive": ("backbone", "scheme"),
    "generic": (),
}
DEFAULT_TOKENS_PER_SECOND = 6000.0
SPECS_ENV = "ATTNRES_EXPERIMENTS"
# the specs of this checkout (attnres demo reads its spec here, wherever it is run from)
CHECKOUT_SPECS_DIR = Path(__file__).resolve().parents[2] / "experiments"


class ExperimentError(ValueError):
    """A user error about an experiment: unknown name, malformed spec. One line, no traceback."""


# ----------------------------------------------------------------------------- data


@dataclass
class Point:
    """One value of one axis: a label and the overrides it applies."""

    axis: str
    label: str
    overrides: dict[str, Any]
    seeds: list[int] | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    paper_loss: float | None = None
    tokens_per_second: float | None = None
    speed: float = 1.0
    by: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)


@dataclass
class PlannedRun:
    """One fully resolved run of an experiment."""

    labels: dict[str, str]  # axis -> point label, plus tags
    seed: int
    model: ModelConfig
    train: TrainConfig
    hash: str
    paper_loss: float | None = None
    tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND

    @property
    def group(self) -> tuple[tuple[str, str], ...]:
        """The labels without the seed: runs of one group differ by seed only."""
        return tuple(sorted(self.labels.items()))

    @property
    def name(self) -> str:
        """A readable id, matched by --only: ``scheme=full/size=s2/seed=1``."""
        return "/".join(f"{k}={v}" for k, v in self.labels.items()) + f"/seed={self.seed}"

    @property
    def tokens(self) -> int:
        t = self.train
        return t.steps * t.batch_size * t.seq_len * t.grad_accum

    def estimated_seconds(self, done_steps: int = 0) -> float:
        """CPU seconds still needed: remaining training tokens plus evaluations (forward only,
        counted at a third of a training token) at the stated throughput."""
        t = self.train
        remaining = max(0, t.steps - done_steps) / t.steps
        n_evals = t.steps // t.eval_every + (0 if t.steps % t.eval_every == 0 else 1)
        eval_tokens = n_evals * t.eval_batches * t.batch_size * t.seq_len / 3
        return remaining * (self.tokens + eval_tokens) / self.tokens_per_second


@dataclass
class ExperimentSpec:
    name: str
    path: Path
    description: str
    report: str
    seeds: list[int]
    base: dict[str, Any]
    axes: list[tuple[str, list[Point]]]
    budget_cpu_hours: float | None = None
    budget_note: str = ""
    tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND
    keep_checkpoint: bool = False
    # after training, the final model's loss on the whole validation split (summary.json's val_split), the
    # loss the reports use when every finished run of the experiment has it; the trainer's own evaluations
    # read only the split's first eval_batches batches
    eval_split: bool = True
    # copy a finished run of the same config from another experiment instead of training it; false where
    # every run must come from this experiment's own code version (provenance: one clean commit)
    reuse: bool = True
    baseline: str | None = None  # label of the reference point of paired comparisons
    headline: list[str] = field(default_factory=list)  # labels of the headline rows
    text: str = ""  # the file as read, for the report and the manifest

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


# ----------------------------------------------------------------------------- locating specs


def default_specs_dir() -> Path:
    """``$ATTNRES_EXPERIMENTS``, else ``./experiments`` when it exists, else the checkout's."""
    env = os.environ.get(SPECS_ENV)
    if env:
        return Path(env)
    here = Path("experiments")
    if here.is_dir() and any(here.glob("*.toml")):
        return here
    return CHECKOUT_SPECS_DIR


def available(specs_dir: Path | None = None) -> list[str]:
    d = Path(specs_dir) if specs_dir is not None else default_specs_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def find_spec(name: str, specs_dir: Path | None = None) -> Path:
    """An experiment name (a spec in the specs directory) or a path to a .toml file."""
    d = Path(specs_dir) if specs_dir is not None else default_specs_dir()
    p = Path(name)
    if p.suffix == ".toml":
        if p.is_file():
            return p
        raise ExperimentError(f"spec file {name!r} does not exist")
    candidate = d / f"{name}.toml"
    if candidate.is_file():
        return candidate
    names = available(d)
    listing = ", ".join(names) if names else "none"
    raise ExperimentError(f"unknown experiment {name!r}; available in {d}: {listing}")


def experiment_command(spec: ExperimentSpec, runs_root: str | os.PathLike | None = None) -> str:
    """The ``attnres experiment`` command that continues ``spec`` from here: by name when the default
    specs directory holds it, else by its path; with ``--runs`` unless the runs are in the default place."""
    import shlex

    try:
        by_name = find_spec(spec.name).resolve() == Path(spec.path).resolve()
    except ExperimentError:
        by_name = False
    argv = ["attnres", "experiment", spec.name if by_name else str(spec.path)]
    if runs_root is not None and Path(runs_root).resolve() != Path("experiments/runs").resolve():
        argv += ["--runs", str(runs_root)]
    return shlex.join(argv)


# ----------------------------------------------------------------------------- parsing


def _err(path: Path, where: str, message: str) -> ExperimentError:
    return ExperimentError(f"{path}: {where}: {message}")


def _seed_list(value: Any, path: Path, where: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in value)
    ):
        raise _err(path, where, f"must be a non-empty list of non-negative integers, got {value!r}")
    if len(set(value)) != len(value):
        raise _err(path, where, f"repeats a seed: {value!r}")
    return list(value)


def _number(value: Any, path: Path, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise _err(path, where, f"must be a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _check_overrides(overrides: dict[str, Any], path: Path, where: str) -> None:
    for key in overrides:
        if key == "preset":
            continue
        try:
            split_overrides({key: overrides[key]})
        except ValueError:
            raise _err(
                path,
                f"{where} {key}",
                "unknown option: not a ModelConfig or TrainConfig field (see `attnres train --help` and ModelConfig)",
            ) from None
    for key in ("out_dir", "seed"):
        if key in overrides:
            raise _err(
                path,
                f"{where} {key}",
                "is set by the runner (experiments/runs/NAME/<hash>/ and the seeds list); drop it",
            )


def _point(raw: Any, axis: str, index: int, path: Path) -> Point:
    where = f"[[axis.{axis}]] #{index + 1}" if axis not in ("run",) else f"[[runs]] #{index + 1}"
    if not isinstance(raw, dict):
        raise _err(path, where, f"must be a table, got {raw!r}")
    label = raw.get("label")
    if not isinstance(label, str) or not label or any(c in label for c in "/= "):
        raise _err(path, f"{where} label", "required: a non-empty string without '/', '=' or spaces")
    where = f"{where} ({label!r})"
    overrides = {k: v for k, v in raw.items() if k not in RESERVED_POINT_KEYS}
    _check_overrides(overrides, path, where)
    seeds = _seed_list(raw["seeds"], path, f"{where} seeds") if "seeds" in raw else None
    tags = raw.get("tags", {})
    if not isinstance(tags, dict) or any(not isinstance(v, (str, int, float)) for v in tags.values()):
        raise _err(path, f"{where} tags", "must be a table of strings or numbers")
    paper = _number(raw["paper_loss"], path, f"{where} paper_loss") if "paper_loss" in raw else None
    tps = _number(raw["tokens_per_second"], path, f"{where} tokens_per_second") if "tokens_per_second" in raw else None
    speed = _number(raw["speed"], path, f"{where} speed") if "speed" in raw else 1.0
    by = raw.get("by", {})
    if not isinstance(by, dict) or any(
        not isinstance(t, dict) or any(not isinstance(o, dict) for o in t.values()) for t in by.values()
    ):
        raise _err(path, f"{where} by", "must be tables by.AXIS.LABEL = { overrides }")
    for other, table in by.items():
        for other_label, extra in table.items():
            _check_overrides(extra, path, f"{where} by.{other}.{other_label}")
    return Point(axis, label, overrides, seeds, {k: str(v) for k, v in tags.items()}, paper, tps, speed, by)


def parse_spec(path: Path, text: str | None = None) -> ExperimentSpec:
    """Read and validate a spec file (no run configs built yet; see ``expand``)."""
    path = Path(path)
    if text is None:
        try:
            text = path.read_text()
        except OSError as e:
            raise ExperimentError(f"{path}: cannot be read: {e}") from e
    try:
        data = parse_toml(text)
    except ValueError as e:
        raise ExperimentError(f"{path}: not valid TOML: {e}") from e
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise _err(path, key, f"unknown top-level key; expected {', '.join(TOP_LEVEL_KEYS)}")
    exp = data.get("experiment")
    if not isinstance(exp, dict):
        raise _err(path, "[experiment]", "missing: every spec needs an [experiment] table with a name")
    for key in exp:
        if key not in EXPERIMENT_KEYS:
            raise _err(path, f"[experiment] {key}", f"unknown key; expected one of {sorted(EXPERIMENT_KEYS)}")
    name = exp.get("name")
    if not isinstance(name, str) or not name:
        raise _err(path, "[experiment] name", "required: a non-empty string")
    if name != path.stem:
        raise _err(path, "[experiment] name", f"{name!r} must equal the file name {path.stem!r}")
    description = exp.get("description", "")
    if not isinstance(description, str):
        raise _err(path, "[experiment] description", "must be a string")
    report = exp.get("report", name if name in REPORT_AXES else "generic")
    if not isinstance(report, str):
        raise _err(path, "[experiment] report", "must be a string (a report kind)")
    seeds = _seed_list(exp.get("seeds", [0]), path, "[experiment] seeds")
    budget = (
        _number(exp["budget_cpu_hours"], path, "[experiment] budget_cpu_hours") if "budget_cpu_hours" in exp else None
    )
    note = exp.get("budget_note", "")
    if not isinstance(note, str):
        raise _err(path, "[experiment] budget_note", "must be a string")
    tps = (
        _number(exp["tokens_per_second"], path, "[experiment] tokens_per_second")
        if "tokens_per_second" in exp
        else DEFAULT_TOKENS_PER_SECOND
    )
    keep = exp.get("keep_checkpoint", False)
    if not isinstance(keep, bool):
        raise _err(path, "[experiment] keep_checkpoint", "must be true or false")
    eval_split = exp.get("eval_split", True)
    if not isinstance(eval_split, bool):
        raise _err(path, "[experiment] eval_split", "must be true or false")
    reuse = exp.get("reuse", True)
    if not isinstance(reuse, bool):
        raise _err(path, "[experiment] reuse", "must be true or false")
    baseline = exp.get("baseline")
    if baseline is not None and not isinstance(baseline, str):
        raise _err(path, "[experiment] baseline", "must be a point label (a string)")
    headline = exp.get("headline", [])
    if not isinstance(headline, list) or any(not isinstance(h, str) for h in headline):
        raise _err(path, "[experiment] headline", "must be a list of point labels")

    base = data.get("base", {})
    if not isinstance(base, dict):
        raise _err(path, "[base]", "must be a table of ModelConfig / TrainConfig overrides")
    _check_overrides(base, path, "[base]")

    axes: list[tuple[str, list[Point]]] = []
    grid = data.get("grid", {})
    if not isinstance(grid, dict):
        raise _err(path, "[grid]", "must be a table of lists")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise _err(path, f"[grid] {key}", f"must be a non-empty list of values, got {values!r}")
        _check_overrides({key: values[0]}, path, "[grid]")
        axes.append((key, [Point(key, str(v), {key: v}) for v in values]))
    axis_tables = data.get("axis", {})
    if not isinstance(axis_tables, dict):
        raise _err(path, "[axis]", "must hold arrays of tables: [[axis.NAME]]")
    for axis, points in axis_tables.items():
        if not isinstance(points, list) or not points:
            raise _err(path, f"[[axis.{axis}]]", "must be a non-empty array of tables")
        axes.append((axis, [_point(p, axis, i, path) for i, p in enumerate(points)]))
    if "runs" in data:
        runs = data["runs"]
        if not isinstance(runs, list) or not runs:
            raise _err(path, "[[runs]]", "must be a non-empty array of tables")
        axes.append(("run", [_point(p, "run", i, path) for i, p in enumerate(runs)]))
    seen = set()
    for axis, points in axes:
        if axis in seen:
            raise _err(path, axis, "this axis is defined twice (in [grid] and [[axis.*]])")
        seen.add(axis)
        labels = [p.label for p in points]
        dup = {label for label in labels if labels.count(label) > 1}
        if dup:
            raise _err(path, f"axis {axis!r}", f"repeated labels {sorted(dup)}")
    if report not in REPORT_AXES:
        raise _err(path, "[experiment] report", f"unknown report kind {report!r}; choose one of {sorted(REPORT_AXES)}")
    names = [a for a, _ in axes]
    for needed in REPORT_AXES[report]:
        if needed not in names:
            raise _err(
                path,
                f"axis {needed!r}",
                f"the {report!r} report needs an axis named {needed!r} "
                f"([[axis.{needed}]] or [grid] {needed}); found {names}",
            )
    labels_of = {a: {p.label for p in points} for a, points in axes}
    for axis, points in axes:
        for p in points:
            for other, table in p.by.items():
                if other not in labels_of or other == axis:
                    raise _err(
                        path,
                        f"axis {axis!r} point {p.label!r} by.{other}",
                        f"not another axis of this spec; axes: {sorted(labels_of)}",
                    )
                unknown = sorted(set(table) - labels_of[other])
                if unknown:
                    raise _err(
                        path,
                        f"axis {axis!r} point {p.label!r} by.{other}",
                        f"labels {unknown} are not points of axis {other!r}",
                    )
    all_labels = {p.label for _, points in axes for p in points}
    if baseline is not None and baseline not in all_labels:
        raise _err(path, "[experiment] baseline", f"{baseline!r} is not the label of any point")
    for h in headline:
        if h not in all_labels:
            raise _err(path, "[experiment] headline", f"{h!r} is not the label of any point")
    return ExperimentSpec(
        name=name,
        path=path,
        description=description,
        report=report,
        seeds=seeds,
        base=dict(base),
        axes=axes,
        budget_cpu_hours=budget,
        budget_note=note,
        tokens_per_second=tps,
        keep_checkpoint=keep,
        eval_split=eval_split,
        reuse=reuse,
        baseline=baseline,
        headline=list(headline),
        text=text,
    )


def load_spec(name: str, specs_dir: Path | None = None) -> ExperimentSpec:
    return parse_spec(find_spec(name, specs_dir))


def with_overrides(spec: ExperimentSpec, overrides: dict[str, Any]) -> ExperimentSpec:
    """A copy of ``spec`` whose ``[base]`` also applies ``overrides`` (``preset`` and ModelConfig /
    TrainConfig fields, e.g. from command-line flags); ``seed`` replaces the default seeds. The
    overrides enter every run's config and so its hash: such runs never mix with the spec's own."""
    overrides = dict(overrides)
    seeds = spec.seeds
    if "seed" in overrides:
        seeds = _seed_list([overrides.pop("seed")], spec.path, "seed")
    _check_overrides(overrides, spec.path, "overrides")
    return dataclasses.replace(spec, base={**spec.base, **overrides}, seeds=seeds)


# ----------------------------------------------------------------------------- hashing


def _float_fields(cls) -> set:
    return {f.name for f in dataclasses.fields(cls) if "float" in str(f.type)}


_MODEL_FLOATS = _float_fields(ModelConfig)
_TRAIN_FLOATS = _float_fields(TrainConfig)


def _normalised(values: dict[str, Any], floats: set) -> dict[str, Any]:
    """Ints given for float fields become floats, so lr=1 and lr=1.0 hash alike."""
    return {
        k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v for k, v in values.items()
    }


def hash_payload(model: ModelConfig, train: TrainConfig) -> dict[str, Any]:
    """What a run's identity is made of: every result-changing field of both configs."""
    t = {k: v for k, v in train.to_dict().items() if k not in UNHASHED_TRAIN_FIELDS}
    return {
        "version": HASH_VERSION,
        "model": _normalised(model.to_dict(), _MODEL_FLOATS),
        "train": _normalised(t, _TRAIN_FLOATS),
    }


def _defaults(cls, floats: set) -> dict[str, Any]:
    return _normalised(
        {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}, floats
    )


def payload_compatible(stored: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a run hashed from ``stored`` computed what ``current`` asks for, across a library update
    that only added config fields: every stored field is unchanged, and every field the stored
    payload lacks is at its default (new options default to the old behaviour)."""
    if not isinstance(stored, dict) or stored.get("version") != current.get("version"):
        return False
    for section, cls, floats in (("model", ModelConfig, _MODEL_FLOATS), ("train", TrainConfig, _TRAIN_FLOATS)):
        old, new = stored.get(section), current[section]
        if not isinstance(old, dict) or set(old) - set(new):
            return False
        defaults = _defaults(cls, floats)
        for key, value in new.items():
            if key in old:
                if old[key] != value:
                    return False
            elif key not in defaults or defaults[key] != value:
                return False
    return True


def config_hash(model: ModelConfig, train: TrainConfig) -> str:
    text = json.dumps(hash_payload(model, train), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- expansion


def expand(spec: ExperimentSpec) -> list[PlannedRun]:
    """Every planned run, in axis order then seed order. Runs with identical configs (the same
    hash) are kept as separate entries: they share one run directory."""
    axes = spec.axes or [("run", [Point("run", "base", {})])]
    planned: list[PlannedRun] = []
    for combo in itertools.product(*(points for _, points in axes)):
        overrides: dict[str, Any] = dict(spec.base)
        labels: dict[str, str] = {}
        seeds, tps, speed, paper = spec.seeds, spec.tokens_per_second, 1.0, None
        for point in combo:
            labels[point.axis] = point.label
        for point in combo:
            overrides.update(point.overrides)
            for other, table in point.by.items():
                overrides.update(table.get(labels[other], {}))
            labels.update(point.tags)
            seeds = point.seeds if point.seeds is not None else seeds
            tps = point.tokens_per_second if point.tokens_per_second is not None else tps
            speed *= point.speed
            paper = point.paper_loss if point.paper_loss is not None else paper
        for seed in seeds:
            where = "/".join(f"{k}={v}" for k, v in labels.items()) + f"/seed={seed}"
            try:
                model, train = build_configs(None, {**copy.deepcopy(overrides), "seed": seed})
            except (ValueError, TypeError) as e:
                raise ExperimentError(f"{spec.path}: run {where}: {e}") from e
            planned.append(
                PlannedRun(
                    labels=labels,
                    seed=seed,
                    model=model,
                    train=train,
                    hash=config_hash(model, train),
                    paper_loss=paper,
                    tokens_per_second=tps * speed,
                )
            )
    return planned
