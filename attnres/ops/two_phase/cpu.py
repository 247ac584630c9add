"""Two-phase depth attention on the CPU as a compiled C++ kernel (``cpu_kernel.cpp``), with the torch
formulation as fallback: Phase 1, the Phase-2 merge fused with the next RMSNorm (``merge_norm``), and that
RMSNorm alone (``rms_norm``, so PreNorm's reads run the same code).

``phase1`` and ``phase1_backward`` have the contract of ``fused.phase1_forward`` / ``fused.phase1_backward``
over a [B, T, n, D] stack or a list of n [B, T, D] sources, in float32 and float64 (the compute dtypes of the
CPU; other dtypes are cast). Per token the kernel keeps the n source rows, the S outputs and the S x H
statistics in cache, so a source row is read from memory once per direction and its gradient written once;
torch's form runs [B*T]-batched n x D by D x S products and materialises every [B*T, n, S, H] intermediate.

Building: nothing is compiled at install time. The first call compiles the kernel with the machine's C++
compiler (``$CXX``, else ``c++``; no torch headers, about a second) into the cache directory
(``$ATTNRES_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnres``, else ``~/.cache/attnres``), keyed by the source,
the flags and the CPU, written atomically so concurrent processes share it. Without a compiler, or when the
build fails, ``kernel()`` is None, ``status()`` says why, and callers keep the torch formulation
(``attnres.ops.backends`` decides which runs).
``ATTNRES_CPU_KERNEL=0`` turns the kernel off (read on every call, so tests run both ways); ``=1`` makes a
failed build an error instead of a fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from attnres.ops.common import DepthStats, compute_dtype, flat_rows, rows_of
from attnres.ops.two_phase.reference import check_queries, query_matrix

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wno-psabi")
NATIVE = ("-march=native",)  # dropped when the compiler refuses it
ABI = 4
# below this many source values per call one thread does the work: starting threads costs more
PARALLEL_MIN_VALUES = 1 << 16
ENV = "ATTNRES_CPU_KERNEL"


@dataclass
class _Loaded:
    lib: ctypes.CDLL | None
    reason: str


_STATE: dict[str, _Loaded] = {}


def _cache_dir() -> Path:
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnres"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, out: Path) -> str:
    """Build the shared library at ``out`` (atomically); '' or the compiler's complaint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = ""
    for extra in (NATIVE, ()):
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        cmd = [compiler, *FLAGS, *extra, str(SOURCE), "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            proc = None
            errors = str(err)
        if proc is not None and proc.returncode == 0:
            os.replace(tmp, out)
            return ""
        Path(tmp).unlink(missing_ok=True)
        if proc is not None:
            errors = (proc.stderr or proc.stdout).strip()[-600:]
    return errors or "the compiler failed"


def _load() -> _Loaded:
    compiler = os.environ.get("CXX", "c++")
    path = shutil.which(compiler)
    if path is None:
        return _Loaded(None, f"no C++ compiler ({compiler!r} is not on PATH; set CXX to one)")
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (SOURCE.read_text(), path, *FLAGS, *NATIVE, platform.machine(), _cpu_model()))
    ).hexdigest()[:16]
    lib_path = _cache_dir() / f"phase1-{key}.so"
    if not lib_path.exists():
        try:
            complaint = _compile(path, lib_path)
        except OSError as err:
            complaint = f"cannot write {lib_path.parent}: {err} (set ATTNRES_CACHE_DIR to a writable folder)"
        if complaint:
            return _Loaded(None, f"building {SOURCE.name} with {path} failed: {complaint}")
    try:
        lib = ctypes.CDLL(str(lib_path))
        if lib.attnres_phase1_abi() != ABI:
            return _Loaded(None, f"{lib_path} has another ABI; delete it to rebuild")
    except (OSError, AttributeError) as err:
        return _Loaded(None, f"loading {lib_path} failed: {err}")
    return _Loaded(lib, f"compiled kernel {lib_path}")


def loaded() -> _Loaded:
    """The kernel library and what became of its build (on the first call), whatever ``ATTNRES_CPU_KERNEL`` says."""
    if "lib" not in _STATE:
        _STATE["lib"] = _load()
    return _STATE["lib"]


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (turned off by ``ATTNRES_CPU_KERNEL=0``, or it cannot build)."""
    setting = os.environ.get(ENV, "auto")
    if setting == "0":
        return None
    state = loaded()
    if state.lib is None and setting == "1":
        raise RuntimeError(f"{ENV}=1 but the CPU kernel is not available: {state.reason}")
    return state.lib


def status() -> str:
    """One line: whether the compiled CPU kernel runs, and why not."""
    if os.environ.get(ENV, "auto") == "0":
        return f"off ({ENV}=0)"
    state = loaded()
    return ("on: " if state.lib is not None else "off: ") + state.reason


def _pointers(rows: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(rows))(*[r.data_ptr() for r in rows])


def _per_source(x: Tensor) -> tuple[list[Tensor], int]:
    """x [B, T, n] or [B, T, n, D]: its n per-source views [B, T(, D)] and the stride between tokens, read in
    place when B and T flatten with one stride (and D is contiguous), else from a contiguous copy."""
    b, t = x.shape[:2]
    if (x.dim() == 4 and x.stride(3) != 1) or (b > 1 and x.stride(0) != t * x.stride(1)):
        x = x.contiguous()
    return list(x.unbind(2)), x.stride(1) if t > 1 else x.stride(0)


def _rows(sources: Tensor | Sequence[Tensor], dtype: torch.dtype) -> tuple[list[Tensor], int]:
    """The n sources (a [B, T, n, D] stack or n tensors [B, T, D]) as rows ``stride`` elements apart per token."""
    if isinstance(sources, Tensor):
        return _per_source(sources.to(dtype))
    rows = [s.to(dtype).contiguous() for s in sources]
    return rows, rows[0].shape[-1]


def _norms(inv_rms: Tensor | Sequence[Tensor] | None, dtype: torch.dtype) -> tuple[list[Tensor], int]:
    """The n inverse RMS ([B, T, n] or n tensors [B, T]) likewise; ([], 0) without key norm."""
    if inv_rms is None or (not isinstance(inv_rms, Tensor) and not inv_rms):
        return [], 0
    if isinstance(inv_rms, Tensor):
        return _per_source(inv_rms.to(dtype))
    return [s.to(dtype).contiguous() for s in inv_rms], 1


def _threads(values: int) -> int:
    return torch.get_num_threads() if values >= PARALLEL_MIN_VALUES else 1


def fits(heads: int, d: int) -> bool:
    """Any width runs (the Triton kernels' question, asked of every kernel set)."""
    return d % heads == 0


def backward_fits(heads: int, d: int, s_count: int) -> bool:
    """Any width and number of queries runs the backward too."""
    return d % heads == 0


def _call(name: str, dtype: torch.dtype, *args: object) -> None:
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"the compiled CPU Phase-1 kernel is not available: {status()}")
    getattr(lib, f"attnres_phase1_{name}_{'f64' if dtype == torch.float64 else 'f32'}")(*args)


def _pointer(t: Tensor | None) -> ctypes.c_void_p | None:
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def _operands(sources, inv_rms, queries, key_weights):
    first = sources if isinstance(sources, Tensor) else sources[0]
    if first.device.type != "cpu":
        raise ValueError(f"the CPU Phase-1 kernel got {first.device} tensors; it runs CPU tensors only")
    cd = compute_dtype(first.dtype)
    rows, stride = _rows(sources, cd)
    norms, norm_stride = _norms(inv_rms, cd)
    b, t, d = rows[0].shape
    heads = check_queries(queries, key_weights, d)
    u = query_matrix(queries, key_weights, cd).detach().contiguous()
    n, s_count = len(rows), u.shape[0]
    common = (
        _pointers(rows),
        ctypes.c_int64(stride),
        _pointers(norms) if norms else None,
        ctypes.c_int64(norm_stride),
        _pointer(u),
        ctypes.c_int64(b * t),
        ctypes.c_int64(n),
        ctypes.c_int64(s_count),
        ctypes.c_int64(heads),
        ctypes.c_int64(d),
    )
    # rows, norms and u must outlive the call: they are returned with the pointers to them
    return cd, (b, t, n, d, s_count, heads), common, (rows, norms, u)


def phase1(
    values: Tensor | Sequence[Tensor],
    inv_rms: Tensor | Sequence[Tensor] | None,
    queries: Tensor,
    key_weights: Tensor | None = None,
    *,
    kernel: str = "softmax",
) -> DepthStats:
    """Phase 1 in one call; the arguments and result of ``reference.phase1``, in the compute dtype.

    values: a [B, T, n, D] stack (a buffer view is read in place when B and T flatten with one stride) or n
    tensors [B, T, D]; inv_rms: [B, T, n], n tensors [B, T], or None (no key norm)."""
    cd, (b, t, n, d, s_count, heads), common, _alive = _operands(values, inv_rms, queries, key_weights)
    h = torch.empty(b, t, s_count, d, dtype=cd)
    lse = torch.empty(b, t, s_count, heads, dtype=cd)
    threads = ctypes.c_int(_threads(b * t * n * d))
    _call("forward", cd, *common, ctypes.c_int(kernel == "softmax"), _pointer(h), _pointer(lse), threads)
    return DepthStats(h, lse)


def phase1_backward(
    values: Tensor | Sequence[Tensor],
    inv_rms: Tensor | Sequence[Tensor] | None,
    queries: Tensor,
    key_weights: Tensor | None,
    lse: Tensor,
    grad_h: Tensor,
    grad_lse: Tensor | None,
    *,
    kernel: str = "softmax",
    needs_du: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """(dL/dvalues [B, T, n, D], dL/du [S, D] for u = queries * key_weights, or None without ``needs_du``)
    in the compute dtype, the key-norm term taken through the values as ``fused.phase1_backward`` does.
    lse [B, T, S, H] is the forward's; grad_h [B, T, S, D]; grad_lse [B, T, S, H] or None."""
    cd, (b, t, n, d, s_count, _), common, _alive = _operands(values, inv_rms, queries, key_weights)
    lse_c = lse.detach().to(cd).contiguous()
    gh = grad_h.detach().to(cd).contiguous()
    g_lse = grad_lse.detach().to(cd).contiguous() if grad_lse is not None else None
    gv = torch.empty(b, t, n, d, dtype=cd)
    du = torch.empty(s_count, d, dtype=cd) if needs_du else None
    threads = ctypes.c_int(_threads(b * t * n * d))
    softmax = ctypes.c_int(kernel == "softmax")
    outputs = (_pointer(gv), _pointer(du))
    _call("backward", cd, *common, softmax, _pointer(lse_c), _pointer(gh), _pointer(g_lse), *outputs, threads)
    return gv, du


_DECODE_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    + [ctypes.c_int64] * 3
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_int64, ctypes.c_void_p]
    + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
)


def _decode_function(dtype: torch.dtype):
    """The kernel's decode entry for ``dtype``, its argument types declared (ctypes then converts plain ints)."""
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"the compiled CPU kernel is not available: {status()}")
    fn = getattr(lib, f"attnres_decode_read_{'f64' if dtype == torch.float64 else 'f32'}")
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _DECODE_ARGTYPES, None
    return fn


class DecodeReader:
    """Reads of a decoding buffer, one token per sequence without gradients, each one kernel call.

    ``rows`` [B, K, D] and ``inv_rms`` [B, K] (or None: no key norm) are two-phase's buffer and inverse RMS
    at T = 1, float32 or float64 CPU tensors with contiguous rows; their pointers and strides are bound once.
    ``read(m, u)`` attends over the first m rows with u [D] (query * key weight, ``heads`` heads) and returns
    the weighted sum [B, 1, D]; ``store=v`` first writes v [B, 1, D] as row m - 1 (and its inverse RMS).
    ``store(row, v)`` only writes. The math is ``DecodeStream``'s torch form, which tests compare it with."""

    def __init__(self, rows: Tensor, inv_rms: Tensor | None, heads: int, kernel: str, eps: float):
        if rows.device.type != "cpu" or rows.dtype not in (torch.float32, torch.float64) or rows.stride(-1) != 1:
            raise ValueError(
                f"the CPU decode kernel reads float32/float64 CPU rows with contiguous channels; got {rows.dtype} "
                f"on {rows.device} with strides {rows.stride()}"
            )
        if inv_rms is not None and inv_rms.dtype != rows.dtype:
            raise ValueError(f"inv_rms is {inv_rms.dtype} and the rows {rows.dtype}: they must match")
        b, _, d = rows.shape
        self.rows, self.inv_rms, self.dtype = rows, inv_rms, rows.dtype
        self._fn = _decode_function(rows.dtype)
        self._bound = (
            rows.data_ptr(),
            rows.stride(0),
            rows.stride(1),
            inv_rms.data_ptr() if inv_rms is not None else None,
            inv_rms.stride(0) if inv_rms is not None else 0,
            inv_rms.stride(1) if inv_rms is not None else 0,
            b,
            heads,
            d,
        )
        self.shape, self.eps, self.softmax = (b, 1, d), eps, int(kernel == "softmax")

    def read(self, m: int, u: Tensor, store: Tensor | None = None) -> Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        if u.dtype != self.dtype or u.numel() != self.shape[2] or not u.is_contiguous():
            raise ValueError(
                f"u must be {self.shape[2]} contiguous {self.dtype} values; got {tuple(u.shape)} {u.dtype}"
            )
        stored: tuple[int | None, int, int] = (None, 0, 0)
        if store is not None:
            store = self._row(store)  # held until the call returns
            stored = (store.data_ptr(), store.stride(0), m - 1)
        self._fn(*self._bound, *stored, self.eps, m, u.data_ptr(), self.softmax, out.data_ptr(), out.stride(0))
        return out

    def store(self, row: int, v: Tensor) -> None:
        v = self._row(v)
        self._fn(*self._bound, v.data_ptr(), v.stride(0), row, self.eps, 0, None, self.softmax, None, 0)

    def _row(self, v: Tensor) -> Tensor:
        """v [B, 1, D] in the rows' dtype with contiguous channels (a copy where it is not)."""
        if v.shape != self.shape:
            raise ValueError(f"the CPU decode kernel stores rows of shape {self.shape}; got {tuple(v.shape)}")
        return v if v.dtype == self.dtype and v.stride(-1) == 1 else v.to(self.dtype).contiguous()


_MERGE_SCALARS = 4  # per token, what the merge's forward keeps for its backward: s, r, w, rho


def _merge_function(name: str, dtype: torch.dtype):
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"the compiled CPU kernel is not available: {status()}")
    return getattr(lib, f"attnres_merge_norm_{name}_{'f64' if dtype == torch.float64 else 'f32'}")


def _merge_operands(h1: Tensor, lse: Tensor | None, partial: Tensor, u: Tensor | None, weight: Tensor | None, cd):
    """The merge's inputs: h1 with its row stride, the rest contiguous ``cd`` tensors [N, D] / [N] / [D]."""
    d = partial.shape[-1]
    rows, stride = rows_of(h1, cd)
    return (rows, stride), flat_rows(lse, cd), flat_rows(partial, cd, d), flat_rows(u, cd), flat_rows(weight, cd)


def merge_norm(
    h1: Tensor,
    lse: Tensor,
    partial: Tensor,
    u: Tensor | None,
    key_eps: float,
    weight: Tensor | None = None,
    norm_eps: float | None = None,
    lse2: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Phase 2 (one head, softmax, key norm) and, with ``norm_eps``, the RMSNorm after it, in one call.

    h1 [B, T, D] and lse [B, T] (or [B, T, 1]) are the Phase-1 result, ``partial`` [B, T, D] the partial sum,
    u [D] the query times the key-norm weight. Returns (out [B, T, D] in the compute dtype: h, or
    RMSNorm(h) * weight when ``norm_eps`` is given; the [B*T, 4] scalars ``merge_norm_backward`` needs).

    With ``lse2`` [B, T], ``partial`` is another depth attention's result with that log-sum-exp (the sources
    completed inside a Full AttnRes group): the merge is ``reference.merge``'s, and u and key_eps are unused."""
    cd = compute_dtype(partial.dtype)
    (h1_rows, h1_stride), lse_c, p, u_c, w_c = _merge_operands(h1, lse, partial, u, weight, cd)
    lse2_c = flat_rows(lse2, cd)  # held here: the kernel reads it after this line
    n, d = p.shape
    out = torch.empty(n, d, dtype=cd)
    saved = torch.empty(n, _MERGE_SCALARS, dtype=cd)
    norm = norm_eps is not None
    _merge_function("forward", cd)(
        _pointer(h1_rows),
        ctypes.c_int64(h1_stride),
        *[_pointer(t) for t in (lse_c, p, lse2_c, u_c, w_c)],
        ctypes.c_int64(n),
        ctypes.c_int64(d),
        ctypes.c_double(key_eps),
        ctypes.c_double(norm_eps if norm_eps is not None else 0.0),
        ctypes.c_int(norm),
        _pointer(out),
        _pointer(saved),
        ctypes.c_int(_threads(n * d)),
    )
    return out.view(partial.shape), saved


def merge_norm_backward(
    h1: Tensor,
    partial: Tensor,
    u: Tensor | None,
    key_eps: float,
    weight: Tensor | None,
    norm_eps: float | None,
    saved: Tensor,
    grad_out: Tensor,
    lse2: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """(dh1, dlse [B, T], dpartial, du [D], dweight [D] or None) for ``merge_norm``'s output gradient, in the
    compute dtype; ``saved`` is its second result. With ``lse2`` (as in ``merge_norm``) du is zero and
    dlse2 = -dlse."""
    cd = compute_dtype(partial.dtype)
    (h1_rows, h1_stride), _, p, u_c, w_c = _merge_operands(h1, None, partial, u, weight, cd)
    lse2_c = flat_rows(lse2, cd)
    n, d = p.shape
    gx = grad_out.detach().to(cd).reshape(n, d).contiguous()
    gh1, gp = torch.empty(n, d, dtype=cd), torch.empty(n, d, dtype=cd)
    glse, du = torch.empty(n, dtype=cd), torch.empty(d, dtype=cd)
    norm = norm_eps is not None
    dw = torch.empty(d, dtype=cd) if norm and weight is not None else None
    _merge_function("backward", cd)(
        _pointer(h1_rows),
        ctypes.c_int64(h1_stride),
        None,
        _pointer(p),
        _pointer(lse2_c),  # only whether it is there: the backward reads w from saved
        _pointer(u_c),
        _pointer(w_c),
        ctypes.c_int64(n),
        ctypes.c_int64(d),
        ctypes.c_double(key_eps),
        ctypes.c_double(norm_eps if norm_eps is not None else 0.0),
        ctypes.c_int(norm),
        _pointer(gx),
        _pointer(saved),
        _pointer(gh1),
        _pointer(gp),
        _pointer(glse),
        _pointer(du),
        _pointer(dw),
        ctypes.c_int(_threads(n * d)),
    )
    shape = partial.shape
    return gh1.view(shape), glse.view(shape[:-1]), gp.view(shape), du, dw


def _norm_function(name: str, dtype: torch.dtype):
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"the compiled CPU kernel is not available: {status()}")
    return getattr(lib, f"attnres_rms_norm_{name}_{'f64' if dtype == torch.float64 else 'f32'}")


def rms_norm(h: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(h) * weight [..., D] in the compute dtype, the per-token 1 / rms [N] its backward needs), the
    math of ``torch.nn.functional.rms_norm`` over the last dimension."""
    cd = compute_dtype(h.dtype)
    d = h.shape[-1]
    (x, stride), w = rows_of(h, cd), flat_rows(weight, cd)
    n = h.numel() // d
    out, rho = torch.empty(n, d, dtype=cd), torch.empty(n, dtype=cd)
    _norm_function("forward", cd)(
        _pointer(x),
        ctypes.c_int64(stride),
        _pointer(w),
        ctypes.c_int64(n),
        ctypes.c_int64(d),
        ctypes.c_double(eps),
        _pointer(out),
        _pointer(rho),
        ctypes.c_int(_threads(n * d)),
    )
    return out.view(h.shape), rho


def rms_norm_backward(h: Tensor, weight: Tensor | None, rho: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor | None]:
    """(dh, dweight or None) for ``rms_norm``'s output gradient, in the compute dtype."""
    cd = compute_dtype(h.dtype)
    d = h.shape[-1]
    (x, stride), w, gx = rows_of(h, cd), flat_rows(weight, cd), flat_rows(grad_out, cd, d)
    n = h.numel() // d
    gh = torch.empty(n, d, dtype=cd)
    dw = torch.empty(d, dtype=cd) if weight is not None else None
    _norm_function("backward", cd)(
        _pointer(x),
        ctypes.c_int64(stride),
        _pointer(w),
        ctypes.c_int64(n),
        ctypes.c_int64(d),
        _pointer(gx),
        _pointer(rho),
        _pointer(gh),
        _pointer(dw),
        ctypes.c_int(_threads(n * d)),
    )
    return gh.view(h.shape), dw
