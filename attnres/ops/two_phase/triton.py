"""Two-phase depth attention as Triton kernels (docs/method.md §6): Phase 1 and the merge, for CUDA.

The same contract as ``reference.py`` (read that first): ``phase1`` reads the n completed sources once
for all S queries of a depth block, ``merge`` combines two ``DepthStats`` exactly. Phase 1's backward
is a kernel of its own, ``phase1_backward`` (``triton_backward.py``, re-exported here): the result of
``fused.phase1_backward``, with the weights recomputed from the forward's lse. ``phase1`` and
``merge`` are not autograd ops: called directly they refuse inputs that require grad while grad mode
is on. ``fused.py`` routes CUDA calls here: its Phase-1 autograd Function runs ``phase1`` forward
and ``phase1_backward`` backward (when ``backward_fits``); its ``merge`` uses the kernel when no
gradient is needed (autograd's elementwise backward is cheap).

- phase 1: each program owns a tile of BLOCK_T tokens and BLOCK_S queries; it walks the sources
  once with an online softmax (running max m and normaliser l per token, query and head, as in
  flash attention) and writes h = acc / l and lse = m + log l. The inverse RMS of each source is
  read from ``inv_rms`` (computed once when the source was written), not recomputed.
- merge: lse = logaddexp(lse_a, lse_b), h = h_a + exp(lse_b - lse) (h_b - h_a), per head.
- merge_norm (``triton_merge_norm.py``, re-exported here): Phase 2 and the sublayer's RMSNorm in one pass,
  forward and backward, with the contract of the C++ kernel's ``cpu.merge_norm`` (``fused._MergeNormKernel``
  runs either).

Tests run the kernels on the CPU through ``TRITON_INTERPRET=1`` (see
``attnres.ops.depth_attention.triton``, whose tiling helpers these kernels share).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnres.ops.common import DepthStats, compute_dtype
from attnres.ops.depth_attention.reference import check_kernel
from attnres.ops.depth_attention.triton import (
    MAX_PADDED_WIDTH,
    check_device,
    on_device,
    pow2,
    tile_shape,
)
from attnres.ops.depth_attention.triton_kernels import tile_coords
from attnres.ops.two_phase.reference import check_phase1_inputs, query_matrix
from attnres.ops.two_phase.triton_backward import backward_fits, phase1_backward
from attnres.ops.two_phase.triton_merge_norm import fits as merge_norm_fits
from attnres.ops.two_phase.triton_merge_norm import merge_norm, merge_norm_backward

__all__ = [
    "backward_fits",
    "fits",
    "merge",
    "merge_norm",
    "merge_norm_backward",
    "merge_norm_fits",
    "phase1",
    "phase1_backward",
]


@triton.jit
def _phase1_kernel(
    v_ptr,
    K,
    sb,
    st,
    sk,
    r_ptr,
    rb,
    rt,
    rk,
    u_ptr,
    h_ptr,
    lse_ptr,
    N,
    T,
    S,
    H,
    DH,
    D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    CDT = h_ptr.dtype.element_ty
    tok64, b64, t64, tok_mask, head, ch, ch_mask = tile_coords(
        tl.program_id(0), N, T, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH
    )
    q_idx = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    q_mask = q_idx < S
    q64 = q_idx.to(tl.int64)
    u = tl.load(
        u_ptr + q64[:, None, None] * D + ch[None, :, :], mask=q_mask[:, None, None] & ch_mask[None, :, :], other=0.0
    ).to(CDT)  # [BS, BH, DH]
    mask = tok_mask[:, None, None] & ch_mask[None, :, :]
    m = tl.full([BLOCK_T, BLOCK_S, BLOCK_H], float("-inf"), CDT)
    l = tl.zeros([BLOCK_T, BLOCK_S, BLOCK_H], CDT)
    acc = tl.zeros([BLOCK_T, BLOCK_S, BLOCK_H, BLOCK_DH], CDT)
    p = v_ptr + (b64 * sb + t64 * st)[:, None, None] + ch[None, :, :]
    rp = r_ptr + b64 * rb + t64 * rt
    for _ in range(K):
        v = tl.load(p, mask=mask, other=0.0).to(CDT)  # [BT, BH, BDH], read once for all S queries
        z = tl.sum(v[:, None, :, :] * u[None, :, :, :], axis=3)  # [BT, BS, BH]
        if NORM:
            r = tl.load(rp, mask=tok_mask, other=0.0).to(CDT)
            z = z * r[:, None, None]
        if SOFTMAX:
            m_new = tl.maximum(m, z)
            scale = tl.exp(m - m_new)
            pz = tl.exp(z - m_new)
            l = l * scale + pz
            acc = acc * scale[:, :, :, None] + pz[:, :, :, None] * v[:, None, :, :]
            m = m_new
        else:
            a = 1.0 / (1.0 + tl.exp(-z))
            acc += a[:, :, :, None] * v[:, None, :, :]
        p += sk
        rp += rk
    if SOFTMAX:
        acc = acc / l[:, :, :, None]
        lse = m + tl.log(l)
    else:
        lse = tl.zeros([BLOCK_T, BLOCK_S, BLOCK_H], CDT)
    out_mask = tok_mask[:, None, None, None] & q_mask[None, :, None, None] & ch_mask[None, None, :, :]
    h_rows = tok64[:, None, None, None] * (S * D) + q64[None, :, None, None] * D + ch[None, None, :, :]
    tl.store(h_ptr + h_rows, acc, mask=out_mask)
    stat_mask = tok_mask[:, None, None] & q_mask[None, :, None] & (head < H)[None, None, :]
    stat_rows = tok64[:, None, None] * (S * H) + q64[None, :, None] * H + head[None, None, :]
    tl.store(lse_ptr + stat_rows, lse, mask=stat_mask)


@triton.jit
def _merge_kernel(
    ha_ptr,
    lsea_ptr,
    hb_ptr,
    lseb_ptr,
    h_ptr,
    lse_ptr,
    M,
    H,
    DH,
    D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    CDT = h_ptr.dtype.element_ty
    row64, _b, _t, row_mask, head, ch, ch_mask = tile_coords(tl.program_id(0), M, 1, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH)
    stat = row64[:, None] * H + head[None, :]
    stat_mask = row_mask[:, None] & (head < H)[None, :]
    lse_a = tl.load(lsea_ptr + stat, mask=stat_mask, other=0.0).to(CDT)
    lse_b = tl.load(lseb_ptr + stat, mask=stat_mask, other=0.0).to(CDT)
    rows = row64[:, None, None] * D + ch[None, :, :]
    mask = row_mask[:, None, None] & ch_mask[None, :, :]
    h_a = tl.load(ha_ptr + rows, mask=mask, other=0.0).to(CDT)
    h_b = tl.load(hb_ptr + rows, mask=mask, other=0.0).to(CDT)
    if SOFTMAX:
        top = tl.maximum(lse_a, lse_b)
        lse = top + tl.log(tl.exp(lse_a - top) + tl.exp(lse_b - top))
        w = tl.exp(lse_b - lse)  # the second set's share of the total mass
        h = h_a + w[:, :, None] * (h_b - h_a)
    else:  # unnormalised sums add
        lse = lse_a
        h = h_a + h_b
    tl.store(lse_ptr + stat, lse, mask=stat_mask)
    tl.store(h_ptr + rows, h, mask=mask)


def _phase1_tile(heads: int, d: int, s: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_S, BLOCK_H, BLOCK_DH, num_warps) of phase 1.

    Accumulators [BLOCK_T, BLOCK_S, D]: up to 16K float32 per program (32 per thread
    at 16 warps, no spills on sm_90). Queries beyond BLOCK_S go to more programs,
    which read the sources again.
    """
    bh, bdh = pow2(heads), pow2(d // heads)
    width = bh * bdh
    bs = min(pow2(s), max(1, 16384 // width))
    warps = min(16, max(4, bs * width // 1024))
    bt = max(1, min(32, 1024 * warps // (bs * width)))
    return bt, bs, bh, bdh, warps


def fits(heads: int, d: int) -> bool:
    """Whether one program can hold a token's D channels of ``heads`` heads (padded to powers of two)."""
    return pow2(heads) * pow2(d // heads) <= MAX_PADDED_WIDTH


def _refuse_autograd(name: str, *tensors: Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"the Triton {name} is no autograd op (no backward wired to it); use attnres.ops.two_phase.fused "
            "for training, or call it under torch.no_grad()"
        )


def phase1(
    values: Tensor,
    inv_rms: Tensor | None,
    queries: Tensor,
    key_weights: Tensor | None = None,
    *,
    kernel: str = "softmax",
) -> DepthStats:
    """Phase 1 in one kernel launch; the arguments and result of ``reference.phase1``.

    values [B, T, n, D] may have any strides over (B, T, n) (a view into the stream's buffer is
    read in place) and unit stride over D.
    """
    check_kernel(kernel)
    heads = check_phase1_inputs(values, inv_rms, queries, key_weights)
    _refuse_autograd("phase1", values, inv_rms, queries, key_weights)
    check_device(values)
    b, t, n, d = values.shape
    if d > 1 and values.stride(3) != 1:
        values = values.contiguous()
    if not fits(heads, d):
        raise ValueError(f"phase1: D={d} is too wide for one program")
    s = queries.shape[0]
    cd = compute_dtype(values.dtype)
    u = query_matrix(queries, key_weights, cd).detach().contiguous()
    r = inv_rms if inv_rms is not None else values  # an unread placeholder pointer without key norm
    r_strides = inv_rms.stride() if inv_rms is not None else (0, 0, 0)
    h = torch.empty(b, t, s, d, device=values.device, dtype=cd)
    lse = torch.empty(b, t, s, heads, device=values.device, dtype=cd)
    bt, bs, bh, bdh, warps = _phase1_tile(heads, d, s)
    tokens = b * t
    if tokens:
        with on_device(values):
            _phase1_kernel[(triton.cdiv(tokens, bt), triton.cdiv(s, bs))](
                values,
                n,
                values.stride(0),
                values.stride(1),
                values.stride(2),
                r,
                *r_strides,
                u,
                h,
                lse,
                tokens,
                t,
                s,
                heads,
                d // heads,
                D=d,
                SOFTMAX=kernel == "softmax",
                NORM=inv_rms is not None,
                BLOCK_T=bt,
                BLOCK_S=bs,
                BLOCK_H=bh,
                BLOCK_DH=bdh,
                num_warps=warps,
            )
    return DepthStats(h, lse)


def merge(a: DepthStats, b: DepthStats, kernel: str = "softmax") -> DepthStats:
    """The exact merge in one kernel launch; the arguments and result of ``reference.merge``."""
    check_kernel(kernel)
    if a.h.shape != b.h.shape or a.lse.shape != b.lse.shape or a.lse.shape[:-1] != a.h.shape[:-1]:
        raise ValueError(
            f"merge: statistics h {tuple(a.h.shape)} / {tuple(b.h.shape)}, lse "
            f"{tuple(a.lse.shape)} / {tuple(b.lse.shape)} do not line up"
        )
    _refuse_autograd("merge", *a, *b)
    check_device(a.h)
    d, heads = a.h.shape[-1], a.lse.shape[-1]
    if d % heads:
        raise ValueError(f"merge: {heads} heads do not divide D={d}")
    cd = compute_dtype(a.h.dtype)
    h = torch.empty(a.h.shape, device=a.h.device, dtype=cd)
    lse = torch.empty(a.lse.shape, device=a.h.device, dtype=cd)
    rows = a.h.numel() // d if d else 0
    if rows:
        bt, bh, bdh, warps = tile_shape(heads, d, per_thread=16, max_warps=8)
        with on_device(a.h):
            _merge_kernel[(triton.cdiv(rows, bt),)](
                a.h.contiguous(),
                a.lse.contiguous(),
                b.h.contiguous(),
                b.lse.contiguous(),
                h,
                lse,
                rows,
                heads,
                d // heads,
                D=d,
                SOFTMAX=kernel == "softmax",
                BLOCK_T=bt,
                BLOCK_H=bh,
                BLOCK_DH=bdh,
                num_warps=warps,
            )
    return DepthStats(h, lse)
