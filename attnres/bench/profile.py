"""Where a benchmark's call spends its time, from ``torch.profiler``'s CPU events.

``time_breakdown`` runs a callable (a training step, a prefill) under the profiler and splits
its wall time, using each event's self time so that nothing counts twice, into

- ``matmul_ms``: matrix products and attention, the library kernels (``MATMUL_OPS`` and the
  scaled-dot-product kernels) outside the optimizer, and ``matmul_calls`` of them: the same work
  in every model that adds no matrix product, whatever its residual scheme;
- ``generated_ms``: inductor's compiled graphs' own time, where their loops run
  (``generated_backward_ms`` of it inside the backward graphs, which also recompute what the
  forward did not keep);
- ``kernels_ms``: the depth attention's own kernels where they run as calls of their own: the
  ``attnres::`` custom ops (Phase 1 forward and backward under torch.compile) and the self time of the
  ``attnres.ops`` autograd Functions in eager mode (``ATTNRES_FUNCTIONS``), which is where the compiled
  C++ kernel runs on the CPU (torch ops they call count in their own parts);
- ``optimizer_ms``: everything inside an optimizer's step and zero_grad (Muon's matmuls included);
- ``rest_ms``: the rest of the wall time (eager ops, Python, the profiler's own overhead).

On a CPU whose matmul speed drifts between runs by more than a residual scheme costs, the
ratio at equal matmul time (``ratio_at_equal_matmul``: the baseline's matmul time in place of the
row's own) resolves what the scheme itself adds. CPU only: the CPU profile does not time CUDA
kernels.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping

MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::mv",
        "aten::addmv",
        "aten::dot",
        "mkldnn::_linear_pointwise",
        "mkl::_mkl_linear",
    }
)
PARTS = ("matmul_ms", "generated_ms", "kernels_ms", "optimizer_ms")
# the profiler's names of attnres.ops' autograd Functions, forward and backward
ATTNRES_FUNCTIONS = frozenset(
    name + suffix
    for name in ("_Phase1", "_MergePartial", "_FusedDepthAttention", "_TritonDepthAttention")
    for suffix in ("", "Backward")
)


def _is_matmul(name: str) -> bool:
    return name in MATMUL_OPS or "scaled_dot_product" in name


def _is_generated(name: str) -> bool:
    """Inductor's code: the compiled graph's own time (its loops run inside it; with
    TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 each loop is also an event of its own)."""
    return "CompiledFxGraph" in name or "cpp_fused" in name


def _is_optimizer(name: str) -> bool:
    return name.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))


def _is_compiled_backward(name: str) -> bool:
    return name == "CompiledFunctionBackward"  # AOT autograd's backward node, around the backward graph


def _within(event, test: Callable[[str], bool]) -> bool:
    """Whether the event or one of its enclosing events satisfies ``test(name)``."""
    while event is not None:
        if test(event.name):
            return True
        event = event.cpu_parent
    return False


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2: the profiler's C++ side prints two lines per start and stop
    (``USDT: ... profiler_start``) that would drown the tables. Used around start and stop only."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def time_breakdown(call: Callable[[], object], calls: int = 1) -> dict[str, float]:
    """Run ``call`` ``calls`` times under the profiler; the parts above per call, ``step_ms`` the
    profiled wall time per call (parts and rest add up to it)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _quiet_stderr():
        prof.start()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        wall = time.perf_counter() - t0
    finally:
        with _quiet_stderr():
            prof.stop()
    parts = dict.fromkeys(PARTS, 0.0)
    matmuls, backward = 0, 0.0
    for e in prof.events():
        ms = e.self_cpu_time_total / 1e3
        if _within(e, _is_optimizer):
            parts["optimizer_ms"] += ms
        elif e.name.startswith("attnres::") or e.name in ATTNRES_FUNCTIONS:
            parts["kernels_ms"] += ms
        elif _is_matmul(e.name):
            parts["matmul_ms"] += ms
            matmuls += 1
        elif _is_generated(e.name):
            parts["generated_ms"] += ms
            if _within(e, _is_compiled_backward):
                backward += ms
    out = {k: v / calls for k, v in parts.items()}
    out["step_ms"] = wall * 1e3 / calls
    out["matmul_calls"] = matmuls / calls
    out["generated_backward_ms"] = backward / calls
    return _with_rest(out)


def _with_rest(b: dict[str, float]) -> dict[str, float]:
    b["rest_ms"] = b["step_ms"] - sum(b[k] for k in PARTS)
    return b


def median_breakdown(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each field's median over rounds; the rest recomputed from them, so that the parts add up."""
    return _with_rest({k: statistics.median(s[k] for s in samples) for k in samples[0]})


def ratio_at_equal_matmul(row: dict[str, float], base: dict[str, float]) -> float | None:
    """The row's profiled time with the baseline's matmul time in place of its own, over the
    baseline's; None when the two make different matmul calls (then their matmul work differs)."""
    if row["matmul_calls"] != base["matmul_calls"]:
        return None
    # 1 + the difference of the non-matmul times: exactly 1 for the baseline against itself
    return 1.0 + ((row["step_ms"] - row["matmul_ms"]) - (base["step_ms"] - base["matmul_ms"])) / base["step_ms"]


def round_robin_breakdowns(
    calls: Mapping[str, Callable[[], object]], rounds: int, per_round: int, device: str, desc: str
) -> dict[str, dict[str, float]]:
    """Each callable's median breakdown over ``rounds`` rounds that each run every callable
    ``per_round`` times in turn (so drifts of the machine hit all alike); {} with no rounds or off
    the CPU, whose profile does not time CUDA kernels."""
    from attnres.train.progress import progress_bar

    if torch_device_type(device) != "cpu" or not rounds:
        return {}
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in calls}
    for _ in progress_bar(range(rounds), desc=desc, unit="round"):
        for v, call in calls.items():
            samples[v].append(time_breakdown(call, per_round))
    return {v: median_breakdown(s) for v, s in samples.items()}


def compared(breakdowns: dict[str, dict[str, float]], baseline: Callable[[str], str]) -> dict[str, dict[str, float]]:
    """Each row's breakdown with ``ratio_at_equal_matmul`` to its baseline row added where it applies."""
    out = {}
    for v, b in breakdowns.items():
        equal = ratio_at_equal_matmul(b, breakdowns[baseline(v)])
        out[v] = {**b, **({"ratio_at_equal_matmul": equal} if equal is not None else {})}
    return out


def torch_device_type(device: str) -> str:
    import torch

    return torch.device(device).type


def check_rounds(value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"profile_rounds={value!r} is invalid: use an integer >= 0 (0: no time breakdown)")


def breakdown_table(rows: dict[str, dict], key: str, what: str, rounds: int, calls: int) -> list[str]:
    """Markdown lines of the rows' breakdowns under ``key`` (nothing if no row has one)."""
    rows = {v: r[key] for v, r in rows.items() if key in r}
    if not rows:
        return []
    lines = [
        "",
        f"Where a {what} goes (torch.profiler, median of {rounds} round-robin rounds of {calls} {what}s; "
        f"ms per {what}):",
        "",
        f"| variant | profiled {what} | matmul & attention | matmul calls | generated code | of it in backward | "
        "AttnRes ops | optimizer | rest | vs prenorm at equal matmul time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, b in rows.items():
        equal = (
            f"{b['ratio_at_equal_matmul']:.3f}" if b.get("ratio_at_equal_matmul") is not None else "- (other matmuls)"
        )
        lines.append(
            f"| {v} | {b['step_ms']:.1f} | {b['matmul_ms']:.1f} | {b['matmul_calls']:.0f} | "
            f"{b['generated_ms']:.1f} | {b['generated_backward_ms']:.1f} | {b.get('kernels_ms', 0.0):.1f} | "
            f"{b['optimizer_ms']:.1f} | "
            f"{b['rest_ms']:.1f} | {equal} |"
        )
    lines += [
        "",
        "matmul & attention: library matrix products and attention kernels outside the optimizer; "
        "generated code: inductor's compiled graphs; AttnRes ops: the attnres:: custom ops (Phase 1 and its "
        "backward as one call each) and the self time of attnres.ops' autograd Functions (where the CPU kernel "
        "runs); rest: eager ops, Python and the profiler. 'At equal "
        f"matmul time': the profiled {what} with the baseline's matmul time in place of its own, over the "
        "baseline's, for rows making the same matmul calls as their baseline.",
    ]
    return lines
