"""Phase 1's backward as one Triton kernel (docs/method.md §6), for CUDA; ``triton.py`` holds the forward.

The math of ``fused.phase1_backward`` (read that first), with the weights recomputed from the forward's
log-sum-exp instead of saved. Per token, source i, query s and head h, with u_s = q_s * g_s (the query
times the key weights) and r_i the source's inverse RMS (1 without key norm):

    dots = v_i . u_s,   z = r_i dots,   alpha = exp(z - lse_s) (softmax) or sigmoid(z)
    dalpha = gh_s . v_i
    gz = alpha (dalpha - delta_s + glse_s),  delta_s = sum_i alpha dalpha        (softmax)
    gz = dalpha alpha (1 - alpha)                                                (sigmoid)
    dv_i = sum_s (alpha gh_s + r_i gz u_s) - (sum_{s,h} gz dots) r_i^3 / D v_i   (last term: key norm)
    du_s = sum over tokens and sources of r_i gz v_i

A program owns BLOCK_T tokens and all S queries (a source's gradient sums over them) and walks the
sources twice: once for delta (softmax only; the forward's h is not kept, so gh . h is not at hand),
once to write each source's gradient. The grid is persistent: each program reduces du over a fixed
set of token tiles, and torch adds the per-program partial sums in a fixed order (deterministic, no
atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnres.ops.common import MAX_BACKWARD_WIDTH, compute_dtype
from attnres.ops.depth_attention.reference import check_kernel
from attnres.ops.depth_attention.triton import (
    _max_programs,
    check_device,
    on_device,
    pow2,
)
from attnres.ops.depth_attention.triton_kernels import tile_coords
from attnres.ops.two_phase.reference import check_phase1_inputs, query_matrix

__all__ = ["MAX_BACKWARD_WIDTH", "backward_fits", "phase1_backward"]


@triton.jit
def _phase1_bwd_kernel(
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
    gh_ptr,
    lse_ptr,
    glse_ptr,
    dv_ptr,
    du_ptr,
    N,
    T,
    S,
    H,
    DH,
    num_tiles,
    D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    NORM: tl.constexpr,
    GRAD_LSE: tl.constexpr,
    NEEDS_DU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    CDT = dv_ptr.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    q_idx = tl.arange(0, BLOCK_S)
    q_mask = q_idx < S
    q64 = q_idx.to(tl.int64)
    head0 = tl.arange(0, BLOCK_H)
    col0 = tl.arange(0, BLOCK_DH)
    ch0 = head0[:, None] * DH + col0[None, :]
    u_mask = q_mask[:, None, None] & ((head0 < H)[:, None] & (col0 < DH)[None, :])[None, :, :]
    u_rows = q64[:, None, None] * D + ch0[None, :, :]
    u = tl.load(u_ptr + u_rows, mask=u_mask, other=0.0).to(CDT)  # [BS, BH, BDH]
    du = tl.zeros([BLOCK_S, BLOCK_H, BLOCK_DH], CDT)
    # a fixed set of tiles per program: the reduction of du is deterministic
    for tile in range(pid, num_tiles, programs):
        tok64, b64, t64, tok_mask, head, ch, ch_mask = tile_coords(tile, N, T, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH)
        mask = tok_mask[:, None, None] & ch_mask[None, :, :]
        gh_rows = tok64[:, None, None, None] * (S * D) + u_rows[None, :, :, :]
        gh = tl.load(gh_ptr + gh_rows, mask=tok_mask[:, None, None, None] & u_mask[None, :, :, :], other=0.0)
        gh = gh.to(CDT)  # [BT, BS, BH, BDH]: held for both walks over the sources
        stat_mask = tok_mask[:, None, None] & q_mask[None, :, None] & (head < H)[None, None, :]
        stat_rows = tok64[:, None, None] * (S * H) + q64[None, :, None] * H + head[None, None, :]
        v_first = v_ptr + (b64 * sb + t64 * st)[:, None, None] + ch[None, :, :]
        r_first = r_ptr + b64 * rb + t64 * rt
        if SOFTMAX:
            lse = tl.load(lse_ptr + stat_rows, mask=stat_mask, other=0.0).to(CDT)
            # delta - glse, so that gz = alpha (dalpha - delta) below
            delta = tl.zeros([BLOCK_T, BLOCK_S, BLOCK_H], CDT)
            if GRAD_LSE:
                delta -= tl.load(glse_ptr + stat_rows, mask=stat_mask, other=0.0).to(CDT)
            p = v_first
            rp = r_first
            for _ in range(K):
                v = tl.load(p, mask=mask, other=0.0).to(CDT)
                z = tl.sum(v[:, None, :, :] * u[None, :, :, :], axis=3)  # [BT, BS, BH]
                if NORM:
                    z = z * tl.load(rp, mask=tok_mask, other=0.0).to(CDT)[:, None, None]
                delta += tl.exp(z - lse) * tl.sum(gh * v[:, None, :, :], axis=3)
                p += sk
                rp += rk
        else:
            lse = tl.zeros([BLOCK_T, BLOCK_S, BLOCK_H], CDT)
            delta = lse
        p = v_first
        rp = r_first
        dv = dv_ptr + (tok64 * K * D)[:, None, None] + ch[None, :, :]  # dv is [N, K, D]
        for _ in range(K):
            v = tl.load(p, mask=mask, other=0.0).to(CDT)  # [BT, BH, BDH]
            dots = tl.sum(v[:, None, :, :] * u[None, :, :, :], axis=3)  # [BT, BS, BH]
            dalpha = tl.sum(gh * v[:, None, :, :], axis=3)
            if NORM:
                r = tl.load(rp, mask=tok_mask, other=0.0).to(CDT)
                z = dots * r[:, None, None]
            else:
                z = dots
            if SOFTMAX:
                a = tl.exp(z - lse)
                gz = a * (dalpha - delta)
            else:
                a = 1.0 / (1.0 + tl.exp(-z))
                gz = dalpha * a * (1.0 - a)
            if NORM:
                gd = gz * r[:, None, None]
                # through r_i = rsqrt(mean(v_i^2) + eps), shared by all queries and heads
                cv = -tl.sum(tl.sum(gz * dots, axis=2), axis=1) * r * r * r / D  # [BT]
                g = tl.sum(a[:, :, :, None] * gh + gd[:, :, :, None] * u[None, :, :, :], axis=1)
                g += cv[:, None, None] * v
            else:
                gd = gz
                g = tl.sum(a[:, :, :, None] * gh + gd[:, :, :, None] * u[None, :, :, :], axis=1)
            tl.store(dv, g.to(CDT), mask=mask)
            if NEEDS_DU:
                du += tl.sum(gd[:, :, :, None] * v[:, None, :, :], axis=0)
            p += sk
            rp += rk
            dv += D
    if NEEDS_DU:
        tl.store(du_ptr + pid * (S * D) + u_rows, du, mask=u_mask)


def _backward_tile(heads: int, d: int, s: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_S, BLOCK_H, BLOCK_DH, num_warps) of the backward.

    All S queries in one program. The output gradient tile [BLOCK_T, BLOCK_S, D] is held for both
    walks over the sources, about 8 float32 per thread (up to 32 at 16 warps for the widest rows that
    ``backward_fits`` admits): u and the du accumulator, [BLOCK_S, D] each, live beside it and are as
    large as it when BLOCK_T is 1.
    """
    bh, bdh, bs = pow2(heads), pow2(d // heads), pow2(s)
    row = bs * bh * bdh
    warps = min(16, max(4, row // 256))
    bt = max(1, min(32, 256 * warps // row))
    return bt, bs, bh, bdh, warps


def backward_fits(heads: int, d: int, s: int) -> bool:
    """Whether one program can hold a token's output gradient for all ``s`` queries (padded to powers of two)."""
    return pow2(s) * pow2(heads) * pow2(d // heads) <= MAX_BACKWARD_WIDTH


def _check_shape(name: str, x: Tensor, want: tuple[int, ...]) -> None:
    if tuple(x.shape) != want:
        raise ValueError(
            f"phase1_backward: {name} must be [B, T, S, {'D' if name == 'grad_h' else 'H'}] = {want}; "
            f"got {tuple(x.shape)} (pass the forward's lse and gradients shaped like its outputs)"
        )


def phase1_backward(
    values: Tensor,
    inv_rms: Tensor | None,
    queries: Tensor,
    key_weights: Tensor | None,
    lse: Tensor,
    grad_h: Tensor,
    grad_lse: Tensor | None,
    *,
    kernel: str = "softmax",
    needs_du: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Phase 1's backward in one kernel launch (plus a fixed-order sum of per-program partial du's).

    values [B, T, n, D] (any strides over B, T, n; unit stride over D), inv_rms [B, T, n] or None
    (no key norm), queries [S, D] or [S, H, D/H], key_weights [S, D] or None: the forward's inputs;
    lse [B, T, S, H] its log-sum-exp, grad_h [B, T, S, D] and grad_lse [B, T, S, H] (or None) the
    gradients of its outputs (the sigmoid kernel reads neither lse nor grad_lse: its lse is a
    constant). Returns (dL/dvalues [B, T, n, D] contiguous, with the key-norm term taken through the
    values; dL/du [S, D] for u = queries * key_weights, or None without ``needs_du``), both in the
    compute dtype: the result of ``fused.phase1_backward``.
    """
    check_kernel(kernel)
    heads = check_phase1_inputs(values, inv_rms, queries, key_weights)
    check_device(values)
    b, t, n, d = values.shape
    s = queries.shape[0]
    _check_shape("lse", lse, (b, t, s, heads))
    _check_shape("grad_h", grad_h, (b, t, s, d))
    if grad_lse is not None:
        _check_shape("grad_lse", grad_lse, (b, t, s, heads))
    if not backward_fits(heads, d, s):
        raise ValueError(
            f"phase1_backward: S={s} queries of D={d} channels ({heads} heads) are too wide for one program "
            f"(pow2(S) * padded D must be <= {MAX_BACKWARD_WIDTH}; check backward_fits first); "
            "use attnres.ops.two_phase.fused.phase1_backward"
        )
    if d > 1 and values.stride(3) != 1:
        values = values.contiguous()
    cd = compute_dtype(values.dtype)
    u = query_matrix(queries, key_weights, cd).detach().contiguous()
    r = inv_rms if inv_rms is not None else values  # an unread placeholder pointer without key norm
    r_strides = inv_rms.stride() if inv_rms is not None else (0, 0, 0)
    softmax = kernel == "softmax"
    glse = grad_lse.contiguous() if grad_lse is not None and softmax else None
    dv = torch.empty(b, t, n, d, device=values.device, dtype=cd)
    tokens = b * t
    bt, bs, bh, bdh, warps = _backward_tile(heads, d, s)
    num_tiles = triton.cdiv(tokens, bt)
    programs = min(num_tiles, _max_programs(values.device))
    du = torch.zeros(max(programs, 1), s, d, device=values.device, dtype=cd) if needs_du else None
    if tokens:
        with on_device(values):
            _phase1_bwd_kernel[(programs,)](
                values,
                n,
                values.stride(0),
                values.stride(1),
                values.stride(2),
                r,
                *r_strides,
                u,
                grad_h.contiguous(),
                lse.contiguous(),
                glse if glse is not None else dv,  # an unread placeholder without grad_lse
                dv,
                du if du is not None else dv,  # an unread placeholder without needs_du
                tokens,
                t,
                s,
                heads,
                d // heads,
                num_tiles,
                D=d,
                SOFTMAX=softmax,
                NORM=inv_rms is not None,
                GRAD_LSE=glse is not None,
                NEEDS_DU=needs_du,
                BLOCK_T=bt,
                BLOCK_S=bs,
                BLOCK_H=bh,
                BLOCK_DH=bdh,
                num_warps=warps,
            )
    return dv, (du.sum(0) if du is not None else None)
