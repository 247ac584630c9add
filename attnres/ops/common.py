"""What every depth-attention op shares: the statistics format, precision, heads and autograd plumbing.

``DepthStats`` is the one format in which a depth attention over a *subset* of the sources is
handed on to be merged with another (docs/method.md §6): the normalised output and the
log-sum-exp of the logits. It is what ``depth_attention(..., return_stats=True)``, every
``phase1`` and every ``merge`` return. Compared with the unnormalised (o, m, l) of flash
attention it carries the same information (h = o / l, lse = m + log l) and merges without
rescaling o: the second set's share of the union is ``sigmoid(lse_b - lse_a)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from types import ModuleType
from typing import NamedTuple, overload

import torch
from torch import Tensor


class DepthStats(NamedTuple):
    """A depth attention over some of the sources, in the form that merges exactly.

    ``h``: the output ``sum_i alpha_i v_i`` over those sources ([..., D]); ``lse``: the
    log-sum-exp of their logits ([..., H], H = 1 for a single-head query), both in the compute
    dtype (float32, float64 for float64 sources). For the sigmoid kernel h is the unnormalised
    sum, lse is zero and merging adds.
    """

    h: Tensor
    lse: Tensor


class RMSNormArgs(NamedTuple):
    """The RMSNorm a sublayer applies to what it reads (``torch.nn.RMSNorm``'s weight and eps), handed to
    Phase 2 (``merge_partial(..., norm=...)``), which may compute the merge and the norm in one pass.

    ``eps`` None: ``torch.finfo(dtype).eps`` of the input, as ``nn.RMSNorm`` does."""

    weight: Tensor | None
    eps: float | None

    def __call__(self, h: Tensor) -> Tensor:
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), self.weight, self.eps)

    def eps_for(self, dtype: torch.dtype) -> float:
        return self.eps if self.eps is not None else torch.finfo(dtype).eps


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits, statistics and weights: float32 for float32/bfloat16/float16, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[..., D] -> [..., H, D/H]."""
    return x.unflatten(-1, (heads, x.shape[-1] // heads))


def inverse_rms(v: Tensor, eps: float) -> Tensor:
    """r = rsqrt(mean(v^2) + eps) over the last dim, in the compute dtype (the key RMSNorm's scale)."""
    cd = compute_dtype(v.dtype)
    ms = torch.linalg.vector_norm(v, dim=-1, dtype=cd).pow(2) / v.shape[-1]
    return torch.rsqrt(ms + eps)


def autocast_disabled(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)``: the ops choose their precision themselves (float32
    statistics), not an enclosing autocast. A no-op where autocast does not exist, as on the meta device,
    where shape inference runs the ops' forwards and ``torch.autocast("meta")`` raises."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_off(backward):
    """A Function's backward run with autocast off, as its forward is: compiled training traces the
    backward together with the forward, inside the caller's autocast, which would otherwise
    recast the backward's products (bf16 mixed with our float32 statistics fails)."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        device = next(g.device.type for g in grads if g is not None)
        with autocast_disabled(device):
            return backward(ctx, *grads)

    return run


class _Unrecorded:
    """The autograd context a Function's forward gets when nothing is recorded for backward."""

    def save_for_backward(self, *tensors) -> None:
        pass


def apply_function(function, *args):
    """``function.apply(*args)``, or with grad mode off its forward called directly: nothing is
    recorded then anyway, and dynamo (torch 2.13) mis-passes the arguments when it inlines some
    Functions' forward under no_grad (a compiled decoding step failed with unpacking errors)."""
    if torch.is_grad_enabled():
        return function.apply(*args)
    return function.forward(_Unrecorded(), *args)


_TRITON_KERNELS: dict[str, ModuleType | None] = {}  # module name -> module, None when unavailable


def triton_kernels(module_name: str) -> ModuleType | None:
    """A module of Triton kernels, imported on first use; None when triton is missing or
    ``ATTNRES_TRITON=0`` (read on every call, so it can be switched at run time). The fast paths
    call this only for CUDA tensors, so nothing imports triton on a CPU-only machine."""
    if os.environ.get("ATTNRES_TRITON", "1") == "0":
        return None
    if module_name not in _TRITON_KERNELS:
        try:
            _TRITON_KERNELS[module_name] = importlib.import_module(module_name)
        except ImportError:
            _TRITON_KERNELS[module_name] = None
    return _TRITON_KERNELS[module_name]


# channels per token that one Triton program holds, padded to powers of two: the depth-attention kernels,
# Phase 1 and the merge (here, not with the kernels, so that the backend table reads them without importing triton)
MAX_PADDED_WIDTH = 8192
# Phase 1's backward kernel holds a token's output gradient for all S queries, padded likewise
MAX_BACKWARD_WIDTH = 16384


@overload
def flat_rows(x: Tensor, cd: torch.dtype, d: int | None = None) -> Tensor: ...
@overload
def flat_rows(x: None, cd: torch.dtype, d: int | None = None) -> None: ...
@overload
def flat_rows(x: Tensor | None, cd: torch.dtype, d: int | None = None) -> Tensor | None: ...
def flat_rows(x: Tensor | None, cd: torch.dtype, d: int | None = None) -> Tensor | None:
    """x as a contiguous ``cd`` tensor [N, d] (or flat without ``d``), a view where it already is one; None
    stays None. The kernels' operands (the C++ and the Triton merge + norm)."""
    if x is None:
        return None
    x = x.detach().to(cd)
    return (x.reshape(-1, d) if d is not None else x.reshape(-1)).contiguous()


def token_rows(x: Tensor, cd: torch.dtype) -> tuple[Tensor, int]:
    """x [B, T, D] in ``cd`` and the stride between its tokens' rows: read in place when B and T flatten
    with one stride and D is contiguous (a query's slice of Phase 1's [B, T, S, D] output), else copied."""
    x = x.detach().to(cd)
    b, t, _ = x.shape
    if x.stride(2) != 1 or (b > 1 and t > 1 and x.stride(0) != t * x.stride(1)):
        x = x.contiguous()
    return x, (x.stride(1) if t > 1 else x.stride(0))


def rows_of(x: Tensor, cd: torch.dtype) -> tuple[Tensor, int]:
    """``token_rows`` for x of any rank [..., D]: the leading dimensions as tokens (h1 of a merge, read in
    place where its rows are evenly spaced)."""
    if x.dim() == 3:
        return token_rows(x, cd)
    return token_rows(x.reshape(1, -1, x.shape[-1]) if x.dim() < 3 else x.flatten(0, -3), cd)
