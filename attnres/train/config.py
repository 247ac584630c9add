"""TrainConfig, named presets, and building a run's two configs from presets, files and flags."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnres.files import parse_toml
from attnres.model.config import ModelConfig, check_field_types

PRECISIONS = ("fp32", "bf16")
# how a run is spread over processes: not what it computes (checkpoints move between layouts)
PARALLEL_FIELDS = frozenset(
    {"dp", "fsdp", "tp", "sequence_parallel", "pp", "vpp", "pp_schedule", "microbatches", "pp_cache", "dist_timeout"}
)
TOKENIZERS = ("bpe", "byte")


@dataclass
class TrainConfig:
    """Everything about a training run that is not the model."""

    out_dir: str = "runs/default"
    data: str | None = None  # None: the bundled Shakespeare corpus
    tokenizer: str = "bpe"
    vocab_size: int = 4096  # BPE vocabulary; the model's vocab_size follows the tokenizer
    val_fraction: float = 0.1
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 300
    optimizer: str = "muon"
    lr: float = 3e-3
    muon_lr: float | None = None  # None: same as lr (Muon's update is RMS-matched to AdamW)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    schedule: str = "wsd"
    warmup_steps: int = 30
    decay_fraction: float = 0.2  # WSD: share of the run spent decaying
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 16
    checkpoint_every: int = 100
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    threads: int | None = None
    progress: bool = True
    cache_dir: str | None = None
    # parallelism (under torchrun; see attnres.parallel): results do not depend on it
    dp: int = 1  # data-parallel ranks (each computes B / dp rows of every batch)
    fsdp: bool = False  # data parallel with FSDP2 (fully_shard) instead of DDP
    tp: int = 1  # tensor-parallel ranks (attention heads and MLP units split; attnres.parallel.tensor)
    sequence_parallel: bool = False  # with tp: the depth state, residual scheme and norms split by position
    pp: int = 1  # pipeline-parallel ranks
    vpp: int = 1  # virtual stages per pipeline rank (chunks = pp * vpp)
    pp_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | LoopedBFS
    microbatches: int | None = None  # pipeline microbatches per batch (None: pp * vpp)
    pp_cache: bool = True  # cross-stage caching of block representations (docs/method.md §7)
    dist_timeout: float = 600.0  # seconds a collective may wait before the job fails
    # speed and memory knobs that leave the arithmetic as it is (a run may resume with them changed)
    compile: bool | str = False  # torch.compile: true (inductor) or a backend name, e.g. "aot_eager"
    # what one graph covers: "model" (the whole forward, fastest steps, the longest first compile) or
    # "sublayer" (each attention/MLP sublayer compiled once and reused by every block, the residual stream
    # eager: a first compile as short as PreNorm's, whatever the scheme). FSDP2, pipeline and tensor
    # parallel runs always compile per sublayer.
    compile_granularity: str = "model"
    # none | block | sublayer (attnres.model.checkpointing); None (what `--set ...=none` reads as) is "none"
    activation_checkpointing: str | None = "none"
    # retrofit-by-fine-tuning (experiments/retrofit.toml): train the model as PreNorm for the first
    # retrofit_step steps, then turn it into the configured residual (zero queries, eps scaled: the same
    # function) with a fresh optimizer on the same schedule; 0: off
    retrofit_step: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def bad(field, allowed):
            return ValueError(f"TrainConfig.{field}={getattr(self, field)!r} is invalid: {allowed}")

        if self.activation_checkpointing is None:  # `--set activation_checkpointing=none` reads as None
            self.activation_checkpointing = "none"
        check_field_types(self)

        for name in (
            "vocab_size",
            "seq_len",
            "batch_size",
            "grad_accum",
            "steps",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be a positive integer")
        for name in ("warmup_steps", "seed", "retrofit_step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "must be a non-negative integer")
        if self.retrofit_step >= self.steps:
            raise bad("retrofit_step", f"must be below steps={self.steps} (0: no retrofit)")
        if self.retrofit_step and (self.dp, self.tp, self.pp, self.fsdp) != (1, 1, 1, False):
            raise bad("retrofit_step", "needs a single-process run (dp=1, tp=1, pp=1, fsdp=false)")
        if self.warmup_steps > self.steps:
            raise bad("warmup_steps", f"must not exceed steps={self.steps}")
        for name in ("lr", "muon_lr"):  # a zero rate trains nothing; check_field_types keeps them finite
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise bad(name, "must be a positive learning rate, e.g. 3e-3")
        for name in ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise bad(name, "must be a non-negative number")
        if self.threads is not None and self.threads < 1:
            raise bad("threads", "must be a positive number of CPU threads (or None for PyTorch's default)")
        if not 0 < self.val_fraction < 1:
            raise bad("val_fraction", "must be between 0 and 1 (exclusive)")
        if not 0 <= self.decay_fraction <= 1:
            raise bad("decay_fraction", "must be between 0 and 1")
        if self.tokenizer not in TOKENIZERS:
            raise bad("tokenizer", f"choose one of {TOKENIZERS}")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"choose one of {PRECISIONS}")
        from attnres.train.optim import OPTIMIZER_NAMES
        from attnres.train.schedule import SCHEDULE_NAMES

        if self.optimizer not in OPTIMIZER_NAMES:
            raise bad("optimizer", f"choose one of {tuple(OPTIMIZER_NAMES)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise bad("schedule", f"choose one of {tuple(SCHEDULE_NAMES)}")
        for name in ("dp", "tp", "pp", "vpp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be a positive integer")
        if self.fsdp and self.dp < 2:
            raise bad("fsdp", "shards over data-parallel ranks: set dp >= 2 as well")
        if self.fsdp and self.pp > 1:
            raise bad("fsdp", "with pp > 1 the pipeline replicas average gradients by all-reduce; drop fsdp")
        if self.sequence_parallel and self.pp > 1:
            raise bad(
                "sequence_parallel",
                f"with pp={self.pp}: the pipeline stages send whole sequences. Fix: drop --sequence-parallel or --pp",
            )
        if self.tp > 1 and self.batch_size % self.dp:
            raise bad("batch_size", f"must be divisible by dp={self.dp}")
        if self.sequence_parallel and self.tp < 2:
            raise bad("sequence_parallel", "splits positions over tensor-parallel ranks: set tp >= 2 as well")
        if self.sequence_parallel and self.seq_len % self.tp:
            raise bad("seq_len", f"must be divisible by tp={self.tp} with sequence_parallel (each rank takes T/tp)")
        if not (isinstance(self.dist_timeout, (int, float)) and self.dist_timeout > 0):
            raise bad("dist_timeout", "must be a positive number of seconds")
        if self.pp > 1 or self.vpp > 1 or self.microbatches is not None:
            from attnres.parallel.pipeline import check_pipeline_options

            if self.pp == 1:
                raise bad("vpp" if self.vpp > 1 else "microbatches", "applies to pipeline parallelism: set pp >= 2")
            if self.batch_size % self.dp:
                raise bad("batch_size", f"must be divisible by dp={self.dp}")
            check_pipeline_options(
                self.pp,
                self.vpp,
                self.pp_schedule,
                self.pipeline_microbatches,
                n_layers=None,
                batch_size=self.batch_size // self.dp,
            )
        from attnres.model.checkpointing import CHECKPOINTING
        from attnres.model.compile import GRANULARITIES, check_compile_setting

        check_compile_setting(self.compile)
        if self.compile_granularity not in GRANULARITIES:
            raise bad("compile_granularity", f"choose one of {GRANULARITIES}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise bad("activation_checkpointing", f"choose one of {CHECKPOINTING}")
        if self.activation_checkpointing == "block" and self.pp > 1:
            raise bad(
                "activation_checkpointing",
                "'block' runs whole-model segments, which pipeline stages split; with pp > 1 use 'sublayer' or 'none'",
            )
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise bad("device", "use auto, cpu, cuda or cuda:N")

    @property
    def pipeline_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp * self.vpp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Fields that may change when a run resumes without changing what has been computed so far.
RESUMABLE_CHANGES = {
    "steps",
    "eval_every",
    "checkpoint_every",
    "progress",
    "threads",
    "out_dir",
    "device",
    "cache_dir",
    "compile",
    "compile_granularity",
    "activation_checkpointing",
} | PARALLEL_FIELDS


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # seconds: smoke tests and CI
    "tiny": {
        "model": dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=32),
        "train": dict(
            tokenizer="byte",
            seq_len=32,
            batch_size=4,
            steps=30,
            warmup_steps=3,
            eval_every=10,
            eval_batches=2,
            checkpoint_every=10,
            lr=3e-3,
        ),
    },
    # the main job: three of these in about ten minutes on 2 CPU cores
    "demo": {
        "model": dict(d_model=128, n_layers=8, n_heads=4, max_seq_len=128),
        "train": dict(
            tokenizer="bpe",
            vocab_size=4096,
            seq_len=128,
            batch_size=16,
            steps=600,
            warmup_steps=60,
            eval_every=100,
            eval_batches=16,
            checkpoint_every=100,
        ),
    },
    # Kimi Linear (docs/method.md §10's backbone): 3 KDA : 1 MLA, mixture of experts after a dense first
    # layer. Seconds: the Kimi Linear tests
    "kimi-tiny": {
        "model": dict(
            backbone="kimi_linear", d_model=32, n_layers=4, n_heads=2, max_seq_len=32, moe_experts=4, moe_top_k=2
        ),
        "train": dict(
            tokenizer="byte",
            seq_len=32,
            batch_size=4,
            steps=30,
            warmup_steps=3,
            eval_every=10,
            eval_batches=2,
            checkpoint_every=10,
            lr=3e-3,
        ),
    },
    # about the demo's cost per step on CPU: transformers' KDA runs its reference (Python-loop) kernel
    # without flash-linear-attention, so width and sequence are halved against "demo" to match its time
    "kimi-demo": {
        "model": dict(
            backbone="kimi_linear", d_model=64, n_layers=8, n_heads=4, max_seq_len=64, moe_experts=8, moe_top_k=2
        ),
        "train": dict(
            tokenizer="bpe",
            vocab_size=4096,
            seq_len=64,
            batch_size=16,
            steps=600,
            warmup_steps=60,
            eval_every=100,
            eval_batches=16,
            checkpoint_every=100,
        ),
    },
    # deeper and wider, for a longer CPU run or a GPU
    "small": {
        "model": dict(d_model=256, n_layers=12, n_heads=4, max_seq_len=256),
        "train": dict(
            tokenizer="bpe",
            vocab_size=4096,
            seq_len=256,
            batch_size=32,
            steps=2000,
            warmup_steps=100,
            eval_every=200,
            eval_batches=32,
            checkpoint_every=200,
        ),
    },
}


def _preset(name: str) -> dict[str, dict[str, Any]]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def preset_model(preset: str | None = None, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The model of a named preset (default: demo) with ModelConfig ``overrides``; no training options."""
    return ModelConfig(**{**_preset(preset or "demo")["model"], **(overrides or {})})


def parse_value(text: str) -> Any:
    """An option value typed as text (``--set KEY=VALUE``, bench variants ``NAME:FIELD=VALUE``):
    none/null, true/false (any case), a Python literal, else the text itself."""
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def parse_bool(value: Any, field: str) -> bool:
    """A yes/no option: a bool, 0 / 1, or the text true / yes / 1 or false / no / 0 (any case). Anything
    else is a one-line error naming ``field``: Python's truth of a text ("no" is true) is never used."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    raise ValueError(f"{field}={value!r} is invalid: use true or false (or yes / no, 1 / 0)")


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Route flat ``key=value`` overrides to ModelConfig or TrainConfig by field name."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model, train = {}, {}
    for key, value in overrides.items():
        if key == "vocab_size":
            train[key] = value  # the tokenizer decides the model's vocabulary
        elif key in model_fields:
            model[key] = value
        elif key in train_fields:
            train[key] = value
        else:
            raise ValueError(
                f"unknown option {key!r}; model options: {sorted(model_fields - {'vocab_size'})}; "
                f"training options: {sorted(train_fields)}"
            )
    return model, train


def load_toml(path: str) -> dict[str, Any]:
    """A TOML config: top-level keys, or [model] / [train] tables, plus an optional preset key; or a
    run's own ``config.json`` (a new run with a finished one's settings)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"config file {path!r} is a directory; pass a .toml file (e.g. {path}/run.toml)")
    if p.exists() and not p.is_file():
        raise ValueError(f"config file {path!r} is not a regular file; pass a .toml file")
    if not p.is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist; pass an existing .toml file")
    if p.suffix == ".json":
        return _load_run_config(p)
    try:
        data = parse_toml(p.read_text())
    except ValueError as e:
        raise ValueError(f"config file {path!r} is not valid TOML: {e}") from e
    flat = {}
    for key, value in data.items():
        if key in ("model", "train") and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _load_run_config(p: Path) -> dict[str, Any]:
    """A run directory's config.json: every model and training option of that run, less its place
    (``out_dir``) and the model's vocabulary (the tokenizer decides it)."""
    import json

    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        if not (isinstance(data, dict) and isinstance(data.get("model"), dict) and isinstance(data.get("train"), dict)):
            raise ValueError("expected {'model': {...}, 'train': {...}}")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(
            f"config file {str(p)!r} is not a run's config.json ({e}); pass the config.json attnres train "
            "wrote into a run directory, or a .toml file"
        ) from e
    model = {k: v for k, v in data["model"].items() if k != "vocab_size"}
    train = {k: v for k, v in data["train"].items() if k != "out_dir"}
    return {**model, **train}


def build_configs(
    preset: str | None = None, overrides: dict[str, Any] | None = None, notes: list[str] | None = None
) -> tuple[ModelConfig, TrainConfig]:
    """Preset defaults, then overrides (from a file and/or flags), validated.

    A preset's warmup longer than the run (``--preset tiny --steps 1``) is capped to the run's steps,
    with a line in ``notes``; an explicit one is an error. The model's ``max_seq_len`` follows a longer
    ``seq_len`` unless it was given: an explicit one below ``seq_len`` is an error."""
    overrides = dict(overrides or {})
    preset = overrides.pop("preset", None) or preset
    model_kw, train_kw = {}, {}
    if preset is not None:
        model_kw.update(_preset(preset)["model"])
        train_kw.update(_preset(preset)["train"])
    m, t = split_overrides(overrides)
    model_kw.update(m)
    train_kw.update(t)
    if "warmup_steps" not in t:
        warmup = train_kw.get("warmup_steps", TrainConfig.warmup_steps)
        capped = capped_warmup(train_kw)
        if capped != warmup:
            train_kw["warmup_steps"] = capped
            if notes is not None:
                steps = train_kw.get("steps", TrainConfig.steps)
                decay = f" less the schedule's decay ({steps - capped})" if capped < steps else ""
                source = f"the {preset} preset's" if preset is not None else "the default"
                notes.append(
                    f"warmup_steps={warmup} ({source}) is longer than the run: capped to {capped} (steps={steps}"
                    f"{decay}; set --warmup-steps to choose)"
                )
    train = TrainConfig(**train_kw)
    model_kw.setdefault("max_seq_len", train.seq_len)
    if _int(model_kw["max_seq_len"]):  # any other type: ModelConfig names the field
        if "max_seq_len" in m and model_kw["max_seq_len"] < train.seq_len:
            raise ValueError(
                f"ModelConfig.max_seq_len={model_kw['max_seq_len']} is below seq_len={train.seq_len}: the model "
                f"could not read its training windows. Fix: raise --set max_seq_len to {train.seq_len} or more, "
                f"or lower --seq-len to {model_kw['max_seq_len']}"
            )
        model_kw["max_seq_len"] = max(model_kw["max_seq_len"], train.seq_len)
    model = ModelConfig(**model_kw)
    if train.tp > 1:  # the widths tensor parallelism splits, before any data or process is touched
        from attnres.parallel.tensor import check_tensor_parallel

        check_tensor_parallel(model, train.tp, train.sequence_parallel)
    return model, train


def capped_warmup(train_kw: dict[str, Any]) -> Any:
    """The warmup a run of these training options takes when its warmup_steps is a preset's or the
    default (not given): at most the run's steps, less a WSD schedule's decay. build_configs applies it
    when a run starts, and resuming applies it again so that the flags that started a run match it.
    Values of the wrong type are returned unchanged (TrainConfig names them)."""
    steps, warmup = train_kw.get("steps", TrainConfig.steps), train_kw.get("warmup_steps", TrainConfig.warmup_steps)
    if not (_int(steps) and _int(warmup) and steps >= 1):
        return warmup
    room = steps  # the steps a warmup may take: all of them, less a WSD schedule's decay
    fraction = train_kw.get("decay_fraction", TrainConfig.decay_fraction)
    if train_kw.get("schedule", TrainConfig.schedule) == "wsd" and isinstance(fraction, (int, float)):
        room = max(1, steps - round(fraction * steps))
    return min(warmup, room)


def _int(value: Any) -> bool:
    """An int and not a bool (True is an int to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)
