#!/usr/bin/env python3
"""Compiled prefill, buffered against unstacked streams, timed interleaved in one process.

``attnres bench decode --compile`` compares each compiled variant with compiled prenorm, but the
two stream forms (``attnres.residual.attnres._compiled_form``) can only be compared across two
runs of it, and on a shared machine prefill medians moved by more than the difference between
runs. This script compiles the prompt-shaped forward of prenorm, Block and Full (the bench's
models and weights: d 256, 12 blocks, Block N 8, prompt 256, batch 1) once per form, checks
that both forms give the same logits, and then times all of them round-robin::

    python scripts/prefill_form_ab.py --rounds 20 --threads 1

The form is chosen at trace time, so each is compiled on its own copy of the model with a flag
read by the patched rule; dynamo guards on the flag, so a call with the other value would
recompile (the script counts the graphs to show that none did).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds (3 prefills per row each)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64

    import attnres.residual.attnres as streams
    from attnres.bench.decode import DecodeBenchConfig, model_config
    from attnres.inference.compiled import CompiledDecoder
    from attnres.model import AttnResLM

    unstacked = {"prefill": True}

    def rule(embedding):  # the library's rule, with prefill's form taken from the flag
        return torch.compiler.is_compiling() and (
            torch.is_grad_enabled() or (embedding.shape[1] > 1 and unstacked["prefill"]))

    streams._compiled_form = rule
    cfg = DecodeBenchConfig(batch_size=args.batch_size)
    prompt = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.prompt_len),
                           generator=torch.Generator().manual_seed(cfg.seed))
    rows = {}
    for variant in ("prenorm", "block", "full"):
        torch.manual_seed(cfg.seed)
        model = AttnResLM(model_config(cfg, variant)).eval()
        for form in ((False,) if variant == "prenorm" else (False, True)):
            rows[(variant, form)] = CompiledDecoder(copy.deepcopy(model), cfg.batch_size)

    def prefill(key):
        unstacked["prefill"] = key[1]
        rows[key].reset()
        return rows[key](prompt)

    from torch._dynamo.utils import counters
    with torch.no_grad():
        logits = {}
        for key in rows:
            t0 = time.perf_counter()
            logits[key] = prefill(key)
            print(f"{key[0]} {'unstacked' if key[1] else 'buffered'}: compiled in {time.perf_counter() - t0:.1f} s")
        for variant in ("block", "full"):
            diff = (logits[(variant, False)] - logits[(variant, True)]).abs().max().item()
            print(f"{variant}: max |logits buffered - unstacked| = {diff:.2e}")
        graphs = counters["stats"]["unique_graphs"]
        times = {key: [] for key in rows}
        for _ in range(args.rounds):
            for key in rows:
                for _ in range(3):
                    t0 = time.perf_counter()
                    prefill(key)
                    times[key].append(time.perf_counter() - t0)
    recompiled = counters["stats"]["unique_graphs"] - graphs
    base = statistics.median(times[("prenorm", False)])
    print(f"\n{args.rounds} rounds x 3 prefills, {args.threads} threads, batch {cfg.batch_size}, "
          f"torch {torch.__version__}; graphs compiled while timing: {recompiled}\n")
    print("| variant | form | prefill ms median (p25-p75) | vs compiled prenorm |")
    print("|---|---|---:|---:|")
    for (variant, form), t in times.items():
        q = statistics.quantiles(t, n=4)
        print(f"| {variant} | {'unstacked' if form else 'buffered'} | {statistics.median(t) * 1e3:.1f} "
              f"({q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}) | {statistics.median(t) / base:.3f} |")


if __name__ == "__main__":
    main()
