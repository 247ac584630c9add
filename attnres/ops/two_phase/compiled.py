"""Two-phase depth attention in the form ``torch.compile`` traces for training and prefill: Phase 1
over the sources as separate tensors, no buffer.

The fused path (``fused.py``) reads the sources in place from a preallocated buffer that the
stream writes row by row, and its custom backwards are traced as written. Under the compiler
both cost what eager mode does not: functionalization turns every row write into a copy of the
buffer, the partitioner keeps one version of the buffer per Phase-1 read for backward, and the
matrix products inside the hand-written backwards cannot fuse with the loops around them. Here
the sources arrive as a list, and ``phase1_sources`` runs one of two forms:

- on the CPU and for small ones elsewhere (``pointwise_phase1``: at most ``backends.POINTWISE_PAIRS``
  source-query pairs, as Full AttnRes' in-group reads are) as plain autograd over pointwise ops and
  reductions over D
  (``phase1_pointwise``): the logits of source i are ``r_i * (v_i . u_s)``, the outputs
  ``sum_i alpha_is v_i``, which inductor fuses into its loops and differentiates itself;
- the others (on CUDA) as the custom op ``attnres::phase1`` (``library.py``): one opaque call forward
  (the Triton Phase-1 kernel) and one hand-written backward, saving only the sources (kept alive
  anyway), their inverse RMS and lse. Measured on the CPU it lost to the pointwise form
  (``backends.CUSTOM_OP_DEVICES``); it has not been timed on a GPU.

For training the streams wrap either in ``torch.utils.checkpoint``, so backward recomputes Phase 1's
outputs from the sources: the merges that read them would otherwise keep them for backward
(S d-vectors per token per group beyond what prenorm keeps).

Eager mode runs both too (the tests compare them with ``reference.py`` in float64); the streams use
them only while compiling. Merges are elementwise; the compiled streams use ``reference.merge`` and
``reference.merge_partial``. A compiled one-token step without gradients (decoding) keeps the
buffered fused path, which decoded faster (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnres.ops import backends
from attnres.ops.common import compute_dtype, split_heads
from attnres.ops.depth_attention.reference import check_kernel
from attnres.ops.two_phase import library
from attnres.ops.two_phase.reference import check_queries, query_matrix


def pointwise_phase1(n_sources: int, n_queries: int, device: torch.device | str = "cpu") -> bool:
    """Whether ``phase1_sources`` runs this Phase 1 as pointwise autograd rather than as the custom op
    (``attnres.ops.backends``, op ``phase1_sources``, whose POINTWISE_PAIRS and CUSTOM_OP_DEVICES decide)."""
    case = backends.Case(device=torch.device(device).type, queries=n_queries, sources=n_sources)
    return backends.choose("phase1_sources", "forward", case).backend == "pointwise"


def phase1_sources(
    sources: Sequence[Tensor],
    inv_rms: Sequence[Tensor] | None,
    queries: Tensor,
    key_weights: Tensor | None = None,
    *,
    kernel: str = "softmax",
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Phase 1 of S static queries over n completed sources given as n tensors.

    sources: n tensors [B, T, D]; inv_rms: n tensors [B, T] (``inverse_rms(v_i, eps)``) or None (no key
    norm); queries [S, D] or [S, H, D/H]; key_weights [S, D] or None. Returns (S outputs h1_s [B, T, D],
    lse [B, T, S, H]) in the compute dtype, as ``fused.phase1_outputs`` does. With the sigmoid kernel h1
    is the unnormalised sum and lse is zero. Small ones (``pointwise_phase1``) run ``phase1_pointwise``,
    the others the custom op ``attnres::phase1`` (``library.py``), which takes the key-norm gradient
    through the sources (inv_rms must be their inverse RMS; its own graph is not used).
    """
    _check(sources, inv_rms, queries, key_weights, kernel)
    if pointwise_phase1(len(sources), queries.shape[0], sources[0].device):
        return phase1_pointwise(sources, inv_rms, queries, key_weights, kernel=kernel)
    h, lse = library.phase1_op(list(sources), list(inv_rms or ()), queries, key_weights, kernel)
    return tuple(h.unbind(2)), lse


def _check(sources, inv_rms, queries, key_weights, kernel) -> int:
    """The number of heads, after checking the arguments of ``phase1_sources``."""
    check_kernel(kernel)
    if not sources:
        raise ValueError("phase1_sources needs at least one source")
    if inv_rms is not None and len(inv_rms) != len(sources):
        raise ValueError(f"{len(inv_rms)} inverse RMS tensors for {len(sources)} sources")
    return check_queries(queries, key_weights, sources[0].shape[-1])


def phase1_pointwise(
    sources: Sequence[Tensor],
    inv_rms: Sequence[Tensor] | None,
    queries: Tensor,
    key_weights: Tensor | None = None,
    *,
    kernel: str = "softmax",
) -> tuple[tuple[Tensor, ...], Tensor]:
    """``phase1_sources`` as plain autograd over pointwise ops and reductions over D: inductor fuses it
    and writes its backward. Here the key-norm gradient flows through inv_rms's own autograd graphs."""
    heads = _check(sources, inv_rms, queries, key_weights, kernel)
    cd = compute_dtype(sources[0].dtype)
    u = split_heads(query_matrix(queries, key_weights, cd), heads)  # [S, H, e]
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
