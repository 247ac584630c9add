"""attnres train: one training run (attnres.train.Trainer), single process or under torchrun."""

from __future__ import annotations

import os
import shlex
import sys

from attnres.cli.options import add_run_options, examples, run_overrides
from attnres.parallel import PIPELINE_SCHEDULES
from attnres.train.config import TrainConfig, build_configs
from attnres.train.metrics import TRACKERS
from attnres.train.resume import resumed_configs
from attnres.train.trainer import Trainer


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model",
        description=(
            "Train a decoder LM with a chosen residual scheme. Options come from a preset, then a TOML "
            "--config, then --set KEY=VALUE, then the flags."
        ),
        epilog=examples(
            "attnres train --preset demo --residual block --out runs/block",
            "attnres train --preset tiny --residual full --steps 50 --warmup-steps 5 --eval-every 10 --out runs/t",
            "attnres train --out runs/block --resume",
            "torchrun --nproc-per-node 2 -m attnres train --preset small --pp 2 --pp-schedule 1F1B",
            "torchrun --nproc-per-node 4 -m attnres train --preset small --dp 2 --tp 2",
        ),
    )
    add_run_options(p, preset_default="demo")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--residual", help="a residual scheme: see `attnres schemes`")
    p.add_argument("--out", help="run directory (checkpoint, metrics, tokenizer, summary)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument(
        "--force",
        action="store_true",
        help="delete the run already in --out (checkpoint, metrics, summary) and start over",
    )
    p.add_argument(
        "--log",
        action="append",
        choices=tuple(TRACKERS),
        default=None,
        help="also log to TensorBoard (pip install 'attnres[tb]'; on whenever installed) or to "
        "Weights & Biases (pip install wandb; WANDB_MODE=offline works without a network); "
        "repeatable",
    )
    g = p.add_argument_group("parallelism (launch with torchrun --nproc-per-node K -m attnres train ...)")
    g.add_argument("--dp", type=int, help="data-parallel ranks (DDP; the global batch is split over them)")
    g.add_argument("--fsdp", action="store_true", help="with --dp: shard with FSDP2 instead of DDP")
    g.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel ranks: attention heads and MLP units split over them, the depth attention "
        "replicated (world = dp * tp * pp)",
    )
    g.add_argument(
        "--sequence-parallel",
        dest="sequence_parallel",
        action="store_true",
        help="with --tp: split the depth state, the residual scheme and the norms by sequence position",
    )
    g.add_argument("--pp", type=int, help="pipeline-parallel ranks")
    g.add_argument("--vpp", type=int, help="virtual pipeline stages per rank (Interleaved1F1B, LoopedBFS)")
    g.add_argument(
        "--pp-schedule", dest="pp_schedule", choices=PIPELINE_SCHEDULES, help="pipeline schedule (default: 1F1B)"
    )
    g.add_argument("--microbatches", type=int, help="pipeline microbatches per batch (default pp * vpp)")
    g.add_argument(
        "--no-pp-cache",
        dest="no_pp_cache",
        action="store_true",
        help="send the whole block history at every stage transition (no cross-stage caching)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    overrides = run_overrides(args)
    if args.out:
        overrides["out_dir"] = args.out
    if args.no_progress:
        overrides["progress"] = False
    notes: list[str] = []
    if args.resume:  # the run's own settings; what is given must match them (attnres.train.resume)
        configs = resumed_configs(overrides.get("out_dir", TrainConfig.out_dir), overrides, notes)
    else:
        if args.config and not overrides.get("preset"):
            notes += _preset_fills(args.config, overrides)
        configs = build_configs("demo", overrides, notes)
    main_rank = os.environ.get("RANK", "0") == "0"
    for note in notes if main_rank else ():
        print(f"attnres train: {note}", file=sys.stderr)
    trainer = Trainer(*configs, resume=args.resume, force=args.force, trackers=args.log or ())
    say = print if trainer.is_main else (lambda *a, **k: None)  # under torchrun, rank 0 speaks
    say(trainer.describe())
    result = trainer.run()
    traffic = trainer.pipeline_traffic()  # collective: every rank takes part
    if traffic:
        say(traffic)
    say(result.describe())
    figures = trainer.write_figures()
    if figures:
        redraw = shlex.join(["attnres", "plot", str(trainer.out_dir)])
        say("figures: " + ", ".join(str(path) for path in figures) + f" (redraw: {redraw})")
    return 0


def _preset_fills(config: str, overrides: dict) -> list[str]:
    """A --config without a preset: which fields the default preset (demo) fills, said once."""
    from attnres.train.config import PRESETS

    unset = [k for table in PRESETS["demo"].values() for k in table if k not in overrides]
    if not unset:
        return []
    return [
        f"{config} sets no preset: the demo preset fills what it does not set ({', '.join(unset)}). "
        'Add preset = "tiny" (or another) to it, or pass --preset, to choose'
    ]
