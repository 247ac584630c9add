"""Two-phase depth attention, the fused path the residual streams run (docs/method.md §6).

The same math as ``reference.py`` (read that first), as custom autograd Functions:

- ``_Phase1``: all S queries of a depth block in one pass over the completed sources, which it
  reads in place from the stream's buffer. Backward also runs once per block, so the sources are
  read and their gradients written once per block instead of once per sublayer: that is where
  the S-fold saving comes from.
- ``_MergePartial``: Phase 2 for the common case (one head, softmax, key norm) with a lean
  backward that writes dh1 and dp once each.

The inverse RMS of each source is computed once when the source is written (``inverse_rms``) and
reused by every reader; its gradient is recomputed here from the values.

Kernels. ``attnres.ops.backends`` chooses for each call (ops ``phase1``, ``merge``, ``merge_partial``).
For CUDA float32/bfloat16/float16 tensors, ``_Phase1``'s forward and ``merge`` (when no gradient is
needed) run the kernels of ``triton.py`` (imported on first use; ``ATTNRES_TRITON=0`` turns them off);
for CPU tensors in eager mode ``_Phase1`` runs the C++ kernel of ``cpu.py``. ``_Phase1``'s backward then
runs the same kernel set's backward, which recomputes the weights from the saved lse (torch's batched
products when S queries of D channels are too wide for one program, or when a graph of the gradient is
wanted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnres.ops import backends
from attnres.ops.common import (
    DepthStats,
    RMSNormArgs,
    apply_function,
    autocast_disabled,
    autocast_off,
    compute_dtype,
    inverse_rms,
    split_heads,
)
from attnres.ops.depth_attention.reference import check_kernel
from attnres.ops.two_phase import reference
from attnres.ops.two_phase.reference import check_phase1_inputs, query_matrix


class _Phase1(torch.autograd.Function):
    """All S pseudo-queries of a depth block against its completed sources in one pass.

    ``values``: [B, T, n, D] (a view into the stream's buffer, stored on ctx, not
    saved: later writes touch other rows only); ``inv_rms``: [B, T, n] or None
    (no key norm); ``producers``: the n autograd tensors behind the rows.
    Returns S tensors h1_s [B, T, D] (compute dtype) and lse [B, T, S, H] (float32;
    for the sigmoid kernel h1 is the unnormalised sum and lse is unused).
    """

    @staticmethod
    def forward(ctx, queries, key_weights, values, inv_rms, opts, *producers):
        with autocast_disabled(values.device.type):
            return _Phase1._forward(ctx, queries, key_weights, values, inv_rms, opts, producers)

    @staticmethod
    def _forward(ctx, queries, key_weights, values, inv_rms, opts, producers):
        kernel, heads, choice = opts
        kernels = choice.kernels
        b, t, n, d = values.shape
        s_count = queries.shape[0]
        cd = compute_dtype(values.dtype)
        if kernels is not None:
            # a kernel's forward (Triton, or the CPU one) keeps nothing of size n: backward recomputes
            # the weights from lse
            h1, lse = kernels.phase1(values, inv_rms, queries, key_weights, kernel=kernel)
            alpha = dots = None
            saved_lse = lse.flatten(0, 1)
        else:
            v3 = values.to(cd).flatten(0, 1)  # [BT, n, D] (a view for float32 buffers)
            h1, lse, alpha, dots = phase1_forward(v3, inv_rms, queries, key_weights, heads, kernel)
            h1 = h1.view(b, t, s_count, d)
            lse = lse.view(b, t, s_count, heads)
            saved_lse = None
        # buffer views: kept on ctx, not saved (later writes go to other rows, which bumps the
        # buffer's version counter but never changes the rows read here)
        ctx.values, ctx.inv_rms, ctx.kernels, ctx.forward = values, inv_rms, kernels, choice.backend
        ctx.opts = (kernel, heads, cd, [(p.shape, p.dtype) for p in producers])
        ctx.save_for_backward(queries, key_weights, alpha, dots, saved_lse)
        # one output per query: each sublayer's gradient then arrives on its own, with no
        # zero-filled [B, T, S, D] assembled by slicing
        return (*h1.unbind(2), lse)

    @staticmethod
    @autocast_off
    def backward(ctx, *grads_out):
        *g_h1s, g_lse = grads_out
        queries, key_weights, alpha, dots, lse = ctx.saved_tensors
        kernel, heads, cd, producer_meta = ctx.opts
        values, inv_rms = ctx.values, ctx.inv_rms
        b, t, n, d = values.shape
        s_count = queries.shape[0]
        if len(g_h1s) == 1 and g_h1s[0] is not None:  # one query (a read inside a group, the last read)
            gh = g_h1s[0].unsqueeze(2).to(cd)  # [B, T, 1, D], a view: nothing to assemble
        else:
            gh = torch.stack(
                [g if g is not None else torch.zeros(b, t, d, dtype=cd, device=values.device) for g in g_h1s], dim=2
            ).to(cd)  # [B, T, S, D]
        needs_du = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # the kernels' backward when the forward ran a kernel (Triton, or the CPU one) and no graph of the
        # gradient is wanted (create_graph: the kernels' results are not differentiable, torch's are)
        case = backends.Case.like(
            values,
            heads=heads,
            queries=s_count,
            sources=n,
            kernel=kernel,
            key_norm=inv_rms is not None,
            create_graph=torch.is_grad_enabled(),
            forward=ctx.forward,
        )
        choice = backends.choose("phase1", "backward", case, kernels=ctx.kernels)
        if choice.kernels is not None:
            gv, du = choice.kernels.phase1_backward(
                values,
                inv_rms,
                queries,
                key_weights,
                lse.view(b, t, s_count, heads),
                gh,
                g_lse,
                kernel=kernel,
                needs_du=needs_du,
            )
        else:
            v3 = values.to(cd).flatten(0, 1)
            if alpha is None:  # a kernel's forward: recompute the weights (one [BT, n, S, H] pass)
                dots, z = phase1_logits(v3, inv_rms, queries, key_weights, heads)
                alpha = torch.exp(z - lse.unsqueeze(1)) if kernel == "softmax" else torch.sigmoid(z)
            r = inv_rms.to(cd).flatten(0, 1) if inv_rms is not None else None
            g_lse3 = g_lse.to(cd).flatten(0, 1) if g_lse is not None else None
            gv, du = phase1_backward(
                v3, r, queries, key_weights, alpha, dots, gh.flatten(0, 1), g_lse3, heads, kernel, needs_du
            )
        gq = gg = None
        if du is not None:
            q = queries.to(cd).reshape(s_count, d)
            if ctx.needs_input_grad[0]:
                gq = du * key_weights.to(cd) if key_weights is not None else du
                gq = gq.reshape(queries.shape).to(queries.dtype)
            if key_weights is not None and ctx.needs_input_grad[1]:
                gg = (du * q).to(key_weights.dtype)

        gv = gv.view(b, t, n, d)
        grads = [gv[:, :, i].reshape(shape).to(dtype) for i, (shape, dtype) in enumerate(producer_meta)]
        return (gq, gg, None, None, None, *grads)


def phase1_forward(
    v3: Tensor, inv_rms: Tensor | None, queries: Tensor, key_weights: Tensor | None, heads: int, kernel: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Phase 1 over v3 [BT, n, D] (compute dtype; inv_rms [B, T, n] with B * T = BT, or None):
    (h1 [BT, S, D], lse [BT, S, H], alpha and the raw dot products [BT, n, S, H])."""
    dots, z = phase1_logits(v3, inv_rms, queries, key_weights, heads)
    if kernel == "softmax":
        lse = torch.logsumexp(z, dim=1)  # [BT, S, H]
        alpha = torch.exp(z - lse.unsqueeze(1))
    else:
        lse = torch.zeros(z.shape[0], queries.shape[0], heads, dtype=v3.dtype, device=z.device)
        alpha = torch.sigmoid(z)
    return _mix(alpha, v3, heads), lse, alpha, dots


def phase1_backward(
    v3: Tensor,
    r: Tensor | None,
    queries: Tensor,
    key_weights: Tensor | None,
    alpha: Tensor,
    dots: Tensor,
    gh: Tensor,
    g_lse: Tensor | None,
    heads: int,
    kernel: str,
    needs_du: bool,
) -> tuple[Tensor, Tensor | None]:
    """Phase 1's backward over v3 [BT, n, D] (compute dtype): (dL/dv3 [BT, n, D], with the key-norm term
    taken through the values; dL/du [S, D] for u = queries * key_weights, or None without ``needs_du``).

    r [BT, n] the inverse RMS (None: no key norm); alpha, dots [BT, n, S, H] the forward's weights and raw
    dot products; gh [BT, S, D] the outputs' gradient; g_lse [BT, S, H] the lse's, or None."""
    cd, d = v3.dtype, v3.shape[-1]
    n, s_count = v3.shape[1], queries.shape[0]
    q = queries.to(cd).reshape(s_count, d)
    g = key_weights.to(cd) if key_weights is not None else None
    u = q * g if g is not None else q

    # dL/dalpha[s, i] = gh_s . v_i (per head): [BT, n, S, H]
    if heads == 1:
        galpha = torch.bmm(v3, gh.transpose(1, 2)).unsqueeze(-1)
    else:
        galpha = torch.einsum("xnhe,xshe->xnsh", split_heads(v3, heads), split_heads(gh, heads))
    if kernel == "softmax":
        gz = alpha * (galpha - (alpha * galpha).sum(dim=1, keepdim=True))
        if g_lse is not None:
            gz = gz + alpha * g_lse.unsqueeze(1)
    else:
        gz = galpha * alpha * (1 - alpha)
    gdots = gz * r[:, :, None, None] if r is not None else gz  # through z = r * dots

    # dv_i = sum_s alpha_si gh_s + sum_s gdots_si u_s (+ key-norm term), one batched product
    if heads == 1:
        # u is shared by all tokens: a plain [BT*n, S] @ [S, D] product, then add alpha @ gh in place
        gv = torch.mm(gdots.reshape(-1, s_count), u).view(v3.shape[0], n, d)
        gv.baddbmm_(alpha.squeeze(-1), gh)
    else:
        gv = torch.einsum("xnsh,xshe->xnhe", alpha, split_heads(gh, heads))
        gv = gv + torch.einsum("xnsh,she->xnhe", gdots, split_heads(u, heads))
        gv = gv.flatten(-2)
    if r is not None:
        # r = rsqrt(mean(v^2) + eps): dr/dv = -r^3 v / D, weighted by sum_s gz * dots
        cv = -(gz * dots).sum(dim=(2, 3)) * r.pow(3) / d  # [BT, n]
        gv.addcmul_(cv.unsqueeze(-1), v3)

    du = None
    if needs_du:
        # du_s = sum over tokens and sources of gdots_si v_i (per head)
        if heads == 1:
            # one [S, BT] @ [BT, D] product per source reads the strided buffer rows in place
            gd = gdots.squeeze(-1)
            du = torch.mm(gd[:, 0].t(), v3[:, 0])
            for i in range(1, n):
                du = du + torch.mm(gd[:, i].t(), v3[:, i])
        else:
            du = torch.einsum("xnsh,xnhe->she", gdots, split_heads(v3, heads)).reshape(s_count, d)
    return gv, du


def phase1_logits(
    v3: Tensor, inv_rms: Tensor | None, queries: Tensor, key_weights: Tensor | None, heads: int
) -> tuple[Tensor, Tensor]:
    """(raw dot products v_i . u_s, logits z = r_i dots), both [BT, n, S, H], from v3 [BT, n, D]."""
    cd, d = v3.dtype, v3.shape[-1]
    s_count = queries.shape[0]
    u = query_matrix(queries, key_weights, cd)
    if heads == 1:
        dots = torch.bmm(v3, u.t().expand(v3.shape[0], d, s_count)).unsqueeze(-1)  # [BT, n, S, 1]
    else:
        dots = torch.einsum("xnhe,she->xnsh", split_heads(v3, heads), split_heads(u, heads))
    r = inv_rms.to(cd).flatten(0, 1) if inv_rms is not None else None  # [BT, n]
    return dots, (dots * r[:, :, None, None] if r is not None else dots)


def triton_for(x: Tensor):
    """The Triton two-phase kernels the table (``attnres.ops.backends.triton_offer``) offers for tensors like
    ``x``, or None: CUDA float32/bfloat16/float16 with triton installed and not ``ATTNRES_TRITON=0``. The
    dispatch sites hand this to ``backends.choose``; tests point it at the interpreted kernels."""
    return backends.triton_offer("phase1", x.device.type, x.dtype).kernels


def phase1_choice(x: Tensor, phase: str = "forward", op: str = "phase1", **case) -> backends.Choice:
    """The table's choice of Phase-1 implementation for sources like ``x`` (``case``: heads, queries, ...)."""
    return backends.choose(op, phase, backends.Case.like(x, **case), triton=triton_for(x))


def phase1_kernels_for(x: Tensor):
    """The Phase-1 kernels the table picks for sources like ``x``: the Triton ones on CUDA, the compiled C++
    one (``cpu.py``) for CPU tensors in eager mode when it is available, else None (torch's batched products).
    Both have ``phase1``, ``phase1_backward``, ``fits`` and ``backward_fits``."""
    return phase1_choice(x, heads=1).kernels


def _mix(alpha: Tensor, v3: Tensor, heads: int) -> Tensor:
    """sum_i alpha[x, i, s, h] v3[x, i, h-channels] -> [BT, S, D]."""
    if heads == 1:
        return torch.bmm(alpha.squeeze(-1).transpose(1, 2).to(v3.dtype), v3)
    out = torch.einsum("xnsh,xnhe->xshe", alpha.to(v3.dtype), split_heads(v3, heads))
    return out.flatten(-2)


def phase1_outputs(
    values: Tensor,
    inv_rms: Tensor | None,
    queries: Tensor,
    key_weights: Tensor | None,
    producers: Sequence[Tensor],
    *,
    kernel: str = "softmax",
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Phase 1 over rows of the residual stream's buffer, the form the streams use.

    values [B, T, n, D] is read in place (a view into the buffer: later writes to other rows are
    fine); gradients go to ``producers``, the n autograd tensors whose values the rows hold.
    Returns the S outputs h1_s [B, T, D] as a tuple, so each sublayer's gradient reaches the
    backward on its own (no zero-filled [B, T, S, D] assembled by slicing), and lse [B, T, S, H].
    """
    check_kernel(kernel)
    heads = check_phase1_inputs(values, inv_rms, queries, key_weights)
    if values.shape[2] != len(producers):
        raise ValueError(f"values hold {values.shape[2]} sources but {len(producers)} producers were given")
    choice = phase1_choice(
        values,
        heads=heads,
        queries=queries.shape[0],
        sources=values.shape[2],
        kernel=kernel,
        key_norm=inv_rms is not None,
    )
    *h1s, lse = apply_function(_Phase1, queries, key_weights, values, inv_rms, (kernel, heads, choice), *producers)
    return tuple(h1s), lse


def phase1(
    values: Tensor,
    inv_rms: Tensor | None,
    queries: Tensor,
    key_weights: Tensor | None = None,
    *,
    kernel: str = "softmax",
) -> DepthStats:
    """Phase 1 as one custom-autograd op; the arguments and result of ``reference.phase1``.

    The key-norm gradient is taken through values (inv_rms must be ``inverse_rms(values, eps)``;
    its own graph is not used).
    """
    h1s, lse = phase1_outputs(values, inv_rms, queries, key_weights, values.unbind(2), kernel=kernel)
    return DepthStats(torch.stack(h1s, dim=2), lse)


class _MergePartial(torch.autograd.Function):
    """merge_partial for one head, softmax, key norm: the common case, with a lean backward.

    h = lerp(h1, p, w), w = sigmoid(z - lse1), z = r_p (p . u), u = q * g. Backward
    needs h1, p and [B, T]-sized scalars; it writes dh1 and dp once each.
    """

    @staticmethod
    def forward(ctx, h1, lse1, partial, query, key_weight, eps):
        with autocast_disabled(partial.device.type):
            cd = compute_dtype(partial.dtype)
            p, h1c = partial.to(cd), h1.to(cd)
            u = query.to(cd) * key_weight.to(cd)
            s = torch.matmul(p, u)  # [B, T]
            r = inverse_rms(p, eps)
            w = torch.sigmoid(r * s - lse1.to(cd).squeeze(-1))
            h = torch.lerp(h1c, p, w.unsqueeze(-1))
            ctx.save_for_backward(h1, partial, query, key_weight, s, r, w)
            return h.to(partial.dtype)

    @staticmethod
    @autocast_off
    def backward(ctx, gh):
        h1, partial, query, key_weight, s, r, w = ctx.saved_tensors
        cd = s.dtype
        p, h1c, gh = partial.to(cd), h1.to(cd), gh.to(cd)
        q, g = query.to(cd), key_weight.to(cd)
        d = p.shape[-1]
        # dL/dw = gh . (p - h1)
        gw = torch.linalg.vecdot(gh, p - h1c)
        gz = gw * w * (1 - w)
        gs, gr = gz * r, gz * s
        w_ = w.unsqueeze(-1)
        gh1 = gh * (1 - w_)
        gp = gh * w_
        gp.addcmul_(gs.unsqueeze(-1), q * g)
        gp.addcmul_((-gr * r.pow(3) / d).unsqueeze(-1), p)
        gu = torch.matmul(gs.reshape(-1), p.reshape(-1, d))  # sum over tokens of gs * p
        return (
            gh1.to(h1.dtype),
            (-gz).unsqueeze(-1).to(cd),
            gp.to(partial.dtype),
            (gu * g).to(query.dtype),
            (gu * q).to(key_weight.dtype),
            None,
        )


def _reference_backward(ctx, inputs: tuple, grad: Tensor, forward) -> list[Tensor | None]:
    """The gradients of a kernel Function's ``inputs`` as a graph (create_graph: the kernels give none), taken
    through ``forward()``, the same math in plain autograd; None where the input needs none."""
    needs = ctx.needs_input_grad[: len(inputs)]
    wanted = [x for x, need in zip(inputs, needs, strict=True) if need and x is not None]
    out = forward()
    grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=True, allow_unused=True))
    return [next(grads) if need and x is not None else None for x, need in zip(inputs, needs, strict=True)]


class _MergeNormKernel(torch.autograd.Function):
    """_MergePartial's math, and with a norm the RMSNorm after it, as one kernel call each way: the C++
    kernel's (``cpu.merge_norm``, CPU float32/float64, eager) or the Triton one (``triton.merge_norm``,
    CUDA), the ``kernels`` module the table chose. h is never written, and backward recomputes it from h1,
    p and the saved [B, T]-sized scalars."""

    @staticmethod
    def forward(ctx, h1, lse1, partial, query, key_weight, weight, eps, norm_eps, kernels):
        u = (query.detach() * key_weight.detach()).to(compute_dtype(partial.dtype))
        out, saved = kernels.merge_norm(h1, lse1, partial, u, eps, weight, norm_eps)
        ctx.save_for_backward(h1, lse1, partial, query, key_weight, weight, saved)
        ctx.eps, ctx.norm_eps, ctx.kernels = eps, norm_eps, kernels
        return out.to(partial.dtype)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        h1, lse1, partial, query, key_weight, weight, saved = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of the gradient (create_graph): the torch form's
            return _MergeNormKernel._graph_backward(ctx, grad)
        u = (query * key_weight).to(saved.dtype)
        gh1, glse, gp, du, dw = ctx.kernels.merge_norm_backward(
            h1, partial, u, ctx.eps, weight, ctx.norm_eps, saved, grad
        )
        return (
            gh1.view(h1.shape).to(h1.dtype),
            glse.view(lse1.shape).to(lse1.dtype),
            gp.view(partial.shape).to(partial.dtype),
            (du * key_weight.to(du.dtype)).to(query.dtype),
            (du * query.to(du.dtype)).to(key_weight.dtype),
            dw.to(weight.dtype) if dw is not None else None,
            None,
            None,
            None,
        )

    @staticmethod
    def _graph_backward(ctx, grad):
        h1, lse1, partial, query, key_weight, weight, _ = ctx.saved_tensors
        norm = RMSNormArgs(weight, ctx.norm_eps) if ctx.norm_eps is not None else None
        found = _reference_backward(
            ctx,
            (h1, lse1, partial, query, key_weight, weight),
            grad,
            lambda: reference.merge_partial(DepthStats(h1, lse1), partial, query, key_weight, ctx.eps, "softmax", norm),
        )
        return (*found, None, None, None)


def merge(a: DepthStats, b: DepthStats, kernel: str = "softmax") -> DepthStats:
    """The arguments and result of ``reference.merge``; the Triton kernel for CUDA statistics when no
    gradient is needed (it has no backward; the merge is elementwise, so autograd's is cheap)."""
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*a, *b))
    case = backends.Case.like(a.h, heads=a.lse.shape[-1], kernel=kernel, grad=grad)
    choice = backends.choose("merge", "forward", case, triton=triton_for(a.h))
    if choice.kernels is not None:
        return choice.kernels.merge(a, b, kernel)
    return reference.merge(a, b, kernel)


class _MergeNormStatsKernel(torch.autograd.Function):
    """``reference.merge_norm`` (one head, softmax) as one C++ kernel call each way: the MergeNorm kernel with
    its second operand a depth attention's result and log-sum-exp (``cpu.merge_norm(..., lse2=...)``), so
    neither the merged h nor the merge's weights are written; the backward recomputes them."""

    @staticmethod
    def forward(ctx, h1, lse1, h2, lse2, weight, norm_eps, kernels):
        out, saved = kernels.merge_norm(h1, lse1, h2, None, 0.0, weight, norm_eps, lse2=lse2)
        ctx.save_for_backward(h1, lse1, h2, lse2, weight, saved)
        ctx.norm_eps, ctx.kernels = norm_eps, kernels
        return out.to(h2.dtype)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        h1, lse1, h2, lse2, weight, saved = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of the gradient (create_graph): the reference's
            norm = RMSNormArgs(weight, ctx.norm_eps) if ctx.norm_eps is not None else None
            found = _reference_backward(
                ctx,
                (h1, lse1, h2, lse2, weight),
                grad,
                lambda: reference.merge_norm(DepthStats(h1, lse1), DepthStats(h2, lse2), "softmax", norm, h2.dtype),
            )
            return (*found, None, None)
        gh1, glse, gh2, _, dw = ctx.kernels.merge_norm_backward(
            h1, h2, None, 0.0, weight, ctx.norm_eps, saved, grad, lse2=lse2
        )
        return (
            gh1.view(h1.shape).to(h1.dtype),
            glse.view(lse1.shape).to(lse1.dtype),
            gh2.view(h2.shape).to(h2.dtype),
            (-glse).view(lse2.shape).to(lse2.dtype),
            dw.to(weight.dtype) if dw is not None else None,
            None,
            None,
        )


def merge_norm(
    a: DepthStats, b: DepthStats, kernel: str, norm: RMSNormArgs | None, dtype: torch.dtype | None = None
) -> Tensor:
    """The arguments and result of ``reference.merge_norm``: the merge of two depth attentions and the
    sublayer's RMSNorm after it (Full AttnRes' reads inside a Phase-1 group), in one C++ kernel call each
    way for one head and softmax on CPU float32/float64 tensors in eager mode, else the reference."""
    check_kernel(kernel)
    dtype = dtype if dtype is not None else a.h.dtype
    case = backends.Case.like(b.h, a.h, norm.weight if norm is not None else None, heads=a.lse.shape[-1], kernel=kernel)
    choice = backends.choose("merge_norm", "forward", case)
    if choice.backend != "cpu_kernel":
        return reference.merge_norm(a, b, kernel, norm, dtype)
    # the norm in the same pass where it runs in the merge's dtype; under autocast, or rounding h to a lower
    # dtype first, it runs after the merge, as in the reference
    fused = norm if norm is not None and dtype == b.h.dtype and not torch.is_autocast_enabled(b.h.device.type) else None
    weight, norm_eps = (fused.weight, fused.eps_for(dtype)) if fused is not None else (None, None)
    h = apply_function(_MergeNormStatsKernel, a.h, a.lse, b.h, b.lse, weight, norm_eps, choice.kernels).to(dtype)
    return h if norm is None or fused is not None else norm(h)


def merge_partial(
    stats: DepthStats,
    partial: Tensor,
    query: Tensor,
    key_weight: Tensor | None,
    eps: float,
    kernel: str = "softmax",
    norm: RMSNormArgs | None = None,
) -> Tensor:
    """Phase 2; the arguments and result of ``reference.merge_partial`` (``norm``: the RMSNorm after it,
    the result then norm(h)). The common case (one head, softmax, key norm) runs as one kernel call, the
    merge and the norm in one pass (forward and backward): Triton's on CUDA, the C++ one on CPU
    float32/float64 tensors in eager mode; else as one custom-autograd op; the others as the plain
    reference."""
    check_kernel(kernel)
    weight = norm.weight if norm is not None else None
    case = backends.Case.like(
        partial,
        stats.h,
        query,
        key_weight,
        weight,
        heads=stats.lse.shape[-1],
        kernel=kernel,
        key_norm=key_weight is not None,
    )
    choice = backends.choose("merge_partial", "forward", case, triton=triton_for(partial))
    backend = choice.backend
    if backend in ("cpu_kernel", "triton"):
        # under autocast the norm runs after the merge, in the dtype autocast gives it
        fused = norm if norm is not None and not torch.is_autocast_enabled(partial.device.type) else None
        weight, norm_eps = (fused.weight, fused.eps_for(partial.dtype)) if fused is not None else (None, None)
        h = apply_function(
            _MergeNormKernel,
            stats.h,
            stats.lse,
            partial,
            query.reshape(-1),
            key_weight,
            weight,
            eps,
            norm_eps,
            choice.kernels,
        )
        return h if norm is None or fused is not None else norm(h)
    if backend == "torch":
        h = apply_function(_MergePartial, stats.h, stats.lse, partial, query.reshape(-1), key_weight, eps)
        return h if norm is None else norm(h)
    return reference.merge_partial(stats, partial, query, key_weight, eps, kernel, norm)
