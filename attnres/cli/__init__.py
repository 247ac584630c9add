"""The ``attnres`` command: a thin shell over the library, one module per verb.

    attnres train        train a model, in one process or under torchrun (attnres.train)
    attnres eval         validation loss of a trained run
    attnres sample       generate text from a trained run (attnres.inference)
    attnres demo         prenorm vs Block vs Full AttnRes, trained and reported (experiments/demo.toml)
    attnres schemes      the residual schemes: classification and cost
    attnres options      every model option: type, default, the scheme or backbone that reads it
    attnres bench        benchmarks: train, op, decode, pipeline (attnres.bench)
    attnres convert      retrofit a Hugging Face LLaMA-family model; native <-> HF (attnres.hf)
    attnres experiment   run a named experiment, resumably (attnres.experiments)
    attnres report       an experiment's report from its cached runs
    attnres plot         redraw a run's loss and depth-weight figures (attnres.analysis)
    attnres placement    uneven depth blocks learned from trained Full AttnRes runs (attnres.analysis)
    attnres doctor       this machine and which implementation runs each op, and why (attnres.ops.backends)

Each verb module registers its subcommand (``add_parser``) and turns the parsed arguments into
library calls (``run``); ``options`` holds what several verbs share. User errors print as one line,
``attnres VERB: error: ...`` (``ATTNRES_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# the verb modules, imported by build_parser: importing this package loads no PyTorch, so a Ctrl-C
# during start-up is caught by main() like any other
VERB_NAMES = (
    "train",
    "evaluate",
    "sample",
    "demo",
    "schemes",
    "model_options",
    "bench",
    "convert",
    "experiment",
    "report",
    "placement",
    "plot",
    "doctor",
)


def _verbs() -> tuple:
    return tuple(importlib.import_module(f"attnres.cli.{name}") for name in VERB_NAMES)


def __getattr__(name):
    if name == "VERBS":
        return _verbs()
    raise AttributeError(f"module 'attnres.cli' has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres", description="Attention Residuals: train, evaluate, sample, and the demo."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb in _verbs():
        verb.add_parser(sub)
    _format_help(parser)
    return parser


def _format_help(parser: argparse.ArgumentParser) -> None:
    """One help format for every verb (and the bench subcommands): defaults shown, examples kept."""
    from attnres.cli.options import HelpFormatter

    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _format_help(child)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # also while the libraries load, before a verb runs
        print("\ninterrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from attnres.checkpoint import CheckpointError
    from attnres.cli.options import CLIError
    from attnres.train.trainer import TrainingDiverged, TrainingInterrupted

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    args.argv = argv  # the command as typed, for the records a verb writes
    try:
        return args.func(args)
    except TrainingInterrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return getattr(e, "exit_code", 130)  # 143 after SIGTERM
    except (CLIError, CheckpointError, TrainingDiverged, ValueError, OSError) as e:
        if os.environ.get("ATTNRES_DEBUG"):
            raise
        print(f"attnres {args.command}: error: {e}", file=sys.stderr)
        print("(set ATTNRES_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 2
    finally:
        from attnres.parallel.runtime import leave_process_group

        leave_process_group()  # a command run under torchrun joined one
