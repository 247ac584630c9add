"""`attnres bench pipeline`: pipeline traffic and step time with and without cross-stage caching.

Run under torchrun with P processes:

    torchrun --nproc-per-node 2 -m attnres bench pipeline --set pp=2 --set vpp=2

For each mode (naive: the whole history at every transition; cached: docs/method.md §7)
the same model, batch and schedule run ``warmup + steps`` forward/backward
steps. Bytes are counted on the wire (every P2P send of every stage) and shown
per transition beside the layout's prediction and docs/method.md §7's formula. Step time
is the median over the timed steps of the slowest rank (barrier to barrier),
the modes alternating step by step so that machine noise hits both alike.
Both modes must produce the same loss; the run checks it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from attnres.model import AttnResLM, ModelConfig
from attnres.parallel.pipeline import build_pipeline
from attnres.parallel.report import formula, gather_traffic, traffic_table


@dataclass
class PipelineBenchConfig:
    pp: int = 2
    vpp: int = 2
    schedule: str = "Interleaved1F1B"
    microbatches: int = 4
    batch_size: int = 8
    seq_len: int = 128
    d_model: int = 128
    n_heads: int = 4
    layers_per_chunk: int = 2
    residual: str = "block"
    block_size: int = 4  # sublayers per depth block: with 2 blocks per chunk, N_p = 1
    steps: int = 10
    warmup: int = 2
    device: str = "cpu"

    @classmethod
    def quick(cls) -> PipelineBenchConfig:
        return cls(d_model=64, seq_len=64, steps=4, warmup=1)


def _model(cfg: PipelineBenchConfig) -> AttnResLM:
    torch.manual_seed(0)
    options: dict[str, Any] = {"attnres_block_size": cfg.block_size} if cfg.residual == "block" else {}
    config = ModelConfig(
        vocab_size=4096,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.pp * cfg.vpp * cfg.layers_per_chunk,
        max_seq_len=cfg.seq_len,
        residual=cfg.residual,
        **options,
    )
    return AttnResLM(config)


def run(cfg: PipelineBenchConfig) -> dict:
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(
                f"bench pipeline needs {cfg.pp} processes: run it as `torchrun --nproc-per-node "
                f"{cfg.pp} -m attnres bench pipeline --set pp={cfg.pp}`"
            )
        dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4096, (cfg.batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, 4096, (cfg.batch_size, cfg.seq_len), generator=g)
    pipes = {}
    for mode in ("naive", "cached"):
        pipes[mode] = build_pipeline(
            _model(cfg),
            pp=cfg.pp,
            vpp=cfg.vpp,
            schedule=cfg.schedule,
            microbatches=cfg.microbatches,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            cache=mode == "cached",
        )
    times: dict[str, list[float]] = {m: [] for m in pipes}
    losses: dict[str, float] = {}
    for i in range(cfg.warmup + cfg.steps):
        if i == cfg.warmup:
            for p in pipes.values():
                p.reset_counters()
        for mode, pipe in pipes.items():
            dist.barrier()
            t0 = time.perf_counter()
            losses[mode] = pipe.train_step(x, y)
            dist.barrier()
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            pipe.model.zero_grad(set_to_none=True)
            if i >= cfg.warmup:
                times[mode].append(float(dt))
    measured = {m: gather_traffic(p) for m, p in pipes.items()}
    layouts = {m: p.layout for m, p in pipes.items()}
    step = {m: statistics.median(t) for m, t in times.items()}
    totals: dict[str, dict[str, Any]] = {}
    for m, counts in measured.items():
        spec = formula(layouts[m])
        totals[m] = {
            "forward_bytes_per_step": sum(v for (t, d), v in counts.items() if d == "forward") / cfg.steps,
            "backward_bytes_per_step": sum(v for (t, d), v in counts.items() if d == "backward") / cfg.steps,
            "formula_bytes_per_step": spec["total"] * cfg.microbatches if spec else None,
            "peak_transition_bytes": max(r["bytes"] for r in layouts[m].traffic()) * cfg.microbatches,
            "per_transition": [{**r, "bytes": r["bytes"] * cfg.microbatches} for r in layouts[m].traffic()],
        }
    return {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "world_size": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "loss": losses,
        "step_seconds": step,
        "cached_over_naive_step_time": step["cached"] / step["naive"],
        "peak_reduction": totals["naive"]["peak_transition_bytes"] / totals["cached"]["peak_transition_bytes"],
        "peak_block_reduction": max(r["blocks"] for r in layouts["naive"].traffic())
        / max(1, max(r["blocks"] for r in layouts["cached"].traffic())),
        "traffic": totals,
        "table": traffic_table(layouts, measured, steps=cfg.steps, microbatches=cfg.microbatches),
        "is_main": dist.get_rank() == 0,
    }


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"pipeline bench: P={c['pp']} V={c['vpp']} {c['schedule']}, {c['microbatches']} microbatches of "
        f"{c['batch_size'] // c['microbatches']}x{c['seq_len']} tokens, d={c['d_model']}, "
        f"{c['residual']} (S={c['block_size']}), {c['layers_per_chunk']} blocks per chunk; "
        f"{result['world_size']} gloo processes x {result['threads']} threads, torch {result['torch']}",
        "",
        result["table"],
    ]
    t = result["traffic"]
    lines.append(
        f"peak per-transition reduction naive/cached: {result['peak_reduction']:.2f}x in bytes, "
        f"{result['peak_block_reduction']:.2f}x in block representations; total "
        f"{t['naive']['forward_bytes_per_step'] / t['cached']['forward_bytes_per_step']:.2f}x"
    )
    lines.append(
        f"step time (median of {c['steps']}, slowest rank): naive {result['step_seconds']['naive'] * 1e3:.1f} ms, "
        f"cached {result['step_seconds']['cached'] * 1e3:.1f} ms, cached/naive "
        f"{result['cached_over_naive_step_time']:.3f}"
    )
    lines.append(f"loss naive {result['loss']['naive']:.6f}, cached {result['loss']['cached']:.6f}")
    return "\n".join(lines)
