"""Which implementation runs each depth-attention op, and why: one table and one function that chooses.

Every op of ``attnres.ops`` that has more than one implementation asks ``choose`` which one runs, for its
forward and for its backward; nothing else in the package decides. The choice depends on the device, the
dtype, the shape (what one Triton program holds), the environment, whether ``torch.compile`` is tracing,
and for a backward on what its forward ran. ``choose`` returns the backend and the reason, ``record``
collects the choices a piece of code makes (which backend ran a failing backward), ``forced`` pins a
backend (the same code through another implementation), and ``attnres doctor`` prints the table for this
machine.

Backends (``BACKENDS``):

- ``reference``: plain autograd over the math as written (``reference.py`` of each op);
- ``torch``: hand-written torch autograd Functions and batched products (``fused.py``);
- ``cpu_kernel``: the C++ Phase-1 kernel (``two_phase/cpu.py``), CPU tensors, eager mode only (the compiler
  cannot trace a ctypes call);
- ``triton``: the Triton kernels, for CUDA float32/bfloat16/float16 tensors (float64 stays with torch, the
  reference precision); tests also run them on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``);
- ``custom_op``: ``attnres::phase1`` (``two_phase/library.py``), one opaque call under ``torch.compile``,
  which runs the ``phase1_op`` choice inside;
- ``pointwise``: ``compiled.phase1_pointwise``, pointwise autograd that inductor fuses and differentiates.

Environment, read on every call: ``ATTNRES_TRITON=0`` turns the Triton kernels off; ``ATTNRES_CPU_KERNEL``
``0`` turns the C++ kernel off, ``1`` makes a kernel that does not build an error (default ``auto``: used
when it builds); ``CXX`` and ``ATTNRES_CACHE_DIR`` say how and where it builds.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnres.ops.common import MAX_BACKWARD_WIDTH, MAX_PADDED_WIDTH, triton_kernels

# Phase 1 over at most this many (source, query) pairs runs as plain pointwise ops (``compiled.phase1_pointwise``)
# that the compiler fuses into the loops around it, on every device (Full AttnRes' in-group reads)
POINTWISE_PAIRS = 4
# devices whose larger Phase 1s run the custom op of ``library.py``: CUDA (the Triton kernels). Not the CPU:
# there the pointwise form, which inductor fuses with the loops around it, beat the opaque op even with the
# compiled C++ kernel inside it (compiled Block 1.180x compiled prenorm with the op against 1.133x pointwise,
# min-max over processes 1.167-1.209 against 1.121-1.158; Full 1.167x against 1.175x; d128 x 8, T128, B8,
# one thread, load ~1; docs/performance.md). Eager mode runs the C++ kernel (``fused.phase1_kernels_for``).
CUSTOM_OP_DEVICES = frozenset({"cuda"})

TRITON_ENV = "ATTNRES_TRITON"
CPU_KERNEL_ENV = "ATTNRES_CPU_KERNEL"
# the variables that change a choice or how a backend builds, as the doctor reports them
ENV_VARIABLES = (TRITON_ENV, CPU_KERNEL_ENV, "TRITON_INTERPRET", "CXX", "ATTNRES_CACHE_DIR")

PHASES = ("forward", "backward")
KERNEL_BACKENDS = ("triton", "cpu_kernel")
# the modules of Triton kernels, imported on first use for CUDA tensors
_TRITON_MODULES = {
    "depth_attention": "attnres.ops.depth_attention.triton",
    "two_phase": "attnres.ops.two_phase.triton",
}


@dataclass(frozen=True)
class Backend:
    """One implementation: its name, what it is, and whether this machine has it."""

    name: str
    summary: str
    check: Callable[[Mapping[str, str] | None], tuple[bool, str]]


@dataclass(frozen=True)
class Op:
    """One op: the function that dispatches it and the backends it chooses from, in the order tried."""

    name: str
    entry: str
    backends: tuple[str, ...]
    summary: str
    triton: str | None = None  # the key of its Triton module in _TRITON_MODULES


@dataclass(slots=True)
class Case:
    """What a choice depends on, besides the environment.

    ``device`` a device type; ``d``/``heads`` the channels and heads of a source; ``queries`` (S) and
    ``sources`` (n) of a Phase 1; ``grad``: a merge whose inputs need a gradient; ``create_graph``: a backward
    run with grad mode on (a graph of the gradient is wanted); ``compiling``: torch.compile is tracing;
    ``values``: the elements of an op whose choice depends on size (rms_norm), 0 where it does not;
    ``reference``: why a depth attention asks for the plain reference (``impl="reference"``, the weights or
    statistics wanted), or ''; ``forward``: for a backward, the backend its forward ran; ``check``: the
    per-call check of a Triton module against the real tensors, ``check(module, require_cuda)`` -> the
    reason they are refused, or None.
    """

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    d: int = 1024
    heads: int = 1
    queries: int = 4
    sources: int = 8
    kernel: str = "softmax"
    key_norm: bool = True
    grad: bool = False
    create_graph: bool = False
    compiling: bool = False
    subclass: str = ""  # the tensor subclass among the inputs (DTensor, ...), whose memory a kernel cannot read
    values: int = 0  # the elements an op runs over where its choice depends on size (rms_norm), else 0
    reference: str = ""
    forward: str | None = None
    check: Callable[[ModuleType, bool], str | None] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def like(cls, x: Tensor, *others: Tensor | None, **fields) -> Case:
        """A case for sources like ``x`` (its device, dtype and last dimension) under the current compile
        state; ``others``: more inputs whose type counts (a tensor subclass among them rules out kernels)."""
        fields.setdefault("compiling", torch.compiler.is_compiling())
        found = [type(t).__name__ for t in (x, *others) if t is not None and type(t) not in (Tensor, nn.Parameter)]
        fields.setdefault("subclass", found[0] if found else "")
        return cls(device=x.device.type, dtype=x.dtype, d=x.shape[-1] if x.dim() else 1, **fields)

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.device} {dtype}" + (" compiling" if self.compiling else "")


class Choice(NamedTuple):
    """The backend that runs ``op``'s ``phase``, why, and the kernel module it runs (None for torch's forms)."""

    op: str
    phase: str
    backend: str
    reason: str
    kernels: ModuleType | None = None


# ----------------------------------------------------------------------------- availability


def _cpu_module() -> ModuleType:
    # imported on first use: two_phase.cpu imports the ops' shape checks, whose package imports this module
    from attnres.ops.two_phase import cpu

    return cpu


def _env(env: Mapping[str, str] | None, name: str, default: str) -> str:
    return (os.environ if env is None else env).get(name, default)


def _always(what: str) -> Callable[[Mapping[str, str] | None], tuple[bool, str]]:
    def check(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
        return True, what

    return check


def _triton_check(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    return triton_status(env)


def cpu_kernel_status(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether the C++ Phase-1 kernel runs here (building it on first use), and why not."""
    if _env(env, CPU_KERNEL_ENV, "auto") == "0":
        return False, f"off ({CPU_KERNEL_ENV}=0)"
    cpu = _cpu_module()
    state = cpu.loaded()
    return state.lib is not None, state.reason


def triton_version() -> str | None:
    """The installed triton's version, found without importing it (importing triton before ``TRITON_INTERPRET``
    is set would keep the interpreter off in a test process), or None."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def interpreted(env: Mapping[str, str] | None = None) -> bool:
    """Whether Triton's interpreter runs the kernels (on CPU tensors; set before triton is imported)."""
    return _env(env, "TRITON_INTERPRET", "0") == "1"


def triton_status(
    env: Mapping[str, str] | None = None, *, load: bool = False, module: str = "two_phase"
) -> tuple[bool, str]:
    """(available, reason): triton installed, not turned off, and (``load``) its kernels import. Without
    ``load`` nothing is imported, and a machine with neither CUDA nor the interpreter has no use for it."""
    if _env(env, TRITON_ENV, "1") == "0":
        return False, f"off ({TRITON_ENV}=0)"
    version = triton_version()
    if version is None:
        return False, "triton is not installed (pip install triton, on a CUDA machine)"
    if load:
        if triton_kernels(_TRITON_MODULES[module]) is None:
            return False, f"triton {version} is installed but {_TRITON_MODULES[module]} does not import"
        return True, f"triton {version}"
    if not (torch.cuda.is_available() or interpreted(env)):
        return (
            False,
            f"triton {version} is installed, but there is no CUDA device (tests run it with TRITON_INTERPRET=1)",
        )
    return True, f"triton {version}" + (" (interpreter)" if interpreted(env) else "")


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "reference", "plain autograd over the math as written (reference.py)", _always("every device and dtype")
        ),
        Backend(
            "torch",
            "hand-written torch autograd Functions and batched products (fused.py)",
            _always("every device and dtype"),
        ),
        Backend("cpu_kernel", "the C++ Phase-1 kernel through ctypes (two_phase/cpu.py), eager CPU", cpu_kernel_status),
        Backend("triton", "Triton kernels, CUDA float32/bfloat16/float16", _triton_check),
        Backend(
            "custom_op",
            "attnres::phase1 custom ops, opaque to torch.compile (two_phase/library.py)",
            _always("registered with torch.library; runs the phase1_op choice inside"),
        ),
        Backend(
            "pointwise",
            "pointwise autograd that inductor fuses (two_phase/compiled.py)",
            _always("plain autograd, every device"),
        ),
    )
}

OPS: dict[str, Op] = {
    o.name: o
    for o in (
        Op(
            "depth_attention",
            "depth_attention.fused.fused_depth_attention, depth_attention",
            ("reference", "triton", "torch"),
            "one sublayer's depth attention over its K sources",
            triton="depth_attention",
        ),
        Op(
            "phase1",
            "two_phase.fused.phase1_outputs",
            ("triton", "cpu_kernel", "torch"),
            "Phase 1 of a depth block on the stream's buffer (eager, and compiled decoding)",
            triton="two_phase",
        ),
        Op(
            "phase1_sources",
            "two_phase.compiled.phase1_sources",
            ("pointwise", "custom_op"),
            "Phase 1 over separate sources, the form torch.compile traces",
        ),
        Op(
            "phase1_op",
            "two_phase.library.phase1_op (attnres::phase1, attnres::phase1_backward)",
            ("triton", "cpu_kernel", "torch"),
            "what runs inside the Phase-1 custom ops",
            triton="two_phase",
        ),
        Op(
            "merge",
            "two_phase.fused.merge",
            ("triton", "reference"),
            "the exact merge of two partial depth attentions",
            triton="two_phase",
        ),
        Op(
            "merge_partial",
            "two_phase.fused.merge_partial",
            ("triton", "cpu_kernel", "torch", "reference"),
            "Phase 2: a sublayer's partial sum merged into its Phase-1 result (and the RMSNorm after it)",
            triton="two_phase",
        ),
        Op(
            "merge_norm",
            "two_phase.fused.merge_norm",
            ("cpu_kernel", "reference"),
            "a read that merges two depth attentions (Full AttnRes inside a group), with the RMSNorm after it",
        ),
        Op(
            "rms_norm",
            "rms_norm.rms_norm",
            ("cpu_kernel", "reference"),
            "a sublayer's pre-norm where no merge fuses it (PreNorm's read, a depth block's first read)",
        ),
        Op(
            "decode_read",
            "residual.depth_streams.DecodeStream (two_phase.cpu.DecodeReader)",
            ("cpu_kernel", "torch"),
            "a read of the buffer at one token per sequence without gradients (KV-cached decoding)",
        ),
        Op("multi_query", "depth_attention.multi_query", ("reference",), "several full-width queries, one pass"),
        Op("token_queries", "token_queries", ("reference",), "two-phase with per-token (low-rank) queries"),
        Op("gated_depth_attention", "gated_depth_attention", ("reference",), "the gated multi-head rival"),
    )
}


def availability(backend: str, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(available, reason) of a backend on this machine, whatever the op."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; use one of {tuple(BACKENDS)}")
    return BACKENDS[backend].check(env)


# ----------------------------------------------------------------------------- recording and forcing

_RECORDERS: list[list[Choice]] = []
_FORCED: list[tuple[str, str | None, str]] = []  # (op, phase or None for both, backend), innermost last


@contextlib.contextmanager
def record() -> Iterator[list[Choice]]:
    """Collect every choice made inside the block (eager calls; a compiled graph decides once, while traced)."""
    found: list[Choice] = []
    _RECORDERS.append(found)
    try:
        yield found
    finally:
        _RECORDERS.remove(found)


@contextlib.contextmanager
def forced(op: str, backend: str, phase: str | None = None) -> Iterator[None]:
    """Run ``op`` (one ``phase``, or both) with ``backend`` inside the block, whatever the device; a kernel
    backend that cannot run the case raises. For debugging and tests: the same call through each backend."""
    _check_op(op, phase)
    if backend not in OPS[op].backends:
        raise ValueError(f"backend={backend!r} is not one of {op}'s backends; use one of {OPS[op].backends}")
    _FORCED.append((op, phase, backend))
    try:
        yield
    finally:
        _FORCED.remove((op, phase, backend))


def _forced(op: str, phase: str) -> str | None:
    for name, wanted, backend in reversed(_FORCED):
        if name == op and wanted in (None, phase):
            return backend
    return None


def _check_op(op: str, phase: str | None) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not known; use one of {tuple(OPS)}")
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase={phase!r} is not known; use one of {PHASES}")


# ----------------------------------------------------------------------------- the choice


def pow2(n: int) -> int:
    """The next power of two (triton.next_power_of_2, without importing triton)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _triton_fits(case: Case, kernels: ModuleType | None, backward: bool) -> str | None:
    """Why one Triton program cannot hold the case (None when it can)."""
    heads, d, s = case.heads, case.d, case.queries
    if backward:
        fits = (
            kernels.backward_fits(heads, d, s) if kernels is not None else _backward_width(case) <= MAX_BACKWARD_WIDTH
        )
        if not fits:
            return (
                f"S={s} queries of D={d} ({heads} heads) are too wide for the backward kernel "
                f"(pow2(S) * padded D = {_backward_width(case)} > {MAX_BACKWARD_WIDTH})"
            )
        return None
    fits = kernels.fits(heads, d) if kernels is not None else pow2(heads) * pow2(d // heads) <= MAX_PADDED_WIDTH
    return None if fits else f"D={d} ({heads} heads) is too wide for one Triton program (at most {MAX_PADDED_WIDTH})"


def _backward_width(case: Case) -> int:
    return pow2(case.queries) * pow2(case.heads) * pow2(case.d // case.heads)


class Offer(NamedTuple):
    """The Triton kernels an op may run for a case: the module (None when not imported), why, and whether
    they are on offer at all (``load=False`` offers without importing)."""

    kernels: ModuleType | None
    reason: str
    offered: bool


def triton_offer(
    op: str, device: str, dtype: torch.dtype, env: Mapping[str, str] | None = None, *, load: bool = True
) -> Offer:
    """The Triton kernels ``op`` may run for tensors on ``device`` (a type) in ``dtype`` before their shape is
    asked: CUDA float32/bfloat16/float16, triton installed and not turned off. Without ``load`` (the doctor's
    rows for a device this machine lacks) nothing is imported."""
    module = OPS[op].triton
    if module is None:
        return Offer(None, f"{op} has no Triton kernels", False)
    if device != "cuda":
        return Offer(None, f"{device} tensors, and the Triton kernels run CUDA tensors", False)
    if dtype == torch.float64:
        return Offer(None, "float64 stays with torch, the reference precision", False)
    if _env(env, TRITON_ENV, "1") == "0":
        return Offer(None, f"turned off by {TRITON_ENV}=0", False)
    if not load:
        version = triton_version()
        if version is None:
            return Offer(None, "triton is not installed", False)
        return Offer(None, f"triton {version} (not imported: no CUDA device here)", True)
    kernels = triton_kernels(_TRITON_MODULES[module])
    if kernels is None:
        return Offer(None, "triton is not installed or its kernels do not import", False)
    return Offer(kernels, f"triton {triton_version()}", True)


_UNSET: object = object()


def choose(
    op: str,
    phase: str = "forward",
    case: Case | None = None,
    *,
    env: Mapping[str, str] | None = None,
    triton: object = _UNSET,
    kernels: ModuleType | None = None,
    load: bool = True,
) -> Choice:
    """The backend that runs ``op``'s ``phase`` for ``case``, and why.

    ``env`` defaults to ``os.environ``. ``triton``: the Triton module a dispatch site offers (its own hook,
    ``two_phase.fused.triton_for``, which tests point at the interpreted kernels), or None; left out, the
    table's ``triton_offer`` decides. ``kernels``: for a backward, the kernel module its forward ran.
    ``load=False`` imports nothing (the doctor's rows for a device this machine lacks).
    Raises RuntimeError where ``ATTNRES_CPU_KERNEL=1`` asks for a C++ kernel that does not build.
    """
    _check_op(op, phase)
    case = case if case is not None else Case()
    pinned = _forced(op, phase)
    if pinned is not None and not case.reference:  # the reference asked for by name is never overridden
        choice = _pinned(op, phase, case, pinned, env, kernels)
    else:
        choice = _RULES[op](op, phase, case, env, triton, kernels, load)
    if _RECORDERS and not torch.compiler.is_compiling():
        for found in _RECORDERS:
            found.append(choice)
    return choice


def _offer(op, case, env, triton, load) -> Offer:
    """The Triton kernels on offer, from the dispatch site's hook or the table."""
    if triton is not _UNSET:
        if triton is not None:
            return Offer(triton, "the kernels the dispatch offers", True)
        found = triton_offer(op, case.device, case.dtype, env, load=load)
        return Offer(None, found.reason if not found.offered else "the dispatch offers no Triton kernels", False)
    return triton_offer(op, case.device, case.dtype, env, load=load)


def _cpu_kernel(case: Case, env: Mapping[str, str] | None, backward: bool = False) -> tuple[ModuleType | None, str]:
    """The C++ kernel module when it runs this case, else None; and why."""
    if case.device != "cpu":
        return None, f"{case.device} tensors, and the C++ kernel runs CPU tensors"
    if case.compiling:
        return None, "torch.compile is tracing, and it cannot trace into a ctypes call"
    if case.subclass:
        return None, f"{case.subclass} inputs, and the C++ kernel reads plain tensors' memory"
    setting = _env(env, CPU_KERNEL_ENV, "auto")
    if setting == "0":
        return None, f"turned off by {CPU_KERNEL_ENV}=0"
    cpu = _cpu_module()
    state = cpu.loaded()
    if state.lib is None:
        if setting == "1":
            raise RuntimeError(f"{CPU_KERNEL_ENV}=1 but the CPU kernel is not available: {state.reason}")
        return None, f"it is not available: {state.reason}"
    fits = cpu.backward_fits(case.heads, case.d, case.queries) if backward else cpu.fits(case.heads, case.d)
    if not fits:
        return None, f"{case.heads} heads do not divide D={case.d}"
    return cpu, "CPU tensors in eager mode, and the C++ kernel is built"


def _phase1_forward(op, case, env, triton, load, backward=False) -> Choice:
    """Phase 1's forward (and the custom op's backward, which chooses the same way with the backward's fit)."""
    phase = "backward" if backward else "forward"
    module, why, offered = _offer(op, case, env, triton, load)
    if offered:
        too_wide = _triton_fits(case, module, backward)
        if too_wide is not None:
            return Choice(op, phase, "torch", too_wide)
        return Choice(op, phase, "triton", f"{case.describe()} tensors that fit one program; {why}", module)
    cpu, cpu_why = _cpu_kernel(case, env, backward)
    if cpu is not None:
        return Choice(op, phase, "cpu_kernel", cpu_why, cpu)
    return Choice(op, phase, "torch", f"no Triton: {why}; no C++ kernel: {cpu_why}")


def _rule_depth_attention(op, phase, case, env, triton, kernels, load) -> Choice:
    if case.reference:
        return Choice(op, phase, "reference", case.reference)
    if phase == "backward":
        # the autograd Function its forward ran writes the backward
        if case.forward == "triton":
            return Choice(op, phase, "triton", "the forward ran the Triton kernels, whose backward kernel follows")
        return Choice(op, phase, "torch", "the forward ran torch's fused Function, whose backward follows")
    module, why, offered = _offer(op, case, env, triton, load)
    if not offered:
        return Choice(op, phase, "torch", f"no Triton: {why}")
    refused = _depth_attention_refused(case, module)
    if refused is not None:
        return Choice(op, phase, "torch", refused)
    return Choice(op, phase, "triton", f"{case.describe()} tensors the kernels cover; {why}", module)


def _depth_attention_refused(case: Case, module: ModuleType | None, require_cuda: bool = True) -> str | None:
    """Why the Triton depth-attention kernels cannot run the case: the real tensors' check where the dispatch
    gives one (``require_cuda``: as the automatic dispatch asks, CUDA and no float64), else the width (the
    doctor's rows)."""
    if module is not None and case.check is not None:
        refused = case.check(module, require_cuda)
        return None if refused is None else f"the Triton kernels do not cover this case: {refused}"
    return _triton_fits(replace(case, queries=1), None, False)


def _rule_phase1(op, phase, case, env, triton, kernels, load) -> Choice:
    if phase == "forward":
        return _phase1_forward(op, case, env, triton, load)
    forward = case.forward if case.forward is not None else _phase1_forward(op, case, env, triton, load).backend
    if forward not in KERNEL_BACKENDS:
        return Choice(op, phase, "torch", "the forward ran torch, which saved the weights")
    if case.create_graph:
        return Choice(op, phase, "torch", "a graph of the gradient is wanted (create_graph): the kernels give none")
    module = kernels if kernels is not None else _module_of(forward, op, case, env, load)
    if forward == "triton":
        too_wide = _triton_fits(case, module, True)
        if too_wide is not None:
            return Choice(op, phase, "torch", f"{too_wide}; the weights are recomputed from the forward's lse")
    elif module is not None and not module.backward_fits(case.heads, case.d, case.queries):
        return Choice(op, phase, "torch", "the C++ kernel's backward does not fit")
    return Choice(op, phase, forward, f"the forward ran {forward}; its backward kernel recomputes the weights", module)


def _module_of(backend: str, op: str, case: Case, env, load: bool) -> ModuleType | None:
    if backend == "cpu_kernel":
        cpu = _cpu_module()
        return cpu
    return triton_offer(op, case.device, case.dtype, env, load=load).kernels


def _rule_phase1_op(op, phase, case, env, triton, kernels, load) -> Choice:
    # forward and backward are two custom ops; each looks for the device's kernels on its own
    return _phase1_forward(op, case, env, triton, load, backward=phase == "backward")


def _rule_phase1_sources(op, phase, case, env, triton, kernels, load) -> Choice:
    pairs = case.sources * case.queries
    if pairs <= POINTWISE_PAIRS:
        return Choice(op, phase, "pointwise", f"{pairs} source-query pairs (at most {POINTWISE_PAIRS})")
    if case.device not in CUSTOM_OP_DEVICES:
        return Choice(
            op, phase, "pointwise", f"{case.device}: pointwise measured faster than the custom op (CUSTOM_OP_DEVICES)"
        )
    return Choice(op, phase, "custom_op", f"{pairs} source-query pairs on {case.device}: attnres::phase1")


def _rule_merge(op, phase, case, env, triton, kernels, load) -> Choice:
    if phase == "backward":
        return Choice(op, phase, "reference", "the Triton merge runs only without gradients; autograd's is elementwise")
    module, why, offered = _offer(op, case, env, triton, load)
    if not offered:
        return Choice(op, phase, "reference", f"no Triton: {why}")
    if case.grad:
        return Choice(op, phase, "reference", "a gradient is wanted and the Triton merge has no backward")
    return Choice(op, phase, "triton", f"{case.describe()} tensors, no gradient wanted; {why}", module)


def _rule_merge_partial(op, phase, case, env=None, triton=_UNSET, kernels=None, load=True) -> Choice:
    if case.heads == 1 and case.kernel == "softmax" and case.key_norm:
        if phase == "backward" and case.forward is not None:
            return Choice(op, phase, case.forward, f"the forward ran {case.forward}, whose Function's backward follows")
        module, why, offered = _offer(op, case, env, triton, load)
        if offered and case.subclass:
            why = f"{case.subclass} inputs, and the Triton kernel reads plain tensors' memory"
        elif offered and case.compiling:
            why = "torch.compile is tracing; inductor fuses the torch form"
        elif offered and module is not None and not module.merge_norm_fits(case.d):
            why = f"D={case.d} is too wide for one program"
        elif offered:
            return Choice(op, phase, "triton", f"one head, softmax, key norm; {why}", module)
        if case.device == "cpu" and case.dtype in (torch.float32, torch.float64):
            module, why = _cpu_kernel(case, env)
            if module is not None:
                return Choice(op, phase, "cpu_kernel", f"one head, softmax, key norm; {why}", module)
        elif case.device == "cpu":
            why = f"{case.describe()} tensors, and the C++ kernel runs float32/float64"
        return Choice(op, phase, "torch", f"one head, softmax, key norm: the lean custom Function (no kernel: {why})")
    return Choice(
        op, phase, "reference", f"{case.heads} heads, {case.kernel}, key norm {case.key_norm}: plain autograd"
    )


def _rule_merge_norm(op, phase, case, env=None, triton=_UNSET, kernels=None, load=True) -> Choice:
    if phase == "backward" and case.forward is not None:
        return Choice(op, phase, case.forward, f"the forward ran {case.forward}, whose Function's backward follows")
    if case.heads != 1 or case.kernel != "softmax":
        return Choice(op, phase, "reference", f"{case.heads} heads, {case.kernel}: plain autograd")
    if case.dtype not in (torch.float32, torch.float64):
        return Choice(op, phase, "reference", f"{case.describe()} tensors, and the C++ kernel runs float32/float64")
    module, why = _cpu_kernel(case, env)
    if module is None:
        return Choice(op, phase, "reference", f"merge, then the norm (no C++ kernel: {why})")
    return Choice(op, phase, "cpu_kernel", f"one head, softmax; {why}", module)


# Below this many elements one torch.nn.functional.rms_norm call (about 9 µs) costs less than a kernel call's
# dispatch (about 20 µs: the choice, the autograd Function, ctypes); measured on this project's CPU machine,
# where they cross near 256 tokens of 256 channels. Decoding (a token per sequence) stays on torch's.
RMS_NORM_MIN_VALUES = 1 << 16


def _rule_rms_norm(op, phase, case, env=None, triton=_UNSET, kernels=None, load=True) -> Choice:
    if phase == "backward" and case.forward is not None:
        return Choice(op, phase, case.forward, f"the forward ran {case.forward}, whose Function's backward follows")
    if case.dtype not in (torch.float32, torch.float64):
        return Choice(op, phase, "reference", f"{case.describe()} tensors, and the C++ kernel runs float32/float64")
    if 0 < case.values < RMS_NORM_MIN_VALUES:
        return Choice(
            op, phase, "reference", f"{case.values} values: below {RMS_NORM_MIN_VALUES} one torch call costs less"
        )
    module, why = _cpu_kernel(case, env)
    if module is None:
        return Choice(op, phase, "reference", f"torch.nn.functional.rms_norm (no C++ kernel: {why})")
    return Choice(op, phase, "cpu_kernel", why, module)


def _rule_decode_read(op, phase, case, env=None, triton=_UNSET, kernels=None, load=True) -> Choice:
    if phase == "backward":
        return Choice(op, phase, "torch", "a decode read runs without gradients; it has no backward")
    if case.dtype not in (torch.float32, torch.float64):
        return Choice(op, phase, "torch", f"{case.describe()} rows, and the C++ kernel reads float32/float64")
    module, why = _cpu_kernel(case, env)
    if module is None:
        return Choice(op, phase, "torch", f"no C++ kernel: {why}")
    return Choice(op, phase, "cpu_kernel", why, module)


def _rule_single(op, phase, case, env, triton, kernels, load) -> Choice:
    return Choice(op, phase, "reference", "plain autograd, the only implementation")


_RULES: dict[str, Callable[..., Choice]] = {
    "depth_attention": _rule_depth_attention,
    "phase1": _rule_phase1,
    "phase1_sources": _rule_phase1_sources,
    "phase1_op": _rule_phase1_op,
    "merge": _rule_merge,
    "merge_partial": _rule_merge_partial,
    "merge_norm": _rule_merge_norm,
    "rms_norm": _rule_rms_norm,
    "decode_read": _rule_decode_read,
    "multi_query": _rule_single,
    "token_queries": _rule_single,
    "gated_depth_attention": _rule_single,
}


def _pinned(op: str, phase: str, case: Case, backend: str, env, kernels) -> Choice:
    """A backend pinned by ``forced``: checked against what the case can run, never silently replaced."""
    reason = "pinned by attnres.ops.backends.forced"
    if phase == "backward" and case.forward is not None and backend in KERNEL_BACKENDS and case.forward != backend:
        raise ValueError(
            f"forced {op} backward={backend!r}, but its forward ran {case.forward!r}; force both phases "
            f"(forced({op!r}, {backend!r}))"
        )
    if (
        op == "merge_partial"
        and backend in ("torch", "cpu_kernel", "triton")
        and _rule_merge_partial(
            op, "forward", replace(case, device="cpu", dtype=torch.float32, compiling=False), env
        ).backend
        not in ("torch", "cpu_kernel")
    ):
        raise ValueError(f"forced {op}={backend!r}, but it covers one head, softmax and key norm only")
    if backend == "triton":
        module = kernels or triton_kernels(_TRITON_MODULES[OPS[op].triton or "two_phase"])
        if module is None:
            raise ValueError(f"forced {op}={backend!r}, but {triton_status(env)[1]}")
        if op == "depth_attention":
            refused = _depth_attention_refused(case, module, False) if phase == "forward" else None
        elif op in ("phase1", "phase1_op"):
            refused = _triton_fits(case, module, phase == "backward")
        else:
            refused = None
        if refused is not None:
            raise ValueError(f"forced {op}={backend!r}, but {refused}")
        return Choice(op, phase, backend, reason, module)
    if backend == "cpu_kernel":
        ok, why = cpu_kernel_status(env)
        if not ok:
            raise ValueError(f"forced {op}={backend!r}, but the C++ kernel is not available: {why}")
        cpu = _cpu_module()
        return Choice(op, phase, backend, reason, cpu)
    return Choice(op, phase, backend, reason)
