"""Benchmarks: `attnres bench NAME` for each NAME in :data:`BENCHES`.

Every bench module has the same three parts, which the registry names:

- a config dataclass whose ``quick()`` is a smaller configuration (under 2 minutes on 2 cores);
- ``run(cfg) -> dict``: the measurements (``is_main`` is False on the torchrun ranks that do not
  report);
- ``format_table(result) -> str``: the markdown table printed by the command.

``train``: step time and peak memory of residual schemes; ``op``: the depth-attention op against
the machine's copy bandwidth; ``decode``: prefill throughput, decode latency and residual I/O;
``pipeline``: pipeline traffic and step time with and without cross-stage caching (torchrun);
``kimi``: our Kimi Linear backbone against transformers' ``KimiLinearForCausalLM`` (max |Δ logit|,
float64) and cached decoding against the full forward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet

from attnres.bench import decode, kimi, op, pipeline, train


@dataclass(frozen=True)
class Bench:
    config: type  # the config dataclass
    run: Callable[[Any], dict]
    format_table: Callable[[dict], str]

    @property
    def options(self) -> FrozenSet[str]:
        """The config's field names: what --set may change."""
        return frozenset(f.name for f in dataclasses.fields(self.config))


BENCHES: Dict[str, Bench] = {
    "train": Bench(train.BenchConfig, train.run, train.format_table),
    "op": Bench(op.OpBenchConfig, op.run, op.format_table),
    "decode": Bench(decode.DecodeBenchConfig, decode.run, decode.format_table),
    "pipeline": Bench(pipeline.PipelineBenchConfig, pipeline.run, pipeline.format_table),
    "kimi": Bench(kimi.KimiBenchConfig, kimi.run, kimi.format_table),
}


def bench_config(name: str, *, quick: bool = False, **options):
    """The config of bench ``name`` (its ``quick()`` one with ``quick=True``) with ``options`` set."""
    bench = BENCHES[name]
    cfg = bench.config.quick() if quick else bench.config()
    for key, value in options.items():
        if key not in bench.options:
            raise ValueError(f"--set {key}: unknown benchmark option; known: {sorted(bench.options)}")
        setattr(cfg, key, value)
    return cfg
