"""`attnres bench train`: step time and peak memory of residual schemes on one config.

Step time: every variant is built in one process and timed round-robin (one
batch of steps per variant per repeat, so slow drifts of the machine hit all
variants alike), after warm-up; we report the median, the 25-75 % spread and
the ratio of medians to `prenorm`.

Peak memory: each variant runs in a fresh subprocess (a process's high-water
mark never goes down, so variants cannot share one). On CUDA we read the
allocator's peak; on CPU the resident-set high-water mark (VmHWM), both
in total and above the baseline measured just before the first training step
(model, optimizer and inputs already allocated), which isolates the memory a
training step needs (activations, gradients, optimizer state).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from attnres.model import AttnResLM, ModelConfig
from attnres.train.config import parse_value
from attnres.train.optim import build_optimizer
from attnres.train.progress import progress_bar

DEFAULT_VARIANTS = ("prenorm", "block", "full", "block:reference", "full:reference")


@dataclass
class BenchConfig:
    d_model: int = 256
    n_layers: int = 12
    n_heads: int = 4
    seq_len: int = 256
    batch_size: int = 8
    vocab_size: int = 4096
    blocks: Optional[int] = 8  # Block AttnRes N (None: the model's default)
    optimizer: str = "adamw"  # or "muon": the trainer's default, whose Newton-Schulz step costs more
    warmup: int = 2
    repeats: int = 7
    steps_per_repeat: int = 2
    seed: int = 0
    device: str = "cpu"
    variants: List[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    memory: bool = True  # measure peak memory (one fresh process per variant)
    # "wall": elapsed time; "process": CPU time of this process, which other jobs on a shared machine
    # do not inflate (it counts every thread's CPU time, so it equals step time only at one thread)
    clock: str = "wall"

    @classmethod
    def quick(cls) -> "BenchConfig":
        return cls(d_model=128, n_layers=8, seq_len=128, batch_size=8, warmup=2, repeats=5,
                   steps_per_repeat=2)


def parse_variant(name: str) -> Tuple[str, str, Dict[str, object]]:
    """'NAME[:IMPL][:FIELD=VALUE]...' -> (residual, impl, ModelConfig options).

    'block' -> ('block', 'two_phase', {}); 'block:reference' -> ('block', 'reference', {});
    'full:attnres_weights=low_rank_query:attnres_query_rank=8' -> ('full', 'two_phase',
    {'attnres_weights': 'low_rank_query', 'attnres_query_rank': 8}).
    """
    residual, *parts = name.split(":")
    impl, options = "two_phase", {}
    for part in parts:
        if "=" in part:
            key, value = part.split("=", 1)
            options[key.strip()] = parse_value(value.strip())
        else:
            impl = part
    return residual, impl, options


def variant_config(variant: str, *, blocks: int, **sizes) -> ModelConfig:
    """The model of one benchmark variant ('block', 'full:reference', 'full:attnres_weights=scalar', ...);
    Block gets N = blocks unless the variant sets its own depth blocks."""
    residual, impl, options = parse_variant(variant)
    own_blocks = {"attnres_blocks", "attnres_block_size", "attnres_block_sizes"} & set(options)
    extra = {"attnres_blocks": blocks} if residual == "block" and blocks is not None and not own_blocks else {}
    return ModelConfig(**{"residual": residual, "attnres_impl": impl, **sizes, **extra, **options})


def model_config(cfg: BenchConfig, variant: str) -> ModelConfig:
    return variant_config(variant, blocks=cfg.blocks, vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                          n_layers=cfg.n_layers, n_heads=cfg.n_heads, max_seq_len=cfg.seq_len)


def _setup(cfg: BenchConfig, variant: str):
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    model = AttnResLM(model_config(cfg, variant)).to(device)
    # The trainer's grouping (Muon on matrices, AdamW on the rest); the lr is irrelevant to timing.
    opt = build_optimizer(model, cfg.optimizer, lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g).to(device)
    return model, opt, x, y


def _step(model, opt, x, y) -> None:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def time_variants(cfg: BenchConfig) -> Dict[str, List[float]]:
    if cfg.clock not in CLOCKS:
        raise ValueError(f"clock={cfg.clock!r} is invalid: choose one of {tuple(CLOCKS)} (wall: elapsed time; "
                         "process: CPU time, for a shared machine at --threads 1)")
    clock = CLOCKS[cfg.clock]
    setups = {v: _setup(cfg, v) for v in cfg.variants}
    for v, (model, opt, x, y) in setups.items():
        for _ in range(cfg.warmup):
            _step(model, opt, x, y)
    times: Dict[str, List[float]] = {v: [] for v in cfg.variants}
    for _ in progress_bar(range(cfg.repeats), desc="bench train: timing", unit="repeat"):
        for v, (model, opt, x, y) in setups.items():
            _sync(cfg.device)
            t0 = clock()
            for _ in range(cfg.steps_per_repeat):
                _step(model, opt, x, y)
            _sync(cfg.device)
            times[v].append((clock() - t0) / cfg.steps_per_repeat)
    return times


def _rss_mib() -> float:
    """Current resident set size (Linux /proc), MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _peak_rss_mib() -> float:
    """High-water mark of this process's resident set, MiB.

    VmHWM belongs to the current address space, so it starts afresh at exec. (getrusage's
    ru_maxrss does not: Linux carries the parent's peak into a forked-and-exec'd child, so
    every probe launched after a big variant would report that variant's peak.)
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_probe(cfg: BenchConfig, variant: str) -> dict:
    """Run in a fresh process: peak memory of training steps of one variant."""
    model, opt, x, y = _setup(cfg, variant)
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
        for _ in range(3):
            _step(model, opt, x, y)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
        return {"method": "cuda max_memory_allocated", "baseline_mib": base, "peak_mib": peak,
                "step_peak_mib": peak - base}
    base = _rss_mib()
    base_hwm = _peak_rss_mib()
    for _ in range(3):
        _step(model, opt, x, y)
    peak = _peak_rss_mib()
    return {"method": "VmHWM, peak resident set of a fresh process", "baseline_mib": base,
            "baseline_hwm_mib": base_hwm, "peak_mib": peak, "step_peak_mib": peak - base}


def measure_memory(cfg: BenchConfig, variant: str) -> dict:
    payload = json.dumps({"cfg": cfg.__dict__, "variant": variant})
    proc = subprocess.run([sys.executable, "-m", "attnres.bench.train", payload], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe for {variant} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(cfg: BenchConfig) -> dict:
    if "prenorm" not in cfg.variants:
        cfg.variants = ["prenorm"] + list(cfg.variants)
    times = time_variants(cfg)
    base = statistics.median(times["prenorm"])
    rows = {}
    for v, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        med = statistics.median(ts)
        rows[v] = {"step_ms_median": med * 1e3, "step_ms_p25": q[0] * 1e3, "step_ms_p75": q[2] * 1e3,
                   "step_ratio": med / base, "tokens_per_s": cfg.batch_size * cfg.seq_len / med,
                   "params": AttnResLM(model_config(cfg, v)).num_params()}
    if cfg.memory:
        mem = {v: measure_memory(cfg, v) for v in progress_bar(cfg.variants, desc="bench train: memory",
                                                               unit="variant")}
        for v in cfg.variants:
            rows[v].update({k: mem[v][k] for k in ("peak_mib", "step_peak_mib", "method")})
            rows[v]["peak_ratio"] = mem[v]["peak_mib"] / mem["prenorm"]["peak_mib"]
            rows[v]["step_peak_ratio"] = mem[v]["step_peak_mib"] / mem["prenorm"]["step_peak_mib"]
    return {"config": cfg.__dict__, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"bench train: d={c['d_model']}, {c['n_layers']} blocks, T={c['seq_len']}, batch={c['batch_size']}, "
        f"block N={c['blocks'] or 'default'}, {c['optimizer']}, device={c['device']}, "
        f"{result['threads']} threads, torch {result['torch']}; "
        f"{c['repeats']} repeats x {c['steps_per_repeat']} steps after {c['warmup']} warm-up"
        + ("; step time is process CPU time" if c.get("clock") == "process" else ""),
        "",
        "| variant | step ms (median) | p25-p75 | vs prenorm | tokens/s | peak MiB | vs prenorm | "
        "step peak MiB | vs prenorm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in result["rows"].items():
        mem = (f"{r['peak_mib']:.0f} | {r['peak_ratio']:.3f} | {r['step_peak_mib']:.0f} | "
               f"{r['step_peak_ratio']:.3f}") if "peak_mib" in r else "- | - | - | -"
        lines.append(f"| {v} | {r['step_ms_median']:.1f} | {r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f} | "
                     f"{r['step_ratio']:.3f} | {r['tokens_per_s']:,.0f} | {mem} |")
    lines.append("")
    lines.append("variant `X` is the default implementation (two_phase where it applies); "
                 "`X:reference` is plain autograd; `:FIELD=VALUE` sets a ModelConfig option. Peak memory: "
                 + next(iter(result["rows"].values())).get("method", "not measured")
                 + "; 'step peak' is the peak above the memory held before the first step.")
    return "\n".join(lines)


if __name__ == "__main__":  # the memory probe subprocess
    args = json.loads(sys.argv[1])
    print(json.dumps(memory_probe(BenchConfig(**args["cfg"]), args["variant"])))
