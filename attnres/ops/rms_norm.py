"""The pre-norm a sublayer applies to what it reads, as every residual stream computes it.

``rms_norm(h, norm)`` is ``torch.nn.functional.rms_norm`` over the last dimension (the reference), and on CPU
float32/float64 tensors in eager mode one C++ kernel call each way (``two_phase/cpu.py``): torch's eager
RMSNorm runs about six passes forward and more backward, which at small widths cost as much as a sublayer's
depth attention. It exists so that timings compare like with like: AttnRes' Phase 2 fuses the norm into
its merge (``two_phase.fused.merge_partial(..., norm=...)``), and every other read (PreNorm's running sum
included) runs this kernel, with the same arithmetic. ``attnres.ops.backends`` chooses (op ``rms_norm``).

``plain_rms_norm(module)`` says whether a module is one a stream may compute this way: exactly
``torch.nn.RMSNorm`` over the last dimension, with no hooks (the kernel does not call the module).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnres.ops import backends
from attnres.ops.common import RMSNormArgs, apply_function, autocast_off


class _RMSNormKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, eps):
        from attnres.ops.two_phase import cpu

        out, rho = cpu.rms_norm(h, weight, eps)
        ctx.save_for_backward(h, weight, rho)
        ctx.eps = eps
        return out.to(h.dtype)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        from attnres.ops.two_phase import cpu

        h, weight, rho = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of the gradient (create_graph): torch's form gives one
            with torch.enable_grad():
                out = RMSNormArgs(weight, ctx.eps)(h)
            wanted = [h] + ([weight] if weight is not None and ctx.needs_input_grad[1] else [])
            grads = torch.autograd.grad(out, wanted, grad, create_graph=True)
            return grads[0], (grads[1] if len(grads) > 1 else None), None
        gh, dw = cpu.rms_norm_backward(h, weight, rho, grad)
        return gh.to(h.dtype), (dw.to(weight.dtype) if dw is not None else None), None


def rms_norm(h: Tensor, norm: RMSNormArgs) -> Tensor:
    """RMSNorm(h) * weight over the last dimension, in h's dtype (``norm``: weight and eps)."""
    case = backends.Case.like(h, norm.weight, values=h.numel())
    if backends.choose("rms_norm", "forward", case).backend == "cpu_kernel" and not torch.is_autocast_enabled(
        h.device.type
    ):
        return apply_function(_RMSNormKernel, h, norm.weight, norm.eps_for(h.dtype))
    return norm(h)


def plain_rms_norm(module: nn.Module) -> RMSNormArgs | None:
    """The weight and eps of ``module`` when a stream may compute it itself (exactly ``nn.RMSNorm`` over
    the last dimension, no hooks of its own or global ones), else None: the stream calls the module."""
    if type(module) is not nn.RMSNorm or len(module.normalized_shape) != 1:
        return None
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        nn.modules.module._global_forward_hooks,
        nn.modules.module._global_forward_pre_hooks,
    )
    if any(hooks):
        return None
    return RMSNormArgs(module.weight, module.eps)
