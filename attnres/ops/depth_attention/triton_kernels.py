"""The Triton kernels of depth attention: the forward (one pass over up to three source segments) and the
backward (the source, query and key-norm gradients), tile by tile. ``attnres.ops.depth_attention.triton``
holds the math they compute (its docstring), the launch helpers and the autograd Function that calls
them; read that first. Kept apart so that each file reads in one sitting.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, N, T, H, DH, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr):
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
def _fwd_segment(
    v_ptr,
    k,
    sb,
    st,
    sk,
    b64,
    t64,
    mask,
    ch,
    u,
    m,
    l,
    acc,
    eps,
    D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    NORM: tl.constexpr,
):
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
    v0_ptr,
    k0,
    sb0,
    st0,
    sk0,
    v1_ptr,
    k1,
    sb1,
    st1,
    sk1,
    v2_ptr,
    k2,
    sb2,
    st2,
    sk2,
    u_ptr,
    h_ptr,
    lse_ptr,
    N,
    T,
    H,
    DH,
    eps,
    D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    NORM: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    CDT = lse_ptr.dtype.element_ty
    tok64, b64, t64, tok_mask, head, ch, ch_mask = tile_coords(
        tl.program_id(0), N, T, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH
    )
    mask = tok_mask[:, None, None] & ch_mask[None, :, :]
    if PER_TOKEN:
        u = tl.load(u_ptr + tok64[:, None, None] * D + ch[None, :, :], mask=mask, other=0.0)
    else:
        u = tl.load(u_ptr + ch, mask=ch_mask, other=0.0)[None, :, :]
    u = u.to(CDT)

    m = tl.full([BLOCK_T, BLOCK_H], float("-inf"), CDT)
    l = tl.zeros([BLOCK_T, BLOCK_H], CDT)
    acc = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_DH], CDT)
    m, l, acc = _fwd_segment(v0_ptr, k0, sb0, st0, sk0, b64, t64, mask, ch, u, m, l, acc, eps, D, SOFTMAX, NORM)
    m, l, acc = _fwd_segment(v1_ptr, k1, sb1, st1, sk1, b64, t64, mask, ch, u, m, l, acc, eps, D, SOFTMAX, NORM)
    m, l, acc = _fwd_segment(v2_ptr, k2, sb2, st2, sk2, b64, t64, mask, ch, u, m, l, acc, eps, D, SOFTMAX, NORM)
    if SOFTMAX:
        acc = acc / l[:, :, None]
        head_mask = tok_mask[:, None] & (head < H)[None, :]
        tl.store(lse_ptr + tok64[:, None] * H + head[None, :], m + tl.log(l), mask=head_mask)
    h_out = h_ptr + tok64[:, None, None] * D + ch[None, :, :]
    tl.store(h_out, acc.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_segment(
    v_ptr, k, sb, st, sk, b64, t64, mask, ch, u, gh, lse, delta, eps, D: tl.constexpr, NORM: tl.constexpr
):
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
def _bwd_segment(
    v_ptr,
    k,
    sb,
    st,
    sk,
    b64,
    t64,
    mask,
    ch,
    u,
    gh,
    delta,
    lse,
    du,
    dv,
    sdv,
    eps,
    D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    NORM: tl.constexpr,
):
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
    v0_ptr,
    k0,
    sb0,
    st0,
    sk0,
    v1_ptr,
    k1,
    sb1,
    st1,
    sk1,
    v2_ptr,
    k2,
    sb2,
    st2,
    sk2,
    u_ptr,
    gh_ptr,
    h_ptr,
    lse_ptr,
    dv_ptr,
    du_ptr,
    N,
    T,
    H,
    DH,
    eps,
    sdv,
    num_tiles,
    D: tl.constexpr,
    SOFTMAX: tl.constexpr,
    NORM: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    DELTA_FROM_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
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
        tok64, b64, t64, tok_mask, head, ch, ch_mask = tile_coords(tile, N, T, H, DH, BLOCK_T, BLOCK_H, BLOCK_DH)
        mask = tok_mask[:, None, None] & ch_mask[None, :, :]
        rows = tok64[:, None, None] * D + ch[None, :, :]
        if PER_TOKEN:  # noqa: SIM108  (a constexpr branch: Triton compiles only the taken side)
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
                delta = _delta_segment(v0_ptr, k0, sb0, st0, sk0, b64, t64, mask, ch, u, gh, lse, delta, eps, D, NORM)
                delta = _delta_segment(v1_ptr, k1, sb1, st1, sk1, b64, t64, mask, ch, u, gh, lse, delta, eps, D, NORM)
                delta = _delta_segment(v2_ptr, k2, sb2, st2, sk2, b64, t64, mask, ch, u, gh, lse, delta, eps, D, NORM)
        else:
            delta = tl.zeros([BLOCK_T, BLOCK_H], CDT)
            lse = delta
        du = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_DH], CDT)
        dv = dv_ptr + rows
        du, dv = _bwd_segment(
            v0_ptr, k0, sb0, st0, sk0, b64, t64, mask, ch, u, gh, delta, lse, du, dv, sdv, eps, D, SOFTMAX, NORM
        )
        du, dv = _bwd_segment(
            v1_ptr, k1, sb1, st1, sk1, b64, t64, mask, ch, u, gh, delta, lse, du, dv, sdv, eps, D, SOFTMAX, NORM
        )
        du, dv = _bwd_segment(
            v2_ptr, k2, sb2, st2, sk2, b64, t64, mask, ch, u, gh, delta, lse, du, dv, sdv, eps, D, SOFTMAX, NORM
        )
        if PER_TOKEN:
            tl.store(du_ptr + rows, du, mask=mask)
        else:
            du_total += tl.sum(du, axis=0)
    if not PER_TOKEN:
        tl.store(du_ptr + pid * D + ch0, du_total, mask=ch0_mask)
