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

``time_triton_vs_torch`` times the Triton kernels against the torch paths on a GPU (not part of
the command: no GPU here).
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List

import torch

from attnres.ops.common import inverse_rms
from attnres.ops.depth_attention import depth_attention_reference, fused_depth_attention
from attnres.ops.two_phase.fused import phase1_outputs
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
                return phase1_outputs(view, inv, qs, ws, producers)

        def p1_fwd_bwd():
            h1s, _ = phase1_outputs(view, inv, qs, ws, producers)
            torch.autograd.backward(h1s, [gh] * len(h1s))

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


@contextmanager
def _without_triton() -> Iterator[None]:
    """The torch fused path even for CUDA tensors (its documented switch, read on every call)."""
    before = os.environ.get("ATTNRES_TRITON")
    os.environ["ATTNRES_TRITON"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["ATTNRES_TRITON"]
        else:
            os.environ["ATTNRES_TRITON"] = before


def time_triton_vs_torch(
    B: int = 8,
    T: int = 2048,
    D: int = 1024,
    K: int = 9,
    heads: int = 1,
    S: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    kernel: str = "softmax",
    normalize_keys: bool = True,
    device: str = "cuda",
    rep_ms: int = 100,
) -> Dict[str, float]:
    """Milliseconds per call, Triton vs the torch paths, on a GPU (needs triton; not run by the tests).

    Times the forward, the forward + backward of the op in the residual stream's layout (K sources
    as rows of a [B, T, K+1, D] buffer), Phase 1 for S queries (forward) and the merge. Also
    reports the effective bandwidth of the Triton forward in GB/s (bytes that must move: K sources
    read, h written) and the largest difference between the two forwards.
    """
    import triton.testing

    from attnres.ops.depth_attention.triton import triton_fused_depth_attention
    from attnres.ops.two_phase import fused as two_phase_fused
    from attnres.ops.two_phase import naive as two_phase_naive
    from attnres.ops.two_phase import triton as two_phase_triton

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    buffer = torch.randn(B, T, K + 1, D, device=dev, dtype=dtype, generator=gen)
    producers = [buffer[:, :, i].clone().requires_grad_() for i in range(K)]
    segments = (buffer[:, :, :K],)
    shape = (D,) if heads == 1 else (heads, D // heads)
    query = (0.1 * torch.randn(shape, device=dev, generator=gen)).requires_grad_()
    key_weight = torch.ones(D, device=dev, requires_grad=True)
    gh = torch.randn(B, T, D, device=dev, dtype=dtype, generator=gen)
    opts = dict(kernel=kernel, normalize_keys=normalize_keys)

    def torch_fwd():
        with _without_triton():
            return fused_depth_attention(segments, producers, query, key_weight, **opts)

    def triton_fwd():
        return triton_fused_depth_attention(segments, producers, query, key_weight, **opts)

    def fwd_bwd(fn):
        def run():
            fn().backward(gh)
        return run

    bench = triton.testing.do_bench
    out: Dict[str, float] = {}
    with torch.no_grad():
        out["fwd_torch_ms"] = bench(torch_fwd, rep=rep_ms)
        out["fwd_triton_ms"] = bench(triton_fwd, rep=rep_ms)
    out["fwd_bwd_torch_ms"] = bench(fwd_bwd(torch_fwd), rep=rep_ms)
    out["fwd_bwd_triton_ms"] = bench(fwd_bwd(triton_fwd), rep=rep_ms)
    moved = (K + 1) * B * T * D * buffer.element_size()
    out["fwd_triton_GBps"] = moved / (out["fwd_triton_ms"] * 1e-3) / 1e9
    with torch.no_grad():
        out["fwd_max_abs_diff"] = (triton_fwd().float() - torch_fwd().float()).abs().max().item()

        values = buffer[:, :, :K]
        inv = inverse_rms(values, 1e-6) if normalize_keys else None
        queries = 0.1 * torch.randn(S, D, device=dev, generator=gen)
        if heads > 1:
            queries = queries.view(S, heads, D // heads)
        kws = torch.ones(S, D, device=dev) if normalize_keys else None
        phase1_args = (values, inv, queries, kws)

        def phase1_torch():
            with _without_triton():
                return two_phase_fused.phase1(*phase1_args, kernel=kernel)

        out["phase1_torch_ms"] = bench(phase1_torch, rep=rep_ms)
        out["phase1_triton_ms"] = bench(lambda: two_phase_triton.phase1(*phase1_args, kernel=kernel), rep=rep_ms)
        a = two_phase_triton.phase1(buffer[:, :, :K - 1], None if inv is None else inv[:, :, :K - 1],
                                    queries, kws, kernel=kernel)
        b = two_phase_triton.phase1(buffer[:, :, K - 1:K], None if inv is None else inv[:, :, K - 1:K],
                                    queries, kws, kernel=kernel)
        out["merge_torch_ms"] = bench(lambda: two_phase_naive.merge(a, b, kernel), rep=rep_ms)
        out["merge_triton_ms"] = bench(lambda: two_phase_triton.merge(a, b, kernel), rep=rep_ms)
    return out
