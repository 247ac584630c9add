"""`attnres bench compile`: how long ``torch.compile`` keeps a training start waiting, per scheme, with the
compiler's on-disk caches cold and then warm.

A compiled model's first steps trace it, differentiate it and generate and build code for every graph;
inductor keeps what it built in its on-disk caches (the FX graph cache and AOTAutograd's), so the next start
of the same model on the same machine reads them instead. Both starts are figures of their own: the first
is what a user waits once per model and machine, the second on every start after it.

For each variant, ``starts`` fresh processes run one after the other over one new, empty cache directory
(``TORCHINDUCTOR_CACHE_DIR``, and Triton's beside it), each building the model and timing its first
``warmup`` compiled steps (wall time: compilation included) and then ``steps`` more (the step time). The
first start is cold, the later ones warm. Each variant has its own directory, so no scheme reads a graph
another compiled; nothing outside those directories is shared (``bench train --compile`` compiles every
variant in one process and reads the user's cache, so its warm-up depends on what ran before).
Ratios are to prenorm's start of the same number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnres.bench import train
from attnres.files import atomic_write_text


@dataclass
class CompileBenchConfig:
    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 4
    seq_len: int = 128
    batch_size: int = 4
    vocab_size: int = 4096
    blocks: int | None = 8  # Block AttnRes N (None: the model's default)
    optimizer: str = "adamw"
    backend: str = "inductor"  # the torch.compile backend (e.g. aot_eager: tracing and autograd, no code)
    # "model": one graph for the whole forward; "sublayer": each attention/MLP sublayer once, reused by every
    # block, the residual stream eager (attnres.model.compile)
    compile_granularity: str = "model"
    variants: list[str] = field(default_factory=lambda: ["prenorm", "block", "full"])
    starts: int = 2  # fresh processes per variant over its cache directory: the first cold, the rest warm
    warmup: int = 2  # compiled steps timed as the start (compilation happens in the first; a recompile in the second)
    steps: int = 3  # steps after the start, whose median is the step time
    seed: int = 0
    device: str = "cpu"

    @classmethod
    def quick(cls) -> CompileBenchConfig:
        return cls(d_model=64, n_layers=2, n_heads=1, seq_len=32, batch_size=2, vocab_size=256, blocks=2)


def _train_config(cfg: CompileBenchConfig, variant: str) -> train.BenchConfig:
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(train.BenchConfig) if hasattr(cfg, f.name)}
    return dataclasses.replace(
        train.BenchConfig(), **{**shared, "variants": [variant], "compile": cfg.backend, "memory": False}
    )


def start(cfg: CompileBenchConfig, variant: str) -> dict:
    """One start of ``variant`` in this process: seconds to build the model, its first ``warmup`` compiled
    steps (the start), and the median of ``steps`` more."""
    t0 = time.perf_counter()
    model, opt, x, y = train._setup(_train_config(cfg, variant), variant + train.COMPILED)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(cfg.warmup):
        train._step(model, opt, x, y)
    train._sync(cfg.device)
    warmup = time.perf_counter() - t0
    times = []
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        train._step(model, opt, x, y)
        train._sync(cfg.device)
        times.append(time.perf_counter() - t0)
    return {"build_s": built, "warmup_s": warmup, "step_s": statistics.median(times) if times else float("nan")}


def _fresh_start(cfg: CompileBenchConfig, variant: str, cache: Path, threads: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "start.json"
        config = json.dumps(dataclasses.asdict(cfg))
        cmd = [sys.executable, "-m", "attnres.bench.compile", config, variant, str(out), str(threads)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"bench compile: the start of {variant} failed: " + " | ".join(tail))
        return json.loads(out.read_text())


def run(cfg: CompileBenchConfig) -> dict:
    for name in ("starts", "warmup"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--set {name}={getattr(cfg, name)}: must be at least 1")
    if cfg.steps < 0:
        raise ValueError(f"--set steps={cfg.steps}: must be 0 or more")
    if "prenorm" not in cfg.variants:
        cfg.variants = ["prenorm"] + list(cfg.variants)
    threads = torch.get_num_threads()
    starts: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="attnres-compile-") as root:
        for v in cfg.variants:
            cache = Path(root) / f"cache-{len(starts)}"
            starts[v] = [_fresh_start(cfg, v, cache, threads) for _ in range(cfg.starts)]
    rows = {}
    for v, runs in starts.items():
        base = starts["prenorm"]
        rows[v] = {
            "warmup_s": [r["warmup_s"] for r in runs],
            "warmup_ratio": [r["warmup_s"] / b["warmup_s"] for r, b in zip(runs, base, strict=True)],
            "step_ms": [1000 * r["step_s"] for r in runs],
            "build_s": [r["build_s"] for r in runs],
        }
    return {"config": dataclasses.asdict(cfg), "threads": threads, "torch": torch.__version__, "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    n = c["starts"]
    lines = [
        f"bench compile: d={c['d_model']}, {c['n_layers']} blocks, T={c['seq_len']}, batch={c['batch_size']}, "
        f"{c['optimizer']}, backend={c['backend']}, one graph per {c.get('compile_granularity', 'model')}, "
        f"device={c['device']}, {result['threads']} threads, "
        f"torch {result['torch']}; each variant {n} fresh processes over its own new cache directory",
        "",
        "| variant | "
        + " | ".join(f"start {i + 1} ({'cold' if i == 0 else 'warm'}) s | vs prenorm" for i in range(n))
        + " | step ms |",
        "|---|" + "---:|---:|" * n + "---:|",
    ]
    for v, r in result["rows"].items():
        cells = " | ".join(f"{w:.1f} | {q:.2f}" for w, q in zip(r["warmup_s"], r["warmup_ratio"], strict=True))
        lines.append(f"| {v} | {cells} | {statistics.median(r['step_ms']):.1f} |")
    lines += [
        "",
        f"start: wall seconds of the first {c['warmup']} compiled steps of a fresh process (tracing, autograd, "
        "code generation and build; the cold start fills the variant's cache directory, the warm ones read "
        f"it); step ms: median over the starts of each one's median of {c['steps']} later steps.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """One start in a fresh process: ``python -m attnres.bench.compile CONFIG_JSON VARIANT OUT_JSON THREADS``."""
    config, variant, out, threads = argv
    torch.set_num_threads(int(threads))
    result = start(CompileBenchConfig(**json.loads(config)), variant)
    atomic_write_text(out, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
