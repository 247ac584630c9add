"""Triton kernels for depth attention (docs/method.md §3) and its two-phase form (docs/method.md §6).

The math is the same as ``attnres.ops.depth_attention`` (read that module
first); this file only changes how the work is laid out on a GPU. For one token
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
- phase 1: S pseudo-queries against the cached blocks in one pass over the
  sources, keeping the unnormalised statistics (o, m, l) per query.
- merge: the online-softmax merge of two sets of statistics.

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
reads it when the kernels are defined).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Dict, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnres.ops.depth_attention import (
    DepthStats,
    _check_kernel,
    _compute_dtype,
    _query_heads,
    depth_attention_reference,
    merge_stats,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_SEGMENTS = 3
MAX_PADDED_WIDTH = 8192  # channels per token held by one program (padded to powers of two)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

__all__ = [
    "INTERPRETED",
    "compile_check",
    "merge",
    "merge_reference",
    "phase1",
    "phase1_reference",
    "supported",
    "time_triton_vs_torch",
    "triton_depth_attention",
    "triton_fused_depth_attention",
    "unsupported_reason",
]


# ============================================================================ kernels


@triton.jit
def _tile_coords(tile, N, T, H, DH, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_DH: tl.constexpr):
    """Token indices of one tile and the [BLOCK_H, BLOCK_DH] channel grid (with masks)."""
    tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < N
    tok64 = tok.to(tl.int64)
    b64 = tok64 // T
    t64 = tok64 % T
    head = tl.arange(0, BLOCK_H)
    col = tl.arange(0, BLOCK_DH)
    ch = head[:, None] * DH + col[None, :]
    ch_mask = (head < H)[:, None] & (col < DH)[None, :]
    return tok64, b64, t64, tok_mask, head, ch, ch_mask


@triton.jit
def _fwd_segment(v_ptr, k, sb, st, sk, b64, t64, mask, ch, u, m, l, acc, eps,
                 D: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr):
    """Fold the k sources of one segment into the running (m, l, acc) of a token tile."""
    p = v_ptr + (b64 * sb + t64 * st)[:, None, None] + ch[None, :, :]
    for _ in range(k):
        v = tl.load(p, mask=mask, other=0.0).to(acc.dtype)
        s = tl.sum(v * u, axis=2)  # [BT, BH]
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(tl.sum(v * v, axis=2), axis=1) / D + eps)  # [BT]
            z = s * r[:, None]
        else:
            z = s
        if SOFTMAX:
            m_new = tl.maximum(m, z)
            scale = tl.exp(m - m_new)
            pz = tl.exp(z - m_new)
            l = l * scale + pz
            acc = acc * scale[:, :, None] + pz[:, :, None] * v
            m = m_new
        else:
            a = 1.0 / (1.0 + tl.exp(-z))
            acc += a[:, :, None] * v
        p += sk
    return m, l, acc


@triton.jit
def _depth_attn_fwd_kernel(
    v0_ptr, k0, sb0, st0, sk0,
    v1_ptr, k1, sb1, st1, sk1,
    v2_ptr, k2, sb2, st2, sk2,
    u_ptr, h_ptr, lse_ptr,
    N, T, H, DH, eps,
    D: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr, PER_TOKEN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr,
):
    CDT = lse_ptr.dtype.element_ty
    tok64, b64, t64, tok_mask, head, ch, ch_mask = _tile_coords(
        tl.program_id(0), N, T, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH)
    mask = tok_mask[:, None, None] & ch_mask[None, :, :]
    if PER_TOKEN:
        u = tl.load(u_ptr + tok64[:, None, None] * D + ch[None, :, :], mask=mask, other=0.0)
    else:
        u = tl.load(u_ptr + ch, mask=ch_mask, other=0.0)[None, :, :]
    u = u.to(CDT)

    m = tl.full([BLOCK_T, BLOCK_H], float("-inf"), CDT)
    l = tl.zeros([BLOCK_T, BLOCK_H], CDT)
    acc = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_DH], CDT)
    m, l, acc = _fwd_segment(v0_ptr, k0, sb0, st0, sk0, b64, t64, mask, ch, u, m, l, acc, eps,
                             D, SOFTMAX, NORM)
    m, l, acc = _fwd_segment(v1_ptr, k1, sb1, st1, sk1, b64, t64, mask, ch, u, m, l, acc, eps,
                             D, SOFTMAX, NORM)
    m, l, acc = _fwd_segment(v2_ptr, k2, sb2, st2, sk2, b64, t64, mask, ch, u, m, l, acc, eps,
                             D, SOFTMAX, NORM)
    if SOFTMAX:
        acc = acc / l[:, :, None]
        head_mask = tok_mask[:, None] & (head < H)[None, :]
        tl.store(lse_ptr + tok64[:, None] * H + head[None, :], m + tl.log(l), mask=head_mask)
    h_out = h_ptr + tok64[:, None, None] * D + ch[None, :, :]
    tl.store(h_out, acc.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_segment(v_ptr, k, sb, st, sk, b64, t64, mask, ch, u, gh, lse, delta, eps,
                   D: tl.constexpr, NORM: tl.constexpr):
    """Add sum_i a_i (gh . v_i) over one segment's sources (the softmax-backward delta)."""
    p = v_ptr + (b64 * sb + t64 * st)[:, None, None] + ch[None, :, :]
    for _ in range(k):
        v = tl.load(p, mask=mask, other=0.0).to(delta.dtype)
        z = tl.sum(v * u, axis=2)
        if NORM:
            z = z * (1.0 / tl.sqrt(tl.sum(tl.sum(v * v, axis=2), axis=1) / D + eps))[:, None]
        delta += tl.exp(z - lse) * tl.sum(gh * v, axis=2)
        p += sk
    return delta


@triton.jit
def _bwd_segment(v_ptr, k, sb, st, sk, b64, t64, mask, ch, u, gh, delta, lse, du, dv, sdv, eps,
                 D: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr):
    """Write dv for the k sources of one segment; return the updated du and dv pointers."""
    p = v_ptr + (b64 * sb + t64 * st)[:, None, None] + ch[None, :, :]
    for _ in range(k):
        v = tl.load(p, mask=mask, other=0.0).to(du.dtype)
        s = tl.sum(v * u, axis=2)  # [BT, BH]
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(tl.sum(v * v, axis=2), axis=1) / D + eps)  # [BT]
            z = s * r[:, None]
        else:
            z = s
        ga = tl.sum(gh * v, axis=2)
        if SOFTMAX:
            a = tl.exp(z - lse)
            gz = a * (ga - delta)
        else:
            a = 1.0 / (1.0 + tl.exp(-z))
            gz = ga * a * (1.0 - a)
        if NORM:
            gs = gz * r[:, None]
            cv = -tl.sum(gz * s, axis=1) * r * r * r / D  # [BT]: through r_i (shared by heads)
            g = a[:, :, None] * gh + gs[:, :, None] * u + cv[:, None, None] * v
        else:
            gs = gz
            g = a[:, :, None] * gh + gs[:, :, None] * u
        tl.store(dv, g.to(dv.dtype.element_ty), mask=mask)
        du += gs[:, :, None] * v
        p += sk
        dv += sdv
    return du, dv


@triton.jit
def _depth_attn_bwd_kernel(
    v0_ptr, k0, sb0, st0, sk0,
    v1_ptr, k1, sb1, st1, sk1,
    v2_ptr, k2, sb2, st2, sk2,
    u_ptr, gh_ptr, h_ptr, lse_ptr, dv_ptr, du_ptr,
    N, T, H, DH, eps, sdv, num_tiles,
    D: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr, PER_TOKEN: tl.constexpr,
    DELTA_FROM_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr,
):
    CDT = du_ptr.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    head0 = tl.arange(0, BLOCK_H)
    col0 = tl.arange(0, BLOCK_DH)
    ch0 = head0[:, None] * DH + col0[None, :]
    ch0_mask = (head0 < H)[:, None] & (col0 < DH)[None, :]
    if not PER_TOKEN:
        u_static = tl.load(u_ptr + ch0, mask=ch0_mask, other=0.0).to(CDT)[None, :, :]
    du_total = tl.zeros([BLOCK_H, BLOCK_DH], CDT)
    # a fixed set of tiles per program: the reduction of du is deterministic
    for tile in range(pid, num_tiles, programs):
        tok64, b64, t64, tok_mask, head, ch, ch_mask = _tile_coords(
            tile, N, T, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH)
        mask = tok_mask[:, None, None] & ch_mask[None, :, :]
        rows = tok64[:, None, None] * D + ch[None, :, :]
        if PER_TOKEN:
            u = tl.load(u_ptr + rows, mask=mask, other=0.0).to(CDT)
        else:
            u = u_static
        gh = tl.load(gh_ptr + rows, mask=mask, other=0.0).to(CDT)
        head_mask = tok_mask[:, None] & (head < H)[None, :]
        if SOFTMAX:
            lse = tl.load(lse_ptr + tok64[:, None] * H + head[None, :], mask=head_mask, other=0.0)
            lse = lse.to(CDT)
            if DELTA_FROM_H:  # h was stored in the compute dtype: sum_i a_i (gh . v_i) = gh . h
                h = tl.load(h_ptr + rows, mask=mask, other=0.0).to(CDT)
                delta = tl.sum(gh * h, axis=2)
            else:  # h was rounded to 16 bits: gh . h would cancel badly, so one more pass
                delta = tl.zeros([BLOCK_T, BLOCK_H], CDT)
                delta = _delta_segment(v0_ptr, k0, sb0, st0, sk0, b64, t64, mask, ch, u, gh, lse,
                                       delta, eps, D, NORM)
                delta = _delta_segment(v1_ptr, k1, sb1, st1, sk1, b64, t64, mask, ch, u, gh, lse,
                                       delta, eps, D, NORM)
                delta = _delta_segment(v2_ptr, k2, sb2, st2, sk2, b64, t64, mask, ch, u, gh, lse,
                                       delta, eps, D, NORM)
        else:
            delta = tl.zeros([BLOCK_T, BLOCK_H], CDT)
            lse = delta
        du = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_DH], CDT)
        dv = dv_ptr + rows
        du, dv = _bwd_segment(v0_ptr, k0, sb0, st0, sk0, b64, t64, mask, ch, u, gh, delta, lse,
                              du, dv, sdv, eps, D, SOFTMAX, NORM)
        du, dv = _bwd_segment(v1_ptr, k1, sb1, st1, sk1, b64, t64, mask, ch, u, gh, delta, lse,
                              du, dv, sdv, eps, D, SOFTMAX, NORM)
        du, dv = _bwd_segment(v2_ptr, k2, sb2, st2, sk2, b64, t64, mask, ch, u, gh, delta, lse,
                              du, dv, sdv, eps, D, SOFTMAX, NORM)
        if PER_TOKEN:
            tl.store(du_ptr + rows, du, mask=mask)
        else:
            du_total += tl.sum(du, axis=0)
    if not PER_TOKEN:
        tl.store(du_ptr + pid * D + ch0, du_total, mask=ch0_mask)


@triton.jit
def _phase1_kernel(
    v_ptr, K, sk, sb, st, u_ptr, o_ptr, m_ptr, l_ptr,
    N, T, S, H, DH, eps, so, sml,
    D: tl.constexpr, NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    CDT = o_ptr.dtype.element_ty
    tok64, b64, t64, tok_mask, head, ch, ch_mask = _tile_coords(
        tl.program_id(0), N, T, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH)
    q_idx = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    q_mask = q_idx < S
    q64 = q_idx.to(tl.int64)
    u = tl.load(u_ptr + q64[:, None, None] * D + ch[None, :, :],
                mask=q_mask[:, None, None] & ch_mask[None, :, :], other=0.0).to(CDT)  # [BS, BH, DH]
    mask = tok_mask[:, None, None] & ch_mask[None, :, :]
    m = tl.full([BLOCK_T, BLOCK_S, BLOCK_H], float("-inf"), CDT)
    l = tl.zeros([BLOCK_T, BLOCK_S, BLOCK_H], CDT)
    acc = tl.zeros([BLOCK_T, BLOCK_S, BLOCK_H, BLOCK_DH], CDT)
    p = v_ptr + (b64 * sb + t64 * st)[:, None, None] + ch[None, :, :]
    for _ in range(K):
        v = tl.load(p, mask=mask, other=0.0).to(CDT)  # [BT, BH, BDH], read once for all S queries
        z = tl.sum(v[:, None, :, :] * u[None, :, :, :], axis=3)  # [BT, BS, BH]
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(tl.sum(v * v, axis=2), axis=1) / D + eps)
            z = z * r[:, None, None]
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        pz = tl.exp(z - m_new)
        l = l * scale + pz
        acc = acc * scale[:, :, :, None] + pz[:, :, :, None] * v[:, None, :, :]
        m = m_new
        p += sk
    out_mask = (tok_mask[:, None, None, None] & q_mask[None, :, None, None]
                & ch_mask[None, None, :, :])
    o_rows = q64[None, :, None, None] * so + tok64[:, None, None, None] * D + ch[None, None, :, :]
    tl.store(o_ptr + o_rows, acc, mask=out_mask)
    stat_mask = tok_mask[:, None, None] & q_mask[None, :, None] & (head < H)[None, None, :]
    stat_rows = q64[None, :, None] * sml + tok64[:, None, None] * H + head[None, None, :]
    tl.store(m_ptr + stat_rows, m, mask=stat_mask)
    tl.store(l_ptr + stat_rows, l, mask=stat_mask)


@triton.jit
def _merge_kernel(
    o1_ptr, m1_ptr, l1_ptr, o2_ptr, m2_ptr, l2_ptr, o_ptr, m_ptr, l_ptr,
    M, H, DH,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr,
):
    CDT = o_ptr.dtype.element_ty
    row64, _b, _t, row_mask, head, ch, ch_mask = _tile_coords(
        tl.program_id(0), M, 1, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH)
    stat = row64[:, None] * H + head[None, :]
    stat_mask = row_mask[:, None] & (head < H)[None, :]
    m1 = tl.load(m1_ptr + stat, mask=stat_mask, other=0.0).to(CDT)
    m2 = tl.load(m2_ptr + stat, mask=stat_mask, other=0.0).to(CDT)
    l1 = tl.load(l1_ptr + stat, mask=stat_mask, other=0.0).to(CDT)
    l2 = tl.load(l2_ptr + stat, mask=stat_mask, other=0.0).to(CDT)
    m = tl.maximum(m1, m2)
    e1 = tl.exp(m1 - m)
    e2 = tl.exp(m2 - m)
    tl.store(m_ptr + stat, m, mask=stat_mask)
    tl.store(l_ptr + stat, e1 * l1 + e2 * l2, mask=stat_mask)
    rows = row64[:, None, None] * D + ch[None, :, :]
    mask = row_mask[:, None, None] & ch_mask[None, :, :]
    o1 = tl.load(o1_ptr + rows, mask=mask, other=0.0).to(CDT)
    o2 = tl.load(o2_ptr + rows, mask=mask, other=0.0).to(CDT)
    tl.store(o_ptr + rows, e1[:, :, None] * o1 + e2[:, :, None] * o2, mask=mask)


# ============================================================================ launch helpers


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _tile(heads: int, d: int, per_thread: int, max_warps: int) -> Tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_DH, num_warps): about ``per_thread`` float32 per thread per tile.

    The numbers come from the register reports of the sm_90 builds (cuobjdump): the
    forward stays free of spills at 16 elements per thread (up to 32 for D = 8192 with
    8 warps), the backward (five live tiles) at 8; 16 warps cap a thread at 128
    registers, so they only pay off for small per-thread counts.
    """
    bh, bdh = _pow2(heads), _pow2(d // heads)
    width = bh * bdh
    warps = min(max_warps, max(4, width // (32 * per_thread)))
    bt = max(1, min(64, 32 * per_thread * warps // width))
    return bt, bh, bdh, warps


def _phase1_tile(heads: int, d: int, s: int) -> Tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_S, BLOCK_H, BLOCK_DH, num_warps) of phase 1.

    Accumulators [BLOCK_T, BLOCK_S, D]: up to 16K float32 per program (32 per thread
    at 16 warps, no spills on sm_90). Queries beyond BLOCK_S go to more programs,
    which read the sources again.
    """
    bh, bdh = _pow2(heads), _pow2(d // heads)
    width = bh * bdh
    bs = min(_pow2(s), max(1, 16384 // width))
    warps = min(16, max(4, bs * width // 1024))
    bt = max(1, min(32, 1024 * warps // (bs * width)))
    return bt, bs, bh, bdh, warps


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _max_programs(device: torch.device) -> int:
    """Programs of the backward's persistent grid (each reduces its own share of dq/dg)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 4 * _sm_count(index)
    return 4


def _on_device(t: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _check_device(t: Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            "the Triton depth-attention kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before attnres.ops.triton_depth_attention is imported)"
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
    key_weight: Optional[Tensor] = None,
    *,
    kernel: str = "softmax",
    require_cuda: bool = True,
) -> Optional[str]:
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
        heads = _query_heads(query, d)
    except ValueError as err:
        return str(err)
    if query.dim() >= 3 and tuple(query.shape[:2]) != (b, t):
        return "per-token query does not match [B, T]"
    if query.device != first.device or (key_weight is not None
                                        and key_weight.device != first.device):
        return "query or key weight on another device"
    if key_weight is not None and tuple(key_weight.shape) != (d,):
        return "key weight must be [D]"
    if _pow2(heads) * _pow2(d // heads) > MAX_PADDED_WIDTH:
        return f"D={d} too wide for one program"
    return None


def supported(segments, query, key_weight=None, *, kernel="softmax", require_cuda=True) -> bool:
    """True when ``unsupported_reason`` finds nothing."""
    return unsupported_reason(segments, query, key_weight, kernel=kernel,
                              require_cuda=require_cuda) is None


def _u_vector(query: Tensor, key_weight: Optional[Tensor], d: int, normalize_keys: bool,
              cd: torch.dtype) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
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
    heads = _query_heads(query, d)
    cd = _compute_dtype(seg0.dtype)
    _, u, _ = _u_vector(query, key_weight, d, normalize_keys, cd)
    h = torch.empty(b, t, d, device=seg0.device, dtype=seg0.dtype)
    lse = torch.empty(n, heads, device=seg0.device, dtype=cd)
    bt, bh, bdh, warps = _tile(heads, d, per_thread=16, max_warps=8)
    grid = (triton.cdiv(n, bt),)
    _depth_attn_fwd_kernel[grid](
        *_segment_args(segments), u, h, lse, n, t, heads, d // heads, float(eps),
        D=d, SOFTMAX=kernel == "softmax", NORM=normalize_keys, PER_TOKEN=query.dim() >= 3,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_DH=bdh, num_warps=warps,
    )
    return h, lse


def _backward(segments, query, key_weight, h, lse, gh, eps, kernel, normalize_keys, dv_dtype):
    seg0 = segments[0]
    b, t, _, d = seg0.shape
    n = b * t
    k = sum(s.shape[2] for s in segments)
    heads = _query_heads(query, d)
    cd = _compute_dtype(seg0.dtype)
    per_token = query.dim() >= 3
    q, u, g = _u_vector(query, key_weight, d, normalize_keys, cd)
    gh = gh.contiguous()
    dv = torch.empty(k, b, t, d, device=seg0.device, dtype=dv_dtype)
    bt, bh, bdh, warps = _tile(heads, d, per_thread=8, max_warps=16)
    num_tiles = triton.cdiv(n, bt)
    programs = min(num_tiles, _max_programs(seg0.device))
    du = torch.empty((n if per_token else programs), d, device=seg0.device, dtype=cd)
    _depth_attn_bwd_kernel[(programs,)](
        *_segment_args(segments), u, gh, h, lse, dv, du,
        n, t, heads, d // heads, float(eps), n * d, num_tiles,
        D=d, SOFTMAX=kernel == "softmax", NORM=normalize_keys, PER_TOKEN=per_token,
        DELTA_FROM_H=h.dtype == cd,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_DH=bdh, num_warps=warps,
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
        with torch.autocast(segments[0].device.type, enabled=False), _on_device(segments[0]):
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
        with torch.autocast(segments[0].device.type, enabled=False), _on_device(segments[0]):
            dv, gq, gg = _backward(segments, query, key_weight, h, lse, gh, eps, kernel,
                                   normalize_keys, dv_dtype)
        gq = gq.reshape(query.shape).to(query.dtype) if ctx.needs_input_grad[0] else None
        gg = gg.to(key_weight.dtype) if (gg is not None and ctx.needs_input_grad[1]) else None
        grads = [dv[i].reshape(shape).to(dtype) for i, (shape, dtype) in enumerate(meta)]
        return (gq, gg, None, None, *grads)


def triton_fused_depth_attention(
    segments: Sequence[Tensor],
    producers: Sequence[Tensor],
    query: Tensor,
    key_weight: Optional[Tensor] = None,
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
    _check_kernel(kernel)
    segments = tuple(s for s in segments if s.shape[2] > 0)
    reason = unsupported_reason(segments, query, key_weight, kernel=kernel, require_cuda=False)
    if reason is not None:
        raise ValueError(f"Triton depth attention does not support this case: {reason}")
    _check_device(segments[0])
    n = sum(seg.shape[2] for seg in segments)
    if n != len(producers):
        raise ValueError(f"segments hold {n} sources but {len(producers)} producers were given")
    return _TritonDepthAttention.apply(
        query, key_weight, segments, (eps, kernel, normalize_keys), *producers
    )


def triton_depth_attention(
    sources: Tensor,
    query: Tensor,
    key_weight: Optional[Tensor] = None,
    *,
    eps: float = 1e-6,
    kernel: str = "softmax",
    normalize_keys: bool = True,
) -> Tensor:
    """Sources [K, B, T, D] -> h [B, T, D], like ``depth_attention(impl="fused")``."""
    if sources.dim() != 4:
        raise ValueError(f"sources must be [K, B, T, D]; got shape {tuple(sources.shape)}")
    return triton_fused_depth_attention(
        (sources.movedim(0, 2),), sources.unbind(0), query, key_weight,
        eps=eps, kernel=kernel, normalize_keys=normalize_keys,
    )


# ============================================================================ two-phase


def _phase1_queries(queries: Tensor, key_weights: Optional[Tensor], d: int, normalize_keys: bool):
    if queries.dim() not in (2, 3):
        raise ValueError(f"queries must be [S, D] or [S, H, D/H]; got {tuple(queries.shape)}")
    heads = 1 if queries.dim() == 2 else queries.shape[1]
    if heads * queries.shape[-1] != d:
        raise ValueError(f"queries {tuple(queries.shape)} do not cover the {d} source channels")
    if (normalize_keys and key_weights is not None
            and tuple(key_weights.shape) != (queries.shape[0], d)):
        raise ValueError(f"key_weights must be [S, D]; got {tuple(key_weights.shape)}")
    return heads


def phase1(
    sources: Tensor,
    queries: Tensor,
    key_weights: Optional[Tensor] = None,
    *,
    eps: float = 1e-6,
    normalize_keys: bool = True,
) -> DepthStats:
    """Phase 1 of docs/method.md §6: S pseudo-queries against the cached sources, one pass over them.

    sources: [K, B, T, D], any strides over (K, B, T) and unit stride over D (so
    ``buffer[:, :, :n].movedim(2, 0)`` is read in place). queries: [S, D] or
    [S, H, D/H]; key_weights: [S, D] (None: ones). Softmax only.
    Returns ``DepthStats(o [S, B, T, D], m [S, B, T], l [S, B, T])`` (m and l
    get a trailing H for multi-head queries), float32 (float64 for float64
    sources). Inference only: no autograd.
    """
    if sources.dim() != 4 or sources.shape[0] == 0:
        raise ValueError(f"sources must be [K, B, T, D] with K >= 1; got {tuple(sources.shape)}")
    _check_device(sources)
    k, b, t, d = sources.shape
    if d > 1 and sources.stride(3) != 1:
        sources = sources.contiguous()
    heads = _phase1_queries(queries, key_weights, d, normalize_keys)
    s = queries.shape[0]
    n = b * t
    cd = _compute_dtype(sources.dtype)
    u = queries.detach().to(cd).reshape(s, d)
    if normalize_keys and key_weights is not None:
        u = u * key_weights.detach().to(cd)
    u = u.contiguous()
    if _pow2(heads) * _pow2(d // heads) > MAX_PADDED_WIDTH:
        raise ValueError(f"phase1: D={d} is too wide for one program; use phase1_reference")
    o = torch.empty(s, b, t, d, device=sources.device, dtype=cd)
    m = torch.empty(s, b, t, heads, device=sources.device, dtype=cd)
    l = torch.empty_like(m)
    bt, bs, bh, bdh, warps = _phase1_tile(heads, d, s)
    grid = (triton.cdiv(n, bt), triton.cdiv(s, bs))
    with _on_device(sources):
        if n:
            _phase1_kernel[grid](
                sources, k, sources.stride(0), sources.stride(1), sources.stride(2), u, o, m, l,
                n, t, s, heads, d // heads, float(eps), n * d, n * heads,
                D=d, NORM=normalize_keys, BLOCK_T=bt, BLOCK_S=bs, BLOCK_H=bh, BLOCK_DH=bdh,
                num_warps=warps,
            )
    if queries.dim() == 2:
        m, l = m.squeeze(-1), l.squeeze(-1)
    return DepthStats(o, m, l)


def phase1_reference(
    sources: Tensor,
    queries: Tensor,
    key_weights: Optional[Tensor] = None,
    *,
    eps: float = 1e-6,
    normalize_keys: bool = True,
) -> DepthStats:
    """Torch reference of ``phase1``: one ``depth_attention_reference`` per query, stacked."""
    if sources.dim() != 4 or sources.shape[0] == 0:
        raise ValueError(f"sources must be [K, B, T, D] with K >= 1; got {tuple(sources.shape)}")
    _phase1_queries(queries, key_weights, sources.shape[-1], normalize_keys)
    outs = []
    with torch.no_grad():
        for i in range(queries.shape[0]):
            kw = key_weights[i] if key_weights is not None else None
            outs.append(depth_attention_reference(
                sources, queries[i], kw, eps=eps, kernel="softmax", normalize_keys=normalize_keys,
            ).stats)
    return DepthStats(*(torch.stack(parts) for parts in zip(*outs)))


def merge(o1: Tensor, m1: Tensor, l1: Tensor, o2: Tensor, m2: Tensor, l2: Tensor) -> DepthStats:
    """Online-softmax merge of two statistics (docs/method.md §6), like ``merge_stats``.

    o: [..., D]; m, l: [...] (single head) or [..., H]. Returns float32
    (float64 for float64 inputs) ``DepthStats(o, m, l)``; ``finalize_stats``
    turns it into h. Inference only: no autograd.
    """
    if o1.shape != o2.shape or m1.shape != m2.shape or l1.shape != m1.shape or l2.shape != m1.shape:
        raise ValueError("merge: the two statistics disagree in shape")
    _check_device(o1)
    d = o1.shape[-1]
    single = m1.dim() == o1.dim() - 1
    if (m1.shape if single else m1.shape[:-1]) != o1.shape[:-1]:
        raise ValueError(f"merge: m {tuple(m1.shape)} does not match o {tuple(o1.shape)}")
    heads = 1 if single else m1.shape[-1]
    if d % heads:
        raise ValueError(f"merge: {heads} heads do not divide D={d}")
    cd = torch.float64 if o1.dtype == torch.float64 else torch.float32
    rows = o1.numel() // d if d else 0
    o = torch.empty(o1.shape, device=o1.device, dtype=cd)
    m = torch.empty(m1.shape, device=o1.device, dtype=cd)
    l = torch.empty_like(m)
    if rows:
        bt, bh, bdh, warps = _tile(heads, d, per_thread=16, max_warps=8)
        c = [x.detach().contiguous() for x in (o1, m1, l1, o2, m2, l2)]
        with _on_device(o1):
            _merge_kernel[(triton.cdiv(rows, bt),)](
                *c, o, m, l, rows, heads, d // heads,
                D=d, BLOCK_T=bt, BLOCK_H=bh, BLOCK_DH=bdh, num_warps=warps,
            )
    return DepthStats(o, m, l)


def merge_reference(o1, m1, l1, o2, m2, l2) -> DepthStats:
    """Torch reference of ``merge``: ``merge_stats`` from the depth-attention module."""
    return merge_stats(DepthStats(o1, m1, l1), DepthStats(o2, m2, l2))


# ============================================================================ build check


_SOURCE_POINTERS = {"v0_ptr", "v1_ptr", "v2_ptr", "v_ptr", "h_ptr", "gh_ptr", "dv_ptr"}


def _aot_signature(fn, dtype: str, constexprs: Dict[str, object]) -> Dict[str, str]:
    """Argument types for ``triton.compile``: source/compute-dtype pointers, i32, fp32 eps."""
    compute = "fp64" if dtype == "fp64" else "fp32"
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype if name in _SOURCE_POINTERS else compute}"
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
    return sig


def compile_check(arch: int = 90, d: int = 1024, heads: int = 1) -> Dict[str, Tuple[int, int]]:
    """Compile the kernels for ``sm_{arch}`` without a GPU (front end, LLVM and ptxas).

    Interpret mode runs the kernels as numpy code and cannot see compiler errors;
    this builds a representative set of variants with the tile sizes the launchers
    would pick for width ``d``. Returns {variant: (registers, spill stack bytes)}
    (-1 when cuobjdump is not found). Needs the ptxas that ships in the triton wheel,
    and must run in a process without TRITON_INTERPRET=1.
    """
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        raise RuntimeError("compile_check needs a process without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", arch, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    fwd_tile = _tile(heads, d, per_thread=16, max_warps=8)
    bwd_tile = _tile(heads, d, per_thread=8, max_warps=16)
    bh, bdh = _pow2(heads), _pow2(d // heads)
    variants = []
    for dtype, softmax, norm, per_token in (("bf16", True, True, False),
                                            ("fp32", False, False, True),
                                            ("fp64", True, True, True)):
        bt, _, _, warps = fwd_tile
        variants.append((f"fwd {dtype} softmax={softmax} norm={norm} per_token={per_token}",
                         _depth_attn_fwd_kernel, dtype, warps,
                         dict(D=d, SOFTMAX=softmax, NORM=norm, PER_TOKEN=per_token,
                              BLOCK_T=bt, BLOCK_H=bh, BLOCK_DH=bdh)))
        bt, _, _, warps = bwd_tile
        variants.append((f"bwd {dtype} softmax={softmax} norm={norm} per_token={per_token}",
                         _depth_attn_bwd_kernel, dtype, warps,
                         dict(D=d, SOFTMAX=softmax, NORM=norm, PER_TOKEN=per_token,
                              DELTA_FROM_H=dtype != "bf16", BLOCK_T=bt, BLOCK_H=bh, BLOCK_DH=bdh)))
    bt, bs, _, _, warps = _phase1_tile(heads, d, 4)
    variants.append(("phase1 bf16 S=4", _phase1_kernel, "bf16", warps,
                     dict(D=d, NORM=True, BLOCK_T=bt, BLOCK_S=bs, BLOCK_H=bh, BLOCK_DH=bdh)))
    variants.append(("merge fp32", _merge_kernel, "fp32", fwd_tile[3],
                     dict(D=d, BLOCK_T=fwd_tile[0], BLOCK_H=bh, BLOCK_DH=bdh)))
    report = {}
    for name, fn, dtype, warps, constexprs in variants:
        src = ASTSource(fn, _aot_signature(fn, dtype, constexprs), constexprs)
        kernel = triton.compile(src, target=target, options={"num_warps": warps})
        regs = stack = -1
        if os.path.exists(cuobjdump):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "kernel.cubin")
                with open(path, "wb") as f:
                    f.write(kernel.asm["cubin"])
                out = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                                     text=True).stdout
            found = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.S)
            if found:
                regs, stack = int(found.group(1)), int(found.group(2))
        report[name] = (regs, stack)
    return report


# ============================================================================ benchmark


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
    """Milliseconds per call, Triton vs the torch fused path, on a GPU (not run by the tests).

    Times the forward, the forward + backward of the op in the residual
    stream's layout (K sources as rows of a [B, T, K+1, D] buffer), phase 1 for
    S queries and the merge. Also reports the effective bandwidth of the Triton
    forward in GB/s (bytes that must move: K sources read, h written) and the
    largest difference between the two forwards. From a shell:
    ``python -m attnres.ops.triton_depth_attention``.
    """
    from attnres.ops.depth_attention import _FusedDepthAttention

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    buffer = torch.randn(B, T, K + 1, D, device=dev, dtype=dtype, generator=gen)
    producers = [buffer[:, :, i].clone().requires_grad_() for i in range(K)]
    segments = (buffer[:, :, :K],)
    shape = (D,) if heads == 1 else (heads, D // heads)
    query = (0.1 * torch.randn(shape, device=dev, generator=gen)).requires_grad_()
    key_weight = torch.ones(D, device=dev, requires_grad=True)
    gh = torch.randn(B, T, D, device=dev, dtype=dtype, generator=gen)
    opts = (1e-6, kernel, normalize_keys)

    def torch_fwd():
        return _FusedDepthAttention.apply(query, key_weight, segments, opts, *producers)

    def triton_fwd():
        return _TritonDepthAttention.apply(query, key_weight, segments, opts, *producers)

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

    sources = buffer[:, :, :K].movedim(2, 0)
    queries = 0.1 * torch.randn(S, D, device=dev, generator=gen)
    if heads > 1:
        queries = queries.view(S, heads, D // heads)
    kws = torch.ones(S, D, device=dev)
    out["phase1_torch_ms"] = bench(
        lambda: phase1_reference(sources, queries, kws, normalize_keys=normalize_keys), rep=rep_ms)
    out["phase1_triton_ms"] = bench(
        lambda: phase1(sources, queries, kws, normalize_keys=normalize_keys), rep=rep_ms)
    a = phase1(sources, queries, kws, normalize_keys=normalize_keys)
    b = phase1(sources[-1:], queries, kws, normalize_keys=normalize_keys)
    out["merge_torch_ms"] = bench(lambda: merge_reference(*a, *b), rep=rep_ms)
    out["merge_triton_ms"] = bench(lambda: merge(*a, *b), rep=rep_ms)
    return out


if __name__ == "__main__":
    for key, value in time_triton_vs_torch().items():
        print(f"{key:>20s}  {value:.4g}")
