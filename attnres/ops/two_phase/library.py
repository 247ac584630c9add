"""Phase 1 over the sources as separate tensors, as two custom ops that torch.compile traces whole.

``attnres::phase1`` (forward) and ``attnres::phase1_backward`` are ``torch.library.custom_op``s with
fake (meta) implementations and a registered autograd formula, so a compiled graph holds each as one
call: nothing breaks the graph, and inductor neither functionalizes a buffer (the sources arrive as a
list) nor differentiates the op itself. What autograd saves for the backward is the sources (which the
stream keeps alive anyway), their inverse RMS, the queries and the log-sum-exp [B, T, S, H]: the backward
recomputes the weights from lse (one pass of dot products) instead of recomputing the whole Phase 1 as
``torch.utils.checkpoint`` does, and writes every source's gradient once.

Each call runs the kernel ``attnres.ops.backends`` picks (op ``phase1_op``), the fastest the device has:

- CPU tensors: the compiled C++ kernel (``cpu.py``), which reads the list in place, forward and backward;
- CUDA float32/bfloat16/float16: the Triton kernels (``triton.py``, ``triton_backward.py``) on a stack of
  the sources;
- otherwise (no compiler, ``ATTNRES_CPU_KERNEL=0``, no triton, float64 on CUDA) torch's batched products
  over a [BT, n, D] stack, the math of ``fused.phase1_forward`` / ``fused.phase1_backward``.

The key-norm gradient is taken through the values: ``inv_rms`` must be ``inverse_rms(source, eps)`` and
gets no gradient of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnres.ops.common import autocast_disabled, compute_dtype
from attnres.ops.two_phase import cpu, fused
from attnres.ops.two_phase.fused import phase1_backward, phase1_forward, phase1_logits
from attnres.ops.two_phase.reference import query_heads


def _kernel_inputs(sources: list[Tensor], inv_rms: list[Tensor], queries: Tensor, phase: str):
    """(kernels, values, inv_rms) in the layout the Phase-1 kernels the table picks (op ``phase1_op``) read:
    the compiled CPU kernel reads the lists in place, Triton one strided stack; None when torch's products
    run."""
    case = dict(heads=query_heads(queries), queries=queries.shape[0], sources=len(sources), key_norm=bool(inv_rms))
    kernels = fused.phase1_choice(
        sources[0], phase, op="phase1_op", **case
    ).kernels  # read at call time: tests route it
    if kernels is None:
        return None
    if kernels is cpu:
        return kernels, list(sources), list(inv_rms) or None
    return kernels, torch.stack(sources, dim=2), torch.stack(inv_rms, dim=2) if inv_rms else None


def _stacked(sources: list[Tensor], inv_rms: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """([B, T, n, D] in the compute dtype, [B, T, n] or None) from the lists."""
    cd = compute_dtype(sources[0].dtype)
    values = torch.stack([v.to(cd) for v in sources], dim=2)
    return values, (torch.stack([r.to(cd) for r in inv_rms], dim=2) if inv_rms else None)


@torch.library.custom_op("attnres::phase1", mutates_args=())
def phase1_op(
    sources: list[Tensor], inv_rms: list[Tensor], queries: Tensor, key_weights: Tensor | None, kernel: str
) -> tuple[Tensor, Tensor]:
    """(h [B, T, S, D], lse [B, T, S, H]) in the compute dtype; ``inv_rms`` empty: no key norm."""
    b, t, d = sources[0].shape
    heads, s_count = query_heads(queries), queries.shape[0]
    with autocast_disabled(sources[0].device.type):
        found = _kernel_inputs(sources, inv_rms, queries, "forward")
        if found is not None:
            kernels, values, inv = found
            h, lse = kernels.phase1(values, inv, queries, key_weights, kernel=kernel)
            return h, lse
        values, inv = _stacked(sources, inv_rms)
        h, lse, _, _ = phase1_forward(values.flatten(0, 1), inv, queries, key_weights, heads, kernel)
        return h.view(b, t, s_count, d), lse.view(b, t, s_count, heads)


@phase1_op.register_fake
def _(sources, inv_rms, queries, key_weights, kernel):
    b, t, d = sources[0].shape
    cd = compute_dtype(sources[0].dtype)
    s_count = queries.shape[0]
    return sources[0].new_empty(b, t, s_count, d, dtype=cd), sources[0].new_empty(
        b, t, s_count, query_heads(queries), dtype=cd
    )


@torch.library.custom_op("attnres::phase1_backward", mutates_args=())
def phase1_backward_op(
    grad_h: Tensor,
    grad_lse: Tensor,
    sources: list[Tensor],
    inv_rms: list[Tensor],
    queries: Tensor,
    key_weights: Tensor | None,
    lse: Tensor,
    kernel: str,
) -> tuple[Tensor, Tensor]:
    """(dL/dvalues [B, T, n, D], dL/du [S, D] for u = queries * key_weights), compute dtype."""
    b, t, d = sources[0].shape
    heads, n = query_heads(queries), len(sources)
    with autocast_disabled(sources[0].device.type):
        found = _kernel_inputs(sources, inv_rms, queries, "backward")
        if found is not None:
            kernels, values_in, inv_in = found
            gv, du = kernels.phase1_backward(
                values_in, inv_in, queries, key_weights, lse, grad_h, grad_lse, kernel=kernel
            )
            assert du is not None  # asked for
            return gv, du
        values, inv = _stacked(sources, inv_rms)
        cd = values.dtype
        v3 = values.flatten(0, 1)
        # the weights again, from lse: one [BT, n, S, H] pass of dot products
        dots, z = phase1_logits(v3, inv, queries, key_weights, heads)
        r = inv.flatten(0, 1) if inv is not None else None
        lse3 = lse.to(cd).flatten(0, 1)
        alpha = torch.exp(z - lse3.unsqueeze(1)) if kernel == "softmax" else torch.sigmoid(z)
        gh = grad_h.to(cd).flatten(0, 1)
        g_lse = grad_lse.to(cd).flatten(0, 1)
        gv, du = phase1_backward(v3, r, queries, key_weights, alpha, dots, gh, g_lse, heads, kernel, True)
        assert du is not None  # asked for
        return gv.view(b, t, n, d), du


@phase1_backward_op.register_fake
def _(grad_h, grad_lse, sources, inv_rms, queries, key_weights, lse, kernel):
    b, t, d = sources[0].shape
    cd = compute_dtype(sources[0].dtype)
    return sources[0].new_empty(b, t, len(sources), d, dtype=cd), queries.new_empty(queries.shape[0], d, dtype=cd)


def _setup_context(ctx, inputs, output):
    sources, inv_rms, queries, key_weights, kernel = inputs
    _, lse = output
    ctx.n, ctx.kernel = len(sources), kernel
    ctx.has_norm, ctx.has_weights = bool(inv_rms), key_weights is not None
    ctx.dtypes = [v.dtype for v in sources]
    ctx.save_for_backward(*sources, *inv_rms, queries, key_weights, lse)


def _backward(ctx, grad_h, grad_lse):
    saved = ctx.saved_tensors
    n = ctx.n
    sources = list(saved[:n])
    inv_rms = list(saved[n : 2 * n]) if ctx.has_norm else []
    queries, key_weights, lse = saved[len(saved) - 3 :]
    if grad_h is None:
        grad_h = lse.new_zeros(*lse.shape[:3], sources[0].shape[-1])
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    gv, du = phase1_backward_op(grad_h, grad_lse, sources, inv_rms, queries, key_weights, lse, ctx.kernel)
    grads = [gv[:, :, i].to(dtype) for i, dtype in enumerate(ctx.dtypes)]
    gq = du * key_weights.to(du.dtype) if key_weights is not None else du
    gq = gq.reshape(queries.shape).to(queries.dtype)
    gk = (du * queries.to(du.dtype).reshape(du.shape)).to(key_weights.dtype) if key_weights is not None else None
    # no gradient through inv_rms: its key-norm term is in the sources' gradients
    return grads, [None] * len(inv_rms), gq, gk, None


phase1_op.register_autograd(_backward, setup_context=_setup_context)
