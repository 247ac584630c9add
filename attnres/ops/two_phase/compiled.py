"""Two-phase depth attention in the form ``torch.compile`` traces for training: plain autograd over
the sources as separate tensors.

The fused path (``fused.py``) reads the sources in place from a preallocated buffer that the
stream writes row by row, and its custom backwards are traced as written. Under the compiler
both cost what eager mode does not: functionalization turns every row write into a copy of the
buffer, the partitioner keeps one version of the buffer per Phase-1 read for backward, and the
matrix products inside the hand-written backwards cannot fuse with the loops around them. Here
nothing is stacked or written in place, and every step is a pointwise op or a reduction over D:

- the logits of source i are ``r_i * (v_i . u_s)``, one reduction per source (no [B, T, n, D]);
- the outputs are ``sum_i alpha_is v_i``, n multiply-adds, which inductor fuses into one loop.

Autograd then saves the sources themselves, which the stream keeps alive anyway, and the
[B, T, n, S, H] weights; inductor generates the backward. For training the streams wrap this in
``torch.utils.checkpoint`` (``DepthAttentionStream._phase1_over``), so backward recomputes the
outputs from the sources instead of keeping them. Eager mode runs this too (the tests compare it with
``reference.py`` in float64), but allocates an [B, T, S, D] temporary per source: the streams use it only while
compiling.

Merges are elementwise; the compiled streams use ``reference.merge`` and ``reference.merge_partial``.
Compiled prefill runs this form too: without gradients no buffer versions are saved, but the
fused Phase 1's matrix products still made Full's compiled prefill slower than this form
(docs/performance.md, "Compiled decoding and prefill"). A compiled one-token step without
gradients (decoding) keeps the buffered fused path, which decoded faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnres.ops.common import compute_dtype, split_heads
from attnres.ops.depth_attention.reference import check_kernel
from attnres.ops.two_phase.reference import check_queries


def phase1_sources(
    sources: Sequence[Tensor],
    inv_rms: Sequence[Tensor] | None,
    queries: Tensor,
    key_weights: Tensor | None = None,
    *,
    kernel: str = "softmax",
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Phase 1 of S static queries over n completed sources given as n tensors.

    sources: n tensors [B, T, D]; inv_rms: n tensors [B, T] (``inverse_rms(v_i, eps)``, with their
    autograd graphs: the key-norm gradient flows through them) or None (no key norm); queries
    [S, D] or [S, H, D/H]; key_weights [S, D] or None. Returns (S outputs h1_s [B, T, D],
    lse [B, T, S, H]) in the compute dtype, as ``fused.phase1_outputs`` does. With the sigmoid
    kernel h1 is the unnormalised sum and lse is zero.
    """
    check_kernel(kernel)
    if not sources:
        raise ValueError("phase1_sources needs at least one source")
    if inv_rms is not None and len(inv_rms) != len(sources):
        raise ValueError(f"{len(inv_rms)} inverse RMS tensors for {len(sources)} sources")
    d = sources[0].shape[-1]
    heads = check_queries(queries, key_weights, d)
    cd = compute_dtype(sources[0].dtype)
    s_count = queries.shape[0]
    u = queries.to(cd).reshape(s_count, d)
    if key_weights is not None:
        u = u * key_weights.to(cd)
    u = split_heads(u, heads)  # [S, H, e]
    values = [split_heads(v.to(cd), heads).unsqueeze(2) for v in sources]  # n x [B, T, 1, H, e]

    logits = []
    for i, v in enumerate(values):
        z = (v * u).sum(-1)  # [B, T, S, H]: a reduction over e, fusible (no matrix product)
        if inv_rms is not None:
            z = z * inv_rms[i].to(cd)[:, :, None, None]
        logits.append(z)
    z = torch.stack(logits, dim=2)  # [B, T, n, S, H]: weights only, nothing of size D
    if kernel == "softmax":
        lse = torch.logsumexp(z, dim=2)
        alpha = torch.exp(z - lse.unsqueeze(2))
    else:
        lse = z.new_zeros(z.shape[:2] + z.shape[3:])
        alpha = torch.sigmoid(z)

    h: Tensor | None = None
    for i, v in enumerate(values):
        term = alpha[:, :, i].unsqueeze(-1) * v  # [B, T, S, H, e]
        h = term if h is None else h + term
    assert h is not None  # sources is not empty (checked above)
    h = h.flatten(-2)  # [B, T, S, D]
    return tuple(h.unbind(2)), lse
