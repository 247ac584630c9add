"""Depth attention, the fused path: what the residual streams run (docs/method.md §3).

The same math as ``reference.py`` (read that first), as a custom autograd Function that saves only
``[B, T, K]``-sized tensors and recomputes the rest from the sources in backward. Keys equal
values, so the normalised keys never need to exist in memory:
``q · (v_i * r_i * g) = r_i * (v_i · (q * g))`` with ``r_i = rsqrt(mean(v_i^2) + eps)``.

Layouts. The public functions take the ``[K, B, T, D]`` of docs/method.md. Internally we work on
``[B, T, K, D]`` ("depth next to channels") because then the weighted sum is one batched
``[1, K] @ [K, D]`` product per token, and the residual stream's preallocated buffer can hand out
views of its first ``k`` sources without copying.

Dispatch. ``attnres.ops.backends`` chooses (op ``depth_attention``): the reference where it is asked for,
the Triton kernels of ``triton.py`` for CUDA tensors when triton is installed and the case is covered
(imported on first use, so this module never needs triton), else this path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnres.ops import backends
from attnres.ops.common import (
    apply_function,
    autocast_disabled,
    autocast_off,
    compute_dtype,
    split_heads,
    triton_kernels,
)
from attnres.ops.depth_attention.reference import (
    DepthAttentionOutput,
    check_kernel,
    check_query,
    check_sources,
    check_vector,
    depth_attention_reference,
    is_per_token,
    query_heads,
)

IMPLS = ("fused", "reference")


class _FusedDepthAttention(torch.autograd.Function):
    """Depth attention that keeps only [B, T, K]-sized tensors for backward.

    ``segments`` are value tensors [B, T, k_j, D] that together form the K
    sources (typically views into the residual stream's buffer: they are
    stored on ctx directly, not through save_for_backward, because later
    sublayers write *other* rows of that buffer in place and the rows read
    here never change). ``producers`` are the autograd tensors whose values
    the segments hold, one [B, T, D] tensor per source, in order; their
    gradients are what backward returns.
    """

    @staticmethod
    def forward(ctx, query, key_weight, segments, opts, *producers):
        # precision is chosen here (float32 statistics), not by an enclosing autocast
        with autocast_disabled(segments[0].device.type):
            return _FusedDepthAttention._forward(ctx, query, key_weight, segments, opts, producers)

    @staticmethod
    def _forward(ctx, query, key_weight, segments, opts, producers):
        eps, kernel, normalize_keys = opts
        d = segments[0].shape[-1]
        heads = query_heads(query, d)
        cd = compute_dtype(segments[0].dtype)
        per_token = is_per_token(query)
        q = query.to(cd).reshape(*query.shape[:-2], d) if heads > 1 else query.to(cd)
        u = q * key_weight.to(cd) if (normalize_keys and key_weight is not None) else q

        s_parts, r_parts = [], []
        for seg in segments:
            v = seg.to(cd)
            s_parts.append(_dot_sources(v, u, heads, per_token))  # [B, T, k, H]
            if normalize_keys:
                ms = torch.linalg.vector_norm(v, dim=-1).pow(2) / d
                r_parts.append(torch.rsqrt(ms + eps))  # [B, T, k]
        s = torch.cat(s_parts, dim=2)
        r = torch.cat(r_parts, dim=2) if normalize_keys else None
        z = s * r.unsqueeze(-1) if r is not None else s
        alpha = torch.softmax(z, dim=2) if kernel == "softmax" else torch.sigmoid(z)

        h: Tensor | None = None
        start = 0
        for seg in segments:
            k = seg.shape[2]
            part = _weighted_sum(seg.to(cd), alpha[:, :, start : start + k], heads)
            h = part if h is None else h + part
            start += k
        assert h is not None  # segments is never empty: the embedding's row at least

        ctx.segments = segments
        ctx.opts = (eps, kernel, normalize_keys, heads, per_token, cd, [(p.shape, p.dtype) for p in producers])
        ctx.save_for_backward(query, key_weight, alpha, s, r)
        return h.to(segments[0].dtype)

    @staticmethod
    @autocast_off
    def backward(ctx, gh):
        query, key_weight, alpha, s, r = ctx.saved_tensors
        eps, kernel, normalize_keys, heads, per_token, cd, producer_shapes = ctx.opts
        segments = ctx.segments
        d = segments[0].shape[-1]
        gh = gh.to(cd)
        q = query.to(cd).reshape(*query.shape[:-2], d) if heads > 1 else query.to(cd)
        use_g = normalize_keys and key_weight is not None
        g = key_weight.to(cd) if use_g else None
        u = q * g if use_g else q

        # dL/dalpha_i = gh . v_i (per head)
        galpha = torch.cat([_dot_sources(seg.to(cd), gh, heads, True) for seg in segments], dim=2)
        if kernel == "softmax":
            gz = alpha * (galpha - (alpha * galpha).sum(dim=2, keepdim=True))
        else:
            gz = galpha * alpha * (1 - alpha)
        if normalize_keys:
            gs = gz * r.unsqueeze(-1)  # through z = s * r
            gr = (gz * s).sum(-1)  # r is shared by the heads
            cv = -gr * r.pow(3) / d  # d r / d v = -r^3 v / D
        else:
            gs, cv = gz, None

        grads: list[Tensor] = []
        gu: Tensor | None = None
        start = 0
        u_b = u.unsqueeze(-2) if per_token else u  # broadcast over k
        gh_h = split_heads(gh, heads).unsqueeze(2)  # [B, T, 1, H, Dh]
        u_h = split_heads(u_b, heads)
        for seg in segments:
            k = seg.shape[2]
            v = seg.to(cd)
            a_k, gs_k = alpha[:, :, start : start + k], gs[:, :, start : start + k]
            # dv = alpha (x) gh + gs (x) u + cv * v, built in place (one [B, T, k, D] tensor)
            gv = a_k.unsqueeze(-1) * gh_h
            gv.addcmul_(gs_k.unsqueeze(-1), u_h)
            gv = gv.flatten(-2)
            if cv is not None:
                gv.addcmul_(cv[:, :, start : start + k].unsqueeze(-1), v)
            grads.append(gv)
            part = _weighted_sum(v, gs_k, heads)  # [B, T, D] = sum_k gs_k v_k
            gu = part if gu is None else gu + part
            start += k
        assert gu is not None  # segments is never empty

        gq: Tensor | None = None
        gg: Tensor | None = None
        if not per_token:
            gu = gu.sum(dim=(0, 1))
        if ctx.needs_input_grad[0]:
            gq = gu * g if g is not None else gu
            if heads > 1:
                gq = gq.reshape(query.shape)
            gq = gq.to(query.dtype)
        if use_g and ctx.needs_input_grad[1]:
            gg = gu * q
            if per_token:
                gg = gg.sum(dim=(0, 1))
            gg = gg.to(key_weight.dtype)

        producer_grads = []
        for gv in grads:
            for i in range(gv.shape[2]):
                producer_grads.append(gv[:, :, i])
        producer_grads = [
            gp.reshape(shape).to(dtype) for gp, (shape, dtype) in zip(producer_grads, producer_shapes, strict=True)
        ]
        return (gq, gg, None, None, *producer_grads)


def _dot_sources(v: Tensor, u: Tensor, heads: int, per_token: bool) -> Tensor:
    """Per-head dot products of sources v [B, T, k, D] with u: -> [B, T, k, H].

    u is [D] (shared by every token) or [B, T, D] (one vector per token).
    """
    if heads == 1:
        if per_token:
            return torch.matmul(v, u.unsqueeze(-1))  # [B, T, k, 1]
        return torch.matmul(v, u).unsqueeze(-1)
    vh = split_heads(v, heads)
    uh = split_heads(u, heads)
    if per_token:
        return torch.einsum("btkhe,bthe->btkh", vh, uh)
    return torch.einsum("btkhe,he->btkh", vh, uh)


def _weighted_sum(v: Tensor, w: Tensor, heads: int) -> Tensor:
    """sum_k w[b, t, k, h] v[b, t, k, h-channels]: v [B, T, k, D], w [B, T, k, H] -> [B, T, D]."""
    if heads == 1:
        return torch.matmul(w.squeeze(-1).unsqueeze(-2).to(v.dtype), v).squeeze(-2)
    out = torch.einsum("btkh,btkhe->bthe", w.to(v.dtype), split_heads(v, heads))
    return out.flatten(-2)


# ----------------------------------------------------------------------------- dispatch
def _triton_module():
    """The depth-attention kernels (``triton.py``), or None (triton missing, or ATTNRES_TRITON=0)."""
    return triton_kernels("attnres.ops.depth_attention.triton")


def _choose(segments: Sequence[Tensor], query: Tensor, key_weight: Tensor | None, kernel: str, reference: str):
    """The table's choice for these tensors; the Triton kernels' own check sees the real segments."""
    first = segments[0]
    case = backends.Case.like(
        first,
        heads=query_heads(query, first.shape[-1]) if not reference else 1,
        kernel=kernel,
        key_norm=key_weight is not None,
        reference=reference,
        check=lambda fast, cuda: fast.unsupported_reason(segments, query, key_weight, kernel=kernel, require_cuda=cuda),
    )
    return backends.choose("depth_attention", "forward", case)


def _attend(choice, segments, producers, query, key_weight, eps, kernel, normalize_keys) -> Tensor:
    if choice.backend == "triton":
        return choice.kernels.triton_fused_depth_attention(
            segments,
            producers,
            query,
            key_weight,
            eps=eps,
            kernel=kernel,
            normalize_keys=normalize_keys,
        )
    if choice.backend == "reference":  # forced: the producers carry the values and receive the gradients
        sources = torch.stack(list(producers), dim=0)
        return depth_attention_reference(
            sources, query, key_weight, eps=eps, kernel=kernel, normalize_keys=normalize_keys
        ).h
    return apply_function(
        _FusedDepthAttention, query, key_weight, tuple(segments), (eps, kernel, normalize_keys), *producers
    )


def fused_depth_attention(
    segments: Sequence[Tensor],
    producers: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    kernel: str = "softmax",
    normalize_keys: bool = True,
) -> Tensor:
    """Depth attention over sources given as value segments plus their producers.

    ``segments``: tensors [B, T, k_j, D] whose concatenation along dim 2 is the
    K sources (views into a buffer are fine and are never copied).
    ``producers``: the K autograd tensors [B, T, D] those values came from;
    gradients flow to them. Returns h [B, T, D].
    """
    check_kernel(kernel)
    n = sum(seg.shape[2] for seg in segments)
    if n != len(producers):
        raise ValueError(f"segments hold {n} sources but {len(producers)} producers were given")
    choice = _choose(segments, query, key_weight, kernel, "")
    return _attend(choice, segments, producers, query, key_weight, eps, kernel, normalize_keys)


# ----------------------------------------------------------------------------- public


def depth_attention(
    sources: Tensor,
    query: Tensor,
    key_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    kernel: str = "softmax",
    normalize_keys: bool = True,
    return_weights: bool = False,
    return_stats: bool = False,
    impl: str = "fused",
):
    """Attend over depth: sources [K, B, T, D] -> h [B, T, D].

    query: [D] (one pseudo-query), [H, D/H] (multi-head), or per token
    [B, T, D] / [B, T, H, D/H] (input-dependent queries).
    key_weight: the key RMSNorm weight [D]; ignored when ``normalize_keys`` is off.
    kernel: "softmax" or "sigmoid" (unnormalised weights, Table 4).
    return_weights: also return alpha [K, B, T] (or [K, B, T, H]).
    return_stats: also return ``DepthStats(h, lse)`` in the compute dtype, the form in which a
    depth attention over some sources merges with one over others (softmax only; the two-phase
    ``merge``).

    Returns h, or ``DepthAttentionOutput(h, weights, stats)`` when any
    ``return_*`` flag is set.
    """
    check_kernel(kernel)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not supported; use one of {IMPLS}")
    check_sources(sources)
    check_query(query, sources)
    check_vector(key_weight, "key_weight", sources)
    if return_stats and kernel != "softmax":
        raise ValueError("return_stats needs kernel='softmax': sigmoid weights have no normaliser")
    asked = "impl='reference'" if impl == "reference" else ""
    if return_weights or return_stats:
        asked = "return_weights / return_stats: only the reference keeps the weights and statistics"
    segments = (sources.movedim(0, 2),)
    choice = _choose(segments, query, key_weight, kernel, asked)
    if choice.backend == "reference":
        out = depth_attention_reference(
            sources, query, key_weight, eps=eps, kernel=kernel, normalize_keys=normalize_keys
        )
        if not (return_weights or return_stats):
            return out.h
        return DepthAttentionOutput(out.h, out.weights if return_weights else None, out.stats if return_stats else None)
    return _attend(choice, segments, sources.unbind(0), query, key_weight, eps, kernel, normalize_keys)
