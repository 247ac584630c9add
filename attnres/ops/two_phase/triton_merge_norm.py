"""Phase 2 fused with the sublayer's RMSNorm as Triton kernels, forward and backward, for CUDA.

The contract of ``cpu.merge_norm`` / ``cpu.merge_norm_backward`` (the C++ kernel's; ``fused._MergeNormKernel``
calls either module): one head, softmax, key norm. Per token, with p the partial sum, u = query * key
weight, r = 1 / sqrt(eps + |p|^2 / D), z = r (p . u), w = sigmoid(z - lse1):

    h = h1 + w (p - h1),   out = h                       (no norm)
                           out = g rho h, rho = 1 / sqrt(norm_eps + |h|^2 / D)   (norm)

Each program owns BLOCK_T whole tokens (D padded to a power of two), so a token's reductions stay inside
one program; h is never written, and the backward recomputes it from h1, p and four saved scalars per
token (s = p . u, r, w, rho). Its weight gradients (du, dg) are summed per program over a persistent grid
and then by torch in a fixed order, so the result does not depend on scheduling. Tests run the kernels on
the CPU through ``TRITON_INTERPRET=1`` against the float64 reference and the C++ kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnres.ops.common import compute_dtype, flat_rows, rows_of
from attnres.ops.depth_attention.triton import check_device, on_device, pow2
from attnres.ops.two_phase.triton_backward import _max_programs

SCALARS = 4  # saved per token: s, r, w, rho


@triton.jit
def _merge_norm_fwd_kernel(
    h1_ptr,
    H1_STRIDE,
    lse_ptr,
    p_ptr,
    u_ptr,
    g_ptr,
    out_ptr,
    saved_ptr,
    N,
    key_eps,
    norm_eps,
    D: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    CDT = out_ptr.dtype.element_ty
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    ch = tl.arange(0, BLOCK_D)
    t_mask, c_mask = tok < N, ch < D
    mask = t_mask[:, None] & c_mask[None, :]
    a = tl.load(h1_ptr + tok[:, None] * H1_STRIDE + ch[None, :], mask=mask, other=0.0).to(CDT)
    b = tl.load(p_ptr + tok[:, None] * D + ch[None, :], mask=mask, other=0.0).to(CDT)
    u = tl.load(u_ptr + ch, mask=c_mask, other=0.0).to(CDT)
    lse = tl.load(lse_ptr + tok, mask=t_mask, other=0.0).to(CDT)
    s = tl.sum(b * u[None, :], axis=1)
    r = 1.0 / tl.sqrt(key_eps + tl.sum(b * b, axis=1) / D)
    w = 1.0 / (1.0 + tl.exp(lse - r * s))
    h = a + w[:, None] * (b - a)
    rho = tl.full([BLOCK_T], 1.0, CDT)
    if NORM:
        rho = 1.0 / tl.sqrt(norm_eps + tl.sum(h * h, axis=1) / D)
        h = h * rho[:, None]
        if WEIGHT:
            h = h * tl.load(g_ptr + ch, mask=c_mask, other=0.0).to(CDT)[None, :]
    tl.store(out_ptr + tok[:, None] * D + ch[None, :], h, mask=mask)
    k = saved_ptr + tok * 4
    tl.store(k, s, mask=t_mask)
    tl.store(k + 1, r, mask=t_mask)
    tl.store(k + 2, w, mask=t_mask)
    tl.store(k + 3, rho, mask=t_mask)


@triton.jit
def _merge_norm_bwd_kernel(
    h1_ptr,
    H1_STRIDE,
    p_ptr,
    u_ptr,
    g_ptr,
    gx_ptr,
    saved_ptr,
    gh1_ptr,
    gp_ptr,
    glse_ptr,
    du_ptr,
    dg_ptr,
    N,
    num_tiles,
    D: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    CDT = gp_ptr.dtype.element_ty
    pid, programs = tl.program_id(0), tl.num_programs(0)
    ch = tl.arange(0, BLOCK_D)
    c_mask = ch < D
    u = tl.load(u_ptr + ch, mask=c_mask, other=0.0).to(CDT)
    g = tl.full([BLOCK_D], 1.0, CDT)
    if WEIGHT:
        g = tl.load(g_ptr + ch, mask=c_mask, other=0.0).to(CDT)
    du = tl.zeros([BLOCK_D], CDT)
    dg = tl.zeros([BLOCK_D], CDT)
    for tile in range(pid, num_tiles, programs):  # a fixed set of tiles per program: deterministic sums
        tok = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_mask = tok < N
        mask = t_mask[:, None] & c_mask[None, :]
        a = tl.load(h1_ptr + tok[:, None] * H1_STRIDE + ch[None, :], mask=mask, other=0.0).to(CDT)
        b = tl.load(p_ptr + tok[:, None] * D + ch[None, :], mask=mask, other=0.0).to(CDT)
        gx = tl.load(gx_ptr + tok[:, None] * D + ch[None, :], mask=mask, other=0.0).to(CDT)
        k = saved_ptr + tok * 4
        s = tl.load(k, mask=t_mask, other=0.0).to(CDT)
        r = tl.load(k + 1, mask=t_mask, other=0.0).to(CDT)
        w = tl.load(k + 2, mask=t_mask, other=0.0).to(CDT)
        rho = tl.load(k + 3, mask=t_mask, other=0.0).to(CDT)
        diff = b - a
        h = a + w[:, None] * diff
        gg = gx * g[None, :]
        if NORM:
            # dL/dh = rho g gx - beta h, beta = rho^3 ((g gx) . h) / D
            beta = rho * rho * rho * tl.sum(gg * h, axis=1) / D
            gh = rho[:, None] * gg - beta[:, None] * h
            if WEIGHT:
                dg += tl.sum(rho[:, None] * gx * h, axis=0)
        else:
            gh = gg
        gz = tl.sum(gh * diff, axis=1) * w * (1.0 - w)  # dL/dw = dL/dh . (p - h1), through the sigmoid
        gs = gz * r
        kp = -(gz * s) * r * r * r / D  # the key norm's term on p
        tl.store(glse_ptr + tok, -gz, mask=t_mask)
        tl.store(gh1_ptr + tok[:, None] * D + ch[None, :], (1.0 - w)[:, None] * gh, mask=mask)
        gp = w[:, None] * gh + gs[:, None] * u[None, :] + kp[:, None] * b
        tl.store(gp_ptr + tok[:, None] * D + ch[None, :], gp, mask=mask)
        du += tl.sum(gs[:, None] * b, axis=0)
    tl.store(du_ptr + pid * D + ch, du, mask=c_mask)
    if WEIGHT:
        tl.store(dg_ptr + pid * D + ch, dg, mask=c_mask)


def fits(d: int) -> bool:
    """Whether one program holds a token's D channels (padded to a power of two) with room for its tile."""
    return pow2(d) <= 16384


def _tile(d: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps): about 16 float32 per thread per live tile (the backward keeps five)."""
    bd = pow2(d)
    warps = min(8, max(4, bd // 512))
    bt = max(1, min(64, 32 * 16 * warps // bd))
    return bt, bd, warps


def merge_norm(
    h1: Tensor,
    lse: Tensor,
    partial: Tensor,
    u: Tensor,
    key_eps: float,
    weight: Tensor | None = None,
    norm_eps: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``cpu.merge_norm`` in one kernel launch: (out [B, T, D] in the compute dtype, the [B*T, 4] scalars)."""
    check_device(partial)
    d = partial.shape[-1]
    if not fits(d):
        raise ValueError(f"merge_norm: D={d} is too wide for one program")
    cd = compute_dtype(partial.dtype)
    rows, stride = rows_of(h1, cd)
    p, lse_c, u_c, w_c = flat_rows(partial, cd, d), flat_rows(lse, cd), flat_rows(u, cd), flat_rows(weight, cd)
    n = p.shape[0]
    out = torch.empty(n, d, device=partial.device, dtype=cd)
    saved = torch.empty(n, SCALARS, device=partial.device, dtype=cd)
    bt, bd, warps = _tile(d)
    if n:
        with on_device(partial):
            _merge_norm_fwd_kernel[(triton.cdiv(n, bt),)](
                rows,
                stride,
                lse_c,
                p,
                u_c,
                w_c if w_c is not None else u_c,  # an unread placeholder without a weight
                out,
                saved,
                n,
                key_eps,
                norm_eps if norm_eps is not None else 0.0,
                D=d,
                NORM=norm_eps is not None,
                WEIGHT=norm_eps is not None and w_c is not None,
                BLOCK_T=bt,
                BLOCK_D=bd,
                num_warps=warps,
            )
    return out.view(partial.shape), saved


def merge_norm_backward(
    h1: Tensor,
    partial: Tensor,
    u: Tensor,
    key_eps: float,
    weight: Tensor | None,
    norm_eps: float | None,
    saved: Tensor,
    grad_out: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``cpu.merge_norm_backward`` in one kernel launch and a fixed-order sum of per-program partials:
    (dh1, dlse [N], dpartial, du [D], dweight [D] or None), in the compute dtype."""
    check_device(partial)
    d = partial.shape[-1]
    cd = compute_dtype(partial.dtype)
    rows, stride = rows_of(h1, cd)
    p, u_c, w_c = flat_rows(partial, cd, d), flat_rows(u, cd), flat_rows(weight, cd)
    gx = flat_rows(grad_out, cd, d)
    n = p.shape[0]
    norm = norm_eps is not None
    weighted = norm and w_c is not None
    gh1, gp = torch.empty(n, d, device=p.device, dtype=cd), torch.empty(n, d, device=p.device, dtype=cd)
    glse = torch.empty(n, device=p.device, dtype=cd)
    bt, bd, warps = _tile(d)
    num_tiles = triton.cdiv(n, bt)
    programs = max(1, min(num_tiles, _max_programs(p.device)))
    du = torch.zeros(programs, d, device=p.device, dtype=cd)
    dg = torch.zeros(programs, d, device=p.device, dtype=cd) if weighted else None
    if n:
        with on_device(partial):
            _merge_norm_bwd_kernel[(programs,)](
                rows,
                stride,
                p,
                u_c,
                w_c if w_c is not None else u_c,  # unread placeholders without a weight
                gx,
                saved,
                gh1,
                gp,
                glse,
                du,
                dg if dg is not None else du,
                n,
                num_tiles,
                D=d,
                NORM=norm,
                WEIGHT=weighted,
                BLOCK_T=bt,
                BLOCK_D=bd,
                num_warps=warps,
            )
    return gh1, glse, gp, du.sum(0), (dg.sum(0) if dg is not None else None)
