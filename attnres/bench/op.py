"""`attnres bench op`: the depth-attention op alone, against the memory bandwidth of this machine.

The op is memory-bound: per token it reads K source vectors and writes one.
We time it on sources laid out as the residual stream keeps them (a
[B, T, K_max, D] buffer, read as a view) and report

- the bytes it must move at the least (forward: read K*D + write D values per
  token; backward: read K*D + D (the incoming gradient), write K*D), and the
  bandwidth that implies at the measured time;
- the bandwidth of a plain copy of the same number of bytes on this machine
  (`Tensor.copy_`, counting bytes read + written), the practical ceiling;
- the ratio of the two.

Implementations: `fused` (the per-sublayer custom autograd op), `reference`
(plain autograd over a stacked tensor), and `two_phase` (one Phase-1 pass for S
queries, reported per query, i.e. per sublayer).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List

import torch

from attnres.ops.depth_attention import depth_attention_reference, fused_depth_attention
from attnres.ops.two_phase import inverse_rms, phase1
from attnres.train.progress import progress_bar


@dataclass
class OpBenchConfig:
    batch_size: int = 8
    seq_len: int = 256
    d_model: int = 256
    sources: List[int] = field(default_factory=lambda: [4, 8, 16, 32])
    queries: int = 4  # S for the two-phase row
    repeats: int = 15
    dtype: str = "float32"
    device: str = "cpu"

    @classmethod
    def quick(cls) -> "OpBenchConfig":
        return cls(seq_len=128, sources=[4, 8, 16], repeats=7)


def _median_time(fn: Callable[[], object], repeats: int, device: str) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(n_bytes: int, cfg: OpBenchConfig) -> float:
    """GB/s of dst.copy_(src) for n_bytes, counting read + write."""
    dtype = getattr(torch, cfg.dtype)
    n = max(1, n_bytes // torch.finfo(dtype).bits * 8)
    src = torch.randn(n, dtype=dtype, device=cfg.device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), cfg.repeats, cfg.device)
    return 2 * n * src.element_size() / t / 1e9


def run(cfg: OpBenchConfig) -> dict:
    dtype = getattr(torch, cfg.dtype)
    B, T, D = cfg.batch_size, cfg.seq_len, cfg.d_model
    esize = torch.finfo(dtype).bits // 8
    rows = []
    for K in progress_bar(cfg.sources, desc="bench op", unit="K"):
        g = torch.Generator().manual_seed(K)
        buffer = torch.randn(B, T, K + 2, D, generator=g, dtype=dtype).to(cfg.device)
        view = buffer[:, :, :K]
        producers = [view[:, :, i].clone().requires_grad_() for i in range(K)]
        q = torch.randn(D, generator=g, dtype=dtype).to(cfg.device).requires_grad_()
        w = (torch.rand(D, generator=g, dtype=dtype) + 0.5).to(cfg.device).requires_grad_()
        gh = torch.randn(B, T, D, generator=g, dtype=dtype).to(cfg.device)
        stacked = torch.stack(producers).detach().requires_grad_()

        fwd_bytes = (K + 1) * B * T * D * esize
        bwd_bytes = (2 * K + 1) * B * T * D * esize
        copy_bw = copy_bandwidth(fwd_bytes, cfg)

        def fused_fwd():
            with torch.no_grad():
                return fused_depth_attention([view], producers, q, w)

        def fused_fwd_bwd():
            h = fused_depth_attention([view], producers, q, w)
            h.backward(gh)

        def ref_fwd():
            with torch.no_grad():
                return depth_attention_reference(stacked, q, w).h

        def ref_fwd_bwd():
            h = depth_attention_reference(stacked, q, w).h
            h.backward(gh)

        S = cfg.queries
        qs = torch.randn(S, D, generator=g, dtype=dtype).to(cfg.device).requires_grad_()
        ws = (torch.rand(S, D, generator=g, dtype=dtype) + 0.5).to(cfg.device).requires_grad_()
        inv = inverse_rms(view, 1e-6)

        def p1_fwd():
            with torch.no_grad():
                return phase1(view, inv, qs, ws, producers)

        def p1_fwd_bwd():
            h1, lse = phase1(view, inv, qs, ws, producers)
            torch.autograd.backward([h1], [gh.unsqueeze(2).expand_as(h1)])

        for name, fwd, fwd_bwd, per in (("fused", fused_fwd, fused_fwd_bwd, 1),
                                        ("reference", ref_fwd, ref_fwd_bwd, 1),
                                        (f"two_phase (S={S}, per query)", p1_fwd, p1_fwd_bwd, S)):
            tf = _median_time(fwd, cfg.repeats, cfg.device) / per
            tfb = _median_time(fwd_bwd, cfg.repeats, cfg.device) / per
            tb = max(tfb - tf, 1e-12)
            rows.append({
                "K": K, "impl": name, "fwd_ms": tf * 1e3, "bwd_ms": tb * 1e3,
                "fwd_min_bytes": fwd_bytes, "bwd_min_bytes": bwd_bytes,
                "fwd_gbps": fwd_bytes / tf / 1e9, "bwd_gbps": bwd_bytes / tb / 1e9,
                "copy_gbps": copy_bw,
                "fwd_frac_of_copy": fwd_bytes / tf / 1e9 / copy_bw,
                "bwd_frac_of_copy": bwd_bytes / tb / 1e9 / copy_bw,
            })
    return {"config": cfg.__dict__, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"bench op: B={c['batch_size']}, T={c['seq_len']}, D={c['d_model']}, {c['dtype']}, "
        f"device={c['device']}, {result['threads']} threads, torch {result['torch']}; median of "
        f"{c['repeats']}. Minimum bytes: fwd (K+1)BTD, bwd (2K+1)BTD elements.",
        "",
        "| K | impl | fwd ms | fwd GB/s | fwd / copy | bwd ms | bwd GB/s | bwd / copy | copy GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['K']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_gbps']:.2f} | "
                     f"{r['fwd_frac_of_copy']:.0%} | {r['bwd_ms']:.2f} | {r['bwd_gbps']:.2f} | "
                     f"{r['bwd_frac_of_copy']:.0%} | {r['copy_gbps']:.2f} |")
    return "\n".join(lines)
