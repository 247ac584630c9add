"""Benchmarks: `attnres bench NAME` for each NAME in :data:`BENCHES`.

Every bench module has the same three parts, which the registry names:

- a config dataclass whose ``quick()`` is a smaller configuration (under 2 minutes on 2 cores);
- ``run(cfg) -> dict``: the measurements (``is_main`` is False on the torchrun ranks that do not
  report);
- ``format_table(result) -> str``: the markdown table printed by the command.

``run_bench`` runs one, in this process or (``processes`` > 1) in several fresh ones whose headline
numbers it reports as min / median / max (``attnres.bench.spread``); ``format_result`` prints it.

``train``: step time and peak memory of residual schemes; ``compile``: the compile warm-up of a training
start, with the compiler's caches cold and warm; ``op``: the depth-attention op against
the machine's copy bandwidth; ``graph``: the ops torch.compile traces per scheme; ``decode``:
prefill throughput, decode latency and residual I/O; ``pipeline``: pipeline traffic and step time
with and without cross-stage caching (torchrun); ``kimi``: our Kimi Linear backbone against
transformers' ``KimiLinearForCausalLM`` (max |Δ logit|, float64) and cached decoding against the full
forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnres.bench import (
    compile,
    decode,
    graph,
    kimi,
    op,
    pipeline,
    roofline,
    spread,
    train,
)
from attnres.bench.checks import check_config, check_fields, coerce


@dataclass(frozen=True)
class Bench:
    config: type[Any]  # the config dataclass, with a quick() classmethod
    run: Callable[[Any], dict]
    format_table: Callable[[dict], str]
    summary: str  # what it measures (the command's help)
    example: str  # a command line that runs it

    @property
    def options(self) -> frozenset[str]:
        """The config's field names: what --set may change."""
        return frozenset(f.name for f in dataclasses.fields(self.config))


BENCHES: dict[str, Bench] = {
    "train": Bench(
        train.BenchConfig,
        train.run,
        train.format_table,
        "step time (forward + backward + AdamW step; --set optimizer=muon for the trainer's Muon) of "
        "prenorm, Block and Full AttnRes (or any schemes in --variants) on one config in one process, "
        "with ratios to prenorm, and peak memory from a fresh process per variant",
        "attnres bench train --quick --variants prenorm,block,full",
    ),
    "roofline": Bench(
        roofline.RooflineBenchConfig,
        roofline.run,
        roofline.format_table,
        "AttnRes's step overhead over prenorm across widths beside its memory-traffic limit (the least extra "
        "bytes of docs/method.md's schedule at this machine's copy bandwidth), eager and with --set "
        "compile=true compiled with the compile warm-up; --set plot=FILE.png draws the curve; --processes N "
        "reports the median and min-max over N fresh processes",
        "attnres bench roofline --quick --processes 3",
    ),
    "compile": Bench(
        compile.CompileBenchConfig,
        compile.run,
        compile.format_table,
        "how long torch.compile keeps a training start waiting, per scheme: fresh processes over a new cache "
        "directory per variant, the first start cold and the next ones reading the compiler's on-disk caches",
        "attnres bench compile --quick --variants prenorm,block,full",
    ),
    "op": Bench(
        op.OpBenchConfig,
        op.run,
        op.format_table,
        "the depth-attention op alone against this machine's copy bandwidth",
        "attnres bench op --quick",
    ),
    "graph": Bench(
        graph.GraphBenchConfig,
        graph.run,
        graph.format_table,
        "what torch.compile traces for each scheme: ATen ops, matrix products and copies of the forward and "
        "backward graphs of one training step, and graph breaks (dynamo + AOT autograd, no code generation)",
        "attnres bench graph --variants prenorm,block,full",
    ),
    "decode": Bench(
        decode.DecodeBenchConfig,
        decode.run,
        decode.format_table,
        "KV-cached prefill throughput and per-token decode latency, and the residual I/O per sublayer "
        "beside the paper's Table 1 (docs/method.md §6)",
        "attnres bench decode --quick",
    ),
    "pipeline": Bench(
        pipeline.PipelineBenchConfig,
        pipeline.run,
        pipeline.format_table,
        "pipeline traffic and step time with and without cross-stage caching (docs/method.md §7); runs "
        "under torchrun, one process per pipeline rank (--set pp=P)",
        "torchrun --nproc-per-node 2 -m attnres bench pipeline --set pp=2 --set vpp=2",
    ),
    "kimi": Bench(
        kimi.KimiBenchConfig,
        kimi.run,
        kimi.format_table,
        "max |logit difference| of the kimi_linear backbone (prenorm, and Block and Full AttnRes with zero "
        "queries) from transformers' KimiLinearForCausalLM in float64, and of cached decoding from the full "
        "forward (needs transformers)",
        "attnres bench kimi",
    ),
}


def bench_config(name: str, *, quick: bool = False, **options):
    """The config of bench ``name`` (its ``quick()`` one with ``quick=True``) with ``options`` set, each in
    its field's type where its text form says so (``attnres.bench.checks.coerce``: a comma list, yes / no),
    every field of its type and range; ``run_bench`` checks the rest (choices, variants, device, memory)."""
    bench = BENCHES[name]
    cfg = bench.config.quick() if quick else bench.config()
    for key, value in options.items():
        if key not in bench.options:
            raise ValueError(f"--set {key}: unknown benchmark option; known: {sorted(bench.options)}")
        setattr(cfg, key, coerce(bench.config, key, value))
    check_fields(cfg)
    return cfg


def run_bench(name: str, cfg, *, processes: int = 1) -> dict:
    """Bench ``name`` at ``cfg``: here, or with ``processes`` > 1 once in each of that many fresh
    processes, merged by ``spread.aggregate`` (medians, with min / median / max in ``spread``)."""
    if processes < 1:
        raise ValueError(f"--processes {processes}: must be at least 1")
    if processes > 1 and name not in spread.HEADLINES:
        raise ValueError(
            f"--processes {processes}: bench {name} runs in one process only; --processes applies to "
            f"{', '.join(sorted(spread.HEADLINES))}"
        )
    check_config(name, cfg)  # before anything is built (a config built by hand too), as train checks its own
    if processes == 1:
        return BENCHES[name].run(cfg)
    config = dict(cfg.__dict__)
    plot = config.pop("plot", "")
    if plot:  # the merged curve is drawn once here, not each process's own
        config["plot"] = ""
    runs = spread.launch(name, config, processes, threads=torch.get_num_threads(), package=__name__)
    merged = spread.aggregate(name, runs)
    if plot:
        merged["config"]["plot"] = plot
        merged["plot"] = roofline.draw(merged, plot)
    return merged


def format_result(name: str, result: dict) -> str:
    """The bench's table, and the spread over processes when there were several."""
    return BENCHES[name].format_table(result) + spread.format_spread(result, name)
