"""Min / median / max of a bench over repeats and over fresh processes (``attnres bench NAME --processes N``).

One run of a bench on a shared machine swings by about 10 %: its medians over repeats hide how far
the next run may land. With ``--processes N`` the bench runs N times, each in a fresh interpreter
(its own allocator, thread pool and compiled code; inductor's on-disk cache is shared, so only the
first process may compile cold), one after the other, the variants' round-robin order rotated by one
from process to process so that no scheme always runs first. Every process measures all its
variants round-robin itself, so each ratio to the baseline is taken within one process; across
processes we report the min, median and max of each headline number (``HEADLINES``). The merged
result's rows hold the medians over processes (a ratio's median is the median of the per-process
ratios, not a ratio of medians); ``spread`` holds min / median / max; ``runs`` each process's result.
``bench roofline``'s rows are its ``points`` (one per width, mode and scheme); its copy bandwidth, a
number of the whole run (``RUN_HEADLINES``), is aggregated too, under ``spread["run"]``.

Within one process the benches already report the spread over repeats (``*_min`` / ``*_max`` beside
each median, pooled over the repeats of every round).

Compile warm-up (``warmup_s``: the first steps of a compiled row, compilation included) is a figure
of its own and not part of any step time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

# the numbers of each bench's rows that are aggregated over processes (others keep the first process's)
HEADLINES: dict[str, tuple[str, ...]] = {
    "train": (
        "step_ms_median",
        "step_ratio",
        "repeat_ratio_median",
        "vs_eager",
        "warmup_s",
        "peak_mib",
        "peak_ratio",
        "step_peak_ratio",
        "tensor_step_peak_ratio",
    ),
    "op": ("fwd_ms", "bwd_ms", "fwd_frac_of_copy", "bwd_frac_of_copy", "copy_gbps"),
    "decode": ("prefill_ms", "prefill_ratio", "decode_ms", "decode_ratio", "warmup_s"),
    "roofline": (
        "measured_ratio",
        "extra_ms",
        "extra_over_limit",
        "limit_ratio",
        "limit_extra_ms",
        "warmup_ratio",
    ),
}
# numbers of a whole run rather than of one row, aggregated the same way under spread["run"]
RUN_HEADLINES: dict[str, tuple[str, ...]] = {"roofline": ("bandwidth_gbs",)}
# benches whose own table shows the min-max over processes: no second spread table
INLINE_SPREAD = frozenset({"roofline"})


def min_median_max(values: Sequence[float]) -> dict[str, float]:
    """{"min", "median", "max", "n"} of a non-empty sample."""
    if not values:
        raise ValueError("min_median_max needs at least one value")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def row_items(result: Mapping) -> dict[str, dict]:
    """A bench result's rows by name: train and decode key them already; op's list is keyed 'K=8 impl',
    roofline's points 'd=256 eager block'."""
    if "points" in result:
        return {f"d={p['width']} {p['mode']} {p['residual']}": p for p in result["points"]}
    rows = result["rows"]
    if isinstance(rows, Mapping):
        return dict(rows)
    return {f"K={r['K']} {r['impl']}": r for r in rows}


def rotated(variants: Sequence[str], i: int) -> list[str]:
    """The round-robin order of process i: the variants turned left by i."""
    if not variants:
        return []
    k = i % len(variants)
    return list(variants[k:]) + list(variants[:k])


def aggregate(name: str, runs: Sequence[Mapping]) -> dict:
    """One result from the results of several processes of bench ``name``.

    The first run gives the structure (and every number not in ``HEADLINES``); each headline number is
    replaced by its median over the runs that have it, and ``spread[row][key]`` holds its min / median /
    max. Rows are matched by name, so a run's variant order does not matter.
    """
    if not runs:
        raise ValueError("aggregate needs the result of at least one process")
    if name not in HEADLINES:
        raise ValueError(f"bench {name!r} has no headline numbers to aggregate; known: {sorted(HEADLINES)}")
    per_run = [row_items(r) for r in runs]
    names = list(per_run[0])
    for i, rows in enumerate(per_run[1:], start=1):
        if set(rows) != set(names):
            raise ValueError(f"process {i} measured rows {sorted(rows)}, process 0 {sorted(names)}")
    merged = json.loads(json.dumps(runs[0]))  # a deep copy of plain JSON data
    merged_rows = row_items(merged)
    spread: dict[str, dict[str, dict[str, float]]] = {}
    for row in names:
        spread[row] = {}
        for key in HEADLINES[name]:
            values = [rows[row][key] for rows in per_run if isinstance(rows[row].get(key), int | float)]
            if not values:
                continue
            spread[row][key] = min_median_max(values)
            merged_rows[row][key] = spread[row][key]["median"]
    for key in RUN_HEADLINES.get(name, ()):
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        if values:
            spread.setdefault("run", {})[key] = min_median_max(values)
            merged[key] = spread["run"][key]["median"]
    merged["processes"] = len(runs)
    merged["spread"] = spread
    merged["runs"] = list(runs)
    return merged


def format_spread(result: Mapping, name: str = "") -> str:
    """The spread table of an aggregated result (empty for a single process, and for bench ``name`` when
    its own table shows the spread)."""
    spread = result.get("spread")
    if not spread or name in INLINE_SPREAD:
        return ""
    lines = [
        "",
        f"over {result['processes']} processes (fresh interpreters, variants' order rotated; each ratio "
        "taken within its process): min / median / max",
        "",
        "| row | number | min | median | max |",
        "|---|---|---:|---:|---:|",
    ]
    for row, numbers in spread.items():
        for key, s in numbers.items():
            lines.append(f"| {row} | {key} | {s['min']:.4g} | {s['median']:.4g} | {s['max']:.4g} |")
    return "\n".join(lines)


def launch(name: str, config: Mapping, processes: int, *, threads: int, package: str) -> list[dict]:
    """Run bench ``name`` at ``config`` (its dataclass's fields) in ``processes`` fresh interpreters, one
    after the other (``python -m PACKAGE``: the bench package, whose registry this module does not
    import), the variants rotated by one each time; their results."""
    if processes < 1:
        raise ValueError(f"--processes {processes}: must be at least 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="attnres-bench-") as tmp:
        for i in range(processes):
            cfg = dict(config)
            if "variants" in cfg:
                cfg["variants"] = rotated(cfg["variants"], i)
            out = os.path.join(tmp, f"process{i}.json")
            proc = subprocess.run(
                [sys.executable, "-m", package, name, json.dumps(cfg), out, str(threads)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            )
            if proc.returncode != 0:
                raise RuntimeError(f"bench {name}, process {i} of {processes} failed:\n{proc.stderr[-3000:]}")
            with open(out) as f:
                results.append(json.load(f))
            print(f"bench {name}: process {i + 1} of {processes} done", file=sys.stderr, flush=True)
    return results
