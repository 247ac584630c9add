"""Depth attention as Triton kernels (docs/method.md §3): forward and backward, for CUDA.

The math is the same as ``reference.py`` and ``fused.py`` (read those first); this file only changes how the
work is laid out on a GPU. For one token
and sources v_0 … v_{K-1} (keys equal values), a query q and key-norm weight g:

    u   = q * g                                  (q alone without key norm)
    r_i = rsqrt(mean(v_i^2) + eps)
    s_i = v_i · u       (per head: the channel group of that head)
    z_i = r_i s_i       (s_i without key norm)
    a_i = softmax_i(z) or sigmoid(z_i)
    h   = sum_i a_i v_i

Kernels (each program owns a tile of BLOCK_T tokens and the whole channel
vector, laid out as [BLOCK_T, BLOCK_H, BLOCK_DH] so that heads and channel
counts that are not powers of two are masked):

- forward: one pass over the sources with an online softmax (running max and
  normaliser, as in flash attention). It writes h and one number per token and
  head, the log-sum-exp ``lse`` of the logits; nothing of size K is saved.
- backward: one pass over the sources again. It recomputes r_i, s_i, z_i and
  a_i = exp(z_i - lse) and uses ``delta = sum_i a_i (gh · v_i) = gh · h``
  (the output h is saved by autograd anyway), so every source gradient can be
  written as soon as its source is read. For bfloat16/float16 outputs gh · h
  would use an h rounded to 16 bits and cancel badly against gh · v_i (errors
  of a few percent in the gradients), so there delta is summed exactly in a
  first pass over the sources (the backward then reads them twice):

      ga_i = gh · v_i
      gz_i = a_i (ga_i - delta)           (softmax)   or  ga_i a_i (1 - a_i)  (sigmoid)
      gs_i = gz_i r_i                     (gz_i without key norm)
      dv_i = a_i gh + gs_i u - (sum_heads gz_i s_i) r_i^3 / D · v_i
      du   = sum_{tokens, i} gs_i v_i  ->  dq = du * g,  dg = du * q

  du is reduced deterministically: each program walks a fixed set of tiles,
  writes its partial sum to a [programs, D] scratch, and torch sums the rows.

The two-phase kernels (``attnres.ops.two_phase.triton``) reuse this file's tiling helpers.

Supported layouts: the sources are given as up to three *segments* [B, T, k, D]
with any strides over (B, T, k) and unit stride over D (views into the residual
stream's [B, T, K_max, D] buffer, the block partial sum ``partial.unsqueeze(2)``,
the window layout's two buffer slices). Queries may be static ([D], [H, D/H]) or
per token ([B, T, D], [B, T, H, D/H]). float32 / bfloat16 / float16 compute in
float32; float64 computes in float64 (tested in interpret mode; on GPUs the
automatic dispatch leaves float64 to torch). ``unsupported_reason`` says why a
case falls back.

Tests run these kernels on the CPU through ``TRITON_INTERPRET=1``; the
environment variable must be set before this module is imported (``@triton.jit``
reads it when the kernels are defined). ``fused.py`` imports this module only when it
dispatches a CUDA call, and this module imports only the reference's shape helpers: no circle.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence

import torch
import triton
from torch import Tensor

from attnres.ops.common import MAX_PADDED_WIDTH, autocast_disabled, compute_dtype
from attnres.ops.depth_attention.reference import check_kernel, query_heads
from attnres.ops.depth_attention.triton_kernels import (
    _depth_attn_bwd_kernel,
    _depth_attn_fwd_kernel,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_SEGMENTS = 3
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

__all__ = [
    "INTERPRETED",
    "supported",
    "triton_depth_attention",
    "triton_fused_depth_attention",
    "unsupported_reason",
]


# ============================================================================ launch helpers


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def tile_shape(heads: int, d: int, per_thread: int, max_warps: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_DH, num_warps): about ``per_thread`` float32 per thread per tile.

    The numbers come from the register reports of the sm_90 builds (cuobjdump): the
    forward stays free of spills at 16 elements per thread (up to 32 for D = 8192 with
    8 warps), the backward (five live tiles) at 8; 16 warps cap a thread at 128
    registers, so they only pay off for small per-thread counts.
    """
    bh, bdh = pow2(heads), pow2(d // heads)
    width = bh * bdh
    warps = min(max_warps, max(4, width // (32 * per_thread)))
    bt = max(1, min(64, 32 * per_thread * warps // width))
    return bt, bh, bdh, warps


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _max_programs(device: torch.device) -> int:
    """Programs of the backward's persistent grid (each reduces its own share of dq/dg)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 4 * _sm_count(index)
    return 4


def on_device(t: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def check_device(t: Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            "the Triton depth-attention kernels need CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported)"
        )


def _segment_args(segments: Sequence[Tensor]):
    """Flat kernel arguments (ptr, k, stride_b, stride_t, stride_k) for exactly three slots."""
    args = []
    for seg in segments:
        args += [seg, seg.shape[2], seg.stride(0), seg.stride(1), seg.stride(2)]
    for _ in range(MAX_SEGMENTS - len(segments)):
        args += [segments[0], 0, 0, 0, 0]  # an empty slot: its loop runs zero times
    return args


def unsupported_reason(
    segments: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor | None = None,
    *,
    kernel: str = "softmax",
    require_cuda: bool = True,
) -> str | None:
    """Why the Triton kernels cannot run this case (None when they can).

    With ``require_cuda`` (the automatic dispatch), float64 and non-CUDA tensors
    are refused too; the explicit entry points also accept float64 and, in
    interpret mode, CPU tensors.
    """
    if kernel not in ("softmax", "sigmoid"):
        return f"kernel {kernel!r}"
    segments = [s for s in segments if s.shape[2] > 0]
    if not segments:
        return "no sources"
    if len(segments) > MAX_SEGMENTS:
        return f"{len(segments)} segments (at most {MAX_SEGMENTS})"
    first = segments[0]
    if first.dim() != 4:
        return "segments must be [B, T, k, D]"
    b, t, _, d = first.shape
    for seg in segments:
        if seg.dim() != 4 or seg.shape[:2] != first.shape[:2] or seg.shape[3] != d:
            return "segments disagree on [B, T, ., D]"
        if seg.dtype != first.dtype or seg.device != first.device:
            return "segments disagree on dtype or device"
        if d > 1 and seg.stride(3) != 1:
            return "a segment is not contiguous along D"
    if b * t == 0:
        return "no tokens"
    if first.dtype not in _DTYPES:
        return f"dtype {first.dtype}"
    if require_cuda and (first.device.type != "cuda" or first.dtype == torch.float64):
        return "not a CUDA float32/bfloat16/float16 tensor"
    try:
        heads = query_heads(query, d)
    except ValueError as err:
        return str(err)
    if query.dim() >= 3 and tuple(query.shape[:2]) != (b, t):
        return "per-token query does not match [B, T]"
    if query.device != first.device or (key_weight is not None and key_weight.device != first.device):
        return "query or key weight on another device"
    if key_weight is not None and tuple(key_weight.shape) != (d,):
        return "key weight must be [D]"
    if pow2(heads) * pow2(d // heads) > MAX_PADDED_WIDTH:
        return f"D={d} too wide for one program"
    return None


def supported(segments, query, key_weight=None, *, kernel="softmax", require_cuda=True) -> bool:
    """True when ``unsupported_reason`` finds nothing."""
    return unsupported_reason(segments, query, key_weight, kernel=kernel, require_cuda=require_cuda) is None


def _u_vector(
    query: Tensor, key_weight: Tensor | None, d: int, normalize_keys: bool, cd: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(q flattened to [D] or [N, D], u = q*g contiguous, g) in the compute dtype."""
    q = query.to(cd)
    q = q.reshape(d) if query.dim() <= 2 else q.reshape(-1, d)
    g = key_weight.to(cd) if (normalize_keys and key_weight is not None) else None
    u = (q * g if g is not None else q).contiguous()
    return q, u, g


def _forward(segments, query, key_weight, eps, kernel, normalize_keys):
    seg0 = segments[0]
    b, t, _, d = seg0.shape
    n = b * t
    heads = query_heads(query, d)
    cd = compute_dtype(seg0.dtype)
    _, u, _ = _u_vector(query, key_weight, d, normalize_keys, cd)
    h = torch.empty(b, t, d, device=seg0.device, dtype=seg0.dtype)
    lse = torch.empty(n, heads, device=seg0.device, dtype=cd)
    bt, bh, bdh, warps = tile_shape(heads, d, per_thread=16, max_warps=8)
    grid = (triton.cdiv(n, bt),)
    _depth_attn_fwd_kernel[grid](
        *_segment_args(segments),
        u,
        h,
        lse,
        n,
        t,
        heads,
        d // heads,
        float(eps),
        D=d,
        SOFTMAX=kernel == "softmax",
        NORM=normalize_keys,
        PER_TOKEN=query.dim() >= 3,
        BLOCK_T=bt,
        BLOCK_H=bh,
        BLOCK_DH=bdh,
        num_warps=warps,
    )
    return h, lse


def _backward(segments, query, key_weight, h, lse, gh, eps, kernel, normalize_keys, dv_dtype):
    seg0 = segments[0]
    b, t, _, d = seg0.shape
    n = b * t
    k = sum(s.shape[2] for s in segments)
    heads = query_heads(query, d)
    cd = compute_dtype(seg0.dtype)
    per_token = query.dim() >= 3
    q, u, g = _u_vector(query, key_weight, d, normalize_keys, cd)
    gh = gh.contiguous()
    dv = torch.empty(k, b, t, d, device=seg0.device, dtype=dv_dtype)
    bt, bh, bdh, warps = tile_shape(heads, d, per_thread=8, max_warps=16)
    num_tiles = triton.cdiv(n, bt)
    programs = min(num_tiles, _max_programs(seg0.device))
    du = torch.empty((n if per_token else programs), d, device=seg0.device, dtype=cd)
    _depth_attn_bwd_kernel[(programs,)](
        *_segment_args(segments),
        u,
        gh,
        h,
        lse,
        dv,
        du,
        n,
        t,
        heads,
        d // heads,
        float(eps),
        n * d,
        num_tiles,
        D=d,
        SOFTMAX=kernel == "softmax",
        NORM=normalize_keys,
        PER_TOKEN=per_token,
        DELTA_FROM_H=h.dtype == cd,
        BLOCK_T=bt,
        BLOCK_H=bh,
        BLOCK_DH=bdh,
        num_warps=warps,
    )
    if not per_token:
        du = du.sum(0)  # fixed order: deterministic
    gq = du * g if g is not None else du
    gg = None
    if g is not None:
        gg = du * q
        if per_token:
            gg = gg.sum(0)
    return dv, gq, gg


# ============================================================================ autograd


class _TritonDepthAttention(torch.autograd.Function):
    """Same contract as ``_FusedDepthAttention`` (segments in, producers' gradients out).

    Saved for backward: the query, the key weight, the output h and the
    log-sum-exp [B*T, H]; the segments are kept on ctx as they are (views into
    a buffer whose rows read here never change, see ``_FusedDepthAttention``).
    """

    @staticmethod
    def forward(ctx, query, key_weight, segments, opts, *producers):
        eps, kernel, normalize_keys = opts
        with autocast_disabled(segments[0].device.type), on_device(segments[0]):
            h, lse = _forward(segments, query, key_weight, eps, kernel, normalize_keys)
        ctx.segments = segments
        ctx.opts = opts
        ctx.producer_meta = [(p.shape, p.dtype) for p in producers]
        ctx.save_for_backward(query, key_weight, h, lse)
        return h

    @staticmethod
    def backward(ctx, gh):
        query, key_weight, h, lse = ctx.saved_tensors
        eps, kernel, normalize_keys = ctx.opts
        segments = ctx.segments
        meta = ctx.producer_meta
        dv_dtype = meta[0][1] if all(dt == meta[0][1] for _, dt in meta) else segments[0].dtype
        with autocast_disabled(segments[0].device.type), on_device(segments[0]):
            dv, gq, gg = _backward(segments, query, key_weight, h, lse, gh, eps, kernel, normalize_keys, dv_dtype)
        gq = gq.reshape(query.shape).to(query.dtype) if ctx.needs_input_grad[0] else None
        gg = gg.to(key_weight.dtype) if (gg is not None and ctx.needs_input_grad[1]) else None
        grads = [dv[i].reshape(shape).to(dtype) for i, (shape, dtype) in enumerate(meta)]
        return (gq, gg, None, None, *grads)


def triton_fused_depth_attention(
    segments: Sequence[Tensor],
    producers: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    kernel: str = "softmax",
    normalize_keys: bool = True,
) -> Tensor:
    """Triton version of ``fused_depth_attention`` (same arguments, same result).

    ``segments``: up to three tensors [B, T, k_j, D] (unit stride along D) whose
    concatenation along dim 2 is the K sources; ``producers``: the K autograd
    tensors [B, T, D] that receive the gradients. Raises ValueError for a case
    the kernels do not cover (see ``unsupported_reason``).
    """
    check_kernel(kernel)
    segments = tuple(s for s in segments if s.shape[2] > 0)
    reason = unsupported_reason(segments, query, key_weight, kernel=kernel, require_cuda=False)
    if reason is not None:
        raise ValueError(f"Triton depth attention does not support this case: {reason}")
    check_device(segments[0])
    n = sum(seg.shape[2] for seg in segments)
    if n != len(producers):
        raise ValueError(f"segments hold {n} sources but {len(producers)} producers were given")
    return _TritonDepthAttention.apply(query, key_weight, segments, (eps, kernel, normalize_keys), *producers)


def triton_depth_attention(
    sources: Tensor,
    query: Tensor,
    key_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    kernel: str = "softmax",
    normalize_keys: bool = True,
) -> Tensor:
    """Sources [K, B, T, D] -> h [B, T, D], like ``depth_attention(impl="fused")``."""
    if sources.dim() != 4:
        raise ValueError(f"sources must be [K, B, T, D]; got shape {tuple(sources.shape)}")
    return triton_fused_depth_attention(
        (sources.movedim(0, 2),),
        sources.unbind(0),
        query,
        key_weight,
        eps=eps,
        kernel=kernel,
        normalize_keys=normalize_keys,
    )
