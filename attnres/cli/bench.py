"""attnres bench NAME: one benchmark of the registry attnres.bench.BENCHES."""
from __future__ import annotations

import json

import torch

from attnres.bench import BENCHES, bench_config
from attnres.cli.options import CLIError, add_set_option, parse_set
from attnres.files import atomic_write_text


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: train (step time, memory), op (bandwidth), decode, pipeline, kimi (exactness)",
                       description=(
        "bench train: step time (forward + backward + AdamW step; --set optimizer=muon for the "
        "trainer's Muon) of prenorm, Block and Full AttnRes (or any schemes in --variants) on one "
        "config in one process, with ratios to prenorm, and peak memory from a fresh process per "
        "variant. bench op: the depth-attention op alone against this machine's copy bandwidth. bench "
        "decode: KV-cached prefill throughput and per-token decode latency, and the residual I/O per "
        "sublayer beside the paper's Table 1 (docs/method.md §6). bench pipeline (under torchrun): pipeline traffic and step time "
        "with and without cross-stage caching. bench kimi: max |logit difference| of our kimi_linear backbone (prenorm, "
        "Block, Full with zero queries) from transformers' KimiLinearForCausalLM in float64, and of cached decoding "
        "from the full forward (needs transformers)."))
    p.add_argument("what", choices=tuple(BENCHES))
    p.add_argument("--quick", action="store_true", help="a smaller config (under 2 minutes on 2 cores)")
    p.add_argument("--variants", help="comma list of NAME[:IMPL][:FIELD=VALUE]..., e.g. prenorm,block,full,"
                   "block:reference,full:attnres_weights=low_rank_query:attnres_query_rank=8")
    add_set_option(p, "benchmark option, e.g. d_model=512")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="also write the results here")
    p.set_defaults(func=run)


def _only_for(flag: str, option: str, what: str) -> None:
    """A flag that sets a config option only some benches have."""
    having = [name for name, bench in BENCHES.items() if option in bench.options]
    if what not in having:
        raise CLIError(f"{flag} applies to " + " and ".join(f"`attnres bench {name}`" for name in having))


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    options = parse_set(args.set)
    if args.variants:
        _only_for("--variants", "variants", args.what)
        options["variants"] = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.no_memory:
        _only_for("--no-memory", "memory", args.what)
        options["memory"] = False
    options["device"] = args.device
    bench = BENCHES[args.what]
    result = bench.run(bench_config(args.what, quick=args.quick, **options))
    if not result.get("is_main", True):  # other torchrun ranks: rank 0 reports
        return 0
    print(bench.format_table(result))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2))
        print(f"\nwritten: {args.json}")
    return 0
