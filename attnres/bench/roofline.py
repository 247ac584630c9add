"""The memory-traffic limit of AttnRes over PreNorm: the *roofline overhead* of a training step.

The depth attention adds no matrix product of the model's size; what it adds is memory traffic, so its
least possible cost is the bytes it must move beyond PreNorm's divided by the machine's copy bandwidth.
The byte counts are the paper's (Table 1, docs/method.md §6): per token and sublayer, a standard
residual moves 3 d-vectors, Block AttnRes on the two-phase schedule (N/S + 5), and Full AttnRes on the
same schedule with groups of G sublayers (G + L/G). So the forward adds, per token and sublayer,

    Block:  (N/S + 2) d          Full:  (G + L/G - 3) d

with N depth blocks of S sublayers (the config's geometry, uneven blocks averaged) and L sublayers.
The backward of a memory-bound op reads what its forward read and writes a gradient for each of its
inputs, which we count as twice its forward traffic (``BACKWARD_FACTOR``); a training step therefore adds
``(1 + BACKWARD_FACTOR)`` times the forward's bytes. The 2d parameters per sublayer and their optimizer
state are left out: at d 128 they are under 0.1 % of the activation traffic.

``roofline(config, batch, seq, bandwidth, prenorm_step_s)`` turns that into seconds and into the least
step ratio over PreNorm that a kernel could reach on this machine; ``copy_bandwidth()`` measures the
bandwidth as ``attnres bench op`` does (a preallocated copy, read plus write bytes, median of rounds).

``attnres bench roofline`` sweeps the width: at each one it runs ``bench train`` (prenorm, Block, Full;
eager, and compiled with ``--set compile=true``; round-robin in one process) and prints the measured
step ratio beside the limit, the extra milliseconds beside the least extra milliseconds, and (compiled)
the compile warm-up against PreNorm's; ``--set plot=FILE.png`` draws overhead against width. With
``--processes N`` the sweep runs in N fresh processes (``attnres.bench.spread``: the round-robin order
``variants`` rotated from one to the next); each point's numbers are the medians of the per-process ones,
shown with their min-max, and the plot draws the medians with min-max error bars.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from attnres.bench import train
from attnres.model import ModelConfig
from attnres.residual.attnres import block_sizes, group_size
from attnres.residual.options import bad_option
from attnres.train.progress import progress_bar

BACKWARD_FACTOR = 2.0  # a memory-bound backward moves about twice its forward's bytes (see the docstring)
FORWARD_ONLY = 0.0  # the factor for inference (prefill, decode): no backward


@dataclass(frozen=True)
class Roofline:
    """The least extra traffic of one scheme over PreNorm and what it costs at a measured bandwidth."""

    residual: str
    vectors_per_token: float  # extra d-vectors moved per token, forward and backward together
    extra_bytes: float  # per step
    extra_seconds: float  # extra_bytes / bandwidth
    ratio: float  # the least step time over PreNorm's: 1 + extra_seconds / prenorm_step_s


def forward_vectors_per_token(config: ModelConfig) -> float:
    """Extra d-vectors the forward moves per token over PreNorm (paper Table 1), summed over sublayers."""
    L = config.n_sublayers
    if config.residual == "block":
        sizes = block_sizes(config)
        n_blocks = len(sizes)
        return float(sum(S * (n_blocks / S + 2) for S in sizes))
    if config.residual == "full":
        G = group_size(config)
        return float(L * (G + L / G - 3))
    raise ValueError(
        f"residual={config.residual!r} has no roofline: the traffic model covers 'block' and 'full' "
        "(the paper's Table 1); use one of those"
    )


def roofline(
    config: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    bandwidth: float,
    prenorm_step_s: float,
    backward_factor: float = BACKWARD_FACTOR,
    element_bytes: int = 4,
) -> Roofline:
    """The least extra cost of ``config``'s depth stream per step of ``batch_size`` x ``seq_len`` tokens.

    ``bandwidth``: bytes per second of a copy (read + write, ``copy_bandwidth``); ``prenorm_step_s``:
    PreNorm's measured step at the same sizes; ``element_bytes``: the depth stream's element size
    (4: the stream stays float32 under autocast too)."""
    for name, value in (("bandwidth", bandwidth), ("prenorm_step_s", prenorm_step_s)):
        if not value > 0:
            raise ValueError(f"roofline {name}={value!r} is invalid: must be a positive measurement")
    vectors = forward_vectors_per_token(config) * (1.0 + backward_factor)
    extra = vectors * batch_size * seq_len * config.d_model * element_bytes
    seconds = extra / bandwidth
    return Roofline(config.residual, vectors, extra, seconds, 1.0 + seconds / prenorm_step_s)


def copy_bandwidth(n_bytes: int = 64 * 2**20, rounds: int = 9, device: str = "cpu") -> float:
    """Bytes per second of ``dst.copy_(src)`` over ``n_bytes`` (larger than the last-level cache), counting
    read and write, the median of ``rounds`` timed copies after one warm-up."""
    n = max(1, n_bytes // 4)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times)


SCHEMES = ("block", "full")


@dataclass
class RooflineBenchConfig:
    widths: list[int] = field(default_factory=lambda: [128, 256, 512, 1024])
    n_layers: int = 8
    head_dim: int = 64  # n_heads = width / head_dim (at least 1)
    seq_len: int = 128
    batch_size: int = 4
    vocab_size: int = 4096
    blocks: int = 8  # Block AttnRes N
    warmup: int = 2
    repeats: int = 3
    steps_per_repeat: int = 2
    seed: int = 0
    device: str = "cpu"
    compile: bool | str = False  # also the compiled rows (true: inductor, or a backend name)
    compile_granularity: str = "model"  # or "sublayer": one graph per sublayer kind (attnres.model.compile)
    clock: str = "process"  # bench train's clock: process CPU time, which other jobs do not inflate
    plot: str = ""  # a PNG path: overhead against width, measured and limit
    # the round-robin order of the timed rows: prenorm and the schemes, each once (--processes rotates it)
    variants: list[str] = field(default_factory=lambda: ["prenorm", *SCHEMES])

    @classmethod
    def quick(cls) -> RooflineBenchConfig:
        return cls(widths=[64, 128], n_layers=4, seq_len=64, batch_size=4, blocks=4, repeats=3, steps_per_repeat=1)


def train_config(cfg: RooflineBenchConfig, width: int) -> train.BenchConfig:
    """``bench train``'s config at one width of the sweep."""
    if sorted(cfg.variants) != sorted(["prenorm", *SCHEMES]):
        raise bad_option(
            "variants",
            cfg.variants,
            f"the sweep times {', '.join(['prenorm', *SCHEMES])}, each once, in any order",
            type(cfg).__name__,
        )
    return train.BenchConfig(
        d_model=width,
        n_layers=cfg.n_layers,
        n_heads=max(1, width // cfg.head_dim),
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        vocab_size=cfg.vocab_size,
        blocks=cfg.blocks,
        warmup=cfg.warmup,
        repeats=cfg.repeats,
        steps_per_repeat=cfg.steps_per_repeat,
        seed=cfg.seed,
        device=cfg.device,
        variants=list(cfg.variants),
        memory=False,
        compile=cfg.compile,
        compile_granularity=cfg.compile_granularity,
        clock=cfg.clock,
        profile_rounds=0,
    )


def run(cfg: RooflineBenchConfig) -> dict:
    bandwidth = copy_bandwidth(device=cfg.device)
    points = []
    for width in progress_bar(list(cfg.widths), desc="bench roofline", unit="width"):
        tcfg = train_config(cfg, width)
        rows = train.run(tcfg)["rows"]
        for suffix in ("", train.COMPILED) if cfg.compile else ("",):
            base = rows["prenorm" + suffix]
            base_s = base["step_ms_median"] / 1e3
            for residual in SCHEMES:
                row = rows[residual + suffix]
                limit = roofline(
                    train.model_config(tcfg, residual),
                    batch_size=cfg.batch_size,
                    seq_len=cfg.seq_len,
                    bandwidth=bandwidth,
                    prenorm_step_s=base_s,
                )
                extra_ms = row["step_ms_median"] - base["step_ms_median"]
                points.append(
                    {
                        "width": width,
                        "mode": "compiled" if suffix else "eager",
                        "residual": residual,
                        "measured_ratio": row["step_ratio"],
                        "ratio_p25": row["repeat_ratio_p25"],
                        "ratio_p75": row["repeat_ratio_p75"],
                        "limit_ratio": limit.ratio,
                        "extra_ms": extra_ms,
                        "limit_extra_ms": limit.extra_seconds * 1e3,
                        "extra_over_limit": extra_ms / (limit.extra_seconds * 1e3),
                        "warmup_ratio": row["warmup_s"] / base["warmup_s"] if suffix else None,
                    }
                )
    result = {
        "config": cfg.__dict__,
        "bandwidth_gbs": bandwidth / 1e9,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "points": points,
    }
    if cfg.plot:
        result["plot"] = draw(result, cfg.plot)
    return result


def _with_range(point: dict, key: str, fmt: str, unit: str = "") -> str:
    """``point[key]`` and, when it was measured in several processes, its [min-max] over them."""
    text = format(point[key], fmt) + unit
    s = point.get("spread", {}).get(key)
    return f"{text} [{format(s['min'], fmt)}-{format(s['max'], fmt)}]" if s else text


def format_table(result: dict) -> str:
    c = result["config"]
    processes = result.get("processes", 1)
    spread = result.get("spread", {})
    points = [dict(p, spread=spread.get(f"d={p['width']} {p['mode']} {p['residual']}", {})) for p in result["points"]]
    bandwidth = f"{result['bandwidth_gbs']:.1f}"
    if bw := spread.get("run", {}).get("bandwidth_gbs"):
        bandwidth += f" [{bw['min']:.1f}-{bw['max']:.1f}]"
    if processes > 1:
        over = (
            f"median over {processes} fresh processes [min-max over them] of each process's median over "
            f"{c['repeats']} repeats"
        )
    else:
        over = f"median over {c['repeats']} repeats (per-repeat 25-75 %)"
    lines = [
        f"bench roofline: {c['n_layers']} Transformer blocks, T {c['seq_len']}, batch {c['batch_size']}, "
        f"head dim {c['head_dim']}, Block N = {c['blocks']}, {c['device']}, {result['threads']} threads, "
        f"clock {c['clock']}, torch {result['torch']}; copy bandwidth {bandwidth} GB/s; step ratios over "
        f"prenorm of the same mode, {over}",
        "",
        "| width | mode | scheme | measured | limit | extra ms | least extra ms | extra / least | warm-up vs prenorm |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        if processes > 1:
            measured = _with_range(p, "measured_ratio", ".3f", "x")
        else:
            measured = f"{p['measured_ratio']:.3f}x ({p['ratio_p25']:.3f}-{p['ratio_p75']:.3f})"
        warm = _with_range(p, "warmup_ratio", ".2f", "x") if p["warmup_ratio"] is not None else "-"
        limit = _with_range(p, "limit_ratio", ".3f", "x")
        lines.append(
            f"| {p['width']} | {p['mode']} | {p['residual']} | {measured} | {limit} | "
            f"{_with_range(p, 'extra_ms', '.2f')} | {_with_range(p, 'limit_extra_ms', '.2f')} | "
            f"{_with_range(p, 'extra_over_limit', '.1f')} | {warm} |"
        )
    if "plot" in result:
        lines += ["", f"plot: {result['plot']}"]
    return "\n".join(lines)


def draw(result: dict, path: str) -> str:
    """Overhead over prenorm (%) against width: measured (solid, per mode; over several processes the median
    with min-max error bars) and the limit (dashed eager, dotted compiled; the median over processes)."""
    from attnres.analysis.plots import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    spread = result.get("spread", {})
    points = result["points"]
    widths = sorted({p["width"] for p in points})
    for residual, color in zip(SCHEMES, ("tab:blue", "tab:orange"), strict=True):
        for mode, marker, limit_style in (("eager", "o", "--"), ("compiled", "s", ":")):
            mine = sorted(
                (p for p in points if p["residual"] == residual and p["mode"] == mode), key=lambda p: p["width"]
            )
            if not mine:
                continue
            x = [p["width"] for p in mine]
            y = [100 * (p["measured_ratio"] - 1) for p in mine]
            ranges = [spread.get(f"d={p['width']} {mode} {residual}", {}).get("measured_ratio") for p in mine]
            if all(ranges):
                below = [yi - 100 * (r["min"] - 1) for yi, r in zip(y, ranges, strict=True)]
                above = [100 * (r["max"] - 1) - yi for yi, r in zip(y, ranges, strict=True)]
                ax.errorbar(
                    x, y, yerr=[below, above], marker=marker, color=color, capsize=3, label=f"{residual} {mode}"
                )
            else:
                ax.plot(x, y, marker=marker, color=color, label=f"{residual} {mode}")
            ax.plot(
                x,
                [100 * (p["limit_ratio"] - 1) for p in mine],
                linestyle=limit_style,
                color=color,
                label=f"{residual} {mode} limit (memory traffic)",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("width d_model")
    ax.set_ylabel("step time over prenorm (%)")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.legend(fontsize=7)
    processes = result.get("processes", 1)
    over = f"; median, min-max over {processes} processes" if processes > 1 else ""
    ax.set_title(
        f"AttnRes overhead and its memory-traffic limit\n({result['bandwidth_gbs']:.1f} GB/s copy{over})", fontsize=10
    )
    return save_png(fig, path, dpi=120)
