"""`attnres bench decode`: prefill throughput and per-token decode latency with the KV cache.

All variants are built in one process and timed round-robin: for each repeat
and variant, ``prefill_repeats`` prefills of the prompt (one prefill is short
enough that a single sample per round is mostly scheduler noise), then
``decode_tokens`` single-token steps. We report the median prefill throughput,
the median per-token decode latency, their quartiles and their ratios to
`prenorm`.

Residual I/O. An ``IOCounter`` observer (``attnres.residual.observe``) counts the
d-vectors per token the residual mechanism reads and writes, one rule per tensor
operation of the stream:

- prenorm: h = h + f reads h and f and writes h: 3 per sublayer.
- two-phase Block AttnRes: Phase 1 reads the n completed blocks once per depth
  block and writes one output per query (S); each later sublayer merges the
  partial sum (reads the Phase-1 output and the partial sum, writes h) and
  updates the partial sum (reads it and f, writes it); closing a block copies
  the sum into the buffer (1 read, 1 write).
- Full AttnRes, grouped: the same Phase 1 per group of G sublayers, plus the
  sources completed inside the group, read by each later sublayer, and the merge.
- per-sublayer ("naive") depth attention: every source read, h written.

docs/method.md §6 / paper Table 1 give 3d (residual), (N/S + 5)d (Block, two-phase) and
(S + N)d (Full with grouping S, N = L/S groups). The paper's kernels keep the
Phase-1 outputs on chip; ours write and re-read them, which the count shows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from attnres.bench.profile import (
    breakdown_table,
    check_rounds,
    compared,
    round_robin_breakdowns,
)
from attnres.bench.train import COMPILED, split_compiled, variant_config
from attnres.inference.cache import KVCache
from attnres.inference.compiled import CompiledDecoder
from attnres.model import AttnResLM, ModelConfig
from attnres.residual import IOCounter, observing
from attnres.train.progress import progress_bar

DEFAULT_VARIANTS = ("prenorm", "block", "block:fused", "full")


@dataclass
class DecodeBenchConfig:
    d_model: int = 256
    n_layers: int = 12
    n_heads: int = 4
    vocab_size: int = 4096
    blocks: int = 8
    prompt_len: int = 256
    decode_tokens: int = 32
    batch_size: int = 1
    repeats: int = 5
    prefill_repeats: int = 5  # prefills per variant and round
    seed: int = 0
    device: str = "cpu"
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    # with compile (true: inductor, or a backend name) every variant also decodes through a compiled
    # step over a static KV cache (attnres.inference.compiled), as the row "VARIANT compiled"
    compile: bool | str = False
    # round-robin rounds of prefill_repeats prefills under torch.profiler for the prefill breakdown
    # (attnres.bench.profile; CPU only; 0: none)
    profile_rounds: int = 3

    @classmethod
    def quick(cls) -> DecodeBenchConfig:
        return cls(d_model=128, n_layers=8, prompt_len=128, decode_tokens=16, repeats=3)


def model_config(cfg: DecodeBenchConfig, variant: str) -> ModelConfig:
    return variant_config(
        variant,
        blocks=cfg.blocks,
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_seq_len=cfg.prompt_len + cfg.decode_tokens,
    )


def formula(config: ModelConfig) -> str:
    """Table 1's per-sublayer residual I/O for this scheme, in d-vectors per token."""
    L = config.n_sublayers
    if config.residual == "prenorm":
        return "3"
    if config.residual == "block":
        return (
            f"N/S + 5 = {config.num_blocks}/{config.block_size} + 5 = {config.num_blocks / config.block_size + 5:.2f}"
        )
    if config.residual == "full":
        g = config.group_size
        n = -(-L // g)
        return f"S + N = {g} + {n} = {g + n}"
    return "-"


def residual_io(model, prompt: torch.Tensor) -> dict[str, float]:
    """Average d-vectors per token read / written by the residual mechanism per sublayer."""
    with observing(model.residual, IOCounter()) as counter, torch.no_grad():
        model(prompt[:, :1])
    L = model.config.n_sublayers
    reads, writes = sum(counter.reads[:L]) / L, sum(counter.writes[:L]) / L
    return {
        "reads": reads,
        "writes": writes,
        "total": reads + writes,
        "final_aggregation": counter.reads[L] + counter.writes[L],
    }


def run(cfg: DecodeBenchConfig) -> dict:
    for name in ("repeats", "prefill_repeats", "decode_tokens"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--set {name}={getattr(cfg, name)}: must be at least 1 (the medians need a sample)")
    check_rounds(cfg.profile_rounds)
    if "prenorm" not in cfg.variants:
        cfg.variants = ["prenorm"] + list(cfg.variants)
    device = torch.device(cfg.device)
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.prompt_len), generator=g).to(device)
    nxt = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.decode_tokens), generator=g).to(device)
    models, decoders = {}, {}
    for v in cfg.variants:
        torch.manual_seed(cfg.seed)
        models[v] = AttnResLM(model_config(cfg, v)).to(device).eval()
        if cfg.compile:  # the same weights, decoded through a compiled step
            decoders[v + COMPILED] = CompiledDecoder(models[v], cfg.batch_size, setting=cfg.compile)
    rows_timed = list(models) + list(decoders)
    prefill: dict[str, list[float]] = {v: [] for v in rows_timed}
    decode: dict[str, list[float]] = {v: [] for v in rows_timed}
    warmup: dict[str, float] = {}

    def session(v):
        """(the cache to reset, the callable that runs tokens through it) of a row."""
        if v in decoders:
            return decoders[v].cache, decoders[v]
        cache = KVCache.for_model(models[v], cfg.batch_size)
        return cache, (lambda ids, model=models[v], cache=cache: model(ids, cache=cache))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        # the first round warms up (and compiles)
        for rep in progress_bar(range(cfg.repeats + 1), desc="bench decode", unit="round"):
            for v in rows_timed:
                cache, step = session(v)
                w0 = time.perf_counter()
                times = []
                for _ in range(cfg.prefill_repeats if rep else 1):
                    cache.reset()
                    sync()
                    t0 = time.perf_counter()
                    step(prompt)
                    sync()
                    times.append(time.perf_counter() - t0)
                steps = []
                for i in range(cfg.decode_tokens):
                    s0 = time.perf_counter()
                    step(nxt[:, i : i + 1])
                    sync()
                    steps.append(time.perf_counter() - s0)
                if rep:
                    prefill[v].extend(times)
                    decode[v].extend(steps)
                else:
                    warmup[v] = time.perf_counter() - w0

        # where a prefill goes: more round-robin rounds under the profiler, after the timing
        def prefill_of(v):
            cache, step = session(v)
            return lambda: (cache.reset(), step(prompt))

        prefills = {v: prefill_of(v) for v in rows_timed}
        breakdown = round_robin_breakdowns(
            prefills, cfg.profile_rounds, cfg.prefill_repeats, cfg.device, "bench decode: profile"
        )

    def baseline(v):  # eager rows against eager prenorm, compiled against compiled
        return "prenorm" + (COMPILED if split_compiled(v)[1] else "")

    rows = {}
    for v in rows_timed:
        model = models[split_compiled(v)[0]]
        p, d = statistics.median(prefill[v]), statistics.median(decode[v])
        q = statistics.quantiles(decode[v], n=4)
        qp = statistics.quantiles(prefill[v], n=4, method="inclusive")
        rows[v] = {
            "prefill_ms": p * 1e3,
            "prefill_ms_p25": qp[0] * 1e3,
            "prefill_ms_p75": qp[2] * 1e3,
            "prefill_ms_min": min(prefill[v]) * 1e3,
            "prefill_ms_max": max(prefill[v]) * 1e3,
            "prefill_tokens_per_s": cfg.batch_size * cfg.prompt_len / p,
            "prefill_ratio": p / statistics.median(prefill[baseline(v)]),
            "decode_ms": d * 1e3,
            "decode_ms_p25": q[0] * 1e3,
            "decode_ms_p75": q[2] * 1e3,
            "decode_ms_min": min(decode[v]) * 1e3,
            "decode_ms_max": max(decode[v]) * 1e3,
            "decode_ratio": d / statistics.median(decode[baseline(v)]),
            "warmup_s": warmup[v],
            "io": residual_io(model, prompt),
            "io_formula": formula(model.config),
        }
    for v, parts in compared(breakdown, baseline).items():
        rows[v]["prefill_breakdown"] = parts
    return {"config": cfg.__dict__, "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"bench decode: d={c['d_model']}, {c['n_layers']} blocks, block N={c['blocks']}, prompt "
        f"{c['prompt_len']}, {c['decode_tokens']} decoded tokens, batch {c['batch_size']}, device="
        f"{c['device']}, {result['threads']} threads, torch {result['torch']}; medians over "
        f"{c['repeats']} repeats ({c.get('prefill_repeats', 1)} prefills each)",
        "",
        "| variant | prefill tokens/s | prefill ms (p25-p75; min-max) | prefill time vs prenorm "
        "| decode ms/token (p25-p75; min-max) | decode vs prenorm | "
        "warm-up s | residual I/O per sublayer (reads + writes, d/token) | Table 1 formula |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    nan = float("nan")
    for v, r in result["rows"].items():
        io = r["io"]
        lines.append(
            f"| {v} | {r['prefill_tokens_per_s']:,.0f} | {r['prefill_ms']:.1f} "
            f"({r.get('prefill_ms_p25', nan):.1f}-{r.get('prefill_ms_p75', nan):.1f}; "
            f"{r.get('prefill_ms_min', nan):.1f}-{r.get('prefill_ms_max', nan):.1f}) | "
            f"{r['prefill_ratio']:.3f} | {r['decode_ms']:.2f} "
            f"({r['decode_ms_p25']:.2f}-{r['decode_ms_p75']:.2f}; "
            f"{r.get('decode_ms_min', nan):.2f}-{r.get('decode_ms_max', nan):.2f}) | {r['decode_ratio']:.3f} | "
            f"{r.get('warmup_s', float('nan')):.1f} | "
            f"{io['reads']:.2f} + {io['writes']:.2f} = {io['total']:.2f} | {r['io_formula']} |"
        )
    lines += [
        "",
        "`block` is two-phase (the default); `block:fused` attends per sublayer over every "
        "source (naive). I/O counting rules: attnres/bench/decode.py. Warm-up: the first (untimed) "
        "prefill and decode round.",
    ]
    if c.get("compile"):
        lines.append(
            "`X compiled`: prefill and one-token steps through one compiled forward over a static KV "
            "cache (attnres.inference.compiled), compared with compiled prenorm; its warm-up "
            "includes the two compilations (prompt shape, one token)."
        )
    lines += breakdown_table(
        result["rows"], "prefill_breakdown", "prefill", c.get("profile_rounds", 0), c.get("prefill_repeats", 1)
    )
    return "\n".join(lines)
