"""What several verbs share: the one-line user error, the one --set parser, and the run options."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from typing import Any

from attnres.parallel import PIPELINE_SCHEDULES
from attnres.train.config import PRESETS, load_toml, parse_value
from attnres.train.config import (
    parse_bool as parse_bool,  # for the verbs: a strict yes/no --set value
)

# flags of the run options whose value is the config field of the same name
RUN_FIELDS = (
    "preset",
    "residual",
    "steps",
    "data",
    "lr",
    "optimizer",
    "device",
    "precision",
    "seed",
    "batch_size",
    "seq_len",
    "tokenizer",
    "dp",
    "tp",
    "pp",
    "vpp",
    "microbatches",
    "pp_schedule",
    "warmup_steps",
    "eval_every",
    "threads",
)
LR_SCHEDULES = ("wsd", "cosine", "constant")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every verb's --help: each option shows its default (unless it has none or its help already
    says it), descriptions are filled to the terminal, and lines indented by spaces (the examples)
    are kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or "default" in text.lower()
        ):
            return text
        shown = default.encode("unicode_escape").decode() if isinstance(default, str) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            indent + line if line.startswith(" ") else super(HelpFormatter, self)._fill_text(line, width, indent)
            for line in text.splitlines()
        )


def examples(*commands: str) -> str:
    """The closing lines of a verb's --help."""
    return "examples:\n" + "\n".join(f"  {c}" for c in commands)


class CLIError(Exception):
    """A user error: printed as one line, no traceback."""


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    """A text flag typed in a shell: ``\\n``, ``\\t`` and ``\\\\`` become a newline, a tab and a backslash
    (shells pass ``"\\n"`` as a backslash and an n); every other character stays as typed."""
    return re.sub(r"\\([nt\\])", lambda m: ESCAPES[m.group(1)], text)


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` items -> {key: value}, later items winning. Keys may use '-' for '_'."""
    options: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. --set d_model=256")
        key, value = item.split("=", 1)
        options[key.strip().replace("-", "_")] = parse_value(value.strip())
    return options


def add_set_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=help)


def add_run_options(p: argparse.ArgumentParser, *, preset_default: str) -> None:
    """The model and training options of the verbs that train (train, demo)."""
    p.add_argument(
        "--preset",
        default=None,
        help=f"named preset: {', '.join(PRESETS)} (default: {preset_default}); the options "
        "below without a default shown take the preset's value",
    )
    p.add_argument(
        "--config",
        help="TOML file with model and training options ([model]/[train] tables or top-level keys; flags override it)",
    )
    add_set_option(p, "any ModelConfig or TrainConfig field, e.g. --set d_model=256 --set attnres_blocks=4")
    p.add_argument(
        "--data",
        help="text file, directory, glob, or .jsonl with a 'text' field (default: the bundled Shakespeare corpus)",
    )
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--lr", type=float, help="learning rate (AdamW and Muon)")
    p.add_argument("--optimizer", choices=("muon", "adamw"))
    p.add_argument(
        "--lr-schedule",
        dest="lr_schedule",
        choices=LR_SCHEDULES,
        help="learning-rate schedule (default: the preset's, wsd)",
    )
    p.add_argument("--warmup-steps", dest="warmup_steps", type=int, help="learning-rate warmup steps")
    p.add_argument("--eval-every", dest="eval_every", type=int, help="validate every N steps")
    p.add_argument("--schedule", choices=LR_SCHEDULES + PIPELINE_SCHEDULES, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--seq-len", dest="seq_len", type=int)
    p.add_argument("--tokenizer", choices=("bpe", "byte"))
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--precision", choices=("fp32", "bf16"))
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no per-step output (a bar on a terminal, a log line every few steps elsewhere)",
    )
    add_compile_option(p)


def add_compile_option(p: argparse.ArgumentParser, what: str = "the model") -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help=f"torch.compile {what} (inductor; the first steps wait for the compilation)",
    )


def run_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides from the run options: the --config file, then --set, then the named flags."""
    overrides: dict[str, Any] = {}
    if getattr(args, "config", None):
        overrides.update(load_toml(args.config))
    overrides.update(parse_set(getattr(args, "set", None)))
    if getattr(args, "schedule", None):  # deprecated: it named either kind of schedule
        kind = "pp_schedule" if args.schedule in PIPELINE_SCHEDULES else "schedule"
        flag = "--pp-schedule" if kind == "pp_schedule" else "--lr-schedule"
        print(f"attnres: --schedule is deprecated; use {flag} {args.schedule}", file=sys.stderr)
        overrides[kind] = args.schedule
    for key in RUN_FIELDS:
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    if getattr(args, "lr_schedule", None):
        overrides["schedule"] = args.lr_schedule  # the TrainConfig field
    if getattr(args, "fsdp", False):
        overrides["fsdp"] = True
    if getattr(args, "sequence_parallel", False):
        overrides["sequence_parallel"] = True
    if getattr(args, "compile", False) and not overrides.get("compile"):  # keeps a --set compile=BACKEND
        overrides["compile"] = True
    if getattr(args, "no_pp_cache", False):
        overrides["pp_cache"] = False
    return overrides


def command_line(args: argparse.Namespace, drop: tuple = ()) -> str:
    """The command as typed (``attnres VERB ...``), without the flags in ``drop``: for reports and
    for the line that tells how to continue."""
    return shlex.join(["attnres"] + [a for a in args.argv if a not in drop])
