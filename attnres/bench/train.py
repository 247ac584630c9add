"""`attnres bench train`: step time and peak memory of residual schemes on one config.

Step time: every variant is built in one process and timed round-robin (one
batch of steps per variant per repeat, so slow drifts of the machine hit all
variants alike), after warm-up; we report the median, the 25-75 % spread, the
ratio of medians to `prenorm`, and the spread of the per-repeat ratios (each
repeat's step over the baseline's step in the same repeat: drifts slower than
one repeat cancel in them).

Where the step goes: a few more round-robin rounds under ``torch.profiler``
split each step into matrix products and attention (library kernels: the
same calls in every variant that adds no matmul), generated code (inductor's
loops, compiled rows), the optimizer, and the rest (eager ops, Python). On a
CPU whose matmul speed drifts from run to run, the ratio at equal matmul time
(prenorm's matmul time put in place of the variant's, shown only where both
make the same matmul calls) resolves what the residual scheme itself costs.

Peak memory: each variant runs in a fresh subprocess (a process's high-water
mark never goes down, so variants cannot share one). On CUDA we read the
allocator's peak; on CPU the resident-set high-water mark (VmHWM), both
in total and above the baseline measured just before the first training step
(model, optimizer and inputs already allocated), which isolates the memory a
training step needs (activations, gradients, optimizer state). Compiled rows count
what compilation leaves resident (generated code, graphs: a constant of the model,
not of the batch) apart from the step's peak. The tensor step peak comes from the
allocator's own events: it sees neither the heap's fragmentation nor the
compiler's objects, so it is exact where the resident set is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnres.bench.profile import (
    breakdown_table,
    check_rounds,
    compared,
    round_robin_breakdowns,
    time_breakdown,
)
from attnres.model import AttnResLM, ModelConfig
from attnres.model.compile import compile_model
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
    blocks: int | None = 8  # Block AttnRes N (None: the model's default)
    optimizer: str = "adamw"  # or "muon": the trainer's default, whose Newton-Schulz step costs more
    warmup: int = 2
    repeats: int = 7
    steps_per_repeat: int = 2
    seed: int = 0
    device: str = "cpu"
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    memory: bool = True  # measure peak memory (one fresh process per variant)
    # with compile (true: inductor, or a backend name) every variant also runs compiled, in the same
    # process and round-robin, as the row "VARIANT compiled" (ratios: compiled to compiled prenorm)
    compile: bool | str = False
    compile_granularity: str = "model"  # or "sublayer" (attnres.model.compile): one graph per sublayer kind
    # "OP=BACKEND[,OP=BACKEND...]": every row runs those ops with those backends (attnres.ops.backends.forced;
    # `attnres doctor` lists them), e.g. merge_norm=reference for an A/B of one kernel
    forced: str = ""
    activation_checkpointing: str = "none"  # none | block | sublayer, for every variant
    # "wall": elapsed time; "process": CPU time of this process, which other jobs on a shared machine
    # do not inflate (it counts every thread's CPU time, so it equals step time only at one thread)
    clock: str = "wall"
    # round-robin rounds of steps_per_repeat steps under torch.profiler for the step breakdown
    # (CPU only; 0: none)
    profile_rounds: int = 3
    # the forward's precision: "float32", or "bfloat16" / "float16" under torch.autocast (mixed-precision
    # training: float32 weights and optimizer, 16-bit matrix products)
    dtype: str = "float32"

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(d_model=128, n_layers=8, seq_len=128, batch_size=8, warmup=2, repeats=5, steps_per_repeat=2)


def parse_variant(name: str) -> tuple[str, str, dict[str, object]]:
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


def model_config(cfg, variant: str) -> ModelConfig:
    """The variant's model at ``cfg``'s sizes (a BenchConfig, or any config with its model fields)."""
    return variant_config(
        variant,
        blocks=cfg.blocks,
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_seq_len=cfg.seq_len,
    )


COMPILED = " compiled"  # the suffix of a compiled variant's row


def split_compiled(row: str) -> tuple[str, bool]:
    """'block compiled' -> ('block', True); 'block' -> ('block', False)."""
    return (row[: -len(COMPILED)], True) if row.endswith(COMPILED) else (row, False)


def rows_of(cfg: BenchConfig) -> list[str]:
    """The timed rows: every variant eager, then (with compile) every variant compiled."""
    return list(cfg.variants) + ([v + COMPILED for v in cfg.variants] if cfg.compile else [])


AUTOCAST = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Autocast(torch.nn.Module):
    """The model's forward under ``torch.autocast`` at ``dtype``: what mixed-precision training runs."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.model(x)


def _setup(cfg: BenchConfig, row: str):
    variant, compiled = split_compiled(row)
    if cfg.dtype not in AUTOCAST:
        raise ValueError(f"dtype={cfg.dtype!r} is invalid: choose one of {tuple(AUTOCAST)}")
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    model = AttnResLM(model_config(cfg, variant)).to(device)
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    if compiled:
        compile_model(model, cfg.compile, granularity=cfg.compile_granularity)
    # The trainer's grouping (Muon on matrices, AdamW on the rest); the lr is irrelevant to timing.
    opt = build_optimizer(model, cfg.optimizer, lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g).to(device)
    half = AUTOCAST[cfg.dtype]
    return (model if half is None else Autocast(model, half)), opt, x, y


def _step(model, opt, x, y) -> None:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def check_clock(clock: str) -> None:
    if clock not in CLOCKS:
        raise ValueError(
            f"clock={clock!r} is invalid: choose one of {tuple(CLOCKS)} (wall: elapsed time; "
            "process: CPU time, for a shared machine at --threads 1)"
        )


def time_variants(cfg: BenchConfig) -> tuple[dict[str, list[float]], dict[str, float], dict[str, dict]]:
    """Step times per row (round-robin repeats), each row's warm-up seconds (wall time; for a
    compiled row: compilation, in the first step, and the second step's recompilation if any), and
    each row's step breakdown (``attnres.bench.profile.round_robin_breakdowns`` over ``profile_rounds``
    rounds after the timing; empty with no rounds or on CUDA)."""
    check_clock(cfg.clock)
    check_rounds(cfg.profile_rounds)
    clock = CLOCKS[cfg.clock]
    setups = {v: _setup(cfg, v) for v in rows_of(cfg)}
    warmup: dict[str, float] = {}
    for v, (model, opt, x, y) in setups.items():
        t0 = time.perf_counter()
        for _ in range(cfg.warmup):
            _step(model, opt, x, y)
        _sync(cfg.device)
        warmup[v] = time.perf_counter() - t0
    times: dict[str, list[float]] = {v: [] for v in setups}
    for _ in progress_bar(range(cfg.repeats), desc="bench train: timing", unit="repeat"):
        for v, (model, opt, x, y) in setups.items():
            _sync(cfg.device)
            t0 = clock()
            for _ in range(cfg.steps_per_repeat):
                _step(model, opt, x, y)
            _sync(cfg.device)
            times[v].append((clock() - t0) / cfg.steps_per_repeat)
    calls = {v: functools.partial(_step, *setup) for v, setup in setups.items()}
    return (
        times,
        warmup,
        round_robin_breakdowns(calls, cfg.profile_rounds, cfg.steps_per_repeat, cfg.device, "bench train: profile"),
    )


def step_breakdown(model, opt, x, y, *, steps: int = 1) -> dict:
    """Where ``steps`` training steps spend their time, per step (``attnres.bench.profile``)."""
    return time_breakdown(lambda: _step(model, opt, x, y), steps)


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
        return {
            "method": "cuda max_memory_allocated",
            "baseline_mib": base,
            "peak_mib": peak,
            "compiler_mib": 0.0,
            "step_peak_mib": peak - base,
            "tensor_step_peak_mib": peak - base,
        }
    base = _rss_mib()
    base_hwm = _peak_rss_mib()
    method = "VmHWM, peak resident set of a fresh process"
    compiler = 0.0
    if split_compiled(variant)[1]:
        # compilation's own peak is not a step's: compile, hand freed heap back to the system (what
        # compilation freed would otherwise count as resident), then restart the high-water mark
        # (Linux: writing 5 to clear_refs resets VmHWM to the current resident set). What stays
        # resident (generated code, graphs, caches) is reported apart: it does not grow with the batch
        for _ in range(cfg.warmup):
            _step(model, opt, x, y)
        _trim_heap()
        compiler = _rss_mib() - base
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method += (
            " (compiled rows: reset after compilation; 'compiler MiB' is what compilation left"
            " resident, and 'step peak' is counted above it)"
        )
    for _ in range(3):
        _step(model, opt, x, y)
    peak = _peak_rss_mib()
    return {
        "method": method,
        "baseline_mib": base,
        "baseline_hwm_mib": base_hwm,
        "peak_mib": peak,
        "compiler_mib": compiler,
        "step_peak_mib": peak - base - compiler,
        "tensor_step_peak_mib": tensor_step_peak_mib(model, opt, x, y),
    }


def tensor_step_peak_mib(model, opt, x, y) -> float:
    """Peak of the tensor bytes a training step allocates beyond those alive before it, from the
    allocator's events as the profiler records them (compiled code's buffers included). Unlike the
    resident set it does not see the C heap's fragmentation or the compiler's own objects, so it
    is exact and the same in every run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, opt, x, y)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def _trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_memory(cfg: BenchConfig, variant: str) -> dict:
    payload = json.dumps({"cfg": cfg.__dict__, "variant": variant})
    proc = subprocess.run(
        [sys.executable, "-m", "attnres.bench.train", payload],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe for {variant} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_forced(setting: str) -> list[tuple[str, str]]:
    """'merge_norm=reference,rms_norm=reference' -> [(op, backend), ...], each checked against the table."""
    from attnres.ops.backends import OPS

    pairs = []
    for item in filter(None, (part.strip() for part in setting.split(","))):
        op, _, backend = item.partition("=")
        if op not in OPS or backend not in OPS[op].backends:
            choices = "; ".join(f"{name}: {'|'.join(o.backends)}" for name, o in OPS.items() if len(o.backends) > 1)
            raise ValueError(
                f"forced={setting!r}: {item!r} is not OP=BACKEND of the backend table; use a comma list of {choices}"
            )
        pairs.append((op, backend))
    return pairs


def run(cfg: BenchConfig) -> dict:
    if "prenorm" not in cfg.variants:
        cfg.variants = ["prenorm"] + list(cfg.variants)
    from attnres.ops.backends import forced

    with contextlib.ExitStack() as stack:
        for op, backend in parse_forced(cfg.forced):
            stack.enter_context(forced(op, backend))
        times, warmup, breakdown = time_variants(cfg)

    def baseline(v):  # the prenorm row a row is compared with: eager to eager, compiled to compiled
        return "prenorm" + (COMPILED if split_compiled(v)[1] else "")

    rows = {}
    for v, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        med = statistics.median(ts)
        paired = [t / b for t, b in zip(ts, times[baseline(v)], strict=True)]
        pq = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
        rows[v] = {
            "step_ms_median": med * 1e3,
            "step_ms_p25": q[0] * 1e3,
            "step_ms_p75": q[2] * 1e3,
            "step_ms_min": min(ts) * 1e3,
            "step_ms_max": max(ts) * 1e3,
            "times_ms": [t * 1e3 for t in ts],
            "step_ratio": med / statistics.median(times[baseline(v)]),
            "repeat_ratio_median": statistics.median(paired),
            "repeat_ratio_p25": pq[0],
            "repeat_ratio_p75": pq[2],
            "tokens_per_s": cfg.batch_size * cfg.seq_len / med,
            "warmup_s": warmup[v],
            "params": AttnResLM(model_config(cfg, split_compiled(v)[0])).num_params(),
        }
        if split_compiled(v)[1]:
            rows[v]["vs_eager"] = med / statistics.median(times[split_compiled(v)[0]])
    for v, parts in compared(breakdown, baseline).items():
        rows[v]["breakdown"] = parts
    if cfg.memory:
        mem = {v: measure_memory(cfg, v) for v in progress_bar(list(rows), desc="bench train: memory", unit="variant")}
        for v in rows:
            rows[v].update(
                {k: mem[v][k] for k in ("peak_mib", "step_peak_mib", "compiler_mib", "tensor_step_peak_mib", "method")}
            )
            for k in ("peak", "step_peak", "tensor_step_peak"):
                rows[v][f"{k}_ratio"] = mem[v][f"{k}_mib"] / mem[baseline(v)][f"{k}_mib"]
    return {"config": cfg.__dict__, "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"bench train: d={c['d_model']}, {c['n_layers']} blocks, T={c['seq_len']}, batch={c['batch_size']}, "
        f"block N={c['blocks'] or 'default'}, {c['optimizer']}, device={c['device']}, "
        f"{result['threads']} threads, torch {result['torch']}; "
        f"{c['repeats']} repeats x {c['steps_per_repeat']} steps after {c['warmup']} warm-up"
        + (
            f"; activation checkpointing {c['activation_checkpointing']}"
            if c.get("activation_checkpointing", "none") != "none"
            else ""
        )
        + ("; step time is process CPU time" if c.get("clock") == "process" else "")
        + (f"; backends forced: {c['forced']}" if c.get("forced") else ""),
        "",
        "| variant | step ms (median) | p25-p75 | min-max | vs prenorm | per repeat p25-p75 | vs eager | warm-up s | "
        "tokens/s | "
        "peak MiB | vs prenorm | compiler MiB | step peak MiB | vs prenorm | tensor step peak MiB | vs prenorm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in result["rows"].items():
        mem = (
            (
                f"{r['peak_mib']:.0f} | {r['peak_ratio']:.3f} | {r['compiler_mib']:.0f} | "
                f"{r['step_peak_mib']:.0f} | {r['step_peak_ratio']:.3f} | {r['tensor_step_peak_mib']:.0f} | "
                f"{r['tensor_step_peak_ratio']:.3f}"
            )
            if "peak_mib" in r
            else " | ".join("-" * 7)
        )
        vs_eager = f"{r['vs_eager']:.3f}" if "vs_eager" in r else "-"
        lines.append(
            f"| {v} | {r['step_ms_median']:.1f} | {r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f} | "
            f"{r.get('step_ms_min', float('nan')):.1f}-{r.get('step_ms_max', float('nan')):.1f} | "
            f"{r['step_ratio']:.3f} | {r['repeat_ratio_p25']:.3f}-{r['repeat_ratio_p75']:.3f} | "
            f"{vs_eager} | {r.get('warmup_s', float('nan')):.1f} | "
            f"{r['tokens_per_s']:,.0f} | {mem} |"
        )
    lines += breakdown_table(result["rows"], "breakdown", "step", c.get("profile_rounds", 0), c["steps_per_repeat"])
    lines.append("")
    lines.append("per repeat: the spread of each repeat's step over the baseline's step in the same repeat.")
    if c.get("compile"):
        scope = (
            "of the whole model"
            if c.get("compile_granularity", "model") == "model"
            else "of each attention/MLP sublayer, one graph per kind that every block reuses "
            "(the residual stream eager)"
        )
        lines.append(
            f"`X compiled`: torch.compile {scope} (attnres.model.compile), compared with "
            "compiled prenorm; 'vs eager' is the compiled step over the same variant's eager one; "
            f"warm-up s: the {c['warmup']} warm-up steps, compilation included (one process compiles every "
            "row, so a row may reuse graphs an earlier one built: `attnres bench compile` starts each afresh)."
        )
    lines.append(
        "variant `X` is the default implementation (two_phase where it applies); "
        "`X:reference` is plain autograd; `:FIELD=VALUE` sets a ModelConfig option. Peak memory: "
        + next(iter(result["rows"].values())).get("method", "not measured")
        + "; 'step peak' is the peak above the memory held before the first step (and, compiled, above "
        "what compilation left resident); 'tensor step peak': the tensor bytes a step allocates "
        "at most, from the allocator's events (exact, no heap fragmentation)."
    )
    return "\n".join(lines)


if __name__ == "__main__":  # the memory probe subprocess
    args = json.loads(sys.argv[1])
    print(json.dumps(memory_probe(BenchConfig(**args["cfg"]), args["variant"])))
