"""attnres train: one training run (attnres.train.Trainer), single process or under torchrun."""
from __future__ import annotations

from attnres.cli.options import add_run_options, run_overrides
from attnres.parallel import PIPELINE_SCHEDULES
from attnres.train.config import build_configs
from attnres.train.trainer import Trainer


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model", description=(
        "Train a decoder LM with a chosen residual scheme. Options come from a preset, then a TOML "
        "--config, then flags and --set KEY=VALUE. Example: attnres train --preset demo --residual "
        "block --out runs/block"))
    add_run_options(p, preset_default="demo")
    p.add_argument("--residual", help="a residual scheme: see `attnres schemes`")
    p.add_argument("--out", help="run directory (checkpoint, metrics, tokenizer, summary)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--force", action="store_true",
                   help="delete the run already in --out (checkpoint, metrics, summary) and start over")
    g = p.add_argument_group("parallelism (launch with torchrun --nproc-per-node K -m attnres train ...)")
    g.add_argument("--dp", type=int, help="data-parallel ranks (DDP; the global batch is split over them)")
    g.add_argument("--fsdp", action="store_true", help="with --dp: shard with FSDP2 instead of DDP")
    g.add_argument("--pp", type=int, help="pipeline-parallel ranks")
    g.add_argument("--vpp", type=int, help="virtual pipeline stages per rank (Interleaved1F1B, LoopedBFS)")
    g.add_argument("--pp-schedule", dest="pp_schedule", choices=PIPELINE_SCHEDULES,
                   help="pipeline schedule (also accepted as --schedule NAME)")
    g.add_argument("--microbatches", type=int, help="pipeline microbatches per batch (default pp * vpp)")
    g.add_argument("--no-pp-cache", dest="no_pp_cache", action="store_true",
                   help="send the whole block history at every stage transition (no cross-stage caching)")
    p.set_defaults(func=run)


def run(args) -> int:
    overrides = run_overrides(args)
    if args.out:
        overrides["out_dir"] = args.out
    if args.no_progress:
        overrides["progress"] = False
    trainer = Trainer(*build_configs("demo", overrides), resume=args.resume, force=args.force)
    say = print if trainer.is_main else (lambda *a, **k: None)  # under torchrun, rank 0 speaks
    say(trainer.describe())
    result = trainer.run()
    traffic = trainer.pipeline_traffic()  # collective: every rank takes part
    if traffic:
        say(traffic)
    say(result.describe())
    return 0
