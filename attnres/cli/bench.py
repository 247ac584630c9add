"""attnres bench NAME: one benchmark of the registry attnres.bench.BENCHES."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from attnres.bench import BENCHES, bench_config, format_result, run_bench
from attnres.bench.spread import HEADLINES
from attnres.cli.options import CLIError, add_compile_option, add_set_option, parse_set
from attnres.files import atomic_write_text


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: train (step time, memory), op (bandwidth), decode, pipeline, kimi (exactness)",
        description="Benchmarks; `attnres bench NAME --help` describes each one.",
        epilog="examples:\n" + "\n".join(f"  {bench.example}" for bench in BENCHES.values()),
    )
    benches = p.add_subparsers(dest="what", metavar="NAME", required=True)
    for name, bench in BENCHES.items():
        b = benches.add_parser(
            name,
            help=bench.summary.split(";")[0].split(" (")[0],
            description=bench.summary[0].upper() + bench.summary[1:] + ".",
            epilog=f"example:\n  {bench.example}",
        )
        b.add_argument("--quick", action="store_true", help="a smaller config (under 2 minutes on 2 cores)")
        if "variants" in bench.options:
            b.add_argument(
                "--variants",
                help="comma list of NAME[:IMPL][:FIELD=VALUE]..., e.g. prenorm,block,full,"
                "block:reference,full:attnres_weights=low_rank_query:attnres_query_rank=8",
            )
        add_set_option(b, f"benchmark option: {', '.join(sorted(bench.options))}")
        if "memory" in bench.options:
            b.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
        if "compile" in bench.options:
            add_compile_option(b, "every variant as well (eager and compiled rows side by side)")
        if name in HEADLINES:
            b.add_argument(
                "--processes",
                type=int,
                default=1,
                help="run the bench in N fresh processes (variants' order rotated) and report min / median / "
                "max over them",
            )
        b.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
        b.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
        b.add_argument("--json", help="also write the results to this file")
        b.set_defaults(func=run)


def run(args) -> int:
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads {args.threads}: must be at least 1 (or leave it out: torch's choice)")
    if args.threads:
        torch.set_num_threads(args.threads)
    options = parse_set(args.set)
    if getattr(args, "variants", None):
        options["variants"] = [v.strip() for v in args.variants.split(",") if v.strip()]
    if getattr(args, "no_memory", False):
        options["memory"] = False
    if getattr(args, "compile", False):
        options.setdefault("compile", True)  # keeps a --set compile=BACKEND
    options["device"] = args.device
    cfg = bench_config(args.what, quick=args.quick, **options)
    if args.json:
        _check_writable(args.json)  # now, not after the whole benchmark has run
    result = run_bench(args.what, cfg, processes=getattr(args, "processes", 1))
    if not result.get("is_main", True):  # other torchrun ranks: rank 0 reports
        return 0
    print(format_result(args.what, result))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2))
        print(f"\nwritten: {args.json}")
    return 0


def _check_writable(path: str) -> None:
    """A one-line error unless a file can be written at ``path`` (its folder is created, as the write would)."""
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError(21, "is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as e:
        raise CLIError(
            f"--json {path} cannot be written ({e.strerror or e}); pass a file path in a folder you can write to"
        ) from None
