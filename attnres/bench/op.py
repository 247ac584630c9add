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

Timing: every row and the copy run in turn within each of ``repeats`` rounds, and the table
reports the best round of each (the JSON also keeps medians): on a shared machine the bandwidth
available drifts, and the best of interleaved rounds is what the op and the copy each achieve under
the same conditions. Backward = (forward + backward) - forward, the backward taken with
``torch.autograd.grad`` so that it measures the gradients the op returns, not their accumulation into
leaf tensors' ``.grad`` across repeats.

Implementations: `fused` (the per-sublayer custom autograd op), `reference`
(plain autograd over a stacked tensor), `two_phase` (one Phase-1 pass for S
queries over the buffer, reported per query, i.e. per sublayer), and `two_phase custom op`
(the same over the sources as a list: the ``attnres::phase1`` op compiled streams run). The two
two-phase rows run the device's kernel (the compiled C++ one on the CPU, ``ops/two_phase/cpu.py``;
Triton on CUDA); their `torch products` twins run the same with the kernels switched off.

``time_triton_vs_torch`` times the Triton kernels against the torch paths on a GPU (not part of
the command: no GPU here).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from attnres.ops.common import inverse_rms
from attnres.ops.depth_attention import depth_attention_reference, fused_depth_attention
from attnres.ops.two_phase import cpu as two_phase_cpu
from attnres.ops.two_phase.fused import phase1_outputs
from attnres.ops.two_phase.library import phase1_op
from attnres.train.progress import progress_bar


@dataclass
class OpBenchConfig:
    batch_size: int = 8
    seq_len: int = 256
    d_model: int = 256
    sources: list[int] = field(default_factory=lambda: [4, 8, 16, 32])
    queries: int = 4  # S for the two-phase row
    repeats: int = 15
    dtype: str = "float32"
    device: str = "cpu"

    @classmethod
    def quick(cls) -> OpBenchConfig:
        return cls(seq_len=128, sources=[4, 8, 16], repeats=7)


def _interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per call of every function, ``repeats`` rounds that each run all of them in turn.

    Interleaving matters on a shared machine: the memory bandwidth available changes from second
    to second (we have seen a plain copy run at 20 and at 55 GB/s minutes apart), and a ratio is
    only meaningful between timings that saw the same conditions."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for fn in fns.values():  # warm-up: allocator, kernel selection
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def _copy(n_bytes: int, cfg: OpBenchConfig) -> Callable[[], object]:
    """dst.copy_(src) over n_bytes (preallocated, so this is the bandwidth ceiling)."""
    dtype = getattr(torch, cfg.dtype)
    n = max(1, n_bytes // torch.finfo(dtype).bits * 8)
    src = torch.randn(n, dtype=dtype, device=cfg.device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


_Impl = tuple[Callable[[], Any], Callable[[Any], object], int]  # forward output: a tensor, or S of them


def _impls(cfg: OpBenchConfig, K: int, dtype: torch.dtype) -> dict[str, _Impl]:
    """Each row's (forward, backward of a forward's output, op calls per forward) on fresh operands
    with K sources, seeded by K."""
    B, T, D = cfg.batch_size, cfg.seq_len, cfg.d_model
    g = torch.Generator().manual_seed(K)
    buffer = torch.randn(B, T, K + 2, D, generator=g, dtype=dtype).to(cfg.device)
    view = buffer[:, :, :K]
    producers = [view[:, :, i].clone().requires_grad_() for i in range(K)]
    q = torch.randn(D, generator=g, dtype=dtype).to(cfg.device).requires_grad_()
    w = (torch.rand(D, generator=g, dtype=dtype) + 0.5).to(cfg.device).requires_grad_()
    gh = torch.randn(B, T, D, generator=g, dtype=dtype).to(cfg.device)
    stacked = torch.stack(producers).detach().requires_grad_()
    S = cfg.queries
    qs = torch.randn(S, D, generator=g, dtype=dtype).to(cfg.device).requires_grad_()
    ws = (torch.rand(S, D, generator=g, dtype=dtype) + 0.5).to(cfg.device).requires_grad_()
    inv = inverse_rms(view, 1e-6)
    inv_list = list(inv.unbind(2))  # the compiled streams' form: each source's inverse RMS on its own
    gh_all = gh.unsqueeze(2).expand(B, T, S, D).contiguous()

    two_phase: _Impl = (
        lambda: phase1_outputs(view, inv, qs, ws, producers)[0],
        lambda h1s: torch.autograd.grad(h1s, [*producers, qs, ws], [gh] * len(h1s)),
        S,
    )
    # the custom op of the compiled streams over the sources as a list (attnres.ops.two_phase.library)
    custom_op: _Impl = (
        lambda: phase1_op(producers, inv_list, qs, ws, "softmax")[0],
        lambda h: torch.autograd.grad(h, [*producers, qs, ws], gh_all),
        S,
    )
    # backward through torch.autograd.grad: the gradients the op returns, not their
    # accumulation into leaves' .grad across repeats (which a model step does not do either)
    return {
        "fused": (
            lambda: fused_depth_attention([view], producers, q, w),
            lambda h: torch.autograd.grad(h, [*producers, q, w], gh),
            1,
        ),
        "reference": (
            lambda: depth_attention_reference(stacked, q, w).h,
            lambda h: torch.autograd.grad(h, [stacked, q, w], gh),
            1,
        ),
        # the kernel of the device (the compiled C++ one on the CPU, Triton on CUDA), then torch's products
        f"two_phase (S={S}, per query)": two_phase,
        f"two_phase torch products (S={S}, per query)": (_plain(two_phase[0]), _plain(two_phase[1]), S),
        f"two_phase custom op (S={S}, per query)": custom_op,
        f"two_phase custom op torch products (S={S}, per query)": (_plain(custom_op[0]), _plain(custom_op[1]), S),
    }


def _then(fwd: Callable[[], Any], bwd: Callable[[Any], object]) -> Callable[[], object]:
    """One call: ``bwd`` of the output of ``fwd``."""
    return lambda: bwd(fwd())


def run(cfg: OpBenchConfig) -> dict:
    dtype = getattr(torch, cfg.dtype)
    B, T, D = cfg.batch_size, cfg.seq_len, cfg.d_model
    esize = torch.finfo(dtype).bits // 8
    rows = []
    for K in progress_bar(cfg.sources, desc="bench op", unit="K"):
        impls = _impls(cfg, K, dtype)
        fwd_bytes = (K + 1) * B * T * D * esize
        bwd_bytes = (2 * K + 1) * B * T * D * esize

        fns: dict[str, Callable[[], object]] = {"copy": _copy(fwd_bytes, cfg)}
        for name, (fwd, bwd, _) in impls.items():
            fns[name + " fwd"] = torch.no_grad()(fwd)
            fns[name + " fwd+bwd"] = _then(fwd, bwd)
        times = _interleaved_times(fns, cfg.repeats, cfg.device)
        copy_bw = 2 * fwd_bytes / min(times["copy"]) / 1e9
        copy_bw_median = 2 * fwd_bytes / statistics.median(times["copy"]) / 1e9
        for name, (_, _, per) in impls.items():
            tf = min(times[name + " fwd"]) / per
            tb = max(min(times[name + " fwd+bwd"]) / per - tf, 1e-12)
            tf_med = statistics.median(times[name + " fwd"]) / per
            tb_med = max(statistics.median(times[name + " fwd+bwd"]) / per - tf_med, 1e-12)
            tf_max = max(times[name + " fwd"]) / per
            rows.append(
                {
                    "K": K,
                    "impl": name,
                    "fwd_ms": tf * 1e3,
                    "bwd_ms": tb * 1e3,
                    "fwd_ms_median": tf_med * 1e3,
                    "bwd_ms_median": tb_med * 1e3,
                    # the slowest round (the fastest is fwd_ms); backward's max is not a difference of rounds
                    "fwd_ms_max": tf_max * 1e3,
                    "fwd_bwd_ms_max": max(times[name + " fwd+bwd"]) / per * 1e3,
                    "fwd_min_bytes": fwd_bytes,
                    "bwd_min_bytes": bwd_bytes,
                    "fwd_gbps": fwd_bytes / tf / 1e9,
                    "bwd_gbps": bwd_bytes / tb / 1e9,
                    "copy_gbps": copy_bw,
                    "copy_gbps_median": copy_bw_median,
                    "fwd_frac_of_copy": fwd_bytes / tf / 1e9 / copy_bw,
                    "bwd_frac_of_copy": bwd_bytes / tb / 1e9 / copy_bw,
                    "fwd_frac_of_copy_median": fwd_bytes / tf_med / 1e9 / copy_bw_median,
                    "bwd_frac_of_copy_median": bwd_bytes / tb_med / 1e9 / copy_bw_median,
                }
            )
    return {
        "config": cfg.__dict__,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_kernel": two_phase_cpu.status(),
        "rows": rows,
    }


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"bench op: B={c['batch_size']}, T={c['seq_len']}, D={c['d_model']}, {c['dtype']}, "
        f"device={c['device']}, {result['threads']} threads, torch {result['torch']}; best of "
        f"{c['repeats']} rounds, each running the copy and every row in turn (medians and the slowest round "
        "in the JSON). "
        f"Minimum bytes: fwd (K+1)BTD, bwd (2K+1)BTD elements. CPU kernel: {result.get('cpu_kernel', '-')}.",
        "",
        "| K | impl | fwd ms | fwd GB/s | fwd / copy | bwd ms | bwd GB/s | bwd / copy | copy GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['K']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_gbps']:.2f} | "
            f"{r['fwd_frac_of_copy']:.0%} | {r['bwd_ms']:.2f} | {r['bwd_gbps']:.2f} | "
            f"{r['bwd_frac_of_copy']:.0%} | {r['copy_gbps']:.2f} |"
        )
    return "\n".join(lines)


@contextmanager
def _without_kernels() -> Iterator[None]:
    """The torch products even where a kernel would run: the documented switches of the Triton kernels and the
    compiled CPU kernel (both read on every call)."""
    before = {name: os.environ.get(name) for name in ("ATTNRES_TRITON", "ATTNRES_CPU_KERNEL")}
    os.environ.update(dict.fromkeys(before, "0"))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``_without_kernels``."""

    def run(*args: Any) -> Any:
        with _without_kernels():
            return fn(*args)

    return run


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
) -> dict[str, float]:
    """Milliseconds per call, Triton vs the torch paths, on a GPU (needs triton; not run by the tests).

    Times the forward, the forward + backward of the op in the residual stream's layout (K sources
    as rows of a [B, T, K+1, D] buffer), Phase 1 for S queries (forward) and the merge. Also
    reports the effective bandwidth of the Triton forward in GB/s (bytes that must move: K sources
    read, h written) and the largest difference between the two forwards.
    """
    import triton.testing

    from attnres.ops.depth_attention.triton import triton_fused_depth_attention
    from attnres.ops.two_phase import fused as two_phase_fused
    from attnres.ops.two_phase import reference as two_phase_reference
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
    opts: dict[str, Any] = dict(kernel=kernel, normalize_keys=normalize_keys)

    def torch_fwd():
        with _without_kernels():
            return fused_depth_attention(segments, producers, query, key_weight, **opts)

    def triton_fwd():
        return triton_fused_depth_attention(segments, producers, query, key_weight, **opts)

    def fwd_bwd(fn):
        def run():
            fn().backward(gh)

        return run

    bench = triton.testing.do_bench
    out: dict[str, float] = {}
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
            with _without_kernels():
                return two_phase_fused.phase1(*phase1_args, kernel=kernel)

        out["phase1_torch_ms"] = bench(phase1_torch, rep=rep_ms)
        out["phase1_triton_ms"] = bench(lambda: two_phase_triton.phase1(*phase1_args, kernel=kernel), rep=rep_ms)
        a = two_phase_triton.phase1(
            buffer[:, :, : K - 1], None if inv is None else inv[:, :, : K - 1], queries, kws, kernel=kernel
        )
        b = two_phase_triton.phase1(
            buffer[:, :, K - 1 : K], None if inv is None else inv[:, :, K - 1 : K], queries, kws, kernel=kernel
        )
        out["merge_torch_ms"] = bench(lambda: two_phase_reference.merge(a, b, kernel), rep=rep_ms)
        out["merge_triton_ms"] = bench(lambda: two_phase_triton.merge(a, b, kernel), rep=rep_ms)
    return out
