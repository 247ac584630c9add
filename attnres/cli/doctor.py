"""attnres doctor: this machine, and which implementation runs each depth-attention op here, and why."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from typing import Any

from attnres.cli.options import CLIError, examples


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="this machine and which implementation runs each op, and why",
        description=(
            "Print torch, the devices, the C++ compiler and the CPU kernel, triton, CUDA and the environment "
            "variables in effect, then for every depth-attention op, forward and backward, the backend that "
            "runs here (float32 on the CPU; bfloat16 on CUDA where the op has Triton kernels) and why "
            "(the table of attnres.ops.backends). The first run builds the C++ kernel (a few seconds)."
        ),
        epilog=examples("attnres doctor", "attnres doctor --json", "attnres doctor --width 4096 --heads 8"),
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--width", type=int, default=1024, help="channels D of a source")
    p.add_argument("--heads", type=int, default=1, help="heads of a query (they divide --width)")
    p.add_argument("--queries", type=int, default=4, help="queries S of a Phase 1 (sublayers of a depth block)")
    p.add_argument("--sources", type=int, default=8, help="sources n a Phase 1 reads (completed depth blocks)")
    p.set_defaults(func=run)


def _check(args) -> None:
    for name in ("width", "heads", "queries", "sources"):
        value = getattr(args, name)
        if value < 1:
            raise CLIError(f"--{name} {value}: must be a positive whole number, e.g. --{name} 4")
    if args.width % args.heads:
        raise CLIError(f"--heads {args.heads} does not divide --width {args.width}; pick a divisor of the width")


def machine() -> dict[str, Any]:
    """torch, devices, compiler, CPU kernel, triton, CUDA and the environment, as the doctor reports them."""
    import torch

    from attnres.ops import backends

    compiler = os.environ.get("CXX", "c++")
    cuda = torch.cuda.is_available()
    triton_ok, triton_why = backends.triton_status(load=False)
    kernel_ok, kernel_why = backends.cpu_kernel_status()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "devices": ["cpu"] + [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())],
        "cpu_threads": torch.get_num_threads(),
        "cuda": {"available": cuda, "version": torch.version.cuda},
        "cxx": {"compiler": compiler, "path": shutil.which(compiler)},
        "cpu_kernel": {"available": kernel_ok, "reason": kernel_why},
        "triton": {"version": backends.triton_version(), "usable": triton_ok, "reason": triton_why},
        "env": {name: os.environ.get(name) for name in backends.ENV_VARIABLES},
    }


def _cases(args) -> list[tuple[str, str, Any]]:
    """(op, label, case) rows: float32 on the CPU for every op; bfloat16 on CUDA where the device matters."""
    import torch

    from attnres.ops import backends

    shape = dict(d=args.width, heads=args.heads, queries=args.queries, sources=args.sources)
    cpu = backends.Case(**shape)
    gpu = backends.Case(device="cuda", dtype=torch.bfloat16, **shape)
    rows: list[tuple[str, str, Any]] = []
    for name, op in backends.OPS.items():
        rows.append((name, "", cpu))
        if name == "phase1":
            rows.append((name, "", backends.Case(compiling=True, **shape)))
        if op.triton is not None or name == "phase1_sources":
            rows.append((name, "", gpu))
        if name == "merge":
            rows.append(
                (name, "with gradients", backends.Case(device="cuda", dtype=torch.bfloat16, grad=True, **shape))
            )
    return rows


def choices(args) -> list[dict[str, Any]]:
    """Every op, phase and case of the doctor's table: the backend that runs and why."""
    import dataclasses

    import torch

    from attnres.ops import backends

    cuda = torch.cuda.is_available()
    found = []
    for name, note, case in _cases(args):
        load = case.device != "cuda" or cuda  # no import of triton for a device this machine lacks
        forward = None
        for phase in backends.PHASES:
            if phase == "backward":
                case = dataclasses.replace(case, forward=forward)
            try:
                choice = backends.choose(name, phase, case, load=load)
                backend, reason = choice.backend, choice.reason
            except RuntimeError as err:  # ATTNRES_CPU_KERNEL=1 and no kernel: what the op would raise
                backend, reason = "error", str(err)
            forward = forward or backend
            found.append(
                {
                    "op": name,
                    "phase": phase,
                    "device": case.device,
                    "dtype": str(case.dtype).removeprefix("torch."),
                    "compiling": case.compiling,
                    "note": note,
                    "backend": backend,
                    "reason": reason,
                }
            )
    return found


def report(args) -> dict[str, Any]:
    from attnres.ops import backends

    return {
        "machine": machine(),
        "shape": {"width": args.width, "heads": args.heads, "queries": args.queries, "sources": args.sources},
        "backends": {
            name: dict(zip(("available", "reason"), backends.availability(name), strict=True))
            for name in backends.BACKENDS
        },
        "ops": {name: {"entry": op.entry, "backends": list(op.backends)} for name, op in backends.OPS.items()},
        "choices": choices(args),
    }


def _text(found: dict[str, Any]) -> str:
    m = found["machine"]
    env = ", ".join(f"{k}={v}" for k, v in m["env"].items() if v is not None) or "none set"
    cxx = m["cxx"]
    lines = [
        f"python      {m['python']} on {m['platform']}",
        f"torch       {m['torch']}",
        f"devices     {'; '.join(m['devices'])} ({m['cpu_threads']} CPU threads)",
        f"CUDA        {'available, CUDA ' + str(m['cuda']['version']) if m['cuda']['available'] else 'not available'}",
        f"C++         {cxx['path'] or 'not found'} ({'CXX=' + cxx['compiler'] if 'CXX' in os.environ else 'c++'})",
        f"CPU kernel  {'on' if m['cpu_kernel']['available'] else 'off'}: {m['cpu_kernel']['reason']}",
        f"Triton      {'usable' if m['triton']['usable'] else 'not usable'}: {m['triton']['reason']}",
        f"env         {env}",
        "",
        "backends",
    ]
    for name, (ok, why) in ((n, (b["available"], b["reason"])) for n, b in found["backends"].items()):
        lines.append(f"  {name:<10} {'yes' if ok else 'no ':<4} {why}")
    s = found["shape"]
    lines += [
        "",
        f"choices (D={s['width']}, {s['heads']} head(s), S={s['queries']} queries, n={s['sources']} sources)",
    ]
    rows = [("op", "phase", "case", "backend", "why")]
    for c in found["choices"]:
        case = (
            f"{c['device']} {c['dtype']}"
            + (" compiling" if c["compiling"] else "")
            + (f" {c['note']}" if c["note"] else "")
        )
        rows.append((c["op"], c["phase"], case, c["backend"], c["reason"]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append("  " + "  ".join(f"{r[i]:<{widths[i]}}" for i in range(4)) + "  " + r[4])
    return "\n".join(lines)


def run(args) -> int:
    _check(args)
    found = report(args)
    if args.json:
        json.dump(found, sys.stdout, indent=2)
        print()
    else:
        print(_text(found))
    return 0
